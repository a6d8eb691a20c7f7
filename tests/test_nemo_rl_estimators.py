"""``install()`` rebinding NeMo-RL's estimator factory, and ESPO's verification flag path.

NOTE: NeMo-RL cannot be installed here, so the rebinding/delegation tests build a TINY FAKE
``nemo_rl`` package in a temp dir: ``nemo_rl.algorithms.grpo`` with a
``_create_advantage_estimator(master_config)`` switch and a ``grpo_train`` that looks it up in
its module globals at call time, and ``nemo_rl.algorithms.grpo_sync`` that imports its own
binding with ``from ... import`` — the two binding patterns of the real modules at 7ea279ab.
The fake stands in only for the module being patched; the thing under test (our
``install``/``uninstall``/``patch_estimator_factory`` and the estimators they build) is real.
"""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
import torch

from nemo_granular.advantages import ESPOEstimator
from nemo_granular.nemo_rl import environments as envs
from nemo_granular.nemo_rl import estimators as est

FAKE_GRPO = """
from pydantic import BaseModel


class AdvEstimatorConfig(BaseModel, extra="allow"):
    name: str = "grpo"
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True


class GRPOConfig(BaseModel, extra="allow"):
    adv_estimator: AdvEstimatorConfig


class MasterConfig(BaseModel, extra="allow"):
    grpo: GRPOConfig
    loss_fn: dict = {}


class OriginalEstimator:
    def __init__(self, name):
        self.name = name


def _create_advantage_estimator(master_config):
    name = master_config.grpo.adv_estimator.name
    if name in ("grpo", "reinforce_plus_plus", "gdpo"):
        return OriginalEstimator(name)
    raise ValueError(f"Invalid adv_estimator name: {name}")


def grpo_train(master_config):
    return _create_advantage_estimator(master_config)
"""

FAKE_GRPO_SYNC = """
from nemo_rl.algorithms.grpo import _create_advantage_estimator


def grpo_train_sync(master_config):
    return _create_advantage_estimator(master_config)
"""

FAKE_PPO = """
def _create_advantage_estimator(master_config):
    return ("ppo-original", master_config["ppo"]["adv_estimator"]["name"])


def ppo_train(master_config):
    return _create_advantage_estimator(master_config)
"""


@pytest.fixture
def fake_nemo_rl(tmp_path, monkeypatch):
    root = tmp_path / "nemo_rl"
    (root / "algorithms").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "algorithms" / "__init__.py").write_text("")
    (root / "algorithms" / "grpo.py").write_text(textwrap.dedent(FAKE_GRPO))
    (root / "algorithms" / "grpo_sync.py").write_text(textwrap.dedent(FAKE_GRPO_SYNC))
    (root / "algorithms" / "ppo.py").write_text(textwrap.dedent(FAKE_PPO))
    monkeypatch.syspath_prepend(str(tmp_path))
    for k in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, k)
    import nemo_rl.algorithms.grpo as grpo
    import nemo_rl.algorithms.grpo_sync as grpo_sync

    yield grpo, grpo_sync
    est.uninstall()
    for k in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        del sys.modules[k]


def _master(grpo, name, **extra):
    return grpo.MasterConfig(grpo={"adv_estimator": {"name": name, **extra}}, loss_fn={})


def test_install_routes_our_names_and_delegates_the_rest(fake_nemo_rl):
    grpo, grpo_sync = fake_nemo_rl
    original_grpo, original_sync = grpo._create_advantage_estimator, grpo_sync._create_advantage_estimator
    handles = est.install()
    assert len(handles) == 2 and est.install() == handles  # idempotent
    assert isinstance(grpo.grpo_train(_master(grpo, "espo")).inner, ESPOEstimator)
    with pytest.raises(ValueError, match="'espo' cannot run in nemo_rl.algorithms.grpo_sync"):
        grpo_sync.grpo_train_sync(_master(grpo, "espo"))  # no message_log reaches its estimator
    for train in (grpo.grpo_train, grpo_sync.grpo_train_sync):
        assert type(train(_master(grpo, "grpo"))).__name__ == "GRPOEstimator"
        other = train(_master(grpo, "reinforce_plus_plus"))
        assert isinstance(other, grpo.OriginalEstimator) and other.name == "reinforce_plus_plus"
        with pytest.raises(ValueError, match="Invalid adv_estimator name: bogus"):
            train(_master(grpo, "bogus"))
        with pytest.raises(ValueError, match="run_sppo"):
            train(_master(grpo, "sppo"))
    est.uninstall()
    assert grpo._create_advantage_estimator is original_grpo
    assert grpo_sync._create_advantage_estimator is original_sync
    assert isinstance(grpo.grpo_train(_master(grpo, "grpo")), grpo.OriginalEstimator)
    with pytest.raises(ValueError):
        grpo.grpo_train(_master(grpo, "espo"))


