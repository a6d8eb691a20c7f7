"""The Slurm launcher (``slurm/launch.sh``) on a REAL two-node Slurm cluster started on this machine.

``slurm/local_cluster/up.sh`` starts munged, slurmctld and two slurmd compute nodes, each in its
own network namespace with its own IP and hostname; the launcher is submitted with ``sbatch``
from a directory outside the repository and must

1. bring up Ray on both nodes, report ``ray.nodes()`` = 2, run the driver, write metrics and a
   checkpoint, and end COMPLETED — after, on a USR1 to the batch shell (what
   ``--signal=B:USR1@T`` sends before the time limit), having made the driver save a checkpoint
   and exit 99, requeued the job, and resumed it with no step lost or repeated (one job for
   both: each Ray start costs ~30 s on the 2-core CI machine). The same job runs as on a pyxis
   cluster, in the local cluster's pyxis (``slurm/local_cluster/pyxis``: each container step in a
   root with only the mounts, no ``$HOME``, the image's environment first; the exact srun command
   lines are recorded) with an image directory made by ``slurm/local_cluster/make_image.sh``, from
   a home where an earlier ``ray.init()`` left ``~/.ray/auth_token``: Ray token auth, ray.sub's
   fixed ports, ``ulimit -n``, ``UV_CACHE_DIR`` and what each step sees in its container are
   checked on the way; the head's name also maps to 127.0.1.1;
2. requeue and resume a NeMo-RL run (the real ``run_grpo`` / ``run_sppo`` around
   ``tests/harness/nemo_rl_loop_driver.py``'s stand-in loop) that stopped at NeMo-RL's own time limit,
   one sent USR1 while starting up and again in the middle of a (slow) checkpoint save, and one
   preempted with SIGTERM (``scontrol requeue``);
3. fail within a bounded time, with a message naming the node, when a worker node dies (every
   process in its namespace — slurmd, slurmstepd, raylet — is SIGKILLed), when a worker's srun
   fails, when Ray's readiness probe is refused (Ray's own reason), and before Ray when the
   preflight finds a problem;
4. run ``nemo-granular preflight`` before Ray, with the driver's Python, in the head's (pyxis)
   container, in WORKDIR, on the driver's final command line; ``submit_comparison.sh`` runs it on
   every NeMo-RL config before submitting anything.

Which preflight: the REAL one (``python -m nemo_granular preflight``, NeMo-RL's own checks) in
``test_real_preflight_*`` (in jobs: a shipped config passes, a config NeMo-RL rejects fails the
job) and ``test_submit_comparison_runs_the_real_preflight_on_the_shipped_configs``; the stand-in
(``NG_FAKE_PREFLIGHT=1``: ``fake_preflight`` in tests/harness/nemo_rl_logger_driver.py, same interface,
records its command lines) where the real one would add NeMo-RL imports to a test's critical path
without new evidence, or would rightly refuse a 64-GPU layout on this 4-GPU cluster: the requeue
test of (2) and the NeMo-RL comparison. Each test's docstring says which.

The module's wall time is mostly waiting: Ray starts, NeMo-RL imports, and the ~30 s Slurm holds a
requeued job. So the one-node jobs of three tests are submitted together (``one_node_jobs``), and
the CPU-only dry runs start in the background when the module starts (``real_preflight_dry_runs``).

The driver of (1) is the real ``nemo-granular train --config examples/configs/local/smoke.yaml``
when ``nemo_granular.embedded`` is importable, the stand-in ``tests/harness/slurm_stub_driver.py`` (same
signal / exit-code / resume contract) otherwise; ``NG_SLURM_TEST_DRIVER=stub|train`` forces one.
Every job runs with a private ``HOME`` (never the real one). What it does to the machine (as
root): apt-installs the Debian packages slurmctld, slurmd, slurm-client, munge and shellcheck (and
util-linux, coreutils, mount for the pyxis emulation) when missing, adds tagged node-name lines
to ``/etc/hosts``, creates a bridge, veths and network
namespaces on a private 10.231.78.0/24 subnet (no outside network), and starts munged, slurmctld
and two slurmd; the teardown (``down.sh``) removes all of it. ``NEMO_GRANULAR_SLURM_TESTS=0``
opts out: the cluster tests and the shellcheck test then skip (a failure under CI, which allows
no skips). Also skipped (with the reason) when not root or when apt cannot install the packages.

When a cluster test fails, the cluster's own logs (slurmctld, every slurmd, munged) are copied
next to the job's logs into the test's ``tmp_path`` (``cluster-logs/``, kept by pytest after the
teardown) and their lines about the job are part of the failure message.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from docs_story import bash_block, bash_blocks, story, substitute

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "slurm"
LAUNCH = SLURM / "launch.sh"
STUB = ROOT / "tests" / "harness" / "slurm_stub_driver.py"
NRL_DRIVER = ROOT / "tests" / "harness" / "nemo_rl_logger_driver.py"
LOOP_DRIVER = ROOT / "tests" / "harness" / "nemo_rl_loop_driver.py"
PYXIS = SLURM / "local_cluster" / "pyxis"  # the local cluster's pyxis (srun + enter.sh)
MAKE_IMAGE = SLURM / "local_cluster" / "make_image.sh"
SHIMS = ROOT / "tests" / "harness" / "host_shims"
IMAGE_BIN, IMAGE_BIN_INSIDE = ROOT / "tests" / "harness" / "image_bin", "/opt/test_bin"
IMAGE_PATH = "/opt/nemo_rl_venv/bin:/root/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SMOKE = ROOT / "examples" / "configs" / "local" / "smoke.yaml"
PKGS = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "munged": "munge",
    "ip": "iproute2",
    "shellcheck": "shellcheck",
    "unshare": "util-linux",
    "chroot": "coreutils",
    "mount": "mount",
}
FAKE_GPUS = 2
# the ports launch.sh pins (NeMo-RL ray.sub's layout, all below 9000): GCS, node/object manager, metrics
PINNED = {"gcs": 1200, "node_manager": 1301, "object_manager": 1303, "metrics_export": 1309}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.slurm]

_apt_state: dict[str, str | None] = {}


def _ensure_debian_packages() -> str | None:
    """apt-get the missing tools once per session (update once first). Returns a skip reason or None."""
    if "result" in _apt_state:
        return _apt_state["result"]
    result = None
    if os.environ.get("NEMO_GRANULAR_SLURM_TESTS", "1").strip().lower() in ("0", "false", "no", "off"):
        result = (
            "NEMO_GRANULAR_SLURM_TESTS=0: not installing Slurm packages, not editing /etc/hosts, "
            "not starting daemons or network namespaces"
        )
    elif os.geteuid() != 0:
        result = "needs root (starts slurmctld/slurmd/munged and network namespaces)"
    else:
        missing = sorted({pkg for exe, pkg in PKGS.items() if shutil.which(exe) is None})
        if missing:
            if shutil.which("apt-get") is None:
                result = f"missing {missing} and no apt-get"
            else:
                env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
                upd = subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, text=True)
                ins = (
                    subprocess.run(
                        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                        env=env,
                        capture_output=True,
                        text=True,
                    )
                    if upd.returncode == 0
                    else upd
                )
                if ins.returncode != 0 or any(shutil.which(e) is None for e, p in PKGS.items() if p in missing):
                    result = f"apt-get could not install {missing}: {(ins.stderr or ins.stdout).strip()[-300:]}"
    _apt_state["result"] = result
    return result


# a resumed driver says so: the embedded trainer's start line, or the stand-in driver's
RESUMED = re.compile(r"resuming at step \d+ of \d+ from \S*step_|^resumed from ", re.M)


def _driver_kind() -> str:
    forced = os.environ.get("NG_SLURM_TEST_DRIVER")
    if forced in ("stub", "train"):
        return forced
    return "train" if importlib.util.find_spec("nemo_granular.embedded") is not None and SMOKE.is_file() else "stub"


# ----------------------------------------------------------------------------------- fixtures ---


class Cluster:
    def __init__(self, state_dir: Path, env: dict, prefix: str):
        self.dir, self.prefix = state_dir, prefix
        self.env = env

    def run(self, *cmd, check=True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, **kw)

    def job_fields(self, job: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def state(self, job: str) -> str:
        return self.job_fields(job).get("JobState", "?")

    def wait_terminal(self, job: str, timeout: float, on_poll=None) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state(job)
            if st in TERMINAL:
                return st
            if on_poll:
                on_poll(st)
            time.sleep(1.0)
        raise AssertionError(
            f"job {job} not finished after {timeout:.0f} s (state {self.state(job)}); "
            f"slurmctld log tail: {self.log_tail('slurmctld.log')}"
        )

    def log_tail(self, name: str, n: int = 15) -> str:
        p = self.dir / "log" / name
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else "(none)"

    def netns_pids(self, node_index: int) -> list[int]:
        """Every process living in node <node_index>'s network namespace (= 'on that node')."""
        ino = os.stat(f"/run/netns/{self.prefix}ns{node_index}").st_ino
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.stat(d / "ns" / "net").st_ino == ino:
                        pids.append(int(d.name))
                except OSError:
                    pass
        return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _ensure_debian_packages()
    if reason:
        pytest.skip(reason)
    prefix = "ngt"
    state = Path("/tmp/ngt-slurm")
    ray_tmp = Path("/tmp/ngt-ray")  # short: Ray's socket paths must stay < 108 chars
    home = tmp_path_factory.mktemp("home")  # never the real HOME: Ray 2.60 writes ~/.ray/auth_token there
    env = {
        **os.environ,
        "HOME": str(home),
        "NG_SLURM_DIR": str(state),
        "NG_SLURM_PREFIX": prefix,
        "NG_SLURM_SUBNET": "10.231.78",
        "NG_SLURM_CTLD_PORT": "16827",
        "NG_SLURM_SLURMD_PORT": "16828",
        "NG_SLURM_NODES": "2",
        "NG_SLURM_NOGRES_NODES": "1",  # ngt3, partition nogres: a site that declares no GPUs to Slurm
        "NG_SLURM_FAKE_GPUS": str(FAKE_GPUS),  # GRES gpu:2 per node (device-less) -> GRES detection
        "NG_PYXIS_STATE": str(state / "pyxis"),  # the containers' /tmp: removed with the cluster
        "NG_SLURM_HEAD_LOOPBACK": "1",  # ngt1 also maps to 127.0.1.1 (Debian/Ubuntu): the head must not bind it
        "SLURM_CONF": str(state / "slurm.conf"),
        "RAY_TMP_BASE": str(ray_tmp),
        "VENV": sys.prefix,
        "OMP_NUM_THREADS": "1",
        "WATCH_INTERVAL": "2",
        "RAY_WAIT_TIMEOUT": "180",
    }
    for var in ("SLURM_JOB_ID", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(var, None)
    # a previous run that crashed may have left its cluster behind: remove it first
    subprocess.run(["bash", str(SLURM / "local_cluster" / "down.sh")], env=env, capture_output=True, timeout=120)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    ray_tmp.mkdir(parents=True)
    up = subprocess.run(
        ["bash", str(SLURM / "local_cluster" / "up.sh"), "--install"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        if up.returncode == 2:
            pytest.skip(f"local Slurm cluster prerequisites missing: {up.stderr.strip()[-300:]}")
        assert up.returncode == 0, f"up.sh failed:\n{up.stdout}\n{up.stderr}"
        yield Cluster(state, env, prefix)
    finally:
        down = subprocess.run(
            ["bash", str(SLURM / "local_cluster" / "down.sh")], env=env, capture_output=True, text=True, timeout=120
        )
        shutil.rmtree(ray_tmp, ignore_errors=True)
        hosts = Path("/etc/hosts").read_text()
        assert f"nemo-granular-local-slurm:{prefix}" not in hosts, "down.sh left /etc/hosts lines"
        assert not Path(f"/run/netns/{prefix}ns1").exists(), f"down.sh left a namespace: {down.stderr}"
        shutil.rmtree(state, ignore_errors=True)


def _driver_cmd(run_dir: Path, steps: int, every: int, slow: bool, python: str | None = None) -> list[str]:
    """``python``: the driver's interpreter (default this one; "python" in a container: the image's)."""
    if _driver_kind() == "train":
        train = ["nemo-granular", "train"] if python is None else [python, "-m", "nemo_granular", "train"]
        return [
            *train,
            "--config",
            str(SMOKE),
            f"output_dir={run_dir}",
            "seed=0",
            f"rl.steps={steps}",
            f"checkpoint.every={every}",
            "warmstart.enabled=false",
        ]  # CI time; the launcher adds --auto-resume
    return [
        python or sys.executable,
        str(STUB),
        f"output_dir={run_dir}",
        f"rl.steps={steps}",
        f"checkpoint.every={every}",
        f"step_seconds={0.3 if slow else 0.05}",
        "--auto-resume",
    ]


def _make_image(
    dest: Path, nemo_rl: Path | None, workers: tuple[str, ...] = (), mcore_in_workers: bool = False
) -> Path:
    """An image directory for the local cluster's pyxis (slurm/local_cluster/make_image.sh): this
    test environment's packages as the image's /opt/nemo_rl_venv, ``nemo_rl`` (when given) as the
    image's /opt/nemo-rl, the test world's NeMo-RL shims and Megatron/Automodel sources as image
    layers on the image's PYTHONPATH. No nemo-granular in it. ``mcore_in_workers``: as in NeMo-RL's
    image, Megatron-LM and Megatron-Bridge (NeMo-RL's ``mcore`` extra) only in the worker venvs
    (``--worker-pth``), there with the shared CPU stand-ins in place of Transformer Engine and CUDA
    (tests/harness/cpu_stand_ins, an image layer, installed by the .pth; docs/nemo-rl.md §7)."""
    layers, path = [f"{SHIMS / 'typing_shim'}:/opt/shims/typing_shim"], ["/opt/shims/typing_shim"]
    worker_pth: list[str] = []
    if nemo_rl is not None:
        path.append("/opt/nemo-rl")
    for var in ("MEGATRON_LM_SRC", "MEGATRON_BRIDGE_SRC", "AUTOMODEL_SRC"):
        if os.environ.get(var) and os.environ.get("NEMO_RL_SRC"):
            layers.append(f"{Path(os.environ[var]).resolve()}:/opt/src/{var.lower()}")
            (worker_pth if mcore_in_workers and var != "AUTOMODEL_SRC" else path).append(f"/opt/src/{var.lower()}")
    if mcore_in_workers:
        layers += [
            f"{ROOT / 'tests' / 'harness' / 'cpu_stand_ins'}:/opt/cpu_stand_ins/cpu_stand_ins",
            f"{SHIMS}:/opt/cpu_stand_ins/host_shims",
        ]  # (the stand-ins find te_stub beside them)
        worker_pth += ["/opt/cpu_stand_ins", "import cpu_stand_ins; cpu_stand_ins.install()"]
    # the test images' `python` first on PATH: it dispatches `python -m nemo_granular.run_*` (and the
    # preflight) to the stand-in driver named by NG_STAND_IN_DRIVER (tests/harness/image_bin/python)
    layers.append(f"{IMAGE_BIN}:{IMAGE_BIN_INSIDE}")
    args = [
        "bash",
        str(MAKE_IMAGE),
        str(dest),
        "--venv",
        sys.prefix,
        "--env",
        "PYTHONPATH=" + ":".join(path),
        "--env",
        f"PATH={IMAGE_BIN_INSIDE}:{IMAGE_PATH}",
    ]
    if nemo_rl is not None:
        args += ["--nemo-rl", str(nemo_rl)]
    for layer in layers:
        args += ["--layer", layer]
    for fqn in workers:
        args += ["--worker-venv", fqn]
    for line in worker_pth:
        args += ["--worker-pth", line]
    subprocess.run(args, check=True, capture_output=True, text=True)
    return dest


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """``release``: NeMo-RL's release container as pyxis runs it (NeMo-RL in the image at
    /opt/nemo-rl, the stock Megatron worker's venv prebuilt under /opt/ray_venvs); ``deps``: an
    image built from a NeMo-RL checkout that the jobs mount (no NeMo-RL inside), Megatron only in
    its prebuilt Megatron worker venv (with the CPU stand-ins)."""
    d = tmp_path_factory.mktemp("images")
    src = Path(os.environ["NEMO_RL_SRC"]).resolve() if os.environ.get("NEMO_RL_SRC") else None
    return {
        "release": _make_image(d / "release", src, (MEGATRON_WORKER,)),
        "deps": _make_image(d / "deps", None, (MEGATRON_WORKER,), mcore_in_workers=True),
    }


MEGATRON_WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
IMAGE_CUDA_ARCHS = "9.0 10.0"  # NeMo-RL's image (docker/Dockerfile); the docs' bare-metal story exports it too


def _pyxis_env(cluster: Cluster, image: Path, mounts: list[Path], srun_log: Path | None = None) -> dict:
    """A job's environment on a pyxis cluster: pyxis' srun first on PATH, CONTAINER, MOUNTS (each
    at its own path) and no VENV (the image's environment runs the job)."""
    env = {
        "PATH": f"{PYXIS}:{cluster.env['PATH']}",
        "CONTAINER": str(image),
        "VENV": None,
        "MOUNTS": ",".join(f"{m}:{m}" for m in mounts),
    }
    if srun_log is not None:
        env["NG_SRUN_LOG"] = str(srun_log)
    return env


def _submit(
    cluster: Cluster,
    workdir: Path,
    name: str,
    cmd: list[str],
    *,
    nodes: int = 2,
    env: dict | None = None,
    soft_nofile: int | None = None,
    sbatch: tuple[str, ...] = (),
) -> str:
    """sbatch launch.sh from a directory outside the repository (script by absolute path), with
    ``env`` on top of the cluster's (a value None removes the variable: sbatch hands the job the
    submitting environment); ``soft_nofile``: submit with that soft ``ulimit -n`` (Slurm
    propagates the submitting shell's soft limits to the job)."""
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        "sbatch",
        "--parsable",
        f"--nodes={nodes}",
        f"--job-name={name}",
        f"--output={workdir}/slurm-%j.out",
        *sbatch,
        str(LAUNCH),
        *cmd,
    ]
    if soft_nofile is not None:
        argv = ["bash", "-c", f'ulimit -Sn {soft_nofile} && exec "$@"', "_", *argv]
    job_env = {k: v for k, v in {**cluster.env, **(env or {})}.items() if v is not None}
    out = subprocess.run(argv, env=job_env, capture_output=True, text=True, check=True, cwd=workdir)
    return out.stdout.strip().split(";")[0]


def _home(path: Path, token: str | None = None) -> Path:
    """A private HOME for a job; with ``token``, the ``~/.ray/auth_token`` a plain ``ray.init()``
    of Ray 2.60 leaves in a (shared) home."""
    (path / ".ray").mkdir(parents=True)
    if token is not None:
        (path / ".ray" / "auth_token").write_text(token)
    return path


def _signal_usr1(cluster: Cluster, job: str) -> None:
    """What ``--signal=B:USR1@T`` sends before the time limit: USR1 to the batch shell only."""
    cluster.run("scancel", "--signal=USR1", "--batch", job)


def _wait_for(what, cond, cluster: Cluster, job: str, workdir: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline and cluster.state(job) in ("PENDING", "RUNNING"), (
            f"waiting for {what}\n" + _explain(cluster, workdir, job)
        )
        time.sleep(0.2)


def _steps(run_dir: Path) -> list[int]:
    p = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []
    return [r["step"] for r in rows if r["step"] >= 1]  # the trainer logs a step-0 evaluation row


def _job_lines(text: str, job: str) -> list[str]:
    """The lines of a slurmctld/slurmd log that are about job <job>."""
    pat = re.compile(rf"(JobId={job}\b|[Jj]ob[ _]?{job}\b|JOB {job}\b|\[{job}[.\]]|StepId={job}\.)")
    return [line for line in text.splitlines() if pat.search(line)]


def _explain(cluster: Cluster, workdir: Path, job: str) -> str:
    """Everything known about a job, for a failure message: the tails of the launcher's logs and
    the job's Slurm output, and the cluster daemons' lines about the job. The daemons' logs are
    also copied to <workdir>/cluster-logs/, which pytest keeps after the teardown removes the
    cluster (its last three runs, under `pytest --basetemp` or the system temp dir)."""
    keep = workdir / "cluster-logs"
    keep.mkdir(parents=True, exist_ok=True)
    for src in [
        *sorted((cluster.dir / "log").glob("*.log")),
        cluster.dir / "munge" / "munged.log",
        cluster.dir / "slurm.conf",
    ]:
        if src.is_file():
            shutil.copyfile(src, keep / src.name)
    parts = []
    files = [p for p in workdir.rglob("*") if p.parent != keep and p.is_file() and p.stat().st_size < 2_000_000]
    # the steps' own logs (ray-head.log: Ray's error) before the rest; launcher.log only where no
    # slurm-<job>.out holds the same lines (a CI log shows only the start and the end of a long message)
    has_out = any(p.name == f"slurm-{job}.out" for p in files)
    for p in sorted(files, key=lambda p: (p.suffix != ".out", p.name == "launcher.log", str(p))):
        if p.name == "launcher.log" and has_out:
            continue
        if p.suffix in (".out", ".log", ".json"):
            parts.append(
                f"--- {p.relative_to(workdir)}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
            )
    for p in sorted(keep.glob("*.log")):
        lines = _job_lines(p.read_text(errors="replace"), job)
        if lines:
            parts.append(f"--- cluster {p.name} (lines about job {job})\n" + "\n".join(lines[-40:]))
    fields = cluster.job_fields(job)
    state = " ".join(
        f"{k}={fields[k]}"
        for k in ("JobState", "Reason", "Restarts", "ExitCode", "BatchHost", "StartTime", "EndTime")
        if k in fields
    )
    return f"job {job} ({state}); cluster logs kept in {keep}:\n" + "\n".join(parts)


def _assert_checkpoint(run_dir: Path) -> str:
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_file(), f"no {latest}"
    name = latest.read_text().strip()
    assert name.startswith("step_") and (run_dir / "checkpoints" / name).is_dir(), name
    return name


# -------------------------------------------------------------------------------------- tests ---


def _srun_lines(log: Path) -> dict[str, list[list[str]]]:
    """The srun command lines the launcher built (recorded by the pyxis shim), by step kind."""
    kinds: dict[str, list[list[str]]] = {}
    # the shim wrote each call with bash's %q (ANSI-C $'...' quoting for multi-line arguments): bash reads it back
    out = subprocess.run(
        [
            "bash",
            "-c",
            'while IFS= read -r line; do eval "a=($line)"; printf "%s\\0" "${a[@]}"; printf "\\1\\0"; done <"$1"',
            "_",
            str(log),
        ],
        capture_output=True,
        check=True,
    ).stdout
    calls = [c.split(b"\0")[:-1] for c in out.split(b"\1\0") if c]
    for argv in ([a.decode() for a in c] for c in calls):
        cmd = argv[-1] if argv else ""
        kind = (
            "head"
            if "ray start --head" in cmd
            else "workers"
            if "ray start --address" in cmd
            else "probe"
            if "ray_cluster.py' wait" in cmd
            else "watch"
            if "ray_cluster.py' watch" in cmd
            else "driver"
            if cmd.endswith("driver.sh")
            else "preflight"
            if "preflight" in cmd
            else "cleanup"
            if "enroot remove" in cmd
            else "other"
        )
        kinds.setdefault(kind, []).append(argv)
    return kinds


def _pinned_ports(nodes: dict) -> None:
    assert nodes["address"].endswith(f":{PINNED['gcs']}"), nodes
    for n in nodes["nodes"]:
        assert {k: n["ports"][k] for k in ("node_manager", "object_manager", "metrics_export")} == {
            k: PINNED[k] for k in ("node_manager", "object_manager", "metrics_export")
        }, n


def test_two_node_job_is_preempted_requeued_resumed_and_completes(cluster, images, tmp_path):
    """Success + preemption in one job (each Ray start costs ~30 s on the CI machine), launched as
    on a pyxis cluster and run in the local cluster's pyxis (slurm/local_cluster/pyxis: every step
    in a container root of the ``release`` image with only MOUNTS, no $HOME, the image's
    environment first): CONTAINER, MOUNTS = a shared folder and the nemo-granular checkout, no
    VENV, the driver started with the image's ``python``; a host UV_CACHE_DIR
    (UV_CACHE_DIR_OVERRIDE is refused with CONTAINER: tests/test_launch_checks.py), a host UV_PROJECT_ENVIRONMENT (the image's wins) and NEMO_RL_VENV_DIR
    (the launcher passes it with --container-env), a low soft ``ulimit -n``; from a home that
    holds the ``~/.ray/auth_token`` an earlier ``ray.init()`` left (Ray 2.60): the head and the
    joining nodes agreed on the auth mode only by chance before. The head node's name also maps
    to 127.0.1.1 (the cluster fixture): the head must bind its real address."""
    train = _driver_kind() == "train"
    shared, outside = tmp_path / "shared", tmp_path / "outside"
    shared.mkdir()
    outside.mkdir()
    run_dir, steps = shared / "run", (8 if train else 30)
    token = "token-an-earlier-ray-init-left-in-home-0123456789abcdef"
    home = _home(tmp_path / "home", token=token)
    srun_log, facts = shared / "srun.log", shared / "node_facts.txt"
    env = {
        "HOME": str(home),
        **_pyxis_env(cluster, images["release"], [shared, ROOT], srun_log),
        "WORKDIR": str(shared),
        "UV_CACHE_DIR": "/host/only/uv-cache",
        "UV_PROJECT_ENVIRONMENT": "/host/only/nemo_rl_venv",
        "NEMO_RL_VENV_DIR": str(shared / "venvs"),
        # what every step sees on its node once the launcher's environment is applied
        "SETUP_COMMAND": f'echo "$(hostname) $(ulimit -Sn) $(ulimit -Hn) ${{UV_CACHE_DIR-unset}} '
        f"$(command -v python) $UV_PROJECT_ENVIRONMENT $NEMO_RL_VENV_DIR $PWD "
        f"$([[ -e {outside} ]] && echo outside || echo no-outside) "
        f"$HOME $([[ -w $HOME ]] && echo writable || echo read-only) "
        f'$([[ -e {home} ]] && echo host-home || echo no-host-home) $(id -un)" >>{facts}',
        "PREEMPT_RESEND": "2",
        "DRIVER_HANDLES_PREEMPT": "1",
    }
    job = _submit(
        cluster,
        tmp_path,
        "ng-pre",
        _driver_cmd(run_dir, steps, every=100, slow=True, python="python"),
        env=env,
        soft_nofile=1024,
    )
    logs = shared / "slurm-logs" / f"ng-pre-{job}"
    # wait for the driver to make progress, then send what `--signal=B:USR1@T` sends before the limit
    _wait_for("2 steps of the first attempt", lambda: len(_steps(run_dir)) >= 2, cluster, job, tmp_path, 240)
    first = json.loads((logs / "ray_nodes.json").read_text())  # ray.nodes() seen before the driver
    _signal_usr1(cluster, job)

    # Slurm holds the requeued job for the credential lifetime (up.sh: cred_expire=30 s) and then
    # starts it by itself. Releasing it earlier (`scontrol update StartTime=now`, what this test
    # used to do) races slurmd's credential revocation of the first attempt: a new launch
    # credential from the same second as the revocation is refused ("already killed, do not
    # launch batch job") and the job ends FAILED without its batch script ever running.
    try:
        state = cluster.wait_terminal(job, timeout=420)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_explain(cluster, tmp_path, job)}") from None
    info = _explain(cluster, tmp_path, job)
    # the job succeeded, on both nodes, in both attempts
    assert state == "COMPLETED", info
    refused = [
        line
        for p in sorted((cluster.dir / "log").glob("slurmd-*.log"))
        for line in _job_lines(p.read_text(errors="replace"), job)
        if "do not launch" in line
    ]
    assert not refused, refused
    status = json.loads((logs / "status.json").read_text())
    assert status["exit_code"] == 0 and status["reason"] == "driver finished" and status["attempt"] == 1, status
    for nodes in (first, json.loads((logs / "ray_nodes.json").read_text())):
        assert nodes["alive"] == 2 and sorted(n["hostname"] for n in nodes["nodes"]) == ["ngt1", "ngt2"], nodes
        # each raylet named after its Slurm node (--node-name; Ray's default is the IP), which the watchdog
        # reports for a lost node
        assert sorted(n["node_name"] for n in nodes["nodes"]) == ["ngt1", "ngt2"], nodes
        assert len({n["ip"] for n in nodes["nodes"]}) == 2, nodes  # two distinct node IPs
        # the GRES gpu count reached Ray on every node
        assert [n["resources"].get("GPU") for n in nodes["nodes"]] == [float(FAKE_GPUS)] * 2, nodes
        # one auth mode for head, workers and probe (the job's own token), ray.sub's fixed ports
        assert nodes["auth_mode"] == "token", nodes
        _pinned_ports(nodes)
    # the home's token left alone, nothing else written there
    assert sorted(p.name for p in (home / ".ray").iterdir()) == ["auth_token"]
    assert (home / ".ray" / "auth_token").read_text() == token
    launcher = (logs / "launcher.log").read_text()
    assert launcher.count("RAY_NODES alive=2 expected=2") == 2, info
    if not train:
        assert json.loads((run_dir / "driver_ray_nodes.json").read_text())["alive"] == 2
    # container mode: the exact srun lines. Every step in the image with the mounts (+ the uv
    # cache at the container's uv cache) and the workdir; the head's steps (probe, watchdog,
    # driver) join the head's named container, as ray.sub runs its driver in it
    steps_by_kind = _srun_lines(srun_log)
    assert {k: len(v) >= 2 for k, v in steps_by_kind.items()} == dict.fromkeys(
        ("head", "workers", "probe", "watch", "driver", "cleanup"), True
    ), steps_by_kind.keys()
    # the job's named containers removed at the end of each attempt: a step per node, on the host
    cleanup = steps_by_kind.pop("cleanup")
    assert len(cleanup) == 4 and not [a for argv in cleanup for a in argv if a.startswith("--container")], cleanup
    # ... and gone: the emulation keeps named containers across jobs (pyxis' global scope) until then
    kept = sorted(p.name for p in Path(cluster.env["NG_PYXIS_STATE"]).glob("ngt*/pyxis_*"))
    assert not [k for k in kept if k.endswith(f"-{job}")], kept
    for kind, lines in steps_by_kind.items():
        name = f"ray-worker-{job}" if kind == "workers" else f"ray-head-{job}"
        for argv in lines:
            assert {
                f"--container-image={images['release']}",
                f"--container-name={name}",
                f"--container-mounts={shared}:{shared},{ROOT}:{ROOT}",
                f"--container-workdir={shared}",
                "--no-container-mount-home",
                "--container-env=NEMO_RL_VENV_DIR",
            } <= set(argv), (kind, argv)
    # every step on both nodes, inside the container: the soft file limit raised (ray.sub: 65535,
    # at most the hard limit), no host UV_CACHE_DIR, the image's python and UV_PROJECT_ENVIRONMENT,
    # the job's NEMO_RL_VENV_DIR, the workdir; nothing of the host outside MOUNTS, not the host's
    # $HOME: the container user's (not root), empty and read-only, as enroot's
    rows = [line.split() for line in facts.read_text().splitlines()]
    assert {r[0] for r in rows} == {"ngt1", "ngt2"} and len(rows) >= 8, rows
    for _host, soft, hard, uv, *inside in rows:
        assert int(soft) == (65535 if hard == "unlimited" or int(hard) >= 65535 else int(hard)) > 1024, rows
        assert uv == "unset", rows
        assert inside == [
            f"{IMAGE_BIN_INSIDE}/python",
            "/opt/nemo_rl_venv",
            str(shared / "venvs"),
            str(shared),
            "no-outside",
            pwd.getpwnam("nobody").pw_dir,
            "read-only",
            "no-host-home",
            "nobody",
        ], rows
    # preempted: checkpoint confirmed (exit 99), requeued once, resumed with no step lost or repeated
    assert int(cluster.job_fields(job)["Restarts"]) == 1, info
    assert "driver exited with code 99 after SIGUSR1" in launcher, info
    assert "requeued" in launcher and "attempt 1 on" in launcher, info
    done = _steps(run_dir)
    assert done == list(range(1, steps + 1)), f"lost or repeated steps: {done}\n{info}"
    assert _assert_checkpoint(run_dir) == f"step_{steps:06d}"
    driver_log = (logs / "driver.log").read_text()
    assert RESUMED.search(driver_log), info
    if not train:  # the stand-in records which attempt ran each step
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        first_resumed = next(r for r in rows if r["attempt"] == 1)
        assert 1 < first_resumed["step"] < steps and first_resumed["resumed_from"] == first_resumed["step"] - 1
    print(f"driver={_driver_kind()} job={job}: steps 1..{steps} over 2 attempts (preempted, requeued, resumed)")


def test_preempted_job_saves_on_sigterm_and_slurm_requeues_it(cluster, tmp_path):
    """Preemption with ``PreemptMode=REQUEUE`` does what ``scontrol requeue`` does: SIGTERM to every
    step (the driver's too) and to the batch shell, SIGKILL after KillWait, then Slurm requeues. The
    driver (a one-node embedded run, its state in its own process) must finish its step, save and
    exit 99, and the launcher must live until then and say so (its log pipe died of the same
    SIGTERM, and the launcher with it, before); the requeued job resumes, no step lost or repeated."""
    run_dir, steps = tmp_path / "run", (8 if _driver_kind() == "train" else 30)
    job = _submit(
        cluster,
        tmp_path,
        "ng-term",
        _driver_cmd(run_dir, steps, every=100, slow=True),
        nodes=1,
        env={"START_RAY": "0", "DRIVER_HANDLES_PREEMPT": "1"},
    )
    _wait_for("2 steps", lambda: len(_steps(run_dir)) >= 2, cluster, job, tmp_path, 240)
    cluster.run("scontrol", "requeue", job)
    state = cluster.wait_terminal(job, timeout=300)
    info = _explain(cluster, tmp_path, job)
    logs = tmp_path / "slurm-logs" / f"ng-term-{job}"
    assert state == "COMPLETED" and int(cluster.job_fields(job)["Restarts"]) == 1, info
    launcher = (logs / "launcher.log").read_text()
    assert "received SIGTERM" in launcher and "driver exited with code 99 after SIGTERM" in launcher, info
    assert "checkpoint saved after SIGTERM; not requeued by the launcher" in launcher, info
    assert _steps(run_dir) == list(range(1, steps + 1)), f"lost or repeated steps: {_steps(run_dir)}\n{info}"
    assert RESUMED.search((logs / "driver.log").read_text()), info


def test_gpus_per_node_contradicting_gres_fails_before_ray(cluster, tmp_path):
    cluster.env["GPUS_PER_NODE"] = str(FAKE_GPUS + 2)
    try:
        job = _submit(cluster, tmp_path, "ng-gres", ["true"])
    finally:
        cluster.env.pop("GPUS_PER_NODE")
    assert cluster.wait_terminal(job, timeout=120) == "FAILED"
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"ERROR: GPUS_PER_NODE={FAKE_GPUS + 2} but node ngt1 has GRES gpu:{FAKE_GPUS}" in out, out
    assert "starting the Ray head" not in out
    status = json.loads((tmp_path / "slurm-logs" / f"ng-gres-{job}" / "status.json").read_text())
    assert status["exit_code"] == 2 and "GPUS_PER_NODE" in status["reason"]


def test_launcher_refuses_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", str(LAUNCH), "echo", "hi"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "not inside a Slurm job" in r.stderr


def test_probe_that_cannot_import_ray_says_so_in_one_line():
    """(No cluster.) The probe's Python without ray (``-S``: no site-packages): one ERROR line, exit 7."""
    r = subprocess.run(
        [sys.executable, "-S", str(SLURM / "ray_cluster.py"), "wait", "--address=10.0.0.1:1200", "--expected=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 7, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        f"ERROR: Ray readiness probe: cannot import ray with {sys.executable} "
        "(ModuleNotFoundError: No module named 'ray')"
    ], r.stdout


def test_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        reason = _ensure_debian_packages()
        if reason or shutil.which("shellcheck") is None:
            pytest.skip(reason or "shellcheck not installable")
    scripts = (
        sorted(str(p) for p in SLURM.rglob("*.sh"))
        + [str(PYXIS / n) for n in ("srun", "enroot")]
        + [str(IMAGE_BIN / "python")]
    )
    assert len(scripts) >= 5, scripts
    r = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_submit_comparison_runs_both_losses_and_builds_the_report(cluster, tmp_path):
    """ESPO vs GSPO (configs differing only in the loss), same seed; afterany report job."""
    if importlib.util.find_spec("nemo_granular.embedded") is None:
        pytest.skip("the report job calls `nemo-granular compare --from-runs` (nemo_granular.embedded missing)")
    local = ROOT / "examples" / "configs" / "local"
    out = tmp_path / "cmp"
    r = cluster.run(
        "bash",
        str(SLURM / "submit_comparison.sh"),
        "--out",
        str(out),
        "--seed",
        "3",
        "--nodes",
        "1",
        str(local / "espo.yaml"),
        str(local / "gspo.yaml"),
        "--",
        "rl.steps=2",
        "rl.prompts_per_step=8",
        "rl.generations_per_prompt=4",
        "rl.eval_every=2",
        "warmstart.enabled=false",
        cwd=tmp_path,
    )
    ids = (out / "job_ids.txt").read_text().split()
    assert len(ids) == 3, r.stdout
    dep = cluster.job_fields(ids[2]).get("Dependency", "")
    assert f"afterany:{ids[0]}" in dep and f"afterany:{ids[1]}" in dep, dep
    for job in ids:  # the two 1-node runs share the cluster, then the report runs
        state = cluster.wait_terminal(job, timeout=300)
        assert state == "COMPLETED", f"{job}: {state}\n{_explain(cluster, out, job)}"
    for name in ("espo", "gspo"):
        assert _steps(out / name) == [1, 2], _explain(cluster, out, ids[0])
        cfg = (out / name / "config.yaml").read_text()
        assert "seed: 3" in cfg
    report = (out / "report" / "report.md").read_text()
    assert "espo" in report and "gspo" in report and "# nemo-granular comparison" in report
    launcher = (out / "slurm-logs").rglob("launcher.log")
    assert all("START_RAY=0" in p.read_text() for p in launcher)  # 1-node embedded runs need no Ray


CONTAINER_STORIES = "### Containers: NeMo-RL's release container, or a main checkout"  # docs/slurm.md
LAUNCH_STORY = "## One launch story: a comparison on a real cluster"


def _cluster_names(images: dict, lustre: Path, nodes: int) -> list[tuple[str, str]]:
    """The only changes the docs' launch stories get (docs_story.substitute): the images, the
    shared file system (``/lustre``: the test's folder; nemo-granular's checkout is this
    repository, so MOUNTS gets it too), the local cluster's nodes and GPUs per node."""
    return [
        ("/lustre/images/nemo-rl-v0.7.0.sqsh", str(images["release"])),
        ("/lustre/images/nemo-rl-7ea279abf.sqsh", str(images["deps"])),
        ("/lustre/nemo-granular", str(ROOT)),
        ("MOUNTS=/lustre:/lustre", f"MOUNTS=/lustre:/lustre,{ROOT}:{ROOT}"),
        ("/lustre", str(lustre)),
        ("-nodes 8", f"-nodes {nodes}"),
        ("-nodes=8", f"-nodes={nodes}"),
        ("gpu:8", f"gpu:{FAKE_GPUS}"),
    ]


def _nemo_rl_checkout(nemo_rl_src: Path, dest: Path) -> Path:
    """A NeMo-RL checkout as the launch story has one (WORKDIR): its package, examples and project."""
    dest.mkdir(parents=True)
    for name in ("nemo_rl", "examples"):  # copies: the source cache may lie under a folder the image
        shutil.copytree(nemo_rl_src / name, dest / name, symlinks=True)  # holds (/root/.cache): no mount there
    shutil.copy2(nemo_rl_src / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _stage_espo_benchmarks(lustre: Path) -> Path:
    """The launch stories' ``--data-dir /lustre/benchmarks``, staged as docs/slurm.md says, from
    local copies of the dataset repositories (no network here)."""
    from test_stage_benchmarks import write_mirror

    write_mirror(lustre / "mirror")
    bench = lustre / "benchmarks"
    staged = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_granular",
            "stage-benchmarks",
            "--suite",
            "espo",
            "--data-dir",
            str(bench),
            "--mirror",
            str(lustre / "mirror"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert staged.returncode == 0, staged.stderr
    return bench


EVAL_LAUNCHER = ROOT / "tests" / "harness" / "nemo_rl_eval_launcher.py"
ANSWER = "2"  # what the tiny model of the NeMo-RL comparison answers to every problem


@pytest.mark.nemo_rl
@pytest.mark.parametrize("story_kind", ["container", "bare_metal"])
def test_submit_comparison_of_nemo_rl_runs_builds_the_benchmark_report(
    cluster, nemo_rl_src, images, tmp_path, story_kind
):
    """ESPO vs GSPO on Qwen3-30B-A3B as docs/slurm.md's launch stories submit it: the page's
    commands, run word for word but the cluster's names (``_cluster_names``) and the CPU additions
    said below (WORKDIR = the NeMo-RL checkout, no NEMO_RL_SRC in the environment).

    ``bare_metal``: the story's step 5 (TORCH_CUDA_ARCH_LIST exported, no container, no VENV:
    nemo-granular and NeMo-RL from the submitting shell's Python, which stands in for NeMo-RL's
    locked venv: ``NEMO_RL_PYTHON`` is that Python running the stand-in driver, in place of
    ``uv run python``).
    ``container``: story (b), on a pyxis cluster
    (the local cluster's pyxis, its tasks as a non-root user: CONTAINER = the ``deps`` image,
    built from the NeMo-RL checkout that MOUNTS holds, Megatron only in its prebuilt Megatron
    worker venv, with nemo-granular's checkout mounted and no VENV; the checks before submission,
    the training, eval and report jobs all run in containers). Both with one node per run (the local
    cluster has two: the runs side by side), on a tiny Qwen3-MoE
    (``policy.model_name``) that answers ``\\boxed{2}`` to everything, with the NeMo-RL driver
    replaced by tests/harness/nemo_rl_logger_driver.py (the test image's ``python`` runs it for
    ``-m nemo_granular.run_grpo``: NG_STAND_IN_DRIVER): NeMo-RL's own load_config and Logger (TensorBoard) write the run
    directories, and a real Megatron checkpoint of the run's "trained" weights (the model plus
    seeded noise) is written by NeMo-RL's and Megatron-Bridge's code in the image's Megatron
    worker venv. Each run's eval job (--eval-suite espo) must pass the eval preflight in its
    container, offline, on the benchmarks staged by ``stage-benchmarks --mirror``, then REALLY
    evaluate: ``eval-checkpoints`` exports the checkpoint with the interpreter it chooses (the
    Megatron worker venv: the eval job's own Python has no Megatron-Bridge) and runs NeMo-RL's
    ``examples/run_eval.py`` on AIME24 (``--benchmarks aime24``: 3 staged problems x 32 samples at
    T=0.6; one benchmark for CI time) through ``--launcher tests/harness/nemo_rl_eval_launcher.py`` (vLLM
    replaced by transformers ``generate`` on CPU, Ray declaring the job's GPUs: docs/nemo-rl.md
    §7). The test then checks, independently: the
    exported weights equal the driver's trained weights (rounded to the run's bf16) and not the
    initial model's; the model, loaded here with transformers, answers each staged problem
    (NeMo-RL's prompt file and the model's chat template) greedily with what run_eval recorded
    for every sample; a verifier written here scores those answers, and evals.json and the
    report's benchmark table must hold those scores. The preflight checks every config before
    anything is submitted, and again in each training job: here the STAND-IN
    (``NG_FAKE_PREFLIGHT=1``), which records its command lines: the real one would rightly refuse
    these 64-GPU layouts on the local cluster's 2 GPUs per node; it runs on these configs, with
    the launch story's allocation, in
    ``test_submit_comparison_runs_the_real_preflight_on_the_shipped_configs``, and in jobs in the
    ``one_node_jobs`` tests."""
    from export_cpu.tiny_hf import make_answering_model

    cfgs = ROOT / "examples" / "configs"
    checkout = _nemo_rl_checkout(nemo_rl_src, tmp_path / "NeMo-RL")
    preflight, bench = tmp_path / "preflight.log", tmp_path / "benchmarks"
    model = tmp_path / "tiny-qwen3-moe"
    make_answering_model(model, f"\\boxed{{{ANSWER}}}")
    # the jobs run offline, so the eval preflight in each eval job's container passes only if it
    # finds every ESPO benchmark staged there
    assert _stage_espo_benchmarks(tmp_path) == bench
    staged_keys = ("aime24", "aime25", "math500", "hmmt25")
    assert sorted(p.name for p in bench.glob("*.jsonl")) == sorted(f"{k}.jsonl" for k in staged_keys)
    keys = ("aime24",)  # evaluated (CI time: each benchmark is one run_eval, a NeMo-RL import and a Ray start)
    # docs/slurm.md's story (b), word for word but the cluster's names (docs_story.py); on CPU, the
    # eval job's additions for the local cluster's 2 GPUs per node (vLLM TP 2; the run's is 4), the one
    # benchmark, transformers in place of vLLM, one math-verify worker (NeMo-RL's MathEnvironment
    # starts num_workers Ray actors); after `--`, a short run of the tiny model
    container = story_kind == "container"
    nodes = 1  # the two runs side by side on the two nodes (a two-node Ray in the image: the preemption test)
    eval_args = (
        '"--data-dir /lustre/benchmarks"',
        f'"--data-dir /lustre/benchmarks --gpus-per-node 2 --tensor-parallel 2 '
        f'--benchmarks {",".join(keys)} --launcher {EVAL_LAUNCHER} env.math.num_workers=1"',
    )
    if container:
        script = substitute(
            story(bash_blocks(CONTAINER_STORIES)[0], "b", skip=("git clone",)),
            [eval_args, ("/lustre/images/nemo-rl-7ea279abf.sqsh", str(images["deps"]))],
        )
        out, logs = tmp_path / "comparisons" / "espo-vs-gspo", tmp_path / "slurm-logs"
    else:
        script = substitute(
            story(bash_block(LAUNCH_STORY, "submit_comparison.sh --seed 0 --nodes 8")),
            [eval_args, ("ACCOUNT", "ngtest"), ("PARTITION", "local")],
        )
        out = tmp_path / "comparisons" / "espo-vs-gspo-seed0"
        logs = out / "slurm-logs"
    script = substitute(script, _cluster_names(images, tmp_path, nodes=nodes), each=False)
    script = script.rstrip("\n") + f" -- grpo.max_num_steps=4 grpo.val_period=2 policy.model_name={model}\n"
    env = _env(
        cluster.env,
        {
            "PATH": f"{PYXIS}:{Path(sys.executable).parent}:{cluster.env['PATH']}",
            "VENV": None,
            "NG_STAND_IN_DRIVER": str(NRL_DRIVER),
            "NG_FAKE_STEP_SECONDS": "0.2",
            "NG_FAKE_PREFLIGHT": "1",
            "NG_FAKE_PREFLIGHT_LOG": str(preflight),
            "NEMO_RL_SRC": None,
        },
    )  # (on the submit host NeMo-RL stays importable through PYTHONPATH)
    if not container:  # `uv run python` in NeMo-RL's locked venv: this Python with the stand-in driver
        env["NEMO_RL_PYTHON"] = f"{sys.executable} {NRL_DRIVER}"
        worker_python = _bare_metal_megatron_worker_venv(checkout)
        # NeMo-RL's venv of a bare `uv sync` has no Megatron (its `mcore` extra is the worker venv's)
        megatron = {
            Path(os.environ[v]).resolve() for v in ("MEGATRON_LM_SRC", "MEGATRON_BRIDGE_SRC") if os.environ.get(v)
        }
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() not in megatron
        )
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, script + r.stdout + r.stderr
    ids = (out / "job_ids.txt").read_text().split()
    assert len(ids) == 5, r.stdout  # 2 training jobs, 2 eval jobs, the report
    # the preflight ran for both configs before any submission (the submit host; both at once, in
    # either order), with the runs' overrides and the allocation
    checked = preflight.read_text().splitlines()
    assert sorted(c.split()[0] for c in checked[:2]) == [
        str(cfgs / "espo_qwen3_30b_a3b_megatron.yaml"),
        str(cfgs / "gspo_qwen3_30b_a3b_megatron.yaml"),
    ], checked
    assert all(
        "grpo.seed=0" in c and f"cluster.num_nodes={nodes}" in c and "cluster.gpus_per_node=2" in c for c in checked[:2]
    ), checked
    # the training jobs got the GPUs and the long limit, the report job its own small allocation
    for job in ids[:4]:
        f = cluster.job_fields(job)
        assert f.get("TimeLimit") == "04:00:00" and "gpu:2" in (f.get("TresPerNode", "") + f.get("Gres", "")), f
    rf = cluster.job_fields(ids[4])
    assert rf.get("TimeLimit") == "00:30:00" and "gpu" not in rf.get("TresPerNode", "") + rf.get("Gres", ""), rf
    for job in ids:
        state = cluster.wait_terminal(job, timeout=900)
        assert state == "COMPLETED", f"{job}: {state}\n{_explain(cluster, out, job)}"
    print(f"NeMo-RL comparison: jobs done {time.monotonic() - t0:.0f} s after submission")
    # each training job ran the preflight again on its node, before its driver
    assert len(preflight.read_text().splitlines()) == 4
    report = (out / "report" / "report.md").read_text()
    scored = []
    for name in ("espo_qwen3_30b_a3b_megatron", "gspo_qwen3_30b_a3b_megatron"):
        run = out / name
        assert list((run / "logs").glob("exp_*/tensorboard/events.out.tfevents.*")), _explain(cluster, out, ids[0])
        drv = next(logs.glob(f"cmp-{name}-*/driver.log")).read_text()
        # the launcher appended the allocation to the NeMo-RL command line
        assert f"cluster.num_nodes={nodes}" in drv and "gpus/node=2" in drv, drv
        # its Ray cluster was up (the head, in the image with CONTAINER)
        launcher = next(logs.glob(f"cmp-{name}-*/launcher.log")).read_text()
        assert f"RAY_NODES alive={nodes} expected={nodes}" in launcher, launcher
        # the checkpoint: Megatron's, written in the Megatron worker venv (the image's; bare metal:
        # the checkout's, which step 4 builds)
        exporter = f"/opt/ray_venvs/{MEGATRON_WORKER}/bin/python" if container else str(worker_python)
        assert f"with {exporter}" in drv, drv
        assert (run / "checkpoints" / "step_4" / "policy" / "weights" / "latest_checkpointed_iteration.txt").is_file()
        ev = next(out.glob(f"slurm-cmp-eval-{name}-*.out")).read_text()
        # the export ran with the Megatron worker venv's Python (the eval job's own has no Megatron-Bridge)
        assert f"Megatron checkpoints exported by {exporter}" in ev, ev
        # NeMo-RL's run_eval in the checkout, the benchmark from its staged file (the eval preflight
        # checked every benchmark of the suite first); only the one asked for
        assert f"(cd {checkout} && {EVAL_LAUNCHER} --config" in ev, ev
        assert [k for k in staged_keys if f"data.dataset_name={bench}/{k}.jsonl" in ev] == list(keys), ev
        _assert_exported_weights(run / "hf" / "step_4", run / "stand_in" / "trained_hf", model)
        expected = _independent_scores(run / "hf" / "step_4", bench, checkout, keys)
        scored += [v["score"] for v in expected.values()]
        # every sample run_eval scored is the model's greedy answer (sampling at T=0.6 cannot move it)
        for key in keys:
            data = json.loads((run / "evals" / "espo" / "step_4" / key / "evaluation_data.json").read_text())
            rows = data["evaluation_data"]
            samples = 1 if key == "math500" else 32
            assert len(rows) == samples * len(expected[key]["answers"]), (key, len(rows))
            assert {r["response"] for r in rows} == {expected[key]["response"]}, (key, rows[:2])
        scores = json.loads((run / "evals.json").read_text())["suites"]["espo"]["checkpoints"]["4"]
        assert scores == pytest.approx({k: expected[k]["score"] for k in keys}, abs=1e-9), scores
        row = next(
            line
            for line in report.splitlines()
            if line.startswith(f"| {name} | 1 |") and line.rstrip().endswith("| 4 |")
        )
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2 : 2 + len(keys)] == [f"{expected[k]['score']:.3f}" for k in keys], (row, expected)
    assert max(scored) > 0 and min(scored) < 1, scored  # neither all right nor all wrong
    assert "Runs: 2 usable of 2" in report, report[:600]
    assert "## Benchmark suite" in report and "| AIME24 | 3 | 32 | T=0.6, top-p 1" in report, report
    assert any(
        line.startswith("| ESPO reaches a higher final validation accuracy than GSPO") and "ESPO 0." in line
        for line in report.splitlines()
    ), report
    assert str(model) in report


def _bare_metal_megatron_worker_venv(checkout: Path) -> Path:
    """What the bare-metal story's step 4 (``preflight --build-venvs``) leaves in the checkout: NeMo-RL's
    Megatron worker venv under ``<checkout>/venvs`` (NEMO_RL_VENV_DIR's default), the only Python with
    Megatron-LM and Megatron-Bridge (NeMo-RL's ``mcore`` extra). Here it is this environment's packages
    with the Megatron sources and the shared CPU stand-ins in place of Transformer Engine and CUDA (as
    the ``deps`` image's worker venv has them: docs/nemo-rl.md §7); its python path."""
    venv = checkout / "venvs" / MEGATRON_WORKER
    pyver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    base = Path(os.path.realpath(sys.executable))
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(base)
    (venv / "pyvenv.cfg").write_text(
        f"home = {base.parent}\ninclude-system-site-packages = false\n"
        f"version = {sys.version_info[0]}.{sys.version_info[1]}\n"
    )
    site = venv / "lib" / pyver / "site-packages"
    site.mkdir(parents=True)
    sources = [os.environ[v] for v in ("MEGATRON_LM_SRC", "MEGATRON_BRIDGE_SRC") if os.environ.get(v)]
    lines = [
        *sources,
        str(ROOT / "tests" / "harness"),
        "import cpu_stand_ins; cpu_stand_ins.install()",
        sysconfig.get_paths()["purelib"],
    ]
    (site / "image_worker.pth").write_text("\n".join(lines) + "\n")
    return venv / "bin" / "python"


def _assert_exported_weights(exported: Path, trained: Path, initial: Path) -> None:
    """The eval job's export holds the driver's trained weights, as the run's bf16 held them
    (bit-exact), and not the initial model's (``policy.model_name``, which the export reads for the
    architecture)."""
    import torch
    from transformers import AutoModelForCausalLM

    def weights(path: Path, bf16: bool) -> dict:
        sd = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
        return {k: (v.to(torch.bfloat16) if bf16 else v).float() for k, v in sd.items()}

    got, want, start = weights(exported, False), weights(trained, True), weights(initial, True)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])][:5]
    assert sum(not torch.equal(got[k], start[k]) for k in got) > len(got) // 2


