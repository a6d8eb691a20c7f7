"""``loss_fn.metrics_level`` and ``loss_fn.enable_torch_compile``: the keys of NeMo-RL's rewritten
``ClippedPGLossFn`` (NVIDIA-NeMo/RL pull request 3751), with its meaning.

* ``minimal`` returns what the rewrite's minimal mode returns of NeMo-RL's metrics — ``loss``,
  ``kl_penalty``, ``num_valid_samples``, ``positive_nll_loss``, ``is_oob_ratio`` with a truncation,
  ``sampling_importance_ratio`` only with the importance-sampling correction — plus the clip
  fractions per token and the non-finite count, each with exactly the value of the ``full`` call; our
  group and bound diagnostics (``GRANULAR_DIAGNOSTICS``) are left out like the rewrite's diagnostics;
  ``metric_normalizations`` advertises exactly the returned metrics. Our π_old/π_gen mismatch diagnostics (``MISMATCH_METRICS``) are
  diagnostics like the rewrite's: at ``minimal`` only with the correction on. Loss and gradient
  do not depend on the level.
* ``enable_torch_compile: true`` runs the tensor-only objective through ``torch.compile`` with
  NeMo-RL's arguments (``dynamic=True``, ``mode="max-autotune-no-cudagraphs"``), built on the first
  call and not pickled; results equal the eager ones. (Here the compiled function is traced by
  TorchDynamo with the ``aot_eager`` backend: inductor's C++ build on a 2-core CI machine would
  cost minutes; the trace — the part that can break on our code — is the same.)
* Bad values are refused in one line naming the key, as NeMo-RL's pydantic config refuses them.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import reference as R
from nemo_granular.config import PRESETS
from nemo_granular.core.masks import row_constant
from nemo_granular.loss_metrics import GRANULAR_DIAGNOSTICS, MINIMAL_SKIPS, MISMATCH_METRICS
from nemo_granular.losses import GranularPolicyLoss, read_policy_batch

V = 16
# what the rewrite's minimal mode keeps of NeMo-RL's metric set (its ClippedPGLossFn.__call__)
NEMO_MINIMAL = {"loss", "kl_penalty", "num_valid_samples", "positive_nll_loss"}
# ours that minimal keeps beside them
OURS_MINIMAL = {"clip_frac_low", "clip_frac_high", "nonfinite_tokens", "nonfinite_token_frac"}
# ours that minimal leaves out (written out here, not read from the package)
OURS_FULL_ONLY = {
    "clip_frac_low_groups",
    "clip_frac_high_groups",
    "groups_per_response",
    "group_size_mean",
    "clip_bound_low_mean",
    "clip_bound_high_mean",
    "prev_entropy_mean",
}
NEMO_FULL_ONLY = {
    "probs_ratio",
    "probs_ratio_clamped",
    "probs_ratio_min",
    "probs_ratio_max",
    "probs_ratio_clamped_min",
    "probs_ratio_clamped_max",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "approx_entropy",
}
TIS = dict(
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=1.03,
)
SEQ_MASK = dict(
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="seq-mask-tis",
    truncated_importance_sampling_ratio=1.01,
    truncated_importance_sampling_ratio_min=0.99,
)


def _make(name, **extra):
    return GranularPolicyLoss(
        {"granular": {"algorithm": name, "espo": {"vocab_size": V}}, **extra}, delimiter_table=R.delimiter_table(V)
    )


def _run(fn, seed=0):
    data, logp, gvs, gvt = R.make_batch(B=6, S=14, V=V, seed=seed, per_token_adv=True, noise=(1e-3, 0.05, 0.4))
    data = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    data["rewards"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    lp = logp.double().requires_grad_(True)
    loss, m = fn(
        next_token_logprobs=lp,
        data=data,
        global_valid_seqs=torch.tensor(gvs, dtype=torch.float64),
        global_valid_toks=torch.tensor(gvt, dtype=torch.float64),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, m


def test_skip_list_is_the_rewrites():
    assert set(MINIMAL_SKIPS) == NEMO_FULL_ONLY
    assert set(GRANULAR_DIAGNOSTICS) == OURS_FULL_ONLY


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize(
    "extra",
    [{}, dict(reference_policy_kl_penalty=0.05, positive_example_nll_weight=0.2), TIS],
    ids=["plain", "kl_nll", "tis"],
)
def test_minimal_drops_only_the_diagnostics(name, extra):
    full_fn, min_fn = _make(name, **extra), _make(name, metrics_level="minimal", **extra)
    loss, grad, full = _run(full_fn)
    mloss, mgrad, minimal = _run(min_fn)
    assert torch.equal(loss, mloss) and torch.equal(grad, mgrad)
    dropped = set(full) - set(minimal)
    corrected = "use_importance_sampling_correction" in extra
    want = NEMO_FULL_ONLY | OURS_FULL_ONLY | (set() if corrected else {"sampling_importance_ratio", *MISMATCH_METRICS})
    assert dropped == want & set(full), sorted(dropped ^ (want & set(full)))
    assert set(minimal) <= set(full)
    for k, v in minimal.items():
        assert v == full[k], f"{k}: minimal {v} != full {full[k]}"
    assert NEMO_MINIMAL | OURS_MINIMAL <= set(minimal)
    if extra is TIS:
        assert {"is_oob_ratio", "sampling_importance_ratio", *MISMATCH_METRICS} <= set(minimal)
    # the advertised normalisers are those of the returned metrics
    assert set(min_fn.metric_normalizations) == set(minimal)
    assert set(full_fn.metric_normalizations) <= set(full) | {"is_oob_ratio"}


@pytest.mark.parametrize("value,key", [("medium", "metrics_level"), ("yes please", "enable_torch_compile")])
def test_bad_values_refused(value, key):
    with pytest.raises(ValueError) as err:
        GranularPolicyLoss({key: value})
    assert "\n" not in str(err.value) and f"loss_fn.{key}" in str(err.value)


@pytest.mark.parametrize("name", ["grpo", "sspo"])  # token ratios; group ratios with entropy bounds
@pytest.mark.parametrize(
    "extra", [{}, dict(granular={"is_level": "group_mean"}, **SEQ_MASK)], ids=["plain", "is_group_mean_seq_mask_tis"]
)
def test_torch_compile_objective(monkeypatch, name, extra):
    """The off-policy correction at its level (math.md §10) is part of the compiled objective."""
    calls = []
    real = torch.compile

    def compile_(fn, **kw):
        calls.append(kw)
        return real(fn, backend="aot_eager", dynamic=kw.get("dynamic"))

    monkeypatch.setattr(torch, "compile", compile_)
    torch._dynamo.reset()
    if extra:  # _make's granular keys and the level together
        extra = dict(extra, granular={"algorithm": name, "espo": {"vocab_size": V}, **extra["granular"]})
    eager, compiled = _make(name, **extra), _make(name, enable_torch_compile=True, **extra)
    assert compiled._compiled_objective is None  # built lazily, on the worker
    for seed in (0, 1):  # a second batch of another size: dynamic shapes, no rebuild
        loss, grad, m = _run(eager, seed)
        closs, cgrad, cm = _run(compiled, seed)
        torch.testing.assert_close(closs, loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(cgrad, grad, rtol=1e-12, atol=1e-15)
        assert set(cm) == set(m) and all(cm[k] == pytest.approx(v, rel=1e-12, abs=1e-15) for k, v in m.items())
    assert calls == [{"dynamic": True, "mode": "max-autotune-no-cudagraphs"}]
    clone = pickle.loads(pickle.dumps(compiled))  # Ray ships the loss: the compiled function stays behind
    assert clone._compiled_objective is None and clone.enable_torch_compile


@pytest.mark.parametrize("name", ["sspo", "espo"])  # a scatter plan of segments; ESPO's one-hot plan
@pytest.mark.parametrize("per_token_adv", [False, True], ids=["response_adv", "token_adv"])
def test_compiled_group_objective_is_one_graph(monkeypatch, name, per_token_adv):
    """The grouped objective compiles without a graph break: the plan's data-dependent sizes and the
    response-level-advantage check (host syncs) are made before the compiled call. Before, dynamo broke
    the graph at ``unique_consecutive`` and at the check's ``.item()``."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", dynamic=kw.get("dynamic")))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = _make(name), _make(name, enable_torch_compile=True)
    for seed, (B, S) in enumerate([(6, 14), (5, 19)]):  # a second size: dynamic shapes
        data, logp, gvs, gvt = R.make_batch(
            B=B, S=S, V=V, seed=seed, per_token_adv=per_token_adv, noise=(1e-3, 0.05, 0.4)
        )
        runs = []
        for fn in (eager, compiled):
            lp = logp.double().requires_grad_(True)
            loss, m = fn(
                next_token_logprobs=lp,
                data={k: v.double() if v.is_floating_point() else v for k, v in data.items()},
                global_valid_seqs=torch.tensor(gvs, dtype=torch.float64),
                global_valid_toks=torch.tensor(gvt, dtype=torch.float64),
            )
            runs.append((loss.detach(), torch.autograd.grad(loss, lp)[0], m))
        (loss, grad, m), (closs, cgrad, cm) = runs
        torch.testing.assert_close(closs, loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(cgrad, grad, rtol=1e-12, atol=1e-15)
        assert set(cm) == set(m) and all(cm[k] == pytest.approx(v, rel=1e-12, abs=1e-15) for k, v in m.items())
    # the grouped path ran, on the advantage branch named
    ddata = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    b = read_policy_batch(logp.double(), ddata, gvs, gvt, compiled.cfg)
    assert compiled._grouped(compiled._index(b))
    assert (row_constant(b.adv, b.valid) is None) == per_token_adv
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize("name", ["grpo", "gspo", "sspo", "espo"])
@pytest.mark.parametrize(
    "key,value",
    [
        ("prev_logprobs", float("-inf")),
        ("prev_logprobs", float("inf")),
        ("advantages", float("inf")),
        ("prev_entropy", float("inf")),
        ("prev_logprobs", float("nan")),
    ],
)
@pytest.mark.parametrize("level", ["full", "minimal"])
def test_first_read_never_hides_a_nonfinite_token(name, key, value, level):
    """The loss first reads the batch without the finiteness pass; one ±inf/NaN token (whose
    effect a clamp or the entropy bounds could hide from every metric) must still give exactly
    the careful read's result: the token leaves the valid mask."""
    data, logp, gvs, gvt = R.make_batch(B=5, S=14, V=V, seed=0, per_token_adv=True)
    col = int(data["token_mask"][1].nonzero()[1])
    data[key] = data[key].clone()
    data[key][1, col] = value
    fn = _make(name, metrics_level=level)
    loss, grad, m = R.run_loss(fn, logp, data, gvs, gvt)
    lp = logp.detach().clone().float().requires_grad_(True)
    careful, cm, _ = fn._call(lp, data, torch.tensor(float(gvs)), torch.tensor(float(gvt)), False)
    careful.backward()
    assert torch.isfinite(loss) and float(loss) == float(careful)
    assert torch.equal(grad, lp.grad.double())
    needs_entropy = fn.granular.needs_entropy
    assert m["nonfinite_tokens"] == (1.0 if key != "prev_entropy" or needs_entropy else 0.0)
    assert m.keys() == cm.keys() and all(m[k] == cm[k] or (math.isnan(m[k]) and math.isnan(cm[k])) for k in m)
