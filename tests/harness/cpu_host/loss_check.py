"""The loss a policy worker computed inside a loop, recomputed in float64 by ``tests/harness/reference.py``.

Every ``GranularPolicyLoss`` call in a policy worker saved what reached it and what it returned
(``cpu_host.hooks._record_policy_loss``; one folder per ``Policy.train`` call, ``cpu_host.launch``).
:func:`check_run` recomputes, for each record, the loss, its gradient w.r.t. the next-token
log-probs and the granular metrics with the naive float64 reference — which rebuilds the groups
itself (segments from the token ids and the tokenizer's delimiter tokens, entropy groups from
``prev_entropy``) and never reads ``granular_group_ids`` — and returns the largest differences.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

import reference as R

METRICS = (
    "clip_frac_low",
    "clip_frac_high",
    "groups_per_response",
    "group_size_mean",
    "probs_ratio",
    "probs_ratio_min",
    "probs_ratio_max",
    "clip_bound_low_mean",
    "clip_bound_high_mean",
)
# the π_old/π_gen correction's diagnostics (docs/algorithms/math.md §10.3), compared where the correction
# is on: the worker's name → the reference's (``metrics["offpolicy"]``); NeMo-RL's ``is_oob_ratio`` is the
# token share (tis, icepop) or, for seq-mask-tis, the masked-group share
OFFPOLICY_METRICS = {
    "gen_mismatch_abs_mean": "gen_mismatch_abs_mean",
    "gen_kl_k3": "gen_kl_k3",
    "gen_mismatch_group_abs_mean": "gen_mismatch_group_abs_mean",
    "is_oob_token_frac": "is_oob_token_frac",
    "is_oob_group_frac": "is_oob_group_frac",
    "sampling_importance_ratio": "sampling_importance_ratio_tokens",
    "is_oob_ratio": None,
}


def offpolicy_pairs(rec: dict, metrics: dict) -> dict[str, tuple[float, float]]:
    """``{name: (worker, reference)}`` of the off-policy diagnostics of one record ({} without the correction;
    the truncation's metrics only with a truncation)."""
    off = rec["config"].get("offpolicy")
    if off is None:
        return {}
    ref = metrics["offpolicy"]
    out = {}
    for k, rk in OFFPOLICY_METRICS.items():
        if k.startswith("is_oob") and off["kind"] is None:
            continue
        if rk is None:
            rk = "is_oob_group_frac" if off["kind"] == "seq-mask-tis" else "is_oob_token_frac"
        out[k] = (float(rec["metrics"][k]), float(ref[rk]))
    return out


def delimiter_ids(model_dir: Path, delimiter: str = "\n\n") -> tuple[int, ...]:
    """Token ids whose text contains ``delimiter`` (what SSPO cuts after), from the tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tuple(i for i in range(len(tok)) if delimiter in tok.decode([i]))


def records(run_dir: Path) -> dict[int, list[dict]]:
    """``{train call: [record, ...]}`` in worker rank, then call order."""
    out = {}
    for folder in sorted((run_dir / "facts.jsonl.loss").glob("train_*")):
        n = int(folder.name.split("_")[1])
        if n < 0:
            continue
        recs = [torch.load(f, weights_only=False) for f in sorted(folder.glob("*.pt"))]
        out[n] = sorted(recs, key=lambda r: (r["rank"], r["call"]))
    return out


def config_of(loss) -> dict:
    """What the float64 reference needs of a ``GranularPolicyLoss``'s settings (read from the object, plain
    values only: the loop's records carry this dict)."""
    g, cfg = loss.granular, loss.cfg
    return {
        "algorithm": g.algorithm,
        "eps_low": cfg.eps_low,
        "eps_high": cfg.eps_high,
        "ratio_clip_c": cfg.ratio_clip_c,
        "kl_coef": cfg.kl_coef,
        "kl_type": cfg.reference_policy_kl_type,
        "kl_in_clamp": cfg.kl_input_clamp_value,
        "kl_out_clamp": cfg.kl_output_clamp_value,
        "sspo": [g.sspo.alpha, g.sspo.beta, g.sspo.gamma],
        "espo_alpha": g.espo.alpha,
        "vocab_size": loss.vocab_size,
        "cuts": list(g.entropy_cut_points),
        "aggregation": g.aggregation,
        # the π_old/π_gen correction (docs/algorithms/math.md §10), None when off
        "offpolicy": (
            {
                "level": g.is_level,
                "kind": cfg.truncated_importance_sampling_type,
                "hi": cfg.truncated_importance_sampling_ratio,
                "lo": cfg.truncated_importance_sampling_ratio_min,
            }
            if cfg.use_importance_sampling_correction
            else None
        ),
    }


def reference_loss(loss, delims: tuple[int, ...]):
    """The float64 reference with ``loss``'s settings, called as a loss function: ``(logp, data, gvs, gvt) →
    (loss, metrics)``."""
    kw = reference_kwargs({"config": config_of(loss)}, delims)
    return lambda logp, data, gvs, gvt: R.granular_loss(logp, data, **kw, gvs=float(gvs), gvt=float(gvt))


def reference_kwargs(rec: dict, delims: tuple[int, ...]) -> dict:
    """The float64 reference loss's settings for one record (all but the batch and the global counts)."""
    cfg = rec["config"]
    kl = None
    if cfg["kl_coef"]:
        kl = {
            "coef": cfg["kl_coef"],
            "type": cfg["kl_type"],
            "in_clamp": cfg["kl_in_clamp"],
            "out_clamp": cfg["kl_out_clamp"],
        }
    spec = dict(R.PRESET_SPECS[cfg["algorithm"]])
    spec.pop("eps")
    spec["aggregation"] = cfg["aggregation"]  # NeMo-RL's token_level_loss may override the preset's
    return dict(
        spec,
        eps_low=cfg["eps_low"],
        eps_high=cfg["eps_high"],
        sspo=tuple(cfg["sspo"]),
        espo_alpha=cfg["espo_alpha"],
        vocab_size=cfg["vocab_size"],
        cuts=tuple(cfg["cuts"]),
        delimiter_ids=delims,
        dual_clip=cfg["ratio_clip_c"],
        kl=kl,
        offpolicy=cfg.get("offpolicy"),
    )


def reference_of(rec: dict, delims: tuple[int, ...]):
    """(loss, grad, metrics, group ids) of the float64 reference for one record."""
    cfg, data = rec["config"], rec["data"]
    spec = R.PRESET_SPECS[cfg["algorithm"]]
    loss, grad, metrics = R.run_ref(
        lambda lp: R.granular_loss(
            lp, data, **reference_kwargs(rec, delims), gvs=rec["global_valid_seqs"], gvt=rec["global_valid_toks"]
        ),
        rec["next_token_logprobs"],
    )
    tm = data["token_mask"][:, 1:] > 0
    if spec["granularity"] == "segment":
        ids = R.segment_group_ids(data["input_ids"][:, 1:], tm, delims)
    elif spec["granularity"] == "entropy_group":
        ids = R.entropy_group_ids(data["prev_entropy"][:, 1:].double(), tm, list(cfg["cuts"]))
    else:
        ids = None
    return loss, grad, metrics, ids


def group_bounds(rec: dict, ids) -> list[tuple[float, float]]:
    """[lo, hi] of every group of a record (rows with sample_mask 1), from the reference's §3 formulas."""
    cfg, data = rec["config"], rec["data"]
    ent = data["prev_entropy"][:, 1:].double()
    out = []
    for i, row in enumerate(ids):
        if float(data["sample_mask"][i]) == 0:
            continue
        for grp in R.groups_of_row(row):
            h = sum(float(ent[i, t]) for t in grp) / len(grp)
            if cfg["algorithm"] == "sspo":
                out.append(R.sspo_bounds(h, *cfg["sspo"]))
            else:
                out.append(R.espo_bounds(h, cfg["espo_alpha"], cfg["vocab_size"]))
    return out


def next_token_logprobs_entropy(model, data: dict, temperature: float):
    """A transformers forward of ``data``'s rows (attention over each row's length): the next-token log-probs
    ``[B, S-1]`` and the entropies of softmax(logits / T) in at least float32, as NeMo-RL trains and scores."""
    ids, lengths = data["input_ids"], data["input_lengths"]
    att = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def with_independent_pi_old(
    run_dir: Path, model_dir: Path, by_call: dict, temperature: float, autocast: torch.dtype | None = torch.bfloat16
) -> dict:
    """The records with ``prev_logprobs`` and ``prev_entropy`` replaced by a transformers forward of the weights
    π_old had, computed as the worker computes them (fp32 parameters under ``autocast``, the policy's
    precision; log-softmax of the float32 logits over the temperature): the generation's state dict at the
    refit before that train call (``Policy.train`` call k follows refit k + 1, saved by ``cpu_host.launch`` as
    ``facts.jsonl.refit/sync_<k + 1>.safetensors``). Valid where the policy's parameters are the refitted ones
    (NeMo-RL main's DTensor refit hands the generation the worker's fp32 parameters; v0.7.0's casts them to
    bf16)."""
    import contextlib

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    precision = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext
    out = {}
    for call, recs in by_call.items():
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
        weights = load_file(str(run_dir / "facts.jsonl.refit" / f"sync_{call + 1}.safetensors"))
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
        out[call] = []
        for rec in recs:
            data = dict(rec["data"])
            ids, lengths = data["input_ids"], data["input_lengths"]
            with torch.no_grad(), precision():
                lp, ent = next_token_logprobs_entropy(model, data, temperature)
            zero = torch.zeros(ids.shape[0], 1, dtype=torch.float64)
            cols = torch.arange(ids.shape[1])[None, :]
            inside = (cols >= 1) & (cols < lengths[:, None])  # NeMo-RL's π_old columns: 1 .. length − 1
            data["prev_logprobs"] = torch.cat([zero, lp.double()], 1) * inside
            data["prev_entropy"] = torch.cat([zero, ent.double()], 1) * inside
            out[call].append(dict(rec, data=data))
    return out


def check_run(run_dir: Path, model_dir: Path, *, pi_old_temperature: float | None = None) -> dict:
    """Recompute every record of a run; the largest |worker − reference| of each quantity (the gradient
    relative to the reference's largest element, per record), and what the records cover. With
    ``pi_old_temperature``, π_old comes from :func:`with_independent_pi_old`, not from the worker's records."""
    delims = delimiter_ids(model_dir)
    by_call = records(run_dir)
    if pi_old_temperature is not None:
        by_call = with_independent_pi_old(run_dir, model_dir, by_call, pi_old_temperature)
    err = {"loss": 0.0, "grad": 0.0, **{k: 0.0 for k in METRICS}}
    summary = {
        "calls": sorted(by_call),
        "records": 0,
        "ids_equal": True,
        "grad_nonzero": 0,
        "per_record": [],
        "offpolicy_err": {},
    }
    for call, recs in by_call.items():
        for j, rec in enumerate(recs):
            loss, grad, metrics, ids = reference_of(rec, delims)
            summary["records"] += 1
            err["loss"] = max(err["loss"], abs(rec["loss"] - float(loss)))
            scale = float(grad.abs().max())
            if scale > 0:
                summary["grad_nonzero"] += 1
                err["grad"] = max(err["grad"], float((rec["grad"].double() - grad).abs().max()) / scale)
            for k in METRICS:
                a, b = float(rec["metrics"][k]), float(metrics[k])
                if math.isinf(b) and a == b:
                    continue
                err[k] = max(err[k], abs(a - b))
            off = offpolicy_pairs(rec, metrics)
            for k, (a, b) in off.items():
                summary["offpolicy_err"][k] = max(summary["offpolicy_err"].get(k, 0.0), abs(a - b))
            if ids is not None and "granular_group_ids" in rec["data"]:
                got = rec["data"]["granular_group_ids"][:, 1:].tolist()
                summary["ids_equal"] &= got == ids
            summary["per_record"].append(
                {
                    "call": call,
                    "index": j,
                    "of": len(recs),
                    "rank": rec["rank"],
                    "rows": int(rec["next_token_logprobs"].shape[0]),
                    "clip": float(metrics["clip_frac_low"]) + float(metrics["clip_frac_high"]),
                    "clip_worker": float(rec["metrics"]["clip_frac_low"]) + float(rec["metrics"]["clip_frac_high"]),
                    "ratio_min": float(metrics["probs_ratio_min"]),
                    "ratio_max": float(metrics["probs_ratio_max"]),
                    # the reference's off-policy diagnostics ({} without the correction)
                    "offpolicy": {k: b for k, (_, b) in off.items()},
                    "bounds": group_bounds(rec, ids)
                    if ids is not None and rec["config"]["algorithm"] in ("sspo", "espo")
                    else [],
                }
            )
    summary["err"] = err
    return summary


_CACHE: dict = {}


def check_run_cached(run_dir: Path, model_dir: Path, **kw) -> dict:
    """:func:`check_run`, once per run directory (and options) in this process (several tests read it)."""
    key = (str(run_dir), str(model_dir), tuple(sorted(kw.items())))
    if key not in _CACHE:
        _CACHE[key] = check_run(run_dir, model_dir, **kw)
    return _CACHE[key]
