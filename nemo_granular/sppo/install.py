"""Install the ``sppo`` advantage estimator into NeMo-RL's PPO loop (reversibly).

NeMo-RL has no estimator registry: ``ppo_train`` / ``async_ppo_train`` call the module
global ``nemo_rl.algorithms.ppo._create_advantage_estimator(master_config)`` (``ppo.py:1269``,
``:2202``), a hard-coded switch over ``gae`` / ``raw_reward``.
The project's generic :func:`nemo_granular.nemo_rl.estimators.patch_estimator_factory` rebinds
that attribute to a wrapper that builds :class:`nemo_granular.advantages.SPPOEstimator` for
``ppo.adv_estimator.name == "sppo"`` and delegates every other name to the saved original.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from ..nemo_rl.estimators import config_get, patch_estimator_factory

__all__ = ["sppo_factory", "install_sppo_estimator", "sppo_estimator_installed"]


def sppo_factory(master_config: Any):
    """``SPPOEstimator(ppo.adv_estimator, loss_fn)``: A = (R − σ(v))·mask, returns = R·mask."""
    from ..advantages import SPPOEstimator
    from ..nemo_rl.compat import estimator_config

    est = SPPOEstimator(estimator_config(master_config, "ppo"), config_get(master_config, "loss_fn"))
    print("  ✓ Using SPPO advantage estimator (A = R − σ(V(s_p)), returns = R)", flush=True)
    return est


def install_sppo_estimator(ppo_module: ModuleType | None = None) -> Callable[[], None]:
    """Install ``sppo`` into ``nemo_rl.algorithms.ppo`` (or ``ppo_module``); returns ``restore()``
    (which leaves the attribute alone if someone else has rebound it since)."""
    if ppo_module is None:
        from ..nemo_rl.compat import module  # lazy: NeMo-RL only

        ppo_module = module("ppo")
    handle = patch_estimator_factory(ppo_module, {"sppo": sppo_factory}, config_section="ppo")
    return handle.restore


@contextlib.contextmanager
def sppo_estimator_installed(ppo_module: ModuleType | None = None) -> Iterator[None]:
    """Context manager form of :func:`install_sppo_estimator`."""
    restore = install_sppo_estimator(ppo_module)
    try:
        yield
    finally:
        restore()
