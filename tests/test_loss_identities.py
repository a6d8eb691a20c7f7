"""Spec §9 identities 1, 4, 5, 6 for `GranularPolicyLoss` (values and gradients)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from nemo_granular.losses import GranularPolicyLoss

V = 16
ALL = sorted(R.PRESET_SPECS)
SUMMED = (
    "clip_frac_low",
    "clip_frac_high",
    "groups_per_response",
    "group_size_mean",
    "probs_ratio",
    "nonfinite_tokens",
    "num_valid_samples",
)


def make_loss(name, **extra):
    granular = {"algorithm": name, "espo": {"vocab_size": V}, **extra.pop("granular", {})}
    return GranularPolicyLoss(
        {"reference_policy_kl_penalty": 0.0, "granular": granular, **extra}, delimiter_table=R.delimiter_table(V)
    )


# ------------------------------------------------------------------ identity 1
# (in float64: the segment path sums per group, the sequence path per token — in float32 the two
# orders differ by a few ulps, in float64 by ~1e-16)


def _run64(fn, logp, data, gvs, gvt):
    data = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    lp = logp.detach().clone().double().requires_grad_(True)
    loss, m = fn(
        next_token_logprobs=lp,
        data=data,
        global_valid_seqs=torch.tensor(float(gvs), dtype=torch.float64),
        global_valid_toks=torch.tensor(float(gvt), dtype=torch.float64),
    )
    loss.backward()
    return loss.detach(), lp.grad, m


@pytest.mark.parametrize("clip", ["fixed", "sspo_entropy"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segment_without_delimiter_is_sequence(clip, seed):
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=seed, no_delimiters=True)
    data["input_ids"][:, 0] = R.DELIMITERS[0]  # a delimiter in the prompt does not cut anything
    seg = make_loss("sspo", granular={"clip": clip})
    seq = make_loss("sspo", granular={"clip": clip, "granularity": "sequence"})
    a = _run64(seg, logp, data, gvs, gvt)
    b = _run64(seq, logp, data, gvs, gvt)
    R.assert_close(a[0], b[0], rtol=1e-13, atol=1e-15, what="loss")
    R.assert_close(a[1], b[1], rtol=1e-13, atol=1e-15, what="grad")
    assert a[2]["groups_per_response"] == b[2]["groups_per_response"]


def test_segment_without_delimiter_is_gspo_preset():
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=3, no_delimiters=True)
    a = _run64(make_loss("sspo_no_ec", granular={"eps_low": 3e-4, "eps_high": 4e-4}), logp, data, gvs, gvt)
    b = _run64(make_loss("gspo"), logp, data, gvs, gvt)
    R.assert_close(a[0], b[0], rtol=1e-13, atol=1e-15, what="loss")
    R.assert_close(a[1], b[1], rtol=1e-13, atol=1e-15, what="grad")


# ------------------------------------------------------------------ identity 4


@pytest.mark.parametrize("seed", [0, 1])
def test_single_entropy_group_with_fixed_eps_is_gspo_token(seed):
    """top_fraction 0.99 puts every token of a row (n < 100) in the high group: one group."""
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=seed, per_token_adv=True)
    one = make_loss("espo", granular={"entropy_top_fraction": 0.99, "clip": "fixed", "eps_low": 3e-4, "eps_high": 4e-4})
    a = R.run_loss(one, logp, data, gvs, gvt)
    b = R.run_loss(make_loss("gspo_token"), logp, data, gvs, gvt)
    assert a[2]["groups_per_response"] == b[2]["groups_per_response"]
    R.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7, what="loss")
    R.assert_close(a[1], b[1], rtol=1e-6, atol=1e-7, what="grad")


def test_single_entropy_group_with_constant_entropy_eps_is_gspo_token():
    """espo_entropy bounds with a constant entropy h give a constant ε = α·h/log|V|."""
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=4, per_token_adv=True, noise=(1e-4, 5e-4, 1e-2))
    h, eps = 1.3, 3.5e-4
    data["prev_entropy"] = torch.full_like(data["prev_entropy"], h)
    alpha = eps * math.log(V) / h
    one = make_loss("espo", granular={"entropy_top_fraction": 0.99, "espo": {"alpha": alpha, "vocab_size": V}})
    a = R.run_loss(one, logp, data, gvs, gvt)
    b = R.run_loss(make_loss("gspo_token", granular={"eps_low": eps, "eps_high": eps}), logp, data, gvs, gvt)
    R.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7, what="loss")
    R.assert_close(a[1], b[1], rtol=1e-6, atol=1e-7, what="grad")
    assert 0 < b[2]["clip_frac_low"] + b[2]["clip_frac_high"] < 1  # both branches are exercised


# ------------------------------------------------------------------ identity 5


@pytest.mark.parametrize("name", ALL)
def test_on_policy_step_gradient_is_weighted_advantage(name):
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=7)
    logp = data["prev_logprobs"][:, 1:].clone()
    loss, grad, m = R.run_loss(make_loss(name), logp, data, gvs, gvt)
    spec = R.PRESET_SPECS[name]
    assert m["clip_frac_low"] == 0 and m["clip_frac_high"] == 0
    if spec["surrogate"] != "reinforce":  # REINFORCE reports logp as its "ratio" (NeMo-RL's convention)
        assert m["probs_ratio_min"] == 1.0 and m["probs_ratio_max"] == 1.0
    # expected gradient of −Agg(A·r) at r = 1: −w_it·A_it with the aggregation weight w_it — the
    # same for CISPO (sg[1]·A·∇logp) and REINFORCE (A·∇logp)
    tm = data["token_mask"][:, 1:] > 0
    A = data["advantages"][:, 1:].double()
    sm = data["sample_mask"].double()
    if spec["granularity"] == "entropy_group":
        ids = R.entropy_group_ids(data["prev_entropy"][:, 1:], tm, [0.2])
    else:
        ids = R.token_group_ids(tm)
    expected = torch.zeros_like(A)
    for i in range(A.shape[0]):
        grps = R.groups_of_row(ids[i])
        n = sum(len(g) for g in grps)
        for g in grps:
            for t in g:
                if spec["aggregation"] == "token_mean":
                    w = sm[i] / gvt
                elif spec["aggregation"] == "seq_mean_token_mean":
                    w = sm[i] / (n * gvs)
                else:
                    w = sm[i] / (len(grps) * len(g) * gvs)
                expected[i, t] = -w * A[i, t]
    R.assert_close(grad, expected, what="grad")
    # and at r = 1 every c_it = A_it, so loss = −Σ w_it·A_it = Σ expected_it (CISPO/REINFORCE: A·logp)
    lp = logp.double() if spec["surrogate"] != "clipped" else 1.0
    R.assert_close(loss, (expected * lp).sum(), what="loss")


# ------------------------------------------------------------------ identity 6


def _pad(data, logp, left=0, right=0, pad_token=R.DELIMITERS[0]):
    out = {}
    for k, v in data.items():
        if torch.is_tensor(v) and v.dim() == 2:
            fill = pad_token if k == "input_ids" else 0
            out[k] = torch.cat(
                [
                    torch.full((v.shape[0], left), fill, dtype=v.dtype),
                    v,
                    torch.full((v.shape[0], right), fill, dtype=v.dtype),
                ],
                dim=1,
            )
        else:
            out[k] = v
    lp = torch.cat([torch.zeros(logp.shape[0], left), logp, torch.zeros(logp.shape[0], right)], dim=1)
    return out, lp


def _rows(data, logp, idx):
    out = {k: (v[idx] if torch.is_tensor(v) and v.dim() >= 1 and k != "input_lengths" else v) for k, v in data.items()}
    out["input_lengths"] = data["input_lengths"][idx]
    return out, logp[idx]


KL = {"reference_policy_kl_penalty": 0.05}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("left,right", [(0, 3), (2, 0), (3, 5)])
def test_invariant_to_padding_width(name, left, right):
    data, logp, gvs, gvt = R.make_batch(B=5, S=12, V=V, seed=1)
    fn = make_loss(name, **KL)
    a = R.run_loss(fn, logp, data, gvs, gvt)
    pdata, plogp = _pad(data, logp, left, right)
    b = R.run_loss(fn, plogp, pdata, gvs, gvt)
    R.assert_close(b[0], a[0], rtol=1e-6, atol=1e-7, what="loss")
    R.assert_close(b[1][:, left : left + logp.shape[1]], a[1], rtol=1e-6, atol=1e-7, what="grad")
    assert b[1][:, :left].abs().sum() == 0 and b[1][:, left + logp.shape[1] :].abs().sum() == 0
    for k in SUMMED + ("probs_ratio_min", "probs_ratio_max"):
        R.assert_close(b[2][k], a[2][k], rtol=1e-6, atol=1e-7, what=k)


@pytest.mark.parametrize("name", ALL)
def test_invariant_to_row_order(name):
    data, logp, gvs, gvt = R.make_batch(B=6, S=12, V=V, seed=2)
    fn = make_loss(name, **KL)
    a = R.run_loss(fn, logp, data, gvs, gvt)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    pdata, plogp = _rows(data, logp, perm)
    b = R.run_loss(fn, plogp, pdata, gvs, gvt)
    R.assert_close(b[0], a[0], rtol=1e-6, atol=1e-7, what="loss")
    R.assert_close(b[1], a[1][perm], rtol=1e-6, atol=1e-7, what="grad")


def _check_split(fn, data, logp, gvs, gvt, parts):
    full = R.run_loss(fn, logp, data, gvs, gvt)
    total, grads, metrics = 0.0, [], []
    for part in parts:
        d, lp = part
        res = R.run_loss(fn, lp, d, gvs, gvt)
        total = total + res[0]
        grads.append(res[1])
        metrics.append(res[2])
    R.assert_close(total, full[0], rtol=1e-6, atol=1e-7, what="summed loss")
    for k in SUMMED:
        R.assert_close(sum(m[k] for m in metrics), full[2][k], rtol=1e-6, atol=1e-7, what=k)
    lo = min(m["probs_ratio_min"] for m in metrics)
    hi = max(m["probs_ratio_max"] for m in metrics)
    R.assert_close(lo, full[2]["probs_ratio_min"], what="min")
    R.assert_close(hi, full[2]["probs_ratio_max"], what="max")
    return full, grads


@pytest.mark.parametrize("name", ALL)
def test_invariant_to_microbatch_split(name):
    data, logp, gvs, gvt = R.make_batch(B=7, S=12, V=V, seed=3)
    fn = make_loss(name, **KL)
    bounds = [(0, 2), (2, 3), (3, 7)]
    parts = [_rows(data, logp, torch.arange(a, b)) for a, b in bounds]
    full, grads = _check_split(fn, data, logp, gvs, gvt, parts)
    R.assert_close(torch.cat(grads), full[1], rtol=1e-6, atol=1e-7, what="grad")


@pytest.mark.parametrize("name", ALL)
def test_invariant_to_sequence_packing_calls(name):
    """One call per sequence with every [B,S] key sliced to the row's length (a plain dict), as
    NeMo-RL's SequencePackingLossWrapper does; partial losses add up to the batch loss."""
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=4)
    fn = make_loss(name, **KL)
    parts = []
    for i, L in enumerate(R.row_lengths(data)):
        d = {
            k: (v[i : i + 1, :L] if torch.is_tensor(v) and v.dim() > 1 and v.shape[1] > 1 else v[i : i + 1])
            for k, v in data.items()
        }
        parts.append((d, logp[i : i + 1, : L - 1]))
    full, grads = _check_split(fn, data, logp, gvs, gvt, parts)
    for i, g in enumerate(grads):
        R.assert_close(g[0], full[1][i, : g.shape[1]], rtol=1e-6, atol=1e-7, what=f"grad row {i}")
        assert full[1][i, g.shape[1] :].abs().sum() == 0


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(ALL),
    B=st.integers(2, 6),
    S=st.integers(3, 12),
    seed=st.integers(0, 10_000),
    left=st.integers(0, 3),
    right=st.integers(0, 3),
    data_perm=st.randoms(use_true_random=False),
)
def test_property_invariances(name, B, S, seed, left, right, data_perm):
    data, logp, gvs, gvt = R.make_batch(B=B, S=S, V=V, seed=seed, prompt_max=max(1, S // 4))
    fn = make_loss(name)
    a = R.run_loss(fn, logp, data, gvs, gvt)
    perm = list(range(B))
    data_perm.shuffle(perm)
    perm = torch.tensor(perm)
    pdata, plogp = _rows(*_pad(data, logp, left, right), perm)
    b = R.run_loss(fn, plogp, pdata, gvs, gvt)
    R.assert_close(b[0], a[0], rtol=1e-6, atol=1e-7, what="loss")
    R.assert_close(b[1][:, left : left + logp.shape[1]], a[1][perm], rtol=1e-6, atol=1e-7, what="grad")
