"""``nemo-granular preflight``: offline checks of a NeMo-RL config before a cluster allocation.

Loads the config as ``run_grpo`` / ``run_sppo`` do, then runs NeMo-RL's own set-up and worker-init
checks (called where NeMo-RL has them as pure functions, re-stated with the NeMo-RL
``file:function`` they mirror where they sit inside GPU constructors), nemo-granular's refusals,
the step-1 batch checks and the worker-venv check, and prints the plan. Needs NeMo-RL importable,
like the drivers; imports nothing heavy until :func:`run_preflight` is called. See docs/preflight.md.
"""

from .findings import ERROR, WARNING, Finding

__all__ = ["Finding", "ERROR", "WARNING", "run_preflight"]


def run_preflight(*args, **kwargs):
    """:func:`nemo_granular.preflight.run.run_preflight` (imported on first call)."""
    from .run import run_preflight as _run

    return _run(*args, **kwargs)
