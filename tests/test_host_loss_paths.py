"""The granular losses inside NeMo-RL's OWN loss call paths (real NeMo-RL code, CPU).

What the workers run between the model output and the loss, called here for real:

* ``prepare_loss_input`` + ``wrap_loss_fn_with_input_preparation`` (Megatron, no packing),
* ``SequencePackingLossWrapper`` with ``cu_seqlens_q`` / ``cu_seqlens_q_padded`` (Megatron and
  DTensor packing: one loss call per sequence, metrics combined by the wrapper),
* the DTensor-v2 ``LossPostProcessor`` (``nemo_rl.models.automodel.train``) with and without
  packing, and the DTensor value worker's ``RightShiftLossWrapper`` around ``SequenceValueLoss``,
* the split-step (streaming) convention of the Megatron worker: every microbatch runs with
  ``global_valid_* = 1`` and each metric is rescaled by the denominator the loss advertises in
  ``metric_normalizations`` (``MetricNormalizer``); the rule is checked on NeMo-RL's own
  ``ClippedPGLossFn`` first, so the test's reading of the rule is itself tested.

Each path is compared with a direct call of the loss on log-probabilities computed here
(``log_softmax`` + gather): loss, gradient w.r.t. the logits, and the metrics reduced as
``grpo_train`` reduces them (sum; min/max for the four ratio extrema, skipping ±inf).
"""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import pytest
import torch

from nemo_granular.losses import GranularPolicyLoss, SequenceValueLoss
from nemo_granular.nemo_rl.policy import add_granular_keys

pytestmark = [pytest.mark.nemo_rl, pytest.mark.v070]

V = 11
DELIM = 3
EXTREMA = {
    "probs_ratio_min": min,
    "probs_ratio_clamped_min": min,
    "probs_ratio_max": max,
    "probs_ratio_clamped_max": max,
}
PRESETS = {
    "grpo": {"granular": {"algorithm": "grpo"}},
    "gspo": {
        "granular": {"algorithm": "gspo"},
        "sequence_level_importance_ratios": True,
        "ratio_clip_min": 3e-3,
        "ratio_clip_max": 4e-3,
    },
    "sspo": {"granular": {"algorithm": "sspo"}, "reference_policy_kl_penalty": 0.05},
    "espo": {"granular": {"algorithm": "espo", "espo": {"vocab_size": V}}},
}


@pytest.fixture(scope="module")
def host(nemo_rl_src):
    # CPU shim (test only): NeMo-RL's single-device logprob path moves the token ids with .cuda()
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    from nemo_rl.algorithms.loss import loss_functions, utils, wrapper
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.automodel import train as automodel_train

    from nemo_granular.nemo_rl import compat

    # MetricNormalizer: main only (v0.7.0 has no split-step metric rescale; docs/nemo-rl.md "NeMo-RL versions")
    yield SimpleNamespace(
        prepare=utils.prepare_loss_input,
        wrapper=wrapper,
        BDD=BatchedDataDict,
        MN=compat.find("MetricNormalizer"),
        lf=loss_functions,
        atrain=automodel_train,
    )
    mp.undo()


def _batch(seed: int, cfg, dtype=torch.float32):
    """A driver batch (``add_granular_keys`` as ``GranularPolicy.train`` does) and leaf logits."""
    g = torch.Generator().manual_seed(seed)
    B, S = 5, 13
    lengths = torch.tensor([13, 8, 11, 5, 10])
    prompt = torch.tensor([3, 2, 4, 2, 3])
    cols = torch.arange(S)[None, :]
    token_mask = ((cols >= prompt[:, None]) & (cols < lengths[:, None])).to(dtype)
    ids = torch.randint(4, V, (B, S), generator=g)
    ids[torch.rand(B, S, generator=g) < 0.25] = DELIM
    ids[cols >= lengths[:, None]] = 0
    logits0 = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 1.5
    lp_cur = _logprobs(logits0, ids)
    shift = torch.zeros(B, S, dtype=torch.float64)
    shift[:, 1:] = lp_cur
    prev = (shift + 0.9 * torch.randn(B, S, generator=g, dtype=torch.float64)).clamp(max=-1e-3) * token_mask
    data = {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=dtype),
        "prev_logprobs": prev.to(dtype),
        "generation_logprobs": (prev + 0.05 * torch.randn(B, S, generator=g, dtype=torch.float64) * token_mask).to(
            dtype
        ),
        "reference_policy_logprobs": (prev + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64) * token_mask).to(
            dtype
        ),
        "advantages": (torch.randn(B, 1, generator=g, dtype=torch.float64) * token_mask).to(dtype),
    }
    entropy = torch.rand(B, S, generator=g) * (cols < lengths[:, None])
    entropy[:, 0] = 0
    table = torch.zeros(V, dtype=torch.bool)
    table[DELIM] = True
    add_granular_keys(data, cfg, entropy, table)
    gvs = data["sample_mask"].sum()
    gvt = (token_mask[:, 1:] * data["sample_mask"][:, None]).sum()
    return data, logits0, gvs, gvt


