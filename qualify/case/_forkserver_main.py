"""The fork server's process (qualify.case.forkserver): run as a script, never imported as part of qualify.

argv[1]: a JSON list of modules to import first. Then one JSON request per line on stdin, one JSON reply per line on
the original stdout (its own prints go to stderr):
  {"op": "spawn", "module", "args", "env", "cwd", "log"} -> {"pid"}: fork a rank that runs `python -m module args`
  {"op": "poll", "pid"} -> {"code"}: its exit code (negative: the signal that ended it), null while it runs
End of input: the live ranks are terminated and the server exits.
"""

import importlib
import json
import os
import signal
import sys
import time

PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # anything an import prints goes to the server's log, not into the protocol
sys.path[0] = os.getcwd()  # not this script's directory (qualify/case/), whose module names are qualify's own


def preload(modules):
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        done.append(name)
    return done


def run_rank(req):
    """In the forked child: become `python -m module args` in req's directory and environment; never returns."""
    code = 1
    try:
        PROTOCOL.close()
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
        import random

        random.seed()  # a fresh interpreter seeds from the OS, not from the server's state
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))  # what a fresh torch reads from the environment
        sys.argv = [req["module"], *req["args"]]
        import runpy

        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001  (a rank's failure is its exit code and traceback, as in python -m)
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001  (the child must never return into the server's loop)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


def main():
    children = {}
    reaped = {}
    PROTOCOL.write(json.dumps({"ready": True, "pid": os.getpid(), "preloaded": preload(json.loads(sys.argv[1]))})
                   + "\n")
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        try:
            req = json.loads(line)
            if req["op"] == "spawn":
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    run_rank(req)
                children[pid] = req
                reply = {"pid": pid}
            elif req["op"] == "poll":
                pid = int(req["pid"])
                if pid in reaped:
                    reply = {"code": reaped[pid]}
                elif pid not in children:
                    reply = {"error": f"pid {pid} is not a rank of this server"}
                else:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done == 0:
                        reply = {"code": None}
                    else:
                        reaped[pid] = os.waitstatus_to_exitcode(status)
                        del children[pid]
                        reply = {"code": reaped[pid]}
            else:
                reply = {"error": f"unknown op {req.get('op')!r}"}
        except Exception as exc:  # noqa: BLE001  (a bad request is answered, not fatal)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        PROTOCOL.write(json.dumps(reply) + "\n")
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 20
    for pid in list(children):
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.05)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


if __name__ == "__main__":
    main()
