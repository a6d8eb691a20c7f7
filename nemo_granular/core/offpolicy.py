"""Off-policy corrections of the policy loss: the π_old/π_gen importance weight at a chosen level
(docs/algorithms/math.md §10), NeMo-RL's truncations of it (tis, icepop, seq-mask-tis) applied to
the ratio's groups, the mismatch diagnostics, and the KL penalty to a reference policy.

Inputs are 0 outside the valid tokens. ``index`` is a :class:`~nemo_granular.core.group_index.GroupIndex`
or ``None`` for token groups; no function loops over groups or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .objective import LOG_RATIO_BOUND, plus_count_eps

__all__ = [
    "IS_LEVELS",
    "TRUNCATIONS",
    "GenerationWeights",
    "importance_weights",
    "truncate_importance_weights",
    "generation_weights",
    "mismatch_sums",
    "mismatch_extrema",
    "batch_mismatch_extrema",
    "high_entropy_tokens",
    "kl_penalty_per_token",
]

IS_LEVELS = ("token", "group_sum", "group_mean")
TRUNCATIONS = ("tis", "icepop", "seq-mask-tis")


def _exp_weight(log_w: torch.Tensor) -> torch.Tensor:
    """exp(min(log w, LOG_RATIO_BOUND)), NaN/inf → 0 (NeMo-RL's nan_to_num)."""
    return torch.nan_to_num(torch.exp(log_w.clamp(max=LOG_RATIO_BOUND)), nan=0.0, posinf=0.0, neginf=0.0)


def importance_weights(
    logq: torch.Tensor,
    log_gen: torch.Tensor,
    index=None,
    level: str = "group_sum",
    counts: torch.Tensor | None = None,
    count_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """w = π_old/π_gen (detached inputs) at ``level`` (math.md §10, eq. 10.1), with δ = logq − log π_gen:

    * ``token`` (or ``index`` None): w_t = exp(δ_t);
    * ``group_sum``: w_g = exp(Σ_{t∈g} δ_t) — NeMo-RL's convention for a whole response;
    * ``group_mean``: w_g = exp(Σ_{t∈g} δ_t / (|g| + 1e-8)), the geometric mean, as the granular
      ratio (the + 1e-8 of NeMo-RL's ``masked_mean``, as every token mean here, formed in
      ``count_dtype``: :func:`~nemo_granular.core.objective.plus_count_eps`).

    Group weights are gathered to their tokens (``RowIndex``: ``[B, 1]``). ``counts`` = |g| (valid
    tokens per group, needed by ``group_mean``). The exponent is clamped at LOG_RATIO_BOUND;
    NaN/inf weights become 0, as in NeMo-RL.
    """
    diff = logq - log_gen
    if index is None or level == "token":
        return _exp_weight(diff)
    log_w = index.sum(diff)
    if level == "group_mean":
        log_w = log_w / plus_count_eps(counts, count_dtype)
    elif level != "group_sum":
        raise ValueError(f"loss_fn.granular.is_level: unknown value {level!r}")
    return index.gather(_exp_weight(log_w))


def truncate_importance_weights(
    weights: torch.Tensor,
    kind: str | None,
    ratio_max: float | None,
    ratio_min: float | None,
    unit_log_ratio_mean: torch.Tensor | None = None,
):
    """NeMo-RL's truncated importance sampling of ``weights`` → ``(weights, out_of_bounds)``
    (math.md §10, eq. 10.2), elementwise on whatever unit ``weights`` holds (token or group):

    * ``tis``: clamp to [min (0 when null), max]; out of bounds per weight;
    * ``icepop``: zero the weights outside [min, max];
    * ``seq-mask-tis``: zero every mask unit (a row in NeMo-RL; the ratio's group here) whose
      geometric-mean ratio exp(``unit_log_ratio_mean``) is outside [min, max] (out of bounds per
      unit); ``unit_log_ratio_mean`` must broadcast against ``weights``; other weights untruncated.

    ``kind`` None: no truncation, ``out_of_bounds`` None.
    """
    if kind is None:
        return weights, None
    if kind == "tis":
        lo = 0.0 if ratio_min is None else ratio_min
        oob = ((weights > ratio_max) | (weights < lo)).to(weights.dtype)
        return weights.clamp(lo, ratio_max), oob
    if kind == "icepop":
        keep = ((weights >= ratio_min) & (weights <= ratio_max)).to(weights.dtype)
        return weights * keep, 1 - keep
    if kind == "seq-mask-tis":
        geo = torch.exp(unit_log_ratio_mean)
        keep = ((geo >= ratio_min) & (geo <= ratio_max)).to(weights.dtype)
        return weights * keep, 1 - keep
    raise ValueError(f"loss_fn.truncated_importance_sampling_type: unknown value {kind!r}")


@dataclass
class GenerationWeights:
    """The π_old/π_gen correction of one loss call (math.md §10)."""

    weight: torch.Tensor  # per token, after truncation ([B, T], or [B, 1] for one group per row)
    oob_token: torch.Tensor | None  # 0/1 per token: its weight was truncated or masked (None: no truncation)
    oob_unit: torch.Tensor | None  # 0/1 per truncation unit [B, U]: token, group, or (seq-mask-tis) mask unit
    unit_counts: torch.Tensor | None  # valid tokens per unit [B, U] (None when the units are tokens)


def generation_weights(
    logq: torch.Tensor,
    log_gen: torch.Tensor,
    valid: torch.Tensor,
    *,
    level: str,
    index=None,
    counts: torch.Tensor | None = None,
    kind: str | None = None,
    ratio_max: float | None = None,
    ratio_min: float | None = None,
    mask_index=None,
    mask_counts: torch.Tensor | None = None,
    count_dtype: torch.dtype | None = None,
) -> GenerationWeights:
    """Weights at ``level`` (eq. 10.1) truncated by ``kind`` (eq. 10.2) on the ratio's groups.

    ``index``/``counts``: the ratio's groups (None: token groups). tis and icepop act on the
    weights' own unit (a token for ``token``, a group otherwise). seq-mask-tis masks the units of
    ``mask_index``/``mask_counts`` (the ratio's groups; a whole row for token groups, NeMo-RL's
    case) by their geometric mean exp(mean δ), and keeps the level's weights of the others.
    Every token count is taken + 1e-8 in ``count_dtype`` (:func:`~nemo_granular.core.objective.plus_count_eps`).
    """
    grouped = index is not None and level != "token"
    diff = logq - log_gen
    if grouped:
        log_w = index.sum(diff)
        if level == "group_mean":
            log_w = log_w / plus_count_eps(counts, count_dtype)
        elif level != "group_sum":
            raise ValueError(f"loss_fn.granular.is_level: unknown value {level!r}")
        w_unit = _exp_weight(log_w)
    else:
        w_unit = _exp_weight(diff)
    if kind is None:
        return GenerationWeights(index.gather(w_unit) if grouped else w_unit, None, None, None)
    if kind == "seq-mask-tis":
        unit_mean = mask_index.sum(diff) / plus_count_eps(mask_counts, count_dtype)
        keep_unit = 1 - truncate_importance_weights(unit_mean, kind, ratio_max, ratio_min, unit_mean)[1]
        keep_tok = mask_index.gather(keep_unit)
        w = (index.gather(w_unit) if grouped else w_unit) * keep_tok
        return GenerationWeights(w, (1 - keep_tok) * valid, 1 - keep_unit, mask_counts)
    w_unit, oob_unit = truncate_importance_weights(w_unit, kind, ratio_max, ratio_min)
    if grouped:
        return GenerationWeights(index.gather(w_unit), index.gather(oob_unit) * valid, oob_unit, counts)
    return GenerationWeights(w_unit, oob_unit * valid, oob_unit * valid, None)


def high_entropy_tokens(entropy: torch.Tensor, valid: torch.Tensor, top_fraction: float) -> torch.Tensor:
    """0/1 per token: among the top ⌈f·n_i⌉ π_old entropies of its row (ESPO's high-entropy group,
    math.md §1; ties by position). One sort per call."""
    from .groups import entropy_group_ids

    ids = entropy_group_ids(entropy, valid > 0, top_fraction)
    return (ids == 0).to(valid.dtype)


def mismatch_sums(
    logq: torch.Tensor,
    log_gen: torch.Tensor,
    valid: torch.Tensor,
    w_tok: torch.Tensor,
    w_row: torch.Tensor,
    *,
    index=None,
    counts: torch.Tensor | None = None,
    n_groups_row: torch.Tensor | None = None,
    correction: GenerationWeights | None = None,
    gen_kl_k3: torch.Tensor | None = None,
    count_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Mismatch diagnostics as global-normalised partial sums (math.md §10.3), δ = logq − log π_gen:

    * ``gen_mismatch_abs_mean`` = Σ_t w_tok·|δ_t| (TOKENS);
    * ``gen_kl_k3`` = Σ_t w_tok·(e^δ − 1 − δ), k3 of KL(π_gen‖π_old) (TOKENS);
    * ``gen_mismatch_group_abs_mean`` = Σ_i w_row·mean_{g∈i} |mean_{t∈g} δ_t| (SEQUENCES): the
      group's log geometric-mean weight, averaged over the row's groups;
    * with a truncation: ``is_oob_token_frac`` (TOKENS) and ``is_oob_group_frac`` (SEQUENCES, per
      row the share of the ratio's groups with a truncated or masked weight).

    ``w_tok`` = valid·sample_mask/gvt ``[B, T]``, ``w_row`` = sample_mask/gvs ``[B]``; ``index`` /
    ``counts`` / ``n_groups_row`` the ratio's groups (None: token groups). ``gen_kl_k3``: that sum
    when the caller has it (NeMo-RL's ``gen_kl_error`` at ``reference_policy_kl_type: k3`` is it).
    Token counts are taken + 1e-8 in ``count_dtype`` (:func:`~nemo_granular.core.objective.plus_count_eps`).
    """
    d = (logq - log_gen).mul_(valid)  # the values may be unmasked (the loss's optimistic read)
    ad = d.abs()
    w_flat = w_tok.reshape(-1)
    out = {
        "gen_mismatch_abs_mean": torch.dot(ad.reshape(-1), w_flat),
        "gen_kl_k3": torch.dot((torch.expm1(d) - d).reshape(-1), w_flat) if gen_kl_k3 is None else gen_kl_k3,
    }
    n_row = valid.sum(-1)
    if index is None:
        per_row = ad.sum(-1) / plus_count_eps(n_row, count_dtype)
    else:
        group_abs = (index.sum(d) / plus_count_eps(counts, count_dtype)).abs() * counts.clamp(max=1)
        per_row = group_abs.sum(-1) / n_groups_row.clamp(min=1)
    out["gen_mismatch_group_abs_mean"] = (per_row * w_row).sum()
    if correction is not None and correction.oob_token is not None:
        out["is_oob_token_frac"] = (correction.oob_token * w_tok).sum()
        touched = correction.oob_token * valid
        if index is None:
            share = touched.sum(-1) / n_row.clamp(min=1)  # a share of groups (tokens here): exact count
        else:
            share = (index.sum(touched) > 0).to(d.dtype).sum(-1) / n_groups_row.clamp(min=1)
        out["is_oob_group_frac"] = (share * w_row).sum()
    return out


def mismatch_extrema(
    logq: torch.Tensor,
    log_gen: torch.Tensor,
    valid: torch.Tensor,
    group_ids=None,
    entropy: torch.Tensor | None = None,
    top_fraction: float = 0.2,
) -> dict[str, float]:
    """Whole-batch mismatch statistics (math.md §10.3), δ = logq − log π_gen over the ``valid`` tokens:

    * ``gen_mismatch_token_abs_max`` = max_t |δ_t|; ``gen_mismatch_group_abs_max`` = max_g |mean_{t∈g} δ_t|
      (``group_ids`` per-row local ids, −1 outside; None: token groups);
    * with ``entropy`` (π_old): ``gen_mismatch_abs_mean_high_entropy`` / ``_low_entropy`` = mean |δ|
      over the batch's high-entropy tokens (the top ⌈f·n_i⌉ π_old entropies of each response, ESPO's
      split, :func:`high_entropy_tokens`) / over the others.

    A maximum does not add over microbatches and the split needs a sort, so the trainers compute
    these once per step on the whole batch (0 where a set is empty)."""
    from .scatter_index import ScatterIndex

    d = ((logq - log_gen) * valid).abs()
    out = {"gen_mismatch_token_abs_max": float(d.amax()) if d.numel() else 0.0}
    if group_ids is None:
        out["gen_mismatch_group_abs_max"] = out["gen_mismatch_token_abs_max"]
    else:
        ids = torch.where(valid > 0, group_ids.long(), -1)
        G = int(ids.max()) + 1 if ids.numel() else 0
        if G <= 0:
            out["gen_mismatch_group_abs_max"] = 0.0
        else:
            idx = ScatterIndex.from_ids(ids, G)
            n = idx.sum(valid.to(d.dtype))
            g = (idx.sum((logq - log_gen) * valid) / n.clamp(min=1)).abs() * n.clamp(max=1)
            out["gen_mismatch_group_abs_max"] = float(g.amax())
    if entropy is not None:
        high = high_entropy_tokens(torch.where(valid > 0, entropy, 0.0), valid, top_fraction)
        low = valid - high
        out["gen_mismatch_abs_mean_high_entropy"] = float((d * high).sum() / high.sum().clamp(min=1))
        out["gen_mismatch_abs_mean_low_entropy"] = float((d * low).sum() / low.sum().clamp(min=1))
    return out


def batch_mismatch_extrema(data, granularity: str, top_fraction: float = 0.2) -> dict[str, float]:
    """:func:`mismatch_extrema` of a NeMo-RL training batch (``[B, S]`` keys, same columns): the
    ratio's groups from ``granular_group_ids``, whole responses for ``sequence``, tokens otherwise;
    the entropy split when the batch carries ``prev_entropy``; {} without ``generation_logprobs``."""
    if "generation_logprobs" not in data:
        return {}
    valid = data["token_mask"].double() * data["sample_mask"].double().reshape(-1, 1)
    ids = data["granular_group_ids"] if "granular_group_ids" in data else None
    if ids is None and granularity == "sequence":
        ids = torch.where(valid > 0, 0, -1)
    ent = data["prev_entropy"].double() if "prev_entropy" in data else None
    return mismatch_extrema(
        data["prev_logprobs"].double(), data["generation_logprobs"].double(), valid, ids, ent, top_fraction
    )


def kl_penalty_per_token(logp, logp_ref, kl_type="k3", input_clamp=20.0, output_clamp=10.0, weights=None):
    """Per-token KL(π_θ‖π_ref) estimator k1/k2/k3 (Schulman 2020), as NeMo-RL's ``calculate_kl``.

    With ``logr = logp_ref − logp``: k1 = −logr, k2 = logr²/2, k3 = exp(logr) − 1 − logr;
    optional input/output clamping; ``weights`` multiply before the output clamp (detached
    where the input clamp is active).
    """
    logr = logp_ref - logp
    if input_clamp is not None:
        clamped = logr.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(logr == clamped, weights, weights.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type: unknown value {kl_type!r}")
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl
