"""Megatron policy-worker extension: ``get_logprobs_with_entropy`` (imports NeMo-RL + Megatron).

Importable only inside NeMo-RL's Megatron worker environment; the driver refers to it by
name (:data:`nemo_granular.nemo_rl.workers.MEGATRON_EXTENSION_FQN`), registered in
``ACTOR_ENVIRONMENT_REGISTRY`` like ``research/template_project``.

``get_logprobs_with_entropy`` runs the worker's OWN ``get_logprobs`` (microbatching, packing,
router replay, PP schedule and the logprob math stay NeMo-RL's) while the module-level name
``LogprobsPostProcessor`` in ``megatron_policy_worker`` is bound, for that call only, to a
subclass that also computes the full-vocabulary entropy from the same logits in the same
forward pass (on the last PP stage, where Megatron calls the post-processor); the entropy is
then broadcast from the last stage like the logprobs. ``get_logprobs`` itself (used for the
reference policy) is untouched.
"""

from __future__ import annotations

import ray
import torch
from megatron.core import parallel_state

from . import compat
from .conversion_lock import locked_model_import
from .workers import megatron_entropy, stack_microbatch_entropy, swap_attr

_mtrain = compat.module("megatron_train")
_mpw = compat.module("megatron_policy_worker")
broadcast_tensors_from_last_stage = compat.get("broadcast_tensors_from_last_stage")
get_runtime_env_for_policy_worker = compat.get("get_runtime_env_for_policy_worker")

__all__ = ["EntropyLogprobsPostProcessor", "GranularMegatronPolicyWorkerImpl", "GranularMegatronPolicyWorker"]


class EntropyLogprobsPostProcessor(_mtrain.LogprobsPostProcessor):
    """NeMo-RL's logprob post-processor + entropy of the same logits into ``sink``."""

    def __init__(self, *args, sink: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.sink = sink

    def __call__(self, data_dict, input_ids, cu_seqlens_padded):
        inner = super().__call__(data_dict, input_ids, cu_seqlens_padded)
        packed = bool(self.cfg["sequence_packing"]["enabled"])
        if compat.fused_linear_logprobs(self):
            key = compat.FUSED_LOGPROBS_KEY[compat.version().key]
            raise ValueError(
                f"{key}: the fused kernel returns logprobs, not logits, so the π_old entropy cannot "
                f"be computed; disable it"
            )

        def processor(output_tensor):
            # entropy first: NeMo-RL's logprob path may work in place on the logits
            self.sink.append(
                megatron_entropy(
                    output_tensor,
                    input_lengths=data_dict["input_lengths"],
                    seq_len=data_dict["input_ids"].shape[1],
                    cu_seqlens_padded=cu_seqlens_padded if packed else None,
                    tp_group=parallel_state.get_tensor_model_parallel_group(),
                    cp_group=parallel_state.get_context_parallel_group(),
                    chunk_size=self.cfg.get("logprob_chunk_size", None),
                )
            )
            return inner(output_tensor)

        return processor


def _broadcast_from_rank0(value: bool) -> bool:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _is_rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


class GranularMegatronPolicyWorkerImpl(_mpw.MegatronPolicyWorkerImpl):
    def __init__(self, *args, **kwargs):
        # the HF→Megatron conversion under the cache folder's lock: the ESPO and GSPO jobs of a
        # comparison, started side by side on a fresh cache, would both convert into one folder.
        # A job waiting for the other's conversion polls the lock in short rounds (conversion_lock.py),
        # so no NCCL collective outlasts the process group's timeout while it waits.
        locked = locked_model_import(
            _mpw.handle_model_import, is_rank0=_is_rank0, broadcast=_broadcast_from_rank0, barrier=_barrier
        )
        with swap_attr(_mpw, "handle_model_import", locked):
            super().__init__(*args, **kwargs)

    def get_logprobs_with_entropy(self, *, data, micro_batch_size=None):
        """``get_logprobs`` + ``entropy`` ``[B, S]`` (float32, token columns, 0 on column 0/padding)."""
        sink: list[torch.Tensor] = []

        def build(*args, **kwargs):
            return EntropyLogprobsPostProcessor(*args, sink=sink, **kwargs)

        with swap_attr(_mpw, "LogprobsPostProcessor", build):
            # super(), not self: in a Ray actor, self.get_logprobs is a by-value copy (see workers.py)
            out = super().get_logprobs(data=data, micro_batch_size=micro_batch_size)
        rows, seq_len = out["logprobs"].shape
        entropy = None
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            entropy = stack_microbatch_entropy(sink, rows, seq_len).to(torch.cuda.current_device())
        entropy = broadcast_tensors_from_last_stage({"entropy": entropy})["entropy"]
        out["entropy"] = entropy.float().cpu()
        return out


@ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))  # pragma: no cover
class GranularMegatronPolicyWorker(GranularMegatronPolicyWorkerImpl):
    pass
