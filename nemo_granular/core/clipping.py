"""Clip bounds and the per-token surrogates: clipped (PPO), CISPO, REINFORCE (docs/algorithms/math.md §3, §4)."""

from __future__ import annotations

import math

import torch

__all__ = [
    "fixed_clip_bounds",
    "sspo_entropy_clip_bounds",
    "espo_entropy_clip_bounds",
    "clipped_surrogate",
    "cispo_surrogate",
    "reinforce_surrogate",
    "calibrate_espo_alpha",
    "ESPO_AUTO_TARGET_EPS",
]

# `espo.alpha: auto`: the mean ε of the first rollout is the middle of GSPO's 3e-4 / 4e-4 (math.md §3)
ESPO_AUTO_TARGET_EPS = 3.5e-4


def fixed_clip_bounds(like: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`fixed` bounds (docs/algorithms/math.md §3): lo = 1 − ε_low, hi = 1 + ε_high, broadcast to ``like``."""
    lo = torch.full_like(like, 1.0 - eps_low, dtype=torch.float32)
    hi = torch.full_like(like, 1.0 + eps_high, dtype=torch.float32)
    return lo, hi


def sspo_entropy_clip_bounds(
    group_entropy: torch.Tensor, alpha: float, beta: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sspo_entropy` bounds (SSPO eq. 13–15; docs/algorithms/math.md §3), per group from its mean entropy H̄:

    hi = min(1 + α + H̄, γ),   lo = max(0, min(1 − H̄, β)).
    """
    h = group_entropy.to(torch.promote_types(group_entropy.dtype, torch.float32))
    hi = torch.clamp(1.0 + alpha + h, max=gamma)
    lo = torch.clamp(torch.clamp(1.0 - h, max=beta), min=0.0)
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
        raise ValueError(f"loss_fn.granular.espo.alpha: auto needs a first rollout with a positive mean π_old entropy, "
                         f"got {mean_entropy}")
    return target_eps * math.log(vocab_size) / mean_entropy


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
