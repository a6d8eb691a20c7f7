"""The losses compute in promote_types(input dtype, float32) (issue 11, item 4): a float64 call
matches the float64 reference to ~1e-12 (values, gradients, metrics) for every preset, and
bf16/fp16 inputs are still computed in float32."""

import pytest
import torch

import reference as R
from nemo_granular.losses import GranularPolicyLoss, SequenceValueLoss

V = 16
METRICS = (
    "clip_frac_low",
    "clip_frac_high",
    "groups_per_response",
    "group_size_mean",
    "probs_ratio",
    "probs_ratio_min",
    "probs_ratio_max",
    "clip_bound_low_mean",
    "clip_bound_high_mean",
    "nonfinite_tokens",
)
NEMO_METRICS = (
    "loss",
    "probs_ratio",
    "probs_ratio_clamped",
    "probs_ratio_min",
    "probs_ratio_max",
    "probs_ratio_clamped_min",
    "probs_ratio_clamped_max",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "approx_entropy",
    "num_valid_samples",
    "sampling_importance_ratio",
)


def _float64_batch(seed, **kw):
    """A reference batch in float64 whose values are NOT float32-representable (a float32
    computation then misses the reference by ~1e-8, far outside the 1e-12 checked here). Masks are
    float64 too, as the global counts of :func:`_run`: the loss forms count + 1e-8 in the count's dtype,
    as NeMo-RL's masked_mean does (float32 counts: tests/test_loss_nemo.py against NeMo-RL itself)."""
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=seed, **kw)
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, v in data.items():
        if v.is_floating_point() and k not in ("token_mask", "sample_mask"):
            v = v.double() + 1e-9 * torch.randn(v.shape, generator=g, dtype=torch.float64) * (v != 0)
        elif v.is_floating_point():
            v = v.double()
        out[k] = v
    logp = logp.double() + 1e-9 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    return out, logp, gvs, gvt


def _run(fn, logp, data, gvs, gvt, dtype=torch.float64):
    lp = logp.detach().clone().to(dtype).requires_grad_(True)
    loss, m = fn(
        next_token_logprobs=lp,
        data=data,
        global_valid_seqs=torch.tensor(float(gvs), dtype=torch.float64),
        global_valid_toks=torch.tensor(float(gvt), dtype=torch.float64),
    )
    loss.backward()
    return loss, lp.grad, m


def _make(name, **extra):
    return GranularPolicyLoss(
        {"granular": {"algorithm": name, "espo": {"vocab_size": V}}, "reference_policy_kl_penalty": 0.0, **extra},
        delimiter_table=R.delimiter_table(V),
    )


@pytest.mark.parametrize("name", sorted(R.PRESET_SPECS))
@pytest.mark.parametrize("seed", [0, 1])
def test_float64_preset_matches_float64_reference(name, seed):
    data, logp, gvs, gvt = _float64_batch(seed, per_token_adv=True, noise=(1e-3, 0.05, 0.4))
    loss, grad, m = _run(_make(name), logp, data, gvs, gvt)
    assert loss.dtype == torch.float64 and grad.dtype == torch.float64
    rloss, rgrad, rm = R.run_ref(lambda lp: R.preset_loss(name, lp, data, gvs=gvs, gvt=gvt, vocab_size=V), logp)
    R.assert_close(loss, rloss, rtol=1e-12, atol=1e-13, what=f"{name} loss")
    R.assert_close(grad, rgrad, rtol=1e-12, atol=1e-13, what=f"{name} grad")
    assert grad.abs().max() > 0
    for k in METRICS:
        R.assert_close(m[k], rm[k], rtol=1e-12, atol=1e-13, what=f"{name} metric {k}")


@pytest.mark.parametrize("name", sorted(R.PRESET_SPECS))
def test_float64_preset_with_kl_and_dual_clip(name):
    data, logp, gvs, gvt = _float64_batch(3, noise=(0.8,))
    dual = None if R.PRESET_SPECS[name]["surrogate"] == "cispo" else 1.5  # CISPO refuses the dual clip
    fn = _make(name, reference_policy_kl_penalty=0.07, ratio_clip_c=dual)
    loss, grad, _ = _run(fn, logp, data, gvs, gvt)
    rloss, rgrad, _ = R.run_ref(
        lambda lp: R.preset_loss(
            name, lp, data, gvs=gvs, gvt=gvt, vocab_size=V, dual_clip=dual, kl={"coef": 0.07, "type": "k3"}
        ),
        logp,
    )
    R.assert_close(loss, rloss, rtol=1e-12, atol=1e-13, what="loss")
    R.assert_close(grad, rgrad, rtol=1e-12, atol=1e-13, what="grad")


