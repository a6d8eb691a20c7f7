"""Critic diagnostics (SPPO Figure 7) against scipy / direct formulas."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_granular.sppo.diagnostics import average_ranks, critic_diagnostics, pearson, spearman

stats = pytest.importorskip("scipy.stats")


def test_ranks_and_correlations_match_scipy():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (40,), generator=g).double()  # many ties
    y = x + torch.randn(40, generator=g, dtype=torch.float64)
    assert torch.allclose(average_ranks(x), torch.from_numpy(stats.rankdata(x.numpy())))
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x.numpy(), y.numpy())[0], abs=1e-12)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x.numpy(), y.numpy())[0], abs=1e-12)
    assert math.isnan(pearson(torch.ones(5), y[:5])) and math.isnan(pearson(x[:1], y[:1]))


def test_batch_metrics_and_pass_rate_correlation():
    g = torch.Generator().manual_seed(1)
    P, k = 12, 8
    logits_p = torch.randn(P, generator=g)
    rates = torch.sigmoid(2 * logits_p + torch.randn(P, generator=g))
    rewards = (torch.rand(P, k, generator=g) < rates[:, None]).double().reshape(-1)
    v = logits_p.repeat_interleave(k)
    groups = torch.arange(P).repeat_interleave(k)
    w = torch.ones(P * k)
    w[3] = 0  # a masked sample
    m = critic_diagnostics(v, rewards, weights=w, group_ids=groups)
    keep = w > 0
    p = torch.sigmoid(v[keep].double())
    r = rewards[keep]
    assert m["num_samples"] == P * k - 1
    assert m["bce"] == pytest.approx(float(torch.nn.functional.binary_cross_entropy(p, r)), rel=1e-9)
    assert m["acc"] == pytest.approx(float(((p > 0.5).double() == r).double().mean()), rel=1e-12)
    assert m["brier"] == pytest.approx(float(((p - r) ** 2).mean()), rel=1e-12)
    assert m["value_mean"] == pytest.approx(float(p.mean())) and m["reward_mean"] == pytest.approx(float(r.mean()))
    emp = torch.stack([rewards[groups == i][w[groups == i] > 0].mean() for i in range(P)])
    assert m["num_prompts_multi"] == P
    assert m["pearson_pass_rate"] == pytest.approx(stats.pearsonr(torch.sigmoid(logits_p).numpy(), emp.numpy())[0])
    assert m["spearman_pass_rate"] == pytest.approx(stats.spearmanr(torch.sigmoid(logits_p).numpy(), emp.numpy())[0])


def test_single_sample_per_prompt_has_no_correlation_and_empty_batch_is_safe():
    m = critic_diagnostics(torch.zeros(4), torch.tensor([1.0, 0, 1, 0]), group_ids=torch.arange(4))
    assert m["num_prompts_multi"] == 0 and "pearson_pass_rate" not in m
    assert m["bce"] == pytest.approx(math.log(2)) and m["acc"] == 0.5  # sigma(0) = 0.5 is not > 0.5
    assert critic_diagnostics(torch.zeros(2), torch.ones(2), weights=torch.zeros(2)) == {"num_samples": 0.0}
    with pytest.raises(ValueError, match="entries"):
        critic_diagnostics(torch.zeros(3), torch.ones(2))
