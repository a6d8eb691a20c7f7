"""Bad input to `GranularPolicyLoss`: shape errors name both shapes, NaN/inf tokens are excluded
and counted, empty microbatches give loss 0 and zero gradient, missing keys are named."""

import math

import pytest
import torch

import reference as R
from nemo_granular.losses import GranularPolicyLoss

V = 16
ALL = sorted(R.PRESET_SPECS)


def make_loss(name, **extra):
    return GranularPolicyLoss(
        {"granular": {"algorithm": name, "espo": {"vocab_size": V}}, "reference_policy_kl_penalty": 0.0, **extra},
        delimiter_table=R.delimiter_table(V),
    )


def _call(fn, logp, data, gvs=3.0, gvt=20.0):
    return fn(
        next_token_logprobs=logp, data=data, global_valid_seqs=torch.tensor(gvs), global_valid_toks=torch.tensor(gvt)
    )


@pytest.mark.parametrize("key", ["advantages", "prev_logprobs", "token_mask", "prev_entropy", "input_ids"])
def test_mismatched_shape_names_both_shapes(key):
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=0)
    data[key] = torch.cat([data[key], data[key][:, :2]], dim=1)  # [3, 12] instead of [3, 10]
    name = {"prev_entropy": "espo", "input_ids": "sspo_no_ec"}.get(key, "grpo")
    with pytest.raises(ValueError) as err:
        _call(make_loss(name), logp, data, gvs, gvt)
    msg = str(err.value)
    assert "\n" not in msg and key in msg
    assert str((3, 11)) in msg and str((3, 9)) in msg, msg


@pytest.mark.parametrize("bad", [10, -2, 2**40 + 1])
@pytest.mark.parametrize("name", ["sspo", "espo"])  # the scatter plan; the one-hot plan
def test_group_ids_out_of_range_are_refused_with_the_id_as_given(name, bad):
    """Ids are range-checked on their float copy (the plans' own): an id outside −1..S−2 is refused in
    one line naming the key and the id exactly as given (2^40 + 1 has no float32 of its own)."""
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=0)
    ids = torch.zeros(3, 10, dtype=torch.long)
    ids[1, 6] = bad
    data["granular_group_ids"] = ids
    with pytest.raises(ValueError) as err:
        _call(make_loss(name), logp, data, gvs, gvt)
    msg = str(err.value)
    assert "\n" not in msg and "granular_group_ids" in msg and f"holds id {bad} outside -1..8" in msg, msg


def test_wrong_row_count_and_rank():
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=0)
    data["sample_mask"] = torch.ones(4)
    with pytest.raises(ValueError, match="sample_mask"):
        _call(make_loss("gspo"), logp, data, gvs, gvt)
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=0)
    with pytest.raises(ValueError, match=r"\[B, S-1\]"):
        _call(make_loss("gspo"), logp[None], data, gvs, gvt)


def test_missing_keys_are_named():
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=0)
    del data["prev_entropy"]
    for name in ("sspo", "espo"):
        with pytest.raises(KeyError, match="prev_entropy"):
            _call(make_loss(name), logp, data, gvs, gvt)
    del data["advantages"]
    with pytest.raises(KeyError, match="advantages"):
        _call(make_loss("grpo"), logp, data, gvs, gvt)


def test_segment_needs_tokenizer_and_espo_needs_vocab():
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=0)
    with pytest.raises(ValueError, match="tokenizer"):
        _call(GranularPolicyLoss({"granular": {"algorithm": "sspo"}}), logp, data, gvs, gvt)
    with pytest.raises(ValueError, match="vocab_size"):
        _call(GranularPolicyLoss({"granular": {"algorithm": "espo"}}), logp, data, gvs, gvt)
    # vocab size from the constructor (the model's) is enough
    _call(GranularPolicyLoss({"granular": {"algorithm": "espo"}}, vocab_size=V), logp, data, gvs, gvt)


def _poison(data, logp, where):
    """Put NaN/inf into valid response tokens; returns the poisoned positions (shifted coords)."""
    tm = data["token_mask"][:, 1:] > 0
    pos = [tuple(p) for p in tm.nonzero().tolist()]
    hits = pos[1 :: max(1, len(pos) // 5)][:4]
    vals = [float("nan"), float("inf"), float("-inf"), float("nan")]
    for (i, t), v in zip(hits, vals):
        if where == "logp":
            logp[i, t] = v
        else:
            data[where][i, t + 1] = v
    return hits


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("where", ["logp", "prev_logprobs", "prev_entropy", "advantages"])
def test_nonfinite_tokens_are_excluded_and_counted(name, where):
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=2, zero_sample_rows=False)
    hits = _poison(data, logp, where)
    loss, grad, m = R.run_loss(make_loss(name), logp, data, gvs, gvt)
    assert math.isfinite(float(loss)) and torch.isfinite(grad).all()
    uses_entropy = name in ("sspo", "espo")
    expected_count = 0 if (where == "prev_entropy" and not uses_entropy) else len(hits)
    assert m["nonfinite_tokens"] == expected_count
    skip = ()
    assert all(math.isfinite(v) for k, v in m.items() if not k.startswith("probs_ratio_m") and k not in skip)
    # excluded == computed by the reference on the same data (which drops non-finite tokens)
    rloss, rgrad, rm = R.run_ref(lambda lp: R.preset_loss(name, lp, data, gvs=gvs, gvt=gvt, vocab_size=V), logp)
    assert rm["nonfinite_tokens"] == expected_count
    R.assert_close(loss, rloss, what="loss")
    R.assert_close(grad, torch.nan_to_num(rgrad, nan=0.0), what="grad")
    if where == "logp":
        assert all(grad[i, t] == 0 for i, t in hits)


@pytest.mark.parametrize("name", ["grpo", "gspo", "sspo_no_ec"])
def test_nonfinite_unused_entropy_keeps_metrics_finite(name):
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=2, zero_sample_rows=False)
    _poison(data, logp, "prev_entropy")
    _, _, m = R.run_loss(make_loss(name), logp, data, gvs, gvt)
    assert math.isfinite(m["prev_entropy_mean"])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("case", ["no_response_tokens", "all_samples_masked", "zero_global_counts"])
def test_empty_microbatch_gives_zero_loss_and_grad(name, case):
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=1)
    if case == "no_response_tokens":
        data["token_mask"].zero_()
    elif case == "all_samples_masked":
        data["sample_mask"].zero_()
    else:
        data["token_mask"].zero_()
        data["sample_mask"].zero_()
        gvs, gvt = 0.0, 0.0
    fn = make_loss(name, reference_policy_kl_penalty=0.05)
    loss, grad, m = R.run_loss(fn, logp, data, gvs, gvt)
    assert float(loss) == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    for k, v in m.items():
        if k in ("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max"):
            assert math.isinf(v)  # NeMo-RL's ±inf sentinels, skipped by its packing wrapper
        else:
            assert math.isfinite(v), (k, v)


def test_extreme_log_ratio_stays_finite():
    """A huge log-ratio on a clipped token must not turn 0-gradient into inf·0 = NaN."""
    data, logp, gvs, gvt = R.make_batch(B=3, S=10, V=V, seed=3)
    tm = data["token_mask"][:, 1:] > 0
    i, t = tm.nonzero()[0].tolist()
    logp[i, t] = data["prev_logprobs"][i, t + 1] + 200.0
    for name in ALL:
        loss, grad, _ = R.run_loss(make_loss(name), logp, data, gvs, gvt)
        assert math.isfinite(float(loss)) and torch.isfinite(grad).all(), name
