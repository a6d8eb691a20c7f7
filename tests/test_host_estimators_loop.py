"""The installed grpo / espo / sppo estimators inside NeMo-RL's REAL loop code (CPU, small tensors).

``grpo_train`` / ``async_grpo_train`` / ``grpo_sync`` / ``ppo_train`` call the estimator inline,
deep inside functions that need a cluster; what runs here is everything around that call that
runs on CPU, from the real modules:

* the real ``_create_advantage_estimator`` of ``nemo_rl.algorithms.grpo`` / ``grpo_sync`` / ``ppo``
  after ``install()`` / ``install_sppo_estimator()`` (our names built, NeMo-RL's names delegated),
* the real rollout structures: a ``BatchedDataDict`` whose ``message_log`` holds the observation
  messages our ``espo_math`` environment writes, prompt ids from NeMo-RL's own
  ``extract_initial_prompt_messages`` + ``batched_message_log_to_flat_message`` as the loop does,
* the keyword arguments of EVERY ``adv_estimator.compute_advantage(...)`` call site, read from the
  real source with ``ast`` (so a NeMo-RL change of the call is caught), bound and passed as is.

Values are compared with NeMo-RL's own ``GRPOAdvantageEstimator`` (ESPO: on the verified rows
only, failed rows 0) and with a direct SPPO formula.
"""

from __future__ import annotations

import ast
import inspect
import math
from types import SimpleNamespace

import pytest
import torch
import typing_extensions

from nemo_granular.config import NEMO_RL_ESTIMATOR_KEYS
from nemo_granular.nemo_rl import environments as envs

pytestmark = [pytest.mark.nemo_rl, pytest.mark.v070]

PAD = 0


@pytest.fixture(scope="module")
def host(nemo_rl_src):
    import nemo_rl.algorithms.grpo as grpo
    import nemo_rl.algorithms.ppo as ppo
    from nemo_rl.algorithms.advantage_estimator import GRPOAdvantageEstimator
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig
    from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    try:
        import nemo_rl.algorithms.grpo_sync as grpo_sync
    except ImportError:  # pragma: no cover - depends on the data-plane extras
        grpo_sync = None
    from nemo_granular.nemo_rl import compat

    return SimpleNamespace(
        grpo=grpo,
        ppo=ppo,
        grpo_sync=grpo_sync,
        AdvCfg=compat.get("AdvEstimatorConfig"),
        NemoGRPO=GRPOAdvantageEstimator,
        LossCfg=ClippedPGLossConfig,
        flat=batched_message_log_to_flat_message,
        BDD=BatchedDataDict,
    )


def _call_sites(module) -> list[list[str]]:
    """Keyword names of each ``adv_estimator.compute_advantage(...)`` call in the module's source
    (``**adv_kwargs`` resolved from the ``adv_kwargs = dict(...)`` / ``adv_kwargs[...] =`` lines)."""
    tree = ast.parse(inspect.getsource(module))
    dict_keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "adv_kwargs" for t in node.targets):
            if isinstance(node.value, ast.Call):
                dict_keys |= {k.arg for k in node.value.keywords}
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            t = node.targets[0]
            if isinstance(t.value, ast.Name) and t.value.id == "adv_kwargs" and isinstance(t.slice, ast.Constant):
                dict_keys.add(t.slice.value)
    sites = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "compute_advantage"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "adv_estimator"
        ):
            names = [k.arg for k in node.keywords if k.arg is not None]
            if any(k.arg is None for k in node.keywords):
                names += sorted(dict_keys)
            sites.append(names)
    return sites


def _rollout(host, rewards, failed, prompts_of):
    """A GRPO rollout batch as ``run_multi_turn_rollout`` leaves it: user prompt, assistant answer,
    the espo_math observation; ``length`` = prompt tokens (what ``extract_initial_prompt_messages``
    reads)."""
    logs, lengths = [], []
    for i, p in enumerate(prompts_of):
        prompt = torch.tensor([5 + p, 7, 9 + p, 11][: 2 + p % 3])
        answer = torch.arange(20 + i, 23 + i + i % 4)
        obs = envs.espo_observations([rewards[i]], [None if failed[i] else "42"])[0]
        logs.append(
            [
                {"role": "user", "content": f"q{p}", "token_ids": prompt},
                {"role": "assistant", "content": "a", "token_ids": answer},
                {**obs, "token_ids": torch.tensor([3, 4])},
            ]
        )
        lengths.append(len(prompt))
    batch = host.BDD(
        {
            "message_log": logs,
            "length": torch.tensor(lengths),
            "total_reward": torch.tensor(rewards, dtype=torch.float32),
        }
    )
    flat, _ = host.flat(
        host.grpo.extract_initial_prompt_messages(batch["message_log"], batch["length"]),
        pad_value_dict={"token_ids": PAD},
    )
    S = 12
    mask = torch.zeros(len(rewards), S)
    for i, L in enumerate(lengths):
        mask[i, L : L + 3] = 1
    return batch, flat["token_ids"], mask


