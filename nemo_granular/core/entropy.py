"""Full-vocabulary entropy (and next-token logprobs) from logits, chunked over positions.

H = logsumexp(z) − Σ_v softmax(z)_v · z_v  (spec, Notation), in nats, float32 accumulation.
Chunking over positions keeps the extra memory at one ``[chunk, V]`` float32 block: the
logits themselves are never copied to float32 as a whole.
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "logprobs_from_logits", "logprobs_and_entropy_from_logits"]


def _chunks(n: int, chunk_size: int | None):
    step = n if not chunk_size or chunk_size <= 0 else chunk_size
    for start in range(0, n, max(step, 1)):  # loop over chunks of positions, not tokens
        yield start, min(start + step, n)


def _stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp, entropy) of float32 logits along the last dim, in one pass."""
    m = z.max(dim=-1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(z - m)
    s = e.sum(-1)
    lse = m.squeeze(-1) + torch.log(s)
    # Σ p·z with p = e/s; masked (-inf) logits contribute 0, not nan
    pz = torch.where(e > 0, e * z, torch.zeros_like(z)).sum(-1) / s
    return lse, lse - pz


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim for every position: ``[..., V] -> [...]``."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for a, b in _chunks(flat.shape[0], chunk_size):
        out[a:b] = _stats(flat[a:b].float())[1]
    return out.view(logits.shape[:-1])


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = 1024) -> torch.Tensor:
    """log softmax(logits)[target] for every position (the logprob-only baseline pass)."""
    flat = logits.reshape(-1, logits.shape[-1])
    tgt = targets.reshape(-1).long()
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for a, b in _chunks(flat.shape[0], chunk_size):
        z = flat[a:b].float()
        out[a:b] = z.gather(-1, tgt[a:b, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return out.view(targets.shape)


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused pass: (log p(target), H) per position from one read of each logits chunk.

    No autograd (π_old quantities): call it under ``torch.no_grad()`` or on detached logits.
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])
    tgt = targets.reshape(-1).long()
    lp = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(lp)
    for a, b in _chunks(flat.shape[0], chunk_size):
        z = flat[a:b].float()
        lse, h = _stats(z)
        lp[a:b] = z.gather(-1, tgt[a:b, None]).squeeze(-1) - lse
        ent[a:b] = h
    return lp.view(targets.shape), ent.view(targets.shape)
