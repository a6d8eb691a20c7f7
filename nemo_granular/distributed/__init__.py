"""Sharded-tensor math for the NeMo-RL worker extensions (pure torch + torch.distributed).

- :mod:`.vocab_parallel`: next-token log-prob and full-vocabulary entropy from logits whose
  vocabulary is sharded over a process group (tensor parallelism), with autograd.
- :mod:`.context_parallel`: reassembly of sequence-sharded per-token tensors (Megatron's
  2·CP zig-zag, per packed sequence; DTensor's ``seq_index`` permutation), with autograd.
- :mod:`.packing`: packing rows into one sequence and unpacking by cumulative lengths.

Nothing here imports NeMo-RL; the process groups are plain ``torch.distributed`` groups
(``None`` = single process).
"""

from .context_parallel import (
    gather_sequence,
    seq_index_gather_index,
    zigzag_gather_index,
    zigzag_positions,
    zigzag_shard,
)
from .packing import pack_sequences, unpack_sequences
from .vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_logprob,
    vocab_parallel_logprob_and_entropy,
)

__all__ = [
    "vocab_parallel_logprob",
    "vocab_parallel_entropy",
    "vocab_parallel_logprob_and_entropy",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_gather_index",
    "seq_index_gather_index",
    "gather_sequence",
    "pack_sequences",
    "unpack_sequences",
]
