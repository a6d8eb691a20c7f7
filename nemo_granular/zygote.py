"""Start ``nemo-granular`` commands by forking a process that has already imported torch and transformers.

``compare`` starts one ``nemo-granular train`` per warm start and run, then one ``eval-checkpoints``
per run: 55 processes in the default demo. Each fresh interpreter spends ~5–7 s of CPU importing torch,
transformers and the model classes before its first step (a quarter of a smoke comparison's CPU on two
cores). A zygote imports them once; every command is then a ``fork()`` of it that runs
``python -m nemo_granular ARGV`` (``runpy``) exactly as a new interpreter would: its own session,
its own working directory and environment, stdout and stderr on the pipe the caller passed, the exit
status of ``main`` (1 and a traceback for an uncaught exception). The zygote has one Python thread when it
forks; the one native thread the imports start, NumPy's OpenBLAS server, is stopped by OpenBLAS's own
fork handler before each fork and started again when next needed, so a child is a clean process.

:class:`Zygote` is the caller's side: :meth:`Zygote.start` returns a :class:`ForkedRun`, which answers
``pid``, ``stdout``, ``poll``, ``wait`` and ``send_signal`` as a ``subprocess.Popen`` does. The wire
is a Unix socket pair: one JSON line per request with the pipe's write end attached (``SCM_RIGHTS``);
the zygote answers ``{"pid": N}`` and, when the child ends, ``{"exit": N, "rc": RC}``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

# what every embedded command imports before its first step (lazily, so their import is what costs). By
# name, as the commands themselves are found (``COMMANDS`` in nemo_granular/cli.py): this module sits beside
# ``compare`` and imports no part of the package, so the parts' import graph stays one-way (test_layering.py)
PRELOAD = (
    "torch",
    "transformers",
    "tokenizers",
    "nemo_granular.embedded.cli",
    "nemo_granular.embedded.trainer",
    "nemo_granular.evals.cli",
    "nemo_granular.evals.embedded",
    "transformers.generation.utils",
)
MODEL_CLASSES = (
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3ForSequenceClassification",
    "PreTrainedTokenizerFast",
    "AutoTokenizer",
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
)


# ----------------------------------------------------------------------------- the zygote process
def _child(argv: list[str], env: dict, cwd: str, out_fd: int, others: list[int]) -> None:
    """In the forked child: become ``python -m nemo_granular ARGV`` and exit with its status. ``others``:
    the pipes of requests not forked yet, closed here (held open, a run's output would never end)."""
    code = 1
    try:
        for fd in others:
            os.close(fd)
        os.setsid()  # its own session, as compare's runs always were: a terminal's Ctrl-C reaches compare only
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGPIPE):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [sys.argv[0], *argv]
        import runpy

        # `python -m nemo_granular ARGV` (its __main__ calls the dispatcher and exits with its status)
        runpy.run_module("nemo_granular", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        else:
            code = 0 if e.code is None else 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # what a normal interpreter exit runs (TensorBoard writers, ...)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _serve(sock: socket.socket) -> None:
    """The zygote's loop: fork a child per request and report its pid; report each child's status when
    it ends. One thread only (children are reaped between requests): a fork never copies another thread."""
    import select

    buf, fds, children = b"", [], set()

    def send(obj: dict) -> None:
        sock.sendall((json.dumps(obj) + "\n").encode())

    while True:
        while children:  # reap whatever ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            send({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
        if not select.select([sock], [], [], 0.1)[0]:
            continue
        msg, new_fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
        if not msg:  # the caller closed its end: finish (the children keep running, as Popen's would)
            return
        buf += msg
        fds += new_fds
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req, out_fd = json.loads(line), fds.pop(0)
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(req["argv"], req["env"], req["cwd"], out_fd, fds)
            os.close(out_fd)
            children.add(pid)
            send({"pid": pid})


def _zygote_main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller decides; it ends the zygote by closing the socket
    sock = socket.socket(fileno=fd)
    import importlib
    import logging

    for name in ("torchao", "torch.utils._pytree"):  # import-time chatter (as `train` silences it)
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in PRELOAD:
        importlib.import_module(module)
    import transformers

    for name in MODEL_CLASSES:
        getattr(transformers, name)
    sock.sendall(b'{"ready": true}\n')
    _serve(sock)


# ----------------------------------------------------------------------------- the caller's side
class ForkedRun:
    """A command started by the zygote; the parts of ``subprocess.Popen`` that ``compare`` uses."""

    def __init__(self, zygote: Zygote, pid: int, stdout):
        self._zygote, self.pid, self.stdout = zygote, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote._exit_codes.get(self.pid)
        return self.returncode

    def wait(self) -> int:
        with self._zygote._changed:
            while self.poll() is None:
                if self._zygote._dead:
                    raise RuntimeError("the zygote process ended while a run was going on")
                self._zygote._changed.wait(1.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


class Zygote:
    """One zygote process, started with ``env`` (its imports read it) and ended by :meth:`close`."""

    def __init__(self, env: dict):
        self.env = dict(env)
        mine, theirs = socket.socketpair()
        code = "import sys; from nemo_granular.zygote import _zygote_main; _zygote_main(int(sys.argv[1]))"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._sock = mine
        self._file = mine.makefile("rb")
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self._pids: list[int] = []
        self._exit_codes: dict[int, int] = {}
        self._dead = False
        first = self._file.readline()
        if not first or not json.loads(first).get("ready"):
            self.close()
            raise RuntimeError("the zygote process did not start")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self._file:
                msg = json.loads(line)
                with self._changed:
                    if "pid" in msg:
                        self._pids.append(msg["pid"])
                    else:
                        self._exit_codes[msg["exit"]] = msg["rc"]
                    self._changed.notify_all()
        except (OSError, ValueError):  # closed by close()
            pass
        with self._changed:
            self._dead = True
            self._changed.notify_all()

    def start(self, argv: list[str], env: dict | None = None, cwd: str | None = None) -> ForkedRun:
        """``python -m nemo_granular ARGV`` with ``env`` and ``cwd``, stdout and stderr merged into
        ``ForkedRun.stdout`` (text, line by line)."""
        read_fd, write_fd = os.pipe()
        req = (
            json.dumps(
                {"argv": list(argv), "env": dict(env if env is not None else os.environ), "cwd": cwd or os.getcwd()}
            ).encode()
            + b"\n"
        )
        try:
            with self._send_lock, self._changed:
                n = len(self._pids)
                socket.send_fds(self._sock, [req], [write_fd])
                while len(self._pids) == n:
                    if self._dead:
                        raise RuntimeError("the zygote process ended")
                    self._changed.wait(1.0)
                pid = self._pids[n]
        finally:
            os.close(write_fd)
        return ForkedRun(self, pid, os.fdopen(read_fd, "r", errors="replace"))

    def close(self) -> None:
        """End the zygote (runs it started keep running, as ``Popen``'s children would)."""
        try:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # EOF for the zygote (makefile() keeps the fd open)
            except OSError:
                pass
            self._file.close()
            self._sock.close()
        finally:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
