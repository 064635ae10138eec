"""A launch's workers started warm: forked from a server that imported torch and distlab once.

Each worker of ``distlab CMD --nproc-per-node N`` used to be a new interpreter importing torch (2-3 s of CPU)
before it did anything: N workers on a few cores paid N times that, and every restart of the group paid it
again. Now the launcher starts one *prefork server* (``python -m distlab.launch.prefork``), which imports torch
and distlab and waits. torchrun still starts, watches and signals one process per worker, but that process is
a small client (:mod:`distlab.launch.prefork_client`, the standard library only) that hands the server its
standard streams, arguments, environment and working directory; the server forks the worker from its warm
image, and the client stands for it (signals passed on, the worker's exit its own), so torchrun's agent sees
what it saw of a worker it started itself.

A worker is a clean process: the server imports modules and runs nothing, so no thread, device or process
group exists before the fork. The worker takes the client's environment, directory, arguments, ``sys.path``
(``PYTHONPATH`` as the client has it) and streams, a session of its own (as torchrun gives its workers), and
runs what ``python -m distlab`` runs. It dies with its client (the server kills its process group when the
client's connection closes; the client dies with torchrun's agent) and with the server (its parent-death
signal); the server ends with the process that started it. A launch started by a process that has a server --
a command that runs launches as subprocesses opens :func:`shared` -- forks its workers from that one when its
workers would inherit the same from it as from a server of their own (:func:`_key`).
``DISTLAB_WORKER_START=exec`` starts fresh interpreters instead, torchrun's own way.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from distlab.errors import ConfigError
from distlab.runtime.launch import adopt_parent

SOCKET_ENV = "DISTLAB_PREFORK_SOCKET"
MODE_ENV = "DISTLAB_WORKER_START"  # prefork (the default on Linux) or exec
# Imported by name: this module sits below the commands. distlab.cli first: it sets torch's C++ log level
# before torch is imported. torch._dynamo (with sympy): torch imports it on the first use of a device context,
# which builds every model -- 1.8 s of CPU per worker otherwise. Importing it starts no thread.
PRELOAD = ("distlab.cli", "torch", "torch.distributed", "torch._dynamo", "distlab.train", "distlab.parallel",
           "distlab.launch.frozen")  # last: the heap all of them made, frozen out of the collector
KEY_ENV = "DISTLAB_PREFORK_KEY"  # the server's key (:func:`_key`), beside its socket, for launches started here
# What an interpreter's start and the imports read from the environment (with every PYTHON* variable): a launch
# whose values differ gets a server of its own. (OMP_NUM_THREADS is not one: a worker applies its own at the fork.)
IMPORT_ENV = {"TORCH_CPP_LOG_LEVEL": "FATAL", "MKL_NUM_THREADS": None}  # (the default where an import sets one:
# distlab.cli's, before torch's)
CLIENT = Path(__file__).with_name("prefork_client.py")


def enabled() -> bool:
    mode = os.environ.get(MODE_ENV, "prefork")
    if mode not in ("prefork", "exec"):
        raise ConfigError(f"{MODE_ENV}={mode!r}: use prefork (workers forked from a warm server) or exec (fresh "
                          f"interpreters)")
    return mode == "prefork" and sys.platform.startswith("linux")


def worker_command(argv: list[str]) -> list[str]:
    """The command torchrun runs for each worker (with ``--no-python``): the client, isolated from
    ``PYTHON*`` settings and the script's directory, unbuffered as torchrun's workers are."""
    return [sys.executable, "-I", "-u", str(CLIENT), *argv]


class _Server:
    def __init__(self, key: tuple):
        self.key = key
        self.dir = tempfile.mkdtemp(prefix="distlab-prefork-")
        self.path = os.path.join(self.dir, "socket")
        # Listening before the server has imported anything: workers' clients that come early wait in the backlog
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(128)
        alive_r, self.alive_w = os.pipe()  # the server ends when this process's end closes (it exits, even killed)
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "distlab.launch.prefork", str(listener.fileno()),
                                      str(alive_r), self.path], stdin=subprocess.DEVNULL,
                                     pass_fds=(listener.fileno(), alive_r),
                                     env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
        os.close(alive_r)
        listener.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        try:
            os.close(self.alive_w)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _remove(self.path)


def _remove(path: str) -> None:
    """The socket and its directory (the server's, when its launcher was killed and could not)."""
    for remove, name in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            remove(name)
        except OSError:
            pass


_SERVER: _Server | None = None
_STOP_AT_EXIT: list[bool] = []


def _key() -> str:
    """What a worker takes from the server that forks it rather than from its own launch: the interpreter, the
    environment its imports read, and the process's standing -- namespaces (an emulated node's network), cgroup,
    CPU affinity, limits, umask, priority, user. Launches whose keys differ need different servers."""
    import resource
    facts: list = [sys.executable, *(os.environ.get(k, default) for k, default in IMPORT_ENV.items()),
                   *sorted((k, v) for k, v in os.environ.items() if k.startswith("PYTHON"))]
    for name in ("net", "mnt", "pid", "uts", "ipc", "user", "cgroup"):
        try:
            facts.append(os.readlink(f"/proc/self/ns/{name}"))
        except OSError:
            facts.append(None)
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        facts += [Path("/proc/self/cgroup").read_text(), [line for line in status if line.startswith("Umask:")]]
    except OSError:
        facts.append(None)
    facts += [sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0), os.getuid(), os.getgid(),
              sorted(os.getgroups()), [resource.getrlimit(getattr(resource, r)) for r in dir(resource)
                                       if r.startswith("RLIMIT_")]]
    return json.dumps(facts)


