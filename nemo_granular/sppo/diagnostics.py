"""SPPO critic diagnostics (SPPO §3.2 eq. 2 and §5.2 / Figure 7).

:func:`critic_diagnostics` summarises how well the critic's V(s_p) = σ(v) predicts the
binary reward R of a batch: BCE (eq. 2), accuracy of ``σ(v) > 0.5`` vs ``R``, mean σ(v),
mean R, Brier score ``(σ(v) − R)²``, and — when some prompts have several samples — the
Pearson and Spearman correlation over prompts between the predicted success probability and
the empirical pass rate (the paper reports Pearson 0.642 / Spearman 0.664 with k = 64).
Pure torch; all reductions are vectorised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["critic_diagnostics", "pearson", "spearman", "average_ranks"]


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of a 1-D tensor, ties getting the mean of their ranks (as scipy's
    ``rankdata(method='average')``)."""
    x = x.reshape(-1)
    s, order = torch.sort(x, stable=True)
    _, inv, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0)
    avg = (ends - counts + ends - 1).double() / 2 + 1
    r = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    r[order] = avg[inv]
    return r


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors; NaN with fewer than 2 points or zero variance."""
    x = x.reshape(-1).double()
    y = y.reshape(-1).double()
    if x.numel() < 2:
        return float("nan")
    xc, yc = x - x.mean(), y - y.mean()
    den = torch.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float((xc * yc).sum() / den) if float(den) > 0 else float("nan")


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation (Pearson of average ranks)."""
    return pearson(average_ranks(x), average_ranks(y))


def critic_diagnostics(
    value_logits: torch.Tensor,
    rewards: torch.Tensor,
    weights: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    min_group_size: int = 2,
) -> dict[str, float]:
    """Critic metrics for one batch.

    Args:
        value_logits: ``[B]`` critic logits v (V(s_p) = σ(v)).
        rewards: ``[B]`` binary rewards R.
        weights: ``[B]`` sample weights (e.g. ``sample_mask`` × has-response); default 1.
        group_ids: ``[B]`` prompt id per sample (e.g. the ``inverse`` of
            :func:`nemo_granular.sppo.critic.unique_prompt_index`). Prompts with at least
            ``min_group_size`` weighted samples enter the correlation.

    Returns ``{bce, acc, value_mean, reward_mean, brier, num_samples}`` plus, when groups
    are given, ``num_prompts``, ``num_prompts_multi`` and — when at least two such prompts
    exist and both sides vary — ``pearson_pass_rate`` and ``spearman_pass_rate``.
    Weighted means over samples; an empty batch gives ``num_samples = 0`` and no means.
    """
    v = value_logits.reshape(-1).double()
    r = rewards.reshape(-1).to(v.device).double()
    if r.shape != v.shape:
        raise ValueError(f"rewards has {r.numel()} entries, value_logits has {v.numel()}")
    w = torch.ones_like(v) if weights is None else weights.reshape(-1).to(v.device).double()
    n = w.sum()
    out: dict[str, float] = {"num_samples": float(n)}
    if float(n) <= 0:
        return out
    p = torch.sigmoid(v)
    bce = F.binary_cross_entropy_with_logits(v, r, reduction="none")
    out.update(
        {
            "bce": float((w * bce).sum() / n),
            "acc": float((w * ((p > 0.5) == (r > 0.5)).double()).sum() / n),
            "value_mean": float((w * p).sum() / n),
            "reward_mean": float((w * r).sum() / n),
            "brier": float((w * (p - r) ** 2).sum() / n),
        }
    )
    if group_ids is not None:
        g = group_ids.reshape(-1).to(v.device).long()
        G = int(g.max()) + 1 if g.numel() else 0
        cnt = torch.zeros(G, dtype=torch.float64, device=v.device).index_add_(0, g, w)
        wins = torch.zeros_like(cnt).index_add_(0, g, w * r)
        pred = torch.zeros_like(cnt).index_add_(0, g, w * p)
        keep = cnt >= min_group_size
        out["num_prompts"] = float((cnt > 0).sum())
        out["num_prompts_multi"] = float(keep.sum())
        if int(keep.sum()) >= 2:
            rate = wins[keep] / cnt[keep]
            pv = pred[keep] / cnt[keep]
            pr, sr = pearson(pv, rate), spearman(pv, rate)
            if pr == pr:  # not NaN
                out["pearson_pass_rate"] = pr
            if sr == sr:
                out["spearman_pass_rate"] = sr
    return out
