"""Learning is real: RL raises held-out accuracy above the warm start, for GRPO and for SSPO.

What is measured (docs/embedded.md, "Is the learning real?"): greedy accuracy on 128 held-out
problems is a chaotic function of the weights at this scale. One evaluation after 60 steps swung
from +0.219 to +0.055 over the warm start (SSPO, seed 0) when a loss refactor changed only the
float rounding (metrics equal to 7 digits for the first steps), and over seeds 0-4 one evaluation
at step 60 gained GRPO +0.305/+0.234/+0.187/+0.289/+0.039 and SSPO +0.055/+0.188/+0.187/-0.047/+0.008.
A single evaluation of a single seed is a coin flip for any change that moves a rounding.

So the statistic is less noisy: per seed, the mean of the evaluations at steps 30, 60, ..., 150
minus the warm start's accuracy; then the mean over seeds 0 and 1. Over seeds 0-4 the per-seed
statistic was GRPO +0.282/+0.242/+0.200/+0.197/+0.103 (mean 0.205, sd 0.067) and SSPO
+0.128/+0.122/+0.203/+0.036/+0.070 (mean 0.112, sd 0.064): SSPO learns less than GRPO on this task
(why was not measured; its responses hold about 4 segments each, docs/embedded.md). The margin, 0.03, is 1.8 sd of a
two-seed mean below SSPO's measured mean; a run whose updates do nothing scores exactly 0 (the
greedy policy never changes) and a sign error in the gradient scores below 0.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from nemo_granular.embedded.config import load_train_config
from nemo_granular.embedded.trainer import Trainer

LOCAL = Path(__file__).resolve().parents[1] / "examples" / "configs" / "local"
SEEDS = (0, 1)
STEPS, EVAL_EVERY = 150, 30
MARGIN = 0.03
COMMON = ["threads=1", "logger.progress=false", "logger.tensorboard=false"]


@pytest.fixture(scope="module")
def warm_policies(tmp_path_factory):
    """Each seed's warm-started policy and its held-out accuracy."""
    out = {}
    for seed in SEEDS:
        d = tmp_path_factory.mktemp(f"warm{seed}")
        cfg = load_train_config(LOCAL / "base.yaml", COMMON + [f"seed={seed}", f"output_dir={d}", "rl.steps=0"])
        trainer = Trainer(cfg)
        assert trainer.run() == 0
        assert trainer.warmstart_info["accuracy"] >= cfg.warmstart.target_accuracy
        out[seed] = (d / "checkpoints" / "step_000000" / "policy", trainer.warmstart_info["accuracy"])
    return out


def _evaluations(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["validation/accuracy"] for r in rows if "validation/accuracy" in r}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "sspo"])
def test_rl_beats_warm_start_by_margin(warm_policies, tmp_path, algorithm):
    gains = []
    for seed in SEEDS:
        policy_dir, warm_acc = warm_policies[seed]
        run_dir = tmp_path / f"seed{seed}"
        cfg = load_train_config(
            LOCAL / f"{algorithm}.yaml",
            COMMON
            + [
                f"seed={seed}",
                f"output_dir={run_dir}",
                f"model.init_from={policy_dir}",
                f"rl.steps={STEPS}",
                f"rl.eval_every={EVAL_EVERY}",
            ],
        )
        assert Trainer(cfg).run() == 0
        evals = _evaluations(run_dir)
        assert evals[0] == pytest.approx(warm_acc)  # the run starts from the warm-started policy
        assert sorted(evals) == [0, *range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)], evals
        gains.append(statistics.mean(evals[s] for s in evals if s > 0) - warm_acc)
    gain = statistics.mean(gains)
    assert gain > MARGIN, f"{algorithm}: held-out accuracy gain per seed {gains}, mean {gain:.3f}, margin {MARGIN}"
