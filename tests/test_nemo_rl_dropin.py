"""`GranularPolicyLoss` and our `grpo` estimator as drop-ins for NeMo-RL's REAL `ClippedPGLossFn` and
`GRPOAdvantageEstimator` (NeMo-RL world, ``nemo_rl_src``): every `ClippedPGLossConfig` key, its
default and its validation, CISPO / REINFORCE, and the metric normalisers in both import orders.

A NeMo-RL user switches the loss class and changes nothing else: the same `loss_fn` mapping (no
`granular` section: the default preset) must give NeMo-RL's loss, gradient, metrics, loss type
and normalisers, and be refused exactly where NeMo-RL refuses it (ours: one line naming the key,
when the loss is built). float64 comparisons run NeMo-RL's code unpatched and agree to 1e-12.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import reference as R
from nemo_granular.advantages import build_advantage_estimator
from nemo_granular.config import NEMO_RL_ESTIMATOR_KEYS, NEMO_RL_LOSS_KEYS, parse_policy_loss_config
from nemo_granular.losses import GranularPolicyLoss

pytestmark = pytest.mark.v070

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nemo(nemo_rl_src):
    from types import SimpleNamespace

    from nemo_rl.algorithms.advantage_estimator import GRPOAdvantageEstimator
    from nemo_rl.algorithms.loss import loss_functions
    from nemo_rl.algorithms.loss.interfaces import LossType
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from nemo_granular.nemo_rl import compat

    # AdvEstimatorConfig moved (v0.7.0: a TypedDict in grpo.py); MetricNormalizer: main only
    return SimpleNamespace(
        lf=loss_functions,
        Cfg=loss_functions.ClippedPGLossConfig,
        Fn=loss_functions.ClippedPGLossFn,
        BDD=BatchedDataDict,
        LossType=LossType,
        MN=compat.find("MetricNormalizer"),
        AdvCfg=compat.get("AdvEstimatorConfig"),
        GRPO=GRPOAdvantageEstimator,
        compat=compat,
    )


@pytest.fixture
def exact(nemo):
    """NeMo-RL's loss module as it ships (its ``masked_mean`` divides by count + 1e-8, and so do we):
    float64 comparisons hold to 1e-12 with nothing patched."""
    return nemo


def _batch(seed=0, noise=(1e-3, 0.05, 0.3)):
    data, logp, gvs, gvt = R.make_batch(B=6, S=14, seed=seed, per_token_adv=True, gen_noise=0.03, noise=noise)
    data = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    data["rewards"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    return data, logp.double(), torch.tensor(gvs, dtype=torch.float64), torch.tensor(gvt, dtype=torch.float64)


def _run(fn, logp, data, gvs, gvt):
    lp = logp.detach().clone().requires_grad_(True)
    loss, metrics = fn(next_token_logprobs=lp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _same_as_nemo(nemo, ours_cfg, nemo_cfg, seed=0, noise=(1e-3, 0.05, 0.3)):
    """Ours and NeMo-RL's on the same float64 batch: loss, gradient, every NeMo-RL metric, the
    loss type and every normaliser NeMo-RL advertises."""
    data, logp, gvs, gvt = _batch(seed, noise)
    ours = GranularPolicyLoss(ours_cfg)
    theirs = nemo.Fn(nemo.Cfg(**nemo_cfg))
    loss, grad, m = _run(ours, logp, data, gvs, gvt)
    rloss, rgrad, rm = _run(theirs, logp, nemo.BDD(data), gvs, gvt)
    torch.testing.assert_close(loss, rloss.double(), rtol=1e-12, atol=1e-13, msg="loss")
    torch.testing.assert_close(grad, rgrad, rtol=1e-12, atol=1e-13, msg="grad")
    assert grad.abs().sum() > 0
    for k, v in rm.items():
        if k == "sampling_importance_ratio" and nemo_cfg.get("sequence_level_importance_ratios"):
            continue  # NeMo-RL's GSPO-mode value is a [B, B] broadcast (test_loss_nemo.py checks both)
        assert float(m[k]) == pytest.approx(float(v), rel=1e-12, abs=1e-13), f"metric {k}"
    assert ours.loss_type is theirs.loss_type
    for k, kind in getattr(theirs, "metric_normalizations", {}).items():  # v0.7.0 advertises none
        assert ours.metric_normalizations[k] is kind, f"normaliser of {k}"
    return m, rm


# ---------------------------------------------------------------- 1. the key table


def _type_name(annotation) -> str:
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if not args or typing.get_origin(annotation) is list:
        return str(annotation).replace("typing.", "") if typing.get_origin(annotation) is list else annotation.__name__
    inner = " | ".join(_type_name(a) for a in args)
    return f"{inner} | None" if type(None) in typing.get_args(annotation) else inner


@pytest.mark.nemo_rl
def test_key_tables_are_nemo_rl_configs(nemo):
    """docs/nemo-rl.md §3 is rendered from NEMO_RL_LOSS_KEYS / NEMO_RL_ESTIMATOR_KEYS
    (test_config.py checks); here the tables are checked against NeMo-RL's real config classes:
    a key added, removed or retyped upstream fails this test."""
    import typing

    import typing_extensions

    if typing_extensions.is_typeddict(nemo.AdvCfg):
        # v0.7.0: a TypedDict without defaults; the keys it lacks and the ones it requires are compat's
        ver = nemo.compat.version().key
        hints = typing.get_type_hints(nemo.AdvCfg)
        lacking = {
            k.rsplit(".", 1)[1]
            for k, c in nemo.compat.CONFIG_KEYS.items()
            if k.startswith("grpo.adv_estimator.") and ver not in c.versions
        }
        assert set(hints) == set(NEMO_RL_ESTIMATOR_KEYS) - lacking
        assert set(nemo.AdvCfg.__required_keys__) == {"name"}  # NotRequired, yet read with [...]: compat
        assert set(nemo.compat.ESTIMATOR_REQUIRED[ver]) <= set(hints)
        tables = ((NEMO_RL_LOSS_KEYS, nemo.Cfg),)
    else:
        tables = ((NEMO_RL_LOSS_KEYS, nemo.Cfg), (NEMO_RL_ESTIMATOR_KEYS, nemo.AdvCfg))
    for ours, model in tables:
        fields = model.model_fields
        assert list(ours) == list(fields), f"{model.__name__}: {sorted(set(ours) ^ set(fields))}"
        for key, (typ, default, status, _) in ours.items():
            assert typ == _type_name(fields[key].annotation), key
            assert default == fields[key].default, key
            assert status in ("NeMo-RL", "refused"), key


@pytest.mark.nemo_rl
def test_every_key_left_out_has_nemo_rl_default(nemo):
    """The effective value of every key of an empty config is NeMo-RL's default, for a mapping and
    for NeMo-RL's own (pydantic) config object, whose filled-in defaults count as left out."""
    want = nemo.Cfg().model_dump()
    assert parse_policy_loss_config({}).nemo_rl_view() == want
    assert parse_policy_loss_config(nemo.Cfg()).nemo_rl_view() == want
    # a preset fills what is left out, also behind NeMo-RL's config object
    gspo = parse_policy_loss_config(nemo.Cfg(granular={"algorithm": "gspo"}))
    assert (gspo.eps_low, gspo.eps_high, gspo.token_level) == (3e-4, 4e-4, False)


