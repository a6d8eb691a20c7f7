"""SPPO's two losses inside NeMo-RL's PPO loop, recomputed in float64 from what the workers received.

The records are written by ``cpu_host.hooks._record_clipped_pg_loss`` (every NeMo-RL
``ClippedPGLossFn`` call of a policy worker) and ``cpu_host.hooks._record_value_loss`` (every
``SequenceValueLoss`` call of a value worker), under ``<facts>.ppo_loss/``. The references below are
written from the formulas (docs/algorithms/math.md §6–§7, SPPO eq. 1–3; NeMo-RL's clipped objective
with its dual clip), element by element in Python floats; they call neither the package nor NeMo-RL.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


def records(run_dir: Path, kind: str) -> list[dict]:
    """Every ``kind`` (``policy`` | ``value``) record of a run, by worker process then call order."""
    folder = run_dir / "facts.jsonl.ppo_loss"
    recs = [torch.load(f, weights_only=False) for f in sorted(folder.glob(f"{kind}_*.pt"))]
    return sorted(recs, key=lambda r: (r["rank"], r["pid"], r["call"]))


def policy_loss_reference(rec: dict) -> dict:
    """SPPO's policy step (SPPO eq. 3, math.md §7): the token-level clipped objective with ε_low / ε_high,
    NeMo-RL's dual clip c for A < 0, no KL, ``token_mean`` over the global token count:

        r_t = exp(log π_θ − log π_old),   o_t = min(r_t A, clip(r_t, 1 − ε_low, 1 + ε_high) A),
        o_t ← max(o_t, c A) where A < 0,  loss = −Σ_t mask_t o_t / global_valid_toks.

    Returns the loss and the ratio statistics over the masked tokens."""
    cfg, d = rec["config"], rec["data"]
    lo, hi, c = cfg["ratio_clip_min"], cfg["ratio_clip_max"], cfg["ratio_clip_c"]
    lp = rec["next_token_logprobs"].double().tolist()
    prev = d["prev_logprobs"].double()[:, 1:].tolist()
    adv = d["advantages"].double()[:, 1:].tolist()
    tmask = d["token_mask"].double()[:, 1:].tolist()
    smask = d["sample_mask"].double().reshape(-1).tolist()
    total, ratios, advs = 0.0, [], []
    for b in range(len(lp)):
        for t in range(len(tmask[b])):
            m = tmask[b][t] * smask[b]
            if m == 0:
                continue
            r, a = math.exp(lp[b][t] - prev[b][t]), adv[b][t]
            o = min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            if c is not None and a < 0:
                o = max(o, c * a)
            total += -m * o
            ratios.append(r)
            advs.append(a)
    return {
        "loss": total / rec["global_valid_toks"],
        "ratio_min": min(ratios, default=1.0),
        "ratio_max": max(ratios, default=1.0),
        "tokens": len(ratios),
        "adv_nonzero": sum(a != 0 for a in advs),
    }


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def value_loss_reference(rec: dict) -> dict:
    """SPPO's critic loss (SPPO eq. 2, math.md §7): V(s_p) = σ(v), v the critic output at the last prompt
    token, which NeMo-RL's right-shifted values hold at the first response column (first 1 of
    ``token_mask``); BCE(σ(v), R) = −R log σ(v) − (1 − R) log(1 − σ(v)) per response, summed over the
    rows with ``sample_mask`` 1 and a response token, divided by ``global_valid_seqs``."""
    d = rec["data"]
    vals = rec["logits"].double()
    vals = vals.squeeze(-1) if vals.dim() == 3 else vals
    vals = vals.tolist()
    tmask = d["token_mask"].tolist()
    smask = d["sample_mask"].double().reshape(-1).tolist()
    rew = d["rewards"].double().reshape(-1).tolist()
    total, preds = 0.0, []
    for b in range(len(vals)):
        cols = [t for t in range(len(vals[b])) if tmask[b][t]]
        if smask[b] == 0 or not cols:
            continue
        s, r = _sigmoid(vals[b][cols[0]]), rew[b]
        total += -(r * math.log(s) + (1 - r) * math.log(1 - s))
        preds.append(s)
    return {"loss": total / rec["global_valid_seqs"], "rows": len(preds), "preds": preds}


def advantage_reference(row: dict) -> list[tuple[float, float]]:
    """(received, expected) advantage of every row with a response: SPPO eq. 1, A = R − σ(v)."""
    out = []
    for has, sm, r, v, a in zip(
        row["has_response"], row["sample_mask"], row["rewards"], row["value_logit"], row["advantage"]
    ):
        if has and sm:
            out.append((a, r - _sigmoid(v)))
    return out
