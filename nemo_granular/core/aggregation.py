"""Aggregations of a per-token term into the (partial) batch objective (docs/algorithms/math.md §5).

All three return a *partial sum* normalised by a global count, NeMo-RL style: summing the
results of every microbatch (or of every single-sequence call under sequence packing)
gives the mean over the global batch. Rows with ``sample_mask = 0`` contribute nothing.
"""

from __future__ import annotations

import torch

from .ratios import group_count, group_sum

__all__ = ["token_mean", "seq_mean_token_mean", "seq_mean_group_mean", "safe_divide"]


def safe_divide(num: torch.Tensor, den) -> torch.Tensor:
    """num / den with den clamped to 1e-8 (den may be a tensor or number; 0/0 → 0)."""
    dt = num.dtype if num.is_floating_point() else torch.float32
    if not torch.is_tensor(den):
        den = torch.tensor(float(den), dtype=dt, device=num.device)
    return num / den.to(num.device, dt).clamp(min=1e-8)


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
