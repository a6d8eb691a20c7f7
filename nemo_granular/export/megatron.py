"""Reader for NeMo-RL Megatron checkpoints, through Megatron-Bridge.

Layout (what NeMo-RL's Megatron policy worker writes through Megatron-Bridge's ``save_checkpoint``)::

    step_N/config.yaml                          policy.model_name (+ policy.hf_config_overrides)
    step_N/policy/weights/latest_checkpointed_iteration.txt
    step_N/policy/weights/iter_0000000/         torch_dist checkpoint: .metadata, __<rank>_0.distcp,
                                                metadata.json, common state, run_config.yaml

The conversion is Megatron-Bridge's public API (``AutoBridge.from_hf_pretrained(model_name)`` →
``load_megatron_model(iter_dir)`` → ``save_hf_pretrained``) in ONE process on CPU under a
one-rank gloo group, into a scratch directory; the result is then read like any HF directory and
re-written by our writer (dtype, shards, card, verification against the Bridge's output).

**Any saved parallel layout is read in that one process** (TP, PP, EP, ETP): a torch_dist
checkpoint stores every tensor under its global shape with each rank's chunk offsets (for MoE
experts the global expert index is one axis), and ``load_megatron_model`` builds the model at
TP = PP = EP = 1 and loads it through ``torch.distributed.checkpoint``, which reassembles the
chunks. Executed on CPU (tests/test_export_megatron.py) for Qwen3-MoE checkpoints saved at EP1, EP2
and TP2×EP2 and dense ones at TP1, TP2 and PP2.

One setting is changed for that build: the MoE token dispatcher becomes ``allgather``. Qwen3-MoE
checkpoints record ``alltoall``, whose constructor creates a CUDA stream
(``MoEAlltoAllTokenDispatcher.__init__``), so on a host without a GPU the single-process build
stops there for every EP; the dispatcher only acts in a forward pass, which the export never runs.

Refused up front, before anything heavy is imported: checkpoint formats other than
``torch_dist`` (Megatron-Bridge's single-process loader reads only that one) and the value model.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from .source import ExportSource, algorithm_of, hf_config_overrides, read_yaml

__all__ = ["find_iter_dir", "saved_parallelism", "check_megatron_supported", "load_megatron"]

PARALLEL_KEYS = {
    "tensor_model_parallel_size": "TP",
    "pipeline_model_parallel_size": "PP",
    "context_parallel_size": "CP",
    "expert_model_parallel_size": "EP",
    "expert_tensor_parallel_size": "ETP",
}


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


def saved_parallelism(run_cfg: dict) -> dict[str, int]:
    """{TP, PP, CP, EP, ETP} the checkpoint was saved with (``model`` section of run_config.yaml)."""
    model = run_cfg.get("model") if isinstance(run_cfg.get("model"), dict) else {}
    out = {}
    for key, short in PARALLEL_KEYS.items():
        value = model.get(key)
        numeric = isinstance(value, (int, float)) or (isinstance(value, str) and value.isdigit())
        out[short] = int(value) if numeric else 1
    return out


def check_megatron_supported(run_cfg: dict, origin: str) -> None:
    """Refuse what Megatron-Bridge's single-process loader cannot read (one line, naming why)."""
    ckpt = run_cfg.get("checkpoint") if isinstance(run_cfg.get("checkpoint"), dict) else {}
    fmt = ckpt.get("ckpt_format", "torch_dist")
    if fmt not in (None, "torch_dist"):
        raise ValueError(
            f"{origin}: checkpoint.ckpt_format={fmt!r}; Megatron-Bridge's load_megatron_model "
            "reads only torch_dist checkpoints"
        )


