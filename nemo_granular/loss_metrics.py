"""The metrics of :class:`~nemo_granular.losses.GranularPolicyLoss`: NeMo-RL's set (same names,
same normalisation) plus the granular ones, and the denominator each advertises.

Every value is a partial sum normalised by a global count (``global_valid_toks``: TOKENS,
``global_valid_seqs``: SEQUENCES) or a raw value (NONE: counts, and the ratio extrema, combined
with min/max), so summing the calls of one step gives the step's value — NeMo-RL's convention.
Each token mean is one weighted sum; ratio statistics of group granularities are taken on the
``[B, G]`` group table (a group's tokens share its ratio and bounds).
"""

from __future__ import annotations

import torch

from .core.diagnostics import masked_extrema, prob_error_sums
from .core.objective import LOG_RATIO_BOUND, aggregation_group_weights, aggregation_weights, plus_count_eps
from .core.offpolicy import mismatch_sums

__all__ = [
    "MINIMAL_SKIPS",
    "GRANULAR_DIAGNOSTICS",
    "MISMATCH_METRICS",
    "metric_kinds",
    "policy_metrics",
    "mismatch_metrics",
]

TOKEN_METRICS = (
    "probs_ratio",
    "probs_ratio_clamped",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "approx_entropy",
    "clip_frac_low",
    "clip_frac_high",
    "clip_bound_low_mean",
    "clip_bound_high_mean",
    "prev_entropy_mean",
    "nonfinite_token_frac",
)
SEQ_METRICS = ("clip_frac_low_groups", "clip_frac_high_groups", "groups_per_response", "group_size_mean")
# π_old-vs-π_gen mismatch (docs/algorithms/math.md §10.3; maxima and the entropy split: per step, by the trainer)
MISMATCH_TOKEN_METRICS = ("gen_mismatch_abs_mean", "gen_kl_k3")
MISMATCH_SEQ_METRICS = ("gen_mismatch_group_abs_mean",)
RAW_METRICS = (
    "num_valid_samples",
    "nonfinite_tokens",
    "positive_nll_loss",
    "probs_ratio_min",
    "probs_ratio_max",
    "probs_ratio_clamped_min",
    "probs_ratio_clamped_max",
)


# what NeMo-RL's `metrics_level: minimal` leaves out (NVIDIA-NeMo/RL pull request 3751);
# `sampling_importance_ratio` too, unless the importance-sampling correction is on
MINIMAL_SKIPS = frozenset(
    (
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
    )
)
# ours, diagnostics of the groups and bounds: at `minimal` only the clip fractions per token and the
# non-finite count stay (the rewrite's minimal keeps no diagnostic; these few cost ~2 small ops)
GRANULAR_DIAGNOSTICS = frozenset(
    (
        "clip_frac_low_groups",
        "clip_frac_high_groups",
        "groups_per_response",
        "group_size_mean",
        "clip_bound_low_mean",
        "clip_bound_high_mean",
        "prev_entropy_mean",
    )
)
# ours, diagnostics like MINIMAL_SKIPS: at `minimal` only while the correction is on (it reads δ anyway)
MISMATCH_METRICS = MISMATCH_TOKEN_METRICS + MISMATCH_SEQ_METRICS + ("is_oob_token_frac", "is_oob_group_frac")


def metric_kinds(
    token_level: bool,
    granularity: str,
    truncation: str | None,
    level: str = "full",
    importance_correction: bool = False,
    is_level: str = "group_sum",
) -> dict[str, str]:
    """Metric name → ``MetricNormalizer`` value (``tokens`` / ``sequences`` / ``none``), as NeMo-RL's
    ``ClippedPGLossFn`` advertises them: ``loss`` and ``kl_penalty`` like the gradient
    (``token_level_loss``), ``is_oob_ratio`` by the truncation, ``sampling_importance_ratio``
    per response for one weight per response (sequence ratios, group-level correction).
    ``level`` ``minimal``: without :data:`MINIMAL_SKIPS`, and without :data:`MISMATCH_METRICS`
    unless ``importance_correction``."""
    grad = "tokens" if token_level else "sequences"
    kinds = {"loss": grad, "kl_penalty": grad}
    kinds.update({k: "tokens" for k in TOKEN_METRICS})
    kinds.update({k: "sequences" for k in SEQ_METRICS})
    kinds.update({k: "none" for k in RAW_METRICS})
    full = level == "full"
    if not full:
        kinds = {k: v for k, v in kinds.items() if k not in MINIMAL_SKIPS and k not in GRANULAR_DIAGNOSTICS}
    if full or importance_correction:
        kinds["sampling_importance_ratio"] = (
            "sequences" if granularity == "sequence" and is_level != "token" else "tokens"
        )
        kinds.update({k: "tokens" for k in MISMATCH_TOKEN_METRICS})
        kinds.update({k: "sequences" for k in MISMATCH_SEQ_METRICS})
    if truncation is not None:
        kinds["is_oob_ratio"] = "sequences" if truncation == "seq-mask-tis" else "tokens"
        if full or importance_correction:
            kinds.update(is_oob_token_frac="tokens", is_oob_group_frac="sequences")
    return kinds


