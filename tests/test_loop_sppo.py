"""NeMo-RL's real PPO loop with SPPO, end to end on CPU (DTensor-v2 policy and value workers).

World: NeMo-RL + the CPU host of ``tests/harness/cpu_host`` (docs/nemo-rl.md §7). One run of
``python -m cpu_host.launch sppo --config <child of examples/configs/sppo_r1_distill_qwen_7b_small_critic.yaml>``:
our unchanged ``nemo_granular.run_sppo.main`` → NeMo-RL's real ``ppo.setup()`` (policy AND value
worker groups, 2 workers each, FSDP2 with the shipped ``cpu_offload: true`` on gloo) → the real
``ppo_train`` for 3 steps at ONE sample per prompt, with the ``sppo`` estimator, the BCE
``SequenceValueLoss`` and ``PromptOnlyValue`` (the critic sees each unique prompt + 1 token), and a
critic smaller than the policy (hidden 16 / 1 layer vs 32 / 2, same tokenizer).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from cpu_host import configs, models
from cpu_host.cluster import RayHead
from cpu_host.runs import finite, run_loop

pytestmark = pytest.mark.v070

PROMPTS = 8


@pytest.fixture(scope="module")
def sppo(nemo_rl_src):
    root = Path(tempfile.mkdtemp(prefix="nsppo", dir="/tmp"))
    try:
        policy = models.write_model(root / "qwen3", hidden=32, layers=2)
        critic = models.write_model(root / "critic", hidden=16, layers=1, seed=1)
        data = models.write_math_data(root / "math.jsonl")
        run = root / "sppo"
        run.mkdir()
        over = configs.shrink_ppo(run, policy, critic, data, gpus=2, prompts=PROMPTS)
        # the tiny critic's config sets pad_token_id: without this the value head starts as garbage
        # (run_sppo refuses it, see test_multi_gpu_critic_with_a_pad_token_id_is_refused)
        over["value"]["hf_config_overrides"] = {"pad_token_id": None}
        cfg = configs.write_child(
            run / "child.yaml", configs.CONFIGS / "sppo_r1_distill_qwen_7b_small_critic.yaml", over
        )
        with RayHead(root, num_cpus=8, num_gpus=2) as head:
            out = run_loop(head, "sppo", cfg, run)
        assert out.rc == 0, out.failure()
        yield SimpleNamespace(run=out, policy=policy, critic=critic)
    finally:
        if not os.environ.get("NEMO_GRANULAR_KEEP_LOOP_RUNS"):  # debugging aid: keep the run directories
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.nemo_rl
@pytest.mark.slow
def test_ppo_loop_three_steps_one_sample_per_prompt(sppo):
    run = sppo.run
    assert run.steps("train/loss") == [1, 2, 3], run.failure()
    for tag in ("train/loss", "train/reward"):
        assert finite(run.series(tag).values()), (tag, run.series(tag))
    calls = run.of("policy_train")
    assert len(calls) == 3
    for c in calls:
        assert c["shape"][0] == PROMPTS  # N = 1: one response per prompt
        assert c["loss_fn"] == "ClippedPGLossFn"  # SPPO's policy loss is NeMo-RL's PPO loss
        assert c["advantages_nonzero"] > 0 and finite([c["loss"], c["grad_norm"]])
        assert c["prev_logprobs_vs_hf"]["max"] <= 0.01  # FSDP2 bf16 parameters vs an fp32 forward (measured 5.5e-3)
    assert max(c["grad_norm"] for c in calls) > 0
    refits = run.of("refit")
    assert len(refits) == 3 and len({r["sum"] for r in refits}) == 3  # the policy moved every step
    # every refit from both policy workers, by the receiver for this NeMo-RL (cpu_host.refit.dtensor_refit_path);
    # in v0.7.0's own ZMQ refit each worker streams the whole model over several staging buffers: identical copies
    from cpu_host.refit import dtensor_refit_path

    path = dtensor_refit_path()
    assert all(r["refit"]["path"] == path and r["refit"]["workers"] == 2 for r in refits), refits
    if path == "ipc_zmq":
        assert all(r["workers_agree"] == 0.0 and min(r["refit"]["payloads"]) > 1 for r in refits), refits
    # the checkpoints hold both models
    for step in (1, 2, 3):
        step_dir = run.dir / "checkpoints" / f"step_{step}"
        assert (step_dir / "policy" / "weights").is_dir() and (step_dir / "value" / "weights").is_dir()


@pytest.mark.nemo_rl
@pytest.mark.slow
def test_critic_is_the_prompt_only_bce_value_model(sppo):
    run = sppo.run
    vcalls = run.of("value_train")
    assert len(vcalls) == 3
    for c in vcalls:
        assert c["loss_fn"] == "SequenceValueLoss"
        # PromptOnlyValue: at most one row per prompt, each only prompt + 1 token long
        assert c["shape"][0] <= PROMPTS and c["shape"][1] < run.of("policy_train")[0]["shape"][1]
        # BCE of a freshly initialised head (logits ≈ 0): ≈ log 2, not the 1e30 of an uninitialised one
        assert 0 < c["loss"] < 2, vcalls
    for tag in ("sppo_critic/bce", "sppo_critic/acc"):
        found = [t for t in run.scalars if t.endswith(tag)]
        assert found and finite(run.series(found[0]).values()), sorted(run.scalars)[:40]


def _saved_shapes(weights_dir) -> dict:
    """name → shape of the tensors NeMo-RL's checkpoint holds (what the workers trained)."""
    from nemo_granular.export.dcp import find_dcp_dir, read_dcp

    path, layout = find_dcp_dir(weights_dir)
    return {k: tuple(v.shape) for k, v in read_dcp(path, safetensors=layout == "safetensors").items()}


