"""Our advantage estimators inside NeMo-RL's training loops: the ONE place that rebinds NeMo-RL.

NeMo-RL picks the estimator in a hard-coded switch, ``_create_advantage_estimator(master_config)``
(``nemo_rl/algorithms/grpo.py``; ``grpo_sync.py`` imports its own binding; ``ppo.py`` has its
own). ``grpo_train`` looks the name up in its module globals at call time, so rebinding the
module attribute is enough — no NeMo-RL source is modified.

- :func:`patch_estimator_factory` — generic: rebinds ``module._create_advantage_estimator`` to a
  wrapper that builds OUR estimator for the names in ``names_to_factory`` and delegates every
  other name to the saved original. Returns a :class:`PatchHandle` (``.restore()``).
  The SPPO entry script uses it for ``nemo_rl.algorithms.ppo`` with ``config_section="ppo"``.
- :func:`install` / :func:`uninstall` / :func:`installed` (context manager) — the GRPO modules
  (``nemo_rl.algorithms.grpo`` and ``nemo_rl.algorithms.grpo_sync``) with the names
  ``grpo`` and ``espo`` (→ :func:`nemo_granular.advantages.build_advantage_estimator`) and
  ``sppo`` (refused with a message: SPPO needs the PPO loop and a critic).

ESPO's flag: NeMo-RL passes ``repeated_batch`` (the rollout batch) to ``compute_advantage``; our
:class:`~nemo_granular.advantages.ESPOEstimator` reads ``repeated_batch["verification_failed"]``.
The estimator built here fills that key, when absent, from the observations our ESPO math
environment writes into ``message_log`` (see :mod:`nemo_granular.nemo_rl.environments`).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..advantages import build_advantage_estimator
from .environments import attach_verification_flags

__all__ = [
    "FACTORY_ATTR",
    "GRPO_MODULES",
    "PatchHandle",
    "config_get",
    "estimator_name",
    "build_grpo_estimator",
    "GRPO_FACTORIES",
    "patch_estimator_factory",
    "install",
    "uninstall",
    "installed",
]

FACTORY_ATTR = "_create_advantage_estimator"
GRPO_MODULES = ("nemo_rl.algorithms.grpo", "nemo_rl.algorithms.grpo_sync")


def config_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` or ``cfg[key]`` (NeMo-RL mixes pydantic models and TypedDicts)."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    if hasattr(cfg, key):
        return getattr(cfg, key)
    extra = getattr(cfg, "model_extra", None) or {}
    return extra.get(key, default)


def estimator_name(master_config: Any, section: str = "grpo") -> str:
    """``master_config.<section>.adv_estimator.name`` (NeMo-RL's default name is ``grpo``; without the
    section, what the NeMo-RL version does: :func:`nemo_granular.nemo_rl.compat.estimator_config`)."""
    from .compat import estimator_config

    return str(estimator_config(master_config, section).get("name", "grpo"))


class _ESPOFromRollout:
    """ESPO estimator as the GRPO loop calls it: derives the verification flag from the rollout."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0  # compute_advantage calls: lets the run_grpo logger log last_metrics once per step

    @property
    def last_metrics(self) -> dict:
        return self.inner.last_metrics

    def compute_advantage(self, prompt_ids, rewards, mask, repeated_batch=None, **kwargs):
        if repeated_batch is not None and "verification_failed" not in kwargs:
            attach_verification_flags(repeated_batch, self.inner.cfg.verification_failed_key)
        out = self.inner.compute_advantage(prompt_ids, rewards, mask, repeated_batch=repeated_batch, **kwargs)
        self.calls += 1
        return out


def build_grpo_estimator(master_config: Any, section: str = "grpo"):
    """Our estimator for ``master_config.<section>.adv_estimator`` (grpo | espo)."""
    from .compat import estimator_config

    est_cfg = estimator_config(master_config, section)  # NeMo-RL's KeyError / fallbacks, per version
    est = build_advantage_estimator(est_cfg, config_get(master_config, "loss_fn"))
    name = estimator_name(master_config, section)
    print(f"  ✓ Using nemo_granular '{name}' advantage estimator", flush=True)
    built = _ESPOFromRollout(est) if name == "espo" else est
    LAST_BUILT[:] = [built]
    return built


# the estimator the last ``_create_advantage_estimator`` call built (run_grpo logs its last_metrics)
LAST_BUILT: list = []