def mismatch_metrics(b, ratios, correction, gen_kl_k3=None) -> dict[str, torch.Tensor]:
    """The π_old-vs-π_gen diagnostics of docs/algorithms/math.md §10.3 on the ratio's groups
    (:func:`~nemo_granular.core.offpolicy.mismatch_sums`); ``gen_kl_k3``: NeMo-RL's ``gen_kl_error``
    of the same call when it is the k3 estimator (the same sum, not computed twice)."""
    return mismatch_sums(
        b.prev,
        b.gen,
        b.valid,
        b.w_tok,
        b.sample_mask * b.inv_gvs,
        index=ratios.index,
        counts=ratios.counts,
        n_groups_row=ratios.n_groups_row,
        correction=correction,
        gen_kl_k3=gen_kl_k3,
        count_dtype=b.count_dtype,
    )


def policy_metrics(b, result, penalized, cfg) -> dict[str, torch.Tensor]:
    """0-d tensors, one per metric. ``b`` is the loss's batch view (``PolicyBatch``), ``result`` the
    objective's :class:`~nemo_granular.core.objective.ObjectiveResult` (ratios, surrogate terms,
    clip bounds per token and per group, the per-group-mean weights when the objective built them,
    the π_old/π_gen correction), ``penalized`` the :class:`~nemo_granular.core.objective.PenalizedLoss`
    (loss, β·KL, NLL) and ``cfg`` the loss's ``PolicyLossSpec``. ``metrics_level`` ``minimal`` leaves
    out :data:`MINIMAL_SKIPS` (and ``sampling_importance_ratio`` without the correction), the others
    keep their values; ``granular.is_level`` is the π_old/π_gen weight's level (math.md §10), which
    ``sampling_importance_ratio`` reports."""
    m: dict[str, torch.Tensor] = {}
    if result.is_oob_ratio is not None:
        m["is_oob_ratio"] = result.is_oob_ratio
    if cfg.metrics_level == "minimal":
        m.update(_minimal_metrics(b, result, penalized, cfg))
    else:
        m.update(_full_metrics(b, result, penalized, cfg))
    return m


def _full_metrics(b, result, penalized, cfg) -> dict[str, torch.Tensor]:
    """:func:`policy_metrics` at ``metrics_level: full``: NeMo-RL's set and ours."""
    g, is_weight = cfg.granular, result.is_weight
    kl_coef, is_level = cfg.kl_coef, g.is_level
    m: dict[str, torch.Tensor] = {}
    w_tok, sm = b.w_tok, b.sample_mask
    w_flat = w_tok.view(-1)

    def tok(x):  # Σ_t w_tok·x: a token mean normalised by global_valid_toks
        if not torch.is_tensor(x) or x.dim() == 0:
            return w_tok.sum() * x
        if x.shape == w_tok.shape and x.is_contiguous():
            return torch.dot(x.view(-1), w_flat)
        return (x * w_tok).sum()

    def seq(x_row):  # a per-row value averaged over rows, normalised by global_valid_seqs
        return (x_row * sm).sum() * b.inv_gvs

    m.update(_ratio_statistics(b, result, g.surrogate, tok))
    m.update(_loss_values(sm, penalized, kl_coef))
    diff = b.prev - b.gen  # 0 outside the valid tokens
    row_is = g.granularity == "sequence" and is_level != "token"  # one π_old/π_gen weight per response
    token_is = not row_is and is_weight is None
    m.update(prob_error_sums(diff, w_tok, cfg.reference_policy_kl_type, LOG_RATIO_BOUND if token_is else None))
    # GSPO: the mean over responses of one π_old/π_gen weight per response. NeMo-RL's own GSPO
    # mode multiplies a [B, 1] weight by a [B] mask, which broadcasts to [B, B], so its dashboard
    # shows Σ_i w_i (about B × ours), not a mean (docs/nemo-rl.md, "Logged metrics").
    if row_is:  # without the correction: the weight the configured level would apply
        log_w = diff.sum(-1) if is_level == "group_sum" else diff.sum(-1) / plus_count_eps(b.n_row, b.count_dtype)
        w_row = torch.exp(log_w.clamp(max=LOG_RATIO_BOUND))
        if is_weight is not None:
            w_row = (is_weight * b.valid).amax(-1)
        m["sampling_importance_ratio"] = seq(w_row)
    elif not token_is:
        m["sampling_importance_ratio"] = tok(is_weight)
    m["approx_entropy"] = -tok(torch.exp((b.logp - b.gen).clamp(max=LOG_RATIO_BOUND)).mul_(b.logp))
    m["positive_nll_loss"] = penalized.nll.detach()
    # ours (the clip-bound means came with the ratio statistics)
    m.update(_granular_metrics(b, result, tok, seq, per_token_bounds=True, with_bounds=False))
    return m


