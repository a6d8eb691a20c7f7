"""The worker extensions and driver hooks against NeMo-RL's REAL worker / policy / value classes.

Imports the real worker modules on CPU (``megatron_workers`` fixture: megatron.core, then the
test-only Transformer Engine placeholder; Automodel's ``safe_import_te`` is told "no TE" in this
module so its checkpoint code keeps its TE-absent path). What is checked:

* every method the extensions override or call exists on the real class with a compatible
  signature (``inspect.signature`` binding, keyword-only where NeMo-RL is keyword-only);
* the post-processor swap takes effect: the real ``get_logprobs`` looks ``LogprobsPostProcessor``
  up in its module globals at call time, the real ``forward_with_post_processing_fn`` dispatches
  on ``isinstance(..., LogprobsPostProcessor)`` (our subclass passes) and calls it with the
  keywords our ``__call__`` accepts; the DTensor-v2 subclass is RUN on CPU logits through the real
  base ``__call__`` and returns NeMo-RL's logprobs plus the entropy;
* the actor-environment registration and the ``policy_factory`` hook are NeMo-RL's real ones;
* ``get_logprobs_with_entropy`` is reachable from the driver exactly as ``policy.py`` calls it
  (``RayWorkerGroup.run_all_workers_sharded_data`` keywords, then ``getattr(worker, name)(data=...)``);
* ``PromptOnlyValue`` uses only attributes / methods the real ``Value`` has;
* π_old entropy is that of the temperature-scaled distribution: NeMo-RL divides the logits in
  place before the post-processor; the embedded trainer does the same.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.nemo_rl, pytest.mark.v070]


@pytest.fixture(scope="module")
def real(megatron_workers):
    import nemo_automodel.shared.import_utils as iu

    mp = pytest.MonkeyPatch()
    mp.setattr(iu, "safe_import_te", lambda: (False, None))  # TE-absent path (test only)
    import nemo_rl.algorithms.grpo as grpo
    from nemo_rl.distributed import ray_actor_environment_registry as reg
    from nemo_rl.distributed import virtual_cluster
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.worker_groups import RayWorkerGroup
    from nemo_rl.models.automodel import train as atrain
    from nemo_rl.models.megatron import train as mtrain
    from nemo_rl.models.policy import lm_policy
    from nemo_rl.models.policy.workers import dtensor_policy_worker_v2 as dpw
    from nemo_rl.models.policy.workers import megatron_policy_worker as mpw
    from nemo_rl.models.value import lm_value

    from nemo_granular.nemo_rl import dtensor_worker, megatron_worker

    yield SimpleNamespace(
        grpo=grpo,
        reg=reg,
        vc=virtual_cluster,
        BDD=BatchedDataDict,
        RWG=RayWorkerGroup,
        atrain=atrain,
        mtrain=mtrain,
        lm_policy=lm_policy,
        dpw=dpw,
        mpw=mpw,
        lm_value=lm_value,
        ours_m=megatron_worker,
        ours_d=dtensor_worker,
    )
    mp.undo()


def _original(fn):
    """The function under NeMo-RL's decorators (``wrap_with_nvtx_name`` keeps it in its closure)."""
    fn = inspect.unwrap(fn)
    for cell in fn.__closure__ or ():
        if inspect.isfunction(cell.cell_contents):
            return _original(cell.cell_contents)
    return fn


def _bindable(fn, *args, **kwargs):
    inspect.signature(_original(fn)).bind(*args, **kwargs)


def _global_names(fn) -> set[str]:
    return set(_original(fn).__code__.co_names)