def test_context_manager_and_name_subset(fake_nemo_rl):
    grpo, _ = fake_nemo_rl
    with est.installed(names=["espo"]):
        assert isinstance(grpo.grpo_train(_master(grpo, "espo")).inner, ESPOEstimator)
        assert isinstance(grpo.grpo_train(_master(grpo, "grpo")), grpo.OriginalEstimator)  # not taken over
    with pytest.raises(ValueError):
        grpo.grpo_train(_master(grpo, "espo"))


def test_generic_patch_for_ppo_with_dict_configs(fake_nemo_rl):
    import nemo_rl.algorithms.ppo as ppo

    built = []
    handle = est.patch_estimator_factory(
        "nemo_rl.algorithms.ppo", {"sppo": lambda mc: built.append(mc) or "ours"}, config_section="ppo"
    )
    cfg = {"ppo": {"adv_estimator": {"name": "sppo"}}}
    assert ppo.ppo_train(cfg) == "ours" and built == [cfg]
    assert ppo.ppo_train({"ppo": {"adv_estimator": {"name": "gae"}}}) == ("ppo-original", "gae")
    handle.restore()
    assert ppo.ppo_train(cfg) == ("ppo-original", "sppo")


def test_patch_refuses_missing_attribute(fake_nemo_rl):
    import nemo_rl.algorithms as algos

    with pytest.raises(AttributeError, match="7ea279ab"):
        est.patch_estimator_factory(algos, {"espo": lambda mc: None})


# ------------------------------------------------------------------ ESPO flag: env -> repeated_batch -> estimator
def _message_log(content_env):
    log = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    if content_env is not None:
        log.append({"role": "environment", "content": content_env})
    return log


def test_espo_observations_mark_unextractable_answers():
    obs = envs.espo_observations([1.0, 0.0, 0.0, 0.0], ["4", "5", None, " "])
    assert [o["content"] for o in obs] == [
        envs.CORRECT_CONTENT,
        envs.INCORRECT_CONTENT,
        envs.VERIFICATION_FAILED_CONTENT,
        envs.VERIFICATION_FAILED_CONTENT,
    ]
    assert all(o["role"] == "environment" for o in obs)
    with pytest.raises(ValueError, match="2 scores but 1 answers"):
        envs.espo_observations([1.0, 0.0], ["4"])


def test_espo_estimator_reads_flags_from_the_rollout_as_grpo_train_calls_it():
    """grpo_train's call: prompt_ids, rewards, mask, repeated_batch, logprobs_policy, logprobs_reference."""
    obs = envs.espo_observations([1, 0, 0, 1, 0, 0], ["1", "2", None, "1", None, "3"])
    repeated_batch = {
        "message_log": [_message_log(o["content"]) for o in obs],
        "total_reward": torch.tensor([1.0, 0, 0, 1, 0, 0]),
    }
    prompt_ids = torch.tensor([[5, 6, 0]] * 3 + [[7, 8, 9]] * 3)
    rewards = repeated_batch["total_reward"]
    mask = torch.ones(6, 4)
    cfg = {
        "grpo": {"adv_estimator": {"name": "espo", "normalize_rewards": True, "use_leave_one_out_baseline": False}},
        "loss_fn": {},
    }
    estimator = est.build_grpo_estimator(cfg)
    adv = estimator.compute_advantage(
        prompt_ids=prompt_ids,
        rewards=rewards,
        mask=mask,
        repeated_batch=repeated_batch,
        logprobs_policy=torch.zeros(6, 4),
        logprobs_reference=torch.zeros(6, 4),
    )
    flags = repeated_batch["verification_failed"]
    assert flags.tolist() == [False, False, True, False, True, False]
    direct = ESPOEstimator(cfg["grpo"]["adv_estimator"]).compute_advantage(
        prompt_ids, rewards, mask, verification_failed=flags
    )
    torch.testing.assert_close(adv, direct)
    assert adv[2].abs().sum() == 0 and adv[4].abs().sum() == 0  # failed: A = 0
    assert adv[0].abs().sum() > 0
    assert estimator.last_metrics["verification_failed_frac"] == pytest.approx(2 / 6)


def test_flags_set_by_an_environment_win_and_missing_observations_warn_once(monkeypatch):
    batch = {
        "message_log": [_message_log(envs.VERIFICATION_FAILED_CONTENT)],
        "verification_failed": torch.tensor([False]),
    }
    assert envs.attach_verification_flags(batch).tolist() == [False]
    monkeypatch.setattr(envs, "_warned_no_flags", False)
    with pytest.warns(UserWarning, match="espo_math"):
        assert envs.attach_verification_flags({"message_log": [_message_log(None)]}).tolist() == [False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envs.attach_verification_flags({"message_log": [_message_log(None)]})
    with pytest.raises(KeyError, match="message_log"):
        envs.attach_verification_flags({})
