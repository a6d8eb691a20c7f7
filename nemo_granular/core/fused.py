"""Hot-path forms of the policy loss (docs/algorithms/math.md §2–§5): float masks, weighted sums, analytic gradient.

Why this shape (profiled on CPU, ``[64, 4095]`` float32, one thread): a comparison that writes
a ``bool`` tensor costs ~3× one that writes 0/1 floats, ``torch.where`` on a bool mask ~10× a
float multiply, and every autograd node adds a backward pass. So here masks are 0/1 tensors of
the compute dtype, every masked mean is a weighted sum, and — because the clipped objective is
linear in the per-token surrogate — its gradient with respect to the logprobs is written in
closed form and handed to autograd by :class:`LinearizedLoss` (one saved tensor, one backward
multiply) instead of a ~20-node graph.

The compute dtype is ``promote_types(dtype, float32)``: float64 inputs stay float64, bf16/fp16
are computed in float32.
"""

from __future__ import annotations

import torch

__all__ = [
    "compute_dtype",
    "indicator",
    "finite_valid",
    "masked_values",
    "substitute_nonfinite",
    "clip_terms",
    "prob_error_sums",
    "masked_extrema",
    "LinearizedLoss",
    "RowIndex",
    "FewGroupIndex",
    "FEW_GROUPS_MAX",
    "row_constant",
]

# a penalty that pushes excluded entries out of a min/max (ratios are ≤ exp(20) ≈ 4.9e8)
_BIG = 1e30


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss computes in: the input's, promoted to at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _broadcast(a, b) -> torch.Size:
    sa = a.shape if torch.is_tensor(a) else ()
    sb = b.shape if torch.is_tensor(b) else ()
    if sa == sb or not sb:
        return sa
    return sb if not sa else torch.broadcast_shapes(sa, sb)  # (the general helper costs ~10 µs a call)


def indicator(op, a, b, like: torch.Tensor) -> torch.Tensor:
    """``op(a, b)`` (a comparison such as ``torch.lt``) as 0/1 values of ``like``'s dtype."""
    out = torch.empty(_broadcast(a, b), dtype=like.dtype, device=like.device)
    return op(a, b, out=out)


