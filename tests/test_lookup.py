"""``nemo_granular.lookup``: the one getter for nested configs (mappings and attribute objects)."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from nemo_granular.lookup import lookup

CFG = {
    "loss_fn": {"granular": {"espo": {"alpha": "auto"}}, "kl": None},
    "ppo": SimpleNamespace(num_generations_per_prompt=1, adv_estimator=None),
    "name": "run",
}


def test_paths_through_mappings_and_attribute_objects():
    assert lookup(CFG, "loss_fn.granular.espo.alpha") == "auto"
    assert lookup(CFG, ("loss_fn", "granular", "espo", "alpha")) == "auto"
    assert lookup(CFG, "ppo.num_generations_per_prompt") == 1
    assert lookup(OmegaConf.create({"a": {"b": 3}}), "a.b") == 3


def test_missing_keys_and_sections_give_the_default_and_a_none_value_stays_none():
    assert lookup(CFG, "loss_fn.granular.sspo.gamma", 1.75) == 1.75  # missing key
    assert lookup(CFG, "loss_fn.kl.coef", 0.0) == 0.0  # a None section on the way
    assert lookup(CFG, "loss_fn.kl", 0.0) is None  # a None value at the end
    assert lookup(CFG, "ppo.adv_estimator.name", "grpo") == "grpo"  # None attribute section
    assert lookup(CFG, "name.upper", "x") == "x"  # a string is not a section
