"""NeMo-RL's real GRPO loop with the plugin, end to end on CPU (DTensor-v2 backend).

World: NeMo-RL (``nemo_rl_src``) + the CPU host of ``tests/cpu_host`` (one private Ray head that
declares 4 GPUs for the whole module; docs/nemo-rl.md §7 lists every stand-in). Each run is
``python -m cpu_host.launch grpo --config <child of a shipped config>``: our unchanged
``nemo_granular.run_grpo.main`` → NeMo-RL's real ``setup()`` (Ray actors, the real
``DTensorPolicyWorkerV2.__init__`` through our extension class, the math / ``espo_math``
environment actors) → the real ``grpo_train`` for 3 steps: generation (transformers on CPU in
vLLM's place, refit through NeMo-RL's ``save_checkpoint``), rewards, our estimators, the π_old
logprob + entropy pass inside the worker, ``train`` with the granular loss, NeMo-RL's Logger
(TensorBoard) and CheckpointManager.

Runs (module-scoped, each used by several tests):
* SSPO, tiny Qwen3, 1 worker, child of ``nemo_rl/sspo_math_1B.yaml``; then the same run resumed
  from its step-2 checkpoint in a new directory;
* ESPO (``espo_math`` environment and verifier), tiny Qwen3-MoE (Automodel's own MoE model), 1 worker;
* GSPO, tiny Qwen3, 4 workers (FSDP2 over DP = 2 × TP = 2 on gloo), child of ``grpo_r1_distill_qwen_1.5b.yaml``.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from cpu_host import configs, models
from cpu_host.cluster import RayHead
from cpu_host.runs import copy_checkpoints, finite, run_ok

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.fixture(scope="module")
def world(nemo_rl_src):
    root = Path(tempfile.mkdtemp(prefix="ngrpo", dir="/tmp"))   # short: Ray's socket paths live under it
    try:
        # 2 heads, 2 kv heads: tensor parallelism needs kv heads divisible by TP = 2
        w = SimpleNamespace(root=root, dense=models.write_model(root / "qwen3", kv_heads=2),
                            moe=models.write_model(root / "qwen3_moe", moe=True),
                            data=models.write_math_data(root / "math.jsonl"))
        with RayHead(root, num_cpus=8, num_gpus=4) as head:
            w.head = head
            yield w
    finally:
        if not os.environ.get("NEMO_GRANULAR_KEEP_LOOP_RUNS"):
            shutil.rmtree(root, ignore_errors=True)


def _child(w, name: str, parent: str, *, model=None, env="math", gpus=1, extra=None) -> tuple[Path, Path]:
    run = w.root / name
    run.mkdir()
    over = configs.shrink(run, model or w.dense, w.data, env=env, gpus=gpus, steps=STEPS)
    # not run/config.yaml: the report reads the resolved config NeMo-RL's checkpointer writes
    return configs.write_child(run / "child.yaml", configs.CONFIGS / parent, over, extra), run



@pytest.fixture(scope="module")
def sspo(world):
    cfg, run = _child(world, "sspo", "nemo_rl/sspo_math_1B.yaml")
    return run_ok(world.head, "grpo", cfg, run)


@pytest.fixture(scope="module")
def sspo_resumed(world, sspo):
    """The SSPO run's config in a new directory holding only its step_1 and step_2 checkpoints."""
    cfg, run = _child(world, "sspo_resumed", "nemo_rl/sspo_math_1B.yaml")
    copy_checkpoints(sspo, run, (1, 2))
    return run_ok(world.head, "grpo", cfg, run)


@pytest.fixture(scope="module")
def espo_moe(world):
    extra = {"grpo": {"adv_estimator": {"name": "espo", "verification_failed_key": "verification_failed"}},
             "loss_fn": {"granular": {"algorithm": "espo", "entropy_top_fraction": 0.2,
                                      "espo": {"alpha": 1.0, "vocab_size": None}}}}
    cfg, run = _child(world, "espo_moe", "nemo_rl/sspo_math_1B.yaml", model=world.moe, env="espo_math", extra=extra)
    return run_ok(world.head, "grpo", cfg, run)


