"""Which Python exports a NeMo-RL Megatron checkpoint before it is evaluated.

Reading a Megatron checkpoint needs Megatron-Bridge, which NeMo-RL installs only in its ``mcore``
extra: the driver's venv of a bare ``uv sync`` (and the interpreter ``eval-checkpoints`` runs in)
usually lacks it, while the venv NeMo-RL starts its Megatron policy workers in has it. So the
export of a Megatron checkpoint runs, in this order, with:

1. ``--export-python CMD`` / ``NG_EXPORT_PYTHON`` — as given (e.g. a venv's ``bin/python``);
2. this interpreter, when ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1`` (NeMo-RL then runs every Megatron
   worker with it: ``ray_actor_environment_registry.MCORE_EXECUTABLE``) or when it imports
   ``megatron.bridge`` itself;
3. the Megatron worker venv NeMo-RL builds (``utils/venvs.py:create_local_venv``): ``bin/python``
   of ``$NEMO_RL_VENV_DIR/<worker class>`` (default ``<NeMo-RL checkout>/venvs``), first the stock
   ``MegatronPolicyWorker`` (NeMo-RL's image prefetches it under ``/opt/ray_venvs``), then the
   plugin's ``GranularMegatronPolicyWorker`` (what a training job of this package built).

Another interpreter gets nemo_granular from the directory this package was imported from,
appended to its ``sys.path`` (after its own packages, so its torch and Megatron win).
DTensor and embedded checkpoints need no Megatron: they are exported with this interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

STOCK_MEGATRON_WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
PLUGIN_MEGATRON_WORKER = "nemo_granular.nemo_rl.megatron_worker.GranularMegatronPolicyWorker"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding nemo_granular/


@dataclass(frozen=True)
class ExportPython:
    python: tuple[str, ...]  # the interpreter command (one path, or a launcher + arguments)
    why: str  # which rule chose it (printed with the plan)

    @property
    def is_this_interpreter(self) -> bool:
        return self.python == (sys.executable,)

    def export_argv(self, *args: str) -> list[str]:
        """``nemo-granular export ARGS`` run by this interpreter."""
        if self.is_this_interpreter:
            return [sys.executable, "-m", "nemo_granular", "export", *args]
        boot = (
            f"import sys; sys.path.append({str(PACKAGE_ROOT)!r}); from nemo_granular.cli import main; sys.exit(main())"
        )
        return [*self.python, "-c", boot, "export", *args]


def _truthy(value: str | None) -> bool:
    return str(value or "").strip().lower() in ("1", "true", "yes", "on")


def _has_bridge() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False


def venv_dir(nemo_rl_dir: Path | None, env: Mapping[str, str] = os.environ) -> Path | None:
    """NeMo-RL's ``NEMO_RL_VENV_DIR`` (its default: ``<checkout>/venvs``)."""
    if env.get("NEMO_RL_VENV_DIR"):
        return Path(os.path.normpath(env["NEMO_RL_VENV_DIR"]))
    return Path(nemo_rl_dir) / "venvs" if nemo_rl_dir else None


def worker_venv_pythons(nemo_rl_dir: Path | None, env: Mapping[str, str] = os.environ) -> list[Path]:
    base = venv_dir(nemo_rl_dir, env)
    return (
        []
        if base is None
        else [base / fqn / "bin" / "python" for fqn in (STOCK_MEGATRON_WORKER, PLUGIN_MEGATRON_WORKER)]
    )


def megatron_export_python(
    nemo_rl_dir: Path | None, *, explicit: str | None = None, env: Mapping[str, str] = os.environ
) -> ExportPython:
    """The interpreter that exports Megatron checkpoints (rules in the module docstring); a
    one-line ``ValueError`` naming every place looked at when none has Megatron-Bridge."""
    explicit = explicit or env.get("NG_EXPORT_PYTHON")
    if explicit:
        argv = tuple(shlex.split(explicit))
        if not argv:
            raise ValueError("--export-python: empty command")
        return ExportPython(argv, "--export-python / NG_EXPORT_PYTHON")
    if _truthy(env.get("NEMO_RL_PY_EXECUTABLES_SYSTEM")):
        return ExportPython((sys.executable,), "NEMO_RL_PY_EXECUTABLES_SYSTEM=1: NeMo-RL's Megatron workers use it")
    if _has_bridge():
        return ExportPython((sys.executable,), "this interpreter imports megatron.bridge")
    candidates = worker_venv_pythons(nemo_rl_dir, env)
    for python in candidates:
        if python.exists():
            return ExportPython((str(python),), f"NeMo-RL's Megatron worker venv {python.parents[1]}")
    looked = ", ".join([sys.executable] + [str(p) for p in candidates])
    raise ValueError(
        "exporting a Megatron checkpoint needs Megatron-Bridge (NeMo-RL's `mcore` extra) and no "
        f"interpreter has it: looked at {looked}; build NeMo-RL's Megatron worker venv "
        "(`nemo-granular preflight CONFIG --build-venvs`) or pass --export-python PYTHON"
    )


def bridge_probe_argv(export: ExportPython) -> list[str]:
    """A command that exits 0 when ``export``'s interpreter imports Megatron-Bridge and the
    exporter (the imports ``nemo-granular export`` makes for a Megatron checkpoint)."""
    code = (
        f"import sys; sys.path.append({str(PACKAGE_ROOT)!r}); "
        "import megatron.bridge, megatron.bridge.training.model_load_save, nemo_granular.export.megatron"
    )
    return [*export.python, "-c", code]
