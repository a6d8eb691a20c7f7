"""The π_old/π_gen correction at the ratio's granularity (docs/algorithms/math.md §10).

1. Every level (token | group_sum | group_mean) and every truncation (none, tis, tis with a
   minimum, icepop, seq-mask-tis) at every granularity, and every preset, against the naive
   float64 loops of ``reference.offpolicy_weights`` / ``reference.mismatch_metrics``: loss,
   gradient and the mismatch diagnostics, all in float64.
2. The token and sequence cases against NeMo-RL's REAL ``ClippedPGLossFn`` in float64 (the
   fixtures of test_loss_nemo.py), with ``is_level`` given explicitly.
3. Spec §9.6 for the new terms: whole batch = microbatches = one call per sequence (NeMo-RL's
   packing wrapper), right padding and row order change nothing.
4. Preflight: the new key and the generalised seq-mask-tis, one-line errors.
"""

from __future__ import annotations

import math

import pytest
import torch

import reference as R
from nemo_granular.config import parse_policy_loss_config
from nemo_granular.losses import GranularPolicyLoss
from test_loss_nemo import OPTIONS, _compare_real, nemo_pg  # noqa: F401 - fixtures
from test_nemo_rl_loss_equivalence import _combine, _driver_batch, _microbatches, _per_sequence, _whole

V = 16
PRESET_OF = {"token": "grpo", "sequence": "gspo", "segment": "sspo_no_ec", "entropy_group": "espo"}
TRUNCATIONS = {
    "none": {},
    "tis": dict(kind="tis", hi=1.01),
    "tis_min": dict(kind="tis", hi=1.03, lo=0.98),
    "icepop": dict(kind="icepop", hi=1.04, lo=0.97),
    "seq_mask_tis": dict(kind="seq-mask-tis", hi=1.02, lo=0.98),
}
# how far a unit's weight strays at gen_noise 0.04, relative to a token's: the bounds above are
# scaled by it so that every case truncates some units and keeps others
SPREAD = {("group_sum", g): 1.5 for g in ("sequence", "segment", "entropy_group")}
SPREAD.update(
    {
        ("group_sum", "sequence"): 3.0,
        ("group_mean", "sequence"): 0.3,
        ("group_mean", "segment"): 0.5,
        ("group_mean", "entropy_group"): 0.5,
    }
)
MASK_SPREAD = {"token": 0.6, "sequence": 0.6, "segment": 0.6, "entropy_group": 0.6}


def _scaled(trunc, granularity, level):
    if not trunc:
        return trunc
    f = MASK_SPREAD[granularity] if trunc["kind"] == "seq-mask-tis" else SPREAD.get((level, granularity), 1.0)
    out = dict(trunc, hi=1 + (trunc["hi"] - 1) * f)
    if trunc.get("lo") is not None:
        out["lo"] = 1 - (1 - trunc["lo"]) * f
    return out


DIAGNOSTICS = ("gen_mismatch_abs_mean", "gen_kl_k3", "gen_mismatch_group_abs_mean")
TOL = dict(rtol=1e-12, atol=1e-14)  # measured: loss 2.3e-14 relative, gradient 3.3e-16 of its max


def _loss_cfg(preset, level, trunc, **extra):
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "use_importance_sampling_correction": True,
        "granular": {"algorithm": preset, "is_level": level, "espo": {"vocab_size": V}},
        **extra,
    }
    if trunc.get("kind"):
        cfg.update(
            truncated_importance_sampling_type=trunc["kind"],
            truncated_importance_sampling_ratio=trunc["hi"],
            truncated_importance_sampling_ratio_min=trunc.get("lo"),
        )
    return cfg


def _batch(seed):
    data, logp, gvs, gvt = R.make_batch(B=6, S=16, V=V, seed=seed, gen_noise=0.04, noise=(1e-3, 0.05, 0.3))
    return {k: (v.double() if v.is_floating_point() else v) for k, v in data.items()}, logp.double(), gvs, gvt