def _loss_values(sample_mask, penalized, kl_coef: float) -> dict[str, torch.Tensor]:
    """``loss``, ``num_valid_samples`` and ``kl_penalty`` (KL without β), as NeMo-RL reports them."""
    kl = penalized.kl
    return {
        "loss": penalized.loss.detach(),
        "num_valid_samples": sample_mask.sum(),
        "kl_penalty": kl.detach() / kl_coef if kl_coef else torch.zeros_like(kl),
    }


def _minimal_metrics(b, result, penalized, cfg) -> dict[str, torch.Tensor]:
    """The metrics :func:`policy_metrics` keeps at ``metrics_level: minimal``, each computed as there:
    the rewrite's minimal set, the clip fractions per token and the non-finite count (not
    :data:`GRANULAR_DIAGNOSTICS`)."""
    g, is_weight = cfg.granular, result.is_weight
    m: dict[str, torch.Tensor] = {}
    sm = b.sample_mask
    w_sum = []

    def tok(x):  # (b.w_tok is built on first use: the group path reports without it)
        w_tok = b.w_tok
        if not torch.is_tensor(x) or x.dim() == 0:
            if not w_sum:
                w_sum.append(w_tok.sum())
            return w_sum[0] * x
        if x.shape == w_tok.shape and x.is_contiguous():
            return torch.dot(x.view(-1), w_tok.view(-1))
        return (x * w_tok).sum()

    def seq(x_row):
        return (x_row * sm).sum() * b.inv_gvs

    m.update(_loss_values(sm, penalized, cfg.kl_coef))
    if is_weight is not None:
        if g.granularity == "sequence" and g.is_level != "token":  # one weight per response
            m["sampling_importance_ratio"] = seq((is_weight * b.valid).amax(-1))
        else:
            m["sampling_importance_ratio"] = tok(is_weight)
    m["positive_nll_loss"] = penalized.nll.detach()
    m.update(_clip_fractions(b, result, tok))
    m.update(_nonfinite(b))
    return m


def _clip_fractions(b, result, tok) -> dict[str, torch.Tensor]:
    """``clip_frac_low`` / ``clip_frac_high``: the share of tokens whose gradient the clip removed
    (a token mean; grouped: the clipped tokens counted per group)."""
    terms = result.terms
    if result.grouped:
        row_tok = (b.sample_mask * b.inv_gvt)[:, None]  # w_tok of a row's valid tokens
        return {"clip_frac_low": (terms.low * row_tok).sum(), "clip_frac_high": (terms.high * row_tok).sum()}
    return {"clip_frac_low": tok(terms.low), "clip_frac_high": tok(terms.high)}


def _nonfinite(b) -> dict[str, torch.Tensor]:
    """Tokens the careful read took out of the valid mask (non-finite inputs), a count and a token share."""
    # valid is the mask itself when no token was taken out (the optimistic read)
    if b.valid is b.mask:
        nonfinite = torch.zeros_like(b.sample_mask[0])
    else:
        nonfinite = ((b.mask.sum(-1) - b.n_row) * b.row_on).sum()
    return {"nonfinite_tokens": nonfinite, "nonfinite_token_frac": nonfinite * b.inv_gvt}