@pytest.mark.nemo_rl
@pytest.mark.slow
def test_critic_is_smaller_than_the_policy(sppo):
    step = sppo.run.dir / "checkpoints" / "step_3"
    policy, value = _saved_shapes(step / "policy" / "weights"), _saved_shapes(step / "value" / "weights")

    def width(shapes):
        (shape,) = [v for k, v in shapes.items() if k.endswith("embed_tokens.weight")]
        return shape[1]

    def layers(shapes):
        return len({k.split(".layers.")[1].split(".")[0] for k in shapes if ".layers." in k})

    # the trained critic is a narrower, shallower network than the trained policy, with a scalar head
    assert width(value) < width(policy) and layers(value) < layers(policy), (width(value), layers(value))
    (head,) = [v for k, v in value.items() if k.endswith("score.weight")]
    assert head[0] == 1, value
    assert sum(math.prod(s) for s in value.values()) < sum(math.prod(s) for s in policy.values())


def test_multi_gpu_critic_with_a_pad_token_id_is_refused():
    """Automodel leaves a multi-GPU critic's value head uninitialised when its config sets
    pad_token_id (the loop above measured a critic BCE of 1e30 before this check)."""
    from types import SimpleNamespace as NS

    from nemo_granular.sppo.validate import check_value_head_initialised

    def cfg(gpus=2, overrides=None, dtensor=True):
        return {
            "cluster": {"gpus_per_node": gpus, "num_nodes": 1},
            "value": {
                "model_name": "critic",
                "dtensor_cfg": {"enabled": dtensor, "tensor_parallel_size": 1},
                "megatron_cfg": {"enabled": not dtensor},
                "hf_config_overrides": overrides or {},
            },
        }

    padded, plain = (lambda n: NS(pad_token_id=0)), (lambda n: NS(pad_token_id=None))
    with pytest.raises(
        ValueError,
        match=r"value.model_name 'critic' sets pad_token_id=0.*"
        r"value.hf_config_overrides.pad_token_id: null",
    ):
        check_value_head_initialised(cfg(), padded)
    assert check_value_head_initialised(cfg(overrides={"pad_token_id": None}), padded)
    assert check_value_head_initialised(cfg(gpus=1), padded)  # one worker: no meta-device build
    assert check_value_head_initialised(cfg(), plain)
    assert check_value_head_initialised(cfg(dtensor=False), padded)  # Megatron critic: another path
    assert check_value_head_initialised(cfg(), lambda n: (_ for _ in ()).throw(OSError("offline"))) is False