@pytest.mark.nemo_rl
def test_empty_config_is_nemo_rl_default_loss(exact):
    """Defaults (``reference_policy_kl_penalty`` 0.01 included: it failed before, 0 here)."""
    _same_as_nemo(exact, {}, {})


# ---------------------------------------------------------------- 3. every key, NeMo-RL's meaning

TIS = dict(
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=1.03,
)
KEY_CASES = {
    "disable_ppo_ratio": dict(disable_ppo_ratio=True),
    "token_level_loss": dict(token_level_loss=False),
    "token_level_loss_kl_is": dict(token_level_loss=False, reference_policy_kl_penalty=0.2, **TIS),
    "sequence_level_importance_ratios": dict(
        sequence_level_importance_ratios=True, token_level_loss=False, ratio_clip_min=3e-3, ratio_clip_max=4e-3
    ),
    "ratio_clip_min_max": dict(ratio_clip_min=0.1, ratio_clip_max=0.28),
    "ratio_clip_c": dict(ratio_clip_c=1.3),
    "reference_policy_kl_penalty": dict(reference_policy_kl_penalty=0.0),
    "reference_policy_kl_type_k1": dict(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k1"),
    "reference_policy_kl_type_k2": dict(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k2"),
    "kl_clamps": dict(reference_policy_kl_penalty=0.1, kl_input_clamp_value=0.1, kl_output_clamp_value=0.002),
    "use_kl_in_reward": dict(reference_policy_kl_penalty=0.1, use_kl_in_reward=True),
    "use_importance_sampling_correction": dict(use_importance_sampling_correction=True),
    "tis": TIS,
    "tis_min": dict(TIS, truncated_importance_sampling_ratio_min=0.98),
    "icepop": dict(TIS, truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio_min=0.97),
    "seq_mask_tis": dict(
        TIS,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.01,
        truncated_importance_sampling_ratio_min=0.99,
    ),
    "use_on_policy_kl_approximation": dict(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True),
    "force_on_policy_ratio": dict(force_on_policy_ratio=True),
    "force_on_policy_ratio_over_disable_ppo_ratio": dict(force_on_policy_ratio=True, disable_ppo_ratio=True),
    "use_cispo": dict(use_cispo=True),
    "use_cispo_tis": dict(use_cispo=True, ratio_clip_max=0.05, **TIS),
    "disable_ppo_ratio_dual_clip": dict(disable_ppo_ratio=True, ratio_clip_c=2.0, **TIS),
    "positive_example_nll_weight": dict(positive_example_nll_weight=0.3),
}


def test_every_key_has_a_case():
    covered = {k for case in KEY_CASES.values() for k in case}
    assert covered == set(NEMO_RL_LOSS_KEYS), sorted(set(NEMO_RL_LOSS_KEYS) - covered)


@pytest.mark.nemo_rl
@pytest.mark.parametrize("case", sorted(KEY_CASES))
def test_key_has_nemo_rl_meaning(exact, case):
    """The same ``loss_fn`` mapping through both losses. Before this suite's fixes,
    ``token_level_loss: false`` gave loss −0.0549 vs NeMo-RL's 0.1785 (gradients 7.3e-2 apart, and
    the ``loss`` normaliser TOKENS vs SEQUENCES); ``use_cispo`` / ``disable_ppo_ratio`` were refused."""
    cfg = KEY_CASES[case]
    noise = (0.2, 0.6) if "ratio_clip_c" in cfg else (1e-3, 0.05, 0.3)
    m, rm = _same_as_nemo(exact, cfg, cfg, noise=noise)
    if "truncated_importance_sampling_type" in cfg:
        assert rm["is_oob_ratio"] > 0, "the batch must trigger the truncation"


# ---------------------------------------------------------------- 3b. any batch size, to the last bits


def _tiny_batch(seed: int, B: int, S: int):
    """float64 batch of B rows × S columns with a handful of response tokens (one row may have
    none, one row may be masked out): where NeMo-RL's ``count + 1e-8`` is ~1e-9 of the count."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(B, S, dtype=torch.float64)
    for i in range(B):
        start = 1 + int(torch.randint(0, 2, (1,), generator=g))
        n = int(torch.randint(0 if i else 1, S - start + 1, (1,), generator=g)) if start < S else 0
        token_mask[i, start : start + n] = 1
    sample_mask = torch.ones(B, dtype=torch.float64)
    if B > 2:
        sample_mask[-1] = 0.0
    prev = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2 - 0.05
    data = {
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": torch.randn(B, S, generator=g, dtype=torch.float64) * token_mask,
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": (prev + 0.05 * torch.randn(B, S, generator=g, dtype=torch.float64)) * token_mask,
        "reference_policy_logprobs": (prev + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)) * token_mask,
        "rewards": (torch.rand(B, generator=g) > 0.3).double(),
    }
    logp = ((prev + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)) * token_mask)[:, 1:]
    gvs = sample_mask.sum()
    gvt = (token_mask[:, 1:] * sample_mask[:, None]).sum()
    return data, logp.contiguous(), gvs, gvt


TINY_CASES = {
    "defaults": {},
    "sequence_loss_kl_nll": dict(
        token_level_loss=False, reference_policy_kl_penalty=0.2, positive_example_nll_weight=0.3
    ),
    "gspo": dict(
        sequence_level_importance_ratios=True, token_level_loss=False, ratio_clip_min=0.05, ratio_clip_max=0.05
    ),
    "tis": TIS,
    "seq_mask_tis": dict(
        TIS,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.2,
        truncated_importance_sampling_ratio_min=0.8,
    ),
    "cispo": dict(use_cispo=True, ratio_clip_max=0.05),
    "tis_min": dict(TIS, truncated_importance_sampling_ratio_min=0.98),
    "icepop": dict(
        TIS,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.95,
    ),
    # GSPO mode with the correction: one exp(Σδ) weight per response (loss_fn.granular.is_level group_sum)
    "gspo_is": dict(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        ratio_clip_min=0.05,
        ratio_clip_max=0.05,
        use_importance_sampling_correction=True,
    ),
    "gspo_tis": dict(
        TIS,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        ratio_clip_min=0.05,
        ratio_clip_max=0.05,
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.98,
    ),
    "gspo_icepop": dict(
        TIS,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        ratio_clip_min=0.05,
        ratio_clip_max=0.05,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.05,
        truncated_importance_sampling_ratio_min=0.95,
    ),
}


@pytest.mark.nemo_rl
@pytest.mark.parametrize("case", sorted(TINY_CASES))
@pytest.mark.parametrize("B,S", [(1, 2), (1, 4), (2, 3), (3, 5)])
def test_float64_equal_on_tiny_batches(nemo, case, B, S):
    """float64 loss, gradient and every metric equal NeMo-RL's unpatched ClippedPGLossFn to 1e-12 on
    batches of a few tokens. Before (global counts clamped at 1e-8 where NeMo-RL adds 1e-8, and
    per-row means over n instead of n + 1e-8) they differed by ~1e-9 relative."""
    cfg = TINY_CASES[case]
    for seed in range(3):
        data, logp, gvs, gvt = _tiny_batch(seed, B, S)
        loss, grad, m = _run(GranularPolicyLoss(cfg), logp, data, gvs, gvt)
        rloss, rgrad, rm = _run(nemo.Fn(nemo.Cfg(**cfg)), logp, nemo.BDD(data), gvs, gvt)
        torch.testing.assert_close(loss, rloss, rtol=1e-12, atol=1e-15, msg=f"seed {seed}: loss")
        torch.testing.assert_close(grad, rgrad, rtol=1e-12, atol=1e-15, msg=f"seed {seed}: grad")
        for k, v in rm.items():
            if k == "sampling_importance_ratio" and cfg.get("sequence_level_importance_ratios"):
                continue  # NeMo-RL 7ea279ab's GSPO-mode value is a [B, B] broadcast (test_loss_nemo.py)
            assert float(m[k]) == pytest.approx(float(v), rel=1e-12, abs=1e-15), f"seed {seed}: metric {k}"


# ---------------------------------------------------------------- 2./3. refused where NeMo-RL refuses

REFUSED = {
    "tis_min_above_max": (
        dict(TIS, truncated_importance_sampling_ratio=1.0, truncated_importance_sampling_ratio_min=2.0),
        "truncated_importance_sampling_ratio_min",
    ),
    "tis_without_correction": (
        dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
        "truncated_importance_sampling_type",
    ),
    "tis_without_ratio": (dict(TIS, truncated_importance_sampling_ratio=None), "truncated_importance_sampling_ratio"),
    "tis_ratio_zero": (dict(TIS, truncated_importance_sampling_ratio=0.0), "truncated_importance_sampling_ratio"),
    "tis_unknown_type": (dict(TIS, truncated_importance_sampling_type="clip"), "truncated_importance_sampling_type"),
    "icepop_without_min": (
        dict(TIS, truncated_importance_sampling_type="icepop"),
        "truncated_importance_sampling_ratio_min",
    ),
    "seq_mask_tis_without_min": (
        dict(TIS, truncated_importance_sampling_type="seq-mask-tis"),
        "truncated_importance_sampling_ratio_min",
    ),
    "seq_mask_tis_with_sequence_ratios": (
        dict(
            TIS,
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio_min=0.5,
            token_level_loss=False,
            sequence_level_importance_ratios=True,
        ),
        "seq-mask-tis",
    ),
    "ratio_without_type": (dict(truncated_importance_sampling_ratio=2.0), "truncated_importance_sampling_ratio"),
    "sequence_ratios_with_token_level_loss": (
        dict(sequence_level_importance_ratios=True),
        "sequence_level_importance_ratios",
    ),
    "dual_clip_not_above_one": (dict(ratio_clip_c=1.0), "ratio_clip_c"),
    "unknown_kl_type": (dict(reference_policy_kl_type="k4"), "reference_policy_kl_type"),
    "cispo_and_reinforce": (dict(use_cispo=True, disable_ppo_ratio=True), "use_cispo"),
    "cispo_forced_ratio": (dict(use_cispo=True, force_on_policy_ratio=True), "use_cispo"),
    "cispo_sequence_ratios": (
        dict(use_cispo=True, sequence_level_importance_ratios=True, token_level_loss=False),
        "use_cispo",
    ),
    "cispo_dual_clip": (dict(use_cispo=True, ratio_clip_c=3.0), "use_cispo"),
    "cispo_sequence_loss": (dict(use_cispo=True, token_level_loss=False), "use_cispo"),
}


@pytest.mark.nemo_rl
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_where_nemo_rl_refuses(nemo, case):
    """NeMo-RL refuses each of these when its loss is built or at its first call (both raise here);
    ours refuses it when built, in one line naming the key. Before: ``tis`` with min 2.0 above max
    1.0 was accepted (and at run time clamped every weight to 1)."""
    cfg, key = REFUSED[case]
    data, logp, gvs, gvt = _batch()
    with pytest.raises((AssertionError, ValueError)):
        _run(nemo.Fn(nemo.Cfg(**cfg)), logp, nemo.BDD(data), gvs, gvt)
    # both types: code and tests written for NeMo-RL catch AssertionError (its asserts), ours ValueError
    with pytest.raises(AssertionError) as err:
        GranularPolicyLoss(cfg)
    assert isinstance(err.value, ValueError)
    assert "\n" not in str(err.value) and key in str(err.value), str(err.value)


def _nemo_refusal_sentences(nemo, cfg: dict) -> list[str]:
    """The message of every ``assert ..., msg`` and ``raise X(msg)`` in NeMo-RL's ``ClippedPGLossFn.__init__``
    and ``__call__``, read from its source now (f-strings evaluated with ``self`` = the config ``cfg``)."""
    import ast
    import inspect
    from types import SimpleNamespace

    tree = ast.parse(inspect.getsource(nemo.Fn))
    self_ = SimpleNamespace(**nemo.Cfg(**cfg).model_dump())
    out = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in ("__init__", "__call__")):
        for node in ast.walk(fn):
            msg = (
                node.msg
                if isinstance(node, ast.Assert)
                else (
                    node.exc.args[0]
                    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args
                    else None
                )
            )
            if msg is not None:
                out.append(eval(compile(ast.Expression(msg), "<nemo-rl>", "eval"), {}, {"self": self_}))
    return out


@pytest.mark.nemo_rl
def test_refusals_carry_nemo_rl_sentences(nemo):
    """NeMo-RL's own refusal sentences, read from its source (not copied here), as ``match=`` against ours:
    code and tests written for ``ClippedPGLossFn`` (e.g. NeMo-RL's test_clipped_pg_loss_rejects_tis_min_above_max,
    ``match="truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio"``) hold for
    our loss. Each REFUSED case that NeMo-RL refuses in ``ClippedPGLossFn`` itself raises one of those sentences
    there; every sentence of its ``__init__``/``__call__`` is raised by some case."""
    import re

    data, logp, gvs, gvt = _batch()
    covered = set()
    for case, (cfg, _) in sorted(REFUSED.items()):
        with pytest.raises((AssertionError, ValueError)) as theirs:
            _run(nemo.Fn(nemo.Cfg(**cfg)), logp, nemo.BDD(data), gvs, gvt)
        sentences = _nemo_refusal_sentences(nemo, cfg)
        if str(theirs.value) not in sentences:
            assert case == "unknown_kl_type", f"{case}: NeMo-RL's refusal {theirs.value} is not in its loss's source"
            continue  # refused in calculate_kl, not in ClippedPGLossFn
        covered.add(sentences.index(str(theirs.value)))
        with pytest.raises(type(theirs.value), match=re.escape(str(theirs.value))):
            GranularPolicyLoss(cfg)
    assert covered == set(range(len(_nemo_refusal_sentences(nemo, {})))), "a NeMo-RL refusal without a case"


# ---------------------------------------------------------------- 2. token_level_loss with presets


@pytest.mark.nemo_rl
def test_token_level_loss_false_with_grpo_preset_is_nemo_rl(exact):
    """NeMo-RL's key wins over the preset it contradicts (a warning names both)."""
    with pytest.warns(UserWarning, match="token_level_loss: false overrides algorithm 'grpo'"):
        _same_as_nemo(
            exact, {"token_level_loss": False, "granular": {"algorithm": "grpo"}}, {"token_level_loss": False}
        )


@pytest.mark.nemo_rl
def test_config_object_keeps_preset_where_keys_are_left_out(exact):
    """NeMo-RL's own config object: keys it holds only as defaults do not override the preset."""
    cfg = exact.Cfg(granular={"algorithm": "gspo"}, sequence_level_importance_ratios=True, token_level_loss=False)
    nemo_cfg = dict(
        sequence_level_importance_ratios=True, token_level_loss=False, ratio_clip_min=3e-4, ratio_clip_max=4e-4
    )
    data, logp, gvs, gvt = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing overridden: no warning
        ours = GranularPolicyLoss(cfg)
    loss, grad, _ = _run(ours, logp, data, gvs, gvt)
    rloss, rgrad, _ = _run(exact.Fn(exact.Cfg(**nemo_cfg)), logp, exact.BDD(data), gvs, gvt)
    torch.testing.assert_close(loss, rloss.double(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grad, rgrad, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------- 6. CISPO / REINFORCE presets


@pytest.mark.nemo_rl
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("preset,key", [("cispo", "use_cispo"), ("reinforce", "disable_ppo_ratio")])
@pytest.mark.parametrize("extra", [{}, dict(reference_policy_kl_penalty=0.05, **TIS)], ids=["plain", "kl_tis"])
def test_preset_at_token_granularity_is_nemo_rl_mode(exact, preset, key, extra, dtype):
    """`algorithm: cispo` ≡ NeMo-RL's `use_cispo: true`, `algorithm: reinforce` ≡ `disable_ppo_ratio:
    true`: values, gradients, metrics (float32 to float32 rounding, float64 to 1e-12)."""
    data, logp, gvs, gvt = _batch(1, noise=(0.05, 0.4))
    data = {k: v.to(dtype) if v.is_floating_point() else v for k, v in data.items()}
    logp, gvs, gvt = logp.to(dtype), gvs.to(dtype), gvt.to(dtype)
    loss, grad, m = _run(
        GranularPolicyLoss({"granular": {"algorithm": preset}, "ratio_clip_max": 0.1, **extra}), logp, data, gvs, gvt
    )
    rloss, rgrad, rm = _run(
        exact.Fn(exact.Cfg(**{key: True, "ratio_clip_max": 0.1, **extra})), logp, exact.BDD(data), gvs, gvt
    )
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=3e-6, atol=3e-7)
    torch.testing.assert_close(loss, rloss.to(dtype), **tol)
    torch.testing.assert_close(grad, rgrad, **tol)
    scale = 1 if dtype == torch.float64 else 10
    for k, v in rm.items():
        assert float(m[k]) == pytest.approx(float(v), rel=tol["rtol"] * scale, abs=tol["atol"] * scale), k
    if preset == "cispo":
        assert m["clip_frac_high"] > 0, "the batch must truncate some CISPO weights"


# ---------------------------------------------------------------- 5. the GRPO estimator

REWARDS = {
    "two_two": ([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0]),
    "groups": ([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0, 1.0], [0, 0, 0, 1, 1, 1, 2, 2]),
    "equal_and_single": ([1.0, 1.0, 0.0, 0.3], [0, 0, 1, 2]),
}


@pytest.mark.nemo_rl
@pytest.mark.parametrize("rewards", sorted(REWARDS))
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"use_leave_one_out_baseline": False},
        {"normalize_rewards": False},
        {"use_leave_one_out_baseline": False, "normalize_rewards": False},
    ],
    ids=["defaults", "no_loo", "no_std", "neither"],
)
def test_grpo_estimator_is_nemo_rl(nemo, rewards, cfg):
    """Same estimator config, same advantages. Before, the default (left-out) leave-one-out
    baseline was off: rewards [1, 0, 0, 1] gave ±0.866 where NeMo-RL gives ±1.1547."""
    r, prompt = REWARDS[rewards]
    r = torch.tensor(r)
    prompt_ids = torch.tensor(prompt)[:, None].expand(-1, 3)
    mask = torch.ones(len(r), 5)
    # v0.7.0 has no defaults (compat.ESTIMATOR_REQUIRED): there the left-out keys are written out as main's
    required, left_out = nemo.compat.ESTIMATOR_REQUIRED[nemo.compat.version().key], not cfg
    cfg = {**{k: NEMO_RL_ESTIMATOR_KEYS[k][1] for k in required if k != "name"}, **cfg}
    theirs = nemo.GRPO(nemo.AdvCfg(name="grpo", **cfg), nemo.Cfg()).compute_advantage(prompt_ids, r, mask)
    for est_cfg in ({"name": "grpo", **cfg}, nemo.AdvCfg(name="grpo", **cfg)):  # a mapping and NeMo-RL's config
        ours = build_advantage_estimator(est_cfg).compute_advantage(prompt_ids, r, mask)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    if rewards == "two_two" and left_out:
        assert theirs[0, 0] == pytest.approx(1.1547, abs=1e-4)


# ---------------------------------------------------------------- 4. normalisers in both import orders


@pytest.mark.nemo_rl
@pytest.mark.slow
@pytest.mark.needs_nemo_rl("MetricNormalizer")
@pytest.mark.parametrize("order", ["granular_first", "nemo_rl_first"])
def test_split_step_rescale_in_both_import_orders(megatron_workers, order):
    """NeMo-RL's Megatron split step (``_split_step_state_init`` + ``_finish_train_step_body``, the
    real methods; it compares the advertised normalisers with ``is``) rescales every metric of a
    ``global_valid_* = 1`` call to the synchronous value, whether ``nemo_granular`` or NeMo-RL's loss
    module was imported first. Before, with ``nemo_granular`` first the kinds were local members:
    ``num_valid_samples`` came out 0.179 instead of 5 and ``groups_per_response`` 1.0 instead of 5.6."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "harness" / "split_step_driver.py"), order],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kinds_are_nemo_rl_members"] and out["loss_kind_is_sequences"] and out["loss_type_is_sequence_level"]
    assert out["global_loss"] == pytest.approx(out["sync_loss"], rel=1e-5)
    assert set(out["rescaled"]) == set(out["sync"])
    for k, v in out["sync"].items():
        assert out["rescaled"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
