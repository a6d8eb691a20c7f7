"""Reader for NeMo-RL DTensor checkpoints (torch distributed checkpoint, sharded over ranks).

Layout (NeMo-RL ``nemo_rl/utils/checkpoint.py``, ``native_checkpoint.py``, ``models/automodel/checkpoint.py``)::

    step_N/config.yaml            policy.model_name (+ policy.hf_config_overrides, policy.tokenizer.name)
    step_N/training_info.json
    step_N/policy/tokenizer/      tokenizer.save_pretrained
    step_N/policy/weights/        DTensor v1: .metadata + __<rank>_0.distcp; keys "model.<hf name>"
                                  (dcp.save({"model": ModelState(model)}) nests the state dict once)
    step_N/policy/weights/model/  DTensor v2, model_save_format=torch_save: .metadata + *.distcp, flat HF names
    step_N/policy/weights/model/consolidated/   v2 with save_consolidated: an HF model dir
    step_N/value/weights/...      PPO value model (sequence classifier, ``value.model_name``)

Reading is single-process: ``torch.distributed.checkpoint.load`` with ``no_dist`` into full-size
plain tensors built from the checkpoint's own metadata, so any number of saving ranks and any
DTensor sharding (dim-0 FSDP, TP) is reassembled. Before loading, every storage item's file and
byte range are checked, so a missing or truncated ``.distcp`` shard is a one-line error.
The v2 default ``model_save_format: safetensors`` (per-rank safetensors pieces carrying DCP
sharding offsets) is read with torch's ``HuggingFaceStorageReader``; a tensor whose chunks do not
cover it (a rank's file missing) is refused.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch

from .embedded import load_hf_dir
from .hf import load_config, to_disk_layout
from .source import ExportSource, algorithm_of, hf_config_overrides, read_json, read_yaml

__all__ = ["find_dcp_dir", "read_dcp", "load_dcp"]


def find_dcp_dir(weights: Path) -> tuple[Path, str]:
    """(directory, layout) with layout ``dcp`` | ``hf`` | ``safetensors``."""
    if (weights / ".metadata").exists():
        return weights, "dcp"
    model = weights / "model"
    if (model / ".metadata").exists():
        return model, "dcp"
    if (model / "consolidated" / "config.json").exists():
        return model / "consolidated", "hf"
    if model.is_dir() and any(f.endswith(".safetensors") for f in os.listdir(model)):
        return model, "safetensors"
    if any(f.endswith(".distcp") for d in (weights, model) if d.is_dir() for f in os.listdir(d)):
        raise ValueError(f"{weights}: .distcp shards without a .metadata file (incomplete checkpoint)")
    raise FileNotFoundError(f"no torch distributed checkpoint (.metadata) in {weights} or {model}")


def read_dcp(path: Path, *, safetensors: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of a DCP directory; non-tensor entries are skipped.

    ``safetensors=True`` reads the Hugging Face storage layout of DCP (``*.safetensors`` files, each
    rank's chunk placed by the ``DCP_SHARDING_INFO`` offsets in its header — what NeMo-RL's v2
    default ``model_save_format: safetensors`` writes) with torch's ``HuggingFaceStorageReader``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if safetensors:
        from .hf import check_safetensors_file

        files = sorted(path.glob("*.safetensors"))
        for f in files:
            check_safetensors_file(f)
        ranks = sorted(int(m.group(1)) for f in files if (m := re.match(r"shard-(\d+)-", f.name)))
        if ranks and ranks != list(range(1, ranks[-1] + 1)):
            gap = min(set(range(1, ranks[-1] + 1)) - set(ranks))
            raise ValueError(
                f"incomplete DCP checkpoint {path}: shard-{gap:05d}-*.safetensors is missing "
                f"(a rank's shard is missing)"
            )
        reader = dcp.HuggingFaceStorageReader(str(path))
        what = f"safetensors headers in {path}"
    else:
        reader = dcp.FileSystemReader(str(path))
        what = str(path / ".metadata")
    try:
        meta = reader.read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling a truncated/corrupt .metadata raises many types
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"corrupt DCP metadata {what}: {type(err).__name__}" + (f": {first}" if first else "")
        ) from None
    if not safetensors:
        sizes: dict[str, int] = {}
        for info in (meta.storage_data or {}).values():
            rel = info.relative_path
            if rel not in sizes:
                f = path / rel
                if not f.exists():
                    raise ValueError(f"missing DCP shard {f} (listed in {path / '.metadata'})")
                sizes[rel] = f.stat().st_size
            if info.offset + info.length > sizes[rel]:
                raise ValueError(
                    f"truncated DCP shard {path / rel}: needs {info.offset + info.length} bytes, has {sizes[rel]}"
                )
    sd = {}
    for fqn, m in meta.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        covered = sum(int(torch.Size(c.sizes).numel()) for c in m.chunks)
        if covered < int(m.size.numel()):
            raise ValueError(
                f"incomplete DCP checkpoint {path}: tensor {fqn} has {covered} of "
                f"{int(m.size.numel())} elements (a rank's shard is missing)"
            )
        sd[fqn] = torch.empty(m.size, dtype=m.properties.dtype)
    if not sd:
        raise ValueError(f"DCP checkpoint {path} holds no tensors")
    try:
        with warnings.catch_warnings():  # single-process load is the intent; silence DCP's notice
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=reader, no_dist=True)
    except Exception as err:  # noqa: BLE001 - any load failure: re-raised as ValueError with its first line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load DCP checkpoint {path}: {first}") from None
    return sd


def load_dcp(step_dir: Path, what: str, model_config: str | None = None) -> ExportSource:
    critic = what == "critic"
    section = "value" if critic else "policy"
    cfg_path = step_dir / "config.yaml"
    train_cfg = read_yaml(cfg_path) if cfg_path.exists() else None
    sec = (train_cfg or {}).get(section) or {}
    weights = step_dir / section / "weights"
    directory, layout = find_dcp_dir(weights)
    tok_dir = step_dir / section / "tokenizer"
    if not tok_dir.is_dir() and critic:
        tok_dir = step_dir / "policy" / "tokenizer"  # PPO builds the critic with the policy's tokenizer
    origin = str(directory)

    overrides = {}
    if layout == "hf":
        config, sd, reference = load_hf_dir(directory, critic=critic, origin=origin)
        model_ref = str(directory)
    else:
        model_ref = model_config or sec.get("model_name")
        if not model_ref:
            raise ValueError(
                f"{cfg_path}: {section}.model_name is needed to rebuild the model config (or pass --model-config DIR)"
            )
        # NeMo-RL's DTensor workers build the model from AutoConfig.from_pretrained(model_name,
        # **hf_config_overrides): the same keywords on whichever config --model-config names
        overrides = hf_config_overrides(sec, f"{cfg_path}: {section}")
        config = load_config(model_ref, critic=critic, **overrides)
        raw = read_dcp(directory, safetensors=layout == "safetensors")
        sd = to_disk_layout(raw, config, critic=critic, origin=origin, strip_prefixes=("model.",))
        reference = _reference_builder(config, sd, critic)

    gen_dir = None
    if not critic and Path(str(model_ref)).is_dir() and (Path(str(model_ref)) / "generation_config.json").exists():
        gen_dir = Path(str(model_ref))
    info = read_json(step_dir / "training_info.json") if (step_dir / "training_info.json").exists() else {}
    step = info.get("step")
    if step is None and step_dir.name.startswith("step_") and step_dir.name[5:].isdigit():
        step = int(step_dir.name[5:])
    src = ExportSource(
        kind="dcp",
        what=what,
        path=step_dir,
        config=config,
        state_dict=sd,
        reference=reference,
        tokenizer_dir=tok_dir if tok_dir.is_dir() else None,
        generation_config_dir=gen_dir,
        train_config=train_cfg,
        algorithm=algorithm_of(train_cfg),
        step=step,
    )
    if overrides:
        src.notes.append(f"{section}.hf_config_overrides applied as in training: {', '.join(sorted(overrides))}")
    if src.tokenizer_dir is None:
        name = ((sec.get("tokenizer") or {}).get("name")) if isinstance(sec.get("tokenizer"), dict) else None
        if name and Path(name).is_dir():
            src.tokenizer_dir = Path(name)
        else:
            src.notes.append(f"no {section}/tokenizer/ in the checkpoint; tokenizer not exported")
    return src


def _reference_builder(config, sd_disk: dict[str, torch.Tensor], critic: bool):
    """The source model for verification: the architecture built from ``config`` with the DCP
    tensors loaded through transformers' own loading path (in-memory conversion included)."""

    def reference() -> torch.nn.Module:
        import tempfile

        from safetensors.torch import save_file

        from .hf import build_model

        model = build_model(config, critic=critic, device="meta")
        mem = model.state_dict()
        if set(sd_disk) <= set(mem):  # identical layouts: load directly, no file round trip
            model = build_model(config, critic=critic)
            missing, unexpected = model.load_state_dict(
                {k: v.float() if v.is_floating_point() else v for k, v in sd_disk.items()}, strict=False
            )
            if unexpected:
                raise ValueError(f"source tensors unknown to the model: {unexpected[0]}")
            if getattr(model.config, "tie_word_embeddings", False):
                model.tie_weights()
            tied = (
                set(model.get_expanded_tied_weights_keys())
                if hasattr(model, "get_expanded_tied_weights_keys")
                else set()
            )
            if set(missing) - tied:
                raise ValueError(f"source model lacks tensor {sorted(set(missing) - tied)[0]}")
            return model.float().eval()
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if critic else AutoModelForCausalLM
        with tempfile.TemporaryDirectory(prefix="nemo-granular-ref-") as tmp:
            save_file(
                {k: v.float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in sd_disk.items()},
                os.path.join(tmp, "model.safetensors"),
            )
            config.save_pretrained(tmp)
            return cls.from_pretrained(tmp, dtype=torch.float32).eval()

    return reference