def _independent_scores(model: Path, bench: Path, checkout: Path, keys) -> dict:
    """Per benchmark: the exported model's greedy response to each problem (transformers
    ``generate`` here, on NeMo-RL's prompt file formatted with the problem, in the model's chat
    template; the model answers the same to every prompt, tests/harness/export_cpu/tiny_hf.py, so they
    must agree), the staged answers, and the score a verifier written here gives them (the last
    ``\\boxed{}`` equals the answer, numerically for numbers and ``\\sqrt{n}``)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    prompt = (checkout / "examples" / "prompts" / "cot.txt").read_text()

    def value(text: str) -> float | None:
        text = text.strip()
        m = re.fullmatch(r"\\sqrt\{(\d+)\}", text)
        if m:
            return math.sqrt(int(m.group(1)))
        try:
            return float(text)
        except ValueError:
            return None

    def reward(response: str, answer: str) -> float:
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", response)
        got, want = (value(boxed[-1]) if boxed else None), value(answer)
        return float(got is not None and want is not None and math.isclose(got, want))

    out = {}
    for key in keys:
        rows = [json.loads(x) for x in (bench / f"{key}.jsonl").read_text().splitlines() if x.strip()]
        responses = set()
        for row in rows:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt.format(row["problem"])}], tokenize=False, add_generation_prompt=True
            )
            ids = torch.tensor([tok(text)["input_ids"]])
            with torch.no_grad():
                new = lm.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=32,
                    do_sample=False,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            responses.add(tok.decode(new[0, ids.shape[1] :].tolist(), skip_special_tokens=True))
        assert len(responses) == 1, responses
        response = responses.pop()
        assert response == f"\\boxed{{{ANSWER}}}", response
        answers = [row["answer"] for row in rows]
        out[key] = {
            "response": response,
            "answers": answers,
            "score": sum(reward(response, a) for a in answers) / len(answers),
        }
    return out


def _without_nemo_rl_src(env: dict) -> dict:
    """Overrides for ``env`` (None = unset) so that it is a NeMo-RL cluster's: no ``NEMO_RL_SRC``
    and NeMo-RL not on ``PYTHONPATH`` (``nemo_rl`` is importable only where a NeMo-RL checkout is
    the working directory, as with ``uv run`` there), and ``TORCH_CUDA_ARCH_LIST`` as the docs' bare-metal
    story exports it (NeMo-RL refuses a Megatron config without it; its image sets the same value)."""
    src = Path(os.environ["NEMO_RL_SRC"]).resolve()
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != src]
    return {"NEMO_RL_SRC": None, "TORCH_CUDA_ARCH_LIST": IMAGE_CUDA_ARCHS, "PYTHONPATH": os.pathsep.join(path)}


def _env(base: dict, overrides: dict) -> dict:
    return {k: v for k, v in {**base, **overrides}.items() if v is not None}


REAL_PREFLIGHT_DRY_RUNS = "test_submit_comparison_runs_the_real_preflight_on_the_shipped_configs"
DRY_RUN_SHIPPED = tuple(
    str(ROOT / "examples" / "configs" / f"{a}_qwen3_30b_a3b_megatron.yaml") for a in ("espo", "gspo")
)
DRY_RUN_FIXTURE = str(ROOT / "tests" / "harness" / "preflight_fixtures" / "espo_qwen3_30b_a3b_before_defer_fix.yaml")
DRY_RUN_SPPO = str(ROOT / "examples" / "configs" / "sppo_r1_distill_qwen_1.5b.yaml")


@pytest.fixture(scope="module", autouse=True)
def real_preflight_dry_runs(request, tmp_path_factory):
    """The dry runs of ``test_submit_comparison_runs_the_real_preflight_on_the_shipped_configs``,
    started in the background when this module starts (if that test is selected and NeMo-RL is
    there): their CPU, four NeMo-RL imports, then overlaps the cluster tests' idle waits (Slurm
    holds a requeued job ~30 s) instead of adding to the module's time. The test waits for them.

    ``good``: docs/slurm.md's bare-metal story (step 5), the page's commands word for word but
    ``/lustre`` (the test's folder, nemo-granular's checkout this repository) and the account and
    partition, with ``--dry-run`` added: the shipped ESPO/GSPO Qwen3-30B-A3B pair (``run_grpo``), 8
    nodes x 8 GPUs, WORKDIR = the NeMo-RL checkout, NeMo-RL importable only there
    (``NEMO_RL_PYTHON`` = a plain Python for ``uv run python``, which needs NeMo-RL's locked venv:
    its ``-m`` puts the working directory first on ``sys.path``), the ESPO benchmarks staged in
    ``--data-dir`` (the story runs offline). ``bad``: the shipped SPPO config (``run_sppo``:
    ``--driver sppo``, ``ppo.seed``) next to ESPO's config before its Megatron fix."""
    runs: dict[str, subprocess.Popen] = {}
    wanted = any(getattr(item, "originalname", item.name) == REAL_PREFLIGHT_DRY_RUNS for item in request.session.items)
    if wanted and os.environ.get("NEMO_RL_SRC"):
        d = tmp_path_factory.mktemp("dry-runs")
        checkout = _nemo_rl_checkout(Path(os.environ["NEMO_RL_SRC"]).resolve(), d / "NeMo-RL")
        env = _env(
            os.environ,
            {"NEMO_RL_PYTHON": sys.executable, "WORKDIR": str(checkout), **_without_nemo_rl_src(dict(os.environ))},
        )
        _stage_espo_benchmarks(d)
        script = substitute(
            story(bash_block(LAUNCH_STORY, "submit_comparison.sh --seed 0 --nodes 8")),
            [
                ("/slurm/submit_comparison.sh ", "/slurm/submit_comparison.sh --dry-run "),
                ("/lustre/nemo-granular", str(ROOT)),
                ("/lustre", str(d)),
                ("ACCOUNT", "ngtest"),
                ("PARTITION", "local"),
            ],
        )
        runs["good"] = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=d,
            start_new_session=True,
        )
        runs["good"].out = d / "comparisons" / "espo-vs-gspo-seed0"
        args = [
            "bash",
            str(SLURM / "submit_comparison.sh"),
            "--dry-run",
            "--out",
            str(d / "bad"),
            "--seed",
            "3",
            "--nodes",
            "8",
            "--train-sbatch",
            "--gres=gpu:8 --time=4:00:00",
            DRY_RUN_SPPO,
            DRY_RUN_FIXTURE,
            "--",
            "~logger.mlflow",
            "logger.monitor_gpus=false",
        ]
        runs["bad"] = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d, start_new_session=True
        )
        runs["dir"] = d
    yield runs
    for proc in runs.values():
        if isinstance(proc, subprocess.Popen) and proc.poll() is None:  # the test did not get to them
            os.killpg(proc.pid, 9)
            proc.communicate()


