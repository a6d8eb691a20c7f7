"""Clip bounds (docs/algorithms/math.md §3) and the clipped surrogate's terms (§4), as the loss runs them.

The bounds are per token or per group from the mean π_old entropy (``fixed`` bounds are two numbers
the loss passes as such); :func:`clip_terms` is the clipped surrogate with its derivative with
respect to the ratio in closed form, on 0/1 masks. The readable autograd forms of the surrogates
(``clipped_surrogate``, ``cispo_surrogate``, ``reinforce_surrogate``) are the reference they are
tested against: :mod:`nemo_granular.core.reference_forms`.
"""

from __future__ import annotations

import math

import torch

from .masks import indicator

__all__ = [
    "sspo_entropy_clip_bounds",
    "espo_entropy_clip_bounds",
    "calibrate_espo_alpha",
    "ESPO_AUTO_TARGET_EPS",
    "clip_terms",
]

# `espo.alpha: auto`: the mean ε of the first rollout is the middle of GSPO's 3e-4 / 4e-4 (math.md §3)
ESPO_AUTO_TARGET_EPS = 3.5e-4


def sspo_entropy_clip_bounds(
    group_entropy: torch.Tensor, alpha: float, beta: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sspo_entropy` bounds (SSPO eq. 13–15; docs/algorithms/math.md §3), per group from its mean entropy H̄:

    hi = min(1 + α + H̄, γ),   lo = max(0, min(1 − H̄, β)).
    """
    h = group_entropy.to(torch.promote_types(group_entropy.dtype, torch.float32))
    hi = torch.clamp(1.0 + alpha + h, max=gamma)
    lo = torch.clamp(1.0 - h, min=0.0, max=max(beta, 0.0))  # max(0, min(x, β)) in one op
    return lo, hi


def espo_entropy_clip_bounds(
    group_entropy: torch.Tensor, alpha: float, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`espo_entropy` bounds (ESPO §3.4; docs/algorithms/math.md §3): ε = α · mean_group(H / log|V|); [1 − ε, 1 + ε].

    ``group_entropy`` is the group mean of H, so ε = α · H̄ / log|V| (the mean is linear).
    """
    if vocab_size < 2:
        raise ValueError(f"espo.vocab_size must be >= 2 for log|V|, got {vocab_size}")
    eps = alpha * group_entropy.to(torch.promote_types(group_entropy.dtype, torch.float32)) / math.log(vocab_size)
    return 1.0 - eps, 1.0 + eps


def calibrate_espo_alpha(mean_entropy: float, vocab_size: int, target_eps: float) -> float:
    """α such that the initial mean ε equals ``target_eps`` (docs/algorithms/math.md §3: the paper gives no α).

    E.g. ``target_eps = 3.5e-4`` (the middle of GSPO's 3e-4/4e-4 bounds) and the mean π_old
    entropy of the first rollout.
    """
    if mean_entropy <= 0:
        raise ValueError(
            f"loss_fn.granular.espo.alpha: auto needs a first rollout with a positive mean π_old entropy, "
            f"got {mean_entropy}"
        )
    return target_eps * math.log(vocab_size) / mean_entropy


def clip_terms(ratio, adv, lo, hi, dual_clip: float | None = None, ratio_clamped=None):
    """Per-token clipped surrogate (docs/algorithms/math.md §4) and the derivative of it with respect to the ratio.

    c = min(r·A, clip(r, lo, hi)·A), with dual clip C: c = max(c, C·A) where A < 0.
    Returns ``(c, r_clamped, low, high, keep)``: ``keep`` = 1 where the min keeps the unclipped
    branch, r·A ≤ clip(r)·A (then dc/dr = A), else the clip removes the gradient — low when A < 0
    (r < lo), high when A > 0 (r > hi); the dual clip also removes it where it holds c at C·A.
    So dc/dr = keep·A. ``ratio``/``lo``/``hi`` may be per-row ``[B, 1]`` tensors or numbers;
    ``adv`` is ``[B, T]``; ``ratio_clamped`` = clip(r, lo, hi) when the caller has it (per group).
    """
    rc = torch.clamp(ratio, lo, hi) if ratio_clamped is None else ratio_clamped
    ra, rca = ratio * adv, rc * adv
    c = torch.minimum(ra, rca)
    keep = indicator(torch.le, ra, rca, adv)  # one comparison instead of four (A's sign × the two bounds)
    clipped = 1 - keep
    low = indicator(torch.lt, adv, 0, adv).mul_(clipped)
    high = clipped.sub_(low)
    if dual_clip is not None:
        # for A >= 0, c >= 0 = C·min(A, 0): the max leaves it alone, so no mask is needed
        floor = adv.clamp(max=0).mul_(dual_clip)
        keep.sub_(indicator(torch.gt, floor, c, adv))
        c = torch.maximum(c, floor)
    return c, rc, low, high, keep
