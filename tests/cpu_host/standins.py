"""CUDA-on-CPU stand-ins for running NeMo-RL's driver and DTensor-v2 workers on a machine without GPUs.

Test code only. Each stand-in answers one GPU-only call on CPU, and nothing else; the list with
the reason for each is in docs/nemo-rl.md §7 ("The loops on CPU"). They are installed LAZILY by
:mod:`.hooks` (from the ``sitecustomize`` in ``tests/cpu_host/site``) in every process of a run:
the driver and every Ray worker. Each ``patch_*`` function receives the freshly imported module.
"""

from __future__ import annotations

import contextlib
import functools
import os

CUDA_TYPES = ("cuda",)


def _is_gpu_device(d) -> bool:
    import torch

    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True                       # an int device is a CUDA ordinal (torch's own rule)
    if isinstance(d, str):
        return d.split(":")[0] in CUDA_TYPES
    if isinstance(d, torch.device):
        return d.type in CUDA_TYPES
    return False


def cpu_device(d):
    """``d`` with every CUDA device (``"cuda"``, ``"cuda:3"``, ``torch.device("cuda")``, an int) mapped to CPU."""
    return "cpu" if _is_gpu_device(d) else d


def _map_device_kwarg(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False      # page-locked host memory is a CUDA allocator feature
        return fn(*args, **kwargs)
    return wrapper


FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "randperm", "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
             "randn_like", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices")
TENSOR_NEW = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


def _to_args(args, kwargs):
    args = tuple(cpu_device(a) for a in args)
    if "device" in kwargs:
        kwargs["device"] = cpu_device(kwargs["device"])
    return args, kwargs


class _NullStream:
    """``torch.cuda.Stream`` / ``Event`` on CPU: everything is already synchronous."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        return None

    def wait_stream(self, *a, **k):
        return None

    def wait_event(self, *a, **k):
        return None

    def record_event(self, *a, **k):
        return _NullStream()

    def record(self, *a, **k):
        return None

    def wait(self, *a, **k):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _mem_get_info(*_a, **_k):
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(free), int(total)


def patch_torch(torch) -> None:
    """torch: device placement on CPU, ``torch.cuda`` queries answered, NVTX no-ops, autocast cuda → cpu,
    NCCL → gloo."""
    if getattr(torch, "_cpu_host_patched", False):
        return
    torch._cpu_host_patched = True
    # torch's `with torch.device(...)` context recognises factories by identity in an lru-cached set
    # built on first use; build it now, from the real functions. Built after the wrapping below, the
    # set held the wrappers, `with torch.device("meta")` stopped applying to torch.tensor, and
    # transformers' meta-device build left RoPE's inv_freq as uninitialised memory (plain
    # AutoModelForCausalLM.from_pretrained included): wrong log-probs, from the stand-in alone.
    import torch.utils._device

    torch.utils._device._device_constructors()
    for name in FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _map_device_kwarg(getattr(torch, name)))
    T = torch.Tensor
    for name in TENSOR_NEW:
        setattr(T, name, _map_device_kwarg(getattr(T, name)))

    tensor_to = T.to

    def to(self, *args, **kwargs):
        args, kwargs = _to_args(args, kwargs)
        return tensor_to(self, *args, **kwargs)

    T.to = to
    T.cuda = lambda self, *a, **k: self
    T.pin_memory = lambda self, *a, **k: self
    T.is_pinned = lambda self, *a, **k: False

    M = torch.nn.Module
    module_to, module_to_empty = M.to, M.to_empty

    def mto(self, *args, **kwargs):
        args, kwargs = _to_args(args, kwargs)
        return module_to(self, *args, **kwargs)

    def mto_empty(self, *, device=None, recurse=True):
        return module_to_empty(self, device=cpu_device(device), recurse=recurse)

    M.to, M.to_empty = mto, mto_empty
    M.cuda = lambda self, *a, **k: self

    cuda = torch.cuda
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats", "ipc_collect",
                 "reset_max_memory_allocated", "reset_accumulated_memory_stats"):
        setattr(cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.get_device_name = lambda *a, **k: "CPU (stand-in for a CUDA device)"
    cuda.mem_get_info = _mem_get_info
    cuda.memory_stats = lambda *a, **k: {}
    cuda.Stream = cuda.Event = _NullStream
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.device = lambda *a, **k: contextlib.nullcontext()
    nvtx = cuda.nvtx
    nvtx.range_push = lambda *a, **k: 0
    nvtx.range_pop = lambda *a, **k: 0
    nvtx.mark = lambda *a, **k: None
    nvtx.range = lambda *a, **k: contextlib.nullcontext()

    # autocast("cuda", bf16) → autocast("cpu", bf16): the worker's mixed precision as on a GPU (FSDP2
    # casts parameters to bf16; without autocast an fp32 activation meets a bf16 weight and stops)
    ac = torch.amp.autocast_mode.autocast
    ac_init = ac.__init__

    @functools.wraps(ac_init)
    def autocast_init(self, device_type, *args, **kwargs):
        ac_init(self, "cpu" if device_type in CUDA_TYPES else device_type, *args, **kwargs)

    ac.__init__ = autocast_init

    dist = torch.distributed
    init_pg, new_group = dist.init_process_group, dist.new_group

    def gloo(backend):
        return "gloo" if backend is None or "nccl" in str(backend) else backend

    def init_process_group(*args, **kwargs):
        if args:
            args = (gloo(args[0]),) + args[1:]
        else:
            kwargs["backend"] = gloo(kwargs.get("backend"))
        kwargs.pop("device_id", None)
        return init_pg(*args, **kwargs)

    def new_group_gloo(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = gloo(kwargs["backend"])
        return new_group(*args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group_gloo


def patch_device_mesh(mesh_module) -> None:
    """``init_device_mesh("cuda", ...)`` / ``DeviceMesh("cuda", ...)`` → a CPU (gloo) mesh."""
    init = mesh_module.init_device_mesh

    @functools.wraps(init)
    def init_device_mesh(device_type, *args, **kwargs):
        return init(cpu_device(device_type), *args, **kwargs)

    mesh_module.init_device_mesh = init_device_mesh
    cls = mesh_module.DeviceMesh
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self, device_type, *args, **kwargs):
        orig(self, cpu_device(device_type), *args, **kwargs)

    cls.__init__ = __init__
