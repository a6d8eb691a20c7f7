"""The small helpers of the loss's hot path: the compute dtype, 0/1 masks of it, and a safe division.

Why 0/1 floats (profiled on CPU, ``[64, 4095]`` float32, one thread): a comparison that writes a
``bool`` tensor costs ~3× one that writes 0/1 floats, and ``torch.where`` on a bool mask ~10× a
float multiply. So the loss's masks are 0/1 tensors of the compute dtype and every masked mean is
a weighted sum. The compute dtype is ``promote_types(dtype, float32)``: float64 inputs stay
float64, bf16/fp16 are computed in float32.
"""

from __future__ import annotations

import torch

__all__ = [
    "PENALTY",
    "compute_dtype",
    "indicator",
    "finite_valid",
    "masked_values",
    "substitute_nonfinite",
    "row_constant",
    "safe_divide",
]

# a penalty that pushes excluded entries out of a min/max (ratios are ≤ exp(20) ≈ 4.9e8)
PENALTY = 1e30


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


def row_constant(x: torch.Tensor, valid: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor | None:
    """x's value per row ``[B]`` when x is the same on every ``valid`` token of each row (a
    response-level advantage, as GRPO's), else None. A non-finite x on a valid token does not pass.
    A row without valid tokens passes with some finite value (callers weight rows by their tokens).

    First over the whole row (one pass, one row min/max): NeMo-RL's advantage estimators expand one
    value per response over every token of its row (``advantages.expand(mask.shape)``), so that
    usually decides it. Else over the valid tokens only: max_t(x − pen) ≤ −max_t(−x − pen) with pen =
    1e30 outside ``valid`` (a row without valid tokens gives 0; x − 2x is NaN for ±inf): four
    passes, two row maxima. One sync each; ``scratch``: a free buffer of x's shape and dtype for the
    second (else one is allocated)."""
    hi, lo = x.amax(-1), x.amin(-1)  # (aminmax over a dim is ~4x these two on CPU)
    if bool((hi - lo == 0).all()):  # ±inf − ±inf is NaN: a non-finite row fails here
        return hi
    buf = torch.add(valid, -1, out=scratch).mul_(PENALTY)  # −pen
    hi = buf.add_(x).amax(-1)  # max over the valid tokens of x (≈ −1e30 for a row without one)
    # (x − pen) − 2x = −x − pen: exact where pen is 0 (2x and x − 2x are exact), ≪ 0 elsewhere
    lo = buf.sub_(x, alpha=2).amax(-1).neg_()  # min over the valid tokens of x (≈ +1e30 without one)
    if not bool((hi <= lo).all()):
        return None
    return hi * indicator(torch.lt, lo, PENALTY / 2, x)  # a row without valid tokens: 0


def safe_divide(num: torch.Tensor, den) -> torch.Tensor:
    """num / den with den clamped to 1e-8 (den may be a tensor or number; 0/0 → 0)."""
    dt = num.dtype if num.is_floating_point() else torch.float32
    if not torch.is_tensor(den):
        den = torch.tensor(float(den), dtype=dt, device=num.device)
    return num / den.to(num.device, dt).clamp(min=1e-8)
