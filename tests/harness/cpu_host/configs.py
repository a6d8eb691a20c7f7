"""Child configs of the shipped examples, shrunk for CPU: model, data, paths, cluster and sizes only.

Each child inherits a shipped config (``defaults:``) and overrides what a 2-core machine needs
(a tiny local model, 4 prompts × 4 samples, 3 steps, short sequences, one fake GPU per worker)
plus the extra keys a test names. Everything else — the loss, the estimator, the worker
backend, NeMo-RL's own defaults — stays what the shipped config says.
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "examples" / "configs"


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def shrink(
    run_dir: Path,
    model_dir: Path,
    data: Path,
    *,
    env: str = "math",
    gpus: int = 1,
    steps: int = 3,
    prompts: int = 4,
    generations: int = 4,
    train_batch: int = 8,
    seq: int = 48,
) -> dict:
    """The overrides every CPU run gets (sizes, paths, cluster); NeMo-RL semantics unchanged."""
    ds = {"dataset_name": "ResponseDataset", "data_path": str(data), "input_key": "problem", "output_key": "answer"}
    return {
        "grpo": {
            "num_prompts_per_step": prompts,
            "num_generations_per_prompt": generations,
            "max_num_steps": steps,
            "max_num_epochs": 100,
            "val_period": 0,
            "val_at_start": False,
            "val_at_end": False,
            "max_val_samples": prompts,
            "val_batch_size": prompts,
            "seed": 7,
        },
        "policy": {
            "model_name": str(model_dir),
            "tokenizer": {"name": str(model_dir)},
            "train_global_batch_size": train_batch,
            "train_micro_batch_size": 4,
            "logprob_batch_size": 4,
            "max_total_sequence_length": seq,
            "make_sequence_length_divisible_by": 1,
            # packing makes Automodel load flash_attention_2 (CUDA kernels): docs/nemo-rl.md §7
            "sequence_packing": {"enabled": False},
            "generation": {"max_new_tokens": 12, "vllm_cfg": {"max_model_len": seq}},
        },
        "data": {
            "_override_": True,
            "max_input_seq_length": seq // 2,
            "shuffle": False,
            "num_workers": 0,
            "use_multiple_dataloader": False,
            "train": ds,
            "validation": dict(ds),
            "default": {
                "prompt_file": None,
                "system_prompt_file": None,
                "processor": "math_hf_data_processor",
                "env_name": env,
            },
        },
        "env": {env: {"num_workers": 1, "math_verify_impl": "hf_math_verify"}},
        "logger": {
            "log_dir": str(run_dir / "logs"),
            "tensorboard_enabled": True,
            "wandb_enabled": False,
            "mlflow_enabled": False,
            "swanlab_enabled": False,
            "monitor_gpus": False,
            "num_val_samples_to_print": 0,
        },
        "checkpointing": {
            "enabled": True,
            "checkpoint_dir": str(run_dir / "checkpoints"),
            "save_period": 1,
            "metric_name": None,
            "keep_top_k": 10,
            "checkpoint_must_save_by": None,
        },
        "cluster": {"gpus_per_node": gpus, "num_nodes": 1},
    }


def shrink_ppo(
    run_dir: Path,
    model_dir: Path,
    critic_dir: Path,
    data: Path,
    *,
    gpus: int = 2,
    steps: int = 3,
    prompts: int = 8,
    train_batch: int = 4,
    seq: int = 48,
) -> dict:
    """:func:`shrink` for NeMo-RL's PPO loop (one sample per prompt) and its value model."""
    over = shrink(
        run_dir,
        model_dir,
        data,
        gpus=gpus,
        steps=steps,
        prompts=prompts,
        generations=1,
        train_batch=train_batch,
        seq=seq,
    )
    grpo = over.pop("grpo")
    over["ppo"] = {**grpo, "num_generations_per_prompt": 1}
    over["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] = gpus  # the inference cluster's shape
    micro = max(1, train_batch // gpus)  # a global batch split over DP must fill a micro-batch
    over["policy"].update(train_micro_batch_size=micro, logprob_batch_size=micro)
    over["value"] = {
        "model_name": str(critic_dir),
        "train_global_batch_size": train_batch,
        "train_micro_batch_size": micro,
        "max_total_sequence_length": seq,
        "make_sequence_length_divisible_by": 1,
        "sequence_packing": {"enabled": False},
    }
    return over


def write_child(path: Path, parent: Path, overrides: dict, extra: dict | None = None) -> Path:
    body = _merge(overrides, extra or {})
    data = body.pop("data", None)
    text = f"defaults: {parent}\n" + yaml.safe_dump(body, sort_keys=False)
    if data is not None:  # NeMo-RL's `_override_` replaces the parent's data section instead of merging it
        text += yaml.safe_dump({"data": data}, sort_keys=False)
    path.write_text(text)
    return path


def shrink_megatron(
    run_dir: Path,
    model_dir: Path,
    data: Path,
    *,
    env: str = "math",
    steps: int = 3,
    seq: int = 48,
    micro: int = 4,
    generations: int = 4,
    train_batch: int = 8,
    gpus: int = 1,
) -> dict:
    """:func:`shrink` for a Megatron-backend parent on ``gpus`` workers (data parallel; every model-parallel
    size 1): sequence packing kept (the CPU attention stand-in takes packed sequences) with bin sizes for
    ``seq``, a small refit buffer for a tiny model, the GPU-only fusions off (Transformer Engine / CUDA
    kernels: rotary fusion, fused MoE permutation, TE's precision-aware FusedAdam) and asynchronous
    checkpoint saves off (nvidia-resiliency-ext, a GPU-node package)."""
    over = shrink(
        run_dir,
        model_dir,
        data,
        env=env,
        gpus=gpus,
        steps=steps,
        seq=seq,
        generations=generations,
        train_batch=train_batch,
    )
    policy = over["policy"]
    del policy["make_sequence_length_divisible_by"]  # the parent's (= TP)
    policy["sequence_packing"] = {
        "train_mb_tokens": seq * micro,
        "logprob_mb_tokens": seq * micro,
        "sequence_length_round": 8,
    }
    policy.update(train_micro_batch_size=micro, logprob_batch_size=micro, refit_buffer_size_gb=0.0001)
    policy["megatron_cfg"] = {
        "tensor_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
        "sequence_parallel": False,
        "apply_rope_fusion": False,
        "moe_permute_fusion": False,
        "optimizer": {"use_precision_aware_optimizer": False},
        "checkpoint": {"async_save": False},
    }
    return over
