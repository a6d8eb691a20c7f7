"""Ray workers forked from one process that has imported their modules once (CPU test host only).

Every Ray worker of a loop run is a fresh interpreter (Ray's ``default_worker.py``) that imports
torch, transformers, Automodel and NeMo-RL before its actor's ``__init__`` runs: 12–15 s of CPU for
a DTensor policy worker, and a loop starts 2–6 of them (docs/testing.md, "CI time"). Here the raylet
still starts each worker process, with its own argv and environment; that process
(``site/sitecustomize.py`` → :func:`delegate`) hands its argv, environment, working directory and
stdin/stdout/stderr to the zygote and waits. The zygote forks a child that becomes the worker
(``runpy`` of ``default_worker.py`` with that argv and environment, in a session of its own as Ray's
workers are) and reports its exit status, which the waiting process exits with; the signals it receives
are passed on. The worker registers with the raylet under its own pid, so the raylet's kills reach it.

What differs from a fresh worker (docs/nemo-rl.md §7): the preloaded modules were imported under the
head's environment, not the worker's (what Ray and NeMo-RL add per actor, ranks, ports and the run's
facts file, is read when used, not on import); the child's Python and NumPy random states are
reseeded from the OS, as a new interpreter's are. Without the zygote (it failed to start, or refused
to serve because a preloaded module started a thread) each worker starts as a fresh interpreter.

``python -m cpu_host.worker_zygote SOCKET MODULE...``: import the modules, then serve on ``SOCKET``
(one JSON line per request, the three descriptors attached; answers ``{"pid": N}``, then
``{"rc": RC}`` when the child ends).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "NEMO_GRANULAR_RAY_ZYGOTE"
# what a DTensor policy / value worker and the math environments import (those a NeMo-RL version lacks
# are skipped: its workers import what they have)
DTENSOR_PRELOAD = (
    "torch",
    "transformers",
    "nemo_rl.models.policy.workers.dtensor_policy_worker_v2",
    "nemo_rl.models.value.workers.dtensor_value_worker_v2",
    "nemo_rl.environments.math_environment",
    "nemo_rl.algorithms.grpo",
    "nemo_rl.algorithms.ppo",
    "cpu_host.launch",
)
MEGATRON_PRELOAD = (*DTENSOR_PRELOAD, "nemo_rl.models.policy.workers.megatron_policy_worker")
# the processes forked: Ray's workers, and the loop drivers (``python -m cpu_host.launch``)
DRIVER_MODULE = "cpu_host.launch"


def forked_command() -> list[str] | None:
    """This process's command as the zygote runs it (``[script, args...]`` or ``["-m", module, args...]``),
    when it is one the zygote forks; at start-up, from ``sitecustomize``."""
    if sys.argv and sys.argv[0].endswith("default_worker.py"):
        return list(sys.argv)
    if sys.orig_argv[1:3] == ["-m", DRIVER_MODULE]:
        return ["-m", DRIVER_MODULE, *sys.argv[1:]]
    return None


# ----------------------------------------------------------------------------- the worker's side
def delegate(path: str, argv: list[str]) -> None:
    """At start-up of a process :func:`forked_command` names: have the zygote fork it, wait for it, exit
    with its status. Returns (the process then starts here, as usual) only when the zygote did not take it."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        req = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode() + b"\n"
        socket.send_fds(sock, [req], [0, 1, 2])
        answers = sock.makefile("rb")
        first = answers.readline()
    except OSError:
        return
    if not first:
        return
    pid = json.loads(first)["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    last = answers.readline()
    rc = json.loads(last)["rc"] if last else 1
    if rc < 0:  # killed by a signal: end the same way
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    os._exit(rc & 0xFF)


# ----------------------------------------------------------------------------- the zygote
def _become_worker(req: dict, fds: list[int]) -> None:
    """In the forked child: the worker process ``python ARGV`` would have been; never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import runpy

        argv = list(req["argv"])
        if argv[0] == "-m":  # python -m MODULE ARGS (run_module puts the module's path in argv[0])
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


# Ray and what imports it stay out of the zygote: Ray's native core reads the worker's job id from the
# environment once, when it is loaded (a worker forked with it loaded fails "Check failed: !job_id_env.empty()")
NOT_PRELOADED = ("ray", "nemo_rl")


class _NoRay:
    """A meta-path finder that refuses ``ray`` while the zygote imports, and notes who asked."""

    def __init__(self):
        self.asked_by: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            caller = sys._getframe(1)
            while caller is not None and caller.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
                caller = caller.f_back
            self.asked_by.add(caller.f_globals.get("__name__", "?") if caller is not None else "?")
            raise ImportError(f"{name} is not preloaded in the worker zygote")
        return None


def _module_order(entries: list[str]) -> list[str]:
    """Every module a worker importing ``entries`` imports, in import order: read once from a forked
    child that imports them (Ray included), then kept in a file keyed by the interpreter, the path and
    ``entries``."""
    import hashlib
    import tempfile
    from pathlib import Path

    key = hashlib.sha256(json.dumps([sys.executable, os.environ.get("PYTHONPATH", ""), entries]).encode()).hexdigest()
    cache = Path(tempfile.gettempdir()) / "nemo-granular-worker-zygote" / f"{key[:24]}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        import importlib

        os.close(read_fd)
        for name in entries:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        with os.fdopen(write_fd, "w") as out:
            json.dump(list(sys.modules), out)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        order = json.loads(f.read() or "[]")
    os.waitpid(pid, 0)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.partial")
    tmp.write_text(json.dumps(order))
    os.replace(tmp, cache)
    return order


def _preload(entries: list[str]) -> None:
    """Import what a worker importing ``entries`` imports, but Ray and what needs it (:data:`NOT_PRELOADED`)."""
    import importlib

    order = _module_order(entries)
    finder = _NoRay()
    sys.meta_path.insert(0, finder)
    try:
        for name in order:
            if name in sys.modules or name.split(".")[0] in NOT_PRELOADED or name == "__main__":
                continue
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the worker imports it itself
                pass
    finally:
        sys.meta_path.remove(finder)
    # a module that tried Ray and went on without it would tell the worker Ray is absent: not kept
    for name in finder.asked_by - {"?"}:
        if name.split(".")[0] not in NOT_PRELOADED:
            print(f"worker_zygote: {name} asked for Ray while preloading: dropped", file=sys.stderr, flush=True)
            sys.modules.pop(name, None)


def serve(path: str, modules: list[str]) -> int:
    """Import ``modules``, then fork a worker per request on the Unix socket ``path``. One Python thread
    (so that a fork copies no other thread's half-held lock): children are reaped between requests."""
    import select

    _preload(modules)
    import threading

    # Python threads only: NumPy's OpenBLAS starts a native server thread on import (torch imports NumPy),
    # which OpenBLAS's own fork handler stops before each fork (it starts again when next needed)
    if threading.active_count() != 1:
        print(
            f"worker_zygote: {[t.name for t in threading.enumerate()]} after the imports; not serving",
            file=sys.stderr,
            flush=True,
        )
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".partial")
    os.rename(path + ".partial", path)  # the socket appears when the zygote is ready
    listener.listen(64)
    conns: dict[int, socket.socket | None] = {}  # the waiting process's connection by its child's pid (None: gone)
    pending: list[socket.socket] = []  # connected, request not read yet
    while True:
        while conns:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = conns.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall((json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n").encode())
                except OSError:
                    pass
                conn.close()
        waiting = {c.fileno(): (pid, c) for pid, c in conns.items() if c is not None}
        ready = select.select([listener, *pending, *(c for _, c in waiting.values())], [], [], 0.2)[0]
        for s in ready:
            if s is listener:
                pending.append(listener.accept()[0])
            elif s in pending:
                pending.remove(s)
                msg, fds, _, _ = socket.recv_fds(s, 1 << 22, 3)
                if not msg or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    s.close()
                    continue
                while not msg.endswith(b"\n"):
                    more = s.recv(1 << 22)
                    if not more:
                        break
                    msg += more
                req = json.loads(msg)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for c in [*pending, *(c for c in conns.values() if c is not None)]:
                        c.close()
                    s.close()
                    _become_worker(req, fds)
                for fd in fds:
                    os.close(fd)
                s.sendall((json.dumps({"pid": pid}) + "\n").encode())
                conns[pid] = s
            else:  # the waiting process ended (killed before its worker): end the worker too
                pid, conn = waiting[s.fileno()]
                if not conn.recv(1):
                    conn.close()
                    conns[pid] = None
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the test that started it
    sys.exit(serve(sys.argv[1], sys.argv[2:]))
