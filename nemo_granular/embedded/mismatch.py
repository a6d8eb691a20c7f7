"""A generation engine that disagrees with the trainer by a controlled amount (docs/algorithms/offpolicy.md).

At scale the rollouts come from vLLM (often FP8) and π_old from Megatron (bf16): π_gen ≠ π_old.
Here ``rl.generation_mismatch: σ`` samples each rollout from a copy of the policy whose every
weight p is p·(1 + σ·ε), ε ~ N(0, 1) drawn afresh per step from (seed, step) — a stand-in for a
lower-precision engine (rounding to FP8 E4M3 is a relative error of the same form, up to 2⁻⁴).
``generation_logprobs`` are the copy's, ``prev_logprobs`` the policy's, as in NeMo-RL.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["perturbed_copy", "generation_seed"]


def generation_seed(seed: int, step: int) -> int:
    """The noise seed of step ``step`` (a pure function: a resumed run draws the same engine)."""
    return (seed * 1_000_003 + step) * 7 + 1


@torch.no_grad()
def perturbed_copy(model: torch.nn.Module, sigma: float, seed: int) -> torch.nn.Module:
    """π_gen: a deep copy of ``model`` with every parameter p replaced by p·(1 + σ·ε), ε iid N(0, 1)
    from a CPU generator seeded by ``seed`` (same draw on any device)."""
    gen = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for p in gen.parameters():  # loop over parameter tensors, not over data
        p.mul_(1 + sigma * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.device, p.dtype))
    gen.eval()
    return gen
