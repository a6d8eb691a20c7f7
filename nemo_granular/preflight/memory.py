"""Per-GPU memory estimates the plan prints: the logits/entropy block of the policy, the critic's state.

Arithmetic, not a measurement; the model is docs/scaling.md §1's:

* a micro-batch holds ``T`` tokens (``*_mb_tokens`` with sequence packing or dynamic batching, else
  batch × ``max_total_sequence_length``); context parallelism gives each GPU ``T / CP`` of them and
  the vocabulary-parallel output layer ``V / TP`` of the vocabulary;
* logits in the model dtype: ``T/CP × V/TP × bytes``;
* one fp32 working block for the log-softmax and the entropy (``logprob_chunk_size`` positions at
  a time when set, else the whole block);
* in training, an fp32 gradient of the logits of the same size as the working block.

The critic (SPPO's value model on the DTensor backend): FSDP shards fp32 master weights, fp32
gradients and Adam's two moments (16 bytes per parameter) over the value model's GPUs; with
``dtensor_cfg.cpu_offload`` they live in host memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .layout import dig

__all__ = ["LogitsEstimate", "logits_estimate", "critic_estimate", "DTYPE_BYTES", "GB"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GB = 1e9


@dataclass(frozen=True)
class LogitsEstimate:
    tokens_per_gpu: int
    vocab_per_gpu: int
    chunk: int
    logits_bytes: int
    fp32_block_bytes: int

    @property
    def logprob_pass_bytes(self) -> int:
        """Logits + one fp32 working block (no backward)."""
        return self.logits_bytes + self.fp32_block_bytes

    @property
    def train_bytes(self) -> int:
        """Logits + fp32 working block + fp32 gradient block."""
        return self.logits_bytes + 2 * self.fp32_block_bytes


def _mb_tokens(policy: Mapping, kind: str) -> int:
    """Tokens of one micro-batch for ``kind`` = ``logprob`` or ``train``."""
    for section in ("sequence_packing", "dynamic_batching"):
        if dig(policy, f"{section}.enabled", False):
            tokens = dig(policy, f"{section}.{kind}_mb_tokens")
            if tokens:
                return int(tokens)
    batch = policy.get("logprob_batch_size" if kind == "logprob" else "train_micro_batch_size") or 1
    return int(batch) * int(policy["max_total_sequence_length"])


def logits_estimate(policy: Mapping, par: Mapping, vocab_size: int, kind: str = "logprob") -> LogitsEstimate:
    """The policy's logits block per GPU for one micro-batch of the ``kind`` pass."""
    tokens = -(-_mb_tokens(policy, kind) // max(int(par["cp"]), 1))
    vocab = -(-int(vocab_size) // max(int(par["tp"]), 1))
    chunk_cfg = policy.get("logprob_chunk_size")
    chunk = min(int(chunk_cfg), tokens) if chunk_cfg and chunk_cfg > 0 else tokens
    nbytes = DTYPE_BYTES.get(str(policy.get("precision", "bfloat16")), 2)
    return LogitsEstimate(tokens, vocab, chunk, tokens * vocab * nbytes, chunk * vocab * 4)


def critic_estimate(params: int, world: int, value: Mapping) -> dict:
    """Persistent critic state per GPU: ``{"params", "bytes_per_gpu", "offloaded"}``."""
    offloaded = bool(dig(value, "dtensor_cfg.cpu_offload", False))
    per_gpu = 0 if offloaded else -(-16 * int(params) // max(int(world), 1))
    return {"params": int(params), "bytes_per_gpu": per_gpu, "offloaded": offloaded}
