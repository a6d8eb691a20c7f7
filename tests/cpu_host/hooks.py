"""Lazy installation of the CPU stand-ins: each patch runs right after its module is first imported.

Nothing here imports torch, Ray or NeMo-RL (an eager ``sitecustomize`` that imported NeMo-RL made
Ray's node start time out): a finder on ``sys.meta_path`` wraps the loader of the named modules
only, so the patch runs when (and if) the process imports that module.
"""

from __future__ import annotations

import importlib.abc
import sys


def _patch_registry(module) -> None:
    """The DTensor workers' actor environments are hard-coded to Automodel's uv venv
    (``PY_EXECUTABLES.AUTOMODEL``), which ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1`` does not cover:
    point them at the running interpreter like the entries the switch does cover."""
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES

    for fqn, env in list(module.ACTOR_ENVIRONMENT_REGISTRY.items()):
        if env in (PY_EXECUTABLES.AUTOMODEL, PY_EXECUTABLES.FSDP, PY_EXECUTABLES.VLLM, PY_EXECUTABLES.BASE):
            module.ACTOR_ENVIRONMENT_REGISTRY[fqn] = PY_EXECUTABLES.SYSTEM


def _standins():
    from cpu_host import standins

    return standins


def _after_import():
    return {
        "torch": lambda m: _standins().patch_torch(m),
        "torch.distributed.device_mesh": lambda m: _standins().patch_device_mesh(m),
        "nemo_rl.distributed.ray_actor_environment_registry": _patch_registry,
    }


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.after(module)


class PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, hooks):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        after = self.hooks.get(name)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, after)
                return spec
        return None


def install() -> None:
    if any(isinstance(f, PostImportFinder) for f in sys.meta_path):
        return
    hooks = _after_import()
    already = [name for name in hooks if name in sys.modules]
    sys.meta_path.insert(0, PostImportFinder(hooks))
    for name in already:            # imported before the hook existed (e.g. by pytest itself)
        hooks[name](sys.modules[name])