def test_megatron_extension_matches_real_worker(real):
    m = real.ours_m
    assert issubclass(m.GranularMegatronPolicyWorkerImpl, real.mpw.MegatronPolicyWorkerImpl)
    # our call self.get_logprobs(data=..., micro_batch_size=...) binds (keyword-only in NeMo-RL)
    _bindable(real.mpw.MegatronPolicyWorkerImpl.get_logprobs, None, data=None, micro_batch_size=None)
    with pytest.raises(TypeError):
        _bindable(real.mpw.MegatronPolicyWorkerImpl.get_logprobs, None, None)  # positional data is refused
    # the swap: get_logprobs builds the post-processor by module-global name at call time
    assert "LogprobsPostProcessor" in _global_names(real.mpw.MegatronPolicyWorkerImpl.get_logprobs)
    assert real.mpw.LogprobsPostProcessor is real.mtrain.LogprobsPostProcessor
    assert issubclass(m.EntropyLogprobsPostProcessor, real.mtrain.LogprobsPostProcessor)
    base_call = inspect.signature(real.mtrain.LogprobsPostProcessor.__call__)
    assert list(inspect.signature(m.EntropyLogprobsPostProcessor.__call__).parameters) == list(base_call.parameters)
    # forward_with_post_processing_fn calls it with keywords our __call__ accepts
    src = textwrap.dedent(inspect.getsource(real.mtrain.forward_with_post_processing_fn))
    calls = [
        n
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "post_processing_fn"
    ]
    kw_sets = [{k.arg for k in c.keywords} for c in calls]
    assert {"data_dict", "input_ids", "cu_seqlens_padded"} in kw_sets
    _bindable(m.EntropyLogprobsPostProcessor.__call__, None, data_dict=None, input_ids=None, cu_seqlens_padded=None)
    # the constructor keywords get_logprobs passes reach the base class through our **kwargs
    init_kw = {
        k.arg
        for n in ast.walk(
            ast.parse(textwrap.dedent(inspect.getsource(_original(real.mpw.MegatronPolicyWorkerImpl.get_logprobs))))
        )
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "LogprobsPostProcessor"
        for k in n.keywords
    }
    assert init_kw and init_kw <= set(inspect.signature(real.mtrain.LogprobsPostProcessor.__init__).parameters)
    from nemo_granular.nemo_rl import compat

    # attributes our processor reads (the fused-kernel flag's name is per version: compat)
    for name in ("cfg", compat.FUSED_LOGPROBS_ATTR[compat.version().key]):
        assert f"self.{name}" in inspect.getsource(real.mtrain.LogprobsPostProcessor.__init__)
    # pipeline helpers it calls
    from megatron.core import parallel_state
    from nemo_rl.models.megatron.pipeline_parallel import broadcast_tensors_from_last_stage

    _bindable(parallel_state.is_pipeline_last_stage, ignore_virtual=True)
    _bindable(broadcast_tensors_from_last_stage, {"entropy": None})


def test_dtensor_extension_runs_through_the_real_post_processor(real):
    d = real.ours_d
    assert issubclass(d.GranularDTensorPolicyWorkerV2Impl, real.dpw.DTensorPolicyWorkerV2Impl)
    _bindable(real.dpw.DTensorPolicyWorkerV2Impl.get_logprobs, None, data=None, micro_batch_size=None)
    assert "LogprobsPostProcessor" in _global_names(real.dpw.DTensorPolicyWorkerV2Impl.get_logprobs)
    assert real.dpw.LogprobsPostProcessor is real.atrain.LogprobsPostProcessor
    assert list(inspect.signature(d.EntropyLogprobsPostProcessor.__call__).parameters) == list(
        inspect.signature(real.atrain.LogprobsPostProcessor.__call__).parameters
    )
    # run it: the real base __call__ on CPU logits (TP = CP = 1, no packing)
    B, S, V = 3, 7, 13
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, V, generator=g)
    ids = torch.randint(0, V, (B, S), generator=g)
    lengths = torch.tensor([7, 4, 6])
    sink: list = []
    post = d.EntropyLogprobsPostProcessor(
        cfg={"logprob_chunk_size": None},
        device_mesh=None,
        cp_mesh=None,
        tp_mesh=None,
        cp_size=1,
        enable_seq_packing=False,
        sink=sink,
    )
    data = real.BDD({"input_ids": ids, "input_lengths": lengths})
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # NeMo-RL moves ids with .cuda() (test only)
    try:
        lp = post(
            logits.clone(), data, SimpleNamespace(seq_index=None, flash_attn_kwargs={}, seq_len=S, input_ids=ids), B, S
        )
    finally:
        mp.undo()
    logp = torch.log_softmax(logits.double(), -1)
    ref_lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    got_lp = lp if lp.shape[1] == S - 1 else lp[:, 1:]
    inside = torch.arange(1, S)[None, :] < lengths[:, None]  # NeMo-RL zeroes the padding
    torch.testing.assert_close(got_lp.double()[inside], ref_lp[inside], rtol=1e-5, atol=1e-5)
    ent = d.stack_microbatch_entropy(sink, B, S)
    ref_ent = torch.zeros(B, S, dtype=torch.float64)
    h = -(logp.exp() * logp).sum(-1)
    for i, L in enumerate(lengths.tolist()):
        ref_ent[i, 1:L] = h[i, : L - 1]
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)