@pytest.fixture(scope="module")
def gspo_tp2_dp2(world):
    """4 workers: FSDP2 over DP = 2 × tensor parallelism TP = 2 (vocabulary-parallel logits)."""
    extra = {"loss_fn": {"token_level_loss": False, "ratio_clip_c": None, "granular": {"algorithm": "gspo"}},
             "grpo": {"adv_estimator": {"name": "grpo"}}, "policy": {"dtensor_cfg": {"tensor_parallel_size": 2}}}
    cfg, run = _child(world, "gspo_tp2_dp2", "grpo_r1_distill_qwen_1.5b.yaml", gpus=4, extra=extra)
    return run_ok(world.head, "grpo", cfg, run)


# ---------------------------------------------------------------------------------------------- checks
def _trained_every_step(run, *, needs_ids: bool, logprob_tol: float):
    assert run.steps("train/loss") == [1, 2, 3], run.failure()
    for tag in ("train/loss", "train/grad_norm", "train/reward", "train/prev_entropy_mean"):
        assert finite(run.series(tag).values()), (tag, run.series(tag))
    calls = run.of("policy_train")
    assert len(calls) == STEPS
    for c in calls:
        assert c["loss_fn"] == "GranularPolicyLoss"
        assert "prev_entropy" in c["keys"] and ("granular_group_ids" in c["keys"]) == needs_ids, c["keys"]
        ent = c["prev_entropy"]
        # entropy of a 32-token vocabulary: in (0, log 32], zero at column 0 and past each length
        assert ent["finite"] and 0 < ent["min"] and ent["max"] <= math.log(models.VOCAB_PAD) + 1e-4, ent
        assert c["prev_entropy_zero_outside_sequence"]
        if needs_ids:
            assert c["group_ids"]["outside_is_minus_one"] and c["group_ids"]["inside_nonneg"], c["group_ids"]
        assert math.isfinite(c["loss"]) and math.isfinite(c["grad_norm"])
        # π_old log-probs and entropy from the worker == a plain transformers forward of the refitted
        # weights (same autocast; the entropy's own chunked formula rounds differently by ~1e-6)
        assert c["prev_logprobs_vs_hf"]["max"] <= logprob_tol, c["prev_logprobs_vs_hf"]
        assert c["prev_logprobs_vs_hf"]["entropy_max"] <= max(logprob_tol, 1e-5), c["prev_logprobs_vs_hf"]
    # a step whose groups all have equal rewards has A = 0 everywhere (and grad 0): not all of them
    assert sum(c["advantages_nonzero"] for c in calls) > 0 and max(c["grad_norm"] for c in calls) > 0
    # the policy moved: the weights the generation side received differ after each training step
    refits = run.of("refit")
    assert len(refits) == STEPS and len({r["sum"] for r in refits}) == STEPS, refits
    # NeMo-RL's generation-vs-training check: sampled tokens' probabilities agree with π_old (bf16
    # autocast on both sides; generation decodes incrementally, training runs the full sequence)
    errs = run.series("train/token_mult_prob_error")
    assert sorted(errs) == [1, 2, 3] and all(abs(v - 1) <= 0.01 for v in errs.values()), errs


def test_sspo_loop_three_steps(sspo):
    # one worker, no FSDP: the worker's forward is transformers' own, bit for bit
    _trained_every_step(sspo, needs_ids=True, logprob_tol=0.0)
    # SSPO's segments: some response has two or more segments ("\n\n" cut), groups/response logged
    assert any(c["group_ids"]["max"] >= 1 for c in sspo.of("policy_train"))
    assert all(v >= 1 for v in sspo.series("train/groups_per_response").values())
    # the checkpoints NeMo-RL's CheckpointManager wrote, one per step
    for step in (1, 2, 3):
        assert (sspo.dir / "checkpoints" / f"step_{step}" / "policy" / "weights").is_dir()


def test_vllm_path_up_to_its_workers(sspo):
    """NeMo-RL's real VllmGeneration.__init__ ran (config checks, placement groups, worker builder)
    up to starting its workers; these are the arguments they would have been started with."""
    (args,) = sspo.of("vllm_arguments")
    assert args["worker_cls"] == "nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker"
    assert args["cluster_world_size"] == 1 and args["colocated"] is True
    assert args["vllm_cfg"]["max_model_len"] == 48 and args["vllm_cfg"]["tensor_parallel_size"] == 1
    assert args["vllm_cfg"]["load_format"] == "dummy"          # weights arrive by refit
    assert args["model_name"].endswith("qwen3") and args["stop_token_ids"] == [1] and args["pad_token_id"] == 0