def _run64(fn, logp, data, gvs, gvt):
    lp = logp.detach().clone().requires_grad_(True)
    loss, m = fn(
        next_token_logprobs=lp,
        data=data,
        global_valid_seqs=torch.tensor(gvs, dtype=torch.float64),
        global_valid_toks=torch.tensor(gvt, dtype=torch.float64),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.dtype == torch.float64
    return loss.detach(), grad, m


def _check_against_reference(preset, level, trunc, seed):
    data, logp, gvs, gvt = _batch(seed)
    fn = GranularPolicyLoss(_loss_cfg(preset, level, trunc), delimiter_table=R.delimiter_table(V))
    loss, grad, m = _run64(fn, logp, data, gvs, gvt)
    rloss, rgrad, rm = R.run_ref(
        lambda lp: R.preset_loss(
            preset, lp, data, gvs=gvs, gvt=gvt, vocab_size=V, offpolicy=dict(level=level, **trunc)
        ),
        logp,
    )
    torch.testing.assert_close(loss, rloss, **TOL, msg="loss")
    torch.testing.assert_close(grad, rgrad, **TOL, msg="grad")
    ref = rm["offpolicy"]
    for k in DIAGNOSTICS:
        assert m[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-15), k
    if trunc.get("kind"):
        assert m["is_oob_token_frac"] == pytest.approx(ref["is_oob_token_frac"], rel=1e-12, abs=1e-15)
        assert m["is_oob_group_frac"] == pytest.approx(ref["is_oob_group_frac"], rel=1e-12, abs=1e-15)
        nemo_kind = "is_oob_group_frac" if trunc["kind"] == "seq-mask-tis" else "is_oob_token_frac"
        assert m["is_oob_ratio"] == pytest.approx(ref[nemo_kind], rel=1e-12, abs=1e-15)
    granularity = R.PRESET_SPECS[preset]["granularity"]
    if granularity != "sequence" or level == "token":
        assert m["sampling_importance_ratio"] == pytest.approx(ref["sampling_importance_ratio_tokens"], rel=1e-12)
    return m, grad


@pytest.mark.parametrize("trunc", sorted(TRUNCATIONS))
@pytest.mark.parametrize("level", ["token", "group_sum", "group_mean"])
@pytest.mark.parametrize("granularity", sorted(PRESET_OF))
def test_level_and_truncation_match_float64_reference(granularity, level, trunc):
    hit = []
    for seed in (0, 1):
        m, grad = _check_against_reference(
            PRESET_OF[granularity], level, _scaled(TRUNCATIONS[trunc], granularity, level), seed
        )
        assert grad.abs().sum() > 0, "everything masked: the case tests nothing"
        hit.append(m.get("is_oob_token_frac", 0.5))
    # the data must exercise the truncation (tokens truncated, but not all)
    assert max(hit) > 0 and min(hit) < 1, hit


@pytest.mark.parametrize("level", ["token", "group_sum", "group_mean"])
@pytest.mark.parametrize("preset", sorted(R.PRESET_SPECS))
def test_every_preset_with_every_level(preset, level):
    _check_against_reference(preset, level, TRUNCATIONS["tis_min"], seed=2)


def test_levels_differ_where_groups_have_several_tokens():
    """The three levels are three different weights at group granularities, one at token granularity."""
    data, logp, gvs, gvt = _batch(0)
    out = {}
    for g in ("token", "segment"):
        for level in ("token", "group_sum", "group_mean"):
            fn = GranularPolicyLoss(_loss_cfg(PRESET_OF[g], level, {}), delimiter_table=R.delimiter_table(V))
            out[g, level] = _run64(fn, logp, data, gvs, gvt)[0]
    assert out["token", "token"] == out["token", "group_sum"] == out["token", "group_mean"]
    vals = [float(out["segment", lv]) for lv in ("token", "group_sum", "group_mean")]
    assert len({round(v, 12) for v in vals}) == 3, vals


# ---- NeMo-RL's REAL ClippedPGLossFn, float64 --------------------------------------------------------

# the truncation cases of test_loss_nemo (one table of NeMo-RL option sets)
NEMO_TRUNC = {k: OPTIONS[k] for k in ("is_plain", "tis", "tis_min", "icepop", "seq_mask_tis")}


@pytest.mark.nemo_rl
@pytest.mark.parametrize("dtype", [torch.float64], ids=["f64"])
@pytest.mark.parametrize("level", ["token", "group_sum", "group_mean"])
@pytest.mark.parametrize("option", sorted(NEMO_TRUNC))
def test_token_groups_equal_real_nemo_rl_at_every_level(nemo_pg, option, level, dtype):  # noqa: F811 - fixture
    """At token granularity every level is NeMo-RL's token-level weight, seq-mask-tis masks whole rows."""
    opts = NEMO_TRUNC[option]
    for seed in (0, 1):
        _compare_real(
            nemo_pg,
            {"granular": {"algorithm": "grpo", "is_level": level}, **opts},
            {"token_level_loss": True, **opts},
            seed,
            True,
            dtype,
        )


@pytest.mark.nemo_rl
@pytest.mark.parametrize("dtype", [torch.float64], ids=["f64"])
@pytest.mark.parametrize("option", sorted(k for k in NEMO_TRUNC if k != "seq_mask_tis"))
def test_sequence_group_sum_equals_real_nemo_rl_gspo_mode(nemo_pg, option, dtype):  # noqa: F811 - fixture
    """`algorithm: gspo` with `is_level: group_sum` (no NeMo-RL GSPO key) is NeMo-RL's GSPO-mode correction."""
    opts = {"ratio_clip_min": 3e-4, "ratio_clip_max": 4e-4, **NEMO_TRUNC[option]}
    for seed in (0, 1):
        _compare_real(
            nemo_pg,
            {"granular": {"algorithm": "gspo", "is_level": "group_sum"}, **opts},
            {"token_level_loss": False, "sequence_level_importance_ratios": True, **opts},
            seed,
            False,
            dtype,
        )


@pytest.mark.nemo_rl
@pytest.mark.parametrize("level", ["token", "group_sum", "group_mean"])
@pytest.mark.parametrize("option", sorted(NEMO_TRUNC))
@pytest.mark.parametrize("B,S", [(1, 2), (2, 3), (3, 5)])
def test_token_groups_equal_real_nemo_rl_on_tiny_batches(nemo_pg, option, level, B, S):  # noqa: F811 - fixture
    """Batches of a few tokens, float64, every metric NeMo-RL returns: the + 1e-8 of NeMo-RL's
    masked_mean in every mean of the correction (seq-mask-tis' geometric mean over n + 1e-8 tokens)."""
    from test_nemo_rl_dropin import _tiny_batch

    make, BDD = nemo_pg
    opts = {"reference_policy_kl_penalty": 0.0, **NEMO_TRUNC[option]}
    for seed in range(3):
        data, logp, gvs, gvt = _tiny_batch(seed, B, S)
        loss, grad, m = _run64(
            GranularPolicyLoss({"granular": {"algorithm": "grpo", "is_level": level}, **opts}), logp, data, gvs, gvt
        )
        rloss, rgrad, rm = _run64(make({"token_level_loss": True, **opts}), logp, BDD(data), gvs, gvt)
        torch.testing.assert_close(loss, rloss, rtol=1e-12, atol=1e-15, msg=f"seed {seed}: loss")
        torch.testing.assert_close(grad, rgrad, rtol=1e-12, atol=1e-15, msg=f"seed {seed}: grad")
        for k, v in rm.items():
            assert float(m[k]) == pytest.approx(float(v), rel=1e-12, abs=1e-15), f"seed {seed}: metric {k}"


# ---- invariances (padding, order, microbatching, packing) for the new terms ----------------------------------------------------------------------

INVARIANCE_CASES = {
    "sspo_group_mean_seq_mask": dict(
        algorithm="sspo", level="group_mean", trunc=dict(kind="seq-mask-tis", hi=1.01, lo=0.99)
    ),
    "espo_group_sum_icepop": dict(algorithm="espo", level="group_sum", trunc=dict(kind="icepop", hi=1.05, lo=0.95)),
    "gspo_group_mean_tis": dict(algorithm="gspo", level="group_mean", trunc=dict(kind="tis", hi=1.002, lo=0.999)),
    "sspo_token_tis": dict(algorithm="sspo", level="token", trunc=dict(kind="tis", hi=1.01)),
}


def _pad_right(data, logp, k):
    out = {}
    for name, v in data.items():
        if v.dim() == 2 and v.shape[1] > 1:
            fill = -1 if name == "granular_group_ids" else 0
            out[name] = torch.cat([v, torch.full((v.shape[0], k), fill, dtype=v.dtype)], dim=1)
        else:
            out[name] = v
    return out, torch.cat([logp, torch.zeros(logp.shape[0], k, dtype=logp.dtype)], dim=1)


@pytest.mark.parametrize("case", sorted(INVARIANCE_CASES))
def test_microbatching_packing_padding_and_order_change_nothing(case):
    spec = INVARIANCE_CASES[case]
    cfg = _loss_cfg(spec["algorithm"], spec["level"], spec["trunc"])
    cfg["granular"]["espo"] = {"vocab_size": 12}
    fn = GranularPolicyLoss(cfg)
    data, logp0, gvs, gvt = _driver_batch(3, cfg)
    data["generation_logprobs"] = (
        data["prev_logprobs"]
        + 0.01
        * torch.randn(data["prev_logprobs"].shape, generator=torch.Generator().manual_seed(7))
        * data["token_mask"]
    )

    def run(split, d, lp):
        lp = lp.clone().requires_grad_(True)
        loss, metrics = _combine(split(fn, lp, d, gvs, gvt))
        (grad,) = torch.autograd.grad(loss, lp)
        return loss.detach(), grad, metrics

    ref_loss, ref_grad, ref_m = run(_whole, data, logp0)
    assert 0 < ref_m["is_oob_token_frac"] < 1, "the truncation must act on part of the batch"
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    permuted = {k: v[perm] for k, v in data.items()}
    padded, lp_pad = _pad_right(data, logp0, 3)
    results = {
        "micro": run(_microbatches, data, logp0),
        "per_seq": run(_per_sequence, data, logp0),
        "permuted": run(_whole, permuted, logp0[perm]),
        "padded": run(_whole, padded, lp_pad),
    }
    for name, (loss, grad, m) in results.items():
        if name == "permuted":
            grad = grad[torch.argsort(perm)]
        if name == "padded":
            assert grad[:, -3:].abs().max() == 0
            grad = grad[:, :-3]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7, msg=f"{name}: loss")
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7, msg=f"{name}: grad")
        for k in (*DIAGNOSTICS, "is_oob_ratio", "is_oob_token_frac", "is_oob_group_frac", "sampling_importance_ratio"):
            assert m[k] == pytest.approx(ref_m[k], rel=1e-5, abs=1e-7), f"{name}: metric {k}"


