"""NeMo-RL's metric helpers in closed form: the π_old-vs-π_gen diagnostics from one ``expm1``, and
masked extrema (docs/algorithms/math.md §10.3; the loss's metrics, :mod:`nemo_granular.loss_metrics`)."""

from __future__ import annotations

import torch

from .masks import PENALTY

__all__ = ["prob_error_sums", "masked_extrema"]


def prob_error_sums(
    d: torch.Tensor, w: torch.Tensor, kl_type: str, is_ratio_bound: float | None = None
) -> dict[str, torch.Tensor]:
    """NeMo-RL's π_old-vs-π_gen diagnostics, Σ_t w_t·f(d_t) with d = log π_old − log π_gen:

    token_mult_prob_error f = exp|d|; gen_kl_error f = KL estimator of ``calculate_kl(gen, old)``
    (k1 −d, k2 d²/2, k3 eᵈ − 1 − d); policy_kl_error the same with −d; js_divergence_error
    f = NeMo-RL's JSD expression, which simplifies exactly to log((1 + eᵈ)/2) − d/2.

    All from one expm1: with m = eᵈ − 1 and q = 1 − e⁻ᵈ = m/(1 + m): eᵈ − 1 − d = m − d,
    e⁻ᵈ − 1 + d = d − q, exp|d| = 1 + max(m, −q), JSD = log1p(m/2) − d/2 — no cancellation
    between terms of size 1 (the textbook forms lose all digits of a 1e-7 KL in float32).
    With ``is_ratio_bound`` B, also NeMo-RL's token-level ``sampling_importance_ratio``
    Σ w·exp(min(d, B)) = Σ w·min(1 + m, e^B) from the same m. ``d`` and ``w`` must be 0 outside
    the valid tokens.
    """
    m = torch.expm1(d)
    q = m / (m + 1)  # 1 − e⁻ᵈ
    w = w.reshape(-1)

    def wsum(x):
        return torch.dot(x.reshape(-1), w)

    if kl_type == "k1":
        gen_kl = -wsum(d)
        pol_kl = -gen_kl
    elif kl_type == "k2":
        gen_kl = pol_kl = wsum(d * d) / 2
    elif kl_type == "k3":  # per token, then summed: the difference of two sums would cancel
        gen_kl, pol_kl = wsum(m - d), wsum(d - q)
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type: unknown value {kl_type!r}")
    sw = w.sum()
    mult = wsum(torch.maximum(m, q.neg_())) + sw  # exp|d| = 1 + max(eᵈ − 1, e⁻ᵈ − 1)
    out = {"token_mult_prob_error": mult, "gen_kl_error": gen_kl, "policy_kl_error": pol_kl}
    if is_ratio_bound is not None:
        e_max = torch.exp(torch.tensor(is_ratio_bound, dtype=m.dtype)).item()
        out["sampling_importance_ratio"] = wsum((m + 1).clamp_(max=e_max))
    out["js_divergence_error"] = wsum(torch.log1p(m.mul_(0.5)).sub_(d * 0.5))
    return out


def masked_extrema(xs: list[torch.Tensor], live: torch.Tensor) -> list[torch.Tensor]:
    """[min, max] of each of ``xs`` over the entries where ``live`` (0/1, broadcastable) is 1;
    (inf, −inf) when there is none (NeMo-RL's sentinels). Entries must be finite and |x| ≪ 1e30."""
    inf = torch.full((), float("inf"), dtype=xs[0].dtype, device=xs[0].device)
    if xs[0].numel() == 0:
        return [inf, -inf] * len(xs)
    pen = (1 - live) * PENALTY  # pushes the excluded entries out of the min and the max
    any_live = live.sum() > 0
    out = []
    for x in xs:  # loop over the (one or two) statistics, not over data
        out += [torch.where(any_live, (x + pen).amin(), inf), torch.where(any_live, (x - pen).amax(), -inf)]
    return out