def test_resume_continues_at_step_3_with_the_same_metrics(sspo, sspo_resumed):
    assert "Loading checkpoint from" in sspo_resumed.log or "step_2" in sspo_resumed.log
    assert sspo_resumed.steps("train/loss") == [3]                 # it trained step 3 only
    assert len(sspo_resumed.of("policy_train")) == 1
    import json

    info = json.loads((sspo_resumed.dir / "checkpoints" / "step_3" / "training_info.json").read_text())
    assert info["current_step"] == 3 and info["total_steps"] == 3
    # same prompts (dataloader state), same weights and optimizer state, same samples (the generation
    # seed is a digest of prompts and weights): step 3 is the uninterrupted run's step 3
    a, b = sspo.of("policy_train")[-1], sspo_resumed.of("policy_train")[0]
    assert a["shape"] == b["shape"] and a["response_tokens"] == b["response_tokens"]
    # every logged training metric of step 3, bit for bit (CPU kernels are deterministic here; timings aside)
    tags = [t for t in sspo_resumed.scalars if t.startswith("train/") and 3 in sspo_resumed.series(t)]
    assert len(tags) > 40 and {"train/loss", "train/reward", "train/grad_norm", "train/prev_entropy_mean"} <= set(tags)
    assert {t: sspo_resumed.series(t)[3] for t in tags} == {t: sspo.series(t).get(3) for t in tags}


def test_espo_loop_on_moe(espo_moe):
    # Automodel's Qwen3-MoE keeps bf16 parameters: π_old vs an fp32 transformers forward within bf16 rounding
    _trained_every_step(espo_moe, needs_ids=True, logprob_tol=0.05)
    (envs,) = espo_moe.of("environments")
    assert envs["train"] and all("ESPOMathEnvironment" in v for v in envs["train"].values()), envs
    fails = espo_moe.series("train/verification_failed_frac")
    assert sorted(fails) == [1, 2, 3] and all(0 <= v <= 1 for v in fails.values()), fails
    # ESPO's entropy groups: the top-20% entropy tokens of a response form group 1
    assert all(c["group_ids"]["max"] == 1 for c in espo_moe.of("policy_train"))


def test_gspo_loop_fsdp_and_tensor_parallel(gspo_tp2_dp2):
    # FSDP2's mixed precision casts the parameters to bf16 (the reference keeps fp32 ones under autocast);
    # the entropy comes from vocabulary-parallel logits (one MAX and one SUM all-reduce over TP)
    _trained_every_step(gspo_tp2_dp2, needs_ids=False, logprob_tol=0.01)
    import yaml

    assert "worker-3" in gspo_tp2_dp2.log                     # four policy workers
    assert gspo_tp2_dp2.of("vllm_arguments")[0]["cluster_world_size"] == 4
    ran = yaml.safe_load((gspo_tp2_dp2.dir / "checkpoints" / "step_3" / "config.yaml").read_text())
    assert ran["policy"]["dtensor_cfg"]["tensor_parallel_size"] == 2 and ran["cluster"]["gpus_per_node"] == 4


def test_compare_from_runs_reads_the_run_directories(sspo, espo_moe, gspo_tp2_dp2, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "nemo_granular", "compare", "--from-runs", str(sspo.dir),
                           str(espo_moe.dir), str(gspo_tp2_dp2.dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    for alg in ("sspo", "espo", "gspo"):
        assert alg in report.lower()
    assert "incomplete" not in report.lower() and "failed" not in report.lower(), report[:3000]


def test_export_of_the_checkpoint_loads_in_transformers_and_generates(sspo, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    step = sspo.dir / "checkpoints" / "step_3"
    proc = subprocess.run([sys.executable, "-m", "nemo_granular", "export", str(step), str(out), "--dtype", "fp32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("1+1=", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]
    # the exported weights are the trained ones: not the initial model's
    first = load_file(str(sspo.dir.parent / "qwen3" / "model.safetensors"))
    trained = dict(model.named_parameters())
    moved = [k for k, v in first.items() if k in trained and not torch.equal(trained[k].detach(), v.float())]
    assert moved, "export equals the initial weights"
