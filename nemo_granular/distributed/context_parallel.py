"""Reassembly of sequence-sharded (context-parallel) per-token tensors, with autograd.

Megatron's load-balanced 2·CP zig-zag: a (padded) sequence of length L is cut into 2·CP
equal chunks and CP rank r holds chunks r and 2·CP−1−r, concatenated in that order. With
sequence packing every packed sequence (slot ``[cu[i], cu[i+1])`` of ``cu_seqlens_padded``,
each slot a multiple of 2·CP) is zig-zag sharded on its own and a rank's local packed row
is the concatenation of its shards, so rank r's local row has length T/CP.

DTensor (torch ``context_parallel``) shards with its own load balancer and NeMo-RL
provides ``seq_index`` (original position of every element of the rank-ordered
concatenation of the shards); the full sequence is the concatenation permuted by
``argsort(seq_index)``.

Both cases are one operation: all-gather the equal-length local shards over the CP group
(rank-ordered, ``[CP·T_local]`` flat layout) and pick, for every global position p, the
element ``index[p]`` of that layout. ``index`` is a permutation of ``0..CP·T_local−1`` built
vectorised by :func:`zigzag_gather_index` / :func:`seq_index_gather_index`.
Backward (every CP rank evaluates the same full-sequence function): all-reduce SUM of the
full-sequence gradient, then scatter it back through ``index`` and keep this rank's row —
the gradient of Σ_ranks f(full) w.r.t. the local shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .vocab_parallel import group_rank_size

__all__ = ["zigzag_positions", "zigzag_shard", "zigzag_gather_index", "seq_index_gather_index", "gather_sequence"]


def _check_divisible(lengths: torch.Tensor, cp_size: int, what: str) -> None:
    if bool(((lengths % (2 * cp_size)) != 0).any()):
        raise ValueError(
            f"{what}: every (padded) sequence length must be a multiple of 2·CP = {2 * cp_size}, got {lengths.tolist()}"
        )


def zigzag_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions held by ``cp_rank`` of one zig-zag-sharded sequence, in local order."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    _check_divisible(torch.tensor([seq_len]), cp_size, "zigzag_positions")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    k2 = 2 * cp_size - 1 - cp_rank
    second = torch.arange(k2 * c, (k2 + 1) * c, device=device)
    return torch.cat([first, second])


def zigzag_shard(
    x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1, cu_seqlens_padded: torch.Tensor | None = None
) -> torch.Tensor:
    """Rank ``cp_rank``'s zig-zag shard of ``x`` along ``dim`` (per packed sequence when
    ``cu_seqlens_padded`` is given) — what Megatron feeds that rank."""
    T = x.shape[dim]
    index = zigzag_gather_index(T // cp_size, cp_size, cu_seqlens_padded, device=x.device)
    # inverse map: flat-layout slot -> global position; take this rank's row of the layout
    inv = torch.empty_like(index)
    inv[index] = torch.arange(T, device=x.device)
    mine = inv.view(cp_size, T // cp_size)[cp_rank]
    return x.index_select(dim, mine)


def zigzag_gather_index(
    t_local: int, cp_size: int, cu_seqlens_padded: torch.Tensor | None = None, device=None
) -> torch.Tensor:
    """``index[p]`` = slot of global (packed) position p in the all-gathered ``[CP·t_local]`` layout.

    Without ``cu_seqlens_padded`` the whole row is one sequence of length ``CP·t_local``.
    Vectorised over positions (no loop over sequences).
    """
    T = t_local * cp_size
    if cu_seqlens_padded is None:
        cu = torch.tensor([0, T], device=device)
    else:
        cu = cu_seqlens_padded.to(device=device, dtype=torch.long).reshape(-1)
        if int(cu[-1]) > T:
            raise ValueError(f"cu_seqlens_padded ends at {int(cu[-1])} but CP·T_local = {T}")
        if int(cu[-1]) < T:  # padding after the last sequence: one more (zig-zag sharded) slot
            cu = torch.cat([cu, cu.new_tensor([T])])
    lengths = cu[1:] - cu[:-1]
    if cp_size == 1:
        return torch.arange(T, device=device)
    _check_divisible(lengths, cp_size, "cu_seqlens_padded")
    p = torch.arange(T, device=device)
    seq = torch.bucketize(p, cu[1:], right=True)  # sequence id of every position
    start, length = cu[seq], lengths[seq]
    c = length // (2 * cp_size)
    off = p - start
    k = off // c
    w = off - k * c
    second = k >= cp_size
    rank = torch.where(second, 2 * cp_size - 1 - k, k)
    local = start // cp_size + torch.where(second, c, torch.zeros_like(c)) + w
    return rank * t_local + local


def seq_index_gather_index(seq_index: torch.Tensor) -> torch.Tensor:
    """``index`` for DTensor CP: the gathered element j holds original position ``seq_index[j]``."""
    seq_index = seq_index.reshape(-1).long()
    return torch.argsort(seq_index)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group, dim, index):
        rank, size = group_rank_size(group)
        x = local.movedim(dim, 0).contiguous()
        t_local = x.shape[0]
        if size > 1:
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x, group=group)
            flat = torch.cat(parts, dim=0)
        else:
            flat = x
        idx = index.to(flat.device)
        ctx.save_for_backward(idx)
        ctx.group, ctx.dim, ctx.rank, ctx.size, ctx.t_local = group, dim, rank, size, t_local
        return flat.index_select(0, idx).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        g = grad.movedim(ctx.dim, 0).contiguous()
        if ctx.size > 1:
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        layout = torch.zeros_like(g)
        layout.index_copy_(0, idx, g)
        mine = layout.view(ctx.size, ctx.t_local, *g.shape[1:])[ctx.rank]
        return mine.movedim(0, ctx.dim), None, None, None


def gather_sequence(
    local: torch.Tensor,
    group=None,
    dim: int = 1,
    index: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full sequence along ``dim`` from this rank's CP shard (differentiable).

    ``index`` (a permutation, see the module docstring) defaults to Megatron's zig-zag
    layout, per packed sequence when ``cu_seqlens_padded`` is given. ``group=None`` is a
    single rank: the tensor is only re-ordered by ``index`` (identity by default).
    """
    _, size = group_rank_size(group)
    if index is None:
        index = zigzag_gather_index(local.shape[dim], size, cu_seqlens_padded, device=local.device)
    if index.numel() != local.shape[dim] * size:
        raise ValueError(f"index has {index.numel()} entries but CP·T_local = {local.shape[dim] * size}")
    return _GatherSequence.apply(local, group, dim % local.dim(), index)
