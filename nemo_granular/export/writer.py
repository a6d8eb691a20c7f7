"""Sharded safetensors writer, atomic output directory and model card.

Contract of the written directory (the Hugging Face layout ``from_pretrained`` reads):

* one ``model.safetensors`` when every tensor fits in ``max_shard_size``; otherwise
  ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` =
  ``{"metadata": {"total_size": <bytes of all tensors>}, "weight_map": {name: shard file}}``;
* shards are filled greedily in natural key order; a shard is closed when the next tensor would
  push it past ``max_shard_size`` (a tensor larger than the limit gets a shard of its own);
* floating-point tensors are cast to the export dtype, integer/bool buffers keep theirs.

:func:`atomic_output_dir` creates ``.<name>.tmp-<random>`` next to the output and renames it into
place only when the body finished without an exception, so an interrupted or failed export leaves
neither the output directory nor the temporary one behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ..cli_common import current_umask

__all__ = ["DTYPES", "parse_size", "plan_shards", "write_safetensors", "atomic_output_dir", "model_card"]

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"5GB"`` → 5·10⁹ bytes (decimal units, ``KiB``/``MiB``/``GiB`` binary; a bare number is bytes)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"--max-shard-size: cannot parse {text!r} (use e.g. 5GB, 500MB, 2GiB, 1000)")
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {text!r}")
    return size


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _export_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype


def plan_shards(
    shapes: Mapping[str, tuple[torch.Size, torch.dtype]], dtype: torch.dtype, max_bytes: int
) -> list[list[str]]:
    """Greedy shard plan: ``shapes`` maps name → (shape, source dtype); returns lists of names."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(shapes, key=_natural_key):
        shape, src = shapes[name]
        out = dtype if src.is_floating_point else src
        nbytes = int(torch.Size(shape).numel()) * out.itemsize
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_safetensors(
    out_dir: Path, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, max_bytes: int
) -> dict[str, Any]:
    """Write ``state_dict`` (cast to ``dtype``) as sharded safetensors into ``out_dir``.

    Each shard's tensors are cast and copied only while that shard is written (peak extra memory
    = one shard). Returns ``{"files": [...], "total_size": bytes, "num_tensors": n}``.
    """
    from safetensors.torch import save_file

    plan = plan_shards({k: (v.shape, v.dtype) for k, v in state_dict.items()}, dtype, max_bytes)
    n = len(plan)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, keys in zip(names, plan):
        shard = {}
        for k in keys:
            t = state_dict[k]
            # copy=True: tensors never share storage inside a file (safetensors refuses shared storage)
            shard[k] = t.detach().to(device="cpu", dtype=_export_dtype(t, dtype), copy=True).contiguous()
            total += shard[k].numel() * shard[k].element_size()
            weight_map[k] = fname
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        os.chmod(out_dir / fname, 0o666 & ~current_umask())  # safetensors creates 0600 files
        del shard
    if n > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items(), key=lambda kv: _natural_key(kv[0]))),
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"files": names, "total_size": total, "num_tensors": len(weight_map)}


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``out``; rename it to ``out`` on success.

    Refuses an existing ``out`` (ValueError). On any exception — ``KeyboardInterrupt`` included —
    the temporary directory is removed and the exception propagates.
    """
    out = Path(out).absolute()
    if out.exists():
        raise ValueError(f"output {out} already exists (remove it or choose another path)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:  # read-only, no permission, a file on the way: name the output the user gave
        raise OSError(err.errno, err.strerror, str(out)) from None
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700; the export is an ordinary directory
        yield tmp
        if out.exists():
            raise ValueError(f"output {out} appeared while exporting; not overwriting it")
        os.rename(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        name = Path(err.filename) if isinstance(err.filename, str) else None
        if name is not None and err.strerror and (name == tmp or tmp in name.parents):
            # a file of the temporary directory: say it as the file of the output it was to become
            raise OSError(err.errno, err.strerror, str(out / name.relative_to(tmp))) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_card(
    *,
    title: str,
    what: str,
    source_kind: str,
    source_path: str,
    algorithm: str | None,
    step: int | None,
    dtype: str,
    architecture: str,
    num_params: int,
    train_config: Any,
    verification: str,
    critic_meaning: Mapping[str, str] | None = None,
) -> str:
    """A short ``README.md``: YAML front matter, provenance, verification and the training config."""
    import yaml

    tags = ["nemo-granular", "reinforcement-learning"] + ([algorithm] if algorithm else [])
    front = {"library_name": "transformers", "tags": tags}
    if what == "critic":
        front["pipeline_tag"] = "text-classification"
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    kind = "SPPO critic (scalar value head)" if what == "critic" else "policy (causal LM)"
    lines += [
        f"Exported by `nemo-granular export` (source format: **{source_kind}** checkpoint).",
        "",
        f"- model: {kind}, `{architecture}`, {num_params:,} parameters, dtype `{dtype}`",
        f"- algorithm: `{algorithm or 'unknown'}`" + (f", training step {step}" if step is not None else ""),
        f"- source: `{source_path}`",
        f"- verification: {verification}",
        "",
    ]
    if critic_meaning:
        lines += [
            "## Reading the value",
            "",
            "This is `AutoModelForSequenceClassification` with `num_labels=1`. Feed the **prompt only**;",
            "the head's logit at the last non-pad token of the prompt is v, and",
            f"`V(prompt) = sigmoid(v) = {critic_meaning.get('meaning', 'P(reward=1 | prompt)')}`",
            "(SPPO: the critic predicts the probability that a response sampled from the policy is",
            "rewarded 1). The same description is stored in `config.json` under `sppo_value`.",
            "",
            "```python",
            "tok = AutoTokenizer.from_pretrained(path)",
            "critic = AutoModelForSequenceClassification.from_pretrained(path)",
            "v = torch.sigmoid(critic(**tok(prompt, return_tensors='pt')).logits[0, 0])",
            "```",
            "",
        ]
    if train_config:
        text = yaml.safe_dump(train_config, sort_keys=False, default_flow_style=False).strip()
        lines += ["## Training configuration", "", "```yaml", text, "```", ""]
    return "\n".join(lines)
