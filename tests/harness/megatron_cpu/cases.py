"""What each rank of a Megatron-worker world does, and the driver's part around it.

Rank side (:func:`run_layout`, in a spawned rank of :func:`megatron_cpu.world.run_world`): build the
policy config from a shipped example config, construct the real worker
(``GranularMegatronPolicyWorkerImpl`` → ``MegatronPolicyWorkerImpl.__init__``), then call
``get_logprobs_with_entropy`` and ``train`` with the granular loss, and return plain tensors.

Driver side (:class:`Driver`, in the test process): shards the batch and puts the results back in
order with NeMo-RL's own ``Policy`` code (``_shard_for_logprob`` / ``_shard_for_train``,
``BatchedDataDict.from_batches`` / ``reorder_data``), as ``Policy`` does around its Ray workers.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "examples" / "configs"


def tiny_overrides(
    model_dir: str, *, tp=1, pp=1, cp=1, ep=1, sp=False, packing=None, precision=None, seq_len=32, gbs=8, mbs=2
) -> dict:
    """Only model size, paths and cluster shrunk (``None`` keeps the shipped value), plus the
    GPU-only fusions and services turned off."""
    m: dict = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,
        "num_layers_in_first_pipeline_stage": None,
        "num_layers_in_last_pipeline_stage": None,
        "sequence_parallel": sp,
        "train_iters": 10,  # set by GRPO's setup from the step budget
        # GPU-only: Transformer Engine / CUDA kernels / nvidia-resiliency-ext
        "apply_rope_fusion": False,
        "moe_permute_fusion": False,
        "optimizer": {"use_precision_aware_optimizer": False},
        "checkpoint": {"async_save": False},
    }
    out: dict = {
        "model_name": model_dir,
        "tokenizer": {"name": model_dir},
        "train_global_batch_size": gbs,
        "train_micro_batch_size": mbs,
        "logprob_batch_size": mbs,
        "generation_batch_size": mbs,
        "max_total_sequence_length": seq_len,
        "make_sequence_length_divisible_by": tp * cp * 2 if cp > 1 else tp,
        "sequence_packing": {
            "train_mb_tokens": seq_len * mbs,
            "logprob_mb_tokens": seq_len * mbs,
            "sequence_length_round": 8,
        },
        "megatron_cfg": m,
    }
    if packing is not None:
        out["sequence_packing"]["enabled"] = packing
    if precision is not None:
        out["precision"] = precision
        m["pipeline_dtype"] = precision
        m["optimizer"].update(bf16=precision == "bfloat16", fp16=precision == "float16")
    return out


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(config_file: str, policy_overrides: dict) -> tuple[dict, dict]:
    """(whole resolved config, policy section with the overrides)."""
    from nemo_granular.nemo_rl.configs import load_resolved

    cfg = load_resolved(CONFIGS / config_file)
    return cfg, merge(cfg["policy"], policy_overrides)


def coords(rank: int, policy_cfg: dict, world: int) -> dict:
    """Rank → (pp, dp, cp, tp) exactly as ``Policy`` lays out its workers (NamedSharding)."""
    m = policy_cfg["megatron_cfg"]
    shape = (m["pipeline_model_parallel_size"], -1, m["context_parallel_size"], m["tensor_model_parallel_size"])
    layout = np.arange(world).reshape(shape)
    pp, dp, cp, tp = (int(i[0]) for i in np.nonzero(layout == rank))
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "dp_size": layout.shape[1]}


def build_worker(policy_cfg: dict, *, init_reference_model=True, init_optimizer=True):
    """Stand-ins installed, then the real worker class constructed as the Ray actor would."""
    from megatron_cpu import standins

    standins.install(int(os.environ["LOCAL_RANK"]))
    from nemo_rl.distributed.named_sharding import NamedSharding
    from transformers import AutoTokenizer

    from nemo_granular.nemo_rl.megatron_worker import GranularMegatronPolicyWorkerImpl

    m = policy_cfg["megatron_cfg"]
    world = int(os.environ["WORLD_SIZE"])
    layout = np.arange(world).reshape(
        m["pipeline_model_parallel_size"], -1, m["context_parallel_size"], m["tensor_model_parallel_size"]
    )
    sharding = NamedSharding(
        layout=layout, names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"]
    )
    tok = AutoTokenizer.from_pretrained(policy_cfg["tokenizer"]["name"])
    return GranularMegatronPolicyWorkerImpl(
        policy_cfg,
        tok,
        init_reference_model=init_reference_model,
        init_optimizer=init_optimizer,
        worker_sharding_annotations=sharding,
    )


def record_chunking(calls: list) -> None:
    """Append ``(kind, tokens, chunk_size)`` for every sequence-chunked log-prob (NeMo-RL's
    ``ChunkedDistributedLogprob``: π_old pass and training loss) and every entropy (the plugin's
    ``vocab_parallel_entropy``, π_old pass) this rank computes; the calls themselves are unchanged."""
    from nemo_rl.distributed import model_utils

    from nemo_granular.nemo_rl import workers

    chunked, entropy = model_utils.ChunkedDistributedLogprob.apply, workers.vocab_parallel_entropy

    def logprob(logits, target, start, end, chunk_size, *rest):
        calls.append(("logprob", logits.shape[-2], chunk_size))
        return chunked(logits, target, start, end, chunk_size, *rest)

    def entropy_(logits, group=None, chunk_size=None):
        calls.append(("entropy", logits.shape[-2], chunk_size))
        return entropy(logits, group, chunk_size)

    model_utils.ChunkedDistributedLogprob.apply = staticmethod(logprob)
    workers.vocab_parallel_entropy = entropy_


def run_layout(rank: int, spec: dict) -> dict:
    """One rank: construct, weights as loaded, log-probs + entropy, one train step, log-probs after."""
    from megatron_cpu import mapping

    t0 = time.perf_counter()
    full, policy = load_config(spec["config"], spec["overrides"])
    worker = build_worker(policy)
    chunking: list = []
    record_chunking(chunking)
    from nemo_granular.losses import GranularPolicyLoss

    c = coords(rank, policy, int(os.environ["WORLD_SIZE"]))
    from megatron_cpu import standins

    out: dict = {"coords": c, "init_s": time.perf_counter() - t0, "te_takers": standins.te_takers()}
    logprob_shards, train_shards = pickle.loads(spec["logprob_shards"]), pickle.loads(spec["train_shards"])
    out["weights"] = mapping.local_pieces(worker.model, worker.optimizer)

    t = time.perf_counter()
    got = worker.get_logprobs_with_entropy(data=logprob_shards[c["dp"]])
    out["logprobs"], out["entropy"] = got["logprobs"], got["entropy"]
    out["logprobs_s"] = time.perf_counter() - t

    loss_fn = GranularPolicyLoss(
        full["loss_fn"], delimiter_table=spec["delimiter_table"], vocab_size=spec["vocab_size"]
    )
    if spec.get("espo_alpha") is not None:
        loss_fn.set_espo_alpha(spec["espo_alpha"])  # the driver's, from the first π_old pass
    seen: dict = {}
    real_step = worker.optimizer.step

    def step():  # the gradients Megatron hands its optimizer (after its own DP/TP reductions)
        named = dict(worker.model.named_parameters())
        seen["grads"] = mapping.local_pieces(
            worker.model, worker.optimizer, {n: getattr(p, "main_grad", None) for n, p in named.items()}
        )
        seen["before"] = {n: p.detach().clone() for n, p in named.items()}
        seen["lr"] = sorted({g["lr"] for g in worker.optimizer.param_groups})  # the scheduler's, this step
        return real_step()

    worker.optimizer.step = step
    t = time.perf_counter()
    metrics = worker.train(train_shards[c["dp"]], loss_fn, gbs=spec["gbs"], mbs=spec["mbs"])
    out["train_s"] = time.perf_counter() - t
    worker.optimizer.step = real_step
    named = dict(worker.model.named_parameters())
    out["grads"], out["lr"] = seen["grads"], seen["lr"]
    out["update"] = mapping.local_pieces(
        worker.model, worker.optimizer, {n: p.detach() - seen["before"][n] for n, p in named.items()}
    )
    out["metrics"] = {
        "global_loss": metrics["global_loss"],
        "grad_norm": metrics["grad_norm"],
        "all_mb_metrics": metrics["all_mb_metrics"],
    }
    # the next forward all-gathers the updated parameter shards (overlap_param_gather)
    out["logprobs_after"] = worker.get_logprobs(data=logprob_shards[c["dp"]])["logprobs"]
    out["chunking"] = chunking
    return out


class Driver:
    """NeMo-RL's ``Policy`` sharding and re-assembly, run in the test process (no Ray)."""

    def __init__(self, policy_cfg: dict, world: int):
        from nemo_rl.models.policy.lm_policy import Policy

        m = policy_cfg["megatron_cfg"]
        self.dp = world // (
            m["tensor_model_parallel_size"] * m["pipeline_model_parallel_size"] * m["context_parallel_size"]
        )
        packing = bool(policy_cfg["sequence_packing"]["enabled"])
        self._policy = types.SimpleNamespace(
            cfg=policy_cfg,
            data_parallel_size=self.dp,
            use_dynamic_batches=False,
            use_sequence_packing=packing,
            sequence_packing_args={
                "algorithm": policy_cfg["sequence_packing"]["algorithm"],
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "sequence_length_pad_multiple": policy_cfg["make_sequence_length_divisible_by"],
                **(
                    {"microbatch_order": policy_cfg["sequence_packing"]["microbatch_order"]}
                    if policy_cfg["sequence_packing"].get("microbatch_order")
                    else {}
                ),
            },
        )
        self._shard_logprob = Policy._shard_for_logprob
        self._shard_train = Policy._shard_for_train

    def logprob_shards(self, data):
        shards, self._unsorted = self._shard_logprob(self._policy, data)
        return list(shards)

    def train_shards(self, data, gbs: int):
        return list(self._shard_train(self._policy, data, gbs))

    def gather(self, per_dp: list[dict], key: str) -> torch.Tensor:
        """Per-DP-rank outputs back into one batch in the caller's order."""
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        out = BatchedDataDict.from_batches([BatchedDataDict({key: r[key]}) for r in per_dp])
        if self._unsorted is not None:
            out.reorder_data(self._unsorted)
        return out[key]


