"""The granular loss gives the same result however NeMo-RL's workers cut the global batch.

The loss is called exactly as NeMo-RL calls it (``loss_fn(next_token_logprobs=..., data=...,
global_valid_seqs=..., global_valid_toks=...)``): (a) once on the whole
batch, (b) on microbatch splits (Megatron/DTensor without packing), (c) once per sequence with
``data`` a plain dict whose 2-D tensors are sliced to the row's length and ``[1, L_i−1]``
logprobs (``SequencePackingLossWrapper``). Losses and every metric are combined with NeMo-RL's
aggregation rules (sum; min/max only for the four ``probs_ratio*`` extrema, skipping ±inf) and
must agree, gradients included. ``prev_entropy`` and ``granular_group_ids`` are precomputed on
the driver by :func:`nemo_granular.nemo_rl.policy.add_granular_keys`, as ``GranularPolicy.train``
does.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_granular.losses import GranularPolicyLoss
from nemo_granular.nemo_rl.policy import add_granular_keys

EXTREMA = {
    "probs_ratio_min": min,
    "probs_ratio_clamped_min": min,
    "probs_ratio_max": max,
    "probs_ratio_clamped_max": max,
}
DELIM = 3  # token id whose text contains "\n\n" in this toy vocabulary
V = 12


def _driver_batch(seed: int, loss_cfg):
    g = torch.Generator().manual_seed(seed)
    B, S = 6, 18
    input_lengths = torch.tensor([18, 11, 15, 7, 18, 13])
    prompt_len = torch.tensor([3, 4, 2, 3, 5, 2])
    cols = torch.arange(S)[None, :]
    token_mask = ((cols >= prompt_len[:, None]) & (cols < input_lengths[:, None])).float()
    input_ids = torch.randint(4, V, (B, S), generator=g)
    input_ids[torch.rand(B, S, generator=g) < 0.2] = DELIM
    input_ids[cols >= input_lengths[:, None]] = 0
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    prev = -torch.rand(B, S, generator=g) * 3 * token_mask
    data = {
        "input_ids": input_ids,
        "input_lengths": input_lengths,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "prev_logprobs": prev,
        "generation_logprobs": prev + 0.02 * torch.randn(B, S, generator=g) * token_mask,
        "reference_policy_logprobs": prev + 0.1 * torch.randn(B, S, generator=g) * token_mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, S) * token_mask,
    }
    entropy = (torch.rand(B, S, generator=g) * 0.6) * (cols < input_lengths[:, None])
    entropy[:, 0] = 0
    table = torch.zeros(V, dtype=torch.bool)
    table[DELIM] = True
    add_granular_keys(data, loss_cfg, entropy, table)
    # current policy: a perturbation of π_old large enough to hit both clip bounds
    logp = (prev[:, 1:] + 1.2 * torch.randn(B, S - 1, generator=g)).clamp(max=0).double()
    gvs = sample_mask.sum()
    gvt = (token_mask[:, 1:] * sample_mask[:, None]).sum()
    return data, logp, gvs, gvt


def _combine(parts):
    loss = sum(p[0] for p in parts)
    metrics: dict[str, float] = {}
    for _, m in parts:
        for k, v in m.items():
            if k in EXTREMA:
                if math.isinf(v):
                    continue
                metrics[k] = EXTREMA[k](metrics[k], v) if k in metrics else v
            else:
                metrics[k] = metrics.get(k, 0.0) + v
    return loss, metrics


def _call(loss_fn, logp, data, gvs, gvt):
    return loss_fn(next_token_logprobs=logp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)


def _whole(loss_fn, logp, data, gvs, gvt):
    return [_call(loss_fn, logp, data, gvs, gvt)]


def _microbatches(loss_fn, logp, data, gvs, gvt, sizes=(2, 3, 1)):
    parts, a = [], 0
    for n in sizes:
        mb = {k: v[a : a + n] for k, v in data.items()}
        parts.append(_call(loss_fn, logp[a : a + n], mb, gvs, gvt))
        a += n
    return parts


def _per_sequence(loss_fn, logp, data, gvs, gvt):
    parts = []
    for i, L in enumerate(data["input_lengths"].tolist()):
        row = {}
        for k, v in data.items():
            v = v[i : i + 1]
            row[k] = v[:, :L] if v.dim() > 1 and v.shape[1] > 1 else v
        parts.append(_call(loss_fn, logp[i : i + 1, : L - 1], row, gvs, gvt))
    return parts


@pytest.mark.parametrize("algorithm", ["sspo", "espo"])
@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_whole_microbatch_and_per_sequence_agree(algorithm, kl):
    cfg = {"reference_policy_kl_penalty": kl, "granular": {"algorithm": algorithm, "espo": {"vocab_size": V}}}
    loss_fn = GranularPolicyLoss(cfg)
    data, logp0, gvs, gvt = _driver_batch(0, cfg)
    assert data["granular_group_ids"].shape == data["input_ids"].shape
    assert data["prev_entropy"].shape == data["input_ids"].shape
    results = {}
    for name, split in (("whole", _whole), ("micro", _microbatches), ("per_seq", _per_sequence)):
        logp = logp0.clone().requires_grad_(True)
        loss, metrics = _combine(split(loss_fn, logp, data, gvs, gvt))
        (grad,) = torch.autograd.grad(loss, logp)
        results[name] = (loss.detach(), grad, metrics)
    ref_loss, ref_grad, ref_m = results["whole"]
    assert torch.isfinite(ref_loss) and ref_grad.abs().sum() > 0
    # the batch must exercise the clipping (otherwise the entropy bounds would be untested here)
    assert ref_m["clip_frac_low"] + ref_m["clip_frac_high"] > 0
    for name in ("micro", "per_seq"):
        loss, grad, m = results[name]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7, msg=f"{name}: loss")
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7, msg=f"{name}: grad")
        assert set(m) == set(ref_m), name
        for k, v in ref_m.items():
            assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), f"{name}: metric {k}"


def test_groups_cross_no_response_and_depend_on_driver_keys():
    cfg = {"granular": {"algorithm": "espo", "espo": {"vocab_size": V}}}
    data, logp, gvs, gvt = _driver_batch(1, cfg)
    ids = data["granular_group_ids"]
    assert bool(((ids >= 0) == (data["token_mask"] > 0)).all())
    # ESPO: 2 groups per row, group 0 = the ceil(20%) highest-entropy response tokens
    for i in range(ids.shape[0]):
        resp = data["token_mask"][i] > 0
        n = int(resp.sum())
        top = int(math.ceil(0.2 * n))
        assert int((ids[i] == 0).sum()) == top
        assert data["prev_entropy"][i][ids[i] == 0].min() >= data["prev_entropy"][i][ids[i] == 1].max()
    # the precomputed ids are what the loss uses: merging the two groups changes the loss
    loss_fn = GranularPolicyLoss(cfg)
    base = _call(loss_fn, logp, data, gvs, gvt)[0]
    other = dict(data)
    other["granular_group_ids"] = torch.where(ids >= 0, torch.zeros_like(ids), ids)
    assert not torch.allclose(_call(loss_fn, logp, other, gvs, gvt)[0], base)
