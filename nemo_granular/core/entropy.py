"""Full-vocabulary entropy (and next-token logprobs) from logits, chunked over positions (no grad).

H = logsumexp(z) − Σ_v softmax(z)_v · z_v  (docs/algorithms/math.md, Notation), in nats, float32 accumulation.
Chunking over positions keeps the extra memory at two small float32 blocks: the logits
themselves are never copied to float32 as a whole.

Speed (``benchmarks/peers.py``): the positions of a chunk are further capped so that one block
holds at most ``CACHE_ELEMENTS`` floats (1 MiB) per thread: the five passes over a block (shift, exp, two
sums, product) then run out of cache and the logits are read from memory once, which makes
the fused logprob+entropy pass faster than a plain ``log_softmax`` + gather (that one writes a
fresh ``[N, V]`` tensor). Results do not depend on the chunking (every position is reduced
on its own).
"""

from __future__ import annotations

import torch

CACHE_ELEMENTS = 1 << 18  # floats per working block (1 MiB in float32): cache-resident on CPU
# floats per working block when no chunk size is given (128 MiB in float32): a null chunk size
# still keeps the extra memory at two bounded blocks, whatever the number of positions
MAX_BLOCK_ELEMENTS = 1 << 25

__all__ = ["entropy_from_logits", "logprobs_from_logits", "logprobs_and_entropy_from_logits"]


def _chunk_stats(logits: torch.Tensor, chunk_size: int | None, targets=None, entropy: bool = True):
    """Yield ``(start, stop, logprob_or_None, entropy_or_None)`` per chunk of positions.

    Per chunk, with y = z − max z, e = exp(y), s = Σe: log p(target) = y[target] − log s and
    H = log s − Σ e·y / s (shifted form: no cancellation between two terms of the size of z).
    Two float32 ``[step, V]`` buffers are allocated once and reused: on CPU, allocating (and
    page-faulting) a fresh block per chunk costs as much as the arithmetic. ``step`` is
    ``chunk_size`` (null: ``MAX_BLOCK_ELEMENTS // V``) capped on CPU at ``CACHE_ELEMENTS // V``
    positions per thread (at least one).
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])
    n, V = flat.shape
    if not chunk_size or chunk_size <= 0:
        chunk_size = max(1, MAX_BLOCK_ELEMENTS // max(V, 1))
    step = min(chunk_size, max(n, 1))
    if flat.device.type == "cpu":  # on GPU the kernels stream; larger blocks mean fewer launches
        # a block per thread: each of the ~12 ops per block is one parallel region, so more
        # threads get proportionally larger blocks (fewer regions)
        step = max(1, min(step, CACHE_ELEMENTS * torch.get_num_threads() // max(V, 1)))
    y_buf = torch.empty(min(step, n), V, dtype=torch.float32, device=flat.device)
    e_buf = torch.empty_like(y_buf) if entropy else None
    for a in range(0, n, max(step, 1)):  # loop over chunks of positions, not tokens
        b = min(a + step, n)
        chunk, y = flat[a:b], y_buf[: b - a]
        m = chunk.amax(dim=-1, keepdim=True).float().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if chunk.dtype == torch.float32:
            torch.sub(chunk, m, out=y)
        else:  # cast first: z − m must be formed in float32
            y.copy_(chunk).sub_(m)
        lp = h = None
        if targets is not None:
            picked = y.gather(-1, targets[a:b, None]).squeeze(-1)
        if entropy:
            e = torch.exp(y, out=e_buf[: b - a])
            s = e.sum(-1)
            t = y.mul_(e).sum(-1)  # Σ e·y, in place: y is not needed any more
            if torch.isnan(t).any():  # masked (-inf) logits: 0·(−inf); they contribute nothing
                t = torch.nan_to_num(y, nan=0.0).sum(-1)
            log_s = torch.log(s)
            h = log_s - t / s
        else:
            log_s = torch.log(y.exp_().sum(-1))
        if targets is not None:
            lp = picked - log_s
        yield a, b, lp, h


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = 256) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim for every position: ``[..., V] -> [...]`` (no grad)."""
    out = torch.empty(logits.shape[:-1].numel(), dtype=torch.float32, device=logits.device)
    for a, b, _, h in _chunk_stats(logits, chunk_size):
        out[a:b] = h
    return out.view(logits.shape[:-1])


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = 256) -> torch.Tensor:
    """log softmax(logits)[target] per position — the logprob-only pass, the benchmarks' baseline (no grad)."""
    tgt = targets.reshape(-1).long()
    out = torch.empty(tgt.numel(), dtype=torch.float32, device=logits.device)
    for a, b, lp, _ in _chunk_stats(logits, chunk_size, tgt, entropy=False):
        out[a:b] = lp
    return out.view(targets.shape)


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused pass: (log p(target), H) per position from one read of each logits chunk (no grad)."""
    tgt = targets.reshape(-1).long()
    lp = torch.empty(tgt.numel(), dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(lp)
    for a, b, lp_c, h in _chunk_stats(logits, chunk_size, tgt):
        lp[a:b], ent[a:b] = lp_c, h
    return lp.view(targets.shape), ent.view(targets.shape)
