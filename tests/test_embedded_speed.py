"""The embedded trainer's and the benchmark suite's faster paths compute what the plain paths compute.

Issue #36 item 9 made the default demo faster without changing a number it produces: these tests run
the same short work both ways in one process and require the results to be equal bit for bit (no
tolerance; no timing is asserted anywhere).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_train
from nemo_granular.embedded import rollout as R
from nemo_granular.embedded.config import LOCAL_CONFIGS, load_train_config

TINY = tiny_train("rl.eval_every=1")


def _records(path: Path) -> list[dict]:
    """metrics.jsonl without what a run measures of itself (seconds)."""
    return [
        {k: v for k, v in json.loads(line).items() if k != "wall_time" and not k.startswith("timing/")}
        for line in path.read_text().splitlines()
    ]


def _train(out: Path, algorithm: str, *extra: str):
    from nemo_granular.embedded.trainer import Trainer

    t = Trainer(
        load_train_config(LOCAL_CONFIGS / f"{algorithm}.yaml", [*TINY, "rl.steps=3", f"output_dir={out}", *extra]),
        log=lambda m: None,
    )
    assert t.run() == 0
    return _records(out / "metrics.jsonl"), {k: v.clone() for k, v in t.policy.state_dict().items()}


@pytest.mark.parametrize("algorithm", ["sspo", "sppo"])
def test_sampling_and_pi_old_in_inference_mode_give_the_no_grad_numbers(tmp_path, monkeypatch, algorithm):
    """Sampling and the π_old pass run in inference mode (no autograd bookkeeping): every metric of a short
    run (rewards, ratios, clip fractions, losses, held-out accuracy) and the trained weights equal a run
    whose no-gradient passes run under plain ``no_grad``, as they did before."""
    fast, fast_w = _train(tmp_path / "fast", algorithm)
    monkeypatch.setattr(R, "NO_AUTOGRAD", torch.no_grad)
    slow, slow_w = _train(tmp_path / "slow", algorithm)
    assert len(fast) == 4 and fast == slow
    assert fast_w.keys() == slow_w.keys() and all(torch.equal(fast_w[k], slow_w[k]) for k in fast_w)


def test_generate_returns_ordinary_tensors():
    """What ``generate`` returns may be updated in place and used in a graph (an inference tensor may not)."""
    from nemo_granular.embedded import models as M

    torch.manual_seed(0)
    cfg = load_train_config(LOCAL_CONFIGS / "grpo.yaml", TINY)
    tok = M.build_tokenizer()
    model = M.build_policy(cfg.model, tok).eval()
    gen = R.generate(
        model, tok, ["Q:1+2+3+4\n"] * 3, max_new_tokens=5, temperature=1.0, greedy=False, device=torch.device("cpu")
    )
    batch = R.to_nemo_batch(gen, tok.pad_token_id)
    R.old_policy_pass(model, batch, 1.0, 1024)
    for value in [*gen.values(), batch["prev_logprobs"], batch["prev_entropy"]]:
        assert not value.is_inference()


def _evals(run: Path, cache: Path | None) -> tuple[dict, list[str]]:
    """evals.json's scores of a fresh evaluation of ``run`` (suite all, 2 samples), and its log lines."""
    from nemo_granular.evals.embedded import evaluate_run
    from nemo_granular.evals.suite import protocols_for

    (run / "evals.json").unlink(missing_ok=True)
    lines: list[str] = []
    data = evaluate_run(run, protocols_for("all"), max_samples=2, log=lines.append, score_cache=cache)
    return {name: s["checkpoints"] for name, s in data["suites"].items()}, lines


def test_the_score_cache_gives_the_computed_scores_and_is_keyed_by_the_policy(tmp_path):
    """``compare`` scores a seed's shared step 0 (the warm start) once: the runs of that seed read it from the
    score cache. Every run's evals.json equals the one computed without the cache; a run whose step 0 is
    another policy (same seed, tokenizer and benchmarks) gets nothing from the cache for it."""
    from nemo_granular.embedded.trainer import Trainer

    ws = tmp_path / "warmstart"
    t = Trainer(
        load_train_config(LOCAL_CONFIGS / "grpo.yaml", [*TINY, "rl.steps=0", f"output_dir={ws}"]), log=lambda m: None
    )
    assert t.run() == 0
    init = ws / "checkpoints" / "step_000000" / "policy"
    runs = {}
    for alg in ("grpo", "gspo"):
        runs[alg] = tmp_path / alg
        _train(runs[alg], alg, f"model.init_from={init}", "checkpoint.every=1")
    from nemo_granular.embedded import models as M

    changed = M.load_pretrained_policy(str(init))  # another policy: one weight moved
    with torch.no_grad():
        changed.model.norm.weight[0] += 0.5
    changed.save_pretrained(str(tmp_path / "changed" / "policy"))
    shutil.copytree(ws / "checkpoints" / "step_000000" / "tokenizer", tmp_path / "changed" / "tokenizer")
    other = tmp_path / "other"
    _train(other, "sspo", f"model.init_from={tmp_path / 'changed' / 'policy'}")
    cache = tmp_path / "score-cache"
    plain = {name: _evals(run, None)[0] for name, run in [*runs.items(), ("other", other)]}
    first, log = _evals(runs["grpo"], cache)
    assert first == plain["grpo"] and not any("score cache" in line for line in log)
    again, log = _evals(runs["gspo"], cache)
    assert again == plain["gspo"]
    step0 = [line for line in log if " step 0: " in line]
    # sspo's greedy and sppo's sampled scores read from the cache (espo's capped setting is sppo's: reused in-process)
    assert len(step0) == 3 and all(line.endswith("(3 from the score cache)") for line in step0[:2]), log
    cached, log = _evals(other, cache)
    assert cached == plain["other"] and not any(" step 0: " in line and "score cache" in line for line in log)
