"""The policy objective of docs/algorithms/math.md §2–§5 in closed form, as the loss computes it.

One call of the loss goes: group ratios (§2) → per-token surrogate (§4) → aggregation weights
(§5) → objective Σ W·c and its gradient with respect to the logprobs, written out (the objective
is linear in the per-token surrogate, so d/dlogp is a product of known factors, handed to autograd
by :class:`~nemo_granular.core.linearized_loss.LinearizedLoss`). Inputs are 0/1 masks and values
already 0 outside the valid tokens, in the compute dtype (:mod:`nemo_granular.core.masks`);
``index`` is a :class:`~nemo_granular.core.group_index.GroupIndex`, ``None`` for token groups.
These are the functions the loss runs; the readable autograd forms of the same formulas, the
reference they are tested against, are :mod:`nemo_granular.core.reference_forms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .clipping import clip_terms
from .masks import indicator, row_constant

__all__ = [
    "COUNT_EPS",
    "count_eps_dtype",
    "plus_count_eps",
    "LOG_RATIO_BOUND",
    "GroupRatios",
    "group_ratios",
    "SurrogateTerms",
    "surrogate_terms",
    "aggregation_group_weights",
    "aggregation_weights",
    "objective_logp_grad",
    "GroupedClip",
    "CHECK_HERE",
    "grouped_clipped_objective",
    "ObjectiveResult",
    "PenalizedLoss",
]

# exp() is applied to log-ratios clamped to ±LOG_RATIO_BOUND (ratio ≤ 4.8e8): an extreme
# token then cannot turn a zero gradient into inf·0 = NaN. Exact below the bound (math.md, Notation).
LOG_RATIO_BOUND = 20.0

# grouped_clipped_objective's default: the response-level-advantage check is made inside
CHECK_HERE = object()

# Every mean over tokens divides by (count + COUNT_EPS), as NeMo-RL's ``masked_mean`` does, so
# float64 results equal NeMo-RL's ClippedPGLossFn on any batch size (math.md, Notation).
COUNT_EPS = 1e-8


def count_eps_dtype(count) -> torch.dtype:
    """The dtype NeMo-RL's ``masked_mean`` forms count + 1e-8 in: ``torch.result_type(count, 1e-8)`` —
    a floating count's (or mask's) own dtype, the default float dtype (float32) for an integer or bool
    one, float64 for a Python number. In float32 the 1e-8 vanishes for every count ≥ 1."""
    return torch.result_type(count, COUNT_EPS) if torch.is_tensor(count) else torch.float64


def plus_count_eps(counts: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """counts + 1e-8 formed in ``dtype`` (:func:`count_eps_dtype` of the mask the counts come from, as
    NeMo-RL's ``masked_mean`` forms torch.sum(mask) + 1e-8), returned in ``counts``' dtype; ``dtype``
    None: in ``counts``' own dtype."""
    if dtype is None or dtype == counts.dtype:
        return counts + COUNT_EPS
    return (counts.to(dtype) + COUNT_EPS).to(counts.dtype)


@dataclass
class GroupRatios:
    """r_it of docs/algorithms/math.md §2 and what its gradient needs."""

    log_ratio: torch.Tensor  # ℓ_it = logp − logq, [B, T]
    ratio: torch.Tensor  # value of r_it (s_g gathered to the group's tokens), [B, T]
    n_groups_row: torch.Tensor  # non-empty groups per row, [B]
    index: Any = None  # the GroupIndex; None: every token is its own group
    group_ratio: torch.Tensor | None = None  # s_g = exp(L_g), [B, G]
    counts: torch.Tensor | None = None  # |G_g| (valid tokens), [B, G]
    cap: torch.Tensor | None = None  # 1 (or True) where the clamp of L_g is inactive, [B, G]


def group_ratios(
    logp: torch.Tensor,
    logq: torch.Tensor,
    valid: torch.Tensor,
    index=None,
    n_row: torch.Tensor | None = None,
    count_dtype: torch.dtype | None = None,
) -> GroupRatios:
    """L_g = Σ_{t∈g} ℓ_t / (|g| + 1e-8), s_g = exp(L_g) and r_it = s_{g(i,t)} (docs/algorithms/math.md §2;
    GSPO eq. 6, SSPO eq. 9); token groups: r_it = exp(ℓ_it). One scatter for |g| and Σℓ together.
    |g| + 1e-8 is formed in ``count_dtype`` (:func:`plus_count_eps`)."""
    log_ratio = logp - logq
    if index is not None:
        log_ratio.mul_(valid)  # group sums: only valid tokens (values may be unmasked)
    if index is None:
        n = valid.sum(-1) if n_row is None else n_row
        return GroupRatios(log_ratio, torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND)), n)
    counts, group_lr = index.sum2(valid, log_ratio)
    group_lr = group_lr / plus_count_eps(counts, count_dtype)
    cap = indicator(torch.le, group_lr, LOG_RATIO_BOUND, group_lr)  # d clamp / d x
    s = torch.exp(group_lr.clamp(max=LOG_RATIO_BOUND))
    return GroupRatios(log_ratio, index.gather(s), counts.clamp(max=1).sum(-1), index, s, counts, cap)


