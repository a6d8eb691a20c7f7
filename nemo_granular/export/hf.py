"""Hugging Face helpers shared by every export source: safe weight readers and layout checks.

Two key layouts exist for one architecture in transformers ≥ 5:

* the **in-memory** layout, ``model.state_dict()`` (e.g. Qwen3-MoE experts fused into
  ``mlp.experts.gate_up_proj`` of shape ``[E, 2I, H]``) — what a NeMo-RL DTensor (DCP) checkpoint
  holds, since it is saved from the live module;
* the **on-disk** layout ``save_pretrained`` writes (per-expert ``mlp.experts.<e>.gate_proj.weight``
  …, tied weights dropped) — what the embedded trainer's ``policy/`` holds and what we export.

:func:`to_disk_layout` accepts either, converts in-memory → on-disk with transformers' own reverse
conversion, and checks names and shapes against a model built on the ``meta`` device from the
config, so that a missing, unexpected or mis-shaped tensor is a one-line ``ValueError`` before any
output is written. Only safe loaders are used: safetensors and ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "read_hf_weights",
    "check_safetensors_file",
    "meta_model",
    "disk_layout",
    "to_disk_layout",
    "load_config",
    "build_model",
]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_safetensors_file(path: Path) -> None:
    """Header sanity check of a ``.safetensors`` file: readable JSON header and every tensor's byte
    range inside the file (catches truncated files with a message naming the file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"truncated safetensors file {path} ({size} bytes, no header)")
        (hlen,) = struct.unpack("<Q", raw)
        if 8 + hlen > size:
            raise ValueError(f"truncated safetensors file {path}: header says {hlen} bytes, file has {size}")
        try:
            header = json.loads(f.read(hlen))
        except ValueError as err:
            raise ValueError(f"corrupt safetensors header in {path}: {_first_line(err)}") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + hlen + end > size:
        raise ValueError(f"truncated safetensors file {path}: tensors need {8 + hlen + end} bytes, file has {size}")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    check_safetensors_file(path)
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type
        raise ValueError(f"cannot read {path}: {_first_line(err)}") from None


def read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """State dict of an HF model directory: ``model.safetensors``, a sharded safetensors index, or
    (fallback) ``pytorch_model.bin`` read with ``torch.load(weights_only=True)``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"corrupt index {index}: {_first_line(err)}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).exists()]
        if missing:
            raise ValueError(f"missing shard {model_dir / missing[0]} listed in {index.name}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(_load_safetensors(model_dir / f))
        absent = sorted(set(weight_map) - set(sd))
        if absent:
            raise ValueError(f"tensor {absent[0]} listed in {index} is in none of its shards")
        return sd
    single = model_dir / "model.safetensors"
    if single.exists():
        return _load_safetensors(single)
    binary = model_dir / "pytorch_model.bin"
    if binary.exists():
        try:
            sd = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - unpickling errors come in many types; re-raised as ValueError
            raise ValueError(f"cannot read {binary} with weights_only=True: {_first_line(err)}") from None
        if not isinstance(sd, dict):
            raise ValueError(f"{binary} does not hold a state dict")
        return sd
    raise FileNotFoundError(f"no model weights (model.safetensors[.index.json] or pytorch_model.bin) in {model_dir}")


def load_config(path_or_name: str | Path, *, critic: bool = False, **overrides: Any):
    """``AutoConfig`` from a directory (or a hub id, offline cache permitting); ``critic`` makes it a
    ``num_labels=1`` sequence-classification config."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(path_or_name), **overrides)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load model config {path_or_name}: {_first_line(err)}") from None
    if critic:
        cfg.num_labels = 1
        arch = (cfg.architectures or [""])[0]
        if arch and not arch.endswith("ForSequenceClassification"):
            cfg.architectures = [arch.replace("ForCausalLM", "") + "ForSequenceClassification"]
    return cfg


def build_model(config, *, critic: bool, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """An (uninitialised-on-meta or random-on-cpu) model of the config's architecture."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if critic else AutoModelForCausalLM
    with torch.device(device):
        try:
            return cls.from_config(config, dtype=dtype)
        except ValueError as err:
            raise ValueError(
                f"transformers cannot build {config.model_type!r} as "
                f"{'a sequence classifier' if critic else 'a causal LM'}: {_first_line(err)}"
            ) from None


def meta_model(config, *, critic: bool):
    return build_model(config, critic=critic, device="meta")


def _revert(model, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory → on-disk conversion (identity where the architecture has none)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: one layout only
        return sd
    return revert_weight_conversion(model, sd)


def _drop_tied(model, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tied = {}
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    ):
        try:
            tied = model.get_expanded_tied_weights_keys()
        except AttributeError:
            tied = {}
    return {k: v for k, v in sd.items() if k not in tied}


def disk_layout(config, *, critic: bool) -> tuple[dict[str, torch.Size], dict[str, torch.Size], Any]:
    """(on-disk name → shape, in-memory name → shape, meta model) for ``config``."""
    model = meta_model(config, critic=critic)
    mem = dict(model.state_dict())
    disk = _revert(model, _drop_tied(model, mem))
    return ({k: v.shape for k, v in disk.items()}, {k: v.shape for k, v in mem.items()}, model)


def _strip_wrappers(key: str) -> str:
    for frag in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        key = key.replace(frag, "")
    return key


def to_disk_layout(
    sd: dict[str, torch.Tensor], config, *, critic: bool, origin: str, strip_prefixes: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Validate ``sd`` against ``config`` and return it in the on-disk layout.

    ``strip_prefixes`` are tried in order (e.g. ``"model."`` for NeMo-RL DTensor-v1 checkpoints,
    whose ``dcp.save({"model": ModelState})`` nests every key one level); the prefix is removed
    only when every key has it and the stripped names match the architecture better.
    """
    disk, mem, model = disk_layout(config, critic=critic)
    sd = {_strip_wrappers(k): v for k, v in sd.items()}

    def score(keys) -> int:
        return len(set(keys) & (set(disk) | set(mem)))

    for prefix in strip_prefixes:
        if sd and all(k.startswith(prefix) for k in sd):
            stripped = {k[len(prefix) :]: v for k, v in sd.items()}
            if score(stripped) > score(sd):
                sd = stripped
    tied = set(mem) - set(_drop_tied(model, mem))
    sd = {k: v for k, v in sd.items() if k not in tied}
    if set(sd) <= set(disk) or not (set(sd) <= set(mem)):
        out = sd
    else:  # in-memory layout (e.g. fused MoE experts): shapes first, then transformers' reverse conversion
        _check_shapes(sd, {k: v for k, v in mem.items() if k not in tied}, config, origin)
        try:
            out = _revert(model, dict(sd))
        except Exception as err:  # noqa: BLE001 - any conversion failure: re-raised as ValueError
            raise ValueError(f"{origin}: cannot convert to the Hugging Face layout: {_first_line(err)}") from None
    _check_shapes(out, disk, config, origin)
    return out


def _check_shapes(sd: dict[str, torch.Tensor], expected: dict[str, torch.Size], config, origin: str) -> None:
    arch = (getattr(config, "architectures", None) or [config.model_type])[0]
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{origin}: missing tensor {missing[0]}{more} required by {arch}")
    if unexpected:
        more = f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{origin}: unexpected tensor {unexpected[0]}{more} for {arch}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != tuple(shape):
            raise ValueError(f"{origin}: tensor {k} has shape {tuple(sd[k].shape)}, config expects {tuple(shape)}")