# ---- preflight -------------------------------------------------------------------------------------


def test_default_levels_and_nemo_rl_gspo_mode():
    def level(cfg):
        return parse_policy_loss_config(cfg).granular.is_level

    assert level({}) == "token"
    for alg in ("gspo", "gspo_token", "sspo", "sspo_no_ec", "espo"):
        assert level({"granular": {"algorithm": alg}}) == "group_mean", alg
    # NeMo-RL's own GSPO key keeps NeMo-RL's weight (drop-in) unless is_level is given
    assert level({"sequence_level_importance_ratios": True, "token_level_loss": False}) == "group_sum"
    assert level({"sequence_level_importance_ratios": True, "granular": {"algorithm": "gspo"}}) == "group_sum"
    assert (
        level(
            {
                "sequence_level_importance_ratios": True,
                "use_importance_sampling_correction": True,
                "granular": {"algorithm": "gspo", "is_level": "group_mean"},
            }
        )
        == "group_mean"
    )


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"granular": {"is_level": "sequence"}}, "loss_fn.granular.is_level"),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.01,
                "granular": {"algorithm": "sspo"},
            },
            "truncated_importance_sampling_ratio_min",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.01,
                "truncated_importance_sampling_ratio_min": 0.99,
                "sequence_level_importance_ratios": True,
                "granular": {"algorithm": "gspo"},
            },
            "seq-mask-tis",
        ),
    ],
)
def test_bad_keys_are_one_line_errors(bad, field):
    with pytest.raises(ValueError) as err:
        parse_policy_loss_config(bad)
    assert "\n" not in str(err.value) and field in str(err.value), str(err.value)


