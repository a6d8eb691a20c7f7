"""Spec §9 identities 2 and 3: the `grpo` preset ≡ NeMo-RL's token-level ``ClippedPGLossFn`` and
`sequence`+shared+fixed+seq_mean_token_mean ≡ its GSPO mode — values, gradients and the metrics
NeMo-RL returns, against ``reference.nemo_clipped_pg_loss`` (NeMo-RL's semantics re-derived from
its source; NeMo-RL itself cannot be installed here)."""

import pytest
import torch

import reference as R
from nemo_granular.losses import GranularPolicyLoss

NEMO_METRICS = ("loss", "probs_ratio", "probs_ratio_clamped", "probs_ratio_min", "probs_ratio_max",
                "probs_ratio_clamped_min", "probs_ratio_clamped_max", "token_mult_prob_error", "gen_kl_error",
                "policy_kl_error", "js_divergence_error", "approx_entropy", "num_valid_samples")

OPTIONS = {
    "plain": {},
    "kl_k1": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k1"),
    "kl_k2": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k2"),
    "kl_k3": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k3"),
    "kl_k3_clamped": dict(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k3", kl_input_clamp_value=0.1,
                          kl_output_clamp_value=0.002),
    "kl_on_policy_approx": dict(reference_policy_kl_penalty=0.05, use_on_policy_kl_approximation=True),
    "kl_in_reward": dict(reference_policy_kl_penalty=0.05, use_kl_in_reward=True),
    "dual_clip": dict(ratio_clip_c=1.3),
    "dapo_eps": dict(ratio_clip_min=0.2, ratio_clip_max=0.28),
    "is_plain": dict(use_importance_sampling_correction=True),
    "tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=1.03),
    "tis_min": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                    truncated_importance_sampling_ratio=1.03, truncated_importance_sampling_ratio_min=0.98),
    "icepop": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                   truncated_importance_sampling_ratio=1.03, truncated_importance_sampling_ratio_min=0.97),
    "seq_mask_tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.01, truncated_importance_sampling_ratio_min=0.99),
    "vapo_nll": dict(positive_example_nll_weight=0.3),
}


def _batch(seed, per_token_adv):
    data, logp, gvs, gvt = R.make_batch(B=6, S=14, seed=seed, per_token_adv=per_token_adv, gen_noise=0.03,
                                        noise=(1e-3, 0.05, 0.3))
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
    m, rm = _compare({"granular": {"algorithm": "grpo"}, **opts}, {"token_level_loss": True, **opts},
                     data, logp, gvs, gvt, extra_metrics=("kl_penalty", "sampling_importance_ratio", "is_oob_ratio",
                                                          "positive_nll_loss"))
    if "truncated_importance_sampling_type" in opts and seed == 0:
        assert rm["is_oob_ratio"] > 0, "test data should trigger the truncation"


@pytest.mark.parametrize("option", sorted(k for k in OPTIONS if k != "seq_mask_tis"))
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_preset_is_nemo_gspo_mode(option, seed):
    """sequence + shared + fixed + seq_mean_token_mean ≡ NeMo-RL with sequence_level_importance_ratios=True,
    token_level_loss=False (GSPO's ε = 3e-4/4e-4 given to both)."""
    opts = {"ratio_clip_min": 3e-4, "ratio_clip_max": 4e-4, **OPTIONS[option]}
    data, logp, gvs, gvt = _batch(seed, per_token_adv=False)
    _compare({"granular": {"algorithm": "gspo"}, "sequence_level_importance_ratios": True, **opts},
             {"token_level_loss": False, "sequence_level_importance_ratios": True, **opts},
             data, logp, gvs, gvt, extra_metrics=("kl_penalty", "is_oob_ratio", "positive_nll_loss"))


def test_explicit_fields_equal_gspo_preset():
    """The identity holds for the explicit field combination, not only for the preset name."""
    data, logp, gvs, gvt = _batch(3, per_token_adv=False)
    cfg = {"granular": {"algorithm": "grpo", "granularity": "sequence", "ratio": "shared", "clip": "fixed",
                        "aggregation": "seq_mean_token_mean"}, "ratio_clip_min": 0.01, "ratio_clip_max": 0.02,
           "reference_policy_kl_penalty": 0.02}
    _compare(cfg, {"token_level_loss": False, "sequence_level_importance_ratios": True, "ratio_clip_min": 0.01,
                   "ratio_clip_max": 0.02, "reference_policy_kl_penalty": 0.02}, data, logp, gvs, gvt)


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