@dataclass
class SurrogateTerms:
    """Per-token surrogate c_it (docs/algorithms/math.md §4) and its slope."""

    value: torch.Tensor  # c_it
    ratio_clamped: torch.Tensor  # clip(r, lo, hi); REINFORCE: logp (what NeMo-RL reports as the ratio)
    low: torch.Tensor  # 0/1: clipped low (clipped: gradient removed; CISPO: weight truncated)
    high: torch.Tensor  # 0/1: clipped high
    slope: torch.Tensor  # dc/dr when ``through_ratio``, else dc/dlogp
    through_ratio: bool


def surrogate_terms(
    kind: str, ratio, logp: torch.Tensor, adv: torch.Tensor, lo, hi, dual_clip: float | None = None, ratio_clamped=None
) -> SurrogateTerms:
    """c_it for ``kind`` (docs/algorithms/math.md §4):

    * ``clipped`` (PPO): c = min(r·A, clip(r, lo, hi)·A) (+ dual clip), dc/dr = A where no clip acts;
    * ``cispo`` (CISPO): c = sg[clip(r, lo, hi)]·A·logp, dc/dlogp = clip(r, lo, hi)·A;
    * ``reinforce``: c = A·logp (+ dual clip, as NeMo-RL applies it), dc/dlogp = A where it does not act.

    ``ratio``/``lo``/``hi`` may be ``[B, T]``, ``[B, 1]`` or numbers; ``logp``, ``adv`` are ``[B, T]``;
    ``ratio_clamped``: clip(r, lo, hi) per token when the caller has it (clipped surrogate only).
    """
    if kind == "clipped":
        c, rc, low, high, keep = clip_terms(ratio, adv, lo, hi, dual_clip, ratio_clamped)
        return SurrogateTerms(c, rc, low, high, keep.mul_(adv), True)
    if kind == "cispo":
        rc = torch.clamp(ratio, lo, hi)
        weight = rc * adv
        r = ratio.expand_as(adv)  # [B, 1] sequence ratios: full-shape clip indicators
        return SurrogateTerms(
            weight * logp, rc, indicator(torch.lt, r, lo, adv), indicator(torch.gt, r, hi, adv), weight, False
        )
    if kind != "reinforce":
        raise ValueError(f"unknown surrogate {kind!r}")
    c, slope = adv * logp, adv
    if dual_clip is not None:  # max(c, C·A) where A < 0: inactive for logp <= 0, kept for NeMo-RL's value
        held = indicator(torch.lt, adv, 0, adv).mul_(indicator(torch.gt, adv * dual_clip, c, adv))
        c = c + held * (adv * dual_clip - c)
        slope = adv * (1 - held)
    zero = torch.zeros_like(adv)
    return SurrogateTerms(c, logp, zero, zero, slope, False)


