"""NeMo-RL's real GRPO loop with the plugin on the Megatron backend, end to end on CPU.

World: NeMo-RL (``nemo_rl_src``) with its pinned Megatron-LM / Megatron-Bridge sources, and the CPU
host of ``tests/harness/cpu_host`` (one private Ray head that declares 1 GPU for the whole module; the
shared stand-ins of ``tests/harness/cpu_stand_ins`` are installed lazily in every Ray worker; docs/nemo-rl.md
§7). Each run is ``python -m cpu_host.launch grpo --config <child of a shipped Megatron config>``:
our unchanged ``run_grpo`` → NeMo-RL's real ``setup()`` (the plugin's ``GranularMegatronPolicyWorker``
Ray actors, whose ``MegatronPolicyWorkerImpl.__init__`` imports the HF checkpoint with
Megatron-Bridge, builds DDP + the distributed optimizer) → the real ``grpo_train`` for 3 steps:
generation (transformers in vLLM's place, refit by the worker's own ``stream_weights_via_ipc_zmq``:
Bridge's HF export over ZMQ), rewards, our estimator, the π_old log-prob + entropy pass inside
the worker (our extension), ``train`` with the granular loss on NeMo-RL's sequence packing, the
Logger and the CheckpointManager (Megatron distributed checkpoints).

Runs (module-scoped, each used by several tests): ESPO (``espo_math`` environment, ``alpha: auto``),
child of ``nemo_rl/espo_math_1B.yaml``, 2 workers (data parallel 2, TP 1), bf16 as shipped; then the
same run resumed from its step-2 checkpoint in a new directory; then ``nemo-granular export`` of a
checkpoint. Two Megatron workers per run (the CI budget): the model-parallel layouts (TP 2, PP 2,
TP 2 × CP 2, EP 2) are checked exactly against transformers by ``tests/test_megatron_worker.py``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from cpu_host import configs, models
from cpu_host.cluster import RayHead
from cpu_host.runs import copy_checkpoints, finite, run_ok
from cpu_host.worker_zygote import MEGATRON_PRELOAD

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.nemo_rl]
STEPS = 3
VOCAB = models.VOCAB_PAD  # TP 1: Megatron pads no vocabulary rows
# 4 prompts x 8 samples, 2 optimizer steps per GRPO step (as the shipped config): groups of 8 make
# a mixed-reward group (A != 0) likely from the random policy's first rollout on
GENERATIONS = 8
WORKERS = 2  # data parallel: bf16 training on two workers, whose refits must agree
# the container's environment on a GPU node: NeMo-RL's Policy refuses the Megatron backend without
# TORCH_CUDA_ARCH_LIST; Megatron's torch.compile'd fusions would build C++ kernels on CPU (the
# eager functions compute the same)
ENV = {"TORCH_CUDA_ARCH_LIST": "9.0", "TORCHDYNAMO_DISABLE": "1"}


@pytest.fixture(scope="module")
def world(nemo_rl_src, megatron_workers):
    root = Path(tempfile.mkdtemp(prefix="nmeg", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        w = SimpleNamespace(
            root=root, model=models.write_model(root / "qwen3"), data=models.write_math_data(root / "math.jsonl")
        )
        with RayHead(root, num_cpus=8, num_gpus=WORKERS, env=ENV, preload=MEGATRON_PRELOAD) as head:
            w.head = head
            yield w
    finally:
        if not os.environ.get("NEMO_GRANULAR_KEEP_LOOP_RUNS"):
            shutil.rmtree(root, ignore_errors=True)


def _child(w, name: str, parent: str, *, env="math", extra=None) -> tuple[Path, Path]:
    run = w.root / name
    run.mkdir()
    over = configs.shrink_megatron(
        run, w.model, w.data, env=env, steps=STEPS, generations=GENERATIONS, train_batch=2 * GENERATIONS, gpus=WORKERS
    )
    return configs.write_child(run / "child.yaml", configs.CONFIGS / parent, over, extra), run


@pytest.fixture(scope="module")
def espo(world):
    cfg, run = _child(world, "espo", "nemo_rl/espo_math_1B.yaml", env="espo_math")
    return run_ok(world.head, "grpo", cfg, run)


@pytest.fixture(scope="module")
def espo_resumed(world, espo):
    """The ESPO run's config in a new directory holding only its step_1 and step_2 checkpoints."""
    cfg, run = _child(world, "espo_resumed", "nemo_rl/espo_math_1B.yaml", env="espo_math")
    copy_checkpoints(espo, run, (1, 2))
    return run_ok(world.head, "grpo", cfg, run)


