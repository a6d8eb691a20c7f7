"""The readable forms of docs/algorithms/math.md §2, §4 and §5: autograd tensor functions, one per formula.

**The loss does not run these.** It runs the closed forms — :mod:`~nemo_granular.core.objective`
(ratios, surrogate slopes, aggregation weights and the gradient written out), on the group indexes of
:mod:`~nemo_granular.core.group_index` and the clip terms of :mod:`~nemo_granular.core.clipping`.
These are the reference those are tested against (``tests/test_core_*.py``: each of these against
the naive float64 reference ``tests/harness/reference.py``, and the closed forms against these or
that): written as the papers write them, with autograd giving every gradient.

* §2 group reductions and ratios: :func:`group_sum`, :func:`group_count`, :func:`group_mean`,
  :func:`gather_groups`, :func:`group_log_ratio`, :func:`shared_ratio`, :func:`token_decomposed_ratio`;
* §3/§4 fixed bounds and the surrogates: :func:`fixed_clip_bounds`, :func:`clipped_surrogate`,
  :func:`cispo_surrogate`, :func:`reinforce_surrogate`;
* §5 the aggregations, each a partial sum normalised by a global count (NeMo-RL style: summing the
  results of every microbatch gives the mean over the global batch; rows with ``sample_mask = 0``
  contribute nothing): :func:`token_mean`, :func:`seq_mean_token_mean`, :func:`seq_mean_group_mean`.
"""

from __future__ import annotations

import torch

from .masks import safe_divide
from .scatter_index import ScatterIndex

__all__ = [
    "group_sum",
    "group_count",
    "group_mean",
    "gather_groups",
    "group_log_ratio",
    "shared_ratio",
    "token_decomposed_ratio",
    "fixed_clip_bounds",
    "clipped_surrogate",
    "cispo_surrogate",
    "reinforce_surrogate",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_group_mean",
]


