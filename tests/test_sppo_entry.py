"""Entry script without NeMo-RL, estimator installation, and the decoupled-critic tokenizer check.

Worlds: the missing-NeMo-RL test forces the world without NeMo-RL in a subprocess
(``env_without_nemo_rl``); ``test_async_ppo_checks_mirror_nemo_rl`` takes the real checkout
(``nemo_rl_src``); the rest runs in both worlds.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import env_without_nemo_rl
from nemo_granular.advantages import SPPOEstimator
from nemo_granular.sppo.install import install_sppo_estimator, sppo_estimator_installed
from nemo_granular.sppo.validate import check_critic_tokenizer, check_same_tokenizer

pytestmark = pytest.mark.v070

ROOT = Path(__file__).resolve().parent.parent


def test_entry_script_names_missing_nemo_rl_in_one_line():
    """World without NeMo-RL (forced in the subprocess)."""
    cfg = ROOT / "examples" / "configs" / "sppo_r1_distill_qwen_1.5b.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_granular.run_sppo", "--config", str(cfg), "ppo.seed=1"],
        capture_output=True,
        text=True,
        env=env_without_nemo_rl(),
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("nemo_granular.run_sppo: error: NeMo-RL is not installed")
    assert "'nemo_rl'" in lines[0]
    helped = subprocess.run(
        [sys.executable, "-m", "nemo_granular.run_sppo", "--help"],
        capture_output=True,
        text=True,
        env=env_without_nemo_rl(),
        timeout=120,
    )
    assert helped.returncode == 0 and "--config" in helped.stdout


@pytest.mark.nemo_rl
def test_async_ppo_checks_mirror_nemo_rl(nemo_rl_src):
    """Issue 15.3: the checks of NeMo-RL's examples/run_ppo.py for async PPO, one line each,
    on NeMo-RL's own MasterConfig of our SPPO config."""
    import copy

    import nemo_rl.algorithms.ppo as ppo

    from nemo_granular.nemo_rl import compat
    from nemo_granular.nemo_rl.configs import load_resolved
    from nemo_granular.run_sppo import _check_async

    path = ROOT / "examples" / "configs" / "sppo_r1_distill_qwen_1.5b.yaml"
    base = load_resolved(path)
    if compat.find("async_ppo_train") is None:
        # v0.7.0 has no async PPO: the key is refused when the config loads, the check names the version
        ver = re.escape(compat.version().title)
        with pytest.raises(
            compat.VersionRefusal,
            match=rf"^ppo\.async_ppo: {{'enabled': True}} needs NeMo-RL main "
            rf"\(7ea279ab\); {ver} does not have this key \(PPO runs "
            rf"synchronously \(no async_ppo_train\)\)$",
        ):
            load_resolved(path, ["+ppo.async_ppo.enabled=true"])
        with pytest.raises(compat.VersionRefusal, match=rf"^ppo\.async_ppo\.enabled: true: {ver} has no async PPO "):
            _check_async(ppo.MasterConfig(**base))
        assert load_resolved(path, ["+ppo.async_ppo.enabled=false"]) == base  # the same as leaving it out
        return
    base["ppo"]["async_ppo"]["enabled"] = True
    base["ppo"]["max_num_epochs"] = -1
    base["loss_fn"]["use_importance_sampling_correction"] = True
    gen = base["policy"]["generation"]
    gen["backend"], gen["vllm_cfg"]["async_engine"], gen["colocated"]["enabled"] = "vllm", True, False

    def check(edit=None, generation=None):
        cfg = copy.deepcopy(base)
        if edit:
            edit(cfg)
        _check_async(ppo.MasterConfig(**cfg), generation)

    check()
    cases = [
        (lambda c: c["policy"]["generation"]["vllm_cfg"].update(async_engine=False), "async_engine=true"),
        (lambda c: c["loss_fn"].update(use_importance_sampling_correction=False), "use_importance_sampling_correction"),
        (lambda c: c["loss_fn"].update(force_on_policy_ratio=True), "force_on_policy_ratio=false"),
        (lambda c: c["policy"]["generation"]["colocated"].update(enabled=True), "colocated.enabled=false"),
        (lambda c: c["ppo"].update(max_num_epochs=100), "max_num_epochs=-1"),
        (lambda c: c["ppo"].update(use_dynamic_sampling=True), "^ppo.use_dynamic_sampling is not supported"),
        (lambda c: c["ppo"]["reward_scaling"].update(enabled=True), "^ppo.reward_scaling.enabled is not supported"),
        (lambda c: c["ppo"]["reward_shaping"].update(enabled=True), "^ppo.reward_shaping.enabled is not supported"),
        (lambda c: c["data"].update(use_multiple_dataloader=True), "^data.use_multiple_dataloader is not supported"),
        (lambda c: c["env"].update(should_use_nemo_gym=True), "NeMo Gym rollout"),
    ]
    for edit, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            check(edit)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="FP8 KV-scale synchronization"):
        check(generation=types.SimpleNamespace(requires_kv_scale_sync=True))
    check(generation=types.SimpleNamespace(requires_kv_scale_sync=False))