def _logprobs(logits, ids):
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def _reduce(parts):
    """``grpo_train``'s reduction of per-microbatch metrics (sum; extrema skip ±inf)."""
    out: dict[str, float] = {}
    for m in parts:
        for k, v in m.items():
            v = float(v)
            if k in EXTREMA:
                if not math.isinf(v):
                    out[k] = EXTREMA[k](out[k], v) if k in out else v
            else:
                out[k] = out.get(k, 0.0) + v
    return out


def _direct(loss_fn, logits0, data, gvs, gvt, rows=None):
    rows = range(logits0.shape[0]) if rows is None else rows
    logits = logits0.float().clone().requires_grad_(True)
    loss, m = loss_fn(
        next_token_logprobs=_logprobs(logits, data["input_ids"]),
        data=data,
        global_valid_seqs=gvs,
        global_valid_toks=gvt,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, _reduce([m])


def _assert_same(got, ref, what, rtol=2e-6, atol=2e-7):
    loss, grad, m = got
    rloss, rgrad, rm = ref
    torch.testing.assert_close(loss.double(), rloss.double(), rtol=rtol, atol=atol, msg=f"{what}: loss")
    torch.testing.assert_close(grad.double(), rgrad.double(), rtol=rtol, atol=atol, msg=f"{what}: grad")
    assert set(m) == set(rm), f"{what}: metric names {sorted(set(m) ^ set(rm))}"
    for k, v in rm.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), f"{what}: metric {k}"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_megatron_unpacked_microbatches_through_prepare_loss_input(host, preset):
    """Megatron without packing: ``wrap_loss_fn_with_input_preparation(prepare_fn=prepare_loss_input)``
    per microbatch, as ``LossPostProcessor`` builds it."""
    cfg = PRESETS[preset]
    loss_fn = GranularPolicyLoss(cfg)
    data, logits0, gvs, gvt = _batch(0, cfg)
    ref = _direct(loss_fn, logits0, data, gvs, gvt)
    assert ref[2]["clip_frac_low"] + ref[2]["clip_frac_high"] > 0, "the batch must reach the clip bounds"
    logits = logits0.float().clone().requires_grad_(True)
    total, parts, a = 0, [], 0
    for n in (2, 2, 1):
        mb = host.BDD({k: v[a : a + n] for k, v in data.items()})
        loss, m = host.wrapper.wrap_loss_fn_with_input_preparation(
            logits[a : a + n], mb, gvs, gvt, loss_fn=loss_fn, prepare_fn=host.prepare
        )
        total, a = total + loss, a + n
        parts.append(m)
    (grad,) = torch.autograd.grad(total, logits)
    _assert_same((total.detach(), grad, _reduce(parts)), ref, preset)


