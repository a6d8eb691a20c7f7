"""The SPPO / GRPO example configs, the sppo: section and the start-up validation.

Worlds: ``test_config_paper_settings[nemo_rl-*]`` runs with the real NeMo-RL checkout
(``nemo_rl_src``: full inheritance through NeMo-RL's own ``load_config``); everything else reads
our own files only and runs in both worlds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from nemo_granular.sppo.validate import parse_sppo_options, validate_sppo_config

pytestmark = pytest.mark.v070

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"
SPPO = ["sppo_r1_distill_qwen_1.5b.yaml", "sppo_r1_distill_qwen_7b.yaml", "sppo_r1_distill_qwen_7b_small_critic.yaml"]
GRPO = ["grpo_r1_distill_qwen_1.5b.yaml", "grpo_r1_distill_qwen_7b.yaml"]


def _load(path: Path, own_keys_only: bool = False) -> DictConfig:
    """NeMo-RL's load_config semantics (nemo_rl/utils/config.py): ``defaults`` relative to the
    file's directory, parents merged left to right, child last, top-level ``_override_``.
    ``own_keys_only``: skip parents inside ``nemo_rl/`` (NeMo-RL not reachable)."""
    cfg = OmegaConf.load(path)
    defaults = cfg.pop("defaults", None)
    if defaults is None:
        return cfg
    base = OmegaConf.create({})
    for d in [defaults] if isinstance(defaults, str) else list(defaults):
        if own_keys_only and str(d).startswith("nemo_rl/"):
            continue
        parent = _load(path.parent / str(d), own_keys_only)
        base = OmegaConf.merge(base, parent)
    for key in list(cfg.keys()):
        if isinstance(cfg[key], DictConfig) and cfg[key].get("_override_", False):
            cfg[key].pop("_override_")
            base.pop(key, None)
    return OmegaConf.merge(base, cfg)


def _resolved(name):
    from nemo_granular.nemo_rl.configs import load_resolved

    return load_resolved(CONFIGS / name)


EXPECT = {  # file: (model, critic, prompts/step, N, policy gbs, critic gbs, actor lr, critic lr, max seq)
    "sppo_r1_distill_qwen_1.5b.yaml": ("1.5B", "1.5B", 256, 1, 128, 128, 1e-6, 5e-6, 9216),
    "sppo_r1_distill_qwen_7b.yaml": ("7B", "7B", 512, 1, 32, 32, 1e-6, 1e-5, 10240),
    "sppo_r1_distill_qwen_7b_small_critic.yaml": ("7B", "1.5B", 512, 1, 32, 32, 1e-6, 1e-5, 10240),
    "grpo_r1_distill_qwen_1.5b.yaml": ("1.5B", None, 256, 8, 1024, None, 1e-6, None, 9216),
    "grpo_r1_distill_qwen_7b.yaml": ("7B", None, 512, 8, 256, None, 1e-6, None, 10240),
}


@pytest.mark.parametrize("mode", [pytest.param("nemo_rl", marks=pytest.mark.nemo_rl), "own_keys"])
@pytest.mark.parametrize("name", SPPO + GRPO)
def test_config_paper_settings(name, mode, request):
    if mode == "nemo_rl":  # full inheritance into NeMo-RL's own example configs (NeMo-RL world)
        request.getfixturevalue("nemo_rl_src")
        cfg = _resolved(name)
    else:  # only our own keys (what a checkout without NeMo-RL can check)
        cfg = OmegaConf.to_container(_load(CONFIGS / name, own_keys_only=True), resolve=False)
    model, critic, prompts, n, gbs, vgbs, lr, vlr, seq = EXPECT[name]
    algo = "ppo" if name.startswith("sppo") else "grpo"
    assert cfg["policy"]["model_name"] == f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{model}"
    assert cfg[algo]["num_prompts_per_step"] == prompts and cfg[algo]["num_generations_per_prompt"] == n
    assert cfg["policy"]["train_global_batch_size"] == gbs
    assert cfg["policy"]["optimizer"]["kwargs"]["lr"] == lr
    assert cfg["policy"]["max_total_sequence_length"] == seq
    assert cfg["policy"]["generation"]["temperature"] == 0.6 and cfg["policy"]["generation"]["max_new_tokens"] == 8192
    assert cfg["loss_fn"]["reference_policy_kl_penalty"] == 0.0
    assert cfg["loss_fn"]["ratio_clip_min"] == cfg["loss_fn"]["ratio_clip_max"] == 0.2
    assert cfg[algo]["reward_scaling"]["enabled"] is False and cfg[algo]["reward_shaping"]["enabled"] is False
    if algo == "ppo":
        opts, warnings = validate_sppo_config(cfg, source=name)
        assert warnings == [] and opts.prompt_only_critic and opts.dedup_prompts
        assert cfg["ppo"]["adv_estimator"]["name"] == "sppo" and cfg["ppo"]["ppo_epochs"] == 1
        assert cfg["value"]["train_global_batch_size"] == vgbs
        assert cfg["value"]["optimizer"]["kwargs"]["lr"] == vlr
        vm = cfg["value"]["model_name"]
        assert vm == f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{critic}" or (
            vm == "${policy.model_name}" and critic == model
        )
    else:
        assert cfg["grpo"]["use_leave_one_out_baseline"] is False and cfg["grpo"]["normalize_rewards"] is True
    if mode == "nemo_rl":
        # the NeMo-RL parent really provided the rest of a runnable config
        for section in ("cluster", "logger", "checkpointing", "data", "env"):
            assert section in cfg
        assert cfg["policy"]["dtensor_cfg"]["enabled"] is True
        if algo == "ppo":
            assert cfg["value"]["reward_model_cfg"] == {"enabled": True, "reward_model_type": "regression"}
            assert cfg["value_loss_fn"].keys() <= {"scale", "cliprange"}  # NeMo-RL forbids extra keys there


BASE = {
    "ppo": {
        "num_prompts_per_step": 8,
        "num_generations_per_prompt": 1,
        "ppo_epochs": 1,
        "adv_estimator": {"name": "sppo"},
        "reward_scaling": {"enabled": False},
        "reward_shaping": {"enabled": False},
    },
    "policy": {"train_global_batch_size": 4, "model_name": "p"},
    "value": {"train_global_batch_size": 8},
    "loss_fn": {"reference_policy_kl_penalty": 0.0},
}


def _with(path, value):
    cfg = copy.deepcopy(BASE)
    *head, last = path.split(".")
    cur = cfg
    for h in head:
        cur = cur.setdefault(h, {})
    cur[last] = value
    return cfg


@pytest.mark.parametrize(
    "path,value,match",
    [
        ("ppo.reward_scaling.enabled", True, r"x\.yaml: ppo\.reward_scaling\.enabled must be false"),
        ("ppo.reward_shaping.enabled", True, r"ppo\.reward_shaping\.enabled must be false"),
        ("ppo.adv_estimator.name", "gae", r"ppo\.adv_estimator\.name must be 'sppo' \(got 'gae'\)"),
        ("value.train_global_batch_size", 3, r"value\.train_global_batch_size=3 must divide"),
        ("value.sequence_packing.fuse_loss", True, r"fuse_loss must be false"),
        ("loss_fn.use_kl_in_reward", True, r"use_kl_in_reward must be false"),
        ("sppo.dedup", True, r"sppo\.dedup: Extra inputs are not permitted"),
    ],
)
def test_validation_errors_are_one_line(path, value, match):
    with pytest.raises(ValueError, match=match) as err:
        validate_sppo_config(_with(path, value), source="x.yaml")
    assert "\n" not in str(err.value)


def test_validation_warnings_and_defaults():
    opts, warnings = validate_sppo_config(BASE)
    assert warnings == [] and opts == parse_sppo_options(None)
    _, warnings = validate_sppo_config(_with("loss_fn.reference_policy_kl_penalty", 0.01))
    assert len(warnings) == 1 and "KL" in warnings[0]
    # no key: the loss applies NeMo-RL's default KL (0.01), so the warning is due too
    no_kl = {**BASE, "loss_fn": {}}
    _, warnings = validate_sppo_config(no_kl)
    assert len(warnings) == 1 and "reference_policy_kl_penalty=0.01 (unset: NeMo-RL's default)" in warnings[0]
    cfg = _with("ppo.num_generations_per_prompt", 2)
    _, warnings = validate_sppo_config(cfg)
    assert len(warnings) == 1 and "N = 1" in warnings[0]
    with pytest.raises(ValueError, match="section 'value' is missing"):
        validate_sppo_config({k: v for k, v in BASE.items() if k != "value"})
