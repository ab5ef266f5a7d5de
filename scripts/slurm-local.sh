#!/usr/bin/env bash
# A real single-node Slurm on loopback, for the slurm tests and CI (see ../shared/notes/slurm-local.md).
# `start` installs Debian's slurmctld, slurmd, slurm-client and munge when they are missing (postinst
# starts nothing), then starts munged, slurmctld and slurmd as root without systemd, each with its own
# key, socket, state and logs under a fresh temp dir, and prints the environment to export.
# `stop [DIR]` (default: the dir of $SLURM_CONF) drains the queue, shuts the controller down and ends the recorded pids only.
# Usage:  eval "$(scripts/slurm-local.sh start)"  ...  scripts/slurm-local.sh stop
# Env: QUALIFY_SLURM_PORT (controller port, default 6817; slurmd uses the next one),
#      QUALIFY_SLURM_KEEP=1 (stop keeps the temp dir and its logs).
set -euo pipefail

log() { echo "slurm-local: $*" >&2; }
# die MESSAGE: a failed start ends the daemons it launched (their logs stay in the temp dir).
die() {
  log "error: $*"
  if [ -n "${dir:-}" ] && [ -d "$dir/pids" ]; then
    for name in slurmd slurmctld munged; do stop_pid "$name"; done
  fi
  exit 2
}
dir=""

# wait_for SECONDS COMMAND...: retry COMMAND every 0.2 s until it succeeds or the deadline passes.
wait_for() {
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
      && command -v munged >/dev/null && command -v mungekey >/dev/null; then
    return
  fi
  [ "$(id -u)" = 0 ] || die "installing Slurm needs root"
  log "installing slurmctld slurmd slurm-client munge"
  local policy=/usr/sbin/policy-rc.d saved=""
  if [ -e "$policy" ]; then saved=$(mktemp); cp -p "$policy" "$saved"; fi
  # exit 101 = "action forbidden": the packages' postinst scripts start no daemon.
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  local rc=0
  {
    DEBIAN_FRONTEND=noninteractive apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge
  } >&2 || rc=$?
  if [ -n "$saved" ]; then mv "$saved" "$policy"; else rm -f "$policy"; fi
  [ "$rc" = 0 ] || die "apt-get failed (exit $rc)"
}

# launch NAME COMMAND...: start a foreground daemon detached from this shell and record its pid.
# The daemons delete their own pid files early on shutdown, so the pid recorded here is what stop uses.
launch() {
  local name=$1; shift
  setsid "$@" >"$dir/log/$name.out" 2>&1 </dev/null &
  echo $! >"$dir/pids/$name"
}

# free_port: QUALIFY_SLURM_PORT, or the first even port from 6817 on where neither it nor the next one
# is listening, so a second cluster on the same machine does not collide with the first.
free_port() {
  local port=${QUALIFY_SLURM_PORT:-6817}
  if [ -z "${QUALIFY_SLURM_PORT:-}" ] && command -v ss >/dev/null; then
    while [ -n "$(ss -Hltn "( sport = :$port or sport = :$((port + 1)) )")" ]; do port=$((port + 2)); done
  fi
  echo "$port"
}

write_conf() {
  local port node
  port=$(free_port)
  # slurmd -C prints this machine's topology: "NodeName=<host> CPUs=.. Boards=.. ... RealMemory=..".
  node=$(slurmd -C | head -n 1)
  nodename=$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$node")
  cat >"$dir/slurm.conf" <<EOF
ClusterName=qualify
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MinJobAge=600
SchedulerParameters=sched_interval=1
DependencyParameters=kill_invalid_depend
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  if [ -n "${SLURM_CONF:-}" ] && [ -f "$SLURM_CONF" ] && sinfo -h >/dev/null 2>&1; then
    log "already running ($SLURM_CONF)"
    echo "export SLURM_CONF=$SLURM_CONF"
    return
  fi
  install_packages
  [ "$(id -u)" = 0 ] || die "starting the local cluster needs root"
  dir=$(mktemp -d /tmp/qualify-slurm.XXXXXX)
  chmod 755 "$dir"
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/run" "$dir/log" "$dir/pids"
  chown munge:munge "$dir/munge"
  chmod 755 "$dir/munge"
  mungekey --create --keyfile="$dir/munge/munge.key"
  chown munge:munge "$dir/munge/munge.key"
  chmod 400 "$dir/munge/munge.key"

  local sock=$dir/munge/munge.socket
  launch munged setpriv --reuid=munge --regid=munge --init-groups \
    munged --foreground --key-file="$dir/munge/munge.key" --socket="$sock" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
  wait_for 20 bash -c "munge -n -S '$sock' | unmunge -S '$sock'" || die "munged did not answer; see $dir/munge/munged.log"

  write_conf
  export SLURM_CONF=$dir/slurm.conf
  launch slurmctld slurmctld -D -c -f "$SLURM_CONF"
  wait_for 30 scontrol ping || die "slurmctld did not answer; see $dir/log/slurmctld.log"
  launch slurmd slurmd -D -f "$SLURM_CONF" -N "$nodename"
  wait_for 30 bash -c '[ "$(sinfo -h -o %T)" = idle ]' || die "node not idle; see $dir/log/slurmd.log"
  log "running: $(sinfo -h -o '%P %D %c cpus %T') (state $dir)"
  echo "export SLURM_CONF=$SLURM_CONF"
  echo "export QUALIFY_SLURM_DIR=$dir"  # set only when this call started the cluster: its owner stops it
}

# stop_pid NAME: TERM the recorded pid, KILL it after a deadline.
stop_pid() {
  local file=$dir/pids/$1 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    wait_for 20 bash -c "! kill -0 $pid" || { log "$1 ($pid) ignored TERM; KILL"; kill -KILL "$pid" 2>/dev/null || true; }
  fi
  rm -f "$file"
}

stop() {
  if [ -n "${1:-}" ]; then dir=$1
  elif [ -n "${SLURM_CONF:-}" ]; then dir=$(dirname "$SLURM_CONF")
  else die "usage: $0 stop DIR (or export SLURM_CONF)"
  fi
  [ -d "$dir/pids" ] || die "$dir is not a cluster started by $0"
  export SLURM_CONF=$dir/slurm.conf
  if scontrol ping >/dev/null 2>&1; then
    local ids
    ids=$(squeue -h -o %A 2>/dev/null || true)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086  # one argument per job id
      scancel $ids || true
      wait_for 30 bash -c '[ -z "$(squeue -h -o %A)" ]' || log "queue did not drain"
    fi
    scontrol shutdown >/dev/null 2>&1 || true
  fi
  stop_pid slurmd
  stop_pid slurmctld
  stop_pid munged
  if [ "${QUALIFY_SLURM_KEEP:-0}" = 1 ]; then log "stopped; kept $dir"; else rm -rf "$dir"; log "stopped"; fi
}

case "${1:-}" in
  start) start ;;
  stop) shift; stop "$@" ;;
  *) die "usage: $0 start | stop [DIR]" ;;
esac