def construct_each(rank: int, items: list[dict]) -> list[dict]:
    """Construct the worker for each shipped config in turn in this process and run one
    ``get_logprobs_with_entropy``; return what reached the worker and the results."""
    out = []
    for item in items:
        t0 = time.perf_counter()
        _, policy = load_config(item["config"], item["overrides"])
        worker = build_worker(policy)
        init_s = time.perf_counter() - t0
        (shard,) = pickle.loads(item["logprob_shards"])
        got = worker.get_logprobs_with_entropy(data=shard)
        model = worker.megatron_cfg.model
        out.append(
            {
                "config": item["config"],
                "init_s": init_s,
                "logprobs": got["logprobs"],
                "entropy": got["entropy"],
                "reached": {
                    "bf16": model.bf16,
                    "recompute_granularity": model.recompute_granularity,
                    "defer_fp32_logits": bool(worker.defer_fp32_logits),
                    "use_distributed_optimizer": worker.megatron_cfg.optimizer.use_distributed_optimizer,
                    "overlap_param_gather": worker.megatron_cfg.ddp.overlap_param_gather,
                    "packing": bool(worker.cfg["sequence_packing"]["enabled"]),
                    "num_moe_experts": model.num_moe_experts,
                    "router_replay": worker._router_replay_enabled,
                },
            }
        )
        del worker
        # each worker is a fresh Ray actor process in NeMo-RL; here the next one starts from
        # Megatron's process-global state torn down (microbatch calculator, parallel state, ...)
        from megatron.bridge.training.initialize import destroy_global_state

        destroy_global_state()
    return out
