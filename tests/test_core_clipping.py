"""Clip bounds (docs/algorithms/math.md §3) and the clipped surrogate with dual clip and indicators (docs/algorithms/math.md §4)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from nemo_granular.core import clipping as C
from nemo_granular.core import reference_forms as F


def test_fixed_bounds():
    lo, hi = F.fixed_clip_bounds(torch.zeros(2, 3), 3e-4, 4e-4)
    assert (
        lo.shape == (2, 3) and torch.allclose(lo, torch.tensor(1 - 3e-4)) and torch.allclose(hi, torch.tensor(1 + 4e-4))
    )


@pytest.mark.parametrize("alpha,beta,gamma", [(0.0, 0.8, 1.75), (0.15, 0.8, 2.2), (0.1, 0.3, 1.0)])
def test_sspo_bounds_eq_13_15(alpha, beta, gamma):
    H = torch.tensor([0.0, 0.05, 0.2, 0.5, 0.75, 1.0, 1.3, 2.5, 7.0])
    lo, hi = C.sspo_entropy_clip_bounds(H, alpha, beta, gamma)
    for h, l_, u in zip(H.tolist(), lo.tolist(), hi.tolist()):
        rl, ru = R.sspo_bounds(h, alpha, beta, gamma)
        R.assert_close(l_, rl, what="lo")
        R.assert_close(u, ru, what="hi")
    assert (lo >= 0).all() and (lo <= beta).all() and (hi <= gamma).all()


def test_espo_bounds_and_calibration():
    H = torch.tensor([0.0, 0.4, 2.0, 9.0])
    lo, hi = C.espo_entropy_clip_bounds(H, 0.7, 32000)
    for h, l_, u in zip(H.tolist(), lo.tolist(), hi.tolist()):
        rl, ru = R.espo_bounds(h, 0.7, 32000)
        R.assert_close(l_, rl, what="lo")
        R.assert_close(u, ru, what="hi")
    a = C.calibrate_espo_alpha(1.2, 32000, 3.5e-4)
    R.assert_close(R.espo_bounds(1.2, a, 32000)[1] - 1, 3.5e-4, what="calibrated ε")
    with pytest.raises(ValueError, match="vocab_size"):
        C.espo_entropy_clip_bounds(H, 1.0, 1)
    with pytest.raises(ValueError, match="espo.alpha: auto needs a first rollout with a positive mean"):
        C.calibrate_espo_alpha(0.0, 100, 1e-3)


def _surrogate_case(seed, n=64, group_bounds=True):
    g = torch.Generator().manual_seed(seed)
    r0 = torch.exp(torch.randn(n, generator=g) * 0.5)
    A = torch.randn(n, generator=g)
    A[::7] = 0.0
    lo = 1 - torch.rand(n, generator=g) * 0.5 if group_bounds else torch.full((n,), 0.8)
    hi = 1 + torch.rand(n, generator=g) * 0.5 if group_bounds else torch.full((n,), 1.2)
    return r0, A, lo, hi


@pytest.mark.parametrize("dual", [None, 1.5, 3.0])
@pytest.mark.parametrize("seed", range(3))
def test_clipped_surrogate_values_grads_indicators(dual, seed):
    r0, A, lo, hi = _surrogate_case(seed)
    r = r0.clone().requires_grad_(True)
    c, low, high = F.clipped_surrogate(r, A, lo, hi, dual)
    c.sum().backward()
    for k in range(r0.numel()):
        rk = torch.tensor(float(r0[k]), dtype=torch.float64, requires_grad=True)
        ck, lk, hk = R.clipped_term(rk, float(A[k]), float(lo[k]), float(hi[k]), dual)
        if ck.requires_grad:
            ck.backward()
        gk = 0.0 if rk.grad is None else float(rk.grad)
        R.assert_close(c[k], R._f(ck), what=f"c[{k}]")
        R.assert_close(r.grad[k], gk, what=f"grad[{k}]")
        assert bool(low[k]) == lk and bool(high[k]) == hk, k
    # the indicator marks exactly the tokens whose gradient the min removes
    no_grad = (r.grad == 0) & (A != 0)
    if dual is None:
        assert torch.equal(no_grad, low | high)
    else:
        assert ((low | high) & ~no_grad).sum() == 0


def test_dual_clip_caps_negative_advantage():
    r = torch.tensor([10.0, 10.0, 0.1])
    A = torch.tensor([-1.0, 1.0, -1.0])
    c, low, high = F.clipped_surrogate(r, A, torch.full((3,), 0.8), torch.full((3,), 1.2), 3.0)
    assert c.tolist() == pytest.approx([-3.0, 1.2, -0.8])
    assert low.tolist() == [False, False, True] and high.tolist() == [False, True, False]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dual=st.sampled_from([None, 1.2, 3.0]))
def test_property_surrogate_is_pessimistic(seed, dual):
    r0, A, lo, hi = _surrogate_case(seed, n=32)
    c, low, high = F.clipped_surrogate(r0, A, lo, hi, dual)
    clipped = torch.maximum(torch.minimum(r0, hi), lo) * A
    bound = torch.minimum(r0 * A, clipped)
    if dual is None:
        assert torch.equal(c, bound)
    else:
        assert (c >= bound).all() and torch.where(A < 0, c >= dual * A, True).all()
    assert not (low & high).any() and not (low & (A >= 0)).any() and not (high & (A <= 0)).any()


@pytest.mark.parametrize("seed", range(3))
def test_cispo_surrogate_values_grads(seed):
    """CISPO (math.md §4): sg[clip(r)]·A·logp against the per-token reference: value, gradient in
    logp (the clipped weight) and no gradient through the ratio."""
    r0, A, lo, hi = _surrogate_case(seed)
    logp0 = -torch.rand(r0.shape, generator=torch.Generator().manual_seed(seed)) * 3
    r, logp = r0.clone().requires_grad_(True), logp0.clone().requires_grad_(True)
    F.cispo_surrogate(r, logp, A, lo, hi).sum().backward()
    assert r.grad is None or not r.grad.any()
    for k in range(r0.numel()):
        lk = torch.tensor(float(logp0[k]), dtype=torch.float64, requires_grad=True)
        ck, low, high = R.cispo_term(
            torch.tensor(float(r0[k]), dtype=torch.float64), lk, float(A[k]), float(lo[k]), float(hi[k])
        )
        ck.backward()
        R.assert_close((r0[k].clamp(lo[k], hi[k]) * A[k] * logp0[k]), R._f(ck), what=f"c[{k}]")
        R.assert_close(logp.grad[k], float(lk.grad), what=f"grad[{k}]")
        assert low == bool(r0[k] < lo[k]) and high == bool(r0[k] > hi[k])


@pytest.mark.parametrize("dual", [None, 2.0])
def test_reinforce_surrogate_values_grads(dual):
    """REINFORCE (math.md §4): A·logp; NeMo-RL's dual clip never acts on logp <= 0."""
    _, A, _, _ = _surrogate_case(4)
    logp0 = torch.randn(A.shape, generator=torch.Generator().manual_seed(4)) * 2  # some logp > C: the dual clip acts
    logp = logp0.clone().requires_grad_(True)
    F.reinforce_surrogate(logp, A).sum().backward()
    R.assert_close(logp.grad, A, what="grad")
    from nemo_granular.core.objective import surrogate_terms

    terms = surrogate_terms("reinforce", torch.ones_like(A), logp0, A, 0.8, 1.2, dual)
    for k in range(A.numel()):
        lk = torch.tensor(float(logp0[k]), dtype=torch.float64, requires_grad=True)
        ck, _, _ = R.reinforce_term(lk, float(A[k]), dual)
        if ck.requires_grad:
            ck.backward()
        R.assert_close(terms.value[k], R._f(ck), what=f"c[{k}]")
        R.assert_close(terms.slope[k], 0.0 if lk.grad is None else float(lk.grad), what=f"slope[{k}]")
    if dual is not None:  # held (no gradient) exactly where A < 0 and A·logp < C·A, i.e. logp > C
        held = (terms.slope == 0) & (A != 0)
        assert held.any() and torch.equal(held, (A < 0) & (logp0 > dual))


@pytest.mark.parametrize("kind", ["clipped", "cispo", "reinforce"])
def test_closed_form_surrogate_slopes_equal_autograd(kind):
    """core.objective.surrogate_terms (the loss's closed form) against autograd of the core forms."""
    r0, A, lo, hi = _surrogate_case(7)
    logp0 = -torch.rand(r0.shape, generator=torch.Generator().manual_seed(7)) * 2
    from nemo_granular.core.objective import surrogate_terms

    terms = surrogate_terms(kind, r0, logp0, A, lo, hi, None)
    r, logp = r0.clone().requires_grad_(True), logp0.clone().requires_grad_(True)
    if kind == "clipped":
        c = F.clipped_surrogate(r, A, lo, hi)[0]
    elif kind == "cispo":
        c = F.cispo_surrogate(r, logp, A, lo, hi)
    else:
        c = F.reinforce_surrogate(logp, A)
    c.sum().backward()
    R.assert_close(terms.value, c.detach(), what="value")
    R.assert_close(terms.slope, r.grad if terms.through_ratio else logp.grad, what="slope")
