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
    ({"use_cispo": True, "disable_ppo_ratio": True}, "use_cispo"),
    ({"use_cispo": True, "token_level_loss": False}, "use_cispo"),
    ({"use_cispo": True, "ratio_clip_c": 3.0}, "use_cispo"),
    ({"use_cispo": True, "force_on_policy_ratio": True}, "use_cispo"),
    ({"granular": {"algorithm": "cispo"}, "ratio_clip_c": 3.0}, "surrogate"),
    ({"use_cispo": True, "granular": {"surrogate": "clipped"}}, "use_cispo"),
    ({"disable_ppo_ratio": True, "granular": {"surrogate": "cispo"}}, "disable_ppo_ratio"),
    ({"granular": {"surrogate": "ppo"}}, "surrogate"),
    ({"token_level_loss": True, "granular": {"aggregation": "seq_mean_group_mean"}}, "token_level_loss"),
    ({"token_level_loss": False, "granular": {"aggregation": "token_mean"}}, "token_level_loss"),
    (
        {"sequence_level_importance_ratios": True, "token_level_loss": True, "granular": {"algorithm": "gspo"}},
        "sequence_level_importance_ratios",
    ),
    ({"sequence_level_importance_ratios": True, "granular": {"algorithm": "sspo"}}, "sequence_level_importance_ratios"),
    ({"sequence_level_importance_ratios": True, "granular": {"algorithm": "espo"}}, "sequence_level_importance_ratios"),
    ({"ratio_clip_c": 1.0}, "ratio_clip_c"),
    ({"ratio_clip_min": -0.2}, "ratio_clip_min"),
    ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
    (
        {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
        "truncated_importance_sampling_type",
    ),
    (
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio": 2.0,
        },
        "truncated_importance_sampling_ratio_min",
    ),
    (
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.0,
            "truncated_importance_sampling_ratio_min": 2.0,
        },
        "truncated_importance_sampling_ratio_min",
    ),
    (
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"},
        "truncated_importance_sampling_ratio",
    ),
    ({"truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_ratio"),
    (
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio": 1.01,
            "truncated_importance_sampling_ratio_min": 0.99,
            "sequence_level_importance_ratios": True,
            "granular": {"algorithm": "gspo"},
        },
        "seq-mask-tis",
    ),
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
    cfg = parse_policy_loss_config(
        {"granular": {"algorithm": "sspo", "clip": "fixed", "eps_low": 0.1}, "ratio_clip_max": 0.28}
    )
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
    cfg = parse_policy_loss_config(
        {"token_level_loss": True, "reference_policy_kl_penalty": 0.1, "use_kl_in_reward": True}
    )
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


def test_docs_key_tables_are_rendered_from_the_code_tables():
    """docs/nemo-rl.md §3 shows NEMO_RL_LOSS_KEYS / NEMO_RL_ESTIMATOR_KEYS exactly (the code tables are
    compared with NeMo-RL's real config classes in test_nemo_rl_dropin.py): neither can drift."""
    import re
    from pathlib import Path

    from nemo_granular.config import NEMO_RL_ESTIMATOR_KEYS, NEMO_RL_LOSS_KEYS, NEMO_RL_NEXT_LOSS_KEYS, render_key_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "nemo-rl.md").read_text()
    for tag, table in (
        ("nemo-rl-loss-keys", render_key_table(NEMO_RL_LOSS_KEYS)),
        ("nemo-rl-next-loss-keys", render_key_table(NEMO_RL_NEXT_LOSS_KEYS)),
        ("nemo-rl-estimator-keys", render_key_table(NEMO_RL_ESTIMATOR_KEYS, "notes")),
    ):
        block = re.search(rf"<!-- {tag}:begin[^\n]*-->\n(.*?)\n<!-- {tag}:end -->", doc, re.S)
        assert block is not None, tag
        assert block.group(1) == table, f"docs/nemo-rl.md {tag} differs from nemo_granular.config"


def test_defaults_are_nemo_rl_defaults():
    """Keys left out get NeMo-RL's defaults (the values are checked against NeMo-RL's real classes in
    test_nemo_rl_dropin.py); a preset fills only what it implies (ε, aggregation)."""
    from nemo_granular.config import NEMO_RL_ESTIMATOR_KEYS, NEMO_RL_LOSS_KEYS

    assert parse_policy_loss_config({}).nemo_rl_view() == {k: v[1] for k, v in NEMO_RL_LOSS_KEYS.items()}
    adv = parse_advantage_config({})
    for key in ("name", "normalize_rewards", "use_leave_one_out_baseline"):
        assert getattr(adv, key) == NEMO_RL_ESTIMATOR_KEYS[key][1], key
    gspo = parse_policy_loss_config({"granular": {"algorithm": "espo"}}).nemo_rl_view()
    assert gspo["token_level_loss"] is False and gspo["reference_policy_kl_penalty"] == 0.01


