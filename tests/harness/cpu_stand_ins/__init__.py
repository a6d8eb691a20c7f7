"""The CPU stand-ins shared by the three harnesses that run NeMo-RL / Megatron / Automodel code
without a GPU: ``tests/harness/cpu_host`` (NeMo-RL's loops in Ray actors), ``tests/harness/megatron_cpu`` (the
Megatron policy worker in spawned gloo worlds) and ``tests/harness/export_cpu`` (checkpoint writers).

Test code only; NeMo-RL, Megatron-LM, Megatron-Bridge, Automodel and torch are never edited.
Each stand-in answers a GPU-only call and nothing else; docs/nemo-rl.md §7 lists them with why.

* :mod:`.torch_cuda` — CUDA devices → CPU (a torch function mode), ``torch.cuda`` answered, CUDA
  RNG = CPU generator, autocast cuda → cpu, NCCL → gloo, CUDA device meshes → CPU.
* :mod:`.megatron` — Transformer Engine absent (import order + placeholder), Megatron's RNG
  tracker, Bridge's layer spec → local spec with :mod:`.attention`, MoE split sizes to the host,
  Bridge's CUDA checks and C++ helper build.
* :mod:`.lazy` — each patch runs when its module is first imported.

:func:`install` puts all of them in place in this process; each harness adds its own few.
"""

from __future__ import annotations


def install(after: dict | None = None, before: dict | None = None) -> None:
    """Every shared stand-in (lazily: torch, Megatron and NeMo-RL modules are patched when first
    imported), plus a harness's own ``after`` / ``before`` hooks (``module name → patch``)."""
    from . import lazy, megatron

    lazy.install(
        {"torch": _torch, "torch.distributed.device_mesh": _device_mesh, **megatron.AFTER_IMPORT},
        megatron.BEFORE_IMPORT,
    )
    if after or before:
        lazy.install(after or {}, before)


def _torch(torch) -> None:
    from . import torch_cuda

    torch_cuda.install()


def _device_mesh(module) -> None:
    from . import torch_cuda

    torch_cuda.cpu_device_mesh(module)
