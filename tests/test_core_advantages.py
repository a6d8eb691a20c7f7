"""Advantages (docs/algorithms/math.md §6) and the SPPO critic loss (docs/algorithms/math.md §7) against the reference, NeMo-RL's
baseline/std semantics and the official SPPO code's semantics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from nemo_granular.core import advantages as AD


def _rewards(seed, B=12, P=4, binary=False):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, P, (B,), generator=g)
    r = torch.randint(0, 2, (B,), generator=g).float() if binary else torch.randn(B, generator=g)
    return prompts, r


def test_prompt_group_index_rows_and_ids():
    rows = torch.tensor([[5, 6, 7], [1, 2, 3], [5, 6, 7], [1, 2, 4]])
    idx = AD.prompt_group_index(rows)
    assert idx[0] == idx[2] and len({int(idx[0]), int(idx[1]), int(idx[3])}) == 3
    ids = AD.prompt_group_index(torch.tensor([9, 3, 9, 3, 1]))
    assert ids[0] == ids[2] and ids[1] == ids[3] and ids[4] not in (ids[0], ids[1])


@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_grpo_matches_reference_and_nemo(loo, norm, seed):
    prompts, r = _rewards(seed, binary=(seed == 2))
    a = AD.grpo_advantages(r, AD.prompt_group_index(prompts), leave_one_out=loo, normalize_std=norm)
    keys = R.prompt_keys(prompts)
    R.assert_close(a, R.grpo_advantages(r, keys, leave_one_out=loo, normalize_std=norm), what="spec")
    R.assert_close(a, R.nemo_grpo_advantages(keys, r, loo, norm), what="nemo")


def test_grpo_unbiased_std_and_edge_groups():
    prompts = torch.tensor([0, 0, 0, 1, 2, 2])
    r = torch.tensor([1.0, 0.0, 0.0, 5.0, 1.0, 1.0])
    a = AD.grpo_advantages(r, AD.prompt_group_index(prompts))
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased
    assert a[0].item() == pytest.approx((2 / 3) / (std + 1e-6), rel=1e-6)
    assert a[3].item() == 0.0  # single response: no baseline
    assert a[4].item() == 0.0 and a[5].item() == 0.0  # std 0 is not scaled, mean removed
    # leave-one-out with two responses: baseline is the other one, std of one sample = 0 → unscaled
    a = AD.grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), leave_one_out=True)
    assert a.tolist() == [1.0, -1.0]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loo", [False, True])
def test_espo_failed_responses(seed, loo):
    prompts, r = _rewards(seed, binary=True)
    failed = torch.rand(r.shape, generator=torch.Generator().manual_seed(50 + seed)) < 0.3
    a = AD.espo_advantages(r, AD.prompt_group_index(prompts), failed, leave_one_out=loo)
    ref = R.espo_advantages(r, R.prompt_keys(prompts), failed, leave_one_out=loo)
    R.assert_close(a, ref, what="espo")
    assert (a[failed] == 0).all()


def test_espo_failed_excluded_from_statistics():
    """A failed response with reward 0 must not pull the mean down (it is not a wrong answer)."""
    prompts = torch.zeros(4, dtype=torch.long)
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    failed = torch.tensor([False, False, False, True])
    a = AD.espo_advantages(r, prompts, failed, normalize_std=False)
    assert a.tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0.0])


def test_sppo_advantage_matches_official_code():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    R_ = torch.randint(0, 2, (B,), generator=g).float()
    v = torch.randn(B, generator=g) * 2
    mask = (torch.rand(B, T, generator=g) < 0.8).float()
    token_rewards = torch.zeros(B, T)
    token_rewards[:, -1] = R_  # verl puts the scalar reward on the last token
    ref_adv, ref_ret = R.sppo_official_advantages(token_rewards, v, mask)
    a = AD.sppo_advantages(R_, v)
    R.assert_close(a[:, None] * mask, ref_adv, what="adv")
    R.assert_close(R_, ref_ret, what="returns")
    assert not AD.sppo_advantages(R_, v.clone().requires_grad_(True)).requires_grad  # a constant for the policy


def test_critic_bce_value_and_grad():
    v = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0], requires_grad=True)
    R_ = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    bce = AD.sppo_critic_bce(v, R_)
    for k in range(5):
        R.assert_close(bce[k], R.bce_with_logits(float(v[k].detach()), float(R_[k])), what="bce")
    bce.sum().backward()
    sig = 1 / (1 + torch.exp(-v.detach().double()))
    R.assert_close(v.grad, sig - R_.double(), what="dBCE/dv = σ(v) − R")


def test_first_response_index():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert AD.first_response_index(mask).tolist() == [2, 0, 0]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 16),
    P=st.integers(1, 5),
    loo=st.booleans(),
    norm=st.booleans(),
    binary=st.booleans(),
)
def test_property_grpo_vs_nemo(seed, B, P, loo, norm, binary):
    prompts, r = _rewards(seed, B, P, binary)
    a = AD.grpo_advantages(r, AD.prompt_group_index(prompts), leave_one_out=loo, normalize_std=norm)
    R.assert_close(a, R.nemo_grpo_advantages(R.prompt_keys(prompts), r, loo, norm), rtol=1e-5, what="nemo")
