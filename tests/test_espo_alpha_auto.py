"""`loss_fn.granular.espo.alpha: auto`: α = 3.5e-4·log|V|/H̄₀ from the first π_old pass (docs/algorithms/espo.md),
logged, and kept in the checkpoint so that a resumed run uses the same α — in the embedded trainer
(its trainer_state.json) and on NeMo-RL (nemo_granular_state.json in NeMo-RL's own checkpoint
directory, through the real ``CheckpointManager`` and the real ``GranularPolicy`` class)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import reference as R
from conftest import tiny_train
from nemo_granular.config import parse_policy_loss_config
from nemo_granular.losses import GranularPolicyLoss
from nemo_granular.nemo_rl.run_state import (
    STATE_FILE,
    checkpoint_dir_of,
    espo_alpha_for_step,
    load_run_state,
    save_run_state,
)

V = 16


def _auto_loss():
    return GranularPolicyLoss(
        {
            "granular": {"algorithm": "espo", "espo": {"alpha": "auto", "vocab_size": V}},
            "reference_policy_kl_penalty": 0.0,
        }
    )


def _rule(entropy, mask, vocab=V):
    """The documented rule on a float64 loop over the valid response tokens."""
    vals = [float(h) for h, m in zip(entropy.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m > 0]
    return 3.5e-4 * math.log(vocab) / (sum(vals) / len(vals))


def test_config_accepts_auto_and_refuses_other_words():
    assert parse_policy_loss_config({"granular": {"espo": {"alpha": "auto"}}}).granular.espo.alpha == "auto"
    with pytest.raises(ValueError) as err:
        parse_policy_loss_config({"granular": {"espo": {"alpha": "automatic"}}})
    assert "\n" not in str(err.value) and "espo.alpha" in str(err.value)


def test_loss_refuses_to_run_before_alpha_is_set_then_uses_the_rule():
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=2)
    fn = _auto_loss()
    assert fn.espo_alpha_pending
    with pytest.raises(ValueError, match="espo.alpha is 'auto'"):
        R.run_loss(fn, logp, data, gvs, gvt)
    mask = data["token_mask"] * data["sample_mask"][:, None]
    alpha = fn.calibrate_espo_alpha(data["prev_entropy"], mask)
    assert alpha == pytest.approx(_rule(data["prev_entropy"], mask), rel=1e-6) and not fn.espo_alpha_pending
    # the loss with the calibrated α is the loss with that α given as a number
    fixed = GranularPolicyLoss(
        {
            "granular": {"algorithm": "espo", "espo": {"alpha": alpha, "vocab_size": V}},
            "reference_policy_kl_penalty": 0.0,
        }
    )
    a, b = R.run_loss(fn, logp, data, gvs, gvt), R.run_loss(fixed, logp, data, gvs, gvt)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- NeMo-RL path


def _driver_batch(seed, scale=1.0):
    data, _, _, _ = R.make_batch(B=5, S=14, V=V, seed=seed)
    data["prev_entropy"] = data["prev_entropy"] * scale
    return data


def test_espo_alpha_for_step_calibrates_once_and_restores():
    loss, state = _auto_loss(), {}
    first = _driver_batch(0)
    mask = first["token_mask"] * first["sample_mask"][:, None]
    alpha = espo_alpha_for_step(loss, first, state)
    assert alpha == state["espo_alpha"] == pytest.approx(_rule(first["prev_entropy"], mask), rel=1e-6)
    # later steps keep it (their entropy differs: 3x)
    assert espo_alpha_for_step(loss, _driver_batch(1, 3.0), state) == alpha
    # a resumed process: a fresh loss and the saved state
    again = _auto_loss()
    assert espo_alpha_for_step(again, _driver_batch(1, 3.0), dict(state)) == alpha
    assert again.granular.espo.alpha == alpha
    # no `auto`: nothing to do, nothing logged
    fixed = GranularPolicyLoss({"granular": {"algorithm": "espo", "espo": {"alpha": 0.5, "vocab_size": V}}})
    assert espo_alpha_for_step(fixed, first, {}) is None


def test_state_file_is_written_whole_and_damage_is_one_line(tmp_path):
    path = save_run_state(tmp_path, {"espo_alpha": 0.01})
    assert path.name == STATE_FILE and load_run_state(tmp_path) == {"espo_alpha": 0.01}
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # no temporary left behind
    assert load_run_state(tmp_path / "absent") == {}
    path.write_text("{not json")
    with pytest.raises(ValueError) as err:
        load_run_state(tmp_path)
    assert "\n" not in str(err.value) and STATE_FILE in str(err.value)


@pytest.mark.nemo_rl
def test_state_survives_a_nemo_rl_checkpoint_and_resume(nemo_rl_src, tmp_path, monkeypatch):
    """The real CheckpointManager and the real GranularPolicy class (its Policy base stands in for
    the Ray workers: __init__ / train / save_checkpoint record their calls): grpo_train's save
    order (init_tmp_checkpoint → policy.save_checkpoint → finalisation), then setup's resume order
    (get_latest_checkpoint_path → get_resume_paths → policy_factory(weights_path=...))."""
    import os

    from nemo_rl.models.policy import lm_policy
    from nemo_rl.utils.checkpoint import CheckpointManager

    from nemo_granular.nemo_rl.policy import granular_policy_class

    calls = []

    def base_init(self, *args, **kwargs):
        calls.append(("init", kwargs.get("weights_path")))

    def base_train(self, data, loss_fn, **kwargs):
        calls.append(("train", float(loss_fn.granular.espo.alpha)))
        return {"loss": torch.zeros(1), "all_mb_metrics": {"loss": [0.0]}}

    def base_save(self, weights_path, optimizer_path=None, tokenizer_path=None, checkpointing_cfg=None):
        os.makedirs(weights_path)  # stand-in for the workers' weight files
        calls.append(("save", weights_path))

    monkeypatch.setattr(lm_policy.Policy, "__init__", base_init)
    monkeypatch.setattr(lm_policy.Policy, "train", base_train)
    monkeypatch.setattr(lm_policy.Policy, "save_checkpoint", base_save)
    GP = granular_policy_class()
    loss_cfg = {"granular": {"algorithm": "espo", "espo": {"alpha": "auto", "vocab_size": V}}}
    ckpt = CheckpointManager(
        {
            "checkpoint_dir": str(tmp_path / "ckpts"),
            "metric_name": None,
            "higher_is_better": False,
            "keep_top_k": 2,
            "save_period": 1,
            "save_optimizer": False,
        }
    )

    def policy(weights_path):
        p = GP(granular_loss_cfg=loss_cfg, delimiter_table=None, weights_path=weights_path)
        p._entropy_for = lambda data, timer=None: data.pop("_entropy")  # the stashed π_old entropy
        return p

    def step(p, loss, seed, scale):
        data = _driver_batch(seed, scale)
        data["_entropy"] = data.pop("prev_entropy")
        return p.train(data, loss)

    # a fresh run: α from the first rollout, logged in all_mb_metrics, saved with the checkpoint
    first = policy(None)
    loss = _auto_loss()
    out = step(first, loss, 0, 1.0)
    batch0 = _driver_batch(0)
    alpha = _rule(batch0["prev_entropy"], batch0["token_mask"] * batch0["sample_mask"][:, None])
    assert out["all_mb_metrics"]["espo_alpha"] == [pytest.approx(alpha, rel=1e-6)]
    tmp = ckpt.init_tmp_checkpoint(1, {"step": 1}, None)
    first.save_checkpoint(
        weights_path=os.path.join(tmp, "policy", "weights"),
        optimizer_path=None,
        tokenizer_path=os.path.join(tmp, "policy", "tokenizer"),
        checkpointing_cfg={},
    )
    assert (tmp / STATE_FILE).is_file()  # inside NeMo-RL's temporary directory, renamed with it
    ckpt.begin_finalization(tmp)
    ckpt.finalize_pending()

    # resume: setup's path to the weights, a fresh loss object; a rollout with 3x the entropy
    latest = ckpt.get_latest_checkpoint_path()
    assert (
        latest.endswith("step_1")
        and json.loads((checkpoint_dir_of(ckpt.get_resume_paths(latest)[0]) / STATE_FILE).read_text())["espo_alpha"]
        == out["all_mb_metrics"]["espo_alpha"][0]
    )
    weights, _ = ckpt.get_resume_paths(latest)
    resumed = policy(weights)
    loss2 = _auto_loss()
    out2 = step(resumed, loss2, 1, 3.0)
    assert out2["all_mb_metrics"]["espo_alpha"] == out["all_mb_metrics"]["espo_alpha"]
    assert calls[-1] == ("train", out["all_mb_metrics"]["espo_alpha"][0])
    # what a fresh calibration on that rollout would have given instead: visibly another α
    other = _auto_loss()
    b1 = _driver_batch(1, 3.0)
    assert other.calibrate_espo_alpha(b1["prev_entropy"], b1["token_mask"] * b1["sample_mask"][:, None]) < alpha / 2


def test_fallback_entropy_source_refuses_auto():
    from nemo_granular.run_grpo import check_config

    cfg = {
        "loss_fn": {"granular": {"algorithm": "espo", "espo": {"alpha": "auto"}}},
        "nemo_granular": {"entropy_source": "current_logits"},
        "grpo": {},
        "policy": {},
    }
    with pytest.raises(ValueError) as err:
        check_config(cfg)
    assert "\n" not in str(err.value) and "espo.alpha" in str(err.value)


# ---------------------------------------------------------------- embedded trainer


def test_embedded_resume_uses_the_alpha_of_the_first_rollout(tmp_path):
    from nemo_granular.embedded.config import LOCAL_CONFIGS, load_train_config
    from nemo_granular.embedded.trainer import Trainer

    tiny = tiny_train(f"output_dir={tmp_path}")
    cfg = load_train_config(LOCAL_CONFIGS / "espo.yaml", tiny + ["rl.steps=1"])
    assert cfg.loss_fn.granular.espo.alpha == "auto"  # the packaged ESPO config uses the rule
    first = Trainer(cfg, log=lambda m: None)
    seen = {}
    calibrate = first.loss_fn.calibrate_espo_alpha

    def spy(entropy, mask, *args):
        seen["rule"] = _rule(entropy, mask, first.vocab_size)
        return calibrate(entropy, mask, *args)

    first.loss_fn.calibrate_espo_alpha = spy
    assert first.run() == 0
    alpha = first.espo_alpha
    assert alpha == pytest.approx(seen["rule"], rel=1e-5)
    state = json.loads((first.last_checkpoint / "trainer_state.json").read_text())
    assert state["espo_alpha"] == alpha
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train/espo_alpha"] == alpha

    more = load_train_config(LOCAL_CONFIGS / "espo.yaml", tiny + ["rl.steps=2"])
    resumed = Trainer(more, resume=True, log=lambda m: None)
    assert resumed.espo_alpha == alpha and resumed.loss_fn.granular.espo.alpha == alpha
    resumed.loss_fn.calibrate_espo_alpha = lambda *a: pytest.fail("a resumed run must not recalibrate α")
    assert resumed.run() == 0
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/espo_alpha" in r] == [1, 2]
    assert records[-1]["train/espo_alpha"] == alpha