def _granular_metrics(b, result, tok, seq, per_token_bounds: bool, with_bounds: bool = True) -> dict[str, torch.Tensor]:
    """Ours beside NeMo-RL's (``full``): clip fractions per token and per group, group counts and sizes,
    mean clip bounds (``with_bounds``), mean π_old entropy, non-finite tokens."""
    m = _clip_fractions(b, result, tok)
    sm = b.sample_mask
    ratios, terms, fraction_weights = result.ratios, result.terms, result.fraction_weights
    grouped = result.grouped  # clipped tokens counted per group: the same sums, per group
    row_tok = (sm * b.inv_gvt)[:, None]  # w_tok of a row's valid tokens
    if grouped:
        if fraction_weights is None:
            fraction_weights = aggregation_group_weights(
                "seq_mean_group_mean",
                sm,
                b.inv_gvt,
                b.inv_gvs,
                b.n_row,
                ratios.counts,
                ratios.n_groups_row,
                b.count_dtype,
            )
        m["clip_frac_low_groups"] = (terms.low * fraction_weights).sum()
        m["clip_frac_high_groups"] = (terms.high * fraction_weights).sum()
    else:
        if fraction_weights is None:
            fraction_weights = aggregation_weights(
                "seq_mean_group_mean",
                b.valid,
                sm,
                b.inv_gvt,
                b.inv_gvs,
                b.n_row,
                ratios.index,
                ratios.counts,
                ratios.n_groups_row,
                b.count_dtype,
            )
        fw = fraction_weights.reshape(-1)
        m["clip_frac_low_groups"] = torch.dot(terms.low.reshape(-1), fw)
        m["clip_frac_high_groups"] = torch.dot(terms.high.reshape(-1), fw)
    m["groups_per_response"] = seq(ratios.n_groups_row)
    m["group_size_mean"] = seq(b.n_row / ratios.n_groups_row.clamp(min=1))
    lo, hi = result.bounds
    if with_bounds and per_token_bounds:
        m["clip_bound_low_mean"], m["clip_bound_high_mean"] = tok(lo), tok(hi)
    elif with_bounds:
        lo_g, hi_g = result.group_bounds
        gw = ratios.counts * row_tok
        m["clip_bound_low_mean"] = (lo_g * gw).sum() if torch.is_tensor(lo_g) else gw.sum() * lo_g
        m["clip_bound_high_mean"] = (hi_g * gw).sum() if torch.is_tensor(hi_g) else gw.sum() * hi_g
    if b.ent is None:
        m["prev_entropy_mean"] = torch.zeros_like(sm[0])
    elif grouped and terms.entropy_sum is not None:
        m["prev_entropy_mean"] = (terms.entropy_sum * row_tok).sum()
    else:
        m["prev_entropy_mean"] = tok(b.ent)
    m.update(_nonfinite(b))
    return m


def _ratio_statistics(b, result, surrogate: str, tok) -> dict[str, torch.Tensor]:
    """probs_ratio(_clamped) means and extrema, clip_bound_{low,high}_mean. REINFORCE reports
    the logprob as its "ratio", as NeMo-RL's ``disable_ppo_ratio`` mode does."""
    ratios, terms = result.ratios, result.terms
    live = b.valid * b.row_on[:, None]
    lo, hi = result.bounds
    if surrogate == "reinforce":
        r_min, r_max = masked_extrema([b.logp], live)
        return {
            "probs_ratio": tok(b.logp),
            "probs_ratio_clamped": tok(b.logp),
            "probs_ratio_min": r_min,
            "probs_ratio_max": r_max,
            "probs_ratio_clamped_min": r_min,
            "probs_ratio_clamped_max": r_max,
            "clip_bound_low_mean": tok(lo),
            "clip_bound_high_mean": tok(hi),
        }
    if ratios.index is None:  # token granularity: per-token statistics
        ratio, clamped = ratios.ratio, terms.ratio_clamped
        if torch.is_tensor(lo) and lo.dim() > 0:
            r_min, r_max, rc_min, rc_max = masked_extrema([ratio, clamped], live)
        else:  # clamp is monotone: the extrema of the clamped ratios are the clamped extrema
            r_min, r_max = masked_extrema([ratio], live)
            rc_min = torch.where(torch.isinf(r_min), r_min, r_min.clamp(lo, hi))  # keep the ±inf sentinels
            rc_max = torch.where(torch.isinf(r_max), r_max, r_max.clamp(lo, hi))
        return {
            "probs_ratio": tok(ratio),
            "probs_ratio_clamped": tok(clamped),
            "probs_ratio_min": r_min,
            "probs_ratio_max": r_max,
            "probs_ratio_clamped_min": rc_min,
            "probs_ratio_clamped_max": rc_max,
            "clip_bound_low_mean": tok(lo),
            "clip_bound_high_mean": tok(hi),
        }
    # group table [B, G]: weight of a group = its token count
    lo_g, hi_g = result.group_bounds
    s, counts = ratios.group_ratio, ratios.counts
    gw = counts * (b.sample_mask * b.inv_gvt)[:, None]
    rc_g = torch.clamp(s, lo_g, hi_g)
    live_g = counts.clamp(max=1) * b.row_on[:, None]
    r_min, r_max, rc_min, rc_max = masked_extrema([s, rc_g], live_g)
    return {
        "probs_ratio": (s * gw).sum(),
        "probs_ratio_clamped": (rc_g * gw).sum(),
        "probs_ratio_min": r_min,
        "probs_ratio_max": r_max,
        "probs_ratio_clamped_min": rc_min,
        "probs_ratio_clamped_max": rc_max,
        "clip_bound_low_mean": (lo_g * gw).sum() if torch.is_tensor(lo_g) else gw.sum() * lo_g,
        "clip_bound_high_mean": (hi_g * gw).sum() if torch.is_tensor(hi_g) else gw.sum() * hi_g,
    }
