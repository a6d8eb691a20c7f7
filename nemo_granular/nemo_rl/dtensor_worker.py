"""DTensor-v2 policy-worker extension: ``get_logprobs_with_entropy`` (imports NeMo-RL + Automodel).

Same mechanism as :mod:`.megatron_worker`: the worker's own ``get_logprobs`` runs with the
module-level ``LogprobsPostProcessor`` of ``dtensor_policy_worker_v2`` bound, for that call,
to a subclass that also computes the entropy (local vocabulary shard + ``tp`` mesh group;
CP via ``seq_index``; packing via ``cu_seqlens_q``). Dummy microbatches that NeMo-RL appends
for uneven DP bins are dropped by row count.
"""

from __future__ import annotations

import ray
import torch
from torch.distributed.tensor import DTensor

from . import compat
from .workers import dtensor_entropy, stack_microbatch_entropy, swap_attr

_atrain = compat.module("automodel_train")
_dpw = compat.module("dtensor_policy_worker_v2")
get_runtime_env_for_policy_worker = compat.get("get_runtime_env_for_policy_worker")

__all__ = ["EntropyLogprobsPostProcessor", "GranularDTensorPolicyWorkerV2Impl", "GranularDTensorPolicyWorkerV2"]


def _cu_seqlens_q(processed_inputs):
    fa = processed_inputs.flash_attn_kwargs
    return fa.get("cu_seqlens_q") if isinstance(fa, dict) else getattr(fa, "cu_seqlens_q", None)


class EntropyLogprobsPostProcessor(_atrain.LogprobsPostProcessor):
    def __init__(self, *args, sink: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.sink = sink

    def __call__(self, logits, data_dict, processed_inputs, original_batch_size, original_seq_len, sequence_dim=1):
        if isinstance(logits, DTensor):
            local, tp_group = logits.to_local(), logits.device_mesh.get_group()
        else:
            local, tp_group = logits, None
        self.sink.append(
            dtensor_entropy(
                local,
                input_lengths=data_dict["input_lengths"],
                seq_len=original_seq_len,
                tp_group=tp_group,
                cp_group=self.cp_mesh.get_group() if self.cp_size > 1 else None,
                seq_index_local=processed_inputs.seq_index if self.cp_size > 1 else None,
                cu_seqlens_q=_cu_seqlens_q(processed_inputs) if self.enable_seq_packing else None,
                chunk_size=self.logprob_chunk_size,
            )
        )
        return super().__call__(
            logits, data_dict, processed_inputs, original_batch_size, original_seq_len, sequence_dim
        )


class GranularDTensorPolicyWorkerV2Impl(_dpw.DTensorPolicyWorkerV2Impl):
    def get_logprobs_with_entropy(self, data, micro_batch_size=None):
        """``get_logprobs`` + ``entropy`` ``[B, S]`` (float32, token columns, 0 on column 0/padding)."""
        sink: list[torch.Tensor] = []

        def build(*args, **kwargs):
            return EntropyLogprobsPostProcessor(*args, sink=sink, **kwargs)

        with swap_attr(_dpw, "LogprobsPostProcessor", build):
            # super(), not self: in a Ray actor, self.get_logprobs is a by-value copy (see workers.py)
            out = super().get_logprobs(data, micro_batch_size=micro_batch_size)
        rows, seq_len = out["logprobs"].shape
        out["entropy"] = stack_microbatch_entropy(sink, rows, seq_len).float().cpu()
        return out


@ray.remote(runtime_env=get_runtime_env_for_policy_worker("dtensor_policy_worker_v2"))  # pragma: no cover
class GranularDTensorPolicyWorkerV2(GranularDTensorPolicyWorkerV2Impl):
    pass