def _packed(logits, lengths, pad_to: int | None):
    """``[1, T, V]`` packed logits (each sequence padded to a multiple of ``pad_to``) and cu_seqlens."""
    chunks, padded = [], []
    for i, L in enumerate(lengths.tolist()):
        P = L if pad_to is None else -(-L // pad_to) * pad_to
        chunks.append(torch.cat([logits[i, :L], logits.new_zeros(P - L, logits.shape[-1])]))
        padded.append(P)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    cu_pad = torch.nn.functional.pad(torch.tensor(padded).cumsum(0), (1, 0)).int()
    return torch.cat(chunks)[None], cu, cu_pad


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("pad_to", [None, 4])
def test_sequence_packing_loss_wrapper(host, preset, pad_to):
    """``SequencePackingLossWrapper`` (one call per sequence, data rows cut to their length)."""
    cfg = PRESETS[preset]
    loss_fn = GranularPolicyLoss(cfg)
    data, logits0, gvs, gvt = _batch(1, cfg)
    ref = _direct(loss_fn, logits0, data, gvs, gvt)
    logits = logits0.float().clone().requires_grad_(True)
    packed, cu, cu_pad = _packed(logits, data["input_lengths"], pad_to)
    wrapped = host.wrapper.SequencePackingLossWrapper(
        loss_fn, host.prepare, cu_seqlens_q=cu, cu_seqlens_q_padded=cu_pad if pad_to else None
    )
    loss, m = wrapped(packed, host.BDD(data), gvs, gvt)
    (grad,) = torch.autograd.grad(loss, logits)
    _assert_same((loss.detach(), grad, _reduce([m])), ref, f"{preset} packed")


@pytest.mark.parametrize("packing", [False, True])
def test_dtensor_v2_loss_post_processor(host, packing):
    """The DTensor-v2 worker's ``LossPostProcessor`` (CP = 1) with and without packing."""
    cfg = PRESETS["sspo"]
    loss_fn = GranularPolicyLoss(cfg)
    data, logits0, gvs, gvt = _batch(2, cfg)
    ref = _direct(loss_fn, logits0, data, gvs, gvt)
    logits = logits0.float().clone().requires_grad_(True)
    post = host.atrain.LossPostProcessor(
        loss_fn=loss_fn,
        cfg={},
        device_mesh=None,
        cp_mesh=None,
        tp_mesh=None,
        cp_size=1,
        dp_size=1,
        enable_seq_packing=packing,
    )
    if packing:
        x, cu, _ = _packed(logits, data["input_lengths"], None)
        processed = SimpleNamespace(flash_attn_kwargs=SimpleNamespace(cu_seqlens_q=cu))
    else:
        x, processed = logits, SimpleNamespace()
    loss, m = post(x, host.BDD(data), processed, gvs, gvt)
    (grad,) = torch.autograd.grad(loss, logits)
    _assert_same((loss.detach(), grad, _reduce([m])), ref, f"dtensor packing={packing}")


def _rescale(metrics, normalizations, mn, loss_type_normalizer, gvs, gvt):
    """Split-step rescaling as ``MetricNormalizer`` documents it: TOKENS ÷ gvt, SEQUENCES ÷ gvs,
    NONE (and ``*_min``/``*_max``) as is, unadvertised ÷ the gradient normalizer."""
    out = {}
    for k, v in metrics.items():
        kind = normalizations.get(k, loss_type_normalizer)
        if "_min" in k or "_max" in k or kind is mn.NONE:
            out[k] = float(v)
        else:
            out[k] = float(v) / float(gvt if kind is mn.TOKENS else gvs)
    return out


def _split_step_vs_sync(loss_fn, mn, data, logp, gvs, gvt, key="next_token_logprobs"):
    sync_loss, sync_m = loss_fn(**{key: logp}, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    one = torch.tensor(1.0)
    raw_loss, raw_m = loss_fn(**{key: logp}, data=data, global_valid_seqs=one, global_valid_toks=one)
    grad_norm = mn.TOKENS if loss_fn.loss_type.value == "token_level" else mn.SEQUENCES
    n = gvt if grad_norm is mn.TOKENS else gvs
    torch.testing.assert_close(raw_loss.double() / float(n), sync_loss.double(), rtol=1e-5, atol=1e-7)
    got = _rescale(raw_m, loss_fn.metric_normalizations, mn, grad_norm, gvs, gvt)
    for k, v in sync_m.items():
        assert got[k] == pytest.approx(float(v), rel=1e-5, abs=1e-7), f"split-step metric {k}"


@pytest.mark.needs_nemo_rl("MetricNormalizer")
def test_split_step_rule_holds_for_nemo_rl_clipped_pg(host):
    """The rescaling rule as read here, checked on NeMo-RL's own loss (token level, GSPO, TIS)."""
    data, logits0, gvs, gvt = _batch(3, {"granular": {"algorithm": "grpo"}})
    logp = _logprobs(logits0, data["input_ids"]).float()
    for cfg in (
        {"token_level_loss": True, "reference_policy_kl_penalty": 0.05},
        {"token_level_loss": False, "sequence_level_importance_ratios": True},
        {
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 1.02,
        },
    ):
        fn = host.lf.ClippedPGLossFn(host.lf.ClippedPGLossConfig(**cfg))
        _split_step_vs_sync(fn, host.MN, host.BDD(data), logp, gvs, gvt)


@pytest.mark.needs_nemo_rl("MetricNormalizer")
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_split_step_metric_normalizations(host, preset):
    """Megatron's streaming step (placeholder ``global_valid_* = 1``, rescale by
    ``metric_normalizations``) gives the synchronous loss and metrics, for every preset — after
    a pickle round trip, as Ray ships the loss to the workers (NeMo-RL compares the kinds with
    ``is``, so they must be NeMo-RL's own enum members)."""
    cfg = dict(
        PRESETS[preset],
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.05,
    )
    loss_fn = pickle.loads(pickle.dumps(GranularPolicyLoss(cfg)))
    assert all(type(k) is host.MN for k in loss_fn.metric_normalizations.values())
    data, logits0, gvs, gvt = _batch(4, cfg)
    logp = _logprobs(logits0, data["input_ids"]).float()
    _split_step_vs_sync(loss_fn, host.MN, data, logp, gvs, gvt)


def test_value_loss_through_dtensor_value_post_processing(host, megatron_workers, monkeypatch):
    """``SequenceValueLoss`` behind the DTensor value worker's ``RightShiftLossWrapper`` inside the
    DTensor-v2 ``LossPostProcessor`` (LOGIT input), microbatched, equals a direct call on the
    right-shifted values; metrics rescale by its ``metric_normalizations`` in the split step."""
    import nemo_automodel.shared.import_utils as iu

    monkeypatch.setattr(iu, "safe_import_te", lambda: (False, None))  # Automodel's TE-absent path (test only)
    from nemo_rl.models.value.workers.dtensor_value_worker_v2 import RightShiftLossWrapper

    B, S = 6, 10
    g = torch.Generator().manual_seed(5)
    token_mask = torch.zeros(B, S)
    for i, (p, n) in enumerate([(2, 5), (3, 6), (2, 3), (4, 5), (3, 2), (2, 7)]):
        token_mask[i, p : p + n] = 1
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    data = {
        "input_ids": torch.randint(0, V, (B, S), generator=g),
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1, 1, 0, 1, 1]),
        "rewards": rewards,
        "returns": token_mask * rewards[:, None],
    }
    gvs = data["sample_mask"].sum()
    gvt = (token_mask[:, 1:] * data["sample_mask"][:, None]).sum()
    head = torch.randn(B, S, 1, generator=g, dtype=torch.float64)
    loss_fn = SequenceValueLoss()

    direct_in = head.clone().requires_grad_(True)
    shifted = torch.cat([torch.zeros_like(direct_in[:, :1]), direct_in[:, :-1]], 1)
    rloss, rm = loss_fn(logits=shifted, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    (rgrad,) = torch.autograd.grad(rloss, direct_in)
    assert rgrad.abs().sum() > 0

    post = host.atrain.LossPostProcessor(
        loss_fn=RightShiftLossWrapper(loss_fn),
        cfg={},
        device_mesh=None,
        cp_mesh=None,
        tp_mesh=None,
        cp_size=1,
        dp_size=1,
    )
    x = head.clone().requires_grad_(True)
    total, parts = 0, []
    for a, b in ((0, 4), (4, 6)):
        loss, m = post(x[a:b], host.BDD({k: v[a:b] for k, v in data.items()}), SimpleNamespace(), gvs, gvt)
        total, parts = total + loss, parts + [m]
    (grad,) = torch.autograd.grad(total, x)
    _assert_same((total.detach(), grad, _reduce(parts)), (rloss.detach(), rgrad, _reduce([rm])), "value")
    if host.MN is None:
        return  # v0.7.0: no split step to rescale for (compat.VERSIONED["MetricNormalizer"])
    _split_step_vs_sync(pickle.loads(pickle.dumps(loss_fn)), host.MN, data, shifted.detach(), gvs, gvt, key="logits")
