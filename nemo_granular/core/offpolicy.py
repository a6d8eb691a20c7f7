"""Off-policy corrections of the policy loss (docs/algorithms/math.md §5): the π_old/π_gen
importance weight of each group and NeMo-RL's truncations of it (tis, icepop, seq-mask-tis),
and the KL penalty to a reference policy. Inputs are 0 outside the valid tokens."""

from __future__ import annotations

import torch

from .objective import LOG_RATIO_BOUND

__all__ = ["importance_weights", "truncate_importance_weights", "kl_penalty_per_token"]


def importance_weights(logq: torch.Tensor, log_gen: torch.Tensor, index=None) -> torch.Tensor:
    """w = π_old/π_gen (detached inputs): per token, or one weight per group,
    exp(Σ_{t∈g} (logq_t − log π_gen_t)) — NeMo-RL's GSPO convention for a whole response. The
    exponent is clamped at LOG_RATIO_BOUND; NaN/inf weights become 0, as in NeMo-RL."""
    diff = logq - log_gen
    if index is not None:
        diff = index.gather(index.sum(diff))
    return torch.nan_to_num(torch.exp(diff.clamp(max=LOG_RATIO_BOUND)), nan=0.0, posinf=0.0, neginf=0.0)


def truncate_importance_weights(weights: torch.Tensor, kind: str | None, ratio_max: float | None,
                                ratio_min: float | None, seq_log_ratio_mean: torch.Tensor | None = None):
    """NeMo-RL's truncated importance sampling of ``weights`` → ``(weights, out_of_bounds)``:

    * ``tis``: clamp to [min (0 when null), max]; out of bounds per token;
    * ``icepop``: zero the tokens whose weight is outside [min, max];
    * ``seq-mask-tis``: zero whole rows whose geometric-mean ratio exp(``seq_log_ratio_mean``)
      is outside [min, max] (out of bounds per row, ``[B]``); other weights untruncated.

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
        geo = torch.exp(seq_log_ratio_mean)
        keep = ((geo >= ratio_min) & (geo <= ratio_max)).to(weights.dtype)
        return weights * keep[:, None], 1 - keep
    raise ValueError(f"loss_fn.truncated_importance_sampling_type: unknown value {kind!r}")


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