def _kwargs_for(site, prompt_ids, rewards, mask, repeated_batch, values=None):
    lp = -torch.rand(mask.shape)
    avail = {
        "prompt_ids": prompt_ids,
        "rewards": rewards,
        "mask": mask,
        "repeated_batch": repeated_batch,
        "logprobs_policy": lp,
        "logprobs_reference": lp - 0.1,
        "logprobs": lp,
        "reference_logprobs": lp - 0.1,
        "prev_logprobs": lp,
        "generation_logprobs": lp - 0.01,
        "sample_mask": mask.amax(-1),
        "values": values,
        "teacher_logprobs": None,
    }  # OPD only; None for every other estimator
    missing = [k for k in site if k not in avail]
    assert not missing, f"NeMo-RL passes {missing} to compute_advantage: extend this test and check our estimator"
    return {k: avail[k] for k in site if k != "values" or values is not None}


def _adv(host, name, **adv):
    """NeMo-RL's estimator config; v0.7.0's is a TypedDict without defaults (its estimators read every
    key with [...]), so there the keys left out are written out with main's defaults."""
    if typing_extensions.is_typeddict(host.AdvCfg):
        adv = {
            **{
                k: d
                for k, (_, d, _, _) in NEMO_RL_ESTIMATOR_KEYS.items()
                if k in host.AdvCfg.__annotations__ and k != "name"
            },
            **adv,
        }
    return host.AdvCfg(name=name, **adv)


def _master(host, name, **adv):
    # the grpo section as NeMo-RL's version types it: a pydantic model on main, a dict on v0.7.0
    section = dict if typing_extensions.is_typeddict(host.grpo.GRPOConfig) else SimpleNamespace
    return SimpleNamespace(grpo=section(adv_estimator=_adv(host, name, **adv)), loss_fn=host.LossCfg())


def test_call_sites_found_and_bind_to_our_estimators(host):
    """Every real call site's keywords bind to our estimators' ``compute_advantage``."""
    from nemo_granular.advantages import SPPOEstimator
    from nemo_granular.nemo_rl.estimators import _ESPOFromRollout

    grpo_sites = _call_sites(host.grpo) + (_call_sites(host.grpo_sync) if host.grpo_sync else [])
    ppo_sites = _call_sites(host.ppo)
    from nemo_granular.nemo_rl import compat

    # ppo_train and async_ppo_train (main); v0.7.0 has no async PPO (compat.VERSIONED["async_ppo_train"])
    assert len(_call_sites(host.grpo)) >= 2 and len(ppo_sites) >= (2 if compat.find("async_ppo_train") else 1)
    assert all("repeated_batch" in s for s in _call_sites(host.grpo)), "ESPO's flags ride on repeated_batch"
    assert all("values" in s for s in ppo_sites), "SPPO needs the critic values"
    for cls, sites in ((_ESPOFromRollout, grpo_sites), (SPPOEstimator, ppo_sites)):
        sig = inspect.signature(cls.compute_advantage)
        for site in sites:
            sig.bind(None, **dict.fromkeys(site))


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_grpo_through_real_factory_equals_nemo_rl_estimator(host, leave_one_out):
    from nemo_granular.nemo_rl import estimators as est

    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5]
    prompts = [0, 0, 0, 0, 1, 1, 1, 1]
    batch, prompt_ids, mask = _rollout(host, rewards, [False] * 8, prompts)
    r = torch.tensor(rewards)
    cfg = dict(use_leave_one_out_baseline=leave_one_out, normalize_rewards=True)
    with est.installed():
        ours = host.grpo._create_advantage_estimator(_master(host, "grpo", **cfg))
        other = host.grpo._create_advantage_estimator(_master(host, "reinforce_plus_plus"))
    assert type(ours).__module__.startswith("nemo_granular")
    assert type(other).__module__.startswith("nemo_rl"), "NeMo-RL's own names must be delegated"
    expected = host.NemoGRPO(_adv(host, "grpo", **cfg), host.LossCfg()).compute_advantage(prompt_ids, r, mask)
    for site in _call_sites(host.grpo):
        got = ours.compute_advantage(**_kwargs_for(site, prompt_ids, r, mask, batch))
        # NeMo-RL expands over the whole [B, S]; ours is 0 off the mask (the loss masks both)
        torch.testing.assert_close(got.float() * mask, expected.float() * mask, rtol=1e-6, atol=1e-6)
        assert bool((got[mask == 0] == 0).all()) and got.abs().sum() > 0
    assert host.grpo._create_advantage_estimator.__name__ == "_create_advantage_estimator"


