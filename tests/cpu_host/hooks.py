"""The stand-ins of every process of a CPU loop run (the test driver and each Ray worker), installed
lazily by ``site/sitecustomize.py``: the shared ones of :mod:`cpu_stand_ins` plus this harness's own.

This harness's own (docs/nemo-rl.md §7):

* the DTensor workers' actor environments, hard-coded to Automodel's uv venv, point at the running
  interpreter (:func:`_patch_registry`);
* NVML's device UUID, which names a worker's ZMQ refit socket (:func:`_patch_nvml`);
* every actor method runs with the CUDA → CPU torch function mode on its thread
  (:func:`_patch_ray_actor_methods`).

Nothing here imports torch, Ray or NeMo-RL (an eager ``sitecustomize`` that imported NeMo-RL made
Ray's node start time out): each patch runs right after its module is first imported.
"""

from __future__ import annotations

import sys


def _patch_registry(module) -> None:
    """The DTensor workers' actor environments are hard-coded to Automodel's uv venv
    (``PY_EXECUTABLES.AUTOMODEL``), which ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1`` does not cover:
    point them at the running interpreter like the entries the switch does cover."""
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES

    for fqn, env in list(module.ACTOR_ENVIRONMENT_REGISTRY.items()):
        if env in (PY_EXECUTABLES.AUTOMODEL, PY_EXECUTABLES.FSDP, PY_EXECUTABLES.VLLM, PY_EXECUTABLES.BASE):
            module.ACTOR_ENVIRONMENT_REGISTRY[fqn] = PY_EXECUTABLES.SYSTEM


def _patch_nvml(nvml) -> None:
    """``get_device_uuid`` (NVML, no library without a GPU) names the socket a policy worker streams
    its refit through (``ipc:///tmp/<uuid>.sock``). One "device" per index and per Ray head: the
    head's private HOME is in the name, so test runs side by side never share a socket."""
    import os
    import zlib

    head = zlib.crc32(os.environ.get("HOME", "").encode())
    nvml.get_device_uuid = lambda device_idx: f"GPU-cpu-{head:08x}-{int(device_idx)}"


def _patch_ray_actor_methods(function_manager) -> None:
    """torch keeps function modes per thread and Ray runs actor methods on a thread of its own, so
    the mode entered where torch was imported does not reach them: each method enters it on its
    thread first (once per thread)."""
    cls = function_manager.FunctionActorManager
    real = cls._make_actor_method_executor

    def make_executor(self, method_name, method):
        inner = real(self, method_name, method)

        def actor_method_executor(__ray_actor, *args, **kwargs):
            stand_ins = sys.modules.get("cpu_stand_ins.torch_cuda")   # loaded once torch is
            if stand_ins is not None:
                stand_ins.mode_on_this_thread()
            return inner(__ray_actor, *args, **kwargs)

        actor_method_executor.name, actor_method_executor.method = inner.name, inner.method
        return actor_method_executor

    cls._make_actor_method_executor = make_executor


AFTER_IMPORT = {"ray._private.function_manager": _patch_ray_actor_methods,
                "nemo_rl.distributed.ray_actor_environment_registry": _patch_registry,
                "nemo_rl.utils.nvml": _patch_nvml}


def install() -> None:
    import cpu_stand_ins

    cpu_stand_ins.install(AFTER_IMPORT)