# ---------------------------------------------------------------------------------------------- checks
def _trained_every_step(run, *, needs_ids: bool, logprob_tol: float, entropy_tol: float, mult_tol: float):
    assert run.steps("train/loss") == [1, 2, 3], run.failure()
    for tag in ("train/loss", "train/grad_norm", "train/reward", "train/prev_entropy_mean"):
        assert finite(run.series(tag).values()), (tag, run.series(tag))
    calls = run.of("policy_train")
    assert len(calls) == STEPS
    for c in calls:
        assert c["loss_fn"] == "GranularPolicyLoss"
        assert "prev_entropy" in c["keys"] and ("granular_group_ids" in c["keys"]) == needs_ids, c["keys"]
        ent = c["prev_entropy"]
        # entropy over the model's vocabulary: in (0, log |V|], zero at column 0 and past each length
        assert ent["finite"] and 0 < ent["min"] and ent["max"] <= math.log(VOCAB) + 1e-3, ent
        assert c["prev_entropy_zero_outside_sequence"]
        if needs_ids:
            assert c["group_ids"]["outside_is_minus_one"] and c["group_ids"]["inside_nonneg"], c["group_ids"]
        assert math.isfinite(c["loss"]) and math.isfinite(c["grad_norm"])
        # π_old from the Megatron worker (bf16 weights and activations) vs a transformers forward of
        # the weights the refit delivered, under bf16 autocast: the same weights, other kernels
        assert c["prev_logprobs_vs_hf"]["max"] <= logprob_tol, c["prev_logprobs_vs_hf"]
        assert c["prev_logprobs_vs_hf"]["entropy_max"] <= entropy_tol, c["prev_logprobs_vs_hf"]
    # the first rollout (from the checkpoint's weights, seeded by them and the prompts) has mixed-reward groups
    assert calls[0]["advantages_nonzero"] > 0 and calls[0]["grad_norm"] > 0, calls[0]
    # NeMo-RL's own refit path (ZMQ) ran before every generation; the weights it delivered moved
    # after each step that had A != 0 and only then (A = 0: zero loss gradient, and the warm-up
    # learning rate's weight decay is below bf16's resolution)
    refits = run.of("refit")
    (layout,) = run.of("policy_layout")
    assert layout["workers"] == layout["data_parallel"] == WORKERS, layout
    for r in refits:  # every worker streamed the whole model over its ZMQ socket
        assert r["refit"]["path"] == "ipc_zmq" and r["refit"]["workers"] == WORKERS, r["refit"]
        assert min(r["refit"]["payloads"]) >= 1 and len(set(r["refit"]["tensors"])) == 1, r["refit"]
        # data-parallel replicas after the same optimizer steps: the weights they sent are identical
        assert r["workers_agree"] == 0.0, r
    moved = [refits[k]["sum"] != refits[k - 1]["sum"] for k in range(1, STEPS)]
    assert moved == [c["advantages_nonzero"] > 0 for c in calls[: STEPS - 1]], (moved, refits)
    errs = run.series("train/token_mult_prob_error")
    print(
        f"{run.dir.name}: logprobs vs HF {max(c['prev_logprobs_vs_hf']['max'] for c in calls):.3g}, entropy vs HF "
        f"{max(c['prev_logprobs_vs_hf']['entropy_max'] for c in calls):.3g}, token_mult_prob_error - 1 "
        f"{max(abs(v - 1) for v in errs.values()):.3g}"
    )
    assert sorted(errs) == [1, 2, 3] and all(abs(v - 1) <= mult_tol for v in errs.values()), errs