@pytest.mark.nemo_rl
def test_submit_comparison_runs_the_real_preflight_on_the_shipped_configs(nemo_rl_src, real_preflight_dry_runs):
    """The REAL preflight in ``submit_comparison.sh`` (no cluster: ``--dry-run``; the runs are
    started by the ``real_preflight_dry_runs`` fixture). Both shipped Qwen3-30B-A3B configs pass,
    with the launch story's allocation and the runs' overrides (``~key`` too); the preflight's
    warnings (missing worker venvs, model config not cached) do not stop the
    submission, and the sbatch lines follow. Next to the shipped SPPO config (run_sppo's argv),
    the ESPO config before its Megatron fix stops the submission: exactly the preflight's own line
    for it, none for the SPPO config, exit 1. Where NeMo-RL is not importable the preflight's own
    reason stops it; ``--no-preflight`` skips the check."""
    good, bad = real_preflight_dry_runs["good"], real_preflight_dry_runs["bad"]
    (good_out, good_err), (bad_out, bad_err) = good.communicate(timeout=600), bad.communicate(timeout=600)
    assert good.returncode == 0, good_out + good_err
    sbatch = [line for line in good_err.splitlines() if line.startswith("sbatch")]
    assert len(sbatch) == 5 and all("grpo.seed=0" in line for line in sbatch[:2]), (
        good_err
    )  # 2 runs, 2 evals, the report
    assert not good.out.exists() and good.out.parent.is_dir() is False, good.out
    assert bad.returncode == 1 and "sbatch" not in bad_err and not bad_out, bad_out + bad_err
    assert bad_err.splitlines() == [
        f"submit_comparison: preflight: {DRY_RUN_FIXTURE}: policy.logprob_chunk_size=2048 needs "
        "policy.megatron_cfg.defer_fp32_logits: true (NeMo-RL: 'defer_fp32_logits must be True if "
        "logprob_chunk_size is set') [nemo_rl/models/megatron/setup.py:_validate_chunking_config]",
        "submit_comparison: nothing submitted; fix the configs (nemo-granular preflight CONFIG shows the plan) "
        "or pass --no-preflight",
    ], bad_err
    # a Python without NeMo-RL (WORKDIR is not the checkout): the preflight cannot check (its exit
    # 2), and its one-line reason is the submission's
    d = real_preflight_dry_runs["dir"]
    args = ["bash", str(SLURM / "submit_comparison.sh"), "--dry-run", "--nodes", "8", *DRY_RUN_SHIPPED]
    env = _env(
        os.environ, {"NEMO_RL_PYTHON": sys.executable, "WORKDIR": str(d), **_without_nemo_rl_src(dict(os.environ))}
    )
    none = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=d)
    assert none.returncode == 1 and len(none.stderr.splitlines()) == 3, none.stderr  # a line each, then what to do
    for cfg, line in zip(DRY_RUN_SHIPPED, none.stderr.splitlines()):
        assert (
            line == f"submit_comparison: preflight: {cfg}: NeMo-RL is not importable here (missing 'nemo_rl'): run "
            "preflight in NeMo-RL's environment like the drivers (e.g. `uv run python -m nemo_granular "
            "preflight ...` in the NeMo-RL checkout)"
        ), none.stderr
    # --no-preflight (experts) submits without checking
    skip = subprocess.run(
        [*args[:3], "--no-preflight", *args[3:]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "NEMO_RL_PYTHON": "/nonexistent/python"},
        cwd=d,
    )
    assert skip.returncode == 0 and len([x for x in skip.stderr.splitlines() if x.startswith("sbatch")]) == 3, (
        skip.stderr
    )


