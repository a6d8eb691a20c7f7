"""The stand-ins of a Megatron-worker rank: the shared CPU stand-ins (:mod:`cpu_stand_ins`) plus
the one this world needs because it has no Ray.

NeMo-RL's ``MegatronPolicyWorkerImpl.__init__`` takes its GPU from ``ray.get_gpu_ids()[0]``; here
the worker class is constructed directly in spawned processes (``megatron_cpu.world``) with the
environment ``RayWorkerGroup`` gives its actors, so ``ray.get_gpu_ids`` answers ``[local rank]``
(calling the real one would start a local Ray). Everything else is shared (docs/nemo-rl.md §7).
"""

from __future__ import annotations

from cpu_stand_ins.megatron import te_takers  # noqa: F401  (the rank reports it)


def install(local_rank: int) -> None:
    """In a rank process, before NeMo-RL's worker module is imported (idempotent)."""
    import cpu_stand_ins
    from cpu_stand_ins.megatron import import_core_then_te_placeholder

    cpu_stand_ins.install()
    # eagerly: the rank inherits the test process's sys.path, placeholder included
    import_core_then_te_placeholder()
    import ray

    ray.get_gpu_ids = lambda: [local_rank]