def test_espo_loop_on_megatron_three_steps(espo):
    # measured at 2 workers: log-probs ≤ 2.1e-3, entropy ≤ 8.7e-5, |token_mult_prob_error − 1| ≤ 4.3e-4
    _trained_every_step(espo, needs_ids=True, logprob_tol=0.01, entropy_tol=4e-4, mult_tol=0.002)
    (envs,) = espo.of("environments")
    assert all("ESPOMathEnvironment" in v for v in envs["train"].values()), envs
    # ESPO's entropy groups: the top-20% entropy tokens of a response form group 1
    assert all(c["group_ids"]["max"] == 1 for c in espo.of("policy_train"))
    # alpha: auto set on the first rollout, logged every step, the same α throughout
    alphas = espo.series("train/espo_alpha")
    assert sorted(alphas) == [1, 2, 3] and len(set(alphas.values())) == 1 and 0 < alphas[1] < 1, alphas
    for step in (1, 2, 3):  # Megatron distributed checkpoints through NeMo-RL's CheckpointManager
        weights = espo.dir / "checkpoints" / f"step_{step}" / "policy" / "weights"
        assert (weights / "latest_checkpointed_iteration.txt").is_file(), sorted(weights.iterdir())


def test_espo_loss_in_the_megatron_loop_equals_the_float64_reference(espo, world):
    """Every loss call of both workers (NeMo-RL's packing wrapper calls it once per packed sequence),
    recomputed in float64 by tests/harness/reference.py (cpu_host.loss_check)."""
    from cpu_host.loss_check import METRICS, check_run, records

    got = check_run(espo.dir, world.model)
    assert got["calls"] == list(range(STEPS)) and got["ids_equal"] and got["grad_nonzero"] > 0, got
    assert {r["rank"] for recs in records(espo.dir).values() for r in recs} == set(range(WORKERS))
    err = got["err"]
    print(f"megatron espo: {got['records']} loss records, errors {err}")
    assert err["loss"] <= LOSS_TOL["loss"] and err["grad"] <= LOSS_TOL["grad"], err
    assert all(err[k] <= LOSS_TOL["metrics"] for k in METRICS), err


# |worker (float32 loss) − float64 reference on the same inputs|: loss and metrics absolute, the
# gradient relative to its largest element
LOSS_TOL = {"loss": 1e-7, "grad": 5e-7, "metrics": 5e-7}  # measured 1.1e-8, 5.7e-8, 5.4e-8


def test_resume_continues_at_step_3_with_the_same_metrics(espo, espo_resumed):
    assert espo_resumed.steps("train/loss") == [3]  # it trained step 3 only
    assert len(espo_resumed.of("policy_train")) == 1
    info = json.loads((espo_resumed.dir / "checkpoints" / "step_3" / "training_info.json").read_text())
    assert info["current_step"] == 3 and info["total_steps"] == 3
    a, b = espo.of("policy_train")[-1], espo_resumed.of("policy_train")[0]
    assert a["shape"] == b["shape"] and a["response_tokens"] == b["response_tokens"]
    # the resumed policy is the uninterrupted run's after step 2: the refit weights agree exactly
    assert espo_resumed.of("refit")[0]["sum"] == espo.of("refit")[2]["sum"]
    tags = [t for t in espo_resumed.scalars if t.startswith("train/") and 3 in espo_resumed.series(t)]
    assert len(tags) > 40 and {"train/loss", "train/reward", "train/grad_norm", "train/espo_alpha"} <= set(tags)
    assert {t: espo_resumed.series(t)[3] for t in tags} == {t: espo.series(t).get(3) for t in tags}


def test_export_of_the_megatron_checkpoint_loads_in_transformers(espo, tmp_path, monkeypatch, capsys):
    """``nemo-granular export`` of the run's step-2 checkpoint: transformers loads and generates, and
    its weights are the ones the generation received at the refit before step 3."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cpu_stand_ins.megatron import use_cpu_layer_spec
    from nemo_granular.cli import main as top_main

    use_cpu_layer_spec(setattr_=monkeypatch.setattr)  # Bridge's model build on CPU (no Transformer Engine)
    out = tmp_path / "hf"
    capsys.readouterr()
    rc = top_main(["export", str(espo.dir / "checkpoints" / "step_2"), str(out), "--dtype", "fp32", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-3000:]
    assert json.loads(cap.out)["source"] == "megatron"
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    params = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    refit = espo.of("refit")[2]
    assert params[:8].tolist() == refit["head"] and float(params.double().sum()) == refit["sum"]
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("1+1=", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]
