"""The NeMo-RL glue's pure parts, called with NeMo-RL's shapes and keys (single process).

Entropy post-processing as the worker extensions call it (per microbatch, then stacked like
the logprobs), group ids on the driver batch, the fallback's rollout-split warning, the entry
script's start-up checks and its one-line error when NeMo-RL is missing (a real subprocess).

Worlds: every test here runs in both worlds (torch only), except
``test_entry_script_without_nemo_rl_prints_one_line``, which forces the world WITHOUT NeMo-RL
in its subprocess (``env_without_nemo_rl``).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import env_without_nemo_rl
from nemo_granular import run_grpo
from nemo_granular.config import parse_advantage_config, parse_policy_loss_config
from nemo_granular.distributed import pack_sequences
from nemo_granular.losses import GranularPolicyLoss
from nemo_granular.nemo_rl import fallback, policy, workers

ROOT = Path(__file__).resolve().parent.parent


def _entropy_ref(logits):
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


def _columns(h, lengths, S):
    out = torch.zeros(h.shape[0], S, dtype=torch.float64)
    out[:, 1:] = h[:, : S - 1]
    return out * (torch.arange(S)[None, :] < lengths[:, None])


def test_megatron_unpacked_and_dtensor_packed_entropy_match_dense():
    g = torch.Generator().manual_seed(0)
    B, S, V = 4, 9, 13
    lengths = torch.tensor([9, 3, 6, 1])
    logits = torch.randn(B, S, V, generator=g)
    expect = _columns(_entropy_ref(logits), lengths, S).float()
    mega = workers.megatron_entropy(logits, input_lengths=lengths, seq_len=S, chunk_size=5)
    torch.testing.assert_close(mega, expect, rtol=1e-5, atol=1e-5)
    assert mega.dtype == torch.float32 and mega.shape == (B, S)
    # DTensor packing: no padding between sequences, unpacked by cu_seqlens_q
    packed, cu, _ = pack_sequences(logits, lengths)
    dt = workers.dtensor_entropy(packed[None], input_lengths=lengths, seq_len=S, cu_seqlens_q=cu)
    torch.testing.assert_close(dt, expect, rtol=1e-5, atol=1e-5)
    # bf16 logits (defer_fp32_logits off): float32 accumulation
    bf = workers.megatron_entropy(logits.bfloat16(), input_lengths=lengths, seq_len=S)
    assert bf.dtype == torch.float32 and (bf - expect).abs().max() < 0.05


def test_megatron_packed_entropy_matches_dense():
    """Megatron's packed layout at CP 1: each sequence at the start of its ``cu_seqlens_padded`` slot (slots
    padded to a multiple of 4, the padding holding other logits), laid out here by hand, unpacked into
    NeMo-RL's token columns: the float64 entropy of the dense logits (one position late, 0 past each length)."""
    g = torch.Generator().manual_seed(1)
    B, S, V = 4, 9, 13
    lengths = torch.tensor([9, 3, 6, 1])
    logits = torch.randn(B, S, V, generator=g)
    slots = [-(-n // 4) * 4 for n in lengths.tolist()]  # 12, 4, 8, 4: every slot but the 6's has padding
    starts = [sum(slots[:i]) for i in range(B + 1)]
    packed = 3 * torch.randn(1, starts[-1], V, generator=g)
    for i, n in enumerate(lengths.tolist()):
        packed[0, starts[i] : starts[i] + n] = logits[i, :n]
    got = workers.megatron_entropy(
        packed, input_lengths=lengths, seq_len=S, cu_seqlens_padded=torch.tensor(starts), chunk_size=5
    )
    assert got.dtype == torch.float32 and got.shape == (B, S)
    torch.testing.assert_close(got, _columns(_entropy_ref(logits), lengths, S).float(), rtol=1e-5, atol=1e-5)


def test_stack_microbatch_entropy_pads_and_drops_dummy_batches():
    a, b, dummy = torch.ones(2, 5), 2 * torch.ones(1, 7), 9 * torch.ones(2, 7)
    out = workers.stack_microbatch_entropy([a, b, dummy], rows=3, seq_len=7)
    assert out.shape == (3, 7) and out[:2, 5:].abs().sum() == 0 and (out[2] == 2).all()
    with pytest.raises(RuntimeError, match="2 rows collected"):
        workers.stack_microbatch_entropy([a], rows=3, seq_len=7)


def test_swap_attr_restores_on_error():
    class Holder:
        X = 1

    with pytest.raises(RuntimeError):
        with workers.swap_attr(Holder, "X", 2):
            assert Holder.X == 2
            raise RuntimeError("boom")
    assert Holder.X == 1


def test_extension_fqn_for_backends():
    assert policy.extension_fqn_for({"megatron_cfg": {"enabled": True}}) == workers.MEGATRON_EXTENSION_FQN
    assert (
        policy.extension_fqn_for({"megatron_cfg": {"enabled": False}, "dtensor_cfg": {"enabled": True, "_v2": True}})
        == workers.DTENSOR_V2_EXTENSION_FQN
    )
    with pytest.raises(ValueError, match="DTensor v1"):
        policy.extension_fqn_for({"dtensor_cfg": {"enabled": True, "_v2": False}})


def test_driver_group_ids_sspo_and_shape_checks():
    cfg = {"granular": {"algorithm": "sspo"}}
    table = torch.zeros(10, dtype=torch.bool)
    table[7] = True
    ids = torch.tensor([[1, 2, 3, 7, 4, 7, 5, 0], [1, 7, 7, 2, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
    data = {"input_ids": ids, "token_mask": mask}
    policy.add_granular_keys(data, cfg, torch.rand(2, 8), table)
    assert data["granular_group_ids"].tolist() == [[-1, -1, 0, 0, 1, 1, 2, -1], [-1, 0, 1, 2, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="prev_entropy has shape"):
        policy.add_granular_keys(dict(data), cfg, torch.rand(2, 7), table)
    with pytest.raises(ValueError, match="needs the π_old entropy"):
        policy.add_granular_keys(dict(data), cfg, None, table)
    # GSPO: no ids needed, no entropy needed
    plain = {"input_ids": ids, "token_mask": mask}
    policy.add_granular_keys(plain, {"granular": {"algorithm": "gspo"}}, None)
    assert "granular_group_ids" not in plain and "prev_entropy" not in plain


def test_rollout_split_warning_once(monkeypatch):
    monkeypatch.setattr(fallback, "_warned", False)
    one = {
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8},
        "policy": {"train_global_batch_size": 64},
    }
    split = {
        "grpo": {"num_prompts_per_step": 32, "num_generations_per_prompt": 16},
        "policy": {"train_global_batch_size": 128},
    }
    assert fallback.rollout_split_steps(split) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fallback.warn_if_rollout_split(one) is False
    with pytest.warns(UserWarning, match="split into 4 optimizer steps"):
        assert fallback.warn_if_rollout_split(split) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # second time: silent
        assert fallback.warn_if_rollout_split(split) is True


def test_entry_script_modes_and_loss(monkeypatch):
    with pytest.raises(ValueError, match="data_plane.enabled"):
        run_grpo.check_supported_modes({"data_plane": {"enabled": True}})
    with pytest.raises(ValueError, match="single-controller"):
        run_grpo.check_supported_modes({"data_plane": {"enabled": False}, "async_rl": {}})
    run_grpo.check_supported_modes({"data_plane": {"enabled": False}})
    assert run_grpo.runtime_options({}) == {"entropy_source": "extension", "allow_ratio_always_one": False}
    with pytest.raises(ValueError, match="entropy_source"):
        run_grpo.runtime_options({"nemo_granular": {"entropy_source": "vllm"}})
    with pytest.raises(ValueError, match="unknown key"):
        run_grpo.runtime_options({"nemo_granular": {"entropy": "x"}})
    master = {
        "loss_fn": {"reference_policy_kl_penalty": 0.0, "granular": {"algorithm": "espo"}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4},
        "policy": {"train_global_batch_size": 16},
    }
    loss = run_grpo.build_loss(master, None, 32000)
    assert isinstance(loss, GranularPolicyLoss) and loss.vocab_size == 32000
    monkeypatch.setattr(fallback, "_warned", False)
    fb = run_grpo.build_loss(master, None, 32000, "current_logits")
    assert isinstance(fb, fallback.CurrentLogitsEntropyLoss) and fb.input_type.name == "LOGIT"
    assert fb.loss_type == loss.loss_type


def test_entry_script_without_nemo_rl_prints_one_line(tmp_path):
    """World without NeMo-RL (forced: the subprocess must not see a NEMO_RL_SRC checkout)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("grpo: {}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_granular.run_grpo", "--config", str(cfg), "grpo.x=1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env_without_nemo_rl(),
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "missing package 'nemo_rl'" in lines[0]


@pytest.mark.parametrize("name", ["sspo_math_1B.yaml", "espo_math_1B.yaml"])
def test_example_configs_validate(name):
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "examples" / "configs" / "nemo_rl" / name))
    assert cfg["defaults"].startswith("upstream/")
    loss = parse_policy_loss_config(cfg["loss_fn"])
    parse_advantage_config(cfg["grpo"]["adv_estimator"])
    opts = run_grpo.check_config(cfg)  # includes: the ratio is not identically 1
    assert opts["entropy_source"] == "extension" and opts["allow_ratio_always_one"] is False
    n = cfg["grpo"]["num_prompts_per_step"] * cfg["grpo"]["num_generations_per_prompt"]
    assert n // cfg["policy"]["train_global_batch_size"] >= 2  # an off-policy optimizer step per rollout
    assert loss.granular.algorithm == name.split("_")[0]


RATIO_BASE = {
    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8},
    "policy": {"train_global_batch_size": 32},
    "loss_fn": {"granular": {"algorithm": "sspo"}},
}


def _cfg(**sections):
    import copy

    cfg = copy.deepcopy(RATIO_BASE)
    for key, value in sections.items():
        *head, last = key.split("__")
        cur = cfg
        for h in head:
            cur = cur.setdefault(h, {})
        cur[last] = value
    return cfg


def test_ratio_one_settings_are_refused_unless_allowed():
    """Issue 11.2: force_on_policy_ratio and one optimizer step per rollout make the ratio 1."""
    assert run_grpo.check_config(_cfg())["allow_ratio_always_one"] is False
    with pytest.raises(
        ValueError,
        match=r"^loss_fn\.force_on_policy_ratio: true fixes the importance ratio at 1.*"
        r"nemo_granular\.allow_ratio_always_one: true",
    ) as err:
        run_grpo.check_config(_cfg(loss_fn__force_on_policy_ratio=True))
    assert "\n" not in str(err.value)
    with pytest.raises(
        ValueError,
        match=r"one optimizer step per rollout \(grpo\.num_prompts_per_step × "
        r"num_generations_per_prompt = 64, policy\.train_global_batch_size=64\)",
    ):
        run_grpo.check_config(_cfg(policy__train_global_batch_size=64))
    allowed = run_grpo.check_config(
        _cfg(policy__train_global_batch_size=64, nemo_granular__allow_ratio_always_one=True)
    )
    assert allowed["allow_ratio_always_one"] is True
    run_grpo.check_config(_cfg(loss_fn__force_on_policy_ratio=True, nemo_granular__allow_ratio_always_one=True))
    with pytest.raises(ValueError, match="allow_ratio_always_one: must be true or false"):
        run_grpo.check_config(_cfg(nemo_granular__allow_ratio_always_one="yes"))
    # PPO: epochs multiply the optimizer steps
    from nemo_granular.nemo_rl.configs import check_ratio_is_active

    ppo = {
        "ppo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 1, "ppo_epochs": 1},
        "policy": {"train_global_batch_size": 8},
        "loss_fn": {},
    }
    with pytest.raises(ValueError, match=r"ppo\.ppo_epochs=1.*sppo\.allow_ratio_always_one"):
        check_ratio_is_active(ppo, "ppo", "sppo.allow_ratio_always_one")
    ppo["ppo"]["ppo_epochs"] = 2
    check_ratio_is_active(ppo, "ppo", "sppo.allow_ratio_always_one")


@pytest.mark.parametrize(
    "key",
    [
        "grpo__use_dynamic_sampling",
        "grpo__reward_scaling__enabled",
        "grpo__reward_shaping__enabled",
        "data__use_multiple_dataloader",
    ],
)
def test_async_grpo_refuses_what_nemo_rl_launcher_refuses(key):
    """Issue 15.3: examples/run_grpo.py's async checks (async_grpo_train does not repeat them)."""
    run_grpo.check_config(_cfg(**{key: True}))  # synchronous: allowed
    with pytest.raises(ValueError, match=rf"^{key.replace('__', '.')}: true is not supported with async GRPO") as err:
        run_grpo.check_config(_cfg(**{key: True, "grpo__async_grpo__enabled": True}))
    assert "\n" not in str(err.value)
    run_grpo.check_config(_cfg(grpo__async_grpo__enabled=True))


def test_sync_logger_adds_estimator_metrics_once_per_advantage_call():
    """Issue 15.5: grpo_train never logs adv_estimator.last_metrics; the wrapper adds them to the
    step's main ``train`` call after each compute_advantage, never to a stale step, never twice,
    and never over a key the loop already logged (async runs)."""
    calls = []

    class Recorder:
        def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
            calls.append((dict(metrics), step, prefix))

        def other(self):
            return "delegated"

    est = types_ns(calls=0, last_metrics={})
    log = run_grpo.EstimatorMetricsLogger(Recorder(), estimator_source=lambda: est)
    assert log.other() == "delegated"
    log.log_metrics({"reward": 1.0}, 1, prefix="train")  # rollout metrics, before the estimator ran
    est.calls, est.last_metrics = 1, {"verification_failed_frac": 0.25}
    log.log_metrics({"t": 1.0}, 1, prefix="timing/train")  # other prefixes untouched
    log.log_metrics({"loss": 0.5}, 1, prefix="train")  # the step's main train metrics
    log.log_metrics({"reward": 2.0}, 2, prefix="train")  # step 2 rollout: estimator not yet run
    est.calls, est.last_metrics = 2, {"verification_failed_frac": 0.5}
    log.log_metrics({"verification_failed_frac": 0.75}, 2, prefix="train")  # async: already there
    assert calls == [
        ({"reward": 1.0}, 1, "train"),
        ({"t": 1.0}, 1, "timing/train"),
        ({"loss": 0.5, "verification_failed_frac": 0.25}, 1, "train"),
        ({"reward": 2.0}, 2, "train"),
        ({"verification_failed_frac": 0.75}, 2, "train"),
    ]


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


def test_loss_objects_pickle_like_ray_ships_them(monkeypatch):
    """Policy.train ships loss_fn to every worker through Ray (pickle): no process groups inside."""
    import pickle

    monkeypatch.setattr(fallback, "_warned", True)
    cfg = {"reference_policy_kl_penalty": 0.0, "granular": {"algorithm": "sspo"}}
    table = torch.zeros(10, dtype=torch.bool)
    table[7] = True
    for obj in (GranularPolicyLoss(cfg, delimiter_table=table), fallback.CurrentLogitsEntropyLoss(cfg)):
        clone = pickle.loads(pickle.dumps(obj))
        assert type(clone) is type(obj) and clone.input_type == obj.input_type
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 10, generator=g)
    data = {
        "input_ids": torch.randint(0, 10, (2, 6), generator=g),
        "token_mask": torch.ones(2, 6),
        "sample_mask": torch.ones(2),
        "advantages": torch.randn(2, 6, generator=g),
        "prev_logprobs": -torch.rand(2, 6, generator=g),
    }
    fb = pickle.loads(pickle.dumps(fallback.CurrentLogitsEntropyLoss(GranularPolicyLoss(cfg, delimiter_table=table))))
    loss, metrics = fb(logits, data, torch.tensor(2.0), torch.tensor(10.0))  # single process: no groups
    assert torch.isfinite(loss) and metrics["prev_entropy_mean"] > 0