def _ppo_like():
    mod = types.ModuleType("ppo_like")

    def original(master_config):
        return ("original", master_config["ppo"]["adv_estimator"]["name"])

    mod._create_advantage_estimator = original
    return mod, original


def test_install_is_reversible_and_delegates_other_names():
    mod, original = _ppo_like()
    restore = install_sppo_estimator(mod)
    cfg = {"ppo": {"adv_estimator": {"name": "sppo", "gae_lambda": 0.95}}, "loss_fn": {}}
    assert isinstance(mod._create_advantage_estimator(cfg), SPPOEstimator)
    assert mod._create_advantage_estimator({"ppo": {"adv_estimator": {"name": "gae"}}}) == ("original", "gae")
    restore()
    assert mod._create_advantage_estimator is original
    restore()  # idempotent


def test_context_manager_restores_and_leaves_a_foreign_rebinding_alone():
    mod, original = _ppo_like()
    cfg = {"ppo": {"adv_estimator": {"name": "sppo"}}, "loss_fn": {}}
    with sppo_estimator_installed(mod):
        assert isinstance(mod._create_advantage_estimator(cfg), SPPOEstimator)
    assert mod._create_advantage_estimator is original
    restore = install_sppo_estimator(mod)
    other = lambda mc: "other"  # noqa: E731
    mod._create_advantage_estimator = other
    restore()
    assert mod._create_advantage_estimator is other


# ---- decoupled critic: same tokenizer ---------------------------------------------------

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "sat", "on", "mat", "1", "2", "+", "="]


def _save_tokenizer(path: Path, words, eos="</s>") -> str:
    specials = ["<pad>", "<unk>", "<s>", "</s>", "<|end|>"]
    vocab = {w: i for i, w in enumerate(specials + list(words))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token=eos
    )
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return {
        "policy": _save_tokenizer(d / "policy", WORDS),
        "critic_same": _save_tokenizer(d / "critic_same", WORDS),
        "critic_perm": _save_tokenizer(d / "critic_perm", WORDS[::-1]),
        "critic_more": _save_tokenizer(d / "critic_more", WORDS + ["dog"]),
        "critic_eos": _save_tokenizer(d / "critic_eos", WORDS, eos="<|end|>"),
    }


def test_same_tokenizer_passes_and_mismatches_raise(tok_dirs):
    load = transformers.AutoTokenizer.from_pretrained
    policy = load(tok_dirs["policy"])
    check_same_tokenizer(policy, load(tok_dirs["critic_same"]))
    with pytest.raises(ValueError, match=r"token '.*' has id \d+ in the policy tokenizer but \d+"):
        check_same_tokenizer(policy, load(tok_dirs["critic_perm"]), "pol", "crit")
    with pytest.raises(ValueError, match=r"vocabulary sizes differ \(14 vs 15\)"):
        check_same_tokenizer(policy, load(tok_dirs["critic_more"]))
    with pytest.raises(ValueError, match=r"special token eos_token differs") as err:
        check_same_tokenizer(policy, load(tok_dirs["critic_eos"]), "pol", "crit")
    assert "critic 'crit' does not share the policy tokenizer 'pol'" in str(err.value)
    assert "\n" not in str(err.value)


def test_check_from_config_uses_policy_tokenizer_and_value_model_name(tok_dirs):
    cfg = {
        "policy": {"model_name": "x", "tokenizer": {"name": tok_dirs["policy"]}},
        "value": {"model_name": tok_dirs["critic_same"]},
    }
    assert check_critic_tokenizer(cfg) is True
    cfg["value"]["model_name"] = tok_dirs["policy"]
    assert check_critic_tokenizer(cfg) is False  # same checkpoint: nothing to compare
    cfg["value"]["model_name"] = tok_dirs["critic_eos"]
    with pytest.raises(ValueError, match="does not share the policy tokenizer"):
        check_critic_tokenizer(cfg)