def test_seq_mask_tis_is_accepted_at_group_granularities():
    for alg in ("sspo", "espo", "gspo"):
        cfg = parse_policy_loss_config(
            {
                "use_importance_sampling_correction": True,
                "granular": {"algorithm": alg},
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.01,
                "truncated_importance_sampling_ratio_min": 0.99,
            }
        )
        assert cfg.granular.is_level == "group_mean"


def test_metric_normalizers_are_advertised():
    from nemo_granular.protocol import MetricNormalizer

    fn = GranularPolicyLoss(_loss_cfg("sspo", "group_mean", TRUNCATIONS["seq_mask_tis"]))
    kinds = fn.metric_normalizations
    assert kinds["gen_mismatch_abs_mean"] == kinds["gen_kl_k3"] == kinds["is_oob_token_frac"] == MetricNormalizer.TOKENS
    assert kinds["gen_mismatch_group_abs_mean"] == kinds["is_oob_group_frac"] == MetricNormalizer.SEQUENCES
    assert kinds["is_oob_ratio"] == MetricNormalizer.SEQUENCES
    gspo_tok = GranularPolicyLoss(_loss_cfg("gspo", "token", {}))
    assert gspo_tok.metric_normalizations["sampling_importance_ratio"] == MetricNormalizer.TOKENS
    gspo_grp = GranularPolicyLoss(_loss_cfg("gspo", "group_mean", {}))
    assert gspo_grp.metric_normalizations["sampling_importance_ratio"] == MetricNormalizer.SEQUENCES


