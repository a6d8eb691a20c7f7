"""Group log-ratio means and the two ratio forms (docs/algorithms/math.md §2): values and gradients."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from nemo_granular.core import groups as G
from nemo_granular.core import reference_forms as Q


def _batch(seed, B=3, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.75
    logq = -torch.rand(B, T, generator=g) * 3
    logp = logq + torch.randn(B, T, generator=g) * 0.3
    toks = torch.randint(0, 6, (B, T), generator=g)
    ids = G.segment_group_ids(toks, mask, R.delimiter_table(6, [0, 1]))
    return mask, logp, logq, ids


def test_group_sum_count_mean_gather():
    ids = torch.tensor([[0, 0, 1, -1], [-1, 0, 0, 0]])
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [100.0, 4.0, 5.0, 6.0]])
    assert Q.group_sum(x, ids, 2).tolist() == [[3.0, 3.0], [15.0, 0.0]]
    assert Q.group_count(ids, 2).tolist() == [[2.0, 1.0], [3.0, 0.0]]
    assert Q.group_mean(x, ids, 2).tolist() == [[1.5, 3.0], [5.0, 0.0]]
    assert Q.gather_groups(torch.tensor([[7.0, 8.0], [9.0, 0.0]]), ids).tolist() == [[7, 7, 8, 0], [0, 9, 9, 9]]


@pytest.mark.parametrize("seed", range(4))
def test_group_log_ratio_matches_reference(seed):
    mask, logp, logq, ids = _batch(seed)
    Gmax = ids.shape[1]
    L = Q.group_log_ratio(logp - logq, ids, Gmax)
    ref = R.group_log_ratio_means(logp, logq, ids.tolist())
    for i, row in enumerate(ref):
        for g, v in row.items():
            R.assert_close(L[i, g], v, what=f"L[{i},{g}]")
        assert all(L[i, g] == 0 for g in range(Gmax) if g not in row)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("form", ["shared", "token_decomposed"])
def test_ratio_values_and_gradients(seed, form):
    """Backprop of Σ_t w_t·r_t: shared gives token t of group g the gradient s_g·Σ_{u∈g} w_u/|g|
    (through the mean); token_decomposed gives s_g·w_t (its own logprob only)."""
    mask, logp, logq, ids = _batch(seed)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(100 + seed))
    lp = logp.clone().requires_grad_(True)
    L = Q.group_log_ratio(lp - logq, ids, ids.shape[1])
    r = Q.shared_ratio(L, ids) if form == "shared" else Q.token_decomposed_ratio(L, ids, lp)
    (torch.where(ids >= 0, r * w, 0.0)).sum().backward()
    # reference: values from float64 group means, gradient by autograd over scalar float64 ops
    lp64 = logp.double().requires_grad_(True)
    rr = R.token_ratios(lp64, logq.double(), ids.tolist(), form)
    sum(v * float(w[i, t]) for (i, t), v in rr.items()).backward()
    for (i, t), v in rr.items():
        R.assert_close(r[i, t], R._f(v), what=f"r[{i},{t}]")
    R.assert_close(lp.grad, lp64.grad, what="grad")
    # the closed forms of docs/algorithms/math.md §2
    for i, row in enumerate(ids.tolist()):
        for grp in R.groups_of_row(row):
            s = R._f(rr[(i, grp[0])])
            for t in grp:
                expect = s * sum(float(w[i, u]) for u in grp) / len(grp) if form == "shared" else s * float(w[i, t])
                R.assert_close(lp.grad[i, t], expect, rtol=1e-5, atol=1e-7, what="closed form")
    assert (lp.grad[~mask] == 0).all()


def test_token_granularity_both_forms_are_exp_log_ratio():
    mask, logp, logq, _ = _batch(9)
    ids = G.token_group_ids(mask)
    L = Q.group_log_ratio(logp - logq, ids, ids.shape[1])
    for r in (Q.shared_ratio(L, ids), Q.token_decomposed_ratio(L, ids, logp)):
        R.assert_close(r[mask], torch.exp((logp - logq).double())[mask], what="token ratio")


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    T=st.integers(1, 12),
    form=st.sampled_from(["shared", "token_decomposed"]),
)
def test_property_ratios(seed, B, T, form):
    mask, logp, logq, ids = _batch(seed, B, T)
    lp = logp.clone().requires_grad_(True)
    L = Q.group_log_ratio(lp - logq, ids, T)
    r = Q.shared_ratio(L, ids) if form == "shared" else Q.token_decomposed_ratio(L, ids, lp)
    torch.where(ids >= 0, r, 0.0).sum().backward()
    lp64 = logp.double().requires_grad_(True)
    rr = R.token_ratios(lp64, logq.double(), ids.tolist(), form)
    if rr:
        sum(rr.values()).backward()
        R.assert_close(lp.grad, lp64.grad, what="grad")
        for (i, t), v in rr.items():
            R.assert_close(r[i, t], R._f(v), what="r")
