"""The DTensor-v2 π_old pass with sequence packing, in one rank of a spawned gloo world (no Ray).

:func:`rank_logprobs` runs the plugin's ``GranularDTensorPolicyWorkerV2Impl.get_logprobs_with_entropy``
— i.e. NeMo-RL's own ``DTensorPolicyWorkerV2Impl.get_logprobs``: ``get_microbatch_iterator`` over the
driver's packed bins, ``process_microbatch`` (NeMo-RL's ``pack_sequences`` and
``get_flash_attention_kwargs``), ``model_forward`` with those kwargs, the DTensor-v2
``LogprobsPostProcessor`` with packing (its unpacking by ``cu_seqlens_q``) and our entropy subclass —
on a bare worker instance holding a transformers model. What a constructed worker would hold and is
set here instead: the model (fp32 transformers Qwen3; at TP > 1 its ``lm_head`` column-parallel
over the TP mesh with torch's own ``ColwiseParallel``, so the logits reach the post-processor as a
vocabulary-sharded DTensor, as in Automodel's TP plan), the meshes, the tokenizer, the config.
Stand-ins: the shared CUDA → CPU ones (``cpu_stand_ins``) and transformers' ``flash_attention_2``
(``cpu_stand_ins.hf_varlen_attention``: flash-attn's varlen kernel is CUDA only).
"""

from __future__ import annotations

from types import SimpleNamespace


def _bare_worker(cls, **attrs):
    obj = cls.__new__(cls)
    obj.timer = SimpleNamespace(start=lambda *a, **k: None, stop=lambda *a, **k: None)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def rank_logprobs(rank: int, model_dir: str, shards: bytes, tp: int, policy_cfg: dict) -> dict:
    import os
    import pickle

    import cpu_stand_ins

    cpu_stand_ins.install()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_stand_ins import hf_varlen_attention
    from cpu_stand_ins.megatron import import_core_then_te_placeholder

    import_core_then_te_placeholder()
    import nemo_automodel.shared.import_utils as iu

    iu.safe_import_te = lambda: (False, None)  # TE-absent path, as test_host_workers
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    mesh = init_device_mesh("cpu", (1, 1, tp), mesh_dim_names=("dp", "cp", "tp"))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_granular.nemo_rl.dtensor_worker import GranularDTensorPolicyWorkerV2Impl

    hf_varlen_attention.install()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.config._attn_implementation = "flash_attention_2"  # what Automodel loads with packing on
    if tp > 1:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(
            model, mesh["tp"], {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        )
    worker = _bare_worker(
        GranularDTensorPolicyWorkerV2Impl,
        cfg=policy_cfg,
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        device_mesh=mesh,
        dp_mesh=mesh["dp"],
        cp_mesh=mesh["cp"],
        tp_mesh=mesh["tp"],
        cp_size=1,
        enable_seq_packing=bool(policy_cfg["sequence_packing"]["enabled"]),
        sampling_params=None,
        dtype=torch.float32,
        autocast_enabled=False,
        allow_flash_attn_args=True,
    )
    (shard,) = pickle.loads(shards)  # DP = 1: every rank gets the one shard
    calls = []
    real = hf_varlen_attention.varlen_attention

    def counted(*a, **k):
        calls.append(int(a[1].shape[2]))
        return real(*a, **k)

    from transformers import AttentionInterface

    AttentionInterface._global_mapping[hf_varlen_attention.NAME] = counted
    out = worker.get_logprobs_with_entropy(shard)
    dist.destroy_process_group()
    return {"logprobs": out["logprobs"], "entropy": out["entropy"], "attention_rows": calls}
