#!/usr/bin/env bash
# A real single-node Slurm with GPU gres on a GPU machine without Slurm or package access (the lent
# two-H200 machine; ../shared/notes/slurm-gpu.md), as scripts/slurm-local.sh does on CPU.
# `start DEBS_DIR` extracts Debian 12's Slurm 22.05 .deb files (fetched elsewhere, see below) to /opt/slurm,
# starts munged, slurmctld and slurmd as root under /tmp/gslurm with gres gpu:<type>:<count> from nvidia-smi,
# writes a `qualify` executable (python3 -m-style entry point of this checkout) to /usr/local/bin, and prints
# the environment to export. `stop` ends the daemons by their recorded pids.
# Fetch the .deb files on a Debian 12 machine:
#   apt-get download slurmctld slurmd slurm-client slurm-wlm-basic-plugins libslurm38 munge libmunge2 \
#     libdbus-1-3 libjson-c5 liblua5.1-0 libyaml-0-2 libnuma1 libreadline8 libhwloc15
# Usage:  eval "$(scripts/slurm-gpu.sh start .gpu/slurm-debs)"  ...  scripts/slurm-gpu.sh stop
set -euo pipefail
P=/opt/slurm
d=/tmp/gslurm
log() { echo "slurm-gpu: $*" >&2; }

stop() {
  for name in slurmd slurmctld munged; do
    [ -f "$d/pids/$name" ] && kill "$(cat "$d/pids/$name")" 2>/dev/null || true
  done
  sleep 1
}

launch() {  # launch NAME COMMAND...: a foreground daemon in its own session, pid recorded
  local name=$1; shift
  setsid "$@" >"$d/log/$name.out" 2>&1 </dev/null &
  echo $! >"$d/pids/$name"
}

start() {
  local debs=${1:?usage: slurm-gpu.sh start DEBS_DIR}
  [ "$(id -u)" = 0 ] || { log "needs root"; exit 2; }
  mkdir -p $P
  for f in "$debs"/*.deb; do dpkg -x "$f" $P; done  # never into /: the image's own libraries stay as they are
  printf "%s\n" $P/usr/lib/x86_64-linux-gnu $P/lib/x86_64-linux-gnu $P/usr/lib/x86_64-linux-gnu/slurm-wlm \
    > /etc/ld.so.conf.d/zz-slurm.conf
  ldconfig
  # Debian names the daemons *-wlm; slurmd execs /usr/sbin/slurmstepd
  for b in slurmd slurmctld slurmstepd; do ln -sf $P/usr/sbin/$b-wlm /usr/sbin/$b; done
  export PATH=$P/usr/bin:$P/usr/sbin:$PATH
  local plug num type node
  plug=$(dirname "$(find $P -name gres_gpu.so | head -n 1)")
  num=$(nvidia-smi -L | wc -l)
  type=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | awk '{print tolower($NF)}')
  stop
  rm -rf $d
  mkdir -p $d/munge $d/state $d/spool $d/pids $d/log
  $P/usr/sbin/mungekey --create --keyfile=$d/munge/munge.key >&2
  chmod 400 $d/munge/munge.key
  launch munged $P/usr/sbin/munged --force --foreground --key-file=$d/munge/munge.key \
    --socket=$d/munge/munge.socket --pid-file=$d/munge/munged.pid --log-file=$d/munge/munged.log \
    --seed-file=$d/munge/munged.seed
  sleep 1
  node=$(/usr/sbin/slurmd -C | head -n 1)
  cat > $d/slurm.conf <<CONF
ClusterName=qualifygpu
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge/munge.socket
PluginDir=$plug
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=1
$node Gres=gpu:$type:$num NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  echo "Name=gpu Type=$type File=/dev/nvidia[0-$((num - 1))]" > $d/gres.conf
  # slurmd sets up cgroup v2 whatever the task plugin; this container has no systemd and no system.slice
  printf "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\nIgnoreSystemdOnFailure=yes\nConstrainDevices=no\n%s\n%s\n" \
    "ConstrainCores=no" "ConstrainRAMSpace=no" > $d/cgroup.conf
  mkdir -p /sys/fs/cgroup/system.slice
  echo "+cpu +cpuset +memory" > /sys/fs/cgroup/cgroup.subtree_control || true
  export SLURM_CONF=$d/slurm.conf
  launch slurmctld /usr/sbin/slurmctld -D -c -f $SLURM_CONF
  sleep 2
  launch slurmd /usr/sbin/slurmd -D -f $SLURM_CONF
  local i
  for i in $(seq 1 30); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 1; done
  sinfo -h -o "%N %T %G %c %m" >&2
  local repo
  repo=$(cd "$(dirname "$0")/.." && pwd)
  cat > /usr/local/bin/qualify <<EOF
#!/bin/sh
exec python3 -c 'import sys; from qualify.cli.app import main; sys.argv[0] = "qualify"; main()' "\$@"
EOF
  chmod 755 /usr/local/bin/qualify
  log "gres gpu:$type:$num, repo $repo"
  echo "export SLURM_CONF=$SLURM_CONF PATH=$P/usr/bin:$P/usr/sbin:\$PATH"
}

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop ;;
  *) echo "usage: slurm-gpu.sh start DEBS_DIR | stop" >&2; exit 2 ;;
esac
