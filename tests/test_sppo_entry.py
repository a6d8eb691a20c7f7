"""Entry script without NeMo-RL, estimator installation, and the decoupled-critic tokenizer check."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from nemo_granular.advantages import SPPOEstimator
from nemo_granular.sppo.install import install_sppo_estimator, sppo_estimator_installed
from nemo_granular.sppo.validate import check_critic_tokenizer, check_same_tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("nemo_rl") is not None, reason="NeMo-RL is installed here")
def test_entry_script_names_missing_nemo_rl_in_one_line(capsys):
    from nemo_granular.run_sppo import main

    cfg = ROOT / "examples" / "configs" / "sppo_r1_distill_qwen_1.5b.yaml"
    assert main(["--config", str(cfg), "ppo.seed=1"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("nemo_granular.run_sppo: error: NeMo-RL is not installed")
    assert "'nemo_rl'" in lines[0]
    with pytest.raises(SystemExit) as ex:
        main(["--help"])
    assert ex.value.code == 0 and "--config" in capsys.readouterr().out


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
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                bos_token="<s>", eos_token=eos)
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
    cfg = {"policy": {"model_name": "x", "tokenizer": {"name": tok_dirs["policy"]}},
           "value": {"model_name": tok_dirs["critic_same"]}}
    assert check_critic_tokenizer(cfg) is True
    cfg["value"]["model_name"] = tok_dirs["policy"]
    assert check_critic_tokenizer(cfg) is False  # same checkpoint: nothing to compare
    cfg["value"]["model_name"] = tok_dirs["critic_eos"]
    with pytest.raises(ValueError, match="does not share the policy tokenizer"):
        check_critic_tokenizer(cfg)
