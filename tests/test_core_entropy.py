"""Full-vocabulary entropy and next-token logprobs from logits (docs/algorithms/math.md, Notation) vs float64 softmax."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from nemo_granular.core import entropy as E


def _logits(seed, shape, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("chunk", [None, 0, 1, 5, 1024])
def test_entropy_and_logprobs_vs_float64(chunk):
    z = _logits(0, (3, 7, 50))
    tgt = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    H_ref, LP_ref = R.entropy_and_logprob(z, tgt)
    R.assert_close(E.entropy_from_logits(z, chunk_size=chunk), H_ref, rtol=2e-6, atol=2e-6, what="H")
    lp, h = E.logprobs_and_entropy_from_logits(z, tgt, chunk_size=chunk)
    R.assert_close(lp, LP_ref, rtol=2e-6, atol=2e-6, what="logp (fused)")
    R.assert_close(h, H_ref, rtol=2e-6, atol=2e-6, what="H (fused)")
    R.assert_close(E.logprobs_from_logits(z, tgt, chunk_size=chunk), LP_ref, rtol=2e-6, atol=2e-6, what="logp")


def test_chunked_equals_unchunked_exactly():
    z = _logits(2, (37, 64))
    tgt = torch.randint(0, 64, (37,))
    full = E.logprobs_and_entropy_from_logits(z, tgt, chunk_size=None)
    for chunk in (1, 4, 10, 36, 37, 100):
        part = E.logprobs_and_entropy_from_logits(z, tgt, chunk_size=chunk)
        assert torch.equal(part[0], full[0]) and torch.equal(part[1], full[1]), chunk
        assert torch.equal(E.entropy_from_logits(z, chunk_size=chunk), full[1])


def test_masked_minus_inf_logits():
    z = _logits(3, (4, 20))
    z[0, :15] = float("-inf")  # top-k style masking
    z[1, 3] = float("-inf")
    z[2, :] = 0.0  # uniform: H = log V
    tgt = torch.tensor([17, 0, 5, 9])
    lp, h = E.logprobs_and_entropy_from_logits(z, tgt)
    H_ref, LP_ref = R.entropy_and_logprob(z, tgt)
    assert torch.isfinite(h).all() and torch.isfinite(lp).all()
    R.assert_close(h, H_ref, rtol=2e-6, atol=2e-6, what="H")
    R.assert_close(lp, LP_ref, rtol=2e-6, atol=2e-6, what="logp")
    assert h[2].item() == pytest.approx(math.log(20), rel=1e-6)
    # a target on a masked logit has log-probability −inf (not NaN)
    lp2, _ = E.logprobs_and_entropy_from_logits(z, torch.tensor([0, 3, 5, 9]))
    assert lp2[0] == float("-inf") and lp2[1] == float("-inf")


def test_one_hot_distribution_has_zero_entropy():
    z = torch.full((2, 10), -1e4)
    z[:, 3] = 0.0
    assert E.entropy_from_logits(z).abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_accumulated_in_float32(dtype):
    z = _logits(4, (6, 300), dtype=dtype)
    tgt = torch.randint(0, 300, (6,))
    lp, h = E.logprobs_and_entropy_from_logits(z, tgt)
    assert lp.dtype == torch.float32 and h.dtype == torch.float32
    H_ref, LP_ref = R.entropy_and_logprob(z.float(), tgt)
    R.assert_close(h, H_ref, rtol=2e-6, atol=2e-5, what="H")
    R.assert_close(lp, LP_ref, rtol=2e-6, atol=2e-5, what="logp")


def test_fused_pass_has_no_autograd():
    z = _logits(5, (4, 16)).requires_grad_(True)
    lp, h = E.logprobs_and_entropy_from_logits(z, torch.zeros(4, dtype=torch.long))
    assert not lp.requires_grad and not h.requires_grad


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    N=st.integers(1, 12),
    Vs=st.integers(2, 40),
    chunk=st.integers(0, 7),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
)
def test_property_entropy(seed, N, Vs, chunk, scale):
    z = _logits(seed, (N, Vs), scale)
    tgt = torch.randint(0, Vs, (N,), generator=torch.Generator().manual_seed(seed))
    lp, h = E.logprobs_and_entropy_from_logits(z, tgt, chunk_size=chunk)
    H_ref, LP_ref = R.entropy_and_logprob(z, tgt)
    # float32 bound of the implemented formula lse − Σ p·z: cancellation error ∝ max|z|
    # (the tighter, scale-free bound is test_entropy_precision_with_large_logits below)
    tol = 1e-6 * max(1.0, float(z.abs().max()))
    R.assert_close(h, H_ref, rtol=2e-6, atol=tol, what="H")
    R.assert_close(lp, LP_ref, rtol=2e-6, atol=tol, what="logp")
    assert (h >= -tol).all() and (h <= math.log(Vs) + tol).all()


def test_entropy_precision_with_large_logits():
    z = _logits(1, (2000, 64), scale=30.0)
    H_ref = R.entropy_and_logprob(z)
    R.assert_close(E.entropy_from_logits(z), H_ref, rtol=1e-6, atol=1e-6, what="H")
