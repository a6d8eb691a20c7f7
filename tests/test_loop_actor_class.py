"""The worker extensions as Ray ships them to a worker process (found by the CPU loops).

Ray turns a ``@ray.remote`` class into a generated subclass that re-wraps EVERY inherited method
(tracing wrappers) and sends it to the worker with cloudpickle. NeMo-RL's ``get_logprobs`` is
wrapped by ``wrap_with_nvtx_name``, so the function inside is not reachable by its qualified name
and cloudpickle ships it BY VALUE, with a frozen copy of its module's globals. The extensions
rebind the module global ``LogprobsPostProcessor`` for one call; through ``self.get_logprobs`` that
rebinding never reached the shipped copy, and the real GRPO loop stopped at its first logprob pass
with "entropy for 0 rows collected". Here the class goes through the same cloudpickle round trip
(no Ray cluster needed) and ``get_logprobs_with_entropy`` must end up in code that reads the real
module's globals at call time: a sentinel put into the module is hit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.nemo_rl,
    pytest.mark.v070,
]  # the Megatron / Automodel imports (shared with the other host tests)


class Reached(Exception):
    pass


@pytest.fixture(scope="module")
def real(megatron_workers):
    import nemo_automodel.shared.import_utils as iu

    mp = pytest.MonkeyPatch()
    mp.setattr(iu, "safe_import_te", lambda: (False, None))  # TE-absent path (test only), as test_host_workers
    from nemo_rl.models.policy.workers import dtensor_policy_worker_v2 as dpw
    from nemo_rl.models.policy.workers import megatron_policy_worker as mpw

    from nemo_granular.nemo_rl import dtensor_worker, megatron_worker

    yield SimpleNamespace(dpw=dpw, mpw=mpw, ours_d=dtensor_worker, ours_m=megatron_worker)
    mp.undo()


def _as_shipped(actor_class):
    """The class a Ray worker process receives for ``actor_class`` (Ray's generated subclass after
    the cloudpickle round trip Ray's function manager does)."""
    import ray.cloudpickle as cloudpickle

    return cloudpickle.loads(cloudpickle.dumps(actor_class.__ray_metadata__.modified_class))


def _bare(cls, **attrs):
    obj = cls.__new__(cls)
    obj.timer = SimpleNamespace(start=lambda *a, **k: None, stop=lambda *a, **k: None)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def _sentinel(*_a, **_k):
    raise Reached


@pytest.fixture(autouse=True)
def no_nvtx(monkeypatch):
    """NeMo-RL's ``wrap_with_nvtx_name`` pushes NVTX ranges (a CUDA library): no-ops here."""
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda *a, **k: 0)


def test_dtensor_extension_reaches_the_module_globals_in_the_shipped_class(real, monkeypatch):
    shipped = _as_shipped(real.ours_d.GranularDTensorPolicyWorkerV2)
    # the copy Ray ships of the inherited get_logprobs does NOT see module rebinding (the trap)
    monkeypatch.setattr(real.dpw, "check_sequence_dim", _sentinel)
    obj = _bare(shipped, cfg={"logprob_batch_size": 2})
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute"):
        shipped.get_logprobs(obj, None, micro_batch_size=2)  # the frozen, real check_sequence_dim ran
    # ... but get_logprobs_with_entropy runs the module's own function, which does
    with pytest.raises(Reached):
        obj.get_logprobs_with_entropy(None, micro_batch_size=2)
    assert real.dpw.LogprobsPostProcessor is real.ours_d._atrain.LogprobsPostProcessor  # restored


def test_megatron_extension_reaches_the_module_globals_in_the_shipped_class(real, monkeypatch):
    shipped = _as_shipped(real.ours_m.GranularMegatronPolicyWorker)
    # the first module global get_logprobs calls: main's media mask; v0.7.0 (no such function) its iterator
    first = (
        "attach_media_token_validity_mask"
        if hasattr(real.mpw, "attach_media_token_validity_mask")
        else "get_microbatch_iterator"
    )
    monkeypatch.setattr(real.mpw, first, _sentinel)
    obj = _bare(
        shipped,
        cfg={"logprob_batch_size": 2},
        model=SimpleNamespace(eval=lambda: None),
        media_placeholder_token_id=None,
        mcore_state=SimpleNamespace(straggler_timer=None),
        delegate_pack_to_model=False,
    )
    grad = torch.is_grad_enabled()  # NeMo-RL's get_logprobs enters no_grad without a with-block
    try:
        with pytest.raises(Reached):
            obj.get_logprobs_with_entropy(data=None, micro_batch_size=2)
    finally:
        torch.set_grad_enabled(grad)