# float64 recomputation of both SPPO losses from what the workers received (cpu_host.ppo_loss_check).
# Measured on this run (CPU, main world; 12 policy and 12 critic loss calls): policy loss 3.8e-8, its
# ratio min / max metrics 5.5e-8, critic BCE 2.1e-8, advantage 4.7e-8 (float32 workers against
# float64); each tolerance is about 4-5× that (docs/testing.md, "Measured in the loops").
POLICY_LOSS_TOL = 2e-7
VALUE_LOSS_TOL = 1e-7
ADVANTAGE_TOL = 2e-7


@pytest.mark.nemo_rl
@pytest.mark.slow
def test_sppo_policy_loss_and_advantage_recomputed(sppo):
    """Every ``ClippedPGLossFn`` call of the policy workers against the float64 token-level clipped
    objective of SPPO eq. 3 (ε 0.2 / 0.2, dual clip c, no KL, token mean over the global count), from
    the log-probs, π_old log-probs, advantages and masks the worker received; and every row's
    advantage, as ``Policy.train`` received it, against SPPO eq. 1, A = R − σ(v), from the critic
    logit and the reward of the same batch. The algorithm acts on this run: every advantage is
    non-zero (|A| ≥ 0.49: σ(v) ≈ 0.5 for a fresh head) and in the second optimizer step of each rollout
    the ratio is not 1 (measured 0.9969–1.0032). The ratios stay inside [0.8, 1.2], so neither the
    ε clip nor the dual clip engages here: those branches are covered by tests/test_loss_nemo.py,
    not by this loop."""
    from cpu_host.ppo_loss_check import advantage_reference, policy_loss_reference, records

    run = sppo.run
    recs = records(run.dir, "policy")
    calls = run.of("policy_train")
    assert len(recs) >= 2 * len(calls) == 6, len(recs)  # at least one per worker and train call
    errs, moved = [], 0
    for rec in recs:
        assert rec["config"]["reference_policy_kl_penalty"] == 0 and not rec["config"]["force_on_policy_ratio"]
        assert "TOKEN_LEVEL" in rec["config"]["loss_type"], rec["config"]
        ref = policy_loss_reference(rec)
        errs.append(abs(rec["loss"] - ref["loss"]))
        assert ref["tokens"] > 0 and ref["adv_nonzero"] == ref["tokens"], ref
        assert abs(rec["metrics"]["probs_ratio_min"] - ref["ratio_min"]) <= POLICY_LOSS_TOL
        assert abs(rec["metrics"]["probs_ratio_max"] - ref["ratio_max"]) <= POLICY_LOSS_TOL
        moved += max(abs(ref["ratio_min"] - 1), abs(ref["ratio_max"] - 1)) > 1e-4
    assert max(errs) <= POLICY_LOSS_TOL, (max(errs), errs)
    # 2 optimizer steps per rollout: the second is off-policy (measured: 6 of 12 calls, one per step and worker)
    assert moved >= 3, "the ratio is 1 in (nearly) every recorded call: only wiring would be proven"
    adv = [pair for c in calls for pair in advantage_reference(c["critic_rows"])]
    assert len(adv) == 3 * PROMPTS and all(c["critic_rows"]["advantage_constant_per_row"] for c in calls)
    assert max(abs(a - e) for a, e in adv) <= ADVANTAGE_TOL, adv
    assert all(abs(e) > 1e-3 for _, e in adv)


@pytest.mark.nemo_rl
@pytest.mark.slow
def test_sppo_critic_bce_recomputed(sppo):
    """Every ``SequenceValueLoss`` call of the value workers against the float64 BCE of SPPO eq. 2:
    σ of the critic output at the prompt's last token (the first response column of NeMo-RL's
    right-shifted values) against the binary reward, summed over valid rows / global_valid_seqs."""
    from cpu_host.ppo_loss_check import records, value_loss_reference

    run = sppo.run
    recs = records(run.dir, "value")
    assert len(recs) >= 2 * len(run.of("value_train")) == 6, len(recs)
    errs, rows = [], 0
    for rec in recs:
        ref = value_loss_reference(rec)
        rows += ref["rows"]
        errs.append(abs(rec["loss"] - ref["loss"]))
    assert max(errs) <= VALUE_LOSS_TOL, (max(errs), errs)
    assert rows == 3 * PROMPTS, rows  # every sample's row, once per step
