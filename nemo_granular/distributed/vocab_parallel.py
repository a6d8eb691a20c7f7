"""Log-probability and entropy from vocabulary-sharded logits (tensor parallelism).

Every rank of ``group`` holds the logits of the same positions for its own contiguous slice
of the vocabulary, ``logits_local[..., v] = z[..., vocab_start + v]``. With the global
quantities

    m   = max_v z_v                          (all-reduce MAX)
    S   = Σ_v exp(z_v − m)                   (all-reduce SUM)
    E   = Σ_v exp(z_v − m) · z_v             (all-reduce SUM, entropy only)
    z_y = logit of the target y              (all-reduce SUM, one rank holds it)

the outputs are ``log p(y) = z_y − (m + log S)`` and ``H = m + log S − E/S`` (docs/algorithms/math.md,
Notation: H = logsumexp(z) − Σ softmax(z)·z, nats). The three sums travel in ONE
all-reduce, so the fused logprob+entropy pass has the same number of collectives as the
logprob-only pass (one MAX, one SUM per chunk).

Gradients (no collective needed: lse and H are global and saved):
    ∂ log p(y)/∂z_v = 1[v = y] − p_v,      ∂H/∂z_v = −p_v (z_v − (lse − H)).
Both are recomputed chunk by chunk in backward from the saved logits, so the extra memory
is one ``[chunk, V/TP]`` float32 block. Positions are processed in chunks of ``chunk_size``
(NeMo-RL's ``logprob_chunk_size``); every rank runs the same chunks, so the collectives match.
With ``chunk_size`` null, a chunk has ``MAX_BLOCK_ELEMENTS // (2·V/TP)`` positions (the smallest
over the ranks): the forward pass (the π_old entropy pass) then holds at most
:data:`MAX_BLOCK_ELEMENTS` float32 temporaries (256 MiB) whatever the number of tokens — the
exponentials of one chunk, and, on CPU, the float32 cast a mixed bf16/float32 op makes of one
chunk of logits. bf16/fp16 logits are never copied to float32 as a whole (issue 26 item 7: with
18k packed tokens × 151,936 that copy alone was ≈ 11 GB, and the exponentials another).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "vocab_parallel_logprob",
    "vocab_parallel_entropy",
    "vocab_parallel_logprob_and_entropy",
    "group_rank_size",
    "MAX_BLOCK_ELEMENTS",
    "chunk_rows",
]

# float32 temporaries of one chunk when no chunk size is given (256 MiB): two [chunk, V/TP] blocks
MAX_BLOCK_ELEMENTS = 1 << 26


def group_rank_size(group) -> tuple[int, int]:
    """(rank, size) inside ``group``; (0, 1) without torch.distributed or with ``group=None``
    when no default group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _row_dot_inplace(e: torch.Tensor, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Σ_v e_v·z_v per row with e_v = exp(z_v − m), overwriting ``e`` (no extra [chunk, V]
    temporary). Rows with masked (−inf) logits, where 0·(−inf) = nan, are recomputed with the
    0·log 0 = 0 rule."""
    out = e.mul_(z).sum(-1)
    bad = torch.isnan(out)
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(-1)
        zb = z[rows].to(e.dtype)
        eb = torch.exp(zb - m[rows, None])
        out[rows] = torch.where(eb > 0, eb * zb, torch.zeros_like(zb)).sum(-1)
    return out


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 accumulation (float64 inputs stay float64, for exact tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def chunk_rows(chunk_size: int | None, v_local: int, group=None, device=None) -> int:
    """Positions per chunk: ``chunk_size`` when given (> 0), else ``MAX_BLOCK_ELEMENTS // (2·v_local)``
    (at least 1), the minimum over ``group`` so that every rank runs the same chunks."""
    if chunk_size and chunk_size > 0:
        return int(chunk_size)
    rows = max(1, MAX_BLOCK_ELEMENTS // (2 * max(int(v_local), 1)))
    if group_rank_size(group)[1] > 1:  # vocabulary shards may differ in size: agree on the rows
        t = torch.tensor([rows], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        rows = int(t.item())
    return rows


def _bounds(n: int, step: int):
    step = max(int(step), 1)
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


class _VocabParallelStats(torch.autograd.Function):
    """(log p(target), H) per position from a vocabulary shard; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, chunk_size, want_lp, want_h):
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        n = flat.shape[0]
        cdt = _compute_dtype(logits)
        lse = torch.empty(n, dtype=cdt, device=logits.device)
        lp = torch.empty(n if want_lp else 0, dtype=cdt, device=logits.device)
        ent = torch.empty(n if want_h else 0, dtype=cdt, device=logits.device)
        if want_lp:
            tgt = target.reshape(-1).long() - vocab_start
            in_range = (tgt >= 0) & (tgt < v_local)
            tgt_local = tgt.clamp(0, v_local - 1)
        step = chunk_rows(chunk_size, v_local, group, logits.device)
        for a, b in _bounds(n, step):  # loop over chunks of positions, not over tokens
            z = flat[a:b]  # in the logits' dtype: a bf16 value is exact in float32, no float32 copy
            m = z.amax(dim=-1).to(cdt)
            _all_reduce(m, dist.ReduceOp.MAX, group)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.sub(z, m[:, None]).to(cdt).exp_()  # the one [chunk, V/TP] temporary of this chunk
            sums = [e.sum(-1)]
            if want_h:
                sums.append(_row_dot_inplace(e, z, m))  # e is not used after this
            del e  # freed before the next chunk's block is allocated
            if want_lp:
                zt = z.gather(-1, tgt_local[a:b, None]).squeeze(-1).to(cdt)
                sums.append(torch.where(in_range[a:b], zt, torch.zeros_like(zt)))
            red = _all_reduce(torch.stack(sums, dim=-1), dist.ReduceOp.SUM, group)
            lse[a:b] = m + torch.log(red[:, 0])
            if want_h:
                ent[a:b] = lse[a:b] - red[:, 1] / red[:, 0]
            if want_lp:
                lp[a:b] = red[:, -1] - lse[a:b]
        ctx.save_for_backward(logits, target if want_lp else None, lse, ent)
        ctx.vocab_start, ctx.chunk_size, ctx.want_lp, ctx.want_h = vocab_start, step, want_lp, want_h
        shape = logits.shape[:-1]
        lp_out = lp.view(shape) if want_lp else lp
        ent_out = ent.view(shape) if want_h else ent
        if not want_lp:
            ctx.mark_non_differentiable(lp_out)
        if not want_h:
            ctx.mark_non_differentiable(ent_out)
        return lp_out, ent_out

    @staticmethod
    def backward(ctx, g_lp, g_h):
        logits, target, lse, ent = ctx.saved_tensors
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        n = flat.shape[0]
        grad = torch.empty(flat.shape, dtype=logits.dtype, device=logits.device)
        use_lp = ctx.want_lp and g_lp is not None
        use_h = ctx.want_h and g_h is not None
        if use_lp:
            g_lp = g_lp.reshape(-1).to(lse.dtype)
            tgt = target.reshape(-1).long() - ctx.vocab_start
            in_range = (tgt >= 0) & (tgt < v_local)
            tgt_local = tgt.clamp(0, v_local - 1)
        if use_h:
            g_h = g_h.reshape(-1).to(lse.dtype)
        cdt = lse.dtype
        for a, b in _bounds(n, ctx.chunk_size):
            z = flat[a:b].to(cdt)
            p = torch.exp(z - lse[a:b, None])
            gz = torch.zeros_like(z)
            if use_lp:
                gz -= p * g_lp[a:b, None]
                hit = torch.where(in_range[a:b], g_lp[a:b], torch.zeros_like(g_lp[a:b]))
                gz.scatter_add_(-1, tgt_local[a:b, None], hit[:, None])
            if use_h:
                mean_z = (lse[a:b] - ent[a:b])[:, None]
                gz -= torch.where(p > 0, p * (z - mean_z), torch.zeros_like(z)) * g_h[a:b, None]
            grad[a:b] = gz.to(grad.dtype)
        return grad.view(logits.shape), None, None, None, None, None, None


