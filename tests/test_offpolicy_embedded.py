"""The embedded trainer's generation-mismatch option (docs/algorithms/offpolicy.md): π_gen is a
perturbed copy of the policy, the correction and its diagnostics run end to end."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_train
from nemo_granular.embedded.config import LOCAL_CONFIGS, load_train_config
from nemo_granular.embedded.mismatch import generation_seed, perturbed_copy
from nemo_granular.embedded.trainer import Trainer

TINY = tiny_train("checkpoint.every=0")
CORRECTION = [
    "loss_fn.use_importance_sampling_correction=true",
    "loss_fn.granular.is_level=group_mean",
    "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
    "loss_fn.truncated_importance_sampling_ratio=1.01",
    "loss_fn.truncated_importance_sampling_ratio_min=0.99",
]


def _step(tmp_path, sigma, overrides=CORRECTION):
    cfg = load_train_config(
        LOCAL_CONFIGS / "sspo.yaml",
        TINY + list(overrides) + [f"output_dir={tmp_path}", "rl.steps=1", f"rl.generation_mismatch={sigma}"],
    )
    t = Trainer(cfg, log=lambda msg: None)
    try:
        batch = t.rollout(0)
        rec = t.train_step()
    finally:
        t.close()
    return batch, rec


def test_mismatch_option_makes_generation_logprobs_differ_and_is_corrected(tmp_path):
    batch0, rec0 = _step(tmp_path / "on", 0.0)
    batch, rec = _step(tmp_path / "off", 0.1)
    mask = batch["token_mask"] > 0
    d0 = (batch0["prev_logprobs"] - batch0["generation_logprobs"])[batch0["token_mask"] > 0].abs()
    d = (batch["prev_logprobs"] - batch["generation_logprobs"])[mask].abs()
    # σ = 0: the engine IS the policy (only float rounding between generate and the π_old pass)
    assert float(d0.max()) < 1e-4
    assert float(d.mean()) > 100 * max(float(d0.mean()), 1e-7)
    # the step logs the diagnostics; the maxima are the batch's own
    for key in (
        "gen_mismatch_abs_mean",
        "gen_kl_k3",
        "gen_mismatch_group_abs_mean",
        "is_oob_ratio",
        "is_oob_token_frac",
        "is_oob_group_frac",
        "gen_mismatch_token_abs_max",
        "gen_mismatch_group_abs_max",
    ):
        assert f"train/{key}" in rec, key
    assert rec["train/gen_mismatch_abs_mean"] > 100 * max(rec0["train/gen_mismatch_abs_mean"], 1e-7)
    assert 0 < rec["train/is_oob_group_frac"] <= 1
    assert rec["train/gen_mismatch_token_abs_max"] >= rec["train/gen_mismatch_group_abs_max"] > 0


PER_STEP = (
    "gen_mismatch_token_abs_max",
    "gen_mismatch_group_abs_max",
    "gen_mismatch_abs_mean_high_entropy",
    "gen_mismatch_abs_mean_low_entropy",
)


@pytest.mark.parametrize("correction", [False, True], ids=["off", "on"])
def test_minimal_metrics_level_drops_the_mismatch_diagnostics_unless_corrected(tmp_path, correction):
    """loss_fn.metrics_level minimal: the loss-side diagnostics and the per-step whole-batch ones
    (a sort of the batch's entropies) are not computed unless the correction is on."""
    from nemo_granular.loss_metrics import MISMATCH_METRICS

    _, rec = _step(tmp_path, 0.1, ["loss_fn.metrics_level=minimal"] + (CORRECTION if correction else []))
    logged = {k.removeprefix("train/") for k in rec}
    assert "loss" in logged and "clip_frac_low" in logged
    diagnostics = set(MISMATCH_METRICS) | set(PER_STEP)
    if correction:
        assert diagnostics <= logged
    else:
        assert not diagnostics & logged, sorted(diagnostics & logged)


def test_perturbed_copy_is_deterministic_and_leaves_the_policy_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 20))
    before = [p.detach().clone() for p in model.parameters()]
    a = perturbed_copy(model, 0.1, generation_seed(3, 5))
    b = perturbed_copy(model, 0.1, generation_seed(3, 5))
    c = perturbed_copy(model, 0.1, generation_seed(3, 6))
    for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q) and not torch.equal(p, r)
    rel = torch.cat([(p / p0 - 1).reshape(-1) for p, p0 in zip(a.parameters(), model.parameters())])
    assert abs(float(rel.std()) - 0.1) < 0.01 and abs(float(rel.mean())) < 0.01  # p·(1 + σ·ε), σ = 0.1
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


@pytest.mark.parametrize("value", ["-0.1", "2", "abc"])
def test_bad_generation_mismatch_is_one_line_error(value):
    with pytest.raises(ValueError) as err:
        load_train_config(LOCAL_CONFIGS / "grpo.yaml", [f"rl.generation_mismatch={value}"])
    assert "\n" not in str(err.value) and "rl.generation_mismatch" in str(err.value)


def test_comparison_report_plots_the_mismatch(tmp_path):
    """The report's mismatch panel: one PNG from the runs' logged ``train/gen_mismatch_abs_mean``,
    none from runs that did not log it."""
    from nemo_granular.report.build import plots
    from nemo_granular.report.runs import load_run
    from test_report import _embedded_run

    with_mm = [
        load_run(
            _embedded_run(
                tmp_path / "a",
                "sspo",
                s,
                [0.5, 0.6, 0.7],
                per_step=lambda k: {"train/gen_mismatch_abs_mean": 0.01 + 1e-3 * k},
            )
        )
        for s in (0, 1)
    ]
    assert with_mm[0].recs[3]["train/gen_mismatch_abs_mean"] == pytest.approx(0.013)
    files = plots({"sspo": with_mm}, tmp_path / "a")
    assert "gen_mismatch_abs_mean_vs_step.png" in files
    without = [load_run(_embedded_run(tmp_path / "b", "grpo", 0, [0.5, 0.6, 0.7]))]
    assert "gen_mismatch_abs_mean_vs_step.png" not in plots({"grpo": without}, tmp_path / "b")