def test_actor_environment_registration_is_real(real):
    from nemo_granular.nemo_rl.policy import register_worker_extensions
    from nemo_granular.nemo_rl.workers import DTENSOR_V2_EXTENSION_FQN, MEGATRON_EXTENSION_FQN

    register_worker_extensions()
    assert real.reg.get_actor_python_env(MEGATRON_EXTENSION_FQN) == real.reg.MCORE_EXECUTABLE
    assert real.reg.get_actor_python_env(DTENSOR_V2_EXTENSION_FQN) == real.vc.PY_EXECUTABLES.AUTOMODEL
    # same executables as the workers they extend
    assert (
        real.reg.get_actor_python_env("nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker")
        == real.reg.MCORE_EXECUTABLE
    )
    # the fqns resolve to the real ray actor classes with the entropy method
    import importlib

    from nemo_granular.nemo_rl.workers import ENTROPY_METHOD

    for fqn in (MEGATRON_EXTENSION_FQN, DTENSOR_V2_EXTENSION_FQN):
        mod, cls = fqn.rsplit(".", 1)
        actor = getattr(importlib.import_module(mod), cls)
        assert hasattr(actor, "remote") and hasattr(actor, ENTROPY_METHOD)


def test_policy_factory_hook_and_driver_call_path(real):
    from nemo_granular.nemo_rl import policy as P

    # grpo.setup takes policy_factory and calls it with keywords GranularPolicy accepts
    assert "policy_factory" in inspect.signature(real.grpo.setup).parameters
    src = textwrap.dedent(inspect.getsource(real.grpo.setup))
    call = next(
        n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "_make_policy"
    )
    GP = P.granular_policy_class()
    assert issubclass(GP, real.lm_policy.Policy)
    _bindable(
        GP.__init__,
        None,
        **{k.arg: None for k in call.keywords},
        worker_extension_cls_fqn="x",
        granular_loss_cfg={},
        delimiter_table=None,
    )
    for name in ("train", "get_logprobs"):
        assert list(inspect.signature(getattr(GP, name)).parameters) == list(
            inspect.signature(getattr(real.lm_policy.Policy, name)).parameters
        ), name
    master = {"policy": {"megatron_cfg": {"enabled": True}}, "loss_fn": {"granular": {"algorithm": "sspo"}}}
    factory = P.make_policy_factory(master)
    seen = {}

    class Probe(GP):
        def __init__(self, **kw):
            seen.update(kw)

    P._CLASS["cls"], saved = Probe, P._CLASS["cls"]
    try:
        P.make_policy_factory(master)(**{k.arg: None for k in call.keywords})
    finally:
        P._CLASS["cls"] = saved
    assert seen["worker_extension_cls_fqn"] == P.MEGATRON_EXTENSION_FQN and callable(factory)

    # driver → worker: GranularPolicy._logprobs_and_entropy with a worker group that checks the
    # call against the real RayWorkerGroup signature and dispatches like it (getattr + data=)
    class Group:
        def run_all_workers_sharded_data(self, method_name, *args, **kwargs):
            _bindable(real.RWG.run_all_workers_sharded_data, None, method_name, *args, **kwargs)
            fn = getattr(real.ours_m.GranularMegatronPolicyWorkerImpl, method_name)
            _bindable(fn, None, **{k: v[0] for k, v in kwargs.items() if k == "data"})
            return [{"logprobs": torch.zeros(2, 3), "entropy": torch.ones(2, 3)}]

        def get_all_worker_results(self, futures):
            return [real.BDD(f) for f in futures]

    pol = object.__new__(GP)
    pol.worker_group = Group()
    pol._shard_for_logprob = lambda data: ([data], None)
    assert hasattr(real.lm_policy.Policy, "_shard_for_logprob")
    out = pol._logprobs_and_entropy(real.BDD({"input_ids": torch.zeros(2, 3, dtype=torch.long)}))
    assert out["entropy"].shape == (2, 3)


