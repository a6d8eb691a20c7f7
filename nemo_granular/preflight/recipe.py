"""Where a config departs from the NeMo-RL example it inherits.

The ``defaults:`` chain of a shipped config ends in one of NeMo-RL's own example configs
(``nemo_rl/upstream/<file>`` → ``$NEMO_RL_SRC/examples/configs/<file>``, resolved as
:mod:`nemo_granular.nemo_rl.configs` does). :func:`recipe_diff` loads that file with NeMo-RL's
``load_config`` and lists every resolved key whose value differs, or that only our config has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RecipeDiff", "reference_recipe", "recipe_diff", "flatten"]


@dataclass(frozen=True)
class RecipeDiff:
    reference: str  # NeMo-RL's examples/configs/<file>
    changed: list[tuple[str, Any, Any]]  # (key, NeMo-RL's value, ours)
    added: list[tuple[str, Any]]  # (key, ours): keys NeMo-RL's example does not have


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": v}`` for nested mappings; empty mappings and lists are leaves."""
    if not isinstance(d, dict) or not d:
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def reference_recipe(path: str | os.PathLike) -> Path | None:
    """NeMo-RL's example config at the end of ``path``'s ``defaults:`` chain (first parent first)."""
    from omegaconf import OmegaConf

    from ..nemo_rl.configs import _defaults, _upstream_rest, nemo_rl_configs_dir

    current = Path(path).expanduser().absolute()
    for _ in range(32):  # a chain longer than this loops
        entries = _defaults(OmegaConf.load(current)) or []
        if not entries:
            return None
        entry = entries[0]
        parent = Path(entry) if entry.startswith("/") else current.parent / entry
        rest = _upstream_rest(entry)
        if rest is not None and not parent.is_file():
            base = nemo_rl_configs_dir()
            return (base / rest) if base is not None else None
        if not parent.is_file():
            return None
        nemo_configs = nemo_rl_configs_dir()
        if nemo_configs is not None and parent.resolve().is_relative_to(nemo_configs.resolve()):
            return parent.resolve()
        current = parent
    return None


def recipe_diff(path: str | os.PathLike, resolved: dict) -> RecipeDiff | None:
    """The keys of ``resolved`` (our config after overrides) that differ from NeMo-RL's example."""
    from omegaconf import OmegaConf

    from ..nemo_rl import compat

    load_config, register_omegaconf_resolvers = compat.get("load_config"), compat.get("register_omegaconf_resolvers")

    ref = reference_recipe(path)
    if ref is None or not ref.is_file():
        return None
    register_omegaconf_resolvers()
    theirs = flatten(OmegaConf.to_container(load_config(str(ref)), resolve=True))
    ours = flatten(resolved)
    changed = [(k, theirs[k], v) for k, v in ours.items() if k in theirs and theirs[k] != v]
    added = [(k, v) for k, v in ours.items() if k not in theirs and not any(k.startswith(t + ".") for t in theirs)]
    text = ref.as_posix()
    shown = "examples/configs/" + text.split("/examples/configs/", 1)[1] if "/examples/configs/" in text else text
    return RecipeDiff(shown, sorted(changed), sorted(added))