# ---------------------------------------------------------------- §2 group reductions and ratios
def group_sum(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Σ of ``values`` over the tokens of each group: ``[B, T] -> [B, num_groups]``.

    Tokens with id -1 are ignored (their value may be anything finite).
    """
    return ScatterIndex(group_ids, num_groups).sum(values)


def group_count(group_ids: torch.Tensor, num_groups: int, dtype=torch.float32) -> torch.Tensor:
    """|G_ig|: number of tokens in each group, ``[B, num_groups]``."""
    return group_sum((group_ids >= 0).to(dtype), group_ids, num_groups)


def group_mean(
    values: torch.Tensor, group_ids: torch.Tensor, num_groups: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of ``values`` over each group (0 for an empty group)."""
    if counts is None:
        counts = group_count(group_ids, num_groups, values.dtype)
    return group_sum(values, group_ids, num_groups) / counts.clamp(min=1)


def gather_groups(per_group: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Broadcast ``[B, G]`` per-group values to ``[B, T]`` tokens (0 outside any group)."""
    return ScatterIndex(group_ids, per_group.shape[1]).gather(per_group)


def group_log_ratio(
    log_ratio: torch.Tensor, group_ids: torch.Tensor, num_groups: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """L_ig = mean over tokens t of group g of ℓ_it (docs/algorithms/math.md §2; GSPO eq. 6, SSPO eq. 9)."""
    return group_mean(log_ratio, group_ids, num_groups, counts)


def shared_ratio(group_log_ratio_: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """`shared` ratio (GSPO eq. 6, SSPO eq. 9): r_it = exp(L_{i,g(i,t)}).

    Differentiated through the group mean, so each token of group g receives gradient
    s_ig · A / |G_ig| · ∇logp_it.
    """
    return torch.exp(gather_groups(group_log_ratio_, group_ids))


def token_decomposed_ratio(group_log_ratio_: torch.Tensor, group_ids: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """`token_decomposed` ratio (GSPO-token eq. 13; ESPO §3.3): r_it = sg[s_ig]·exp(logp_it − sg[logp_it]).

    Its value is s_ig; its gradient flows through token t's own logprob only, scaled by s_ig.
    """
    s = torch.exp(gather_groups(group_log_ratio_, group_ids)).detach()
    return s * torch.exp(logp - logp.detach())


# ---------------------------------------------------------------- §3, §4 fixed bounds and the surrogates
def fixed_clip_bounds(like: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`fixed` bounds (docs/algorithms/math.md §3): lo = 1 − ε_low, hi = 1 + ε_high, broadcast to ``like``."""
    lo = torch.full_like(like, 1.0 - eps_low, dtype=torch.float32)
    hi = torch.full_like(like, 1.0 + eps_high, dtype=torch.float32)
    return lo, hi


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    lo: torch.Tensor | float,
    hi: torch.Tensor | float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (PPO; docs/algorithms/math.md §4), to be maximised:

    c = min(r·A, clip(r, lo, hi)·A); with dual clip C > 1 and A < 0: c = max(c, C·A).

    Returns ``(c, clipped_low, clipped_high)``: a token is clipped low when A < 0 and r < lo,
    high when A > 0 and r > hi — exactly the tokens whose gradient the min removes.
    """
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, lo, hi) * advantages  # lo/hi: tensors or numbers
    c = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        c = torch.where(advantages < 0, torch.maximum(c, dual_clip * advantages), c)
    r = ratio.detach()
    clipped_low = (advantages < 0) & (r < lo)
    clipped_high = (advantages > 0) & (r > hi)
    return c, clipped_low, clipped_high


def cispo_surrogate(
    ratio: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    lo: torch.Tensor | float,
    hi: torch.Tensor | float,
) -> torch.Tensor:
    """CISPO surrogate (MiniMax-M1 §3.1; docs/algorithms/math.md §4), to be maximised:

    c = sg[clip(r, lo, hi)] · A · logp.

    The clipped ratio is only a weight: every token keeps its gradient clip(r)·A·∇logp (PPO's
    min drops it where r leaves [lo, hi] in the direction of A). ``r`` is the token's granular
    ratio (its group's s_g), so the weight is clipped per group.
    """
    return torch.clamp(ratio, lo, hi).detach() * advantages * logp


def reinforce_surrogate(logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE surrogate (docs/algorithms/math.md §4; NeMo-RL's ``disable_ppo_ratio``): c = A · logp.

    No ratio: the gradient is A·∇logp whatever the groups; the granularity acts only through the
    aggregation (§5) and the off-policy weights.
    """
    return advantages * logp


# ---------------------------------------------------------------- §5 aggregations
def token_mean(values: torch.Tensor, mask: torch.Tensor, global_valid_toks) -> torch.Tensor:
    """`token_mean` (GRPO/DAPO; NeMo-RL TOKEN_LEVEL): Σ m·c / Σ m over the global batch."""
    return safe_divide(torch.where(mask, values, 0.0).sum(), global_valid_toks)


def _row_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum(-1).to(values.dtype)
    return torch.where(mask, values, 0.0).sum(-1) / n.clamp(min=1)


def seq_mean_token_mean(
    values: torch.Tensor, mask: torch.Tensor, sample_mask: torch.Tensor, global_valid_seqs
) -> torch.Tensor:
    """`seq_mean_token_mean` (GSPO eq. 4, SSPO eq. 16; NeMo-RL SEQUENCE_LEVEL).

    Mean over responses of the token mean inside each response.
    """
    return safe_divide((_row_token_mean(values, mask) * sample_mask).sum(), global_valid_seqs)


def seq_mean_group_mean(
    values: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int,
    sample_mask: torch.Tensor,
    global_valid_seqs,
) -> torch.Tensor:
    """`seq_mean_group_mean` (ESPO §3.2): mean over responses of the mean over its non-empty
    groups of the token mean inside each group. Every group weighs the same."""
    counts = group_count(group_ids, num_groups, values.dtype)
    sums = group_sum(torch.where(group_ids >= 0, values, 0.0), group_ids, num_groups)
    present = counts > 0
    per_group = sums / counts.clamp(min=1)
    n_groups = present.sum(-1).to(values.dtype)
    per_row = torch.where(present, per_group, 0.0).sum(-1) / n_groups.clamp(min=1)
    return safe_divide((per_row * sample_mask).sum(), global_valid_seqs)