@pytest.mark.parametrize(
    "preset,nemo_cfg,rtol",
    [
        ("grpo", {"token_level_loss": True}, 1e-12),
        # GSPO mode divides each row's log-ratio sum by (n_i + 1e-8), as we do
        (
            "gspo",
            {
                "token_level_loss": False,
                "sequence_level_importance_ratios": True,
                "ratio_clip_min": 3e-4,
                "ratio_clip_max": 4e-4,
            },
            1e-12,
        ),
    ],
)
def test_float64_nemo_metrics(preset, nemo_cfg, rtol):
    """NeMo-RL's metric set in float64 (the diagnostics of π_old vs π_gen included)."""
    data, logp, gvs, gvt = _float64_batch(4, noise=(1e-3, 0.05, 0.3), gen_noise=0.03)
    extra = (
        {"sequence_level_importance_ratios": True, "ratio_clip_min": 3e-4, "ratio_clip_max": 4e-4}
        if preset == "gspo"
        else {}
    )
    loss, grad, m = _run(
        GranularPolicyLoss({"granular": {"algorithm": preset}, "reference_policy_kl_penalty": 0.0, **extra}),
        logp,
        data,
        gvs,
        gvt,
    )
    rloss, rgrad, rm = R.run_ref(
        R.nemo_clipped_pg_loss, logp, data, {"reference_policy_kl_penalty": 0.0, **nemo_cfg}, gvs, gvt
    )
    # every token mean divides by count + 1e-8 on both sides (NeMo-RL's masked_mean; math.md, Notation)
    R.assert_close(loss, rloss, rtol=rtol, atol=1e-13, what="loss")
    R.assert_close(grad, rgrad, rtol=rtol, atol=1e-13, what="grad")
    for k in NEMO_METRICS:
        if k in rm:
            R.assert_close(m[k], rm[k], rtol=rtol, atol=1e-14, what=f"metric {k}")


def test_float32_call_is_not_float64_accurate():
    """Sanity check of the test data: a float32 call misses the float64 reference by far more than 1e-12."""
    data, logp, gvs, gvt = _float64_batch(0, per_token_adv=True)
    loss32, _, _ = _run(_make("sspo"), logp, data, gvs, gvt, dtype=torch.float32)
    rloss, _, _ = R.run_ref(lambda lp: R.preset_loss("sspo", lp, data, gvs=gvs, gvt=gvt, vocab_size=V), logp)
    assert loss32.dtype == torch.float32
    assert abs(float(loss32.detach()) - float(rloss)) > 1e-11


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=2)
    fn = _make("sspo")
    loss, grad, _ = _run(fn, logp, data, gvs, gvt, dtype=dtype)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    # the same as a float32 call on the rounded logprobs
    loss32, grad32, _ = _run(fn, logp.to(dtype).float(), data, gvs, gvt, dtype=torch.float32)
    assert torch.equal(loss.detach(), loss32.detach())
    assert torch.equal(grad, grad32.to(dtype))


@pytest.mark.parametrize("name", sorted(R.PRESET_SPECS))
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_loss_ignores_the_callers_autocast(name, per_token_adv):
    """The workers call the loss inside the model's bf16 autocast: loss, gradient and every metric are
    bit-identical to the call without it (found by the CPU GRPO loop: the per-group sums, a matmul,
    ran in bf16 there and put the in-loop SSPO loss 1.5e-3 off the float64 reference)."""
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=3, per_token_adv=per_token_adv)
    fn = _make(name)
    loss, grad, m = _run(fn, logp, data, gvs, gvt, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ac, grad_ac, m_ac = _run(fn, logp, data, gvs, gvt, dtype=torch.float32)
    assert torch.equal(loss.detach(), loss_ac.detach()) and torch.equal(grad, grad_ac)
    assert m == m_ac


def test_value_loss_float64():
    g = torch.Generator().manual_seed(0)
    B, S = 4, 9
    token_mask = torch.zeros(B, S)
    token_mask[:, 3:] = 1
    values = (torch.randn(B, S, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    data = {
        "token_mask": token_mask,
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
    }
    loss, m = SequenceValueLoss()(
        logits=values, data=data, global_valid_seqs=torch.tensor(3.0), global_valid_toks=torch.tensor(18.0)
    )
    assert loss.dtype == torch.float64
    ref = sum(R.bce_with_logits(float(values[i, 3]), float(data["rewards"][i])) for i in (0, 1, 3)) / 3
    assert abs(float(loss) - ref) < 1e-13
    loss.backward()
    assert values.grad.dtype == torch.float64
    for i in (0, 1, 3):  # d BCE / d v = σ(v) − R, divided by the 3 global sequences
        expect = (torch.sigmoid(values[i, 3].detach()) - data["rewards"][i]) / 3
        assert abs(float(values.grad[i, 3]) - float(expect)) < 1e-15
