"""A private local Ray head that declares GPUs, and the environment every driver of a test module runs in.

One head per test module (``ray start --head --block`` in its own process group): the drivers are
subprocesses that attach to it with ``RAY_ADDRESS`` (NeMo-RL's ``init_ray`` reuses an external
cluster), so a failed driver can be killed hard without leaving a Ray instance behind, and the
next driver does not pay for a new head. Ray's temp dir, ``HOME`` (Ray 2.60 writes
``~/.ray/auth_token`` and switches to token auth when it finds one) and the auth mode are private
to the head; the whole process group is killed at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[1]
REPO = HARNESS.parents[1]
SITE = Path(__file__).resolve().parent / "site"
SOURCE_VARS = ("NEMO_RL_SRC", "MEGATRON_LM_SRC", "MEGATRON_BRIDGE_SRC", "AUTOMODEL_SRC")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``root``."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append((int(entry), st[1]))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _kill_all(family: list[tuple[int, int]]) -> None:
    for pid, started in family:
        st = _stat(pid)
        if st is not None and st[1] == started:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def cpu_host_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment of the head, the drivers and (forwarded by NeMo-RL) every Ray worker."""
    env = dict(os.environ)
    # the NeMo-RL sources (tests/conftest.py puts them on PYTHONPATH; a script run by hand may not)
    sources = [str(Path(env[v]).resolve()) for v in SOURCE_VARS if env.get(v)]
    have = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE)]
    paths = [str(SITE), str(REPO)] + [p for p in sources if p not in have] + [p for p in have if p != str(REPO)]
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        NEMO_GRANULAR_CPU_HOST="1",
        NEMO_RL_PY_EXECUTABLES_SYSTEM="1",  # NeMo-RL's own switch: no per-worker uv venvs
        HOME=str(home),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        RAY_DEDUP_LOGS="0",
    )
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


class _HeadExited(RuntimeError):
    """The head process ended before the cluster answered."""


class RayHead:
    """``ray start --head --block`` with a private temp dir / HOME; ``stop()`` kills its process group."""

    def __init__(
        self,
        root: Path,
        num_cpus: int = 8,
        num_gpus: int = 2,
        env: dict[str, str] | None = None,
        preload: tuple[str, ...] | None = None,
    ):
        self.root = Path(root)
        self.extra_env = dict(env or {})  # for the head, its workers and the drivers
        # the modules the workers' zygote imports once (cpu_host/worker_zygote.py); () or
        # NEMO_GRANULAR_RAY_ZYGOTE=0: every worker a fresh interpreter
        from .worker_zygote import DTENSOR_PRELOAD

        self.preload = DTENSOR_PRELOAD if preload is None else tuple(preload)
        self.zygote: subprocess.Popen | None = None
        self.home = self.root / "home"
        self.temp = self.root / "ray"  # Ray's unix socket paths must stay short: keep root short
        self.home.mkdir(parents=True, exist_ok=True)
        self.temp.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "head.log"

    def env(self, **extra: str) -> dict[str, str]:
        return cpu_host_env(self.home, RAY_ADDRESS=self.address, **{**self.extra_env, **extra})

    def start(self, timeout: float = 180.0, attempts: int = 3) -> "RayHead":
        """Start the head; a head that exits while starting is retried with fresh ports: its raylet must register
        within a fixed 30 s (ray/_private/node.py), which a loaded two-core machine can miss, and a port
        ``_free_port`` chose may have been taken since."""
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout)
            except _HeadExited:
                self._stop_head()
                self.port = _free_port()
                self.address = f"127.0.0.1:{self.port}"
        return self._start_once(timeout)

    def _start_zygote(self, timeout: float = 300.0) -> None:
        """The workers' zygote, with the head's environment; the head and its drivers get its socket. A
        zygote that does not come up leaves every worker a fresh interpreter (the log says why)."""
        from .worker_zygote import SOCKET_ENV

        if self.zygote is not None or not self.preload or os.environ.get(SOCKET_ENV) == "0":
            return
        path = self.root / "zygote.sock"
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "cpu_host.worker_zygote", str(path), *self.preload],
            env=cpu_host_env(self.home, **self.extra_env),
            cwd=str(self.root),
            stdin=subprocess.DEVNULL,
            stdout=open(self.root / "zygote.log", "a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while not path.exists() and self.zygote.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if path.exists():
            self.extra_env[SOCKET_ENV] = str(path)

    def _start_once(self, timeout: float) -> "RayHead":
        self._start_zygote()
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            f"--num-cpus={self.num_cpus}",
            f"--num-gpus={self.num_gpus}",
            f"--temp-dir={self.temp}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            # every port of its own, so that two heads (two test modules on two xdist workers) can coexist:
            # Ray's defaults for these are fixed numbers
            *(
                f"--{flag}={_free_port()}"
                for flag in (
                    "ray-client-server-port",
                    "dashboard-port",
                    "dashboard-agent-listen-port",
                    "dashboard-agent-grpc-port",
                    "metrics-export-port",
                    "runtime-env-agent-port",
                    "node-manager-port",
                    "object-manager-port",
                )
            ),
        ]
        env = cpu_host_env(self.home, **self.extra_env)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=open(self.log, "a"),  # "a": every attempt's log kept
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        probe = (
            "import ray; ray.init(address='auto', logging_level='ERROR'); "
            "print('GPUS', ray.cluster_resources().get('GPU', 0)); ray.shutdown()"
        )
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise _HeadExited(f"ray head exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            try:
                out = subprocess.run(
                    [sys.executable, "-c", probe],
                    env=self.env(),
                    capture_output=True,
                    text=True,
                    timeout=max(10.0, min(120.0, deadline - time.monotonic())),
                )
            except subprocess.TimeoutExpired:
                # a probe whose ray.init hangs (seen under CI's load: the GCS still starting) is tried again
                # until the deadline, as a failing one is; it ended a rehearsal's Megatron loop set-up at once
                continue
            if out.returncode == 0 and f"GPUS {float(self.num_gpus)}" in out.stdout:
                return self
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"ray head did not come up in {timeout}s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self._stop_head()
        if self.zygote is not None:  # and the workers it forked (each in a session of its own)
            family = _descendants(self.zygote.pid)
            self.zygote.kill()
            self.zygote.wait()
            _kill_all(family)
            self.zygote = None

    def _stop_head(self) -> None:
        if self.proc is None:
            return
        # Ray's worker processes start their own sessions: note every descendant first
        family = _descendants(self.proc.pid)
        # SIGTERM makes the raylet drain for up to 30 s; a test head holds nothing worth draining
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 20)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        time.sleep(2)
        _kill_all(family)  # what outlived its raylet (normally nothing)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


def run_driver(
    head: RayHead, args: list[str], log: Path, timeout: float, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """Run one driver (``python -m ...``) attached to ``head``; killed with its process group on timeout."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, *args],
            env=head.env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    return subprocess.CompletedProcess(args, rc, log.read_text(), "")
