"""``nemo-granular export`` of NeMo-RL Megatron checkpoints, executed on CPU.

The checkpoints are written by NeMo-RL's and Megatron-Bridge's own code (HF import,
``setup_model_config`` on NeMo-RL's Qwen3-30B-A3B recipe, Bridge's ``save_checkpoint``,
``CheckpointManager``) over 2 gloo processes, from tiny HF Qwen3 / Qwen3-MoE models
(``tests/harness/export_cpu/megatron_writer.py``). Each export is reloaded with transformers and compared
with the HF source: the exported tensors must be bit-equal to the source's (rounded to bf16 for
the bf16 run) and the logits within 1e-6 (fp32 end to end, so any difference could only come from
a kernel; measured: 0.0 in every case).

The only CPU stand-in the export itself needs is Megatron's local layer spec in place of Transformer
Engine's (``tests/harness/cpu_stand_ins/megatron.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from export_cpu.tiny_hf import YARN_OVERRIDES
from nemo_granular.cli import main as top_main

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.nemo_rl]

LOGIT_TOL = 1e-6

# name → (HF source, TP, PP, EP, NeMo-RL precision, export dtype)
CASES = {
    "moe_ep1": ("hf_moe", 1, 1, 1, "float32", "fp32"),
    "moe_ep2": ("hf_moe", 1, 1, 2, "float32", "fp32"),
    "moe_tp2ep2_bf16": ("hf_moe", 2, 1, 2, "bfloat16", "bf16"),  # the 30B-A3B recipe's precision and TP×EP shape
    "dense_tp1": ("hf_dense", 1, 1, 1, "float32", "fp32"),
    "dense_tp2": ("hf_dense", 2, 1, 1, "float32", "fp32"),
    "dense_pp2": ("hf_dense", 1, 2, 1, "float32", "fp32"),
}
STEP = 3


@pytest.fixture(scope="module")
def megatron_checkpoints(megatron_workers, tmp_path_factory):
    """Every case's ``checkpoint_dir/step_3`` from one 2-rank writer run (≈ 60 CPU-s)."""
    from export_cpu.launch import run_ranks
    from export_cpu.tiny_hf import make_hf_model

    root = tmp_path_factory.mktemp("megatron")
    make_hf_model(root / "hf_moe", moe=True, seed=1)
    make_hf_model(root / "hf_dense", moe=False, seed=2)
    jobs = [
        {
            "hf_dir": str(root / hf),
            "checkpoint_dir": str(root / name),
            "step": STEP,
            "tp": tp,
            "pp": pp,
            "ep": ep,
            "precision": precision,
        }
        for name, (hf, tp, pp, ep, precision, _) in CASES.items()
    ]
    jobs.append(
        {
            "hf_dir": str(root / "hf_dense"),
            "checkpoint_dir": str(root / "dense_yarn"),
            "step": STEP,
            "tp": 2,
            "pp": 1,
            "ep": 1,
            "precision": "float32",
            "hf_config_overrides": YARN_OVERRIDES,
        }
    )
    run_ranks("megatron_writer", jobs, world=2, log_dir=root)
    return root


@pytest.fixture
def local_spec(megatron_workers, monkeypatch):
    from cpu_stand_ins.megatron import use_cpu_layer_spec

    use_cpu_layer_spec(setattr_=monkeypatch.setattr)


