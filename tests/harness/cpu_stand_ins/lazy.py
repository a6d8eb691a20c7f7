"""Lazy installation: each patch runs right before or right after its module is first imported.

Nothing here imports torch, Ray or NeMo-RL (an eager ``sitecustomize`` that imported NeMo-RL made
Ray's node start time out): a finder on ``sys.meta_path`` wraps the loader of the named modules
only, so a patch runs when (and if) the process imports that module.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, after, applied):
        self.inner, self.after, self.applied = inner, after, applied

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for after in self.after:
            self.applied.add((module.__name__, id(after)))
            after(module)


class PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.before: dict[str, list[Callable[[], None]]] = {}
        self.after: dict[str, list[Callable]] = {}
        self.applied: set[tuple[str, int]] = set()  # (module, id(patch)) run on an imported module

    def find_spec(self, name, path, target=None):
        for before in self.before.pop(name, []):  # once, before the module's own import starts
            before()
        after = self.after.get(name)
        if not after:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, list(after), self.applied)
                return spec
        return None


def install(after: dict[str, Callable], before: dict[str, Callable[[], None]] | None = None) -> None:
    """Add the hooks (``module name → patch``) to this process's finder (created once). A module
    already imported gets its ``after`` patch now (its ``before`` is then too late and is dropped)."""
    finder = next((f for f in sys.meta_path if isinstance(f, PostImportFinder)), None)
    if finder is None:
        finder = PostImportFinder()
        sys.meta_path.insert(0, finder)
    for name, fn in (before or {}).items():
        waiting = finder.before.setdefault(name, [])
        if name not in sys.modules and fn not in waiting:
            waiting.append(fn)
    for name, fn in after.items():
        if name in sys.modules:
            if (name, id(fn)) not in finder.applied:
                finder.applied.add((name, id(fn)))
                fn(sys.modules[name])
        elif fn not in finder.after.setdefault(name, []):
            finder.after[name].append(fn)
