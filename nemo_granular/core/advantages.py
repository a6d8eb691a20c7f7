"""Advantages (docs/algorithms/math.md §6) and the SPPO critic loss (docs/algorithms/math.md §7) as pure tensor
functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "prompt_group_index",
    "grpo_advantages",
    "espo_advantages",
    "sppo_advantages",
    "first_response_index",
    "sppo_critic_bce",
]


def prompt_group_index(prompt_ids: torch.Tensor) -> torch.Tensor:
    """Index 0..P-1 of each row's prompt: rows with identical ``prompt_ids`` share a group.

    ``prompt_ids`` is ``[B, Lp]`` (token ids, as NeMo-RL passes them) or ``[B]`` (ids).
    """
    key = prompt_ids if prompt_ids.dim() > 1 else prompt_ids.unsqueeze(-1)
    return torch.unique(key, dim=0, return_inverse=True)[1]


def grpo_advantages(
    rewards: torch.Tensor,
    prompt_index: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    leave_one_out: bool = False,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantage (docs/algorithms/math.md §6): A_i = (R_i − mean_G R) / (std_G R + ε) over the prompt's group G.

    ``valid`` (bool ``[B]``) selects the responses that enter the statistics; invalid ones get
    A = 0. ``leave_one_out`` uses the mean (and std) of the *other* valid responses (RLOO);
    ``normalize_std=False`` skips the std scaling (Dr.GRPO). std is the unbiased sample std,
    as in NeMo-RL; a group with std 0 is not scaled. A prompt with fewer valid responses than
    the baseline needs (1, or 2 with leave-one-out) gets A = 0.
    """
    r = rewards.double()
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    valid = valid.bool()
    P = int(prompt_index.max().item()) + 1 if prompt_index.numel() else 0
    w = valid.double()
    n = torch.zeros(P, dtype=torch.float64, device=r.device).index_add(0, prompt_index, w)
    s1 = torch.zeros_like(n).index_add(0, prompt_index, r * w)
    s2 = torch.zeros_like(n).index_add(0, prompt_index, r * r * w)
    n_i, s1_i, s2_i = n[prompt_index], s1[prompt_index], s2[prompt_index]
    if leave_one_out:  # statistics of the other valid responses of the same prompt
        n_i, s1_i, s2_i = n_i - w, s1_i - r * w, s2_i - r * r * w
    mean = s1_i / n_i.clamp(min=1)
    var = (s2_i - n_i * mean * mean) / (n_i - 1).clamp(min=1)
    std = torch.where(n_i > 1, var.clamp(min=0).sqrt(), torch.zeros_like(var))
    adv = r - mean
    if normalize_std:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    enough = n_i >= 1
    adv = torch.where(valid & enough, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def espo_advantages(
    rewards: torch.Tensor,
    prompt_index: torch.Tensor,
    verification_failed: torch.Tensor,
    **grpo_options,
) -> torch.Tensor:
    """ESPO advantage (ESPO §3.5; docs/algorithms/math.md §6 Decision): GRPO advantage where responses whose
    verification FAILED (no judgeable answer) get A = 0 and are left out of their prompt's
    mean and std."""
    return grpo_advantages(rewards, prompt_index, valid=~verification_failed.bool(), **grpo_options)


def first_response_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of the first response token of each row (0 for a row without one)."""
    m = mask.bool()
    idx = torch.argmax(m.to(torch.int8), dim=-1)
    return torch.where(m.any(-1), idx, torch.zeros_like(idx))


def sppo_advantages(rewards: torch.Tensor, value_logits: torch.Tensor) -> torch.Tensor:
    """SPPO advantage (SPPO eq. 1; docs/algorithms/math.md §6): A_i = R_i − σ(v_i), v_i the critic logit at the
    last prompt token (V(s_p) = σ(v)). Returns ``[B]``; the caller broadcasts it to tokens."""
    return rewards.float() - torch.sigmoid(value_logits.float().detach())


def sppo_critic_bce(value_logits: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """SPPO critic loss (SPPO §3.2; docs/algorithms/math.md §7): per-response BCE-with-logits(v_i, R_i), ``[B]``."""
    dt = torch.promote_types(value_logits.dtype, torch.float32)  # float64 stays float64
    return F.binary_cross_entropy_with_logits(value_logits.to(dt), rewards.to(dt), reduction="none")