def run_cli(argv, capsys):
    capsys.readouterr()
    rc = top_main(["export", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _expert_ranges_per_file(iter_dir: Path) -> dict[str, set[int]]:
    """{.distcp file: global expert indices whose fc1 chunks it holds} from the DCP metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(iter_dir)).read_metadata()
    out: dict[str, set[int]] = {}
    for index, info in meta.storage_data.items():
        if index.fqn == "decoder.layers.mlp.experts.experts.linear_fc1.weight":
            out.setdefault(info.relative_path, set()).add(int(index.offset[1]))  # (layer, expert, row, col)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_export_equals_hf_source(case, megatron_checkpoints, local_spec, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from export_cpu.tiny_hf import assert_same_weights, max_logit_diff
    from nemo_granular.export.source import read_yaml

    hf, tp, pp, ep, precision, dtype = CASES[case]
    ckpt_dir = megatron_checkpoints / case
    step = ckpt_dir / f"step_{STEP}"
    # the layout NeMo-RL writes
    assert sorted(os.listdir(ckpt_dir)) == [f"step_{STEP}"]
    assert {"config.yaml", "training_info.json", "policy"} <= set(os.listdir(step))
    weights = step / "policy" / "weights"
    assert (weights / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    iter_dir = weights / "iter_0000000"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json", "run_config.yaml"} <= set(
        os.listdir(iter_dir)
    )
    run_cfg = read_yaml(iter_dir / "run_config.yaml")["model"]
    assert (
        run_cfg["tensor_model_parallel_size"],
        run_cfg["pipeline_model_parallel_size"],
        run_cfg["expert_model_parallel_size"],
    ) == (tp, pp, ep)
    assert run_cfg["transformer_layer_spec"]["_target_"].endswith("gpt_provider.default_layer_spec")
    assert read_yaml(step / "config.yaml")["policy"]["model_name"] == str(megatron_checkpoints / hf)
    if ep == 2:  # experts really sharded: rank 0's file holds experts {0, 1}, rank 1's {2, 3}
        assert _expert_ranges_per_file(iter_dir) == {"__0_0.distcp": {0, 1}, "__1_0.distcp": {2, 3}}

    out = tmp_path / "hf"
    rc, stdout, err = run_cli([ckpt_dir, out, "--dtype", dtype, "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(stdout)  # Bridge's own progress output must not reach stdout
    assert rep["source"] == "megatron" and rep["step_dir"] == str(step)
    assert rep["verification"]["exact_max_abs_diff"] <= 1e-5
    saved = "×".join(f"{k}{v}" for k, v in (("TP", tp), ("PP", pp), ("EP", ep)) if v > 1) or "no model parallelism"
    assert any(f"saved with {saved};" in n for n in rep["notes"]), rep["notes"]

    source = AutoModelForCausalLM.from_pretrained(str(megatron_checkpoints / hf), dtype=torch.float32).eval()
    if dtype == "bf16":  # the run trained in bf16: its weights are the source rounded to bf16
        for p in source.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert_same_weights(source, exported)
    tok = AutoTokenizer.from_pretrained(str(out))
    diff = max_logit_diff(source, exported, tok)
    note = ""
    if dtype == "bf16":  # the cost of the run's bf16, for the docs (not an export error)
        full = AutoModelForCausalLM.from_pretrained(str(megatron_checkpoints / hf), dtype=torch.float32).eval()
        note = f"; vs the unrounded fp32 source {max_logit_diff(full, exported, tok):.3g}"
    print(f"max |logit diff| vs source, {case}: {diff:.3g}{note}")  # shown with -s
    assert diff <= LOGIT_TOL
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM" if hf == "hf_moe" else "Qwen3ForCausalLM"]


def test_megatron_export_applies_training_hf_config_overrides(megatron_checkpoints, tmp_path):
    """A run trained with ``policy.hf_config_overrides`` (YaRN, TP2): NeMo-RL imported the HF model
    with ``AutoBridge.from_hf_pretrained(model_name, **hf_config_overrides)``, so the Megatron model
    it trained used YaRN; the export must carry it and compute what the HF model with the same
    override computes. The export runs in its own process with the shared CPU stand-ins
    (``tests/harness/export_cpu/export_on_cpu.py``: Megatron's YaRN embedding asks for a CUDA device when built)."""
    import subprocess

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from export_cpu.tiny_hf import assert_same_weights, max_logit_diff
    from nemo_granular.export.source import read_yaml

    step = megatron_checkpoints / "dense_yarn" / f"step_{STEP}"
    assert read_yaml(step / "config.yaml")["policy"]["hf_config_overrides"] == YARN_OVERRIDES
    run_cfg = read_yaml(step / "policy" / "weights" / "iter_0000000" / "run_config.yaml")["model"]
    assert run_cfg["position_embedding_type"] == "yarn"  # what Megatron trained with
    out = tmp_path / "hf"
    res = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "harness" / "export_cpu" / "export_on_cpu.py"),
            str(step),
            str(out),
            "--dtype",
            "fp32",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    stdout = res.stdout

    hf = megatron_checkpoints / "hf_dense"
    trained_cfg = AutoConfig.from_pretrained(str(hf), **YARN_OVERRIDES)
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == trained_cfg.rope_parameters
    trained = AutoModelForCausalLM.from_pretrained(str(hf), config=trained_cfg, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert_same_weights(trained, exported)
    tok = AutoTokenizer.from_pretrained(str(out))
    same, without = max_logit_diff(trained, exported, tok), max_logit_diff(plain, exported, tok)
    print(f"max |logit diff| exported vs HF+YaRN {same:.3g}, vs HF without the override {without:.3g}")
    assert same <= LOGIT_TOL
    assert without > 1e-3  # the override changes what the model computes
    assert "note: policy.hf_config_overrides applied as in training: rope_scaling" in stdout


def test_upstream_single_process_moe_build_needs_cuda(megatron_checkpoints, local_spec, monkeypatch):
    """Why a CPU-only single-process export of a Qwen3-MoE checkpoint stopped (at any EP): Bridge's
    ``load_megatron_model`` keeps the recorded ``alltoall`` dispatcher, whose constructor creates a
    CUDA stream. The export sets ``allgather`` for its build; this pins the upstream behaviour."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.model_load_save import temporary_distributed_context

    monkeypatch.setattr(torch.cuda, "Stream", torch.cuda.streams.Stream)  # torch's own, whatever else ran
    bridge = AutoBridge.from_hf_pretrained(str(megatron_checkpoints / "hf_moe"))
    iter_dir = megatron_checkpoints / "moe_ep2" / f"step_{STEP}" / "policy" / "weights" / "iter_0000000"
    with temporary_distributed_context(backend="gloo"):
        with pytest.raises(RuntimeError, match=r"torch\.cuda\.Stream requires CUDA support"):
            bridge.load_megatron_model(str(iter_dir))


def test_eval_job_exports_with_nemo_rl_megatron_worker_venv(megatron_checkpoints, nemo_rl_src, tmp_path):
    """Issue 24.1 end to end: ``eval-checkpoints`` started by an interpreter without Megatron-Bridge
    (NeMo-RL's ``.venv`` of a bare ``uv sync``) exports the Megatron checkpoint with the Megatron
    worker venv under ``NEMO_RL_VENV_DIR`` (where NeMo-RL's image keeps it), then evaluates it
    (``run_eval`` replaced by the shim of tests/test_evals.py: vLLM needs a GPU). The worker venv is
    a real venv whose site holds this machine's packages, the pinned Megatron sources and the
    shared CPU stand-ins (a ``.pth``); nemo_granular it gets from the export command itself.
    Before the fix the export ran with the driver's interpreter: ImportError, no benchmark."""
    import shutil
    import subprocess
    import sysconfig

    from transformers import AutoModelForCausalLM

    from conftest import HOST_PATHS, env_without_nemo_rl
    from export_cpu.tiny_hf import assert_same_weights
    from nemo_granular.evals.export_python import STOCK_MEGATRON_WORKER
    from test_evals import SHIM, _data_dir, _expected, _make_venv

    run = tmp_path / "espo_seed0"
    shutil.copytree(megatron_checkpoints / "dense_tp2" / f"step_{STEP}", run / "checkpoints" / f"step_{STEP}")
    tests = str(Path(__file__).parent / "harness")  # the CPU stand-ins
    # the pinned sources first (as conftest puts them first on this process's path), then the packages
    worker = _make_venv(
        tmp_path / "ray_venvs" / STOCK_MEGATRON_WORKER,
        *HOST_PATHS,
        tests,
        sysconfig.get_paths()["purelib"],
        "import cpu_stand_ins; cpu_stand_ins.install()",
    )
    data = _data_dir(tmp_path, ["aime24", "aime25", "math500", "hmmt25"])
    shim = tmp_path / "run_eval_shim.py"
    shim.write_text(SHIM)
    env = env_without_nemo_rl(
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        NEMO_RL_VENV_DIR=str(tmp_path / "ray_venvs"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    for var in ("NG_EXPORT_PYTHON", "NEMO_RL_PY_EXECUTABLES_SYSTEM"):
        env.pop(var, None)
    launcher = f"env PYTHONPATH={os.pathsep.join(HOST_PATHS)} {sys.executable} {shim}"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_granular",
            "eval-checkpoints",
            str(run),
            "--suite",
            "espo",
            "--nemo-rl",
            str(nemo_rl_src),
            "--data-dir",
            str(data),
            "--launcher",
            launcher,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"Megatron checkpoints exported by {worker}" in res.stderr

    hf = run / "hf" / f"step_{STEP}"
    source = AutoModelForCausalLM.from_pretrained(str(megatron_checkpoints / "hf_dense"), dtype=torch.float32)
    for p in source.parameters():  # eval-checkpoints exports in bf16
        p.data = p.data.to(torch.bfloat16).float()
    assert_same_weights(source, AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32))
    scores = json.loads((run / "evals.json").read_text())["suites"]["espo"]["checkpoints"][str(STEP)]
    for key, n in (("aime24", 32), ("aime25", 32), ("math500", 1), ("hmmt25", 32)):
        problems = len((data / f"{key}.jsonl").read_text().splitlines())
        assert scores[key] == pytest.approx(_expected(problems, n, STEP)), key
