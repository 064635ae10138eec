"""What torchrun starts for each worker of a warm launch (:mod:`distlab.launch.prefork`): a small process, the
standard library only, that stands for the worker.

It hands the prefork server its standard streams (the descriptors themselves), arguments, environment and working
directory; the server forks the worker and says its pid. From then on every signal torchrun's agent sends here
goes on to the worker's process group (as torchrun signals its workers' groups), and this process exits as the
worker did -- with its exit code, or killed by the same signal -- so the agent sees what it would have seen of a
worker it started itself; it dies with the agent. Run as ``python -I -u prefork_client.py ARGS`` with the
server's socket in ``DISTLAB_PREFORK_SOCKET``.
"""

import ctypes
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    path = os.environ.get("DISTLAB_PREFORK_SOCKET", "")
    pid = None
    pending = []

    def forward(sig, frame):
        if pid is None:
            pending.append(sig)
            return
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    # Dies with torchrun's agent (SIGKILL on its death): its connection closes and the server kills the worker's
    # group -- a server shared by several launches outlives each of them.
    agent = os.environ.get("DISTLAB_LAUNCHER_PID", str(os.getppid()))  # (torchrun's agent runs in the launcher)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if str(os.getppid()) != agent:  # it died before the call
        os._exit(1)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        payload = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "ppid": os.getppid()}).encode()
        socket.send_fds(sock, [struct.pack("!Q", len(payload))], [0, 1, 2])
        sock.sendall(payload)
        replies = sock.makefile("r")
        started = replies.readline()
    except OSError as exc:
        print(f"distlab: error: cannot reach the worker start-up server at {path!r} ({exc}); its launcher has "
              f"ended, or set DISTLAB_WORKER_START=exec to start workers as fresh interpreters", file=sys.stderr,
              flush=True)
        os._exit(1)
    if not started:
        print("distlab: error: the worker start-up server closed before starting this worker (see its message "
              "above)", file=sys.stderr, flush=True)
        os._exit(1)
    pid = json.loads(started)["pid"]
    for sig in pending:
        forward(sig, None)
    ended = replies.readline()
    if not ended:  # the server died (with its launcher): so did the worker (its parent-death signal)
        os._exit(1)
    code = json.loads(ended)["exit"]
    if code < 0:  # killed by a signal: end the same way
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)
    os._exit(code)


if __name__ == "__main__":
    main()
