"""Spec §9 identities 2 and 3: the `grpo` preset ≡ NeMo-RL's token-level ``ClippedPGLossFn`` and
`sequence`+shared+fixed+seq_mean_token_mean ≡ its GSPO mode — values, gradients and the metrics
NeMo-RL returns.

Two layers: against ``reference.nemo_clipped_pg_loss`` (an independent float64 re-derivation,
runs without NeMo-RL) and, at the end of this file, against NeMo-RL's REAL ``ClippedPGLossFn``
(``nemo_rl_src`` fixture; runs in CI) on identical float32 and float64 tensors — float64 to
1e-12 as NeMo-RL ships it (every token mean divides by count + 1e-8 on both sides)."""

import pytest
import torch

import reference as R
from nemo_granular.losses import GranularPolicyLoss

pytestmark = pytest.mark.v070

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
)

OPTIONS = {
    "plain": {},
    "kl_k1": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k1"),
    "kl_k2": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k2"),
    "kl_k3": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k3"),
    "kl_k3_clamped": dict(
        reference_policy_kl_penalty=0.1,
        reference_policy_kl_type="k3",
        kl_input_clamp_value=0.1,
        kl_output_clamp_value=0.002,
    ),
    "kl_on_policy_approx": dict(reference_policy_kl_penalty=0.05, use_on_policy_kl_approximation=True),
    "kl_in_reward": dict(reference_policy_kl_penalty=0.05, use_kl_in_reward=True),
    "dual_clip": dict(ratio_clip_c=1.3),
    "dapo_eps": dict(ratio_clip_min=0.2, ratio_clip_max=0.28),
    "is_plain": dict(use_importance_sampling_correction=True),
    "tis": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.03,
    ),
    "tis_min": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.03,
        truncated_importance_sampling_ratio_min=0.98,
    ),
    "icepop": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.03,
        truncated_importance_sampling_ratio_min=0.97,
    ),
    "seq_mask_tis": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.01,
        truncated_importance_sampling_ratio_min=0.99,
    ),
    "vapo_nll": dict(positive_example_nll_weight=0.3),
}