def test_espo_flags_from_real_rollout_messages(host):
    """ESPO through the real factory: flags come from the espo_math observations in ``message_log``;
    failed rows get 0 and leave their prompt's statistics — NeMo-RL's GRPO estimator on the
    verified rows alone gives the other rows."""
    from nemo_granular.nemo_rl import estimators as est

    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    failed = [False, True, False, False, True, False, False, False]
    prompts = [0, 0, 0, 0, 1, 1, 1, 1]
    batch, prompt_ids, mask = _rollout(host, rewards, failed, prompts)
    r = torch.tensor(rewards)
    with est.installed():
        ours = host.grpo._create_advantage_estimator(_master(host, "espo"))
    for site in _call_sites(host.grpo):
        b = host.BDD(dict(batch))  # a fresh rollout batch per call (the flag is attached to it)
        got = ours.compute_advantage(**_kwargs_for(site, prompt_ids, r, mask, b))
        assert b["verification_failed"].tolist() == failed
        keep = ~torch.tensor(failed)
        ref = host.NemoGRPO(_adv(host, "grpo"), host.LossCfg()).compute_advantage(prompt_ids[keep], r[keep], mask[keep])
        torch.testing.assert_close(got[keep].float(), ref.float() * mask[keep], rtol=1e-6, atol=1e-6)
        assert bool((got[~keep] == 0).all())
    assert not all(math.isclose(a, 0) for a in got[keep][:, :].abs().sum(-1).tolist())


def test_sppo_through_real_ppo_factory(host):
    """``sppo`` in ``nemo_rl.algorithms.ppo._create_advantage_estimator``; called with the PPO loop's
    keywords (values = right-shifted critic logits); NeMo-RL's ``raw_reward`` still builds its own."""
    from nemo_granular.sppo.install import sppo_estimator_installed

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    batch, prompt_ids, mask = _rollout(host, rewards.tolist(), [False] * 4, [0, 0, 1, 1])
    first = mask.argmax(-1)
    logits_v = torch.tensor([0.3, -1.2, 2.0, 0.0])
    values = torch.zeros_like(mask)
    values[torch.arange(4), first] = logits_v
    master = SimpleNamespace(ppo=host.ppo.PPOConfig(adv_estimator={"name": "sppo"}), loss_fn=host.LossCfg())
    with sppo_estimator_installed(host.ppo):
        est = host.ppo._create_advantage_estimator(master)
        raw = host.ppo._create_advantage_estimator(
            SimpleNamespace(
                ppo=host.ppo.PPOConfig(adv_estimator={"name": "raw_reward", "normalize_advantages": False}),
                loss_fn=host.LossCfg(),
            )
        )
    assert type(raw).__module__.startswith("nemo_rl"), "NeMo-RL's own names must be delegated"
    for site in _call_sites(host.ppo):
        out = est.compute_advantage(**_kwargs_for(site, prompt_ids, rewards, mask, batch, values=values))
        adv, ret = out
        expected = (rewards - torch.sigmoid(logits_v))[:, None] * mask
        torch.testing.assert_close(adv.float(), expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ret.float(), rewards[:, None] * mask)


def test_espo_in_grpo_sync_is_refused_when_built(host):
    """``grpo_sync``'s data-plane loop hands the estimator ``repeated_batch`` = a fresh
    ``BatchedDataDict`` of total_reward/baseline/std (no ``message_log``), so ESPO's flag can
    never reach it there. The factory must refuse ``espo`` in that module at build time (start of
    training), not fail with a KeyError at the first advantage computation; ``grpo`` still works."""
    from nemo_granular.nemo_rl import estimators as est

    if host.grpo_sync is None:
        pytest.fail("nemo_rl.algorithms.grpo_sync does not import in this environment")
    site = _call_sites(host.grpo_sync)
    assert site, "grpo_sync's compute_advantage call not found"
    with est.installed():
        with pytest.raises(ValueError, match="espo.*grpo_sync"):
            host.grpo_sync._create_advantage_estimator(_master(host, "espo"))
        ours = host.grpo_sync._create_advantage_estimator(_master(host, "grpo"))
        espo_in_grpo = host.grpo._create_advantage_estimator(_master(host, "espo"))
    assert type(ours).__module__.startswith("nemo_granular")
    assert hasattr(espo_in_grpo, "compute_advantage")
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv_inputs = host.BDD({"total_reward": r, "baseline": r * 0, "std": r * 0})
    mask = torch.ones(4, 3)
    got = ours.compute_advantage(**_kwargs_for(site[0], torch.tensor([[1], [1], [2], [2]]), r, mask, adv_inputs))
    assert got.shape == mask.shape
