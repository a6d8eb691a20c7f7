"""Round-trip verification of an exported directory against the source model.

For each prompt (one unpadded forward each, fp32 compute):

* ``exact``: the exported model loaded by ``from_pretrained(out, dtype=float32)`` against the
  source model **with its weights rounded to the export dtype** (``w → w.to(dtype).float()``). Both
  hold the same numbers, so this checks the files, index, key layout and config exactly, for every
  dtype: ``max |Δ| ≤ 1e-5`` (:data:`EXACT_TOL`).
* ``drift``: the exported model against the full-precision source — the cost of the export dtype
  itself, not an export error. fp32: ``≤ 1e-5`` (it is the exact check); fp16: ``≤ 5e-2·max(1,
  max|ref|)``; bf16: ``≤ 1e-1·max(1, max|ref|)`` (:data:`DRIFT_REL_TOL`), and always finite. bf16
  keeps 8 mantissa bits (relative rounding 2⁻⁹ per weight), which compounds over layers, and in a
  MoE a rounded router logit can switch an expert for a token, so this is a sanity bound against
  dtype catastrophes (fp16 overflow to inf/NaN, a wrong scale) relative to the logit scale; the
  file-level correctness is the ``exact`` check. Measured on the tiny test models (5 seeds,
  weights ~N(0, 0.2)): bf16 drift / max(1, max|logit|) = 0.7–1.4 % dense Qwen3, 0.7–4.8 % Qwen3-MoE;
  fp16 0.1–0.2 % for both.

The compared quantity is the LM logits for a policy and the head logit ``v`` with ``V = σ(v)``
for the SPPO critic (read at the last prompt token). A failure raises a one-line ``ValueError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import torch

from .critic import prompt_values

__all__ = ["EXACT_TOL", "DRIFT_REL_TOL", "DEFAULT_PROMPTS", "fits_in_memory", "prompt_ids", "verify_export"]

EXACT_TOL = 1e-5
DRIFT_REL_TOL = {"fp32": 1e-5, "fp16": 5e-2, "bf16": 1e-1}
DEFAULT_PROMPTS = ("The capital of France is", "Question: what is 12 * 7?\nAnswer:", "def fibonacci(n):")


def available_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fits_in_memory(num_params: int) -> bool:
    """Verification holds two fp32 copies of the model plus the source tensors: ~3 × 4 bytes/param."""
    avail = available_memory()
    return avail is None or 12 * num_params < 0.8 * avail


def prompt_ids(tokenizer, prompts: Sequence[str], vocab_size: int) -> list[torch.Tensor]:
    """Token ids per prompt (tokenizer of the exported dir); fixed random ids when there is none."""
    out = []
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (8 + 3 * i,), generator=g) for i in range(len(prompts))]
    for p in prompts:
        ids = torch.tensor(tokenizer(p)["input_ids"], dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            continue
        if int(ids.max()) >= vocab_size:
            raise ValueError(f"tokenizer produces id {int(ids.max())} >= the model's vocab_size {vocab_size}")
        out.append(ids)
    if not out:
        raise ValueError("no verification prompt produced any token")
    return out


@torch.no_grad()
def _outputs(model, ids: Sequence[torch.Tensor], critic: bool) -> list[torch.Tensor]:
    if critic:
        return [prompt_values(model, ids)]
    return [model(input_ids=x.view(1, -1)).logits.float()[0] for x in ids]


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@torch.no_grad()
def verify_export(source, out_dir: Path, dtype_name: str, prompts: Sequence[str]) -> dict:
    """Run the checks above; returns the measured numbers (raises ``ValueError`` on failure)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from .writer import DTYPES

    dtype = DTYPES[dtype_name]
    tok = AutoTokenizer.from_pretrained(str(out_dir)) if (out_dir / "tokenizer_config.json").exists() else None
    ids = prompt_ids(tok, prompts, int(source.config.get_text_config().vocab_size))

    ref = source.reference()
    full = _outputs(ref, ids, source.critic)
    if dtype != torch.float32:
        for p in ref.parameters():
            p.data = p.data.to(dtype).float()
        rounded = _outputs(ref, ids, source.critic)
    else:
        rounded = full
    del ref

    cls = AutoModelForSequenceClassification if source.critic else AutoModelForCausalLM
    exported = cls.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    got = _outputs(exported, ids, source.critic)
    del exported

    exact = _max_diff(got, rounded)
    drift = _max_diff(got, full)
    scale = max(1.0, max(float(x.abs().max()) for x in full))
    drift_tol = DRIFT_REL_TOL[dtype_name] * (1.0 if dtype_name == "fp32" else scale)
    report = {
        "prompts": len(ids),
        "quantity": "critic logit v (V=sigmoid(v))" if source.critic else "LM logits",
        "exact_max_abs_diff": exact,
        "exact_tol": EXACT_TOL,
        "drift_max_abs_diff": drift,
        "drift_tol": drift_tol,
        "ref_max_abs": scale,
    }
    if source.critic:
        report["values_source"] = [round(float(v), 6) for v in torch.sigmoid(full[0])]
        report["values_exported"] = [round(float(v), 6) for v in torch.sigmoid(got[0])]
        report["value_max_abs_diff"] = float((torch.sigmoid(got[0]) - torch.sigmoid(full[0])).abs().max())
    if not exact <= EXACT_TOL:
        raise ValueError(
            f"verification failed: exported model differs from the source (weights rounded to "
            f"{dtype_name}) by max |Δ| = {exact:.3g} > {EXACT_TOL:g}"
        )
    if not (drift <= drift_tol and all(bool(torch.isfinite(x).all()) for x in got)):
        raise ValueError(
            f"verification failed: {dtype_name} export drifts from the fp32 source by "
            f"max |Δ| = {drift:.3g} > {drift_tol:.3g}"
        )
    return report


def describe(report: Optional[dict], reason: str = "") -> str:
    if report is None:
        return f"not run ({reason})" if reason else "not run"
    text = (
        f"passed on {report['prompts']} prompts ({report['quantity']}): max |Δ| vs source rounded to the "
        f"export dtype = {report['exact_max_abs_diff']:.2e} (≤ {report['exact_tol']:g}); vs fp32 source = "
        f"{report['drift_max_abs_diff']:.2e} (≤ {report['drift_tol']:.2e})"
    )
    if "value_max_abs_diff" in report:
        text += f"; max |ΔV| = {report['value_max_abs_diff']:.2e}"
    return text
