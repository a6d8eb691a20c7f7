"""The configuration contract: presets fill unset fields, and every bad value is a one-line
ValueError naming the field."""

import pytest

from nemo_granular.config import PRESETS, parse_advantage_config, parse_policy_loss_config
from nemo_granular.losses import GranularPolicyLoss

BAD = [
    ({"granular": {"sspo": {"beta": 1.5}}}, "sspo.beta"),
    ({"granular": {"sspo": {"beta": -0.1}}}, "sspo.beta"),
    ({"granular": {"sspo": {"gamma": 0.9}}}, "sspo.gamma"),
    ({"granular": {"sspo": {"alpha": -0.1}}}, "sspo.alpha"),
    ({"granular": {"espo": {"alpha": -1.0}}}, "espo.alpha"),
    ({"granular": {"algorithm": "espo", "espo": {"alpha": 0.0}}}, "espo.alpha"),
    ({"granular": {"espo": {"vocab_size": 1}}}, "espo.vocab_size"),
    ({"granular": {"entropy_top_fraction": 0.0}}, "entropy_top_fraction"),
    ({"granular": {"entropy_top_fraction": 1.0}}, "entropy_top_fraction"),
    ({"granular": {"entropy_top_fraction": 1.5}}, "entropy_top_fraction"),
    ({"granular": {"entropy_top_fraction": [0.5, 0.3]}}, "entropy_top_fraction"),
    ({"granular": {"entropy_top_fraction": []}}, "entropy_top_fraction"),
    ({"granular": {"segment_delimiters": []}}, "segment_delimiters"),
    ({"granular": {"segment_delimiters": [""]}}, "segment_delimiters"),
    ({"granular": {"algorithm": "ppo2"}}, "algorithm"),
    ({"granular": {"granularity": "paragraph"}}, "granularity"),
    ({"granular": {"ratio": "geometric"}}, "ratio"),
    ({"granular": {"clip": "adaptive"}}, "clip"),
    ({"granular": {"aggregation": "sum"}}, "aggregation"),
    ({"granular": {"eps_low": -0.1}}, "eps_low"),
    ({"granular": {"typo_field": 1}}, "typo_field"),
    ({"use_cispo": True}, "use_cispo"),
    ({"disable_ppo_ratio": True}, "disable_ppo_ratio"),
    ({"sequence_level_importance_ratios": True, "granular": {"algorithm": "sspo"}}, "sequence_level_importance_ratios"),
    ({"sequence_level_importance_ratios": True, "granular": {"algorithm": "espo"}}, "sequence_level_importance_ratios"),
    ({"ratio_clip_c": 1.0}, "ratio_clip_c"),
    ({"ratio_clip_min": -0.2}, "ratio_clip_min"),
    ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
    ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
     "truncated_importance_sampling_type"),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
      "truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_ratio_min"),
]


@pytest.mark.parametrize("cfg,field", BAD, ids=[f for _, f in BAD])
def test_bad_config_is_one_line_value_error_naming_the_field(cfg, field):
    with pytest.raises(ValueError) as err:
        parse_policy_loss_config(cfg)
    msg = str(err.value)
    assert "\n" not in msg and field in msg, msg
    with pytest.raises(ValueError):  # the loss object validates the same way
        GranularPolicyLoss(cfg)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_fill_unset_fields(name):
    g = parse_policy_loss_config({"granular": {"algorithm": name}}).granular
    for key in ("granularity", "ratio", "clip", "aggregation"):
        assert getattr(g, key) == PRESETS[name][key]
    assert (g.eps_low, g.eps_high) == tuple(PRESETS[name]["eps"])
    assert g.advantage == PRESETS[name]["advantage"]


def test_user_fields_override_preset_and_nemo_eps_override_granular_eps():
    cfg = parse_policy_loss_config({"granular": {"algorithm": "sspo", "clip": "fixed", "eps_low": 0.1},
                                    "ratio_clip_max": 0.28})
    assert cfg.granular.clip == "fixed" and cfg.granular.granularity == "segment"
    assert cfg.eps_low == 0.1 and cfg.eps_high == 0.28
    assert parse_policy_loss_config({"granular": {"algorithm": "gspo"}}).eps_high == 4e-4


def test_needs_entropy_and_cut_points():
    assert parse_policy_loss_config({"granular": {"algorithm": "espo"}}).granular.needs_entropy
    assert parse_policy_loss_config({"granular": {"algorithm": "sspo"}}).granular.needs_entropy
    assert not parse_policy_loss_config({"granular": {"algorithm": "gspo"}}).granular.needs_entropy
    g = parse_policy_loss_config({"granular": {"entropy_top_fraction": [0.1, 0.5]}}).granular
    assert g.entropy_cut_points == [0.1, 0.5]


def test_nemo_keys_pass_through_and_kl_in_reward():
    cfg = parse_policy_loss_config({"token_level_loss": True, "reference_policy_kl_penalty": 0.1,
                                    "use_kl_in_reward": True})
    assert cfg.kl_coef == 0.0


def test_omegaconf_input():
    from omegaconf import OmegaConf
    oc = OmegaConf.create({"granular": {"algorithm": "espo", "entropy_top_fraction": [0.2, 0.6]}})
    assert parse_policy_loss_config(OmegaConf.to_container(oc)).granular.entropy_cut_points == [0.2, 0.6]
    assert parse_policy_loss_config(oc).granular.algorithm == "espo"


def test_advantage_config():
    assert parse_advantage_config({"name": "espo"}).name == "espo"
    for bad, field in (({"name": "gae2"}, "name"), ({"name": "grpo", "epsilon": "x"}, "epsilon")):
        with pytest.raises(ValueError) as err:
            parse_advantage_config(bad)
        assert "\n" not in str(err.value) and field in str(err.value)
