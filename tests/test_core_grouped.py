"""The clipped objective written per group (``core.objective.grouped_clipped_objective``, the loss's
path for group granularities) against a naive float64 autograd computation of docs/algorithms/math.md
§2–§5, and the plans' multi-channel group sums (``ScatterIndex.sums`` / ``FewGroupIndex.sums``)
against a one-hot sum: contiguous segments (run sums), interleaved ids (the scatter fallback), few
groups (one-hot matmul); tokens that carry an id but are not valid belong to no group."""

from __future__ import annotations

import pytest
import torch

from nemo_granular.core.group_index import FewGroupIndex
from nemo_granular.core.masks import row_constant
from nemo_granular.core.objective import COUNT_EPS, aggregation_group_weights, grouped_clipped_objective
from nemo_granular.core.scatter_index import ScatterIndex

F64 = torch.float64


def _batch(kind: str, seed: int, B=5, T=23, G=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # a full row
    lengths[1] = 0  # an empty row
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    if kind == "segments":  # contiguous, non-decreasing ids (SSPO)
        cuts = (torch.rand(B, T, generator=g) < 0.25).long()
        ids = torch.cumsum(cuts, -1) - cuts
        ids = torch.minimum(ids, torch.full_like(ids, G - 1))
    else:  # interleaved ids (runs of one token: the scatter path), or few groups
        ids = torch.randint(0, 3 if kind == "few" else G, (B, T), generator=g)
    ids = torch.where(mask > 0, ids, -1)
    valid = mask.clone()
    valid[0, 3] = 0.0  # an id but not valid (a non-finite token of the careful read)
    return ids, mask, valid, g


def _plan(kind, ids, valid):
    G = int(ids.max()) + 1
    if kind == "few":
        return FewGroupIndex(ids, G, F64, member=valid), G
    return ScatterIndex.from_ids(ids, G, member=valid), G


def _onehot(ids, valid, G):
    """O[b, g, t] = 1 where token t of row b is a valid member of group g (naive, float64)."""
    return ((ids[:, None, :] == torch.arange(G)[None, :, None]) & (valid[:, None, :] > 0)).to(F64)


@pytest.mark.parametrize("kind", ["segments", "interleaved", "few"])
def test_group_sums_and_counts(kind):
    ids, mask, valid, g = _batch(kind, 0)
    index, G = _plan(kind, ids, valid)
    if kind == "segments":
        assert 4 * index.runs()[0].numel() <= index.flat.numel()  # the run-sum path is the one tested
    elif kind == "interleaved":
        assert 4 * index.runs()[0].numel() > index.flat.numel()  # the scatter fallback
    chans = [torch.randn(ids.shape, generator=g, dtype=F64) for _ in range(3)]
    table = index.sums(chans)
    onehot = _onehot(ids, valid, G)
    want = torch.stack([torch.einsum("bgt,bt->bg", onehot, c) for c in chans], -1)
    assert table.shape == (ids.shape[0], G + 1, 3)
    torch.testing.assert_close(table[:, 1:], want, rtol=1e-14, atol=1e-14)
    # the dummy slot holds every other token: the table's total is the channels' total
    torch.testing.assert_close(table.sum((0, 1)), torch.stack([c.sum() for c in chans]), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(index.counts(F64), onehot.sum(-1), rtol=0, atol=0)
    # a non-finite value outside every group still shows in the table
    chans[0][1, 0] = float("inf")
    assert not torch.isfinite(index.sums(chans).sum())


def _naive(logp, logq, adv, valid, ent, ids, G, form, bounds, aggregation, sm, inv_gvt, inv_gvs):
    """Σ W·c with autograd, everything per token (math.md §2–§5): r_t = exp(L_g(t)) (shared) or
    sg[s_g]·exp(logp_t − sg[logp_t]) (token_decomposed); c = min(r·A, clip(r, lo, hi)·A)."""
    onehot = _onehot(ids, valid, G)
    lp = logp.clone().requires_grad_(True)
    n = onehot.sum(-1)
    L = torch.einsum("bgt,bt->bg", onehot, (lp - logq) * valid) / (n + COUNT_EPS)
    s = torch.exp(L.clamp(max=20.0))
    s_tok = torch.einsum("bgt,bg->bt", onehot, s)
    r = s_tok if form == "shared" else s_tok.detach() * torch.exp(lp - lp.detach())
    if callable(bounds):
        h = torch.einsum("bgt,bt->bg", onehot, ent) / n.clamp(min=1)
        lo_g, hi_g = bounds(h)
        lo, hi = torch.einsum("bgt,bg->bt", onehot, lo_g), torch.einsum("bgt,bg->bt", onehot, hi_g)
    else:
        lo, hi = (torch.full_like(lp, v) for v in bounds)
    c = torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)
    n_groups = (n > 0).to(F64).sum(-1)
    omega = aggregation_group_weights(aggregation, sm, inv_gvt, inv_gvs, n.sum(-1), n, n_groups)
    W = valid * (torch.einsum("bgt,bg->bt", onehot, omega) if omega.shape[-1] > 1 else omega)
    obj = (W * c).sum()
    (grad,) = torch.autograd.grad(obj, lp)
    rd = r.detach()
    low = ((adv < 0) & (rd < lo)).to(F64) * valid
    high = ((adv > 0) & (rd > hi)).to(F64) * valid
    return obj.detach(), grad, torch.einsum("bgt,bt->bg", onehot, low), torch.einsum("bgt,bt->bg", onehot, high)


@pytest.mark.parametrize("kind", ["segments", "interleaved", "few"])
@pytest.mark.parametrize("form", ["shared", "token_decomposed"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_group_mean"])
@pytest.mark.parametrize("adv_kind", ["per_token", "per_response"])
@pytest.mark.parametrize("entropy_bounds", [False, True])
def test_grouped_objective_matches_naive(kind, form, aggregation, adv_kind, entropy_bounds):
    ids, mask, valid, g = _batch(kind, 1)
    index, G = _plan(kind, ids, valid)
    B, T = ids.shape
    logq = -torch.rand(B, T, generator=g, dtype=F64) * 3
    # ratios on both sides of the clip range: some groups clipped low, some high
    logp = logq + torch.randn(B, 1, generator=g, dtype=F64) * 0.3 + torch.randn(B, T, generator=g, dtype=F64) * 0.1
    if adv_kind == "per_token":
        adv = torch.randn(B, T, generator=g, dtype=F64)
        adv[2, :4] = 0.0  # A = 0: no gradient, never clipped
    else:
        adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T) * mask
    adv = adv * mask + (1 - mask) * 7.0  # values outside the valid tokens are not read
    ent = torch.rand(B, T, generator=g, dtype=F64) * 2
    sm = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=F64)
    inv_gvt, inv_gvs = 1 / (torch.tensor(57.0, dtype=F64) + 1e-8), 1 / (torch.tensor(4.0, dtype=F64) + 1e-8)

    def bounds_fn(h):
        return torch.clamp(1 - 0.1 * h, min=0.0), 1 + 0.1 * h

    bounds = bounds_fn if entropy_bounds else (0.9, 1.1)
    assert (row_constant(adv, valid) is None) == (adv_kind == "per_token")
    obj, grad, ratios, _, clip, _ = grouped_clipped_objective(
        logp, logq, adv, valid, ent, index, form, bounds, aggregation, sm, inv_gvt, inv_gvs
    )
    want, want_grad, low, high = _naive(
        logp, logq, adv, valid, ent, ids, G, form, bounds, aggregation, sm, inv_gvt, inv_gvs
    )
    assert float(clip.low.sum()) > 0 or float(clip.high.sum()) > 0  # the clip acts somewhere
    torch.testing.assert_close(obj, want, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad * valid, want_grad, rtol=1e-13, atol=1e-15)
    assert torch.equal(grad * (1 - valid), torch.zeros_like(grad))  # no gradient outside the members
    torch.testing.assert_close(clip.low, low, rtol=0, atol=0)
    torch.testing.assert_close(clip.high, high, rtol=0, atol=0)
    assert torch.isfinite(clip.probe)


def _naive_row_constant(x, valid):
    """Per row, the one value x takes on the valid tokens (0 for a row without one), or None when a
    row has two values or a non-finite one: a Python loop over rows."""
    out = []
    for i in range(x.shape[0]):
        vals = {float(v) for v, m in zip(x[i], valid[i]) if m > 0}
        if any(not torch.isfinite(torch.tensor(v)) for v in vals) or len(vals) > 1:
            return None
        out.append(vals.pop() if vals else 0.0)
    return torch.tensor(out, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(
    "case",
    [
        "constant",
        "one_token_differs",
        "empty_row",
        "inf_valid",
        "inf_outside",
        "nan_valid",
        "large_and_zero",
        "whole_row",
        "whole_row_empty_row",
        "whole_row_one_token_differs",
        "whole_row_one_outside_differs",
        "whole_row_inf",
    ],
)
def test_row_constant_matches_a_loop_over_rows(case, dtype):
    """The response-level-advantage check of the grouped objective: rows whose valid tokens share a value
    (|A| above and below 1, 0, negative), a row without valid tokens, one token off by one ulp,
    non-finite values on and off the valid tokens; other values outside the valid tokens (the masked
    check) or, ``whole_row``, one value on every token of the row (NeMo-RL's layout: the one-pass check)."""
    g = torch.Generator().manual_seed(3)
    B, T = 6, 17
    valid = (torch.rand(B, T, generator=g) > 0.3).to(dtype)
    a = torch.tensor([2.5, -3.0, 0.0, 0.7, -0.2, 1.0], dtype=dtype)
    x = a[:, None].expand(B, T).clone()
    if not case.startswith("whole_row"):
        x = x * valid + (1 - valid) * torch.randn(B, T, generator=g, dtype=dtype) * 5  # other values outside
    col = int(valid[1].nonzero()[-1])
    off = int((valid[1] == 0).nonzero()[0])
    if case == "whole_row_empty_row":
        valid[4] = 0
    elif case == "whole_row_one_token_differs":
        x[1, col] = torch.nextafter(x[1, col], torch.tensor(0.0, dtype=dtype))
    elif case == "whole_row_one_outside_differs":  # the one-pass check fails, the masked one passes
        x[1, off] = torch.nextafter(x[1, off], torch.tensor(0.0, dtype=dtype))
    elif case == "whole_row_inf":
        x[5] = float("inf")
    if case == "one_token_differs":
        x[1, col] = torch.nextafter(x[1, col], torch.tensor(0.0, dtype=dtype))
    elif case == "empty_row":
        valid[4] = 0
    elif case == "inf_valid":
        x[1, col] = float("inf")
    elif case == "inf_outside":
        x[1, off] = float("-inf")
    elif case == "nan_valid":
        x[1, col] = float("nan")
    elif case == "large_and_zero":
        x[3] = torch.where(valid[3] > 0, torch.tensor(0.0, dtype=dtype), x[3])
        x[3, int(valid[3].nonzero()[0])] = 1e20
    want = _naive_row_constant(x, valid)
    got = row_constant(x, valid)
    if case == "inf_outside":  # a non-finite value off the valid tokens: no fast path (the careful read follows)
        assert got is None
        return
    assert (got is None) == (want is None), (got, want)
    if want is not None:
        has_valid = valid.sum(-1) > 0  # a row without valid tokens: any finite value (callers weight it by 0)
        assert torch.equal(got[has_valid], want[has_valid])
        assert torch.isfinite(got).all()