@pytest.mark.nemo_rl
def test_submit_comparison_preflights_in_the_image_with_its_python(cluster, nemo_rl_src, images, tmp_path):
    """Issue 33.1-2: with CONTAINER nothing of the launch story is installed on the submit host, and
    with the release image WORKDIR (/opt/nemo-rl) exists only in the image: the REAL preflight of
    every config must run in the image, as one one-task container step (``srun --ntasks=1`` with
    launch.sh's container options), with the image's ``python`` (``uv run`` fails there), before
    anything is submitted. The step runs as enroot runs a user's container (the local cluster's
    pyxis, by default: ``nobody``, not root, HOME an empty directory it cannot write, uv with no
    index and an empty cache). Configs: the shipped SSPO config (passes: no line) and a copy of
    the GSPO config outside MOUNTS (the jobs would not see it: refused in the image, one line); exit
    1, nothing written. An explicit ``NEMO_RL_PYTHON="uv run python"`` still wins, and then fails in
    the image with uv's own reason; a container step that cannot start stops the submission with one
    line, exit 2."""
    shipped = ROOT / "examples" / "configs" / "sspo_qwen2.5_math_1.5b.yaml"
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    hidden = elsewhere / "gspo_qwen2.5_math_1.5b.yaml"
    shutil.copy(ROOT / "examples" / "configs" / "gspo_qwen2.5_math_1.5b.yaml", hidden)
    srun_log, out = tmp_path / "srun.log", shared / "cmp"
    env = _env(
        cluster.env,
        {
            **_pyxis_env(cluster, images["release"], [shared, ROOT], srun_log),
            "WORKDIR": "/opt/nemo-rl",
            "NEMO_RL_PYTHON": None,
            **_without_nemo_rl_src(cluster.env),
        },
    )
    args = [
        "bash",
        str(SLURM / "submit_comparison.sh"),
        "--dry-run",
        "--out",
        str(out),
        "--nodes",
        "1",
        "--train-sbatch",
        f"--gres=gpu:{FAKE_GPUS} --time=4:00:00",
        str(shipped),
        str(hidden),
    ]
    t0 = time.monotonic()
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    print(f"submission preflight in the image: {time.monotonic() - t0:.0f} s")
    assert r.returncode == 1 and not r.stdout, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"submit_comparison: preflight: {hidden}: {hidden}: config file not found",
        "submit_comparison: nothing submitted; fix the configs (nemo-granular preflight CONFIG shows the plan) "
        "or pass --no-preflight",
    ], r.stderr
    assert not out.exists()
    steps = _srun_lines(srun_log)
    assert list(steps) == ["preflight"] and len(steps["preflight"]) == 1, steps
    [step] = steps["preflight"]
    assert {
        "--nodes=1",
        "--ntasks=1",
        f"--container-image={images['release']}",
        "--container-workdir=/opt/nemo-rl",
        f"--container-mounts={shared}:{shared},{ROOT}:{ROOT}",
        "--no-container-mount-home",
    } <= set(step), step
    script = step[-1]
    assert f"exec python -m nemo_granular preflight --driver grpo {shipped} grpo.seed=0" in script, script
    assert "uv run" not in script and "NG_CONTAINER=" in script, script

    # the user's NEMO_RL_PYTHON wins; `uv run` in the image fails (no writable cache, no index)
    uv = subprocess.run(
        args, env={**env, "NEMO_RL_PYTHON": "uv run python"}, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert uv.returncode == 1 and not out.exists(), uv.stderr
    home = pwd.getpwnam("nobody").pw_dir  # HOME in the container (enroot's: the user's, empty, read-only)
    for cfg in (shipped, hidden):
        assert (
            f"submit_comparison: preflight: {cfg}: error: Failed to initialize cache at `{home}/.cache/uv`"
            in uv.stderr.splitlines()
        ), uv.stderr
    # a container step that cannot start: one line, exit 2, nothing submitted or written
    broken = subprocess.run(
        args,
        env={**env, "MOUNTS": f"{tmp_path / 'missing'}:/x"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert broken.returncode == 2 and not broken.stdout and not out.exists(), broken.stderr
    [line] = broken.stderr.splitlines()
    assert line.startswith(
        f"submit_comparison: preflight: the checks could not run in the image (srun "
        f"--container-image={images['release']} exited "
    ) and line.endswith(f"--container-mounts: {tmp_path / 'missing'}: No such file or directory; nothing submitted"), (
        line
    )


def test_submit_comparison_starts_nemo_rl_with_the_images_python_in_a_container(tmp_path):
    """Issue 33.2 (no cluster: ``--dry-run --no-preflight``): with CONTAINER the drivers start with
    the image's ``python`` (NEMO_RL_PYTHON's default there; ``uv run python`` on bare metal), and
    the eval jobs' containers get NG_CONTAINER, so ``eval-checkpoints`` starts ``run_eval`` with it
    too (tests/test_evals.py); an explicit NEMO_RL_PYTHON wins."""
    cfgs = [str(ROOT / "examples" / "configs" / f"{a}_qwen3_30b_a3b_megatron.yaml") for a in ("espo", "gspo")]
    checkout = _fake_nemo_rl_checkout(tmp_path / "NeMo-RL")

    def sbatch_lines(**env) -> list[str]:
        r = subprocess.run(
            [
                "bash",
                str(SLURM / "submit_comparison.sh"),
                "--dry-run",
                "--no-preflight",
                "--nodes",
                "8",
                "--eval-suite",
                "espo",
                "--nemo-rl",
                str(checkout),
                *cfgs,
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=_env(
                os.environ,
                {"CONTAINER": None, "VENV": None, "NEMO_RL_PYTHON": None, "MOUNTS": f"{tmp_path}:{tmp_path}", **env},
            ),
        )
        assert r.returncode == 0, r.stderr
        return [line for line in r.stderr.splitlines() if line.startswith("sbatch")]

    def driver(line: str) -> str:
        return line.split("/launch.sh ", 1)[1].split(" -m ", 1)[0]

    image = sbatch_lines(CONTAINER="/lustre/images/nemo-rl.sqsh")
    assert [driver(x) for x in image[:2]] == ["python"] * 2, image
    assert all("NG_CONTAINER=/lustre/images/nemo-rl.sqsh" in x for x in image[2:4]), image
    assert [driver(x) for x in sbatch_lines()[:2]] == ["uv run python"] * 2
    own = sbatch_lines(CONTAINER="/lustre/images/nemo-rl.sqsh", NEMO_RL_PYTHON="/opt/venv/bin/python")
    assert [driver(x) for x in own[:2]] == ["/opt/venv/bin/python"] * 2, own


def test_submit_comparison_dry_run_writes_nothing_and_keeps_training_resources_off_the_report(tmp_path):
    local = ROOT / "examples" / "configs" / "local"
    out = tmp_path / "cmp"
    r = subprocess.run(
        [
            "bash",
            str(SLURM / "submit_comparison.sh"),
            "--dry-run",
            "--out",
            str(out),
            "--sbatch",
            "-A acct -p part",
            "--train-sbatch",
            "--gres=gpu:8 --time=4:00:00",
            str(local / "espo.yaml"),
            str(local / "gspo.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert not out.exists(), "a dry run created the comparison directory"
    sbatch = [line for line in r.stderr.splitlines() if line.startswith("sbatch")]
    assert len(sbatch) == 3, r.stderr
    assert all("-A acct -p part" in line for line in sbatch)
    assert all("--gres=gpu:8" in line and "--time=4:00:00" in line for line in sbatch[:2])
    assert "--gres" not in sbatch[2] and "--time=00:30:00" in sbatch[2] and "--dependency=afterany:" in sbatch[2]
    bad = subprocess.run(
        [
            "bash",
            str(SLURM / "submit_comparison.sh"),
            "--dry-run",
            "--sbatch",
            "--gres=gpu:8",
            str(local / "espo.yaml"),
            str(local / "gspo.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "--train-sbatch" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_submit_comparison_eval_jobs_follow_training_and_precede_the_report(tmp_path):
    """--eval-suite: one eval job per run, afterok on its training job, with the training
    resources on one node; the report waits for training AND eval jobs."""
    local = ROOT / "examples" / "configs" / "local"
    r = subprocess.run(
        [
            "bash",
            str(SLURM / "submit_comparison.sh"),
            "--dry-run",
            "--out",
            str(tmp_path / "cmp"),
            "--train-sbatch",
            "--gres=gpu:8",
            "--eval-suite",
            "espo",
            "--eval-args",
            "--data-dir /data",
            str(local / "espo.yaml"),
            str(local / "gspo.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    sbatch = [line for line in r.stderr.splitlines() if line.startswith("sbatch")]
    assert len(sbatch) == 5, r.stderr
    train_ids = re.findall(r"job (DRYRUN\d+) ->", r.stdout)[:2]
    eval_ids = re.findall(r"eval of \S+ \(suite espo\): job (DRYRUN\d+) \(after (DRYRUN\d+)\)", r.stdout)
    assert [after for _, after in eval_ids] == train_ids, r.stdout
    for line, tid in zip(sbatch[2:4], train_ids):
        assert f"--dependency=afterok:{tid}" in line and "--nodes=1" in line and "--gres=gpu:8" in line
        assert "eval-checkpoints" in line and "--suite" in line and "espo" in line and "--data-dir" in line
    report_dep = re.search(r"--dependency=afterany:(\S+)", sbatch[4]).group(1).split(":")
    assert sorted(report_dep) == sorted(train_ids + [e for e, _ in eval_ids])
    bad = subprocess.run(
        [
            "bash",
            str(SLURM / "submit_comparison.sh"),
            "--dry-run",
            "--eval-suite",
            "aime",
            str(local / "espo.yaml"),
            str(local / "gspo.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "--eval-suite" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_max_restarts_default_covers_the_30b_pair_at_4_hours_per_attempt():
    """Issue 24.9: launch.sh's MAX_RESTARTS default against the arithmetic docs/slurm.md states:
    the 30B pair's grpo.max_num_steps, its checkpoint_must_save_by (4 h jobs), the docs' per-step
    estimate, one step's time for setup per attempt. The default must cover it, also with steps
    twice as slow; the old default (20) did not (the docs' "step ~300")."""
    cfg = yaml.safe_load((ROOT / "examples" / "configs" / "espo_qwen3_30b_a3b_megatron.yaml").read_text())
    steps = cfg["grpo"]["max_num_steps"]
    d, h, m, sec = map(int, cfg["checkpointing"]["checkpoint_must_save_by"].split(":"))
    budget = ((d * 24 + h) * 60 + m) * 60 + sec
    default = int(re.search(r"^MAX_RESTARTS=\$\{MAX_RESTARTS:-(\d+)\}", LAUNCH.read_text(), re.M).group(1))
    docs = (ROOT / "docs" / "slurm.md").read_text().splitlines()
    row = next(line for line in docs if line.startswith("| `MAX_RESTARTS` |"))
    minutes = int(re.search(r"a step of about (\d+) minutes", row).group(1))
    restarts_doc, per_attempt_doc = map(int, re.search(r"e\.g\. (\d+) at (\d+) steps per attempt", row).groups())

    def restarts(step_s: float) -> tuple[int, int]:  # (steps per attempt, restarts after the first attempt)
        per_attempt = budget // step_s - 1  # one step's time goes to setup (Ray, Megatron, vLLM)
        return int(per_attempt), math.ceil(steps / per_attempt) - 1

    per_attempt, needed = restarts(minutes * 60)
    slow = restarts(2 * minutes * 60)[1]
    assert (per_attempt, needed) == (per_attempt_doc, restarts_doc), row  # the docs' numbers
    assert f"twice as slow need {slow};" in row and f"| {default} |" in row, row
    assert default >= needed and default >= slow, (default, needed, slow)
    assert 20 < needed and per_attempt * 21 == int(re.search(r"at step (\d+)", row).group(1)), row


def _fake_nemo_rl_checkout(d: Path) -> Path:
    """What submit_comparison.sh checks of a NeMo-RL checkout (--nemo-rl): examples/run_eval.py, nemo_rl/."""
    (d / "examples").mkdir(parents=True)
    (d / "examples" / "run_eval.py").write_text("")
    (d / "nemo_rl").mkdir()
    return d


def test_submit_comparison_eval_jobs_run_the_eval_preflight_first(tmp_path):
    """Issue 24: each NeMo-RL run's eval job runs ``python -m nemo_granular.preflight.eval_checks``
    first, in the same place as eval-checkpoints (its container with CONTAINER), with the suite,
    the run, the checkout and --eval-args' --data-dir/--export-python; it fails the job before any
    export. The dry run's --wrap script is then EXECUTED (no container): with a benchmark not
    staged it stops with the preflight's line and eval-checkpoints never starts; with the run's
    Megatron checkpoint and no interpreter that has Megatron-Bridge it stops with that line; with
    the data staged and no Megatron checkpoint the check passes and eval-checkpoints runs (and
    says what it lacks: the run has no checkpoints)."""
    cfgs = [str(ROOT / "examples" / "configs" / f"{a}_qwen3_30b_a3b_megatron.yaml") for a in ("espo", "gspo")]
    checkout, data, out = _fake_nemo_rl_checkout(tmp_path / "NeMo-RL"), tmp_path / "bench", tmp_path / "cmp"
    data.mkdir()
    for key in ("aime24", "aime25", "math500"):  # hmmt25 missing
        (data / f"{key}.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    # no interpreter with Megatron-Bridge: not the driver's either (the NeMo-RL world puts its sources on PYTHONPATH)
    bridge = os.environ.get("MEGATRON_BRIDGE_SRC")
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not (bridge and p == bridge)]
    env = _env(
        os.environ,
        {
            "CONTAINER": None,
            "VENV": None,
            "NEMO_RL_VENV_DIR": str(tmp_path / "no-venvs"),
            "NG_EXPORT_PYTHON": None,
            "NEMO_RL_PY_EXECUTABLES_SYSTEM": None,
            "MEGATRON_BRIDGE_SRC": None,
            "PYTHONPATH": os.pathsep.join(path),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        },
    )
    r = subprocess.run(
        [
            "bash",
            str(SLURM / "submit_comparison.sh"),
            "--dry-run",
            "--no-preflight",
            "--out",
            str(out),
            "--nodes",
            "1",
            "--eval-suite",
            "espo",
            "--nemo-rl",
            str(checkout),
            "--eval-args",
            f"--data-dir {data}",
            *cfgs,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    evals = [shlex.split(line) for line in r.stderr.splitlines() if line.startswith("sbatch") and "cmp-eval-" in line]
    assert len(evals) == 2, r.stderr
    wraps = [next(a.split("=", 1)[1] for a in argv if a.startswith("--wrap=")) for argv in evals]
    for wrap, name in zip(wraps, ("espo", "gspo")):
        inner = shlex.split(wrap)[-1]  # exec bash -c SCRIPT
        check = (
            f"python -m nemo_granular.preflight.eval_checks --eval-suite espo --run {out}/{name}_qwen3_30b_a3b_megatron"
        )
        assert check in inner, inner
        assert f"--nemo-rl {checkout} --data-dir {data} && nemo-granular eval-checkpoints" in inner, inner
        assert inner.index(check) < inner.index("eval-checkpoints")
    run = out / "espo_qwen3_30b_a3b_megatron"

    def job(**extra):
        return subprocess.run(
            ["sh", "-c", wraps[0]],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**env, "OMP_NUM_THREADS": "1", **extra},
        )

    missing = job()
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert missing.stderr.splitlines() == [
        f"preflight: error: hmmt25: no {data}/hmmt25.jsonl and NeMo-RL has no loader for it; stage it: "
        f"nemo-granular stage-benchmarks --suite espo --data-dir {data} [nemo-granular stage-benchmarks]"
    ], missing.stderr
    (data / "hmmt25.jsonl").write_text(json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    weights = run / "checkpoints" / "step_4" / "policy" / "weights"
    (weights / "iter_0000004").mkdir(parents=True)  # a Megatron checkpoint of the run
    no_bridge = job()
    assert no_bridge.returncode == 1, no_bridge.stderr
    [line] = no_bridge.stderr.splitlines()  # the preflight's line only: eval-checkpoints did not start
    assert (
        line.startswith("preflight: error: exporting a Megatron checkpoint needs Megatron-Bridge")
        and f"{tmp_path}/no-venvs/" in line
    ), line
    shutil.rmtree(run / "checkpoints")
    clean = job()
    assert clean.returncode != 0 and "preflight:" not in clean.stderr, clean.stderr
    assert clean.stderr.startswith(f"nemo-granular eval-checkpoints: error: {run}: neither"), clean.stderr


def test_submit_comparison_refuses_a_venv_the_container_would_not_have(tmp_path):
    """CONTAINER + VENV at submit time (launch.sh refuses it in the training job, before Ray; the
    eval and report jobs activate VENV in their containers too): a VENV outside MOUNTS, or whose
    python links outside MOUNTS (uv's managed Python under $HOME), or, without MOUNTS, under $HOME,
    stops the submission with one line, exit 2, nothing written; a VENV (and its python) inside
    MOUNTS is accepted."""
    local = ROOT / "examples" / "configs" / "local"
    home, shared = tmp_path / "home", tmp_path / "shared"
    uv_python = home / ".local" / "share" / "uv" / "python" / "cpython-3.13" / "bin" / "python3.13"
    uv_python.parent.mkdir(parents=True)
    uv_python.write_text("")  # (uv's managed Python: a real file under $HOME)
    (shared / "venv" / "bin").mkdir(parents=True)
    (shared / "venv" / "bin" / "python").symlink_to(uv_python)
    (shared / "own" / "bin").mkdir(parents=True)
    (shared / "own" / "bin" / "python").symlink_to(shared / "own" / "bin" / "python3")
    (shared / "own" / "bin" / "python3").write_text("")

    def submit(**env):
        out = tmp_path / f"cmp{len(list(tmp_path.iterdir()))}"
        r = subprocess.run(
            [
                "bash",
                str(SLURM / "submit_comparison.sh"),
                "--dry-run",
                "--out",
                str(out),
                str(local / "espo.yaml"),
                str(local / "gspo.yaml"),
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=_env(os.environ, {"HOME": str(home), "CONTAINER": "img.sqsh", **env}),
        )
        return r

    keep = "With CONTAINER, leave VENV unset (the image's environment runs the jobs; docs/slurm.md)"
    for env, want in (
        (
            {"VENV": str(shared / "venv"), "MOUNTS": f"{tmp_path / 'other'}:/x"},
            f"VENV={shared / 'venv'} is not inside MOUNTS={tmp_path / 'other'}:/x: the container does not have it. ",
        ),
        (
            {"VENV": str(shared / "venv"), "MOUNTS": f"{shared}:{shared}"},
            f"VENV={shared / 'venv'}: its python is a link to {uv_python}, outside MOUNTS "
            f"({shared}:{shared}): in the container (no $HOME: --no-container-mount-home) it does not exist. ",
        ),
        ({"VENV": str(home / "venv"), "MOUNTS": None}, None),
    ):
        if want is None:  # no MOUNTS: only a python under $HOME is refused
            (home / "venv" / "bin").mkdir(parents=True)
            (home / "venv" / "bin" / "python").symlink_to(uv_python)
            want = (
                f"VENV={home / 'venv'}: its python is a link to {uv_python}, under $HOME, "
                "which the container does not have (--no-container-mount-home). "
            )
        r = submit(**env)
        assert r.returncode == 2 and not r.stdout, r.stdout + r.stderr
        assert r.stderr.splitlines() == [f"submit_comparison: {want}{keep}"], r.stderr
    ok = submit(VENV=str(shared / "own"), MOUNTS=f"{shared}:{shared}")
    assert ok.returncode == 0 and len([x for x in ok.stderr.splitlines() if x.startswith("sbatch")]) == 3, ok.stderr


def _nemo_rl_world(d: Path) -> dict[str, Path]:
    """A tiny tokenizer+config model folder, a JSONL dataset, and children of the repo's GRPO
    (SSPO) and SPPO configs on them, as ``run_grpo`` / ``run_sppo`` load them on a cluster."""
    from cpu_host.models import write_word_level_model

    words = ["what", "is", "1", "2", "3", "+", "=", "answer", "\\boxed{", "}"]
    model = write_word_level_model(d / "model", words, vocab_size=32)
    data = d / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"problem": f"what is {a} + {b}", "answer": str(a + b)}) + "\n"
            for a in (1, 2)
            for b in (1, 2, 3)
        )
    )
    ds = f"{{dataset_name: ResponseDataset, data_path: {data}, input_key: problem, output_key: answer}}"
    common = (
        f"policy: {{model_name: {model}, tokenizer: {{name: {model}}}}}\n"
        "data:\n  _override_: true\n  max_input_seq_length: 64\n  shuffle: false\n  num_workers: 0\n"
        f"  use_multiple_dataloader: false\n  train: {ds}\n  validation: {ds}\n"
        "  default: {prompt_file: null, system_prompt_file: null, processor: math_hf_data_processor, "
        "env_name: math}\nenv: {math: {num_workers: 1}}\n"
        "checkpointing: {enabled: true, metric_name: null, keep_top_k: 1000, checkpoint_must_save_by: null}\n"
    )
    cfgs = {"grpo": d / "grpo.yaml", "sppo": d / "sppo.yaml"}
    cfgs["grpo"].write_text(f"defaults: {ROOT / 'examples/configs/nemo_rl/sspo_math_1B.yaml'}\n" + common)
    cfgs["sppo"].write_text(
        f"defaults: {ROOT / 'examples/configs/sppo_r1_distill_qwen_1.5b.yaml'}\n"
        + common
        + f"value: {{model_name: {model}}}\n"
    )
    return cfgs


def _nemo_rl_steps(run: Path) -> list[tuple[int, int]]:
    p = run / "steps.jsonl"
    return [(r["step"], r["attempt"]) for r in map(json.loads, p.read_text().splitlines())] if p.exists() else []


@pytest.mark.nemo_rl
def test_nemo_rl_runs_stopped_early_are_requeued_and_resume(cluster, nemo_rl_src, tmp_path):
    """Two one-node NeMo-RL jobs side by side (a Ray head each; NeMo-RL's own ``init_ray`` attaches
    to it), the real ``run_grpo`` / ``run_sppo`` with tests/harness/nemo_rl_loop_driver.py's loop:

    * SPPO stopped by NeMo-RL's own time limit (``checkpointing.checkpoint_must_save_by``): NeMo-RL
      saves and returns normally, as at the last step; the run must still be requeued and resume;
    * SSPO sent USR1 while the driver starts (no handler yet: here a sleep before the driver, as
      ``uv run`` syncing its environment) and again in the middle of a slow checkpoint save: the
      save must complete, NeMo-RL must stop at the end of the step with a checkpoint, exit 99, and
      the requeued job resume from it. Its home holds an earlier ``ray.init()``'s token, the SPPO
      job's home none: NeMo-RL's ``init_ray`` must attach with the job's token either way. Its
      ``--time=30`` sets the driver's time budget: the job's end minus ``NG_SAVE_RESERVE_SECONDS``.

    The launcher's preflight here is the STAND-IN (``NG_FAKE_PREFLIGHT=1``), which records each
    attempt's command line: the real one would put another NeMo-RL import (tens of seconds) in
    front of each of the four drivers, on this test's critical path, and is run in jobs by the
    ``one_node_jobs`` tests."""
    cfgs = _nemo_rl_world(tmp_path / "world")
    usr1_run, limit_run = tmp_path / "usr1", tmp_path / "limit"
    homes = {
        "usr1": _home(tmp_path / "home-usr1", token="a-token-left-by-an-earlier-ray-init-0123"),
        "limit": _home(tmp_path / "home-limit"),
    }
    base = {
        "START_RAY": "1",
        "PREEMPT_RESEND": "1",
        "NG_FAKE_STEP_SECONDS": "0.5",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NG_FAKE_PREFLIGHT": "1",
        "NG_FAKE_PREFLIGHT_LOG": str(tmp_path / "preflight.log"),
    }

    def cmd(module: str, cfg: Path, run: Path, *extra: str) -> list[str]:
        return [
            sys.executable,
            str(LOOP_DRIVER),
            "-m",
            module,
            "--config",
            str(cfg),
            *extra,
            f"checkpointing.checkpoint_dir={run}/checkpoints",
            f"logger.log_dir={run}/logs",
        ]

    submitted = time.time()
    usr1 = _submit(
        cluster,
        tmp_path / "w-usr1",
        "ng-usr1",
        cmd("nemo_granular.run_grpo", cfgs["grpo"], usr1_run, "grpo.max_num_steps=6", "checkpointing.save_period=2"),
        nodes=1,
        sbatch=("--time=30",),
        env={
            **base,
            "HOME": str(homes["usr1"]),
            "NG_FAKE_STARTUP_SECONDS": "6",
            "NG_FAKE_SAVE_SECONDS": "4",
            "NG_SAVE_RESERVE_SECONDS": "600",
        },
    )
    limit = _submit(
        cluster,
        tmp_path / "w-limit",
        "ng-limit",
        cmd(
            "nemo_granular.run_sppo",
            cfgs["sppo"],
            limit_run,
            "ppo.max_num_steps=6",
            "checkpointing.save_period=100",
            "checkpointing.checkpoint_must_save_by=00:00:00:03",
        ),
        nodes=1,
        env={**base, "HOME": str(homes["limit"])},
    )
    w = tmp_path / "w-usr1"
    _wait_for("the driver's start", lambda: (usr1_run / "startup.0").exists(), cluster, usr1, w)
    _signal_usr1(cluster, usr1)
    ckpt = usr1_run / "checkpoints"
    _wait_for("a checkpoint save", lambda: any(ckpt.glob("tmp_step_*")), cluster, usr1, w, 400)
    saving = sorted(p.name for p in ckpt.glob("tmp_step_*"))
    _signal_usr1(cluster, usr1)
    states = {job: cluster.wait_terminal(job, timeout=480) for job in (usr1, limit)}
    for job, run, name in ((usr1, usr1_run, "usr1"), (limit, limit_run, "limit")):
        wd = tmp_path / f"w-{name}"
        info = _explain(cluster, wd, job)
        logs = wd / "slurm-logs" / f"ng-{name}-{job}"
        launcher, driver = (logs / "launcher.log").read_text(), (logs / "driver.log").read_text()
        assert states[job] == "COMPLETED" and int(cluster.job_fields(job)["Restarts"]) == 1, info
        status = json.loads((logs / "status.json").read_text())
        assert status["exit_code"] == 0 and status["reason"] == "driver finished" and status["attempt"] == 1, status
        # every step exactly once over the two attempts, resumed from NeMo-RL's checkpoint
        steps = _nemo_rl_steps(run)
        assert [s for s, _ in steps] == list(range(1, 7)), (steps, info)
        assert not list((run / "checkpoints").glob("tmp_step_*")), info  # no half-written save left
        first = [s for s, a in steps if a == 0]
        assert first and 1 <= max(first) < 6 and {a for s, a in steps if s > max(first)} == {1}, steps
        # the second attempt's loop started from the first one's last checkpoint (NeMo-RL's setup
        # found it; its retention later removes an off-period step_N once a newer one exists)
        section = "ppo" if name == "limit" else "grpo"
        assert f"stand-in {section} loop: from step 0," in driver, info
        assert f"stand-in {section} loop: from step {max(first)}," in driver, info
        assert "driver exited with code 99" in launcher and "requeued, attempt 1" in launcher, info
        nodes = json.loads((logs / "ray_nodes.json").read_text())
        assert nodes["auth_mode"] == "token" and nodes["alive"] == 1, nodes
        _pinned_ports(nodes)
        if name == "limit":
            assert "Timeout has been reached, stopping training early" in driver, info
            assert (
                f"stopped at NeMo-RL's time limit (checkpointing.checkpoint_must_save_by) after step "
                f"{max(first)} of 6" in driver
            ), info
        else:
            assert saving, "no save was in progress when the second USR1 was sent"
            # the time budget (--time=30): the job's end (NG_JOB_END_TIME, from Slurm's EndTime)
            # minus the reserve, counted from the driver's start (checkpoint_must_save_by is null here)
            end = re.findall(r"^export NG_JOB_END_TIME=(\d+)$", (logs / "driver.sh").read_text(), re.M)
            start = int(time.mktime(time.strptime(cluster.job_fields(job)["StartTime"], "%Y-%m-%dT%H:%M:%S")))
            assert len(end) == 1 and abs(int(end[0]) - (start + 1800)) <= 2, (end, start)
            # each attempt's budget, from the wall-clock window in which its checker was made (the
            # harness's record) and its job's end: the last attempt's from Slurm's StartTime above,
            # the first's started between the submission and its checker
            lines = [
                (int(x), int(b))
                for x, b in re.findall(
                    r"the Slurm job ends in (\d+) s; NeMo-RL will save and stop within (\d+) s \(job end minus "
                    r"NG_SAVE_RESERVE_SECONDS=600\)",
                    driver,
                )
            ]
            made = {r["attempt"]: r for r in map(json.loads, (run / "checkers.jsonl").read_text().splitlines())}
            assert len(lines) == 2 and sorted(made) == [0, 1], (lines, made, info)
            assert all(abs(x - 600 - b) <= 1 for x, b in lines), lines
            (x0, _), (x1, _) = lines
            assert 1800 - (made[0]["before"] - submitted) - 1 <= x0 <= 1800 + 1, (x0, made[0], submitted)
            assert int(end[0]) - made[1]["before"] - 1 <= x1 <= int(end[0]) - made[1]["after"] + 1, (x1, made[1], end)
            assert "driver exited with code 99 after SIGUSR1" in launcher, info
            assert f"stopped by SIGUSR1 after step {max(first)} of 6" in driver, info
    assert sorted(p.name for p in (homes["usr1"] / ".ray").iterdir()) == ["auth_token"]
    assert (homes["usr1"] / ".ray" / "auth_token").read_text().startswith("a-token-left")
    assert not list((homes["limit"] / ".ray").iterdir())  # NeMo-RL's ray.init wrote no token into the home
    # the preflight checked each attempt's command line, with the launcher's cluster overrides
    checked = (tmp_path / "preflight.log").read_text().splitlines()
    assert len(checked) == 4 and all("cluster.num_nodes=1" in c and "cluster.gpus_per_node=2" in c for c in checked)


# ------------------------------------------------------- one-node jobs, submitted together ---


def _submit_real_preflight_jobs(cluster: Cluster, d: Path, nemo_rl_src: Path, jobs: dict, images: dict) -> None:
    """``one_node_jobs["ok"]`` and ``["bad"]`` (see there)."""
    shipped = ROOT / "examples" / "configs" / "sspo_qwen2.5_math_1.5b.yaml"
    srun_log, run = d / "srun.log", d / "runs" / "sspo_qwen2.5_math_1.5b"
    # docs/slurm.md's story (a), word for word but the cluster's names; after it, a short run and
    # the override forms ~key and +key=value, which the preflight must pass on to the driver
    extra = ["grpo.max_num_steps=2", "~logger.mlflow", "+logger.note=checked"]
    script = substitute(
        story(bash_blocks(CONTAINER_STORIES)[0], "a", skip=("git clone",)),
        [("/lustre/images/nemo-rl-v0.7.0.sqsh", str(images["release"]))],
    )
    script = substitute(script, _cluster_names(images, d, nodes=1), each=False).rstrip("\n") + f" {' '.join(extra)}\n"
    (d / "data").mkdir()  # NG_DATA_DIR: the MATH files the stand-in driver does not read
    (d / "ok").mkdir()
    env = _env(
        cluster.env,
        {
            "PATH": f"{PYXIS}:{cluster.env['PATH']}",
            "VENV": None,
            "NG_SRUN_LOG": str(srun_log),
            "NG_STAND_IN_DRIVER": str(NRL_DRIVER),
            "START_RAY": "0",
            "NG_FAKE_STEP_SECONDS": "0.1",
            **_without_nemo_rl_src(cluster.env),
        },
    )
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True, cwd=d / "ok", timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("Submitted batch job "), script + r.stdout + r.stderr
    cmd = [
        "python",
        "-m",
        "nemo_granular.run_grpo",
        "--config",
        str(shipped),
        f"checkpointing.checkpoint_dir={run}/checkpoints",
        f"logger.log_dir={run}/logs",
        *extra,
    ]
    jobs["ok"] = SimpleNamespace(
        job=r.stdout.split()[-1],
        workdir=d / "ok",
        logs=d / "slurm-logs",
        name="nemo-granular",
        cmd=cmd,
        checkout="/opt/nemo-rl",
        srun_log=srun_log,
        run=run,
        config=shipped,
        image=images["release"],
    )

    bad_cfg = d / "sspo_before_defer_fix.yaml"  # as every shipped Megatron config resolved before its fix
    bad_cfg.write_text(f"defaults: {shipped}\npolicy:\n  megatron_cfg:\n    defer_fp32_logits: false\n")
    bad_cmd = [sys.executable, "-m", "nemo_granular.run_grpo", "--config", str(bad_cfg), "grpo.seed=3"]
    # a COMMAND string of plain words is the command's arguments: the launcher finds the driver's
    # Python and config and appends the cluster overrides
    jobs["bad"] = SimpleNamespace(
        job=_submit(
            cluster,
            d / "bad",
            "ng-pf-bad",
            [],
            nodes=1,
            # bare metal, as the docs' story: TORCH_CUDA_ARCH_LIST exported
            env={"COMMAND": " ".join(bad_cmd), "TORCH_CUDA_ARCH_LIST": IMAGE_CUDA_ARCHS},
        ),
        workdir=d / "bad",
        config=bad_cfg,
    )


@pytest.fixture(scope="module")
def one_node_jobs(cluster, images, tmp_path_factory):
    """The one-node jobs of the next three tests, submitted at once (longest first): the cluster
    runs two side by side instead of one test's job after the other's.

    * ``ok``: the REAL preflight passes a shipped config inside the job, launched by docs/slurm.md's
      story (a), NeMo-RL's release container under pyxis: the page's commands word for word but the
      cluster's names (the local cluster's pyxis with the ``release`` image, which records the srun
      lines): WORKDIR = the image's NeMo-RL (/opt/nemo-rl), nemo-granular from its mounted
      checkout, no VENV, NeMo-RL not importable on the host side (no ``NEMO_RL_SRC``, not on
      ``PYTHONPATH``). The driver's Python is the image's ``python``; the test image's runs
      tests/harness/nemo_rl_logger_driver.py for ``-m nemo_granular.run_grpo`` (NG_STAND_IN_DRIVER),
      a short stand-in run (the real one needs GPUs), and the real ``nemo-granular preflight``. Its
      command line ends with the override forms ``~key`` and ``+key=value``;
    * ``bad``: the REAL preflight, with the real Python (``python -m nemo_granular.run_grpo``, as a
      COMMAND string), of a config NeMo-RL's Megatron worker rejects at init;
    * ``probe``: Ray refuses the readiness probe;
    * ``off``: ``PREFLIGHT=0`` (the stand-in driver and preflight: nothing of NeMo-RL runs).

    ``ok`` and ``bad`` need NeMo-RL (their tests take ``nemo_rl_src``); without it only the others
    are submitted."""
    d = tmp_path_factory.mktemp("one-node")
    jobs: dict[str, SimpleNamespace] = {}
    if os.environ.get("NEMO_RL_SRC"):
        _submit_real_preflight_jobs(cluster, d, Path(os.environ["NEMO_RL_SRC"]).resolve(), jobs, images)

    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": "the-token-the-head-starts-with-0123456789",
        "SETUP_COMMAND": "[[ $SLURM_STEP_ID == 0 ]] || export RAY_AUTH_TOKEN=a-different-token-9876543210",
    }
    jobs["probe"] = SimpleNamespace(
        job=_submit(cluster, d / "probe", "ng-probe", ["true"], nodes=1, env=env), workdir=d / "probe"
    )

    # CONTAINER + a VENV made on the host: its python links into $HOME (uv's managed Pythons live
    # there), which the container does not have (--no-container-mount-home)
    shared, home = d / "venv-home" / "shared", d / "venv-home" / "home"
    uv_python = home / ".local" / "share" / "uv" / "python" / "cpython-3" / "bin" / "python3"
    uv_python.parent.mkdir(parents=True)
    uv_python.symlink_to(Path(sys.executable).resolve())
    venv = shared / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(uv_python)
    (venv / "bin" / "activate").write_text(f'export VIRTUAL_ENV={venv} PATH="{venv}/bin:$PATH"\n')
    # its console scripts start with the venv's python, as uv writes them
    (venv / "bin" / "ray").write_text(f"#!{venv}/bin/python\nfrom ray.scripts.scripts import main\nmain()\n")
    (venv / "bin" / "ray").chmod(0o755)
    env = {
        "HOME": str(home),
        **_pyxis_env(cluster, images["release"], [shared, ROOT]),
        "VENV": str(venv),
        "WORKDIR": str(shared),
    }
    jobs["venv"] = SimpleNamespace(
        job=_submit(cluster, d / "venv-home", "ng-venv", ["python", "-c", "print(1)"], nodes=1, env=env),
        workdir=d / "venv-home",
        venv=venv,
        shared=shared,
    )
    # a 1-GPU job on the 2-GPU nodes under launch.sh's --exclusive: Ray and the driver get 1 GPU
    jobs["gpus"] = SimpleNamespace(
        job=_submit(
            cluster,
            d / "gpus",
            "ng-gpus",
            [],
            nodes=1,
            sbatch=("--gres=gpu:1",),
            env={"START_RAY": "0", "COMMAND": 'echo "gpus=$NG_GPUS_PER_NODE"'},
        ),
        workdir=d / "gpus",
    )

    # a node without GRES (a site that declares no GPUs to Slurm) that has two GPU devices: the
    # launcher counts them (NG_GPU_DEVICE_GLOB: two device files made here, and the two that are no GPU)
    devices = d / "nogres-dev"
    devices.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (devices / name).touch()
    jobs["nogres"] = SimpleNamespace(
        job=_submit(
            cluster,
            d / "nogres",
            "ng-nogres",
            [],
            nodes=1,
            sbatch=("--partition=nogres",),
            env={"NG_GPU_DEVICE_GLOB": f"{devices}/nvidia[0-9]*", "COMMAND": 'echo "gpus=$NG_GPUS_PER_NODE"'},
        ),
        workdir=d / "nogres",
    )

    log = d / "off-preflight.log"
    off_cmd = [sys.executable, str(NRL_DRIVER), "-m", "nemo_granular.run_grpo", "--config"]  # no config: exit 2
    env = {
        "PREFLIGHT": "0",
        "START_RAY": "0",
        "CLUSTER_OVERRIDES": "0",
        "NG_FAKE_PREFLIGHT": "1",
        "NG_FAKE_PREFLIGHT_LOG": str(log),
    }
    jobs["off"] = SimpleNamespace(
        job=_submit(cluster, d / "off", "ng-pf-off", off_cmd, nodes=1, env=env), workdir=d / "off", preflight_log=log
    )
    return jobs


def _finished(cluster: Cluster, j: SimpleNamespace, name: str, state: str) -> tuple[Path, str]:
    """Wait for one of ``one_node_jobs``; assert its final state; its log directory and explanation
    (under the job's BASE_LOG_DIR when it has one: ``j.logs``, its job name ``j.name``)."""
    got = cluster.wait_terminal(j.job, timeout=480)
    info = _explain(cluster, j.workdir, j.job)
    assert got == state, info
    return getattr(j, "logs", j.workdir / "slurm-logs") / f"{getattr(j, 'name', name)}-{j.job}", info


@pytest.mark.v070
@pytest.mark.nemo_rl
def test_real_preflight_passes_a_shipped_config_in_the_head_container(cluster, nemo_rl_src, one_node_jobs):
    """``one_node_jobs["ok"]``: the shipped SSPO config with the launcher's cluster overrides passes
    the real preflight inside the job; its warnings (worker venvs missing, model config not cached) are shown in the launcher's log and do not stop the job. Under
    pyxis the preflight runs with the driver's Python in the head's named container, in WORKDIR:
    that is where NeMo-RL is importable and where the config's ``nemo_rl/upstream/`` parent
    resolves. The driver then runs the very command line the preflight checked."""
    j = one_node_jobs["ok"]
    logs, info = _finished(cluster, j, "ng-pf-ok", "COMPLETED")
    launcher = (logs / "launcher.log").read_text()
    # the exact argv: the driver's Python, --driver, the config, the driver's overrides in order
    # (options removed, ~key and +key=value kept), then the cluster overrides from the allocation
    words = [w for w in j.cmd[3:] if w not in ("--config", str(j.config))]
    argv = [
        j.cmd[0],
        "-m",
        "nemo_granular",
        "preflight",
        "--driver",
        "grpo",
        str(j.config),
        *words,
        "cluster.num_nodes=1",
        f"cluster.gpus_per_node={FAKE_GPUS}",
    ]
    steps = _srun_lines(j.srun_log)
    assert sorted(steps) == ["cleanup", "driver", "preflight"] and len(steps["preflight"]) == 1, steps
    pf = steps["preflight"][0]
    prefix, _, words = pf[-1].partition(" && exec ")
    assert prefix == f"source '{logs}/node_env.sh'" and shlex.split(words) == argv, (pf[-1], argv)
    for argv_ in (pf, steps["driver"][0]):  # preflight and driver: one named container, in WORKDIR
        assert {
            f"--container-image={j.image}",
            f"--container-name=ray-head-{j.job}",
            f"--container-workdir={j.checkout}",
            "--no-container-mount-home",
        } <= set(argv_), argv_
    assert f"--output={logs}/preflight.log" in pf and f"--error={logs}/preflight-0.err" in pf, pf
    assert f"cd {j.checkout}\n" in (logs / "node_env.sh").read_text()
    # the plugin's Megatron extension runs in the image's prebuilt MegatronPolicyWorker venv: nothing
    # to build for it (the vLLM worker's venv is not in this image: that warning stays)
    assert "worker venv missing: /opt/ray_venvs/nemo_granular" not in launcher, info
    # the real preflight's plan: the allocation, the inherited NeMo-RL recipe found in the checkout
    plan = (logs / "preflight.log").read_text()
    assert "(driver: run_grpo)" in plan and "cluster   1 node(s) × 2 GPUs" in plan, plan
    assert "recipe    departs from NeMo-RL's examples/configs/grpo_math_1B_megatron.yaml" in plan, plan
    assert "result    ok, " in plan, plan
    # ... against the image's NeMo-RL (/opt/nemo-rl), whose version is read here from its own files:
    # in the v0.7.0 world (scripts/test.sh) the image is NeMo-RL's v0.7.0 release container
    from nemo_granular.nemo_rl import compat

    image_version = compat.classify(nemo_rl_src / "nemo_rl")
    assert (
        f"nemo-rl   checked against {compat.TITLES[image_version.key]} (" in plan and "at /opt/nemo-rl/nemo_rl" in plan
    ), plan
    if os.environ.get("NEMO_GRANULAR_EXPECT_NEMO_RL"):  # scripts/test.sh names the world it built
        assert image_version.key == os.environ["NEMO_GRANULAR_EXPECT_NEMO_RL"], image_version
    # its warnings shown, and the job went on; the venvs it looked for are the checkout's
    assert re.search(r"preflight: no problems, \d+ warning\(s\):", launcher), info
    # (inside the image NeMo-RL looks for them in the image's NEMO_RL_VENV_DIR, not <checkout>/venvs)
    assert "[preflight] preflight: warning: worker venv missing: /opt/ray_venvs/" in launcher, info
    assert "TORCH_CUDA_ARCH_LIST" not in launcher, info  # the image sets it, as NeMo-RL's does
    assert "driver exited with code 0" in launcher, info
    # the driver ran the command line the preflight checked
    cfg = yaml.safe_load((j.run / "checkpoints" / "step_2" / "config.yaml").read_text())
    assert (cfg["cluster"]["num_nodes"], cfg["cluster"]["gpus_per_node"]) == (1, FAKE_GPUS), cfg["cluster"]
    assert cfg["logger"]["note"] == "checked" and "mlflow" not in cfg["logger"], cfg["logger"]


@pytest.mark.nemo_rl
def test_real_preflight_stops_a_job_whose_config_nemo_rl_would_reject(cluster, nemo_rl_src, one_node_jobs):
    """``one_node_jobs["bad"]``: the real preflight finds what NeMo-RL's Megatron worker would
    reject at init on the GPUs; the job fails before Ray starts, with the preflight's own line in
    the launcher's log and as the job's reason. ``one_node_jobs["off"]``: ``PREFLIGHT=0`` (experts)
    skips the check and the driver runs."""
    j = one_node_jobs["bad"]
    logs, info = _finished(cluster, j, "ng-pf-bad", "FAILED")
    problem = (
        "policy.logprob_chunk_size=1024 needs policy.megatron_cfg.defer_fp32_logits: true (NeMo-RL: "
        "'defer_fp32_logits must be True if logprob_chunk_size is set') "
        "[nemo_rl/models/megatron/setup.py:_validate_chunking_config]"
    )
    launcher = (logs / "launcher.log").read_text()
    assert (
        f"preflight: {sys.executable} -m nemo_granular preflight --driver grpo {j.config} grpo.seed=3 "
        f"cluster.num_nodes=1 cluster.gpus_per_node={FAKE_GPUS}\n" in launcher
    ), info
    assert f"[preflight] preflight: error: {problem}\n" in launcher, info
    out = (j.workdir / f"slurm-{j.job}.out").read_text()
    errors = [line for line in out.splitlines() if "ERROR:" in line]
    assert len(errors) == 1 and errors[0].endswith(
        f"ERROR: preflight of {j.config}: {problem} (PREFLIGHT=0 skips the check)"
    ), (errors, info)
    assert "starting the Ray head" not in out and "driver:" not in out, out
    status = json.loads((logs / "status.json").read_text())
    assert status["exit_code"] == 2 and problem in status["reason"], status
    assert "result    FAILED: 1 problem(s)" in (logs / "preflight.log").read_text()

    off = one_node_jobs["off"]
    logs, info = _finished(cluster, off, "ng-pf-off", "FAILED")
    launcher = (logs / "launcher.log").read_text()
    assert "preflight skipped (PREFLIGHT=0)" in launcher and "driver exited with code 2" in launcher, info
    assert not off.preflight_log.exists()


def test_container_with_a_host_venv_outside_the_mounts_fails_before_ray(cluster, one_node_jobs):
    """``one_node_jobs["venv"]``: CONTAINER and a VENV made on the host whose python is a link into
    $HOME (uv's managed Python), as the launch story documented before: in the container (pyxis,
    --no-container-mount-home) that interpreter does not exist. The job must fail before Ray with
    one line that says so and what to do; it used to fail in the Ray head step ("bad interpreter")."""
    j = one_node_jobs["venv"]
    _, info = _finished(cluster, j, "ng-venv", "FAILED")
    logs = j.shared / "slurm-logs" / f"ng-venv-{j.job}"
    errors = [line for line in (j.workdir / f"slurm-{j.job}.out").read_text().splitlines() if "ERROR:" in line]
    target = Path(sys.executable).resolve()
    assert len(errors) == 1 and errors[0].split("ERROR: ", 1)[1] == (
        f"VENV={j.venv}: its python is a link to {target}, outside MOUNTS ({j.shared}:{j.shared},{ROOT}:{ROOT}): "
        "in the container (no $HOME: --no-container-mount-home) it does not exist. With CONTAINER, leave VENV "
        "unset (the image's environment runs the job; docs/slurm.md)"
    ), (errors, info)
    assert "starting the Ray head" not in (logs / "launcher.log").read_text(), info


def test_gpus_per_node_come_from_the_jobs_request_not_the_nodes_gres(cluster, one_node_jobs):
    """``one_node_jobs["gpus"]``: ``--gres=gpu:1`` on nodes with GRES gpu:2, under launch.sh's
    ``--exclusive``: the launcher gives the steps (``srun --gres``), Ray and the driver 1 GPU per node."""
    j = one_node_jobs["gpus"]
    logs, info = _finished(cluster, j, "ng-gpus", "COMPLETED")
    assert "gpus=1" in (logs / "driver.log").read_text(), info
    assert "gpus_per_node=1 (job asked: 1, node gres: 'gpu:2')" in (logs / "launcher.log").read_text(), info


def test_container_steps_run_as_the_user_with_the_images_venv_linked_into_its_uv_cache_and_names_persist(
    cluster, images, tmp_path
):
    """What the local cluster's pyxis shows of a real container (issue 33, items 2 and 6): a step
    runs as a non-root user (``nobody``, the job's user in a user namespace), HOME its empty home in
    a read-only root, and the image's venv takes its packages from the image's /root/.cache/uv, as
    NeMo-RL's Dockerfile links them (``uv sync --link-mode symlink``): a mount over that folder, as
    ray.sub's ``UV_CACHE_DIR_OVERRIDE`` makes, leaves ``import torch`` failing; launch.sh and
    submit_comparison.sh refuse it (tests/test_launch_checks.py). ``--container-remap-root`` is root.
    A named container persists across jobs (pyxis' default ``container_scope=global``) until
    ``enroot remove``: the reason launch.sh names its containers after the job and removes them."""
    env = _env(cluster.env, {"PATH": f"{PYXIS}:{cluster.env['PATH']}"})
    cache = tmp_path / "uv-cache"
    cache.mkdir()

    def step(*opts: str, cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                "srun",
                "--nodes=1",
                "--ntasks=1",
                f"--container-image={images['release']}",
                "--no-container-mount-home",
                *opts,
                "bash",
                "-c",
                cmd,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    user = step(cmd='id -un; echo "$HOME"; python -c "import torch; print(torch.__file__)"; touch "$HOME/x" 2>&1; true')
    lines = user.stdout.splitlines()
    assert (
        user.returncode == 0
        and lines[:3]
        == [
            "nobody",
            pwd.getpwnam("nobody").pw_dir,
            f"/opt/nemo_rl_venv/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages/torch/__init__.py",
        ]
        and "Read-only file system" in lines[3]
    ), user.stdout + user.stderr
    hidden = step(f"--container-mounts={cache}:/root/.cache/uv", cmd="python -c 'import torch'")
    assert hidden.returncode != 0 and "No module named 'torch'" in hidden.stderr, hidden.stderr
    root = step("--container-remap-root", cmd="id -u")
    assert root.returncode == 0 and root.stdout.split() == ["0"], root.stdout + root.stderr

    # a named container outlives its job (pyxis' default global scope): a later job's step that
    # names it runs in it, on its image, whatever --container-image says, until enroot removes it
    other = tmp_path / "other-image"
    subprocess.run(
        ["bash", str(MAKE_IMAGE), str(other), "--venv", sys.prefix, "--env", "NG_IMAGE=other"],
        check=True,
        capture_output=True,
    )
    show = 'cat /tmp/mark 2>/dev/null || echo no-mark; echo "image=${NG_IMAGE:-first}"'
    first = step("-w", "ngt1", "--container-name=kept", cmd="echo kept > /tmp/mark")
    again = subprocess.run(
        [
            "srun",
            "-w",
            "ngt1",
            f"--container-image={other}",
            "--container-name=kept",
            "--no-container-mount-home",
            "bash",
            "-c",
            show,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0 and again.stdout.split() == ["kept", "image=first"], again.stdout + again.stderr
    listed = subprocess.run(
        ["srun", "-w", "ngt1", "bash", "-c", "enroot list; enroot remove -f pyxis_kept"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and listed.stdout.split() == ["pyxis_kept"], listed.stdout + listed.stderr
    fresh = subprocess.run(
        [
            "srun",
            "-w",
            "ngt1",
            f"--container-image={other}",
            "--container-name=kept",
            "--no-container-mount-home",
            "bash",
            "-c",
            show,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.stdout.split() == ["no-mark", "image=other"], fresh.stdout + fresh.stderr


def test_a_node_without_gres_gives_ray_and_the_driver_its_gpu_devices(cluster, one_node_jobs):
    """``one_node_jobs["nogres"]``: on ngt3, a node the cluster declares without GRES (partition
    nogres), neither the job nor the node says how many GPUs there are; the launcher counts the head
    node's GPU devices (2, not nvidiactl / nvidia-uvm), and Ray and the driver get 2, not 0."""
    j = one_node_jobs["nogres"]
    logs, info = _finished(cluster, j, "ng-nogres", "COMPLETED")
    assert "gres" not in cluster.job_fields(j.job).get("TresPerNode", ""), info
    assert "gpus=2" in (logs / "driver.log").read_text(), info
    launcher = (logs / "launcher.log").read_text()
    assert re.search(r"gpus_per_node=2 \(job asked: none, node gres: '[^']*'\) from 2 GPU devices", launcher), info
    nodes = json.loads((logs / "ray_nodes.json").read_text())
    assert [n["node_name"] for n in nodes["nodes"]] == ["ngt3"], nodes
    assert [n["resources"].get("GPU") for n in nodes["nodes"]] == [2.0], nodes


def test_failed_readiness_probe_prints_rays_own_reason(cluster, one_node_jobs):
    """``one_node_jobs["probe"]``: token auth chosen by the user (RAY_AUTH_MODE, RAY_AUTH_TOKEN),
    and a node environment that hands the steps after the head a different token (here a
    SETUP_COMMAND): Ray refuses the readiness probe, and the job's one ERROR line must be Ray's
    reason, not a line of source."""
    j = one_node_jobs["probe"]
    logs, info = _finished(cluster, j, "ng-probe", "FAILED")
    errors = [line for line in (j.workdir / f"slurm-{j.job}.out").read_text().splitlines() if "ERROR:" in line]
    assert len(errors) == 1, (errors, info)
    assert "Ray readiness probe" in errors[0] and "InvalidAuthToken" in errors[0], errors[0]
    assert "ray.init(" not in errors[0] and "logging_level" not in errors[0], errors[0]
    status = json.loads((logs / "status.json").read_text())
    assert "InvalidAuthToken" in status["reason"], status


def test_worker_that_cannot_start_fails_the_job_at_once(cluster, tmp_path):
    """A worker node whose set-up fails (its srun step exits): the job fails within seconds, naming
    the node, instead of waiting RAY_WAIT_TIMEOUT (600 s here) for a node that never joins."""
    env = {
        "RAY_WAIT_TIMEOUT": "600",
        "SETUP_COMMAND": '[[ $(hostname) != ngt2 ]] || { echo "no /scratch on $(hostname)"; false; }',
    }
    t0 = time.monotonic()
    job = _submit(cluster, tmp_path, "ng-wfail", ["true"], env=env)
    state = cluster.wait_terminal(job, timeout=240)
    took = time.monotonic() - t0
    info = _explain(cluster, tmp_path, job)
    assert state == "FAILED" and took < 200, (took, info)
    status = json.loads((tmp_path / "slurm-logs" / f"ng-wfail-{job}" / "status.json").read_text())
    assert "ray-workers" in status["reason"] and "SETUP_COMMAND failed on ngt2" in status["reason"], status
    assert "RAY_NODES" not in (tmp_path / f"slurm-{job}.out").read_text()
    print(f"worker set-up failure: job ended {took:.0f} s after submission")


def test_worker_node_death_fails_job_promptly(cluster, tmp_path):
    """Runs LAST among the cluster tests: it leaves node ngt2 dead (down.sh cleans up)."""
    run_dir = tmp_path / "run"
    # MAX_RESTARTS=0: a lost node fails the job instead of requeueing it (tests/test_launch_checks.py)
    # faster dead-node detection by Ray's GCS (defaults: 3000 ms x 5), in this job only: it was set for
    # every job when a CI run under full load saw a head's Ray process die (likely this, not confirmed)
    job = _submit(
        cluster,
        tmp_path,
        "ng-kill",
        _driver_cmd(run_dir, 100000, every=1000, slow=True),
        env={"MAX_RESTARTS": "0", "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"},
    )
    deadline = time.monotonic() + 240
    while not _steps(run_dir):
        assert time.monotonic() < deadline and cluster.state(job) in ("PENDING", "RUNNING"), _explain(
            cluster, tmp_path, job
        )
        time.sleep(0.5)
    victims = cluster.netns_pids(2)  # node ngt2 "crashes": slurmd, slurmstepd, raylet, ...
    assert victims
    for pid in victims:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    t_kill = time.monotonic()
    status_file = tmp_path / "slurm-logs" / f"ng-kill-{job}" / "status.json"
    bound = 150.0  # detection: Ray health checks (~15-30 s) + launcher poll + teardown grace
    while not status_file.exists():
        assert time.monotonic() - t_kill < bound, (
            f"launcher still running {bound:.0f} s after the node died\n" + _explain(cluster, tmp_path, job)
        )
        time.sleep(1.0)
    status = json.loads(status_file.read_text())
    info = _explain(cluster, tmp_path, job)
    assert status["exit_code"] != 0, info
    assert "ngt2" in status["reason"] and ("lost" in status["reason"] or "died" in status["reason"]), status
    err = (tmp_path / f"slurm-{job}.out").read_text()
    assert "ERROR:" in err and "ngt2" in err, info
    assert not list((Path(cluster.env["HOME"]) / ".ray").glob("*"))  # no Ray token written into the home
    # the batch script has ended; Slurm finishes the record once it declares the node down
    assert cluster.state(job) in ("COMPLETING", "FAILED", "NODE_FAIL"), info
    print(f"node failure detected after {time.monotonic() - t_kill:.0f} s (reason: {status['reason']})")
