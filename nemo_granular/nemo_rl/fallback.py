"""Fallback entropy source: the CURRENT policy's logits, detached, inside the training step.

Use when the worker extension (exact π_old entropy from the ``get_logprobs`` pass) is not
available. :class:`CurrentLogitsEntropyLoss` is a LOGIT-input loss around
:class:`~nemo_granular.losses.GranularPolicyLoss`: NeMo-RL hands it the raw logits of the
training forward (vocabulary-sharded over TP on Megatron, a vocab-sharded DTensor on
DTensor v2, CP-sharded per sequence under Megatron packing); it computes, with
:mod:`nemo_granular.distributed`,

- ``next_token_logprobs`` ``[B, W−1]`` (differentiable; TP all-reduces, CP zig-zag gather
  whose backward sums the gradient over CP ranks — NeMo-RL divides the loss by CP), and
- ``prev_entropy`` ``[B, W]`` = entropy of the same logits, **detached**, in token columns,

and calls the granular loss with them (``W`` = width of ``data["input_ids"]``).

This equals the π_old entropy only while the weights are still π_old, i.e. when a rollout is
consumed by ONE optimizer step (``grpo.num_prompts_per_step × grpo.num_generations_per_prompt
≤ policy.train_global_batch_size``). Otherwise later optimizer steps see π_θ's entropy:
:func:`warn_if_rollout_split` warns once, loudly. Not supported: DTensor context parallelism
(its logits arrive CP-sharded in torch's load-balanced order without ``seq_index``), Megatron's
fused linear-CE logprobs, and ``sequence_packing.fuse_loss`` (LOGPROB-only in NeMo-RL).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..distributed import gather_sequence, vocab_parallel_logprob_and_entropy, zigzag_shard
from ..distributed.vocab_parallel import group_rank_size
from ..losses import GranularPolicyLoss
from ..protocol import HostMember, LossInputType
from .estimators import config_get

__all__ = [
    "rollout_split_steps",
    "warn_if_rollout_split",
    "current_logits_logprobs_and_entropy",
    "CurrentLogitsEntropyLoss",
]

_warned = False


def rollout_split_steps(master_config: Any) -> int:
    """Optimizer steps one rollout is split into: ceil(prompts·generations / train_global_batch_size)."""
    grpo = config_get(master_config, "grpo")
    policy = config_get(master_config, "policy")
    n = int(config_get(grpo, "num_prompts_per_step")) * int(config_get(grpo, "num_generations_per_prompt"))
    gbs = int(config_get(policy, "train_global_batch_size"))
    if gbs <= 0:
        raise ValueError(f"policy.train_global_batch_size must be > 0, got {gbs}")
    return -(-n // gbs)


def warn_if_rollout_split(master_config: Any) -> bool:
    """Warn ONCE (warnings + a banner on stderr) when the fallback's entropy is not π_old's."""
    global _warned
    steps = rollout_split_steps(master_config)
    if steps <= 1:
        return False
    if not _warned:
        _warned = True
        msg = (
            f"nemo_granular: prev_entropy comes from the CURRENT logits (fallback), but one rollout is "
            f"split into {steps} optimizer steps (grpo.num_prompts_per_step × num_generations_per_prompt > "
            f"policy.train_global_batch_size): from the 2nd step on the entropy is π_θ's, not π_old's. "
            f"Use the worker extension (nemo_granular.entropy_source: extension) for exact π_old entropy."
        )
        print("\n" + "!" * 100 + "\n" + msg + "\n" + "!" * 100 + "\n", file=sys.stderr, flush=True)
        warnings.warn(msg, stacklevel=2)
    return True


def _backend_groups(logits: torch.Tensor):  # pragma: no cover - depends on the backend
    """(local logits, tp_group, cp_group, vocab_start) as the training backend laid them out."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # very old torch
        DTensor = ()  # type: ignore[assignment]
    if DTensor and isinstance(logits, DTensor):
        mesh = logits.device_mesh
        if mesh.ndim != 1:
            raise NotImplementedError(
                "CurrentLogitsEntropyLoss: DTensor context parallelism is not supported; use the worker extension"
            )
        group = mesh.get_group()
        rank, size = group_rank_size(group)
        return logits.to_local(), group, None, rank * (-(-logits.shape[-1] // size))
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            tp = ps.get_tensor_model_parallel_group()
            return logits, tp, ps.get_context_parallel_group(), ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    except ImportError:
        pass
    return logits, None, None, 0


def current_logits_logprobs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    tp_group=None,
    cp_group=None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(next_token_logprobs [B, W−1], entropy [B, W])`` from (sharded) training logits.

    ``logits``: ``[B, P/CP, V/TP]`` for ONE sequence per row (Megatron per-sequence packing
    slot, zig-zag over CP; or an unpacked batch with CP = 1), ``P ≥ W − 1``; ``input_ids``:
    ``[B, W]`` global token ids. Entropy column 0 is 0 and column j is H(logits at j−1).
    """
    _, cp = group_rank_size(cp_group)
    cp_rank = group_rank_size(cp_group)[0]
    B, W = input_ids.shape
    P = logits.shape[1] * cp
    if P < W - 1:
        raise ValueError(f"logits cover {P} positions but input_ids has width {W}")
    ids = input_ids.to(logits.device).long()
    targets = torch.zeros(B, P, dtype=torch.long, device=logits.device)
    targets[:, : W - 1] = ids[:, 1:]  # position t scores token t+1
    if cp > 1:
        targets = zigzag_shard(targets, cp_rank, cp, dim=1)
    lp, ent = vocab_parallel_logprob_and_entropy(logits, targets, tp_group, vocab_start, chunk_size)
    if cp > 1:
        lp = gather_sequence(lp, cp_group, dim=1)
        ent = gather_sequence(ent.detach(), cp_group, dim=1)
    ent = ent.detach().float()
    entropy = torch.cat([torch.zeros(B, 1, dtype=ent.dtype, device=ent.device), ent[:, : W - 1]], dim=1)
    return lp[:, : W - 1], entropy


class CurrentLogitsEntropyLoss:
    """LOGIT-input wrapper: current-logits logprobs + detached entropy → :class:`GranularPolicyLoss`.

    Picklable (no process groups as attributes: they are looked up from the backend at call
    time, or passed as ``process_groups=(tp, cp)``).
    """

    input_type = HostMember(LossInputType.LOGIT)

    def __init__(
        self,
        inner: GranularPolicyLoss | Mapping,
        master_config: Any = None,
        chunk_size: int | None = None,
        **inner_kwargs,
    ):
        self.inner = inner if isinstance(inner, GranularPolicyLoss) else GranularPolicyLoss(inner, **inner_kwargs)
        self.reference_policy_kl_penalty = self.inner.reference_policy_kl_penalty
        self.use_fused_linear_logprobs = False
        self.chunk_size = chunk_size
        if master_config is not None:
            warn_if_rollout_split(master_config)

    @property
    def loss_type(self):
        return self.inner.loss_type

    @property
    def metric_normalizations(self) -> dict:
        return self.inner.metric_normalizations

    def __call__(
        self,
        logits: torch.Tensor,
        data: Mapping,
        global_valid_seqs,
        global_valid_toks,
        process_groups: tuple | None = None,
        vocab_start: int | None = None,
        **kwargs,
    ):
        if process_groups is None:
            local, tp, cp, start = _backend_groups(logits)
        else:
            (tp, cp), local, start = process_groups, logits, vocab_start
        input_ids = data["input_ids"]
        if hasattr(input_ids, "full_tensor"):
            raise NotImplementedError("CurrentLogitsEntropyLoss: DTensor context parallelism is not supported")
        lp, entropy = current_logits_logprobs_and_entropy(local, input_ids, tp, cp, start, self.chunk_size)
        view = dict(data.items())  # plain mapping, like NeMo-RL's packing wrapper passes
        view["prev_entropy"] = entropy.to(lp.device)
        return self.inner(
            next_token_logprobs=lp, data=view, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks
        )