def _refuse_sppo(master_config: Any):
    raise ValueError(
        "grpo.adv_estimator.name: 'sppo' needs a critic and the PPO loop; "
        "launch python -m nemo_granular.run_sppo instead of run_grpo"
    )


GRPO_FACTORIES: dict[str, Callable[[Any], Any]] = {
    "grpo": build_grpo_estimator,
    "espo": build_grpo_estimator,
    "sppo": _refuse_sppo,
}


def _refuse_espo_in_grpo_sync(master_config: Any):
    raise ValueError(
        "grpo.adv_estimator.name: 'espo' cannot run in nemo_rl.algorithms.grpo_sync: its data-plane "
        "loop gives the estimator no message_log, so ESPO's verification flags never arrive; use "
        "grpo_train / async_grpo_train (python -m nemo_granular.run_grpo)"
    )


# per-module replacements of GRPO_FACTORIES entries: grpo_sync builds `repeated_batch` for the
# estimator from total_reward/baseline/std only (nemo_rl/algorithms/grpo_sync.py at 7ea279ab)
MODULE_FACTORIES: dict[str, dict[str, Callable[[Any], Any]]] = {
    "nemo_rl.algorithms.grpo_sync": {"espo": _refuse_espo_in_grpo_sync},
}


@dataclass
class PatchHandle:
    """One rebinding: ``module.<attr>`` was ``original`` and is now ``wrapper``."""

    module: ModuleType
    attr: str
    original: Callable
    wrapper: Callable

    def restore(self) -> None:
        """Put the original back (only if our wrapper is still the bound one)."""
        if getattr(self.module, self.attr, None) is self.wrapper:
            setattr(self.module, self.attr, self.original)


def patch_estimator_factory(
    module: str | ModuleType,
    names_to_factory: Mapping[str, Callable[[Any], Any]],
    *,
    attr: str = FACTORY_ATTR,
    config_section: str = "grpo",
) -> PatchHandle:
    """Rebind ``module.<attr>(master_config)`` to build ``names_to_factory[name](master_config)``
    for our names and call the saved original for every other name (same arguments)."""
    mod = importlib.import_module(module) if isinstance(module, str) else module
    if not hasattr(mod, attr):
        raise AttributeError(
            f"{mod.__name__}.{attr} does not exist (NeMo-RL version mismatch? written against 7ea279ab)"
        )
    original = getattr(mod, attr)
    table = dict(names_to_factory)

    @functools.wraps(original)
    def wrapper(master_config, *args, **kwargs):
        name = estimator_name(master_config, config_section)
        factory = table.get(name)
        if factory is None:
            return original(master_config, *args, **kwargs)
        return factory(master_config)

    wrapper.__nemo_granular_original__ = original  # type: ignore[attr-defined]
    setattr(mod, attr, wrapper)
    return PatchHandle(mod, attr, original, wrapper)


_INSTALLED: list[PatchHandle] = []


def install(
    modules: Iterable[str] = GRPO_MODULES,
    names: Iterable[str] | None = None,
    *,
    required: Iterable[str] = ("nemo_rl.algorithms.grpo",),
) -> list[PatchHandle]:
    """Rebind the GRPO estimator factories (idempotent). A module outside ``required`` that
    fails to import (e.g. ``grpo_sync`` without the data-plane extras) is skipped with a warning."""
    if _INSTALLED:
        return list(_INSTALLED)
    table = GRPO_FACTORIES if names is None else {n: GRPO_FACTORIES[n] for n in names}
    required = set(required)
    try:
        for name in modules:
            try:
                mod = importlib.import_module(name)
            except ImportError as err:
                if name in required:
                    raise
                warnings.warn(f"nemo_granular: {name} not patched ({err})", stacklevel=2)
                continue
            overrides = {k: f for k, f in MODULE_FACTORIES.get(name, {}).items() if k in table}
            _INSTALLED.append(patch_estimator_factory(mod, {**table, **overrides}))
    except BaseException:
        uninstall()
        raise
    return list(_INSTALLED)


def uninstall() -> None:
    """Undo :func:`install` (reverse order)."""
    while _INSTALLED:
        _INSTALLED.pop().restore()


@contextmanager
def installed(modules: Iterable[str] = GRPO_MODULES, names: Iterable[str] | None = None, **kwargs):
    """``with installed(): grpo_train(...)`` — install for the duration of the block."""
    already = bool(_INSTALLED)
    handles = install(modules, names, **kwargs)
    try:
        yield handles
    finally:
        if not already:
            uninstall()