def test_prompt_only_value_uses_real_value_api(real):
    from nemo_granular.sppo.critic import PromptOnlyValue

    V = real.lm_value.Value
    init_src = inspect.getsource(V.__init__)
    for attr in ("sharding_annotations", "use_dynamic_batches", "use_sequence_packing", "cfg"):
        assert f"self.{attr}" in init_src, f"Value has no {attr}"
    _bindable(V.get_values, None, {}, timer=None)
    _bindable(V.train, None, {}, None, False, gbs=None, mbs=None, timer=None)
    # the wrapper forwards with exactly these shapes of call
    for name in ("get_values", "train"):
        ours = list(inspect.signature(getattr(PromptOnlyValue, name)).parameters)
        theirs = list(inspect.signature(getattr(V, name)).parameters)
        assert ours[: len(theirs)] == theirs or set(theirs) <= set(ours) | {"kwargs"}, name
    # the value worker classes the critic runs in are importable and expose what ppo calls
    from nemo_rl.models.value.workers import dtensor_value_worker_v2, megatron_value_worker

    for mod in (dtensor_value_worker_v2, megatron_value_worker):
        impl = next(c for n, c in vars(mod).items() if n.endswith("ValueWorkerImpl") or n.endswith("ValueWorkerV2Impl"))
        assert hasattr(impl, "get_values") and hasattr(impl, "train"), impl


def test_pi_old_entropy_is_of_the_temperature_scaled_distribution(real):
    """NeMo-RL divides the logits IN PLACE by the temperature before the logprob post-processor
    (both backends), so the entropy our post-processor computes from the same tensor is that of
    softmax(logits / T); the embedded trainer's π_old pass uses the same scaled logits."""
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

    for mod in (real.mtrain, real.atrain):
        x = torch.randn(2, 3, 5)
        y = x.clone()
        out = mod.apply_temperature_scaling(y, TrainingSamplingParams(temperature=0.7, top_k=None, top_p=1.0))
        torch.testing.assert_close(y, x / 0.7)  # in place
        assert out is y or out.data_ptr() == y.data_ptr()
        src = textwrap.dedent(inspect.getsource(mod.forward_with_post_processing_fn))
        assert src.index("apply_temperature_scaling(") < src.rindex("post_processing_fn("), mod.__name__

    from nemo_granular.embedded.rollout import old_policy_pass

    V, T = 9, 0.6
    g = torch.Generator().manual_seed(1)
    table = torch.randn(V, V, generator=g) * 2

    class Tiny(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return SimpleNamespace(logits=table[input_ids])

    ids = torch.randint(0, V, (2, 6), generator=g)
    batch = {"input_ids": ids, "input_lengths": torch.tensor([6, 6])}
    old_policy_pass(Tiny(), batch, T, chunk_size=4)
    logp = torch.log_softmax(table[ids][:, :-1].double() / T, -1)
    torch.testing.assert_close(
        batch["prev_entropy"][:, 1:].double(), -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5
    )
    unscaled = torch.log_softmax(table[ids][:, :-1].double(), -1)
    assert not torch.allclose(batch["prev_entropy"][:, 1:].double(), -(unscaled.exp() * unscaled).sum(-1))