def aggregation_group_weights(
    kind: str,
    sample_mask: torch.Tensor,
    inv_gvt,
    inv_gvs,
    n_row: torch.Tensor,
    counts: torch.Tensor | None = None,
    n_groups_row: torch.Tensor | None = None,
    count_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ω with W_it = valid_it·ω_{i,g(i,t)} (docs/algorithms/math.md §5): one value per row ``[B, 1]``
    — token_mean: sample_mask/gvt; seq_mean_token_mean: sample_mask/(n_i·gvs) — or per group
    ``[B, G]`` — seq_mean_group_mean: sample_mask/(G_i·|g|·gvs) (``counts`` None: token groups,
    where it is the per-row one). Token counts are taken + 1e-8 as in :func:`aggregation_weights`."""
    if kind == "token_mean":
        return (sample_mask * inv_gvt)[:, None]
    if kind == "seq_mean_token_mean" or counts is None:
        return (sample_mask * inv_gvs / plus_count_eps(n_row, count_dtype))[:, None]
    if kind != "seq_mean_group_mean":
        raise ValueError(f"unknown aggregation {kind!r}")
    return (sample_mask * inv_gvs / n_groups_row.clamp(min=1))[:, None] / plus_count_eps(counts, count_dtype)


def aggregation_weights(
    kind: str,
    valid: torch.Tensor,
    sample_mask: torch.Tensor,
    inv_gvt,
    inv_gvs,
    n_row: torch.Tensor,
    index=None,
    counts: torch.Tensor | None = None,
    n_groups_row: torch.Tensor | None = None,
    count_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W_it with objective = Σ_it W_it·c_it (docs/algorithms/math.md §5, global denominators):

    token_mean: m/gvt; seq_mean_token_mean: m/(n_i·gvs); seq_mean_group_mean: m/(G_i·|g|·gvs),
    m = valid·sample_mask, where every token count (n_i, |g|, and the global counts behind
    ``inv_gvt``/``inv_gvs``) is taken + 1e-8 as NeMo-RL's ``masked_mean`` does, in the dtype it
    does (``count_dtype`` for n_i and |g|, :func:`plus_count_eps`); G_i is exact.
    With token groups the two per-sequence means coincide.
    """
    per_group = index is not None and kind == "seq_mean_group_mean"
    omega = aggregation_group_weights(
        kind, sample_mask, inv_gvt, inv_gvs, n_row, counts if per_group else None, n_groups_row, count_dtype
    )
    return valid * (index.gather(omega) if per_group else omega)


def objective_logp_grad(
    weights: torch.Tensor,
    terms: SurrogateTerms,
    ratios: GroupRatios,
    form: str,
    valid: torch.Tensor,
    count_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """d(Σ W·c)/d logp (docs/algorithms/math.md §2 for the ratio's part): W·dc/dlogp directly for
    CISPO/REINFORCE; otherwise W·dc/dr times dr/dlogp — token: r (0 where ℓ is clamped);
    ``token_decomposed``: s_g; ``shared``: s_g/(|g| + 1e-8) summed over the group's tokens (|g| + 1e-8
    in ``count_dtype``, as in :func:`group_ratios`)."""
    grad = weights * terms.slope
    if not terms.through_ratio:
        return grad
    if ratios.index is None:
        lr = ratios.log_ratio
        return grad.mul_(ratios.ratio).mul_(indicator(torch.le, lr, LOG_RATIO_BOUND, lr))
    if form == "token_decomposed":  # sg[s_g]·exp(logp − sg[logp]): d/dlogp_t = s_g
        return grad.mul_(ratios.ratio)
    idx = ratios.index  # shared: r = exp(L_g), d/dlogp_u = s_g/|g| for every u in g
    slope = ratios.group_ratio * ratios.cap / plus_count_eps(ratios.counts, count_dtype)
    return idx.gather(slope * idx.sum(grad)) * valid


@dataclass
class GroupedClip:
    """The clipped surrogate on a group plan, per group (:func:`grouped_clipped_objective`): what
    the metrics read in place of per-token terms."""

    ratio_clamped: torch.Tensor  # ĉ_g = clip(s_g, lo_g, hi_g), [B, G]
    low: torch.Tensor  # Σ_{t∈g} [A_t < 0] where s_g < ĉ_g (tokens clipped low), [B, G]
    high: torch.Tensor  # Σ_{t∈g} [A_t > 0] where s_g > ĉ_g (tokens clipped high), [B, G]
    entropy_sum: torch.Tensor | None  # Σ_{t∈g} H_t (None without an entropy), [B, G]
    probe: torch.Tensor  # Σ of every channel over every slot: non-finite iff an input is


def grouped_clipped_objective(
    logp: torch.Tensor,
    logq: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    ent: torch.Tensor | None,
    index,
    form: str,
    bounds,
    aggregation: str,
    sample_mask: torch.Tensor,
    inv_gvt,
    inv_gvs,
    count_dtype: torch.dtype | None = None,
    row_adv=CHECK_HERE,
):
    """Σ_it W_it·c_it of the clipped surrogate and its gradient, for group ratios r_it = s_g and
    weights W_it = valid_it·ω_g (every group granularity and aggregation, docs/algorithms/math.md
    §2–§5), written per group. With A⁺ = max(A, 0), A⁻ = min(A, 0) and ĉ_g = clip(s_g, lo_g, hi_g):

        c_it = min(s_g·A_it, ĉ_g·A_it) = A⁺_it·min(s_g, ĉ_g) + A⁻_it·max(s_g, ĉ_g)
        Σ_it W_it·c_it = Σ_g ω_g·(min(s_g, ĉ_g)·ΣA⁺_g + max(s_g, ĉ_g)·ΣA⁻_g)
        dc/dr = A⁺·k⁺_g + A⁻·k⁻_g,  k⁺_g = [s_g ≤ ĉ_g] (not clipped high), k⁻_g = [s_g ≥ ĉ_g] (not clipped low)
        shared (r = exp(L_g)):            ∂/∂logp_u = s_g·cap_g/(|g| + 1e-8)·ω_g·(k⁺_g·ΣA⁺_g + k⁻_g·ΣA⁻_g), u ∈ g
        token_decomposed (sg[s_g]·e^{logp−sg[logp]}): ∂/∂logp_t = ω_g·s_g·(k⁺_g·A⁺_t + k⁻_g·A⁻_t)

    with L_g = Σ_{t∈g} ℓ_t/(|g| + 1e-8) as in :func:`group_ratios` (+ 1e-8 in ``count_dtype``). Segmented
    sums of the channels ℓ, H (and, unless A is constant over each response's valid tokens, A⁺, A⁻, [A > 0],
    [A < 0]) give every group quantity; one gather (two for token_decomposed with per-token A) takes the
    gradient back to the tokens. With one A_i per response (the usual case) the sums are A_i·|g| and the
    above is Σ_g ω_g·|g|·min(s_g·A_i, ĉ_g·A_i), with dc/dr = A_i·k_g, k_g = k⁺_g if A_i > 0 else k⁻_g.
    ``index``: a plan whose members are the valid tokens (``index.sums``, ``index.counts``); values need not
    be 0 outside them. ``bounds``: (lo, hi) numbers, or a function of the group mean entropy
    H̄_g = ΣH/max(|g|, 1) giving (lo_g, hi_g).
    ``row_adv``: :func:`~nemo_granular.core.masks.row_constant` of (adv, valid) when the caller has made
    the check (its host sync) already, as before a compiled objective; by default it is made here.
    Returns (objective, gradient, :class:`GroupRatios` without per-token values, (lo, hi),
    :class:`GroupedClip`, ω).
    """
    log_ratio = logp - logq
    with_ent = ent is not None and callable(bounds)
    table = index.sums([log_ratio, ent] if with_ent else [log_ratio])
    # a response-level advantage (the usual case): its group sums are A_i·|g| (ℓ's buffer is free now)
    if row_adv is CHECK_HERE:
        row_adv = row_constant(adv, valid, scratch=log_ratio if log_ratio.dtype == adv.dtype else None)
    sums = table[:, 1:]
    counts = index.counts(sums.dtype)
    if row_adv is None:
        adv_pos = adv.clamp(min=0)
        adv_neg = adv - adv_pos  # exact: A or 0
        adv_table = index.sums([adv_pos, adv_neg, indicator(torch.gt, adv, 0, adv), indicator(torch.lt, adv, 0, adv)])
        probe = table.sum() + adv_table.sum()
        sum_pos, sum_neg, n_pos, n_neg = adv_table[:, 1:].unbind(-1)
    else:
        probe = table.sum() + row_adv.sum()
        a = row_adv[:, None]
    counts_eps = plus_count_eps(counts, count_dtype)
    group_lr = sums[..., 0] / counts_eps
    cap = group_lr <= LOG_RATIO_BOUND  # d clamp / d x (a [B, G] table: a bool multiplies as 0/1)
    s = torch.exp(group_lr.clamp(max=LOG_RATIO_BOUND))
    n_groups_row = counts.clamp(max=1).sum(-1)
    ent_sum = sums[..., 1] if with_ent else None
    if callable(bounds):
        bounds = bounds(ent_sum / counts.clamp(min=1))
    rc = torch.clamp(s, *bounds)
    omega = aggregation_group_weights(
        aggregation, sample_mask, inv_gvt, inv_gvs, counts.sum(-1), counts, n_groups_row, count_dtype
    )
    if row_adv is None:
        keep_pos, keep_neg = indicator(torch.le, s, rc, s), indicator(torch.ge, s, rc, s)
        objective = (omega * (torch.minimum(s, rc) * sum_pos + torch.maximum(s, rc) * sum_neg)).sum()
        if form == "token_decomposed":
            ws = omega * s
            grad = index.gather(ws * keep_pos).mul_(adv_pos).add_(index.gather(ws * keep_neg).mul_(adv_neg))
        else:
            grad = index.gather(s * cap / counts_eps * omega * (keep_pos * sum_pos + keep_neg * sum_neg))
        low, high = (1 - keep_neg) * n_neg, (1 - keep_pos) * n_pos
    else:
        # one A per row: Σ_{t∈g} c_t = |g|·min(s_g·A, ĉ_g·A) (a product with A keeps or flips the order
        # exactly), and dc/dr = A where the unclipped side is the min: k_g = [s_g ≤ ĉ_g] for A > 0,
        # [s_g ≥ ĉ_g] for A < 0 (A = 0: no term, no clip counted)
        pos = a > 0
        sa = s * a
        keep = torch.where(pos, s <= rc, s >= rc)
        weight = omega * counts
        objective = (weight * torch.minimum(sa, rc * a)).sum()
        if form == "token_decomposed":
            grad = index.gather(omega * sa * keep)
        else:
            grad = index.gather(sa * keep * cap * weight / counts_eps)
        clipped = counts * ~keep
        low, high = clipped * (a < 0), clipped * pos
    ratios = GroupRatios(None, None, n_groups_row, index, s, counts, cap)
    clip = GroupedClip(rc, low, high, ent_sum, probe)
    return objective, grad, ratios, bounds, clip, omega


@dataclass(frozen=True, slots=True)
class ObjectiveResult:
    """One evaluation of the objective J = Σ_it W_it·c_it (docs/algorithms/math.md §2–§5, the
    π_old/π_gen weight of §10 folded into W) and what the metrics read of it."""

    objective: torch.Tensor  # J, 0-d
    grad: torch.Tensor  # ∂J/∂logp, [B, T]
    ratios: GroupRatios
    terms: SurrogateTerms | GroupedClip  # per token, or per group (the grouped clipped surrogate)
    bounds: Any  # (lo, hi): per token, numbers, or (group path) the group tables
    group_bounds: Any  # (lo_g, hi_g) per group, numbers, or None (token groups)
    fraction_weights: torch.Tensor | None  # the per-group-mean weights when J was built with them, else None
    correction: Any = None  # the π_old/π_gen GenerationWeights (None: no correction)
    is_oob_ratio: torch.Tensor | None = None  # NeMo-RL's share of truncated weights (None: no truncation)

    @property
    def is_weight(self) -> torch.Tensor | None:
        """The π_old/π_gen weight per token (after truncation), or None."""
        return None if self.correction is None else self.correction.weight

    @property
    def grouped(self) -> bool:
        """J was computed per group (:func:`grouped_clipped_objective`): ``terms`` is a :class:`GroupedClip`."""
        return isinstance(self.terms, GroupedClip)


@dataclass(frozen=True, slots=True)
class PenalizedLoss:
    """loss = −J + β·KL + w·NLL (NeMo-RL's loss with its two penalties) and the penalties, 0-d each."""

    loss: torch.Tensor
    kl: torch.Tensor  # β·KL, aggregated like NeMo-RL's loss type
    nll: torch.Tensor  # the NLL on correct responses (unweighted)
