"""CPU stand-ins for the CUDA calls NeMo-RL's Megatron worker makes, installed in a worker process.

Each answers a call that needs a GPU and nothing else (``docs/nemo-rl.md`` §7 lists them with
why); no NeMo-RL, Megatron-LM or Megatron-Bridge source is edited. ``install(local_rank)`` must
run in the rank process after :func:`import_megatron_then_te_placeholder` and before NeMo-RL's
worker module is imported.

* CUDA device → CPU: a ``TorchFunctionMode`` maps every ``device=`` that names CUDA (``"cuda"``,
  ``cuda:N``, an int index) to CPU in torch calls, makes ``Tensor.cuda`` / ``pin_memory`` /
  ``record_stream`` identities, and answers ``Tensor.type()`` with the CUDA type name a GPU would
  give (Megatron's optimizers dispatch on that string: ``torch.cuda.FloatTensor`` etc.).
* ``torch.cuda``: ``current_device`` is the local rank (NeMo-RL asserts it equals
  ``ray.get_gpu_ids()[0]``); set_device / synchronize / empty_cache / streams / events / NVTX /
  memory statistics answer like an idle device; the CUDA RNG is the CPU generator (the tensors it
  seeds live on CPU), ``is_available`` stays False.
* process groups: ``init_process_group("nccl")`` and ``new_group(backend="nccl")`` → gloo.
* Ray: ``ray.get_gpu_ids`` (the actor's GPU) → ``[local_rank]``; no Ray is started.
* Megatron-Bridge: ``initialize_megatron`` runs with its own ``allow_no_cuda=True``, the dataset
  index helpers (``compile_helpers``: a ``make`` of a C++ extension RL never uses) are not built,
  the GPT provider's Transformer Engine layer spec is Megatron's local one
  (:mod:`megatron_cpu.attention`), the HF import's provider asks for no TE fused permutation.
* MoE all-to-all split sizes go to the host as numpy, as from a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

TE_STUB = Path(__file__).resolve().parents[1] / "host_shims" / "te_stub"


def import_megatron_then_te_placeholder() -> None:
    """megatron.core first (so every module keeps its Transformer-Engine-absent path), then the
    test-only Transformer Engine placeholder that Megatron-Bridge imports at module level.

    A spawned rank inherits the parent's ``sys.path``, placeholder included, so it is taken off
    while megatron.core imports; :func:`te_takers` then checks that no megatron.core module saw it."""
    sys.path[:] = [p for p in sys.path if Path(p).resolve() != TE_STUB]
    import megatron.core.distributed  # noqa: F401
    import megatron.core.inference.text_generation_controllers.text_generation_controller  # noqa: F401
    import megatron.core.models.gpt.experimental_attention_variant_module_specs  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import megatron.core.transformer.moe.moe_layer  # noqa: F401

    if str(TE_STUB) not in sys.path:
        sys.path.append(str(TE_STUB))


def te_takers() -> list[str]:
    """megatron.core modules that took their Transformer Engine path (``HAVE_TE`` true): must be none."""
    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith("megatron.core") and getattr(mod, "HAVE_TE", False) is True)


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu(device):
    return torch.device("cpu") if _is_cuda(device) else device


_CUDA_TYPE = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
              torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
              torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor",
              torch.uint8: "torch.cuda.ByteTensor", torch.bool: "torch.cuda.BoolTensor"}


def _to_host(args, kwargs) -> bool:
    """``t.to("cpu")`` / ``t.to(device="cpu")``: on a GPU a copy into host memory. Here the tensor is
    already on CPU, so torch would return the SAME tensor, and Megatron's offload (host copy, then
    ``storage().resize_(0)`` of the device buffer, ``param_and_grad_buffer.py`` ``offload_to_cpu``)
    would free the only copy of the weights. So moves to the host always copy."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return (isinstance(target, str) and target == "cpu") or (
        isinstance(target, torch.device) and target.type == "cpu")


def _autograd_with_mode(func, *args, **kwargs):
    """Run ``torch.autograd.backward`` / ``grad`` with the mode active. torch runs a mode's handler
    with the mode popped, and the autograd graph task keeps the thread state it starts with, so a
    backward started through the mode (activation recompute calls ``torch.autograd.backward``)
    would run every backward function without it. The mode is pushed again and the function's own
    dispatch check (which would hand the call back to the mode, endlessly) skipped."""
    import torch.autograd as autograd

    saved = autograd.has_torch_function
    with CudaIsCpu():
        autograd.has_torch_function = lambda *a: False
        try:
            return func(*args, **kwargs)
        finally:
            autograd.has_torch_function = saved