def _default_start(logits: torch.Tensor, group, vocab_start: int | None) -> int:
    if vocab_start is not None:
        return int(vocab_start)
    rank, _ = group_rank_size(group)
    return rank * logits.shape[-1]  # Megatron: equal shards, rank r holds [r·V/TP, (r+1)·V/TP)


def vocab_parallel_logprob_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
):
    """Fused ``(log p(target), H)`` per position, both ``logits.shape[:-1]``, float32
    (float64 for float64 logits).

    ``logits``: ``[..., V/TP]`` local vocabulary shard; ``target``: global token ids with shape
    ``logits.shape[:-1]`` (the caller shifts: position t's logits score token t+1);
    ``vocab_start``: first global id of this shard (default ``rank·V_local``, Megatron's layout).
    Differentiable in both outputs.
    """
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target has shape {tuple(target.shape)} but logits have positions {tuple(logits.shape[:-1])}")
    return _VocabParallelStats.apply(
        logits, target, _default_start(logits, group, vocab_start), group, chunk_size, True, True
    )


def vocab_parallel_logprob(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``log p(target)`` per position from a vocabulary shard (differentiable)."""
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target has shape {tuple(target.shape)} but logits have positions {tuple(logits.shape[:-1])}")
    return _VocabParallelStats.apply(
        logits, target, _default_start(logits, group, vocab_start), group, chunk_size, True, False
    )[0]


def vocab_parallel_entropy(logits: torch.Tensor, group=None, chunk_size: int | None = None) -> torch.Tensor:
    """Full-vocabulary entropy H per position from a vocabulary shard (differentiable)."""
    return _VocabParallelStats.apply(logits, None, 0, group, chunk_size, False, True)[1]