def load_megatron(step_dir: Path, what: str, scratch_parent: Path, model_config: str | None = None) -> ExportSource:
    from .embedded import load_hf_dir

    if what == "critic":
        raise ValueError(
            f"{step_dir}: exporting a Megatron value model (critic) is not supported; "
            "NeMo-RL's converters target the policy LM"
        )
    train_cfg = read_yaml(step_dir / "config.yaml") if (step_dir / "config.yaml").exists() else {}
    policy = train_cfg.get("policy") or {}
    iter_dir = find_iter_dir(step_dir / "policy" / "weights")
    run_cfg_path = iter_dir / "run_config.yaml"
    if not run_cfg_path.exists():
        raise FileNotFoundError(f"{run_cfg_path} not found (incomplete Megatron checkpoint)")
    run_cfg = read_yaml(run_cfg_path)
    check_megatron_supported(run_cfg, str(iter_dir))
    model_name = model_config or policy.get("model_name")
    overrides = hf_config_overrides(policy, f"{step_dir / 'config.yaml'}: policy")
    ignored = None
    if overrides and ((policy.get("pretrained_checkpoint") or {}).get("format") == "megatron_bridge"):
        # NeMo-RL ignores them for a megatron_bridge start (architecture from its run_config.yaml)
        ignored, overrides = sorted(overrides), {}
    if not model_name:
        raise ValueError(f"{step_dir / 'config.yaml'}: policy.model_name is needed for the Megatron→HF mapping")
    try:
        from megatron.bridge import AutoBridge
        from megatron.bridge.training.model_load_save import temporary_distributed_context
    except ImportError as err:
        raise ImportError(
            "exporting a Megatron checkpoint needs Megatron-Bridge (package megatron-bridge, "
            f"NeMo-RL's `mcore` extra); importing it failed: {err}"
        ) from None

    scratch = Path(tempfile.mkdtemp(prefix=".megatron-hf-", dir=scratch_parent))
    out = scratch / "hf"
    log = io.StringIO()
    try:  # Bridge prints progress to stdout; keep the CLI's stdout for its own report (--json)
        with contextlib.redirect_stdout(log):
            _convert(AutoBridge, temporary_distributed_context, model_name, overrides, iter_dir, out)
    except BaseException:
        sys.stderr.write(log.getvalue()[-4000:])
        raise
    config, sd, reference = load_hf_dir(out, critic=False, origin=str(iter_dir))
    tok = step_dir / "policy" / "tokenizer"
    step = int(step_dir.name[5:]) if step_dir.name.startswith("step_") and step_dir.name[5:].isdigit() else None
    if tok.is_dir():
        tokenizer_dir = tok
    else:
        tokenizer_dir = out if (out / "tokenizer_config.json").exists() else None
    src = ExportSource(
        kind="megatron",
        what=what,
        path=step_dir,
        config=config,
        state_dict=sd,
        reference=reference,
        tokenizer_dir=tokenizer_dir,
        generation_config_dir=out if (out / "generation_config.json").exists() else None,
        train_config=train_cfg,
        algorithm=algorithm_of(train_cfg),
        step=step,
    )
    layout = "×".join(f"{k}{v}" for k, v in saved_parallelism(run_cfg).items() if v > 1) or "no model parallelism"
    src.notes.append(
        f"Megatron checkpoint saved with {layout}; read in one process by Megatron-Bridge (torch_dist resharding)"
    )
    src.notes.append("verified against Megatron-Bridge's HF conversion of the checkpoint")
    if overrides:
        src.notes.append(f"policy.hf_config_overrides applied as in training: {', '.join(sorted(overrides))}")
    if ignored:
        src.notes.append(
            f"policy.hf_config_overrides ({', '.join(ignored)}) not applied: NeMo-RL ignores them for "
            "pretrained_checkpoint.format megatron_bridge"
        )
    return src


def _convert(
    AutoBridge: Any, temporary_distributed_context: Any, model_name: str, overrides: dict, iter_dir: Path, out: Path
) -> None:
    # the call NeMo-RL's HF import makes (community_import.import_model_from_hf_name), overrides included
    bridge = AutoBridge.from_hf_pretrained(model_name, **overrides)
    with temporary_distributed_context(backend="gloo"):
        try:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
        except Exception:  # noqa: BLE001 - CPU-only hosts: nothing is initialised randomly
            pass  # (the weights come from the checkpoint)
        # alltoall's constructor needs a CUDA stream; no forward runs here, so allgather is equivalent
        megatron_model = bridge.load_megatron_model(
            str(iter_dir), mp_overrides={"moe_token_dispatcher_type": "allgather"}
        )
        bridge.save_hf_pretrained(megatron_model, str(out))
