"""Reader for NeMo-RL Megatron checkpoints, through Megatron-Bridge when it is installed.

Layout: ``step_N/policy/weights/iter_XXXXXXX/`` (Megatron-Bridge distributed checkpoint with its
``run_config.yaml``), ``step_N/config.yaml`` (``policy.model_name``, ``policy.hf_overrides``),
``step_N/policy/tokenizer/``. The conversion is Megatron-Bridge's public API
(``AutoBridge.from_hf_pretrained(model_name)`` → ``load_megatron_model(iter_dir)`` →
``save_hf_pretrained``) run single-process on CPU under a gloo context, into a scratch directory;
the result is then read like any HF directory and re-written by our writer (dtype, shards, card,
verification against the Bridge's output).

Refused up front, before anything heavy is imported: a Qwen3-MoE checkpoint saved with expert
parallelism > 1 (``expert_model_parallel_size`` in ``run_config.yaml``) — single-process export of
those is a known upstream failure; NeMo-RL's ``examples/converters/convert_megatron_to_hf_gpu.py``
with ``--ep`` is the supported route.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from .source import ExportSource, algorithm_of, read_yaml

__all__ = ["find_iter_dir", "check_megatron_supported", "load_megatron"]


def find_iter_dir(weights: Path) -> Path:
    if (weights / "run_config.yaml").exists():
        return weights
    latest = weights / "latest_checkpointed_iteration.txt"
    if latest.exists():
        text = latest.read_text().strip()
        if text.isdigit() and (weights / f"iter_{int(text):07d}").is_dir():
            return weights / f"iter_{int(text):07d}"
    iters = sorted(c for c in weights.iterdir() if c.is_dir() and re.fullmatch(r"iter_\d+", c.name))
    if not iters:
        raise FileNotFoundError(f"no Megatron iter_* directory in {weights}")
    return iters[-1]


def _find(d: Any, key: str) -> Any:
    """First value of ``key`` anywhere in a nested mapping (run_config.yaml nests it under ``model``)."""
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def check_megatron_supported(run_cfg: dict, model_name: str | None, origin: str) -> None:
    """Refuse Qwen3-MoE with expert parallelism > 1 (known upstream single-process export failure)."""
    model = run_cfg.get("model") if isinstance(run_cfg.get("model"), dict) else run_cfg
    ep = model.get("expert_model_parallel_size", _find(run_cfg, "expert_model_parallel_size")) or 1
    target = str(model.get("_target_", ""))
    experts = model.get("num_moe_experts") or 0
    name = str(model_name or "")
    is_qwen3_moe = ("qwen3moe" in target.lower().replace("_", "")
                    or (bool(experts) and "qwen3" in (target + name).lower())
                    or bool(re.search(r"qwen3.*(moe|-a\d+(\.\d+)?b)", name, re.I)))
    if is_qwen3_moe and int(ep) > 1:
        raise ValueError(
            f"{origin}: Qwen3-MoE checkpoint saved with expert_model_parallel_size={ep}; single-process "
            "Megatron→HF export fails upstream for EP>1 — use NeMo-RL's examples/converters/"
            f"convert_megatron_to_hf_gpu.py --ep {ep} (torchrun on GPUs), then `nemo-granular export` the HF dir")


def load_megatron(step_dir: Path, what: str, scratch_parent: Path, model_config: str | None = None) -> ExportSource:
    from .embedded import load_hf_dir

    if what == "critic":
        raise ValueError(f"{step_dir}: exporting a Megatron value model (critic) is not supported; "
                         "NeMo-RL's converters target the policy LM")
    train_cfg = read_yaml(step_dir / "config.yaml") if (step_dir / "config.yaml").exists() else {}
    policy = train_cfg.get("policy") or {}
    iter_dir = find_iter_dir(step_dir / "policy" / "weights")
    run_cfg_path = iter_dir / "run_config.yaml"
    if not run_cfg_path.exists():
        raise FileNotFoundError(f"{run_cfg_path} not found (incomplete Megatron checkpoint)")
    model_name = model_config or policy.get("model_name")
    check_megatron_supported(read_yaml(run_cfg_path), model_name, str(iter_dir))
    if not model_name:
        raise ValueError(f"{step_dir / 'config.yaml'}: policy.model_name is needed for the Megatron→HF mapping")
    try:
        from megatron.bridge import AutoBridge
        from megatron.bridge.training.model_load_save import temporary_distributed_context
    except ImportError:
        raise ImportError("exporting a Megatron checkpoint needs Megatron-Bridge (package megatron-bridge, "
                          "NeMo-RL's `mcore` extra), which is not installed") from None

    scratch = Path(tempfile.mkdtemp(prefix=".megatron-hf-", dir=scratch_parent))
    out = scratch / "hf"
    bridge = AutoBridge.from_hf_pretrained(model_name, **(policy.get("hf_overrides") or {}))
    with temporary_distributed_context(backend="gloo"):
        try:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
        except Exception:  # CPU-only hosts: seeding the CUDA RNG tracker is optional here
            pass
        megatron_model = bridge.load_megatron_model(str(iter_dir), skip_temp_dist_context=True)
        bridge.save_hf_pretrained(megatron_model, str(out))
    config, sd, reference = load_hf_dir(out, critic=False, origin=str(iter_dir))
    tok = step_dir / "policy" / "tokenizer"
    step = int(step_dir.name[5:]) if step_dir.name.startswith("step_") and step_dir.name[5:].isdigit() else None
    src = ExportSource(kind="megatron", what=what, path=step_dir, config=config, state_dict=sd, reference=reference,
                       tokenizer_dir=tok if tok.is_dir() else (out if (out / "tokenizer_config.json").exists() else None),
                       generation_config_dir=out if (out / "generation_config.json").exists() else None,
                       train_config=train_cfg, algorithm=algorithm_of(train_cfg), step=step)
    src.notes.append("verified against Megatron-Bridge's HF conversion of the checkpoint")
    return src
