"""Sequence packing: rows ``[B, S]`` ↔ one packed row ``[T]`` by cumulative lengths.

Layout (NeMo-RL/Megatron): sequence i occupies the slot ``[cu_padded[i], cu_padded[i+1])``
of the packed row, its ``L_i = input_lengths[i]`` real tokens first, then padding (each
slot padded to a multiple of ``pad_multiple``, e.g. 2·CP·TP). Unpacking is a single gather
(vectorised over rows and columns) and therefore differentiable.
"""

from __future__ import annotations

import torch

__all__ = ["pack_sequences", "unpack_sequences"]


def pack_sequences(x: torch.Tensor, input_lengths: torch.Tensor, pad_multiple: int = 1, pad_value=0):
    """Pack rows of ``x`` ``[B, S, ...]`` → ``(packed [T, ...], cu_seqlens [B+1], cu_seqlens_padded [B+1])``."""
    lengths = input_lengths.to(torch.long).reshape(-1).cpu()
    if lengths.numel() != x.shape[0]:
        raise ValueError(f"input_lengths has {lengths.numel()} entries but x has {x.shape[0]} rows")
    if bool((lengths > x.shape[1]).any()):
        raise ValueError(f"input_lengths {lengths.tolist()} exceed the row width {x.shape[1]}")
    padded = ((lengths + pad_multiple - 1) // pad_multiple) * pad_multiple
    zero = torch.zeros(1, dtype=torch.long)
    cu = torch.cat([zero, torch.cumsum(lengths, 0)])
    cu_pad = torch.cat([zero, torch.cumsum(padded, 0)])
    T = int(cu_pad[-1])
    packed = torch.full((T, *x.shape[2:]), pad_value, dtype=x.dtype, device=x.device)
    cols = torch.arange(x.shape[1])
    keep = cols[None, :] < lengths[:, None]  # [B, S]
    dest = (cu_pad[:-1, None] + cols[None, :])[keep]
    packed[dest.to(x.device)] = x[keep.to(x.device)]
    return packed, cu, cu_pad


def unpack_sequences(
    packed: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    input_lengths: torch.Tensor,
    seq_len: int,
    shift: int = 0,
    fill: float = 0.0,
) -> torch.Tensor:
    """Rows ``[B, seq_len, ...]`` from a packed ``[T, ...]`` (or ``[1, T, ...]``) tensor.

    ``out[i, shift + j] = packed[cu_padded[i] + j]`` for ``0 <= j < L_i − shift``, ``fill``
    elsewhere. ``shift=1`` is NeMo-RL's convention for next-token quantities: the value
    computed from the logits at position j (which score token j+1) lands in column j+1, and
    column 0 holds ``fill``.
    """
    if packed.dim() >= 2 and packed.shape[0] == 1 and cu_seqlens_padded.numel() > 1:
        packed = packed[0]
    cu = cu_seqlens_padded.to(device=packed.device, dtype=torch.long).reshape(-1)
    lengths = input_lengths.to(device=packed.device, dtype=torch.long).reshape(-1)
    B = lengths.numel()
    if cu.numel() < B + 1:
        raise ValueError(f"cu_seqlens_padded has {cu.numel()} entries, need at least B+1 = {B + 1}")
    if bool((lengths > seq_len).any()):
        raise ValueError(f"input_lengths {lengths.tolist()} exceed seq_len {seq_len}")
    cols = torch.arange(seq_len, device=packed.device)
    src = cu[:B, None] + cols[None, :] - shift  # [B, seq_len]
    valid = (cols[None, :] >= shift) & (cols[None, :] < lengths[:, None])
    src = torch.where(valid, src, torch.zeros_like(src)).clamp(0, max(packed.shape[0] - 1, 0))
    out = packed.index_select(0, src.reshape(-1)).view(B, seq_len, *packed.shape[1:])
    mask = valid.view(B, seq_len, *([1] * (packed.dim() - 1)))
    return torch.where(mask, out, torch.full_like(out, fill))
