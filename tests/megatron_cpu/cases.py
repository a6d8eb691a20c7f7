"""What each rank of a Megatron-worker world does: build the policy config, construct the real worker
(``GranularMegatronPolicyWorkerImpl`` through ``MegatronPolicyWorkerImpl.__init__``), call it, and
return plain tensors for the parent process to assert on.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"


def tiny_overrides(model_dir: str, *, tp=1, pp=1, cp=1, ep=1, packing=False, precision="float32",
                   seq_len=32, gbs=4, mbs=2) -> dict:
    """Only model size, paths and cluster shrunk, plus the GPU-only fusions turned off."""
    return {
        "model_name": model_dir, "tokenizer": {"name": model_dir},
        "train_global_batch_size": gbs, "train_micro_batch_size": mbs, "logprob_batch_size": mbs,
        "generation_batch_size": mbs, "max_total_sequence_length": seq_len, "precision": precision,
        "make_sequence_length_divisible_by": tp * cp * 2 if cp > 1 else tp,
        "sequence_packing": {"enabled": packing, "train_mb_tokens": seq_len * mbs,
                             "logprob_mb_tokens": seq_len * mbs, "sequence_length_round": 8},
        "megatron_cfg": {
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "context_parallel_size": cp,
            "expert_model_parallel_size": ep, "pipeline_dtype": precision, "sequence_parallel": False,
            "train_iters": 10,  # set by GRPO's setup from the step budget
            # GPU-only fusions (Transformer Engine / CUDA kernels)
            "apply_rope_fusion": False, "moe_permute_fusion": False,
            "optimizer": {"use_precision_aware_optimizer": False,
                          "bf16": precision == "bfloat16", "fp16": precision == "float16"},
            "checkpoint": {"async_save": False},  # needs nvidia-resiliency-ext
        },
    }


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_policy_config(config_file: str, overrides: dict) -> dict:
    from nemo_granular.nemo_rl.configs import load_resolved

    cfg = load_resolved(CONFIGS / config_file)
    return cfg, merge(cfg["policy"], overrides)


def build_worker(rank: int, policy_cfg: dict, *, init_reference_model=True):
    """Stand-ins installed, then the real worker class constructed as the Ray actor would."""
    from megatron_cpu import standins

    standins.import_megatron_then_te_placeholder()
    standins.install(int(os.environ["LOCAL_RANK"]))
    import numpy as np
    from nemo_rl.distributed.named_sharding import NamedSharding
    from transformers import AutoTokenizer

    from nemo_granular.nemo_rl.megatron_worker import GranularMegatronPolicyWorkerImpl

    m = policy_cfg["megatron_cfg"]
    world = int(os.environ["WORLD_SIZE"])
    tp, pp, cp = m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"], m["context_parallel_size"]
    sharding = NamedSharding(layout=np.arange(world).reshape(pp, -1, cp, tp),
                             names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"])
    tok = AutoTokenizer.from_pretrained(policy_cfg["tokenizer"]["name"])
    return GranularMegatronPolicyWorkerImpl(policy_cfg, tok, init_reference_model=init_reference_model,
                                            worker_sharding_annotations=sharding)
