"""Advantage estimators with NeMo-RL's ``compute_advantage(prompt_ids, rewards, mask, **kw)``
interface, against the reference (prompt_ids as [B, Lp] token rows or [B] ids)."""

import pytest
import torch

import reference as R
from nemo_granular.advantages import ESPOEstimator, GRPOEstimator, SPPOEstimator, build_advantage_estimator


def _batch(seed, B=10, P=3, Lp=4, S=9):
    g = torch.Generator().manual_seed(seed)
    bank = torch.randint(0, 50, (P, Lp), generator=g)
    which = torch.randint(0, P, (B,), generator=g)
    prompt_rows = bank[which]
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    mask = (torch.rand(B, S, generator=g) < 0.7).float()
    return prompt_rows, which, rewards, mask


@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("ids_form", ["rows", "ids"])
def test_grpo_estimator(loo, norm, ids_form):
    rows, which, r, mask = _batch(0)
    est = build_advantage_estimator({"name": "grpo", "use_leave_one_out_baseline": loo, "normalize_rewards": norm})
    assert isinstance(est, GRPOEstimator)
    adv = est.compute_advantage(rows if ids_form == "rows" else which, r, mask)
    assert adv.shape == mask.shape
    ref = R.nemo_grpo_advantages(R.prompt_keys(rows), r, loo, norm)
    R.assert_close(adv, ref[:, None] * mask.double(), what="grpo")


@pytest.mark.parametrize("seed", range(3))
def test_espo_estimator_flag_sources(seed):
    rows, which, r, mask = _batch(seed)
    failed = torch.rand(r.shape, generator=torch.Generator().manual_seed(seed + 9)) < 0.3
    est = build_advantage_estimator({"name": "espo", "use_leave_one_out_baseline": False})
    assert isinstance(est, ESPOEstimator)
    ref = R.espo_advantages(r, R.prompt_keys(rows), failed)[:, None] * mask.double()
    R.assert_close(est.compute_advantage(rows, r, mask, verification_failed=failed), ref, what="kwarg")
    R.assert_close(
        est.compute_advantage(rows, r, mask, repeated_batch={"verification_failed": failed.tolist()}),
        ref,
        what="repeated_batch",
    )
    assert est.last_metrics["verification_failed_frac"] == pytest.approx(failed.float().mean().item())


def test_espo_estimator_errors():
    rows, _, r, mask = _batch(0)
    est = ESPOEstimator({"name": "espo"})
    with pytest.raises(KeyError, match="verification_failed"):
        est.compute_advantage(rows, r, mask)
    with pytest.raises(ValueError, match="verification_failed"):
        est.compute_advantage(rows, r, mask, verification_failed=torch.zeros(3, dtype=torch.bool))
    custom = ESPOEstimator({"name": "espo", "verification_failed_key": "judge_error"})
    custom.compute_advantage(rows, r, mask, repeated_batch={"judge_error": torch.zeros(len(r), dtype=torch.bool)})


@pytest.mark.parametrize("values_form", ["logits_B", "shifted_BS"])
def test_sppo_estimator_matches_official(values_form):
    rows, _, r, mask = _batch(1)
    mask[:, :2] = 0  # prompt columns
    mask[:, 2] = 1  # every row has a response
    g = torch.Generator().manual_seed(3)
    v = torch.randn(len(r), generator=g)
    if values_form == "logits_B":
        values = v
    else:  # NeMo-RL's right-shifted critic output: V(s_p) at the first response column
        values = torch.randn(mask.shape, generator=g)
        first = (mask > 0).int().argmax(-1)
        values[torch.arange(len(r)), first] = v
    est = build_advantage_estimator({"name": "sppo"})
    assert isinstance(est, SPPOEstimator)
    adv, ret = est.compute_advantage(rows, r, mask, values=values)
    token_rewards = torch.zeros(mask.shape)
    token_rewards[:, -1] = r
    ref_adv, ref_ret = R.sppo_official_advantages(token_rewards, v, mask)
    R.assert_close(adv, ref_adv, what="adv")
    R.assert_close(ret, ref_ret[:, None] * mask.double(), what="returns")


def test_sppo_estimator_errors():
    rows, _, r, mask = _batch(1)
    est = SPPOEstimator({"name": "sppo"})
    with pytest.raises(KeyError, match="values"):
        est.compute_advantage(rows, r, mask)
    with pytest.raises(ValueError, match="binary"):
        est.compute_advantage(rows, r * 0.5 + 0.25, mask, values=torch.zeros(len(r)))
