"""The three aggregations (docs/algorithms/math.md §5) against the reference, and their microbatch additivity."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from nemo_granular.core import groups as G
from nemo_granular.core import reference_forms as AG


def _case(seed, B=5, T=10):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = False  # an empty row
    vals = torch.randn(B, T, generator=g)
    sm = (torch.rand(B, generator=g) < 0.8).float()
    H = torch.randint(0, 4, (B, T), generator=g).float()
    ids = G.entropy_group_ids(H, mask, [0.3, 0.6])
    return mask, vals, sm, ids


def _ref(kind, mask, vals, sm, ids, gvs, gvt):
    ids_l = ids.tolist() if kind == "seq_mean_group_mean" else R.token_group_ids(mask)
    per = {(i, t): float(vals[i, t]) for i in range(vals.shape[0]) for t in range(vals.shape[1]) if mask[i, t]}
    return float(R.aggregate(per, ids_l, sm, kind, gvs, gvt))


def _ours(kind, mask, vals, sm, ids, gvs, gvt):
    if kind == "token_mean":
        return AG.token_mean(vals * sm[:, None], mask, gvt)
    if kind == "seq_mean_token_mean":
        return AG.seq_mean_token_mean(vals, mask, sm, gvs)
    return AG.seq_mean_group_mean(vals, ids, ids.shape[1], sm, gvs)


KINDS = ["token_mean", "seq_mean_token_mean", "seq_mean_group_mean"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_aggregation_matches_reference(kind, seed):
    mask, vals, sm, ids = _case(seed)
    gvs, gvt = float(sm.sum()), float((mask * sm[:, None]).sum())
    R.assert_close(_ours(kind, mask, vals, sm, ids, gvs, gvt), _ref(kind, mask, vals, sm, ids, gvs, gvt), what=kind)


def test_group_mean_weights_groups_equally():
    """20/80 split of 10 tokens: each high-entropy token weighs 4× a low one (ESPO §3.2)."""
    ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    vals = torch.zeros(1, 10, requires_grad=True)
    AG.seq_mean_group_mean(vals, ids, 2, torch.ones(1), 1.0).backward()
    assert vals.grad[0, 0] == pytest.approx(4 * vals.grad[0, 5])
    assert vals.grad.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_microbatch_partials_add_up(kind):
    mask, vals, sm, ids = _case(7, B=8)
    gvs, gvt = float(sm.sum()), float((mask * sm[:, None]).sum())
    full = _ours(kind, mask, vals, sm, ids, gvs, gvt)
    parts = sum(_ours(kind, mask[a:b], vals[a:b], sm[a:b], ids[a:b], gvs, gvt) for a, b in [(0, 3), (3, 4), (4, 8)])
    R.assert_close(parts, full, what=kind)


def test_zero_denominators_give_zero():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    vals = torch.randn(2, 3)
    ids = torch.full((2, 3), -1)
    for kind in KINDS:
        assert float(_ours(kind, mask, vals, torch.zeros(2), ids, 0.0, 0.0)) == 0.0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 6), T=st.integers(1, 12), kind=st.sampled_from(KINDS))
def test_property_aggregation(seed, B, T, kind):
    mask, vals, sm, ids = _case(seed, B, T)
    gvs, gvt = float(sm.sum()), float((mask * sm[:, None]).sum())
    R.assert_close(_ours(kind, mask, vals, sm, ids, gvs, gvt), _ref(kind, mask, vals, sm, ids, gvs, gvt), what=kind)
