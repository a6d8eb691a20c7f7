"""``nemo-granular export SRC OUT``: checkpoint → Hugging Face model directory, verified by round trip.

``SRC`` is a run dir (uses ``checkpoints/latest``), an embedded step dir, a NeMo-RL ``step_N`` dir
or a NeMo-RL checkpoint dir (highest ``step_N``). The output is built in a temporary directory
next to ``OUT`` and renamed into place only after the weights, config, tokenizer, generation
config, model card and (by default) the verification all succeeded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["main", "export_checkpoint", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from ..cli_common import ArgumentParser  # one-line usage errors, exit 2

    p = ArgumentParser(
        prog="nemo-granular export",
        description="Export a checkpoint to a Hugging Face model directory, verified by round trip.",
    )
    p.add_argument("src", help="run dir, step dir, or NeMo-RL step_N dir")
    p.add_argument("out", help="output directory (must not exist)")
    p.add_argument("--source", choices=("auto", "embedded", "dcp", "megatron"), default="auto")
    p.add_argument(
        "--what",
        choices=("policy", "critic"),
        default="policy",
        help="critic: the SPPO critic (embedded) / PPO value model (NeMo-RL DCP)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB, 2GiB (default 5GB)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--verify",
        dest="verify",
        action="store_true",
        default=None,
        help="reload with transformers and compare with the source (default: on when it fits in memory)",
    )
    g.add_argument("--no-verify", dest="verify", action="store_false")
    p.add_argument(
        "--prompts",
        action="append",
        default=None,
        help="verification prompt (repeatable; default: three built-in prompts)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="HF config dir/name for DCP/Megatron sources (default: policy.model_name of config.yaml)",
    )
    p.add_argument("--json", action="store_true", help="print the export report as JSON")
    return p


def open_source(src: Path, source: str, what: str, scratch_parent: Path, model_config: Optional[str] = None):
    from .source import detect, resolve_step_dir

    step_dir = resolve_step_dir(src)
    kind = detect(step_dir, what) if source == "auto" else source
    if kind == "embedded":
        from .embedded import load_embedded

        return load_embedded(step_dir, what)
    if kind == "dcp":
        from .dcp import load_dcp

        return load_dcp(step_dir, what, model_config)
    from .megatron import load_megatron

    return load_megatron(step_dir, what, scratch_parent, model_config)


def export_checkpoint(
    src,
    out,
    *,
    source: str = "auto",
    what: str = "policy",
    dtype: str = "bf16",
    max_shard_size: str | int = "5GB",
    verify: Optional[bool] = None,
    prompts: Optional[Sequence[str]] = None,
    model_config: Optional[str] = None,
) -> dict:
    """Export ``src`` to ``out`` atomically; returns a report (files, sizes, verification numbers)."""
    if not Path(src).exists():  # before torch is imported (seconds): a mistyped path answers at once
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    import copy
    import shutil

    from .critic import SPPO_VALUE, annotate_critic_config
    from .verify import DEFAULT_PROMPTS, describe, fits_in_memory, verify_export
    from .writer import DTYPES, atomic_output_dir, model_card, parse_size, write_safetensors

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    out = Path(out).absolute()
    if out.exists():
        raise ValueError(f"output {out} already exists (remove it or choose another path)")
    with atomic_output_dir(out) as tmp:
        scratch = tmp / ".scratch"
        scratch.mkdir()
        src_obj = open_source(Path(src), source, what, scratch, model_config)
        config = copy.deepcopy(src_obj.config)
        config.dtype = DTYPES[dtype]
        if src_obj.critic:
            annotate_critic_config(config)
        files = write_safetensors(tmp, src_obj.state_dict, DTYPES[dtype], max_bytes)
        config.save_pretrained(str(tmp))
        if src_obj.generation_config_dir is not None:
            from transformers import GenerationConfig

            GenerationConfig.from_pretrained(str(src_obj.generation_config_dir)).save_pretrained(str(tmp))
        elif not src_obj.critic:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        if src_obj.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(src_obj.tokenizer_dir))
            except (OSError, ValueError) as err:
                raise ValueError(f"cannot load tokenizer {src_obj.tokenizer_dir}: {str(err).splitlines()[0]}") from None
            tok.save_pretrained(str(tmp))
        num_params = src_obj.num_params()
        do_verify = fits_in_memory(num_params) if verify is None else verify
        reason = "--no-verify" if verify is False else "model too large for memory; pass --verify to force"
        report = verify_export(src_obj, tmp, dtype, list(prompts or DEFAULT_PROMPTS)) if do_verify else None
        shutil.rmtree(scratch)
        arch = (config.architectures or [type(config).__name__])[0]
        card = model_card(
            title=f"{src_obj.algorithm or 'RL'}-trained {'critic' if src_obj.critic else 'policy'} ({arch})",
            what=what,
            source_kind=src_obj.kind,
            source_path=str(src_obj.path),
            algorithm=src_obj.algorithm,
            step=src_obj.step,
            dtype=dtype,
            architecture=arch,
            num_params=num_params,
            train_config=src_obj.train_config,
            verification=describe(report, reason),
            critic_meaning=SPPO_VALUE if src_obj.critic else None,
        )
        (tmp / "README.md").write_text(card)
    return {
        "output": str(out),
        "source": src_obj.kind,
        "what": what,
        "step_dir": str(src_obj.path),
        "dtype": dtype,
        "num_params": num_params,
        "files": files["files"],
        "total_size": files["total_size"],
        "num_tensors": files["num_tensors"],
        "verification": report,
        "notes": src_obj.notes,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # keep the CLI's stderr to errors only
    try:
        rep = export_checkpoint(
            args.src,
            args.out,
            source=args.source,
            what=args.what,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            verify=args.verify,
            prompts=args.prompts,
            model_config=args.model_config,
        )
    except OSError as err:
        if isinstance(err, FileNotFoundError):
            raise
        # disk full, permission denied, ...: the export was rolled back; report it on one line
        what = f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err)
        raise ValueError(what) from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
        return 0
    v = rep["verification"]
    print(
        f"exported {rep['source']} {rep['what']} ({rep['num_params']:,} params, {rep['dtype']}) to {rep['output']} "
        f"in {len(rep['files'])} shard(s), {rep['total_size']:,} bytes"
    )
    if v is None:
        print("verification: not run")
    else:
        print(
            f"verification: passed on {v['prompts']} prompts; "
            f"max |Δ| vs rounded source {v['exact_max_abs_diff']:.2e}, "
            f"vs fp32 source {v['drift_max_abs_diff']:.2e} (tol {v['drift_tol']:.2e})"
        )
    for note in rep["notes"]:
        print(f"note: {note}")
    return 0
