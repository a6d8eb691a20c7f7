"""Launch-story checks that need no Slurm cluster (issue 33, items 3-6, 8-10): what ``nemo-granular
preflight`` (its runtime and worker checks, called directly), ``slurm/submit_comparison.sh`` and
``slurm/launch.sh`` refuse before anything is submitted or started, and what the scripts ask
``sbatch`` / ``srun`` / ``ray start`` for. The scripts run with fake ``sbatch`` / ``srun`` /
``scontrol`` on ``PATH`` that only record their arguments; a refusal is one line on stderr, exit 2,
and no fake was called. ``_launch_ray`` takes launch.sh through every step (Ray head, readiness
probe, watchdog, driver) with those fakes. The runs in the local Slurm cluster are in
``tests/test_slurm.py``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_granular.evals.staging import staging_refusal
from nemo_granular.preflight.runtime import container_path_findings, runtime_findings
from nemo_granular.preflight.worker_checks import IMAGE_TORCH_CUDA_ARCH_LIST, policy_init_checks

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "slurm"
DOCS = (ROOT / "docs" / "slurm.md").read_text()
CFG = ROOT / "examples" / "configs"
MEGATRON_30B = [str(CFG / f"{a}_qwen3_30b_a3b_megatron.yaml") for a in ("espo", "gspo")]
LOCAL = [str(CFG / "local" / f"{a}.yaml") for a in ("espo", "gspo")]


def _fakes(d: Path, srun: str = "exit 0", scontrol: str = "") -> Path:
    """``sbatch``, ``srun``, ``scontrol`` that append their argv (one JSON list a line) to ``calls``
    (``srun``: the fake's shell after that; ``scontrol``: lines it runs before answering ``show
    hostnames``)."""
    d.mkdir(parents=True, exist_ok=True)
    log = d / "calls"
    for name in ("sbatch", "srun", "scontrol"):
        body = {
            "sbatch": 'echo "1$RANDOM"',
            "srun": srun,
            # hostnames of the allocation: the one node; nothing else is known
            "scontrol": scontrol + '[[ "$1 $2" == "show hostnames" ]] && echo n1; exit 0',
        }[name]
        # one O_APPEND write per record: the fakes run side by side (srun's background watch, scontrol)
        record = (
            f"{sys.executable} -c 'import json, os, sys; os.write(1, (json.dumps(sys.argv[1:]) + chr(10)).encode())' "
            f'{name} "$@" >>{log}'
        )
        (d / name).write_text(f"#!/usr/bin/env bash\n{record}\n{body}\n")
        (d / name).chmod(0o755)
    return log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _env(tmp_path: Path, **extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "HF_"))
        and k not in ("CONTAINER", "MOUNTS", "VENV", "UV_CACHE_DIR_OVERRIDE", "NEMO_RL_PYTHON", "PREFLIGHT", "WORKDIR")
    }
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    for k, v in extra.items():  # None: not set
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _submit(tmp_path: Path, args: list[str], **env) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    log = _fakes(tmp_path / "bin")
    r = subprocess.run(
        ["bash", str(SLURM / "submit_comparison.sh"), "--out", str(tmp_path / "cmp"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(tmp_path, **env),
        timeout=300,
    )
    return r, _calls(log)


def _fake_nemo_rl(tmp_path: Path) -> tuple[Path, Path]:
    """A NeMo-RL checkout as submit_comparison.sh looks for one, and a NEMO_RL_PYTHON whose
    ``-m nemo_granular preflight`` passes (the real preflight is tests/test_slurm.py's) and which is
    this Python otherwise."""
    checkout = tmp_path / "NeMo-RL"
    (checkout / "examples").mkdir(parents=True)
    (checkout / "examples" / "run_eval.py").write_text("")
    (checkout / "nemo_rl").mkdir()
    py = tmp_path / "nrl-python"
    py.write_text(
        f'#!/usr/bin/env bash\n[[ "$1 $2 $3" == "-m nemo_granular preflight" ]] && exit 0\nexec {sys.executable} "$@"\n'
    )
    py.chmod(0o755)
    return checkout, py


# ---------------------------------------------------------------- 4. TORCH_CUDA_ARCH_LIST ----------

MEGATRON_POLICY = {
    "megatron_cfg": {"enabled": True},
    "dtensor_cfg": {"enabled": False},
    "train_micro_batch_size": 1,
    "logprob_batch_size": 1,
}


def test_megatron_config_without_torch_cuda_arch_list_is_refused_with_the_value_to_set():
    """NeMo-RL's Policy.__init__ raises RuntimeError when TORCH_CUDA_ARCH_LIST is unset and the
    Megatron backend is on (in setup(), after the allocation started); the preflight said so only
    as a warning. Now: an error where the environment is the job's (bare metal; inside the job's
    container), naming the value NeMo-RL's image sets; a warning on the submit host of a CONTAINER
    job, whose image's value wins."""
    for env in ({}, {"NG_CONTAINER": "img.sqsh", "CONTAINER": "img.sqsh"}):
        [f] = [f for f in policy_init_checks(MEGATRON_POLICY, 8, env) if "TORCH_CUDA_ARCH_LIST" in f.message]
        assert f.level == "error", f
        assert f"export TORCH_CUDA_ARCH_LIST='{IMAGE_TORCH_CUDA_ARCH_LIST}'" in f.message, f
        assert f.source == "nemo_rl/models/policy/lm_policy.py:Policy.__init__"
    [f] = [
        f
        for f in policy_init_checks(MEGATRON_POLICY, 8, {"CONTAINER": "img.sqsh"})
        if "TORCH_CUDA_ARCH_LIST" in f.message
    ]
    assert f.level == "warning", f
    assert not [
        f
        for f in policy_init_checks(MEGATRON_POLICY, 8, {"TORCH_CUDA_ARCH_LIST": "9.0"})
        if "TORCH_CUDA_ARCH_LIST" in f.message
    ]
    dtensor = {**MEGATRON_POLICY, "megatron_cfg": {"enabled": False}, "dtensor_cfg": {"enabled": True}}
    assert not [f for f in policy_init_checks(dtensor, 8, {}) if "TORCH_CUDA_ARCH_LIST" in f.message]


@pytest.mark.nemo_rl
def test_torch_cuda_arch_list_value_and_rule_are_nemo_rls(nemo_rl_src):
    """The value the refusal names is NeMo-RL's Dockerfile's ENV, and NeMo-RL raises (not warns)
    for the Megatron backend without it."""
    docker = (nemo_rl_src / "docker" / "Dockerfile").read_text()
    assert f'ENV TORCH_CUDA_ARCH_LIST="{IMAGE_TORCH_CUDA_ARCH_LIST}"' in docker
    policy = (nemo_rl_src / "nemo_rl" / "models" / "policy" / "lm_policy.py").read_text()
    megatron = policy[policy.index("megatron_policy_worker.MegatronPolicyWorker") :]
    megatron = megatron[: megatron.index("else:")]
    assert re.search(r'if "TORCH_CUDA_ARCH_LIST" not in os\.environ:\s+raise RuntimeError', megatron), megatron


def test_docs_bare_metal_story_sets_torch_cuda_arch_list():
    """docs/slurm.md's launch story (step 3, the submitting shell's variables) sets it."""
    story = DOCS[DOCS.index("**3. Models and data pre-staged") : DOCS.index("**4. Check each config")]
    assert f"export TORCH_CUDA_ARCH_LIST='{IMAGE_TORCH_CUDA_ARCH_LIST}'" in story, story


# ---------------------------------------------------------------- 5. staged benchmarks -------------


