"""π_old entropy next to the logprobs in NeMo-RL's policy workers — the pure parts.

The worker extensions (:mod:`.megatron_worker`, :mod:`.dtensor_worker`, importable only inside
NeMo-RL's worker environments) hand the logits that NeMo-RL's ``LogprobsPostProcessor``
receives to the functions below, which return the entropy in NeMo-RL's per-token layout:
``[B, S]`` float32, column i = entropy of the distribution that produced token i (the logits
at position i−1), column 0 and columns ≥ ``input_lengths[i]`` = 0 — the same convention as
the ``logprobs`` the worker returns.

Backend layouts (see docs/nemo-rl.md):
- Megatron, no packing: ``[B, S', V/TP]`` (CP = 1 without packing).
- Megatron, packing: ``[1, T/CP, V/TP]``; every packed sequence zig-zag sharded over CP inside
  its ``cu_seqlens_padded`` slot.
- DTensor v2: local ``[B, S/CP, V/TP]`` (CP via torch's load balancer, ``seq_index``) or
  packed ``[1, T, V/TP]`` with ``cu_seqlens_q`` (CP = 1 with packing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..distributed import gather_sequence, seq_index_gather_index, unpack_sequences, vocab_parallel_entropy
from ..distributed.vocab_parallel import group_rank_size

__all__ = [
    "MEGATRON_EXTENSION_FQN",
    "DTENSOR_V2_EXTENSION_FQN",
    "ENTROPY_METHOD",
    "shift_to_token_columns",
    "megatron_entropy",
    "dtensor_entropy",
    "stack_microbatch_entropy",
    "swap_attr",
]

MEGATRON_EXTENSION_FQN = "nemo_granular.nemo_rl.megatron_worker.GranularMegatronPolicyWorker"
DTENSOR_V2_EXTENSION_FQN = "nemo_granular.nemo_rl.dtensor_worker.GranularDTensorPolicyWorkerV2"
ENTROPY_METHOD = "get_logprobs_with_entropy"


def shift_to_token_columns(per_position: torch.Tensor, input_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S']`` per-position values → ``[B, seq_len]`` token columns (shift by one, zero
    column 0 and everything at or after each row's length)."""
    B, s_in = per_position.shape
    out = per_position.new_zeros(B, seq_len)
    n = min(s_in, seq_len) - 1
    if n > 0:
        out[:, 1 : n + 1] = per_position[:, :n]
    cols = torch.arange(seq_len, device=out.device)
    keep = cols[None, :] < input_lengths.to(out.device).reshape(-1, 1)
    return torch.where(keep, out, torch.zeros_like(out))


def megatron_entropy(
    logits: torch.Tensor,
    *,
    input_lengths: torch.Tensor,
    seq_len: int,
    cu_seqlens_padded: torch.Tensor | None = None,
    tp_group=None,
    cp_group=None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy ``[B, seq_len]`` from Megatron's vocab-parallel output (packed when
    ``cu_seqlens_padded`` is given: TP reduction, per-sequence zig-zag CP gather, unpack)."""
    with torch.no_grad():
        h = vocab_parallel_entropy(logits.detach(), tp_group, chunk_size)  # [B, S'] or [1, T/CP]
        if cu_seqlens_padded is None:
            if group_rank_size(cp_group)[1] > 1:
                raise ValueError("Megatron context parallelism needs sequence packing (cu_seqlens_padded)")
            return shift_to_token_columns(h.float(), input_lengths, seq_len)
        full = gather_sequence(h, cp_group, dim=1, cu_seqlens_padded=cu_seqlens_padded)  # [1, T]
        return unpack_sequences(full.float(), cu_seqlens_padded, input_lengths, seq_len, shift=1)


def dtensor_entropy(
    logits_local: torch.Tensor,
    *,
    input_lengths: torch.Tensor,
    seq_len: int,
    tp_group=None,
    cp_group=None,
    seq_index_local: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy ``[B, seq_len]`` from DTensor-v2 logits (the local vocabulary shard).

    CP > 1: the local ``seq_index`` shard is all-gathered (rank order = DTensor ``Shard(1)``),
    then the entropy is gathered and un-permuted with ``argsort(seq_index)``.
    Packing (CP = 1): unpacked by ``cu_seqlens_q`` (no padding between sequences).
    """
    with torch.no_grad():
        h = vocab_parallel_entropy(logits_local.detach(), tp_group, chunk_size)
        if group_rank_size(cp_group)[1] > 1:
            if seq_index_local is None:
                raise ValueError("DTensor context parallelism needs processed_inputs.seq_index")
            ident = torch.arange(seq_index_local.shape[-1] * group_rank_size(cp_group)[1], device=h.device)
            full_index = gather_sequence(seq_index_local.reshape(1, -1).to(h.device), cp_group, dim=1, index=ident)
            h = gather_sequence(h, cp_group, dim=1, index=seq_index_gather_index(full_index))
        if cu_seqlens_q is not None:
            return unpack_sequences(h.float(), cu_seqlens_q, input_lengths, seq_len, shift=1)
        return shift_to_token_columns(h.float(), input_lengths, seq_len)


def stack_microbatch_entropy(chunks: Sequence[torch.Tensor], rows: int, seq_len: int) -> torch.Tensor:
    """Concatenate per-microbatch ``[b, s]`` entropies (right-padded to ``seq_len``), keeping the
    first ``rows`` rows — DTensor appends padding "dummy" microbatches after the real ones."""
    out, n = [], 0
    for c in chunks:
        if n >= rows:
            break
        if c.shape[1] < seq_len:
            c = torch.nn.functional.pad(c, (0, seq_len - c.shape[1]))
        out.append(c[:, :seq_len])
        n += c.shape[0]
    if n < rows:
        raise RuntimeError(f"entropy for {n} rows collected but the logprobs have {rows} rows")
    return torch.cat(out, 0)[:rows]


@contextlib.contextmanager
def swap_attr(obj, name: str, value):
    """Temporarily rebind ``obj.name`` (used to make the worker's own ``get_logprobs`` build our
    post-processor subclass for one call; restored even on error).

    The extensions call ``super().get_logprobs``, never ``self.get_logprobs``: Ray's actor class
    copies every inherited method into a generated subclass (tracing wrappers) and ships it
    to the worker process with cloudpickle. NeMo-RL's ``get_logprobs`` is wrapped by
    ``wrap_with_nvtx_name``, so the function inside cannot be found by name and is pickled BY
    VALUE, with its own frozen copy of the module globals: a module-level rebinding never
    reaches it. ``super()`` resolves to the class in the imported module, whose function reads
    the real module globals at call time."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield old
    finally:
        setattr(obj, name, old)