def _batch(seed, per_token_adv):
    data, logp, gvs, gvt = R.make_batch(
        B=6, S=14, seed=seed, per_token_adv=per_token_adv, gen_noise=0.03, noise=(1e-3, 0.05, 0.3)
    )
    data["rewards"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    return data, logp, gvs, gvt


def _compare(ours_cfg, nemo_cfg, data, logp, gvs, gvt, extra_metrics=()):
    ours_cfg = {"reference_policy_kl_penalty": 0.0, **ours_cfg}
    nemo_cfg = {"reference_policy_kl_penalty": 0.0, **nemo_cfg}
    loss, grad, m = R.run_loss(GranularPolicyLoss(ours_cfg), logp, data, gvs, gvt)
    rloss, rgrad, rm = R.run_ref(R.nemo_clipped_pg_loss, logp, data, nemo_cfg, gvs, gvt)
    R.assert_close(loss, rloss, what="loss")
    R.assert_close(grad, rgrad, what="grad")
    for k in NEMO_METRICS + tuple(extra_metrics):
        if k in rm:
            assert k in m, f"metric {k} missing"
            R.assert_close(m[k], rm[k], rtol=2e-6, what=f"metric {k}")
    return m, rm


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_preset_is_nemo_token_level(option, seed):
    opts = OPTIONS[option]
    data, logp, gvs, gvt = _batch(seed, per_token_adv=True)
    m, rm = _compare(
        {"granular": {"algorithm": "grpo"}, **opts},
        {"token_level_loss": True, **opts},
        data,
        logp,
        gvs,
        gvt,
        extra_metrics=("kl_penalty", "sampling_importance_ratio", "is_oob_ratio", "positive_nll_loss"),
    )
    if "truncated_importance_sampling_type" in opts and seed == 0:
        assert rm["is_oob_ratio"] > 0, "test data should trigger the truncation"


@pytest.mark.parametrize("option", sorted(k for k in OPTIONS if k != "seq_mask_tis"))
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_preset_is_nemo_gspo_mode(option, seed):
    """sequence + shared + fixed + seq_mean_token_mean ≡ NeMo-RL with sequence_level_importance_ratios=True,
    token_level_loss=False (GSPO's ε = 3e-4/4e-4 given to both)."""
    opts = {"ratio_clip_min": 3e-4, "ratio_clip_max": 4e-4, **OPTIONS[option]}
    data, logp, gvs, gvt = _batch(seed, per_token_adv=False)
    _compare(
        {"granular": {"algorithm": "gspo"}, "sequence_level_importance_ratios": True, **opts},
        {"token_level_loss": False, "sequence_level_importance_ratios": True, **opts},
        data,
        logp,
        gvs,
        gvt,
        extra_metrics=("kl_penalty", "is_oob_ratio", "positive_nll_loss"),
    )


def test_explicit_fields_equal_gspo_preset():
    """The identity holds for the explicit field combination, not only for the preset name."""
    data, logp, gvs, gvt = _batch(3, per_token_adv=False)
    cfg = {
        "granular": {
            "algorithm": "grpo",
            "granularity": "sequence",
            "ratio": "shared",
            "clip": "fixed",
            "aggregation": "seq_mean_token_mean",
        },
        "ratio_clip_min": 0.01,
        "ratio_clip_max": 0.02,
        "reference_policy_kl_penalty": 0.02,
    }
    _compare(
        cfg,
        {
            "token_level_loss": False,
            "sequence_level_importance_ratios": True,
            "ratio_clip_min": 0.01,
            "ratio_clip_max": 0.02,
            "reference_policy_kl_penalty": 0.02,
        },
        data,
        logp,
        gvs,
        gvt,
    )


def test_loss_type_and_metric_normalizers():
    """NeMo-RL protocol attributes: TOKEN_LEVEL for token_mean presets, SEQUENCE_LEVEL otherwise."""
    from nemo_granular.protocol import LossInputType, LossType, MetricNormalizer

    assert GranularPolicyLoss({"granular": {"algorithm": "grpo"}}).loss_type == LossType.TOKEN_LEVEL
    assert GranularPolicyLoss({"granular": {"algorithm": "gspo"}}).loss_type == LossType.SEQUENCE_LEVEL
    fn = GranularPolicyLoss({"granular": {"algorithm": "espo", "espo": {"vocab_size": 16}}})
    assert fn.loss_type == LossType.SEQUENCE_LEVEL and fn.input_type == LossInputType.LOGPROB
    assert fn.metric_normalizations["loss"] == MetricNormalizer.SEQUENCES
    assert fn.metric_normalizations["probs_ratio_min"] == MetricNormalizer.NONE
    assert fn.metric_normalizations["clip_frac_low"] == MetricNormalizer.TOKENS
    data, logp, gvs, gvt = _batch(0, per_token_adv=False)
    _, _, m = R.run_loss(fn, logp, data, gvs, gvt)
    assert set(fn.metric_normalizations) <= set(m) | {"is_oob_ratio"}
    assert all(isinstance(v, float) for v in m.values())


# ---- against NeMo-RL's REAL ClippedPGLossFn (NEMO_RL_SRC; runs in CI) ---------------------------


def _as(data, dtype):
    return {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in data.items()}


def _run(fn, logp, data, gvs, gvt):
    lp = logp.detach().clone().requires_grad_(True)
    loss, metrics = fn(next_token_logprobs=lp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


@pytest.fixture(scope="module")
def nemo_pg(nemo_rl_src):
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    def make(cfg):
        return ClippedPGLossFn(ClippedPGLossConfig(**cfg))

    return make, BatchedDataDict


def _compare_real(nemo_pg, ours_cfg, nemo_cfg, seed, per_token_adv, dtype):
    make, BDD = nemo_pg
    data, logp, gvs, gvt = _batch(seed, per_token_adv)
    data, logp = _as(data, dtype), logp.to(dtype)
    gvs, gvt = torch.as_tensor(gvs, dtype=dtype), torch.as_tensor(gvt, dtype=dtype)
    base = {"reference_policy_kl_penalty": 0.0}
    loss, grad, m = _run(GranularPolicyLoss({**base, **ours_cfg}), logp, data, gvs, gvt)
    rloss, rgrad, rm = _run(make({**base, **nemo_cfg}), logp, BDD(data), gvs, gvt)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=3e-6, atol=3e-7)
    assert loss.dtype == dtype and grad.dtype == dtype
    torch.testing.assert_close(loss, rloss.to(dtype), **tol, msg="loss")
    torch.testing.assert_close(grad, rgrad, **tol, msg="grad")
    # GSPO + ICE-POP at [0.97, 1.03] drops every sequence (a product of token ratios): zero gradient
    assert grad.abs().sum() > 0 or nemo_cfg.get("truncated_importance_sampling_type") == "icepop"
    for k, v in rm.items():
        assert k in m, f"metric {k} missing"
        if k == "sampling_importance_ratio" and nemo_cfg.get("sequence_level_importance_ratios"):
            # NeMo-RL's GSPO-mode metric broadcasts [B, 1] weights against the [B] sample mask:
            # Σ_i Σ_j w_i·m_j / gvs = Σ_i w_i over ALL rows. Ours is the masked mean Σ_i w_i·m_i / gvs.
            w = _gspo_row_weights(data, nemo_cfg)
            assert float(v) == pytest.approx(float(w.sum() * gvs / (gvs + 1e-8)), rel=tol["rtol"] * 10), (
                "NeMo-RL's GSPO IS metric"
            )
            assert float(m[k]) == pytest.approx(
                float((w * data["sample_mask"]).sum() / (gvs + 1e-8)), rel=tol["rtol"] * 10
            )
            continue
        scale = 1 if dtype == torch.float64 else 10  # float32: metrics are sums of a different order
        assert float(m[k]) == pytest.approx(float(v), rel=tol["rtol"] * scale, abs=tol["atol"] * scale), f"metric {k}"
    return m, rm


def _gspo_row_weights(data, cfg):
    """exp(Σ_t (log π_old − log π_gen)) per row over the valid tokens, truncated as configured."""
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    w = torch.exp(((data["prev_logprobs"] - data["generation_logprobs"])[:, 1:] * mask).sum(-1))
    kind = cfg.get("truncated_importance_sampling_type")
    if kind == "tis":
        w = w.clamp(
            cfg.get("truncated_importance_sampling_ratio_min") or 0.0, cfg["truncated_importance_sampling_ratio"]
        )
    elif kind == "icepop":
        w = w * (
            (w >= cfg["truncated_importance_sampling_ratio_min"]) & (w <= cfg["truncated_importance_sampling_ratio"])
        )
    return w


@pytest.mark.nemo_rl
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_grpo_preset_is_real_clipped_pg_token_level(nemo_pg, option, dtype):
    opts = OPTIONS[option]
    for seed in (0, 1):
        _, rm = _compare_real(
            nemo_pg, {"granular": {"algorithm": "grpo"}, **opts}, {"token_level_loss": True, **opts}, seed, True, dtype
        )
        if "truncated_importance_sampling_type" in opts and seed == 0:
            assert rm["is_oob_ratio"] > 0, "test data should trigger the truncation"


@pytest.mark.nemo_rl
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("option", sorted(k for k in OPTIONS if k != "seq_mask_tis"))
def test_gspo_preset_is_real_clipped_pg_gspo_mode(nemo_pg, option, dtype):
    opts = {"ratio_clip_min": 3e-4, "ratio_clip_max": 4e-4, **OPTIONS[option]}
    for seed in (0, 1):
        _compare_real(
            nemo_pg,
            {"granular": {"algorithm": "gspo"}, "sequence_level_importance_ratios": True, **opts},
            {"token_level_loss": False, "sequence_level_importance_ratios": True, **opts},
            seed,
            False,
            dtype,
        )


# ---- NeMo-RL's float32 / integer masks and global counts with float64 values (issue 34) --------


def _counted_as(data, logp, mask_dtype):
    """float64 values, ``token_mask``/``sample_mask`` and the global counts in ``mask_dtype`` — NeMo-RL's
    loops hand its loss float32 masks and float32 global counts (sums of them)."""
    data = _as(data, torch.float64)
    data["token_mask"], data["sample_mask"] = data["token_mask"].to(mask_dtype), data["sample_mask"].to(mask_dtype)
    gvs = data["sample_mask"].sum()
    gvt = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    assert gvs.dtype == gvt.dtype == (torch.int64 if mask_dtype == torch.int64 else mask_dtype)
    return data, logp.to(torch.float64), gvs, gvt


COUNT_CASES = {  # our config, NeMo-RL's config
    "grpo": ({"granular": {"algorithm": "grpo"}}, {"token_level_loss": True}),
    "gspo": (
        {
            "granular": {"algorithm": "gspo"},
            "sequence_level_importance_ratios": True,
            "ratio_clip_min": 3e-4,
            "ratio_clip_max": 4e-4,
        },
        {
            "token_level_loss": False,
            "sequence_level_importance_ratios": True,
            "ratio_clip_min": 3e-4,
            "ratio_clip_max": 4e-4,
        },
    ),
}


# NeMo-RL refuses seq-mask-tis with sequence_level_importance_ratios (GSPO): that pair is not a case
COUNT_PAIRS = [
    (preset, option)
    for preset in sorted(COUNT_CASES)
    for option in ("plain", "kl_k3", "is_plain", "tis_min", "seq_mask_tis", "vapo_nll")
    if (preset, option) != ("gspo", "seq_mask_tis")
]


@pytest.mark.nemo_rl
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64], ids=["f32", "i64"])
@pytest.mark.parametrize("preset,option", COUNT_PAIRS)
def test_presets_real_clipped_pg_float32_int_counts(nemo_pg, preset, option, mask_dtype):
    """NeMo-RL forms count + 1e-8 in the count's dtype (``masked_mean``: torch.sum(mask) or the global
    count, + 1e-8): in float32 (a float32 count, or an integer one promoted to float32) the 1e-8 vanishes.
    Ours must form it there too: float64 values, float32 / int64 masks and global counts, our presets
    against the REAL ``ClippedPGLossFn`` — loss and gradient to 4e-15 relative (a float64 + 1e-8 differs
    by 1.3e-9 for GSPO, 5e-11 for GRPO), metrics as in the float64 comparison above."""
    make, BDD = nemo_pg
    ours_cfg, nemo_cfg = COUNT_CASES[preset]
    base = {"reference_policy_kl_penalty": 0.0}
    for seed in (0, 1):
        data, logp, gvs, gvt = _counted_as(*_batch(seed, per_token_adv=preset == "grpo")[:2], mask_dtype)
        loss, grad, m = _run(GranularPolicyLoss({**base, **ours_cfg, **OPTIONS[option]}), logp, data, gvs, gvt)
        rloss, rgrad, rm = _run(make({**base, **nemo_cfg, **OPTIONS[option]}), logp, BDD(data), gvs, gvt)
        assert loss.dtype == grad.dtype == rloss.dtype == torch.float64
        assert float(loss) != 0 and grad.abs().sum() > 0
        # measured after: 1.3e-15 relative (last bits: summation order); before: 1.3e-9 (GSPO), 5e-11 (GRPO)
        R.assert_close(loss, rloss, rtol=4e-15, atol=0, what="loss")
        R.assert_close(grad, rgrad, rtol=4e-15, atol=0, what="grad")
        for k, v in rm.items():
            if k == "sampling_importance_ratio" and preset == "gspo":
                continue  # NeMo-RL's GSPO-mode metric is a sum over all rows (see _compare_real)
            # NeMo-RL's is_oob_ratio is float32 here: masked_mean(oob.float(), float32 mask)
            rel = 2e-7 if k == "is_oob_ratio" and mask_dtype != torch.float64 else 1e-12
            assert float(m[k]) == pytest.approx(float(v), rel=rel, abs=1e-13), f"metric {k}"