def test_token_level_loss_override_warns_and_dumps_round_trip():
    """A given token_level_loss that overrides a named preset's aggregation says so; a parsed
    config dumped and parsed again (as the embedded trainer does) is the same config, silently."""
    import warnings

    with pytest.warns(UserWarning, match="token_level_loss: true overrides algorithm 'espo'"):
        cfg = parse_policy_loss_config({"token_level_loss": True, "granular": {"algorithm": "espo"}})
    assert cfg.granular.aggregation == "token_mean"
    for raw in (
        {"token_level_loss": True, "granular": {"algorithm": "espo"}},
        {"granular": {"algorithm": "cispo"}},
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
        {"disable_ppo_ratio": True, "force_on_policy_ratio": True},
        {},
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = parse_policy_loss_config(raw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = parse_policy_loss_config(first.model_dump())
        assert again.model_dump() == first.model_dump(), raw
        assert again.nemo_rl_view() == first.nemo_rl_view(), raw


def test_nemo_rl_modes_select_the_surrogate_and_groups():
    c = parse_policy_loss_config({"use_cispo": True})
    assert (c.granular.surrogate, c.granular.granularity) == ("cispo", "token")
    assert parse_policy_loss_config({"disable_ppo_ratio": True}).granular.surrogate == "reinforce"
    # NeMo-RL checks force_on_policy_ratio first: the forced ratio wins over disable_ppo_ratio
    assert (
        parse_policy_loss_config({"disable_ppo_ratio": True, "force_on_policy_ratio": True}).granular.surrogate
        == "clipped"
    )
    # with no granular choice, sequence_level_importance_ratios is NeMo-RL's GSPO mode
    g = parse_policy_loss_config({"sequence_level_importance_ratios": True, "token_level_loss": False}).granular
    assert (g.granularity, g.ratio, g.aggregation) == ("sequence", "shared", "seq_mean_token_mean")
    # CISPO at other granularities and aggregations through the preset
    g = parse_policy_loss_config(
        {"granular": {"algorithm": "cispo", "granularity": "segment"}, "token_level_loss": False}
    ).granular
    assert (g.surrogate, g.granularity, g.aggregation) == ("cispo", "segment", "seq_mean_token_mean")


def test_embedded_trainer_has_no_reference_policy():
    """The embedded trainer keeps no reference model: its β defaults to 0 (NeMo-RL's 0.01 would
    need one) and a non-zero β is refused in one line; its other keys are NeMo-RL's defaults."""
    from nemo_granular.embedded.config import load_train_config

    cfg = load_train_config(None)
    assert cfg.loss_fn.reference_policy_kl_penalty == 0.0 and cfg.loss_fn.token_level
    assert cfg.grpo.adv_estimator.use_leave_one_out_baseline  # NeMo-RL's default; base.yaml sets false
    with pytest.raises(ValueError) as err:
        load_train_config("grpo", ["loss_fn.reference_policy_kl_penalty=0.1"])
    assert "\n" not in str(err.value) and "reference_policy_kl_penalty" in str(err.value)
    assert load_train_config("grpo").grpo.adv_estimator.use_leave_one_out_baseline is False


def test_config_stays_as_given_and_resolves_once_into_a_frozen_spec():
    """The pydantic models keep what was given (None: left out) and refuse assignment; the effective
    values live in the frozen spec, computed at validation (no post-validation rewriting)."""
    import dataclasses

    from nemo_granular.config import NEMO_RL_LOSS_KEYS, NEMO_RL_NEXT_LOSS_KEYS, PolicyLossConfig, PolicyLossSpec

    raw = {"sequence_level_importance_ratios": True, "token_level_loss": False}
    cfg = PolicyLossConfig.model_validate(raw)
    g = cfg.granular
    assert (g.granularity, g.aggregation, g.is_level, g.eps_low) == (None, None, None, None)
    spec = cfg.spec
    assert (spec.granular.granularity, spec.granular.aggregation, spec.granular.is_level) == (
        "sequence",
        "seq_mean_token_mean",
        "group_sum",
    )
    assert parse_policy_loss_config(raw) == spec and parse_policy_loss_config(spec) is spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.granular.is_level = "token"
    with pytest.raises(ValueError):
        cfg.granular.is_level = "token"  # pydantic: frozen
    fields = {f.name for f in dataclasses.fields(PolicyLossSpec)} - {"granular"}
    assert fields == set(NEMO_RL_LOSS_KEYS) | set(NEMO_RL_NEXT_LOSS_KEYS)