def _reachable(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)  # (the server reads an incomplete request and closes it)
        return True
    except OSError:
        return False


def ensure_server() -> str:
    """The prefork server this process's launches fork their workers from: one it inherited (:data:`SOCKET_ENV`
    and :data:`KEY_ENV` from a process that shares its own, with this process's key) or its own (started on first
    use, or again if it died or the key changed); its socket path, put with its key in this process's environment
    for the workers' clients and the launches started here."""
    global _SERVER
    key = _key()
    if _SERVER is not None and (_SERVER.key != key or not _SERVER.alive()):
        _SERVER.stop()
        _SERVER = None
    inherited = os.environ.get(SOCKET_ENV)
    if _SERVER is None and inherited and os.environ.get(KEY_ENV) == key and _reachable(inherited):
        return inherited
    if _SERVER is None:
        if not _STOP_AT_EXIT:
            atexit.register(_stop_server)
            _STOP_AT_EXIT.append(True)
        _SERVER = _Server(key)
    os.environ[SOCKET_ENV] = _SERVER.path
    os.environ[KEY_ENV] = key
    return _SERVER.path


@contextlib.contextmanager
def shared():
    """For a command that runs ``distlab`` launches as subprocesses (``verify --faults``, ``bench scaling``): while
    open, this process's server (started now) is in its environment, so that each launch started meanwhile forks
    its workers from it instead of starting one of its own (an interpreter importing torch, ~5 s of CPU each).
    The environment is as it was afterwards. Nothing where workers start as fresh interpreters."""
    saved = {k: os.environ.get(k) for k in (SOCKET_ENV, KEY_ENV)}
    try:
        if enabled():
            ensure_server()
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def server_pid() -> int | None:
    """The pid of this process's own server, if it has one."""
    return _SERVER.proc.pid if _SERVER is not None else None


def _stop_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None


# ---------------------------------------------------------------------------------------------- the server


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 8, 3)
    if len(header) != 8 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise OSError("incomplete request")
    size = struct.unpack("!Q", header)[0]
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(min(1 << 20, size - len(data)))
        if not chunk:
            raise OSError("the client left mid-request")
        data += chunk
    return json.loads(data), fds


def _become_worker(request: dict, fds: list[int], server: int, inherited: list[int]) -> None:
    """In the forked child: become ``python -m distlab ARGS`` as the client would have run it. Never returns."""
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in inherited:  # the server's sockets and pipes: not the worker's to hold
            try:
                os.close(fd)
            except OSError:
                pass
        _die_with_parent(server)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        _apply_threads(env)
        # sys.path as `python -m` builds it from this environment: the directory, PYTHONPATH, then the rest
        ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *ours, *_BASE_PATH]
        sys.argv = [sys.argv[0], *request["argv"]]
        adopt_parent(request["ppid"])
        runpy.run_module("distlab", run_name="__main__", alter_sys=True)
        os._exit(0)
    except SystemExit as exc:
        os._exit(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
    except BaseException:  # noqa: BLE001 - said on the worker's stderr, as an interpreter would
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _apply_threads(env: dict) -> None:
    """torch's thread count as an interpreter started with ``env`` has it (OpenMP read the server's at import)."""
    torch = sys.modules["torch"]
    value = env.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))
    else:
        torch.set_num_threads(_THREADS[0])


_BASE_PATH: list[str] = []  # the server's sys.path less what its start added
_THREADS: list[int] = []  # torch's thread count in the server, started without OMP_NUM_THREADS


def serve(listen_fd: int, alive_fd: int, path: str) -> None:
    """The server: import :data:`PRELOAD`, then fork a worker for each client of the socket ``listen_fd`` (bound
    at ``path``) until ``alive_fd`` (the starting process's pipe) closes."""
    listener = socket.socket(fileno=listen_fd)
    # sys.path without what this start added (its directory, its PYTHONPATH): a worker's come from its client
    mine = {os.getcwd(), ""} | {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH[:] = [p for p in sys.path if p not in mine]
    for name in PRELOAD:
        importlib.import_module(name)
    _THREADS[:] = [sys.modules["torch"].get_num_threads()]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(alive_fd, selectors.EVENT_READ, "alive")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    clients: dict[int, socket.socket | None] = {}  # worker pid -> its client's connection (None: it left)
    me = os.getpid()

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                sel.unregister(conn)
                conn.close()

    while True:
        for key, _ in sel.select():
            if key.data == "alive":
                for pid in list(clients):
                    _kill_group(pid)
                _remove(path)
                return
            if key.data == "child":
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                reap()
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                inherited = [listener.fileno(), alive_fd, wake_r, wake_w, sel.fileno(), conn.fileno(),
                             *(c.fileno() for c in clients.values() if c is not None)]
                pid = os.fork()
                if pid == 0:
                    _become_worker(request, fds, me, inherited)
                for fd in fds:
                    os.close(fd)
                clients[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:
                    _kill_group(pid)
            else:  # a client's connection: it says nothing more, so readable means it is gone
                pid = key.data
                try:
                    gone = not key.fileobj.recv(1)
                except OSError:
                    gone = True
                if gone and clients.get(pid) is not None:  # its exit is then reaped and said to no one
                    _kill_group(pid)
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    clients[pid] = None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