@pytest.mark.parametrize("granularity", ["token", "sequence", "segment"])
def test_batch_mismatch_extrema_match_loops(granularity):
    """The whole-batch maxima the trainers log once per step (math.md §10.3), against loops."""
    from nemo_granular.core.groups import group_ids_for
    from nemo_granular.core.offpolicy import batch_mismatch_extrema

    data, _, _, _ = _batch(4)
    if granularity == "segment":
        data["granular_group_ids"] = group_ids_for(
            "segment", data["token_mask"] > 0, token_ids=data["input_ids"], delimiter_table=R.delimiter_table(V)
        )
    got = batch_mismatch_extrema(data, granularity)
    valid = (data["token_mask"] * data["sample_mask"][:, None]) > 0
    d = data["prev_logprobs"] - data["generation_logprobs"]
    tok = max(abs(float(d[i, t])) for i in range(d.shape[0]) for t in range(d.shape[1]) if valid[i, t])
    groups: dict = {}
    for i in range(d.shape[0]):
        for t in range(d.shape[1]):
            if valid[i, t]:
                key = (
                    (i, t)
                    if granularity == "token"
                    else (i, 0)
                    if granularity == "sequence"
                    else (i, int(data["granular_group_ids"][i, t]))
                )
                groups.setdefault(key, []).append(float(d[i, t]))
    grp = max(abs(sum(v) / len(v)) for v in groups.values())
    assert got["gen_mismatch_token_abs_max"] == pytest.approx(tok, rel=1e-12)
    assert got["gen_mismatch_group_abs_max"] == pytest.approx(grp, rel=1e-12)
    # the entropy split: each response's top ⌈20 %⌉ π_old entropies (ties: earlier first) vs the rest
    high, low = [], []
    for i in range(d.shape[0]):
        pos = [t for t in range(d.shape[1]) if valid[i, t]]
        ranked = sorted(pos, key=lambda t: (-float(data["prev_entropy"][i, t]), t))
        k = math.ceil(0.2 * len(pos))
        high += [abs(float(d[i, t])) for t in ranked[:k]]
        low += [abs(float(d[i, t])) for t in ranked[k:]]
    assert got["gen_mismatch_abs_mean_high_entropy"] == pytest.approx(sum(high) / len(high), rel=1e-12)
    assert got["gen_mismatch_abs_mean_low_entropy"] == pytest.approx(sum(low) / len(low), rel=1e-12)
    assert batch_mismatch_extrema({k: v for k, v in data.items() if k != "generation_logprobs"}, granularity) == {}


@pytest.mark.parametrize("level", ["group_sum", "group_mean"])
def test_sequence_weight_metric_without_correction_follows_the_level(level):
    """With the correction off, `sampling_importance_ratio` at sequence groups reports the per-response
    weight the level would apply: exp(Σδ) (NeMo-RL's GSPO mode) or exp(mean δ)."""
    data, logp, gvs, gvt = _batch(5)
    cfg = {"reference_policy_kl_penalty": 0.0, "granular": {"algorithm": "gspo"}}
    if level == "group_sum":
        cfg.update(sequence_level_importance_ratios=True)
    m = _run64(GranularPolicyLoss(cfg), logp, data, gvs, gvt)[2]
    d = (data["prev_logprobs"] - data["generation_logprobs"])[:, 1:]
    mask = data["token_mask"][:, 1:]
    want = 0.0
    for i in range(d.shape[0]):
        n = float(mask[i].sum())
        if data["sample_mask"][i] and n:
            s = float((d[i] * mask[i]).sum())
            want += math.exp(s if level == "group_sum" else s / (n + 1e-8)) / (gvs + 1e-8)  # masked_mean's + 1e-8
    assert m["sampling_importance_ratio"] == pytest.approx(want, rel=1e-12)