def finite_valid(mask: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
    """``mask`` (0/1) times 1 where every one of ``values`` is finite: x − x is 0 exactly for a
    finite x and NaN for ±inf/NaN, so one sum of such differences tests them all."""
    z = values[0] - values[0]
    for x in values[1:]:
        z.add_(x).sub_(x)  # (0 + x) − x is exactly 0 for finite x
    return indicator(torch.eq, z, 0, mask).mul_(mask)


def masked_values(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """x where ``valid`` is 1, 0 elsewhere (non-finite entries of x included): a new tensor."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0).mul_(valid)


def substitute_nonfinite(x: torch.Tensor, fallback: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """x where ``valid`` and x is finite, ``fallback`` where valid and x is not, 0 elsewhere
    (``fallback`` must already be 0 outside ``valid``). Exact: one of the two terms is 0."""
    ok = finite_valid(valid, x)
    return masked_values(x, ok).add_(fallback * (1 - ok))


def clip_terms(ratio, adv, lo, hi, dual_clip: float | None = None, ratio_clamped=None):
    """Per-token clipped surrogate (docs/algorithms/math.md §4) and the derivative of it with respect to the ratio.

    c = min(r·A, clip(r, lo, hi)·A), with dual clip C: c = max(c, C·A) where A < 0.
    Returns ``(c, r_clamped, low, high, keep)``: ``keep`` = 1 where the min keeps the unclipped
    branch, r·A ≤ clip(r)·A (then dc/dr = A), else the clip removes the gradient — low when A < 0
    (r < lo), high when A > 0 (r > hi); the dual clip also removes it where it holds c at C·A.
    So dc/dr = keep·A. ``ratio``/``lo``/``hi`` may be per-row ``[B, 1]`` tensors or numbers;
    ``adv`` is ``[B, T]``; ``ratio_clamped`` = clip(r, lo, hi) when the caller has it (per group).
    """
    rc = torch.clamp(ratio, lo, hi) if ratio_clamped is None else ratio_clamped
    ra, rca = ratio * adv, rc * adv
    c = torch.minimum(ra, rca)
    keep = indicator(torch.le, ra, rca, adv)  # one comparison instead of four (A's sign × the two bounds)
    clipped = 1 - keep
    low = indicator(torch.lt, adv, 0, adv).mul_(clipped)
    high = clipped.sub_(low)
    if dual_clip is not None:
        # for A >= 0, c >= 0 = C·min(A, 0): the max leaves it alone, so no mask is needed
        floor = adv.clamp(max=0).mul_(dual_clip)
        keep.sub_(indicator(torch.gt, floor, c, adv))
        c = torch.maximum(c, floor)
    return c, rc, low, high, keep


def prob_error_sums(d: torch.Tensor, w: torch.Tensor, kl_type: str,
                    is_ratio_bound: float | None = None) -> dict[str, torch.Tensor]:
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
    pen = (1 - live) * _BIG  # pushes the excluded entries out of the min and the max
    any_live = live.sum() > 0
    out = []
    for x in xs:  # loop over the (one or two) statistics, not over data
        out += [torch.where(any_live, (x + pen).amin(), inf), torch.where(any_live, (x - pen).amax(), -inf)]
    return out


def row_constant(x: torch.Tensor, valid: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor | None:
    """x's value per row ``[B]`` when x is the same on every ``valid`` token of each row (a
    response-level advantage, as GRPO's), else None. max_t(x − pen) ≤ min_t(x + pen) with pen =
    1e30 outside ``valid`` (a row without valid tokens passes; a non-finite x does not). One sync;
    ``scratch``: a free buffer of x's shape and dtype to work in (else one is allocated)."""
    buf = torch.mul(valid, -_BIG, out=scratch).add_(_BIG)  # pen
    live = indicator(torch.lt, buf.amin(-1), 1, x)  # rows with a valid token (1), without (0)
    hi = buf.neg_().add_(x).amax(-1)  # x − pen
    # (x − pen − x)·(−1) = pen exactly (pen is 0 or 1e30 ≫ |x|): x + pen in the same buffer
    if not bool((hi <= buf.sub_(x).neg_().add_(x).amin(-1)).all()):
        return None
    return hi * live  # a row without valid tokens: 0


class LinearizedLoss(torch.autograd.Function):
    """A scalar whose gradient with respect to ``logp`` is the given tensor: ``value`` and
    ``grad`` = d value / d logp are computed by the caller without autograd."""

    @staticmethod
    def forward(ctx, logp, value, grad):
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return (grad * grad_out).to(ctx.logp_dtype), None, None


class RowIndex:
    """:class:`~nemo_granular.core.ratios.GroupIndex` for one group per row (sequence
    granularity): sums are row sums ``[B, 1]`` and gathers are broadcasts (no scatter).
    Values passed to :meth:`sum` must already be 0 outside the valid tokens."""

    def __init__(self, batch: int):
        self.B, self.G = batch, 1

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values.sum(-1, keepdim=True)

    def sum2(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sum(a), self.sum(b)

    def gather(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group


# up to this many groups per row :class:`FewGroupIndex` is used (ESPO: 2): on CPU a `scatter_add`
# of a [64, 4095] float32 tensor costs ~25 element-wise passes, the one-hot form ~2 per group
FEW_GROUPS_MAX = 4


class FewGroupIndex:
    """:class:`~nemo_granular.core.ratios.GroupIndex` for a few groups per row (ESPO's entropy
    groups), as a one-hot table O_igt = [id_it = g] ``[B, G, T]`` of the compute dtype:
    group sums Σ_t O_igt·x_it, gathers Σ_g O_igt·v_ig (exact: one term is v, the others 0·v).
    Ids must be in −1..G−1 (−1: no group: sums skip it, gathers read 0); ``member`` (0/1 of the
    compute dtype): the tokens that may belong to a group (the others count as id −1). Values
    summed and gathered must be finite (0·inf is NaN). Row 0 of the stored table is the dummy
    group (the tokens of no group), for :meth:`sums`."""

    def __init__(self, group_ids: torch.Tensor, num_groups: int, dtype: torch.dtype,
                 member: torch.Tensor | None = None):
        self.B, self.T = group_ids.shape
        self.G = num_groups
        ids = group_ids.to(dtype).add_(1)  # small integers: exact in float (a float comparison is ~4x an int64 one)
        if member is not None:
            ids.mul_(member)
        cols = torch.arange(num_groups + 1, dtype=dtype, device=ids.device)
        self.table = torch.empty(self.B, num_groups + 1, self.T, dtype=dtype, device=ids.device)
        torch.eq(ids[:, None, :], cols[None, :, None], out=self.table)
        self.onehot = self.table[:, 1:]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return torch.mul(self.onehot, values[:, None, :]).sum(-1)

    def sums(self, channels: list[torch.Tensor]) -> torch.Tensor:
        """C channels at once, ``[B, G + 1, C]`` with the dummy group first (as
        :meth:`GroupIndex.sums <nemo_granular.core.ratios.GroupIndex.sums>`): one batched matmul."""
        return torch.bmm(torch.stack(channels, dim=1), self.table.transpose(1, 2)).transpose(1, 2)

    def counts(self, dtype: torch.dtype) -> torch.Tensor:
        """Tokens per group (its members), ``[B, G]`` in ``dtype``."""
        return self.onehot.sum(-1).to(dtype)

    def sum2(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sum(a), self.sum(b)

    def gather(self, per_group: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([torch.zeros_like(per_group[:, :1]), per_group], dim=1)  # the dummy group reads 0
        return torch.bmm(padded[:, None, :], self.table).squeeze(1)