def test_offline_comparison_with_eval_suite_refuses_unstaged_benchmarks_before_submitting(tmp_path):
    """HF_HUB_OFFLINE=1 and --eval-suite without --data-dir (docs/slurm.md's container
    comparison): every eval job failed after all the training steps. submit_comparison.sh now
    refuses before any sbatch, in one line naming the benchmarks and the stage-benchmarks
    command; with --data-dir it names only what is not staged there; staged, it submits."""
    checkout, py = _fake_nemo_rl(tmp_path)
    common = ["--nodes", "8", "--eval-suite", "espo", "--nemo-rl", str(checkout)]
    r, calls = _submit(tmp_path, [*common, *MEGATRON_30B], HF_HUB_OFFLINE="1", NEMO_RL_PYTHON=str(py))
    assert r.returncode == 2 and not calls and not (tmp_path / "cmp").exists(), (r.stdout, r.stderr, calls)
    assert r.stderr.splitlines() == [
        "submit_comparison: --eval-suite espo: aime24, aime25, math500, hmmt25: no --data-dir "
        "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set); run nemo-granular stage-benchmarks --suite espo "
        '--data-dir DIR and --eval-args "--data-dir DIR"'
    ], r.stderr
    bench = tmp_path / "bench"
    bench.mkdir()
    for key in ("aime24", "aime25", "math500"):
        (bench / f"{key}.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    # online, a --data-dir: hmmt25 has no NeMo-RL loader, so it must be staged anyway
    r, calls = _submit(tmp_path, [*common, "--eval-args", f"--data-dir {bench}", *MEGATRON_30B], NEMO_RL_PYTHON=str(py))
    assert r.returncode == 2 and not calls, (r.stderr, calls)
    assert r.stderr.splitlines() == [
        f"submit_comparison: --eval-suite espo: hmmt25: not staged in {bench} (NeMo-RL has no loader); "
        f"run nemo-granular stage-benchmarks --suite espo --data-dir {bench}"
    ], r.stderr
    (bench / "hmmt25.jsonl").write_text(json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    r, calls = _submit(
        tmp_path,
        [*common, "--eval-args", f"--data-dir {bench}", *MEGATRON_30B],
        HF_HUB_OFFLINE="1",
        NEMO_RL_PYTHON=str(py),
    )
    assert r.returncode == 0, r.stderr
    assert [c[0] for c in calls] == ["sbatch"] * 5, calls  # 2 training, 2 eval, the report


def test_staging_refusal_names_a_bad_staged_file(tmp_path):
    (tmp_path / "aime24.jsonl").write_text("not json\n")
    line = staging_refusal("espo", tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert line.startswith(f"{tmp_path}/aime24.jsonl:1: not a staged benchmark line"), line
    assert staging_refusal("espo", None, env={}) is not None  # hmmt25: no NeMo-RL loader


def test_docs_container_comparison_passes_the_data_dir():
    """docs/slurm.md's container comparison (b) runs offline with --eval-suite: it must stage and
    pass --data-dir."""
    block = DOCS[DOCS.index("# (b) a container built from a NeMo-RL main checkout") :]
    block = block[: block.index("```")]
    assert "--eval-suite espo" in block and '--eval-args "--data-dir /lustre/benchmarks"' in block, block


# ---------------------------------------------------------------- 6. UV_CACHE_DIR_OVERRIDE ---------


def test_submit_comparison_refuses_uv_cache_dir_override_with_container(tmp_path):
    """It was mounted at /root/.cache/uv (ray.sub's), over the uv cache that NeMo-RL's image links
    its venvs into (`uv sync --link-mode symlink`): `import torch` failed in every step."""
    shared = tmp_path / "shared"
    r, calls = _submit(
        tmp_path, LOCAL, CONTAINER="img.sqsh", MOUNTS=f"{tmp_path}:{tmp_path}", UV_CACHE_DIR_OVERRIDE=str(shared / "uv")
    )
    assert r.returncode == 2 and not calls and not r.stdout, (r.stdout, r.stderr, calls)
    assert r.stderr.splitlines() == [
        "submit_comparison: UV_CACHE_DIR_OVERRIDE with CONTAINER hides the image's /root/.cache/uv "
        "(its venvs link there); unset it"
    ], r.stderr


def _launch(
    tmp_path: Path, cmd: tuple[str, ...] = ("true",), fakes: dict | None = None, **env
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """slurm/launch.sh as the batch script of a one-node job (fake srun/scontrol; the driver CMD)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = _fakes(tmp_path / "bin", **(fakes or {}))
    job = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_ON_NODE": "2",
        "NG_ROOT": str(ROOT),
        "HEAD_IP": "10.0.0.1",
        "START_RAY": "0",
        "WORKDIR": str(tmp_path),
        "BASE_LOG_DIR": str(tmp_path / "logs"),
    }
    r = subprocess.run(
        ["bash", str(SLURM / "launch.sh"), *cmd],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env=_env(tmp_path, **{**job, **env}),
    )
    return r, _calls(log)


# a fake srun's --output file ($out), and what `ray start --head` prints there once its raylet has
# registered with the GCS (Ray 2.60's scripts.py; the launcher waits for it)
SRUN_OUT = 'out=/dev/null; for a; do [[ "$a" == --output=* ]] && out=${a#--output=}; done\n'
HEAD_STARTED = 'echo "2026-11-30 11:24:35,462 SUCC scripts.py:1085 -- Ray runtime started." >>"$out"; '
# the Ray head's and the watchdog's steps run until they are stopped, as the real ones do
RAY_SRUN = (
    SRUN_OUT + 'case "$*" in *"ray start --head"*) ' + HEAD_STARTED + "exec sleep 60 ;;\n"
    '  *"ray start"*|*"ray_cluster.py\' watch"*) exec sleep 60 ;; esac; exit 0'
)


def _launch_ray(
    tmp_path: Path, cmd: tuple[str, ...] = ("true",), scontrol: str = "", **env
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """_launch with START_RAY=1 through every step to the driver: a socket listening at
    HEAD_IP:RAY_PORT stands for the head's GCS, the readiness probe's fake step succeeds."""
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen(8)
        return _launch(
            tmp_path,
            cmd,
            {"srun": RAY_SRUN, "scontrol": scontrol},
            START_RAY="1",
            HEAD_IP="127.0.0.1",
            RAY_PORT=str(gcs.getsockname()[1]),
            **env,
        )


def _srun_scripts(calls: list[list[str]]) -> list[str]:
    """The command line of each recorded srun (its last argument: the step's bash -c script, or driver.sh)."""
    return [" ".join(c[1:]) for c in calls if c[0] == "srun"]


def test_launch_refuses_uv_cache_dir_override_with_container_before_any_step(tmp_path):
    mounts = f"{tmp_path}:{tmp_path},{ROOT}:{ROOT}"
    r, calls = _launch(tmp_path, CONTAINER="img.sqsh", MOUNTS=mounts, UV_CACHE_DIR_OVERRIDE=str(tmp_path / "uv"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert not [c for c in calls if c[0] == "srun"], calls
    errors = [line for line in (r.stdout + r.stderr).splitlines() if "ERROR:" in line]
    assert len(errors) == 1 and errors[0].endswith(
        "ERROR: UV_CACHE_DIR_OVERRIDE with CONTAINER hides the image's /root/.cache/uv (its venvs link there); unset it"
    ), errors
    # without it the same job runs its driver step
    ok, calls = _launch(tmp_path, CONTAINER="img.sqsh", MOUNTS=mounts)
    assert ok.returncode == 0 and [c for c in calls if c[0] == "srun"], ok.stdout + ok.stderr


def test_docs_say_why_uv_cache_dir_override_is_refused():
    row = next(line for line in DOCS.splitlines() if line.startswith("| `UV_CACHE_DIR_OVERRIDE`"))
    assert "refused" in row and "--link-mode symlink" in row, row


# ---------------------------------------------------------------- 3. paths inside MOUNTS -----------

SHIPPED_PATHS = {
    "checkpointing": {"enabled": True, "checkpoint_dir": "results/sspo_qwen2.5_math_1.5b"},
    "logger": {"log_dir": "logs/sspo_qwen2.5_math_1.5b"},
    "data": {
        "train": {"data_path": "data/math_level3to5_train.jsonl"},
        "validation": [{"data_path": "HuggingFaceH4/MATH-500"}, {"data_path": "/lustre/data/math500_test.jsonl"}],
        "default": {"prompt_file": "examples/prompts/cot.txt"},
    },
}


def test_container_run_paths_outside_the_mounts_are_refused():
    """Release image, WORKDIR=/opt/nemo-rl: the shipped configs' relative checkpoint_dir/log_dir
    resolve inside the image: checkpoints lost with the container (data files, only read, are not checked). One
    error per key, naming it and the path; none for paths under a mount's destination, for
    Hugging Face dataset ids, prompt files (the image's examples/), or without CONTAINER/MOUNTS."""
    env = {"CONTAINER": "nemo-rl-v0.7.0.sqsh", "MOUNTS": "/lustre:/lustre", "WORKDIR": "/opt/nemo-rl"}
    lines = [f.line() for f in runtime_findings(SHIPPED_PATHS, env)]
    assert lines == [
        f"error: {key}={value} is /opt/nemo-rl/{value} in the container, outside MOUNTS=/lustre:/lustre: the image's "
        "own file system (not shared, lost with the container); set it under a mounted directory "
        "[nemo-granular:runtime]"
        for key, value in (
            ("checkpointing.checkpoint_dir", "results/sspo_qwen2.5_math_1.5b"),
            ("logger.log_dir", "logs/sspo_qwen2.5_math_1.5b"),
        )
    ], lines
    # inside the job's container (launch.sh's preflight): NG_CONTAINER / NG_MOUNTS, the mount's destination
    inside = {"NG_CONTAINER": "img", "NG_MOUNTS": "/host/lustre:/lustre", "WORKDIR": "/opt/nemo-rl"}
    assert len(container_path_findings(SHIPPED_PATHS, inside)) == 2
    fixed = {
        **SHIPPED_PATHS,
        "checkpointing": {"enabled": True, "checkpoint_dir": "/lustre/runs/sspo/checkpoints"},
        "logger": {"log_dir": "/lustre/runs/sspo/logs"},
        "data": {**SHIPPED_PATHS["data"], "train": {"data_path": "/lustre/data/math_level3to5_train.jsonl"}},
    }
    assert container_path_findings(fixed, env) == [] and container_path_findings(fixed, inside) == []
    assert container_path_findings(SHIPPED_PATHS, {"WORKDIR": "/opt/nemo-rl"}) == []  # no CONTAINER
    assert container_path_findings(SHIPPED_PATHS, {"CONTAINER": "img", "WORKDIR": "/x"}) == []  # no MOUNTS
    # WORKDIR on a mount (the main-checkout container): the relative paths are on the shared file system
    assert container_path_findings(SHIPPED_PATHS, {**env, "WORKDIR": "/lustre/NeMo-RL"}) == []


def test_docs_release_image_example_sets_paths_under_a_mount():
    """docs/slurm.md's example (a) (WORKDIR=/opt/nemo-rl) sets checkpoint_dir and log_dir under /lustre."""
    block = DOCS[DOCS.index("# (a) NeMo-RL's v0.7.0 release container") : DOCS.index("# (b) a container built")]
    assert re.search(r"checkpointing\.checkpoint_dir=/lustre/\S+", block), block
    assert re.search(r"logger\.log_dir=/lustre/\S+", block), block
    assert "NG_DATA_DIR=/lustre/data" in block, block


def test_stop_script_sends_usr1_to_the_batch_shell_and_refuses_a_bad_id(tmp_path):
    """slurm/stop.sh is the documented stop: ``scancel --signal=USR1 --batch JOBID`` (the launcher's save
    path), nothing sent for a malformed id."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "scancel.args"
    (fake / "scancel").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {log}\n')
    (fake / "scancel").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    ok = subprocess.run(
        ["bash", str(ROOT / "slurm" / "stop.sh"), "4242", "17_3"], env=env, capture_output=True, text=True, timeout=30
    )
    assert ok.returncode == 0 and log.read_text().split() == ["--signal=USR1", "--batch", "4242", "17_3"], ok.stderr
    log.unlink()
    bad = subprocess.run(
        ["bash", str(ROOT / "slurm" / "stop.sh"), "4242;rm"], env=env, capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a Slurm job id" in bad.stderr
    assert not log.exists()


# ---------------------------------------------------------------- 8. the eval jobs' node -----------


def _evals(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c[0] == "sbatch" and any(a.startswith("--job-name=cmp-eval-") for a in c)]


def test_eval_jobs_ask_for_the_whole_node_and_its_memory_before_the_users_sbatch_args(tmp_path):
    """The eval job exports a 30B Megatron checkpoint (tens of GB of RSS) and runs vLLM: with only
    --nodes=1 it got a site's default memory (DefMemPerCPU for one CPU). Now --exclusive --mem=0,
    before --sbatch/--train-sbatch so that the user's own --mem still wins (sbatch: the last one);
    with the user's --mem-per-cpu/--mem-per-gpu no --mem=0 (sbatch refuses two of them)."""
    checkout, py = _fake_nemo_rl(tmp_path)
    common = ["--no-preflight", "--nodes", "8", "--eval-suite", "espo", "--nemo-rl", str(checkout)]
    r, calls = _submit(
        tmp_path, [*common, "--train-sbatch", "--gres=gpu:8 --mem=500G", *MEGATRON_30B], NEMO_RL_PYTHON=str(py)
    )
    assert r.returncode == 0, r.stderr
    evals = _evals(calls)
    assert len(evals) == 2, calls
    for argv in evals:
        assert "--exclusive" in argv and "--mem=0" in argv, argv
        assert argv.index("--exclusive") < argv.index("--gres=gpu:8"), argv
        assert argv.index("--mem=0") < argv.index("--mem=500G"), argv
    per_gpu = tmp_path / "per-gpu"
    per_gpu.mkdir()
    r, calls = _submit(
        per_gpu, [*common, "--train-sbatch", "--gres=gpu:8 --mem-per-gpu=100G", *MEGATRON_30B], NEMO_RL_PYTHON=str(py)
    )
    assert r.returncode == 0, r.stderr
    assert [("--exclusive" in argv, "--mem=0" in argv) for argv in _evals(calls)] == [(True, False)] * 2, calls


def test_docs_say_the_eval_jobs_get_a_whole_node():
    assert "--exclusive --mem=0" in DOCS, "docs/slurm.md does not say what the eval jobs ask for"


# ---------------------------------------------------------------- 9. launch.sh on a real cluster ---


def _table_default(name: str) -> str:
    row = next(line for line in DOCS.splitlines() if line.startswith(f"| `{name}` |"))
    return row.split("|")[2].strip()


def test_ray_wait_timeout_default_leaves_time_for_the_image_import(tmp_path):
    """Issue 33.9c: RAY_WAIT_TIMEOUT covers each node's import of the container image (pyxis) before
    Ray starts; ray.sub gives its workers 1800 s, the launcher gave 600. The readiness probe of a
    launch through every step gets the default, and docs/slurm.md's table says the same."""
    r, calls = _launch_ray(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    [wait] = [s for s in _srun_scripts(calls) if "ray_cluster.py' wait" in s]
    timeout = re.search(r"--timeout=(\d+)", wait).group(1)
    assert timeout == "1800", wait
    assert _table_default("RAY_WAIT_TIMEOUT") == timeout


NO_GRES = (
    '[[ "$1 $2 $3" == "show node -o" ]] && echo "NodeName=n1 Arch=x86_64 CPUTot=2 Gres=(null) State=IDLE"\n'
    '[[ "$1 $2 $3" == "show job -o" ]] && echo "JobId=7 JobName=job TimeLimit=UNLIMITED"\n'
)
NRL_DRIVER = ("python", "-m", "nemo_granular.run_grpo", "--config", "cfg.yaml")


def test_launch_without_gres_counts_the_head_nodes_gpu_devices(tmp_path):
    """Issue 33.9d: on a site without GRES (no --gres in the job, no gpu Gres on the node) Ray started
    with --num-gpus=0 on GPU nodes. Now the batch shell (on the head node) counts its GPU devices,
    as nvidia-smi -L would (NG_GPU_DEVICE_GLOB, /dev/nvidia[0-9]*; /dev/nvidiactl is not a GPU),
    for ray start, NG_GPUS_PER_NODE and cluster.gpus_per_node, and says so; no --gres for srun
    (the site has none). No devices: 0, as before."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_text("")
    r, calls = _launch_ray(tmp_path / "job", NRL_DRIVER, NO_GRES, NG_GPU_DEVICE_GLOB=f"{dev}/nvidia[0-9]*")
    assert r.returncode == 0, r.stdout + r.stderr
    scripts = _srun_scripts(calls)
    [head] = [s for s in scripts if "ray start --head" in s]
    assert "--num-gpus=3 " in head, head
    assert not [c for c in calls if c[0] == "srun" and any(a.startswith("--gres") for a in c)], calls
    [preflight] = [s for s in scripts if "-m nemo_granular preflight" in s]
    assert "cluster.num_nodes=1 cluster.gpus_per_node=3" in preflight, preflight
    logs = tmp_path / "job" / "logs" / "job-7"
    assert "cluster.gpus_per_node=3" in (logs / "driver.sh").read_text()
    assert "NG_GPUS_PER_NODE=3 " in (logs / "node_env.sh").read_text()
    assert (
        f"gpus_per_node=3 (job asked: none, node gres: '(null)') from 3 GPU devices ({dev}/nvidia[0-9]*) "
        "on the head node"
    ) in r.stdout, r.stdout
    # a node without GPU devices
    r, calls = _launch_ray(tmp_path / "cpu", NRL_DRIVER, NO_GRES, NG_GPU_DEVICE_GLOB=f"{tmp_path}/none/nvidia[0-9]*")
    assert r.returncode == 0, r.stdout + r.stderr
    [head] = [s for s in _srun_scripts(calls) if "ray start --head" in s]
    assert "--num-gpus=0 " in head and "cluster.gpus_per_node" not in " ".join(_srun_scripts(calls)), calls
    assert "gpus_per_node=0 (job asked: none, node gres: '(null)') from 0 GPU devices" in r.stdout, r.stdout


def test_docs_name_the_gpu_device_glob():
    assert _table_default("NG_GPU_DEVICE_GLOB") == "`/dev/nvidia[0-9]*`"


CACHES = {
    "TRITON_CACHE_DIR": "triton",
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "XDG_CACHE_HOME": "cache",
    "MEGATRON_CONFIG_LOCK_DIR": "megatron-config-locks",
}
HOME_ONLY = ("XDG_CACHE_HOME", "MEGATRON_CONFIG_LOCK_DIR")  # set only where HOME cannot be written
RAY = "RAY_AUTH_TOKEN_PATH"


def _step_env(tmp_path: Path, **env) -> dict:
    """The four cache variables in a step: node_env.sh sourced, with the job's environment (what pyxis
    passes from the host, the image defining none of them) and, unless given, a HOME that cannot be
    written (pyxis: an empty read-only directory; for root here: none)."""
    script = f"source {tmp_path / 'logs' / 'job-7' / 'node_env.sh'} >/dev/null && " + " && ".join(
        f'echo "{k}=${{{k}:-}}"' for k in CACHES
    )
    out = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(tmp_path, **{**{k: None for k in CACHES}, "HOME": str(tmp_path / "no-home"), **env}),
    )
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_container_steps_get_writable_compile_caches(tmp_path):
    """Issue 33.9b: under pyxis HOME is an empty read-only directory, and Triton's and vLLM's caches
    (NeMo-RL's vllm_worker: ~/.cache/vllm) default under it. With CONTAINER every step gets them,
    torch-inductor's and, where HOME cannot be written, XDG_CACHE_HOME under /tmp/nemo-granular-<job
    id>/ in the container (XDG_CACHE_HOME moves uv's cache too: a root container's /root/.cache/uv
    is NeMo-RL's image's). A value the user set is kept (and reaches the container as every host
    variable the image does not define)."""
    mounts = f"{tmp_path}:{tmp_path},{ROOT}:{ROOT}"
    unset = {k: None for k in CACHES}
    r, calls = _launch(tmp_path / "a", CONTAINER="img.sqsh", MOUNTS=mounts, **unset)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _step_env(tmp_path / "a") == {k: f"/tmp/nemo-granular-7/{d}" for k, d in CACHES.items()}
    # a writable HOME (a root container): its XDG cache, uv's with it, stays
    assert _step_env(tmp_path / "a", HOME=str(tmp_path)) == {
        **{k: f"/tmp/nemo-granular-7/{d}" for k, d in CACHES.items()},
        **dict.fromkeys(HOME_ONLY, ""),
    }
    # the user's own value
    r, calls = _launch(
        tmp_path / "b",
        CONTAINER="img.sqsh",
        MOUNTS=mounts,
        **{**unset, "TRITON_CACHE_DIR": "/lustre/triton", "XDG_CACHE_HOME": "/lustre/cache"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    mine = _step_env(tmp_path / "b", TRITON_CACHE_DIR="/lustre/triton", XDG_CACHE_HOME="/lustre/cache")
    assert (mine["TRITON_CACHE_DIR"], mine["XDG_CACHE_HOME"]) == ("/lustre/triton", "/lustre/cache"), mine
    assert not [a for c in calls for a in c if a.startswith("--container-env")], calls
    # no container: the host's caches, untouched
    r, _ = _launch(tmp_path / "c", **unset)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _step_env(tmp_path / "c") == {k: "" for k in CACHES}


MOUNTS_OK = f"/tmp:/tmp,{ROOT}:{ROOT}"  # pytest's tmp_path is under /tmp
# every step is recorded; the containers' cleanup step (its last three words: bash -c SCRIPT) runs here
RUN_CLEANUP = 'case "$*" in *"enroot remove"*) shift $(($# - 3)); exec "$@" ;; esac; exit 0'


def test_eval_and_report_jobs_in_a_container_get_writable_compile_caches(tmp_path):
    """Issue 33.9b for submit_comparison.sh's own jobs: the eval job runs NeMo-RL's run_eval (vLLM's
    cache: ~/.cache/vllm; its local Ray's token: ~/.ray/auth_token) and the report job Python, in the
    image, under a HOME pyxis leaves empty and read-only. Their --wrap scripts, run here (srun: the container step's ``bash -c SCRIPT``; python:
    prints the variables), get launch.sh's job-scoped caches; a value of the user's is kept."""
    checkout, py = _fake_nemo_rl(tmp_path)
    mounts = f"/tmp:/tmp,{ROOT}:{ROOT}"
    r, calls = _submit(
        tmp_path,
        ["--no-preflight", "--nodes", "1", "--eval-suite", "espo", "--nemo-rl", str(checkout), *LOCAL],
        NEMO_RL_PYTHON=str(py),
        CONTAINER="img.sqsh",
        MOUNTS=mounts,
        **{k: None for k in CACHES},
    )
    assert r.returncode == 0, r.stderr
    report = [c for c in calls if c[0] == "sbatch" and any(a.startswith("--job-name=cmp-report") for a in c)]
    wraps = [a.split("=", 1)[1] for c in [*_evals(calls), *report] for a in c if a.startswith("--wrap=")]
    assert len(wraps) == 3, calls
    run = tmp_path / "run"
    run.mkdir()
    (run / "srun").write_text('#!/usr/bin/env bash\nshift $(($# - 3)); exec "$@"\n')  # bash -c SCRIPT
    (run / "python").write_text(
        "#!/usr/bin/env bash\n"
        + "".join(f'echo "{k}=${{{k}:-}}"\n' for k in (*CACHES, RAY))
        + f'[[ -z "${{{RAY}:-}}" ]] || echo "token=$(stat -c %a "${RAY}") $(wc -c <"${RAY}")"\n'
    )
    for f in ("srun", "python"):
        (run / f).chmod(0o755)

    def step_env(wrap: str, keys=CACHES, **env) -> dict:
        out = subprocess.run(
            ["sh", "-c", wrap],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
            env={
                **_env(tmp_path, **{k: None for k in (*CACHES, RAY, "RAY_AUTH_TOKEN")}),
                "PATH": f"{run}:{os.environ['PATH']}",
                "SLURM_JOB_ID": "7",
                "HOME": str(tmp_path / "no-home"),
                **env,
            },
        )
        assert out.returncode == 0, out.stderr
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if line.split("=", 1)[0] in keys)

    for wrap in wraps:
        assert "--container-image=img.sqsh" in wrap, wrap
        assert step_env(wrap) == {k: f"/tmp/nemo-granular-7/{d}" for k, d in CACHES.items()}, wrap
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        writable = step_env(wrap, HOME=str(home))  # a writable HOME keeps its cache
        assert [writable[k] for k in HOME_ONLY] == ["", ""], writable
        mine = step_env(wrap, TRITON_CACHE_DIR="/lustre/triton", XDG_CACHE_HOME="/lustre/cache")
        assert (mine["TRITON_CACHE_DIR"], mine["XDG_CACHE_HOME"]) == ("/lustre/triton", "/lustre/cache"), mine
        # run_eval's local ray.init() writes a token to ~/.ray/auth_token (read-only here, the shared
        # home on bare metal): a job-scoped one instead (the user's only, 64 hex digits), unless the
        # user gave one
        token = Path("/tmp/nemo-granular-7/ray_auth_token")
        for home_dir in (tmp_path / "no-home", home):
            token.unlink(missing_ok=True)
            assert step_env(wrap, keys=(RAY, "token"), HOME=str(home_dir)) == {RAY: str(token), "token": "600 64"}
        assert step_env(wrap, keys=(RAY,), RAY_AUTH_TOKEN="mine") == {RAY: ""}
        token.unlink()


def _fake_enroot(d: Path, listed: list[str]) -> Path:
    """An ``enroot`` whose ``list`` prints ``listed`` (pyxis' names) and which records each ``remove``."""
    log = d / "enroot.calls"
    (d / "enroot").write_text(
        f'#!/usr/bin/env bash\n[[ "$1" == list ]] && printf "%s\\n" {" ".join(listed)}\n'
        f'[[ "$1" == remove ]] && echo "$*" >>{log}\nexit 0\n'
    )
    (d / "enroot").chmod(0o755)
    return log


def test_named_containers_are_job_scoped_and_removed_at_the_end_of_the_job(tmp_path):
    """Issue 33.9a: under pyxis' default container_scope (global) a named container stays on the node
    after the job as enroot's ``pyxis_<name>``, and a later step naming it skips the import of its
    --container-image: with the fixed names ``ray-head``/``ray-worker`` a changed CONTAINER was
    silently ignored on a reused node, and an earlier job's state persisted. Now the names carry the
    job id, and at the end of the job one step per node removes them (``pyxis_<name>``, or with
    container_scope=job ``pyxis_<job id>_<name>``) with ``enroot remove -f``: only these, and a
    failing or missing enroot does not change the job's exit status."""
    bin_ = tmp_path / "job" / "bin"
    bin_.mkdir(parents=True)
    removed = _fake_enroot(
        bin_, ["pyxis_ray-head", "pyxis_ray-head-7", "pyxis_ray-head-70", "pyxis_7_ray-worker-7", "pyxis_ray-worker-6"]
    )
    r, calls = _launch(tmp_path / "job", fakes={"srun": RUN_CLEANUP}, CONTAINER="img.sqsh", MOUNTS=MOUNTS_OK)
    assert r.returncode == 0, r.stdout + r.stderr
    sruns = [c for c in calls if c[0] == "srun"]
    [driver] = [c for c in sruns if c[-1].endswith("driver.sh")]
    assert "--container-name=ray-head-7" in driver, driver
    assert not [a for c in sruns for a in c if a in ("--container-name=ray-head", "--container-name=ray-worker")]
    [cleanup] = [c for c in sruns if "enroot remove" in c[-1]]
    assert sruns[-1] == cleanup and "--overlap" in cleanup and "n1" in cleanup, sruns
    assert not [a for a in cleanup if a.startswith("--container")], cleanup  # on the host, where enroot is
    assert sorted(removed.read_text().split("\n")[:-1]) == [
        "remove -f pyxis_7_ray-worker-7",
        "remove -f pyxis_ray-head-7",
    ], removed.read_text()
    # no enroot on the node; a cleanup step that fails: the job's status is the driver's
    r, calls = _launch(tmp_path / "no-enroot", fakes={"srun": RUN_CLEANUP}, CONTAINER="img.sqsh", MOUNTS=MOUNTS_OK)
    assert r.returncode == 0 and [c for c in calls if c[0] == "srun" and "enroot remove" in c[-1]], r.stdout + r.stderr
    fail_cleanup = 'case "$*" in *"enroot remove"*) exit 1 ;; esac; exit 0'
    r, _ = _launch(tmp_path / "bad", fakes={"srun": fail_cleanup}, CONTAINER="img.sqsh", MOUNTS=MOUNTS_OK)
    assert r.returncode == 0, r.stdout + r.stderr
    r, _ = _launch(
        tmp_path / "driver-fails",
        ("false",),
        fakes={"srun": RUN_CLEANUP.replace("exit 0", 'exit "$FAKE_RC"')},
        CONTAINER="img.sqsh",
        MOUNTS=MOUNTS_OK,
        FAKE_RC="3",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    # without CONTAINER: no names, no cleanup step
    r, calls = _launch(tmp_path / "host")
    assert r.returncode == 0 and not [c for c in calls if c[0] == "srun" and "enroot" in c[-1]], calls


def test_docs_say_the_named_containers_are_job_scoped_and_removed():
    row = next(line for line in DOCS.splitlines() if line.startswith("| `CONTAINER` |"))
    assert "`ray-head-<job id>`" in row and "`ray-worker-<job id>`" in row, row
    assert "enroot remove" in DOCS and "container_scope" in DOCS


# the driver's step runs driver.sh here, in the batch shell's environment (as srun passes it)
RUN_DRIVER = 'case "$*" in *driver.sh) shift $(($# - 2)); exec "$@" ;; esac; exit 0'


def test_driver_runs_without_the_steps_slurm_and_pmi_variables(tmp_path):
    """Issue 33.9e: the driver's step inherited the batch shell's SLURM_* and PMI* variables (and
    srun adds its task's: SLURM_PROCID=0 of SLURM_NTASKS=1). NeMo-RL v0.7.0's init_ray passes the
    driver's whole environment to every Ray actor, where MPI/PMIx and anything that takes its rank
    from them read task 0 of 1; ray.sub (7ea279abf) unsets ^(PMI|PMIX|MPI|OMPI|SLURM)_ before Ray and
    its driver. Now driver.sh does the same for the driver's process only: the step is still an srun
    step, what the launcher gives the driver stays (NG_SLURM_ATTEMPT, NG_JOB_END_TIME, also from
    SLURM_JOB_END_TIME when scontrol gave no end), SLURMD_NODENAME (not SLURM_) too."""
    out = tmp_path / "driver.env"
    r, calls = _launch(
        tmp_path / "job",
        ("bash", "-c", f"env >{out}"),
        fakes={"srun": RUN_DRIVER},
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURM_STEP_ID="3",
        PMI_RANK="0",
        PMIX_RANK="0",
        OMPI_COMM_WORLD_RANK="0",
        MPI_LOCALRANKID="0",
        SLURMD_NODENAME="n1",
        SLURM_JOB_END_TIME="4102444800",
        SLURM_RESTART_COUNT="2",
        MAX_RESTARTS="5",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert [c for c in calls if c[0] == "srun" and c[-1].endswith("driver.sh")], calls
    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    leaked = sorted(k for k in env if re.match(r"(PMI|PMIX|MPI|OMPI|SLURM)_", k))
    assert leaked == [], leaked
    assert env["NG_SLURM_ATTEMPT"] == "2" and env["NG_JOB_END_TIME"] == "4102444800", env
    assert env["SLURMD_NODENAME"] == "n1"


def test_ray_head_and_workers_start_without_the_steps_slurm_and_pmi_variables(tmp_path):
    """Issue 33.9: every Ray actor is a child of its node's raylet and inherits the environment of the
    step that ran ``ray start``: srun's task variables (SLURM_PROCID, PMI_RANK, ...) and the batch
    shell's SLURM_*. ray.sub (7ea279abf) clears ^(PMI|PMIX|MPI|OMPI|SLURM)_ before ``ray start`` on the
    head and on every worker, as for its driver; launch.sh now does too. A two-node job whose head and
    worker steps run here (srun: the step's ``bash -c SCRIPT`` with a task's variables added; ray:
    records its environment, then runs as the real one does)."""
    envs = tmp_path / "envs"
    envs.mkdir()
    fake = tmp_path / "fake-ray"
    fake.mkdir()
    (fake / "ray").write_text(
        f'#!/usr/bin/env bash\nenv >"{envs}/$([[ " $* " == *" --head "* ]] && echo head || '
        f'echo worker).env"\nexec sleep 60 </dev/null >/dev/null 2>&1\n'
    )  # (not holding our pipes)
    (fake / "ray").chmod(0o755)
    srun = (
        SRUN_OUT + 'case "$*" in *"ray start --head"*) ' + HEAD_STARTED + ";; esac\n"
        'case "$*" in *"ray start"*) export SLURM_PROCID=1 SLURM_STEP_ID=2 PMI_RANK=1 PMIX_RANK=1 '
        'OMPI_COMM_WORLD_RANK=1; shift $(($# - 3)); exec "$@" ;; *"ray_cluster.py\' watch"*) exec sleep 60 ;; '
        "esac; exit 0"
    )
    hosts = '[[ "$1 $2" == "show hostnames" ]] && { echo n1; echo n2; exit 0; }\n'
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen(8)
        r, calls = _launch(
            tmp_path / "job",
            ("true",),
            {"srun": srun, "scontrol": hosts},
            START_RAY="1",
            HEAD_IP="127.0.0.1",
            RAY_PORT=str(gcs.getsockname()[1]),
            SLURM_JOB_NODELIST="n1,n2",
            SLURM_JOB_NUM_NODES="2",
            SLURM_NTASKS="2",
            SLURMD_NODENAME="n1",
            MAX_RESTARTS="5",
            PATH=f"{fake}:{tmp_path / 'job' / 'bin'}:{os.environ['PATH']}",
        )
    assert r.returncode == 0, r.stdout + r.stderr
    for step in ("head", "worker"):
        assert (envs / f"{step}.env").is_file(), (step, _srun_scripts(calls))
        env = dict(line.split("=", 1) for line in (envs / f"{step}.env").read_text().splitlines() if "=" in line)
        leaked = sorted(k for k in env if re.match(r"(PMI|PMIX|MPI|OMPI|SLURM)_", k))
        assert leaked == [], (step, leaked)
        assert env["SLURMD_NODENAME"] == "n1"  # not SLURM_: kept, as by ray.sub


# ---------------------------------------------------------------- 10. the watchdog -----------------


def _ray_cluster():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_cluster_under_test", SLURM / "ray_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _FakeRay:
    """``ray.nodes()`` answering from a script: a list of nodes, or an exception to raise."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = 0

    def nodes(self):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


NODE_A = {
    "NodeID": "a",
    "Alive": True,
    "NodeManagerHostname": "n1",
    "NodeManagerAddress": "10.0.0.1",
    "NodeName": "10.0.0.1",
}
NODE_B = {
    "NodeID": "b",
    "Alive": True,
    "NodeManagerHostname": "n2",
    "NodeManagerAddress": "10.0.0.2",
    "NodeName": "10.0.0.2",
}


def _watch(monkeypatch, capsys, answers, *args, env=None):
    rc_mod = _ray_cluster()
    fake = _FakeRay(answers)
    monkeypatch.setattr(rc_mod, "_connect", lambda address, what: fake)
    monkeypatch.setattr(rc_mod.time, "sleep", lambda s: None)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    rc = rc_mod.main(["watch", "--address=10.0.0.1:1200", "--expected=2", "--interval=0", *args])
    return rc, fake.calls, capsys.readouterr().out


def test_watchdog_tolerates_transient_probe_errors_and_fails_after_k_in_a_row(monkeypatch, capsys):
    """Issue 33.10a: one ``ray.nodes()`` that raised (a GCS call timing out under load) ended the
    watchdog (exit 5) and so the job. Now the watchdog fails only after K probes in a row failed
    (--failures, launch.sh's RAY_WATCH_FAILURES, default 3); a probe that answers resets the count;
    a lost node still fails at the first probe that shows it (exit 4)."""
    both, lost_b = [NODE_A, NODE_B], [NODE_A, {**NODE_B, "Alive": False}]
    err = TimeoutError("GetAllNodeInfo timed out")
    rc, calls, out = _watch(monkeypatch, capsys, [both, err, both, err, err, both, lost_b])
    assert (rc, calls) == (4, 7), out
    assert "ERROR: Ray node lost: n2 (10.0.0.2)" in out, out
    assert out.count("ERROR") == 1 and "probe 2 of 3 failed in a row" in out, out
    rc, calls, out = _watch(monkeypatch, capsys, [both, err, err, err, both])
    assert (rc, calls) == (5, 4), out
    assert out.strip().splitlines()[-1] == (
        "ERROR: lost contact with the Ray head at 10.0.0.1:1200: 3 probes in a "
        "row failed, the last: TimeoutError: GetAllNodeInfo timed out"
    ), out
    rc, calls, out = _watch(monkeypatch, capsys, [both, err, both], "--failures=1")
    assert (rc, calls) == (5, 2), out


def test_watchdog_writes_the_lost_nodes_slurm_names(monkeypatch, capsys, tmp_path):
    """The lost node's Slurm name goes to --lost-out for the launcher's ExcNodeList: the raylet's
    --node-name (launch.sh: SLURMD_NODENAME), else, where Ray kept its default (the IP), the host name."""
    out = tmp_path / "lost_nodes"
    named = {**NODE_B, "NodeName": "gpu-b07", "NodeManagerHostname": "gpu-b07.cluster.example"}
    rc, _, text = _watch(
        monkeypatch, capsys, [[NODE_A, named], [NODE_A, {**named, "Alive": False}]], f"--lost-out={out}"
    )
    assert rc == 4 and out.read_text() == "gpu-b07\n", text
    rc, _, _ = _watch(
        monkeypatch, capsys, [[NODE_A, NODE_B], [NODE_A, {**NODE_B, "Alive": False}]], f"--lost-out={out}"
    )
    assert rc == 4 and out.read_text() == "gpu-b07\nn2\n"


def test_ray_nodes_are_named_after_their_slurm_nodes(tmp_path):
    r, calls = _launch_ray(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    [head] = [s for s in _srun_scripts(calls) if "ray start --head" in s]
    [watch] = [s for s in _srun_scripts(calls) if "ray_cluster.py' watch" in s]
    assert "${SLURMD_NODENAME:+--node-name=$SLURMD_NODENAME}" in head, head
    assert f"--lost-out='{tmp_path}/logs/job-7/lost_nodes'" in watch, watch


def test_launch_passes_ray_watch_failures_to_the_watchdog(tmp_path):
    r, calls = _launch_ray(tmp_path / "a")
    assert r.returncode == 0, r.stdout + r.stderr
    [watch] = [s for s in _srun_scripts(calls) if "ray_cluster.py' watch" in s]
    assert "--failures=3" in watch and _table_default("RAY_WATCH_FAILURES") == "3", watch
    r, calls = _launch_ray(tmp_path / "b", RAY_WATCH_FAILURES="5")
    assert [s for s in _srun_scripts(calls) if "ray_cluster.py' watch" in s and "--failures=5" in s], calls


# the watchdog reports a lost node (its ERROR line in watch.log, exit 4) while the driver runs
# the job was submitted with --exclude=n5 (scontrol show job)
EXC_N5 = '[[ "$1 $2" == "show job" ]] && { echo "   ReqNodeList=(null) ExcNodeList=n5"; exit 0; }\n'
NODE_LOST_SRUN = (
    SRUN_OUT + 'case "$*" in *"ray start"*) ' + HEAD_STARTED + "exec sleep 60 ;;\n"
    '  *"ray_cluster.py\' watch"*) sleep 1; echo "ERROR: Ray node lost: n2 (10.0.0.2) — 1 of 2 nodes '
    'alive" >>"$out"; lost=$(sed -n "s/.*--lost-out=\'\\([^\']*\\)\'.*/\\1/p" <<<"$*"); '
    'echo n2 >>"$lost"; exit 4 ;;\n'
    "  *driver.sh) exec sleep 60 ;; esac; exit 0"
)


def test_a_lost_node_requeues_the_job_within_max_restarts(tmp_path):
    """Issue 33.10a: a node lost under a running driver (the watchdog's exit 4) failed the job for
    good; Slurm would requeue a --requeue job on a node failure itself, but only once it declares the
    node down (SlurmdTimeout, minutes later), and the launcher had ended the job by then. Now the
    launcher requeues it (the run resumes from its latest checkpoint) within the same MAX_RESTARTS,
    and says why; at MAX_RESTARTS it fails as before."""

    def launch(d, scontrol=EXC_N5, **env):
        with socket.socket() as gcs:
            gcs.bind(("127.0.0.1", 0))
            gcs.listen(8)
            return _launch(
                d,
                ("true",),
                {"srun": NODE_LOST_SRUN, "scontrol": scontrol},
                START_RAY="1",
                HEAD_IP="127.0.0.1",
                RAY_PORT=str(gcs.getsockname()[1]),
                DRIVER_STOP_GRACE="2",
                **env,
            )

    r, calls = launch(tmp_path / "a", SLURM_RESTART_COUNT="1", MAX_RESTARTS="3")
    assert r.returncode == 0, r.stdout + r.stderr
    # the lost node's Slurm name (the watchdog's --lost-out) and the command that keeps the pending job off it,
    # with the exclusions it was submitted with (n5); the launcher itself cannot: Slurm refuses a running job's
    # ExcNodeList (tried on the local cluster, docs/slurm.md)
    assert ["scontrol", "requeue", "7"] in calls and not [c for c in calls if c[:2] == ["scontrol", "update"]], calls
    assert (
        "warning: lost node(s) n2: Slurm may start the requeued job on them again; to prevent that, while it "
        "waits to restart (squeue: PD): scontrol update JobId=7 ExcNodeList=n5,n2"
    ) in r.stdout, r.stdout
    status = json.loads((tmp_path / "a" / "logs" / "job-7" / "status.json").read_text())
    assert status["exit_code"] == 0 and status["reason"] == (
        "a Ray node was lost (Ray node lost: n2 (10.0.0.2) — 1 of 2 nodes alive): requeued, attempt 2 will "
        "resume from the latest checkpoint"
    ), status
    assert status["reason"] in r.stdout, r.stdout
    r, calls = launch(tmp_path / "b", SLURM_RESTART_COUNT="3", MAX_RESTARTS="3")
    assert r.returncode == 1 and ["scontrol", "requeue", "7"] not in calls, r.stdout + r.stderr
    assert "lost node(s)" not in r.stdout + r.stderr
    errors = [line for line in r.stdout.splitlines() if "ERROR:" in line]
    assert errors and errors[-1].endswith(
        "ERROR: Ray node lost: n2 (10.0.0.2) — 1 of 2 nodes alive (Ray watchdog "
        f"exit 4; see {tmp_path}/b/logs/job-7/watch.log); MAX_RESTARTS=3 reached, "
        "not requeueing"
    ), errors


# Ray's own report when a process of `ray start --block` dies: printed by Ray's code, into the step's log
RAY_REPORT = r"""
import os, subprocess, sys, tempfile
from ray.autoscaler._private.cli_logger import cli_logger
from ray.scripts import scripts
logs = tempfile.mkdtemp()
with open(os.path.join(logs, "raylet.out"), "w") as f:
    f.write("[2026-11-29 18:06:55,101 I 11 11] (raylet) main.cc:12: Setting node ID\n"
            "[2026-11-29 18:07:48,708 E 11 11] (raylet) node_manager.cc:34: marked dead by the GCS\n"
            "[2026-11-29 18:07:48,709 I 11 11] (raylet) main.cc:56: shutting down\n")
raylet = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
raylet.wait()
cli_logger.error("Some Ray subprocesses exited unexpectedly:")   # scripts.py's words before the details
scripts._log_unexpected_subprocess_exit_details([("raylet", raylet)], logs, None)
"""
RAY_DIES_SRUN = (
    SRUN_OUT + 'case "$*" in *"ray start"*) ' + HEAD_STARTED + "sleep 2; "
    f'{sys.executable} "$(dirname "$0")/ray_report.py"'
    ' >>"$out" 2>&1; exit 1 ;;\n'
    '  *"ray_cluster.py\' watch"*|*driver.sh) exec sleep 60 ;; esac; exit 0'
)


def test_a_dead_ray_head_fails_the_job_with_rays_own_reason(tmp_path):
    """A Ray head whose raylet died (`ray start --block` exits 1) failed the job with "a node or its Ray
    process died; see ray-head.log", and what Ray printed there was all there was to go on (a CI run's
    head died under load and the reason was lost with the log). Now the job's error names the Ray
    process and its exit code and the last error line of its log, from the report Ray's own code prints."""
    (tmp_path / "bin").mkdir(parents=True)
    (tmp_path / "bin" / "ray_report.py").write_text(RAY_REPORT)
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen(8)
        r, calls = _launch(
            tmp_path,
            ("true",),
            {"srun": RAY_DIES_SRUN},
            START_RAY="1",
            HEAD_IP="127.0.0.1",
            RAY_PORT=str(gcs.getsockname()[1]),
            DRIVER_STOP_GRACE="2",
            MAX_RESTARTS="0",
        )
    assert r.returncode == 1, r.stdout + r.stderr
    status = json.loads((tmp_path / "logs" / "job-7" / "status.json").read_text())
    assert status["reason"] == (
        "the ray-head step exited (code 1): Ray reports raylet [exit code=1] exited; the last error in its log: "
        "[2026-11-29 18:07:48,708 E 11 11] (raylet) node_manager.cc:34: marked dead by the GCS; see "
        f"{tmp_path}/logs/job-7/ray-head.log"
    ), status
    assert status["reason"] in r.stdout, r.stdout


# what `ray start --head` prints when its raylet does not register within Ray 2.60's fixed 30 s
# (node.py), then exit 1; the fake head does this on its first FAILS starts (a count in $tries)
HEAD_TIMEOUT = (
    "Exception: The current node timed out during startup. This could happen because some of the "
    "raylet failed to startup or the GCS has become overloaded."
)
HEAD_TIMES_OUT_SRUN = (
    SRUN_OUT + 'tries="$(dirname "$0")/head_tries"\n'
    'case "$*" in *"ray start --head"*) echo x >>"$tries"\n'
    '    if (( $(wc -l <"$tries") <= FAILS )); then sleep 1; { echo "Traceback (most recent call last):";'
    f' echo "  File "ray/_private/node.py", line 440, in __init__"; echo "{HEAD_TIMEOUT}"; }} >>"$out";'
    " exit 1; fi\n    " + HEAD_STARTED + '[[ -n "${DIES:-}" ]] && { sleep 2; exit 1; }; exec sleep 60 ;;\n'
    '  *"ray_cluster.py\' watch"*) exec sleep 60 ;;\n'
    '  *driver.sh) [[ -n "${DIES:-}" ]] && exec sleep 60 ;; esac; exit 0'
)


@pytest.mark.parametrize("fails, dies", [(2, False), (3, False), (2, True)])
def test_a_ray_head_that_times_out_in_its_start_is_started_again(tmp_path, fails, dies):
    """A CI run's Ray head step exited 1 46 s after its GCS port opened, with no report of a dead
    process: what `ray start --head` does when its raylet has not registered within Ray 2.60's fixed
    30 s on an overloaded node. The launcher took the open port for a started head and failed the job
    when the step exited. Now the head is ready when Ray prints "Ray runtime started."; a head that
    exits before that is started again, RAY_HEAD_TRIES (3) times in all, each retry a line with
    Ray's error; the third failure fails the job with that error (not "a node or its Ray process died").
    A head that started and then exits without a word (``dies``) is not started again, and the job's
    error is not an earlier start's."""
    r, calls = _launch(
        tmp_path,
        ("true",),
        {"srun": HEAD_TIMES_OUT_SRUN},
        START_RAY="1",
        FAILS=str(fails),
        DIES="1" if dies else "",
        DRIVER_STOP_GRACE="2",
        MAX_RESTARTS="0",
    )
    heads = [c for c in calls if c[0] == "srun" and "ray start --head" in " ".join(c)]
    retries = [line.split("] ", 1)[1] for line in r.stdout.splitlines() if "before it started" in line]
    log = tmp_path / "logs" / "job-7" / "ray-head.log"
    assert len(heads) == 3 and log.read_text().count(HEAD_TIMEOUT) == fails, (heads, r.stdout + r.stderr)
    assert retries == [f"the Ray head exited (code 1) before it started: {HEAD_TIMEOUT[:300]}; starting it again"] * 2
    assert [
        re.sub(r"srun pid \d+", "srun pid N", line.split("] ", 1)[1])
        for line in r.stdout.splitlines()
        if "starting the Ray head on" in line
    ] == [
        "starting the Ray head on n1 (srun pid N)",
        "starting the Ray head on n1 (srun pid N, try 2 of 3)",
        "starting the Ray head on n1 (srun pid N, try 3 of 3)",
    ], r.stdout
    status = json.loads((tmp_path / "logs" / "job-7" / "status.json").read_text())
    if dies:
        assert r.returncode == 1 and status["reason"] == (
            f"the ray-head step exited (code 1): a node or its Ray process died; see {log}"
        ), (status, r.stdout + r.stderr)
    elif fails == 2:  # the third start: the job runs (the driver `true`)
        assert r.returncode == 0 and status["reason"] == "driver finished", (status, r.stdout + r.stderr)
        assert "Ray head is up at" in r.stdout
    else:
        assert r.returncode == 1 and status["reason"] == (
            f"the ray-head step exited (code 1): {HEAD_TIMEOUT[:300]}; see {log}"
        ), (status, r.stdout + r.stderr)


# ---------------------------------------------------------------- 11. preemption, honestly ---------


def _site(mode: str, params: str = "(null)", grace: int = 120, part_mode: str | None = None) -> str:
    """The fake scontrol's answers to ``show config`` (the preemption lines) and ``show partition -o gpu``."""
    return (
        f'[[ "$1 $2" == "show config" ]] && printf "%s\\n" "Configuration data as of 2026-11-29T12:00:00" '
        f'"PreemptMode             = {mode}" "PreemptType             = preempt/partition_prio" '
        f'"PreemptParameters       = {params}" && exit 0\n'
        f'[[ "$1 $2 $3 $4" == "show partition -o gpu" ]] && echo "PartitionName=gpu AllowGroups=ALL '
        f'Default=YES GraceTime={grace} PreemptMode={part_mode or mode} State=UP" && exit 0\n'
    )


def _preemption_line(r: subprocess.CompletedProcess, logs: Path) -> str:
    [line] = [x for x in (logs / "launcher.log").read_text().splitlines() if "] preemption: " in x]
    assert line in r.stdout
    return line.split("] ", 1)[1]


def test_launch_states_in_one_line_what_a_preemption_costs_this_job(tmp_path):
    """Issue 33.11: before Ray starts the launcher reads the site's preemption settings
    (``scontrol show config``: PreemptMode, PreemptType, PreemptParameters; the job's partition:
    its GraceTime and own PreemptMode, which wins) and logs one line saying what a preemption does
    to this job: a NeMo-RL run under plain SIGTERM saves nothing; with send_user_signal it gets
    the launcher's USR1 path. A cluster without preemption says so; scontrol saying nothing does
    not fail the job."""
    cases = {
        "requeue": (
            _site("REQUEUE"),
            NRL_DRIVER,
            "preemption: PreemptMode=REQUEUE, PreemptType=preempt/partition_prio, PreemptParameters=(null), "
            "GraceTime=120s: SIGTERM to every step at once: Ray stops under the NeMo-RL driver, which does "
            "not save; the run loses the steps since its last checkpoint (checkpointing.save_period); "
            "Slurm requeues the job and it resumes from its latest checkpoint",
        ),
        "cancel-usr1": (
            _site("OFF", "send_user_signal", 600, part_mode="CANCEL"),
            NRL_DRIVER,
            "preemption: PreemptMode=CANCEL, PreemptType=preempt/partition_prio, "
            "PreemptParameters=send_user_signal, GraceTime=600s: SIGUSR1 to the batch shell: the "
            "driver saves at the end of its current step if that step and the save end within "
            "GraceTime=600s (exit 99, on which the launcher runs scontrol requeue), else it is killed "
            "and loses the steps since its last checkpoint; Slurm cancels the job rather than "
            "requeue it",
        ),
        "off": (
            _site("OFF"),
            NRL_DRIVER,
            "preemption: PreemptMode=OFF, PreemptType=preempt/partition_prio, PreemptParameters=(null), "
            "GraceTime=120s: no preemption on this cluster",
        ),
        "silent": ("", ("true",), "preemption: unknown (scontrol show config gave no PreemptMode)"),
    }
    for name, (scontrol, cmd, want) in cases.items():
        d = tmp_path / name
        r, calls = _launch(d, cmd, {"scontrol": scontrol}, SLURM_JOB_PARTITION="gpu")
        assert r.returncode == 0, (name, r.stdout + r.stderr)
        assert _preemption_line(r, d / "logs" / "job-7") == want, name
        if scontrol:
            asked = [c for c in calls if c[:3] in (["scontrol", "show", "config"], ["scontrol", "show", "partition"])]
            assert asked == [["scontrol", "show", "config"], ["scontrol", "show", "partition", "-o", "gpu"]], calls


def test_docs_say_what_the_preemption_line_reports():
    section = DOCS[DOCS.index("## Preemption, time limit and requeue") : DOCS.index("## One launch story")]
    assert "preemption: PreemptMode=" in section and "GraceTime" in section and "send_user_signal" in section


def _trainings(calls: list[list[str]]) -> dict[str, list[str]]:
    """The training jobs' sbatch argv by job name (those that run slurm/launch.sh)."""
    return {
        next(a for a in c if a.startswith("--job-name=")): c
        for c in calls
        if c[0] == "sbatch" and str(SLURM / "launch.sh") in c
    }


def test_a_30b_a3b_training_job_gets_a_30_minute_usr1_lead_before_the_users_sbatch_args(tmp_path):
    """Issue 33.11: launch.sh's --signal=B:USR1@300 gives the driver 300 s to end its step and save;
    a 30B-A3B step takes 10-15 min, so that USR1 came too late and the time limit cut the run
    without a save. submit_comparison.sh now asks for --signal=B:USR1@1800 for a 30B-A3B config's
    training job, before --sbatch / --train-sbatch (the user's own --signal wins: sbatch takes the
    last); other configs keep launch.sh's 300 s."""
    r, calls = _submit(tmp_path / "a", ["--no-preflight", *MEGATRON_30B])
    assert r.returncode == 0, r.stderr
    jobs = _trainings(calls)
    assert len(jobs) == 2, calls
    for argv in jobs.values():
        assert [a for a in argv if a.startswith("--signal")] == ["--signal=B:USR1@1800"], argv
    r, calls = _submit(
        tmp_path / "b", ["--no-preflight", "--train-sbatch", "--time=4:00:00 --signal=B:USR1@900", *MEGATRON_30B]
    )
    assert r.returncode == 0, r.stderr
    for argv in _trainings(calls).values():
        assert argv.index("--signal=B:USR1@1800") < argv.index("--signal=B:USR1@900"), argv
    r, calls = _submit(tmp_path / "c", ["--no-preflight", *LOCAL])
    assert r.returncode == 0, r.stderr
    jobs = _trainings(calls)
    assert len(jobs) == 2 and not [a for c in jobs.values() for a in c if a.startswith("--signal")], jobs


def test_docs_say_why_the_30b_a3b_lead_is_30_minutes():
    assert "--signal=B:USR1@1800" in DOCS and "30b_a3b" in DOCS
