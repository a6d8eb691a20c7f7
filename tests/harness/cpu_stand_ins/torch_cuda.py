"""torch on a machine without GPUs, answering what NeMo-RL / Megatron / Automodel ask of CUDA.

Each stand-in answers a GPU-only call and nothing else (docs/nemo-rl.md §7 lists them with why):

* :class:`CudaIsCpu`, a ``TorchFunctionMode`` entered for the life of the process: every torch call
  whose ``device=`` names CUDA (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, an int ordinal)
  runs on CPU, and so do ``Tensor.to(device)`` and ``Module.to(device)``; ``torch.device(N)`` of
  an int ordinal (``with torch.device(torch.cuda.current_device())``, Megatron's YaRN rotary
  embedding) is the CPU device; ``Tensor.cuda`` /
  ``pin_memory`` / ``record_stream`` do nothing, ``is_pinned`` is False; ``Tensor.type()`` answers
  the CUDA type name a GPU gives (Megatron's optimizers dispatch on ``"torch.cuda.FloatTensor"``).
  Moves to the host (``.cpu()``, ``.to("cpu")``) always copy, as from a GPU (see :func:`_to_host`).
* ``torch.cuda``: ``set_device`` is remembered and ``current_device`` answers it (NeMo-RL's
  Megatron worker asserts they agree); device count, name, capability, streams, events, NVTX,
  memory statistics answer like an idle device; the CUDA RNG is the CPU generator (the tensors it
  seeds live on CPU). ``is_available`` stays False.
* ``torch.autocast("cuda", ...)`` is ``torch.autocast("cpu", ...)``: the same mixed precision on the
  device the tensors are on.
* NCCL → gloo in ``init_process_group`` / ``new_group``; ``init_device_mesh("cuda")`` /
  ``DeviceMesh("cuda")`` → a CPU mesh.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch.overrides import TorchFunctionMode


def is_cuda(device) -> bool:
    """``device`` names a CUDA device (an int is a CUDA ordinal, torch's own rule)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def cpu(device):
    """``device`` with CUDA mapped to the CPU."""
    return torch.device("cpu") if is_cuda(device) else device


_CUDA_TYPE = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _to_host(args, kwargs) -> bool:
    """``t.to("cpu")`` / ``t.to(device="cpu")``: on a GPU a copy into host memory. Here the tensor is
    already on CPU, so torch would return the SAME tensor, and Megatron's offload (host copy, then
    ``storage().resize_(0)`` of the device buffer, ``param_and_grad_buffer.py`` ``offload_to_cpu``)
    would free the only copy of the weights. So moves to the host always copy."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return (isinstance(target, str) and target == "cpu") or (isinstance(target, torch.device) and target.type == "cpu")


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
        if func is torch.device and len(args) == 1 and not kwargs and is_cuda(args[0]) and isinstance(args[0], int):
            return torch.device("cpu")  # an ordinal means the accelerator, which torch refuses without one
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
            kwargs["device"] = cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        if func is torch._C._nn._parse_to:  # Module.to(device, ...): its arguments, parsed
            args = tuple(cpu(a) for a in args)
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.backward:  # Tensor.backward(gradient=) is autograd.backward(grad_tensors=)
            if "gradient" in kwargs:
                kwargs["grad_tensors"] = kwargs.pop("gradient")
            return _autograd_with_mode(torch.autograd.backward, args[0], *args[1:], **kwargs)
        if func in (torch.autograd.backward, torch.autograd.grad):
            return _autograd_with_mode(func, *args, **kwargs)
        return func(*args, **kwargs)


class _Event:
    """``torch.cuda.Event`` on CPU: everything is already synchronous."""

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


class _Stream(_Event):
    """``torch.cuda.Stream`` on CPU (also a context manager, as ``torch.cuda.stream(s)`` is)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event or _Event()


def _host_memory(*_a, **_k) -> tuple[int, int]:
    """(free, total) bytes: the host's memory stands in for the device's."""
    page = os.sysconf("SC_PAGE_SIZE")
    return int(page * os.sysconf("SC_AVPHYS_PAGES")), int(page * os.sysconf("SC_PHYS_PAGES"))


def _device_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible:
        return len(visible.split(","))
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


_STATE: dict = {}


def answer_torch_cuda() -> None:
    """``torch.cuda`` queries, streams, events, NVTX, memory statistics and the CUDA RNG."""
    cuda = torch.cuda
    _STATE["device"] = 0
    stream = _Stream()
    # a distinct function per name: torch._dynamo's trace rules refuse one object under two names
    zero = lambda: lambda *a, **k: 0  # noqa: E731
    nothing = lambda: lambda *a, **k: None  # noqa: E731
    gen = torch.default_generator

    def set_device(device):
        if isinstance(device, str):
            device = torch.device(device)
        _STATE["device"] = (device.index or 0) if isinstance(device, torch.device) else int(device)

    def get_device_properties(*_a, **_k):
        # what torch's CPU build raises here (its _lazy_init, skipped once is_initialized answers
        # True); callers such as inductor's cache key catch it
        raise AssertionError("Torch not compiled with CUDA enabled")

    answers = dict(
        current_device=lambda: _STATE["device"],
        set_device=set_device,
        device_count=_device_count,
        synchronize=nothing(),
        empty_cache=nothing(),
        ipc_collect=nothing(),
        reset_peak_memory_stats=nothing(),
        reset_max_memory_allocated=nothing(),
        reset_accumulated_memory_stats=nothing(),
        memory_allocated=zero(),
        max_memory_allocated=zero(),
        memory_reserved=zero(),
        max_memory_reserved=zero(),
        memory_stats=lambda *a, **k: {},
        mem_get_info=_host_memory,
        get_device_name=lambda *a, **k: "CPU (stand-in for a CUDA device)",
        get_device_capability=lambda *a, **k: (9, 0),
        is_initialized=lambda: True,
        get_device_properties=get_device_properties,
        Stream=_Stream,
        Event=_Event,
        current_stream=lambda *a, **k: stream,
        default_stream=lambda *a, **k: stream,
        stream=lambda *a, **k: contextlib.nullcontext(),
        device=lambda *a, **k: contextlib.nullcontext(),
        set_stream=nothing(),
        is_current_stream_capturing=lambda: False,
        get_rng_state=lambda *a, **k: gen.get_state(),
        set_rng_state=lambda s, *a, **k: gen.set_state(s),
        get_rng_state_all=lambda: [gen.get_state()],
        set_rng_state_all=lambda states: gen.set_state(states[0]),
        manual_seed=lambda seed: gen.manual_seed(int(seed)),
        manual_seed_all=lambda seed: gen.manual_seed(int(seed)),
        seed=nothing(),
        seed_all=nothing(),
    )
    for name, value in answers.items():
        setattr(cuda, name, value)
    cuda.random.get_rng_state = answers["get_rng_state"]
    cuda.random.set_rng_state = answers["set_rng_state"]
    nvtx = cuda.nvtx
    nvtx.range_push = zero()
    nvtx.range_pop = zero()
    nvtx.range = lambda *a, **k: contextlib.nullcontext()
    nvtx.mark = nothing()


def autocast_cuda_is_cpu() -> None:
    """``torch.autocast("cuda", dtype)`` → ``torch.autocast("cpu", dtype)``: the workers keep GPU mixed
    precision (FSDP2 casts parameters to bf16; without autocast an fp32 activation meets a bf16
    weight and the forward stops)."""
    ac = torch.amp.autocast_mode.autocast
    real_init = ac.__init__

    @functools.wraps(real_init)
    def autocast_init(self, device_type, *args, **kwargs):
        real_init(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    ac.__init__ = autocast_init


def gloo_for_nccl() -> None:
    """``init_process_group`` / ``new_group`` with NCCL (or no backend, or ``"cuda:nccl,cpu:gloo"``) → gloo."""
    dist = torch.distributed
    real_init, real_new_group = dist.init_process_group, dist.new_group

    def gloo(backend):
        return "gloo" if backend is None or "nccl" in str(backend) else backend

    @functools.wraps(real_init)
    def init_process_group(*args, **kwargs):
        if args:
            args = (gloo(args[0]),) + args[1:]
        else:
            kwargs["backend"] = gloo(kwargs.get("backend"))
        kwargs.pop("device_id", None)  # binds the group to a CUDA device
        return real_init(*args, **kwargs)

    @functools.wraps(real_new_group)
    def new_group(*args, **kwargs):
        kwargs["backend"] = gloo(kwargs.get("backend"))
        return real_new_group(*args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group


def cpu_device_mesh(mesh_module) -> None:
    """``init_device_mesh("cuda", ...)`` / ``DeviceMesh("cuda", ...)`` → a CPU (gloo) mesh."""
    real_init = mesh_module.init_device_mesh

    @functools.wraps(real_init)
    def init_device_mesh(device_type, *args, **kwargs):
        return real_init("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    mesh_module.init_device_mesh = init_device_mesh
    cls = mesh_module.DeviceMesh
    real = cls.__init__

    @functools.wraps(real)
    def __init__(self, device_type, *args, **kwargs):
        real(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    cls.__init__ = __init__


def install(torch_module=None) -> None:
    """All of the above in this process (idempotent); the mode on the calling thread, for the
    life of the process (NeMo-RL's workers are built and called on the thread that imports torch:
    a Ray actor's main thread, a spawned rank's main thread)."""
    if getattr(torch, "_cpu_stand_ins", False):
        return
    torch._cpu_stand_ins = True
    answer_torch_cuda()
    autocast_cuda_is_cpu()
    gloo_for_nccl()
    mode = CudaIsCpu()
    mode.__enter__()
    _STATE["mode"] = mode


def mode_on_this_thread() -> None:
    """Enter :class:`CudaIsCpu` on the calling thread if it is not active there (torch keeps its
    function modes per thread; Ray runs actor methods on a thread of its own, not the one that
    imported torch). A no-op before :func:`install`."""
    if "mode" not in _STATE:
        return
    from torch.overrides import _get_current_function_mode_stack

    if not any(isinstance(m, CudaIsCpu) for m in _get_current_function_mode_stack()):
        CudaIsCpu().__enter__()