class CudaIsCpu(TorchFunctionMode):
    """Every torch call that names a CUDA device runs on CPU instead (see module docstring)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE.get(args[0].dtype, func(*args))
        if func is torch.Tensor.cpu:
            return args[0].clone()  # a device-to-host copy (see _to_host)
        if func is torch.Tensor.to and _to_host(args, kwargs):
            kwargs["copy"] = True
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.backward:
            return _autograd_with_mode(torch.autograd.backward, args[0], *args[1:], **kwargs)
        if func in (torch.autograd.backward, torch.autograd.grad):
            return _autograd_with_mode(func, *args, **kwargs)
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_INSTALLED: dict = {}


def install(local_rank: int) -> None:
    """Answer the CUDA calls of NeMo-RL's Megatron worker on CPU in this process (idempotent)."""
    if _INSTALLED:
        return
    cuda = torch.cuda
    stream = _Stream()
    # a distinct function per name: torch._dynamo's trace rules refuse one object under two names
    zero = lambda: lambda *a, **k: 0  # noqa: E731
    nothing = lambda: lambda *a, **k: None  # noqa: E731
    gen = torch.default_generator
    answers = dict(
        current_device=lambda: local_rank, set_device=nothing(),
        device_count=lambda: int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))),
        synchronize=nothing(), empty_cache=nothing(), ipc_collect=nothing(), reset_peak_memory_stats=nothing(),
        memory_allocated=zero(), max_memory_allocated=zero(), memory_reserved=zero(), max_memory_reserved=zero(),
        memory_stats=lambda *a, **k: {}, mem_get_info=lambda *a, **k: (80 << 30, 80 << 30),
        get_device_name=lambda *a, **k: "CPU stand-in", get_device_capability=lambda *a, **k: (9, 0),
        is_initialized=lambda: True, Stream=_Stream, Event=_Event, current_stream=lambda *a, **k: stream,
        default_stream=lambda *a, **k: stream, stream=lambda *a, **k: contextlib.nullcontext(),
        set_stream=nothing(), is_current_stream_capturing=lambda: False,
        get_rng_state=lambda *a, **k: gen.get_state(), set_rng_state=lambda s, *a, **k: gen.set_state(s),
        manual_seed=lambda seed: gen.manual_seed(int(seed)), manual_seed_all=lambda seed: gen.manual_seed(int(seed)),
        seed=nothing(), seed_all=nothing(),
    )
    for name, value in answers.items():
        _INSTALLED[("torch.cuda", name)] = getattr(cuda, name, None)
        setattr(cuda, name, value)
    cuda.random.get_rng_state = answers["get_rng_state"]
    cuda.random.set_rng_state = answers["set_rng_state"]
    cuda.nvtx.range_push = zero()
    cuda.nvtx.range_pop = zero()
    cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx.mark = nothing()

    # Megatron's tracker swaps the CUDA generator state in and out around model-parallel regions
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: gen.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: gen.set_state(state)

    # The MoE all-to-all dispatcher moves its split sizes to the host (numpy) only if they are on
    # the device (``is_cuda``); on CPU they would stay tensors, which ``all_to_all_single`` rejects.
    from megatron.core.transformer.moe import token_dispatcher

    def device_to_host(tensor, as_numpy=False, record_stream=False):
        if not torch.is_tensor(tensor):
            return tensor
        host = tensor.clone()
        return host.numpy() if as_numpy else host

    token_dispatcher.maybe_move_tensor_to_cpu = device_to_host

    dist = torch.distributed
    init_pg, new_group = dist.init_process_group, dist.new_group

    @functools.wraps(init_pg)
    def init_process_group(backend=None, *a, **k):
        return init_pg("gloo", *a, **k)

    @functools.wraps(new_group)
    def new_group_gloo(*a, **k):
        if k.get("backend") in (None, "nccl"):
            k["backend"] = "gloo"
        return new_group(*a, **k)

    dist.init_process_group = init_process_group
    dist.new_group = new_group_gloo

    import ray

    ray.get_gpu_ids = lambda: [local_rank]

    from megatron.bridge.training import initialize as binit

    binit.compile_helpers = nothing()
    from megatron.bridge.models import gpt_provider

    from megatron_cpu.attention import cpu_layer_spec

    gpt_provider.transformer_engine_layer_spec = cpu_layer_spec  # see megatron_cpu.attention
    # The HF -> Megatron import builds the provider a model bridge configures (Qwen3-MoE asks for
    # TE's fused permutation) and applies only the parallel sizes of NeMo-RL's megatron_cfg, so
    # its moe_permute_fusion: false never reaches the import; the training provider gets it.
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    real_provider = AutoBridge.to_megatron_provider

    @functools.wraps(real_provider)
    def to_megatron_provider(self, *a, **k):
        provider = real_provider(self, *a, **k)
        provider.moe_permute_fusion = False
        return provider

    AutoBridge.to_megatron_provider = to_megatron_provider
    real_init = binit.initialize_megatron
    import nemo_rl.models.megatron.setup as nsetup

    nsetup.initialize_megatron = functools.partial(real_init, allow_no_cuda=True)

    mode = CudaIsCpu()
    mode.__enter__()  # for the life of the process (the worker is built and called on this thread)
    _INSTALLED["mode"] = mode
