"""Preflight checks of the runtime a job will have, not of the config: the container, the
interpreter, where NeMo-RL will find its worker venvs, and the time budget.

They read the launch story's environment (docs/slurm.md): ``CONTAINER``, ``MOUNTS``, ``VENV``,
``NEMO_RL_VENV_DIR`` as exported for ``submit_comparison.sh`` / ``launch.sh`` on the submit host;
inside a job step, what ``slurm/launch.sh`` writes into ``node_env.sh`` (``NG_CONTAINER``,
``NG_MOUNTS``, ``NG_VENV``) and ``driver.sh`` (``NG_JOB_END_TIME``); ``NG_TIME_LIMIT`` (an sbatch
``--time`` value, set by ``submit_comparison.sh`` from ``--train-sbatch``).

* CONTAINER + VENV: pyxis shows the container only ``MOUNTS`` (``--no-container-mount-home``). A
  VENV made on a login node links its python to an interpreter outside it (uv's managed Pythons
  live under ``$HOME``): in the container that link dangles and every step fails.
* Worker venvs: inside NeMo-RL's image ``NEMO_RL_VENV_DIR`` is the image's (``/opt/ray_venvs``),
  which beats a host value unless passed with pyxis' ``--container-env`` (``launch.sh`` passes a
  ``NEMO_RL_VENV_DIR`` set for the job). Venvs checked or built here under another folder are then
  not where NeMo-RL looks.
* Paths (CONTAINER): ``checkpointing.checkpoint_dir``, ``logger.log_dir`` and every local
  ``data...data_path`` resolve (relative ones against the working directory, ``WORKDIR``) in the
  container. Outside the destinations of ``MOUNTS`` they are the image's own folders (the shipped
  configs' relative ``results/...`` under ``WORKDIR=/opt/nemo-rl``): checkpoints and logs vanish
  with the container, and the data is not there.
* Time: NeMo-RL stops at ``checkpointing.checkpoint_must_save_by`` counted from after its setup;
  ``nemo_granular/nemo_rl/time_limit.py`` also stops it a step and a save before the job's end
  (``NG_SAVE_RESERVE_SECONDS`` for the save until one is measured). A limit later than the job's
  end minus the reserve, or a job shorter than the reserve, is reported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ..nemo_rl.time_limit import job_seconds_left, save_reserve_seconds
from .findings import Finding, error, warning
from .layout import dig

__all__ = ["runtime_findings", "parse_sbatch_time", "container_venv_problem", "container_path_findings"]

SOURCE = "nemo-granular:runtime"


def parse_sbatch_time(text: str) -> float | None:
    """Seconds of an sbatch ``--time`` value (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S``); None for ``UNLIMITED``/``INFINITE`` or anything else."""
    text = text.strip()
    m = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?", text)
    if m:
        d, h, mi, s = (int(x) if x else 0 for x in m.groups())
        return float(((d * 24 + h) * 60 + mi) * 60 + s)
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    nums = [int(p) for p in parts]
    if len(nums) == 1:
        return nums[0] * 60.0
    if len(nums) == 2:
        return nums[0] * 60.0 + nums[1]
    return nums[0] * 3600.0 + nums[1] * 60.0 + nums[2]


def _mount_sources(mounts: str) -> list[str]:
    return [spec.split(":", 1)[0].rstrip("/") for spec in mounts.split(",") if spec.split(":", 1)[0]]


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def container_venv_problem(venv: str, mounts: str, in_container: bool, home: str = "") -> str | None:
    """Why ``VENV`` cannot work in the container, or None. ``in_container``: this process runs in
    the job's container (the link must resolve here); else the submit host's view (``MOUNTS``;
    without MOUNTS, site-wide enroot mounts may hold anything: only a python under ``home``,
    which pyxis does not mount with --no-container-mount-home, is certain to be missing)."""
    python = os.path.join(venv, "bin", "python")
    target = os.path.realpath(python)
    if in_container:
        if not os.path.exists(target):
            return (
                f"VENV={venv}: its python ({python} -> {target}) does not exist in the container; with CONTAINER "
                "leave VENV unset (the image's environment runs the job; docs/slurm.md)"
            )
        return None
    if not mounts:
        if home and _inside(target, [home.rstrip("/")]):
            return (
                f"VENV={venv}: its python is a link to {target}, under $HOME, which the container does not have "
                "(--no-container-mount-home); with CONTAINER leave VENV unset (the image's environment runs the "
                "job; docs/slurm.md)"
            )
        return None
    roots = _mount_sources(mounts)
    if not _inside(os.path.abspath(venv), roots) and not _inside(os.path.realpath(venv), roots):
        return (
            f"VENV={venv} is not inside MOUNTS={mounts or '<none>'}: the container does not have it; with "
            "CONTAINER leave VENV unset (the image's environment runs the job; docs/slurm.md)"
        )
    if os.path.exists(target) and not _inside(target, roots) and not target.startswith("/usr/"):
        return (
            f"VENV={venv}: its python is a link to {target}, outside MOUNTS ({mounts}): it does not exist in "
            "the container; with CONTAINER leave VENV unset (the image's environment runs the job; docs/slurm.md)"
        )
    return None


def _mount_destinations(mounts: str) -> list[str]:
    """The container-side folders of pyxis ``--container-mounts`` (``SRC[:DST[:FLAGS]]``, comma list)."""
    out = []
    for spec in mounts.split(","):
        parts = spec.split(":")
        dst = parts[1] if len(parts) > 1 and parts[1] else parts[0]
        if dst:
            out.append(os.path.normpath(dst).rstrip("/") or "/")
    return out


_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")


def _data_paths(node, key: str = "data"):
    """``(key, value)`` of every ``data_path`` under ``data`` that names a local file (an absolute
    path, or a data file name), not a Hugging Face dataset id such as ``HuggingFaceH4/MATH-500``."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            if k == "data_path" and isinstance(v, str) and (v.startswith("/") or v.endswith(_DATA_SUFFIXES)):
                yield f"{key}.{k}", v
            else:
                yield from _data_paths(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _data_paths(v, f"{key}[{i}]")


def container_path_findings(cfg: Mapping, environ: Mapping[str, str] = os.environ) -> list[Finding]:
    """CONTAINER: the run's checkpoint and log paths (what it writes) must be inside MOUNTS (see the module
    docstring); relative ones resolve against ``WORKDIR`` (else the working directory), where the
    driver runs. No MOUNTS (site-wide enroot mounts, not visible here): nothing to check."""
    inside = bool(environ.get("NG_CONTAINER"))
    if not (environ.get("NG_CONTAINER") or environ.get("CONTAINER")):
        return []
    mounts = environ.get("NG_MOUNTS" if inside else "MOUNTS", "")
    roots = _mount_destinations(mounts)
    if not roots:
        return []
    base = environ.get("WORKDIR") or os.getcwd()
    keyed = [(k, dig(cfg, k, None)) for k in ("checkpointing.checkpoint_dir", "logger.log_dir")]
    if not dig(cfg, "checkpointing.enabled", True):
        keyed = keyed[1:]
    # data files are read, not written: one inside the image is the image's own (a shipped dataset) and is
    # not lost with the container; whether it exists is the data loader's check
    out = []
    for key, value in keyed:
        if not isinstance(value, str) or not value:
            continue
        path = os.path.normpath(os.path.join(base, value))
        if not _inside(path, roots) and "/" not in roots:
            out.append(
                error(
                    SOURCE,
                    f"{key}={value} is {path} in the container, outside MOUNTS={mounts}: the "
                    "image's own file system (not shared, lost with the container); set it under "
                    "a mounted directory",
                )
            )
    return out


def _venv_dir_findings(environ: Mapping[str, str], venv_dir: str | None) -> list[Finding]:
    if venv_dir is None or not environ.get("CONTAINER") or environ.get("NG_CONTAINER"):
        return []  # not a container job, or already inside it (then venv_dir is NeMo-RL's own view)
    if not environ.get("NEMO_RL_VENV_DIR"):
        return [
            warning(
                SOURCE,
                f"CONTAINER: NeMo-RL in the image looks for the worker venvs in the image's "
                f"NEMO_RL_VENV_DIR (pyxis: the image's value wins), not in {venv_dir}, where this "
                f"preflight checks (and --build-venvs builds) them; export NEMO_RL_VENV_DIR="
                f"{venv_dir} for the job (launch.sh passes it into the container) on a file system "
                "in MOUNTS, or use the venvs the image ships",
            )
        ]
    roots = _mount_sources(environ.get("MOUNTS", ""))
    path = os.path.realpath(environ["NEMO_RL_VENV_DIR"])
    if not _inside(environ["NEMO_RL_VENV_DIR"].rstrip("/"), roots) and not _inside(path, roots):
        return [
            error(
                SOURCE,
                f"NEMO_RL_VENV_DIR={environ['NEMO_RL_VENV_DIR']} is not inside MOUNTS="
                f"{environ.get('MOUNTS') or '<none>'}: the worker venvs there are not in the container",
            )
        ]
    return []


def _time_findings(cfg: Mapping, environ: Mapping[str, str]) -> list[Finding]:
    limit, what = None, ""
    if environ.get("NG_TIME_LIMIT"):
        limit, what = parse_sbatch_time(environ["NG_TIME_LIMIT"]), f"--time={environ['NG_TIME_LIMIT']}"
    elif environ.get("NG_JOB_END_TIME") or environ.get("SLURM_JOB_ID"):
        limit, what = job_seconds_left(environ), "the time the Slurm job has left"
    if limit is None:
        return []
    reserve = save_reserve_seconds(environ)
    if limit <= reserve:
        return [
            error(
                SOURCE,
                f"{what} ({limit:.0f} s) is not more than NG_SAVE_RESERVE_SECONDS={reserve:.0f}: NeMo-RL "
                "would save at its first step and stop; give the job more time or a smaller reserve",
            )
        ]
    must = dig(cfg, "checkpointing.checkpoint_must_save_by", None)
    if not must or not dig(cfg, "checkpointing.enabled", False):
        return []
    parts = str(must).split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return []  # NeMo-RL's own format check reports it
    seconds = sum(int(p) * m for p, m in zip(parts, (86400, 3600, 60, 1)))
    if seconds > limit - reserve:
        return [
            warning(
                SOURCE,
                f"checkpointing.checkpoint_must_save_by={must} ({seconds} s, counted from after "
                f"NeMo-RL's setup) is later than {what} ({limit:.0f} s) minus NG_SAVE_RESERVE_SECONDS="
                f"{reserve:.0f}: the driver stops NeMo-RL before the job's end instead, a step and a "
                f"save ahead (the reserve until a save is measured)",
            )
        ]
    return []


def runtime_findings(
    cfg: Mapping, environ: Mapping[str, str] = os.environ, venv_dir: str | None = None
) -> list[Finding]:
    """The runtime checks for a config (see the module docstring). ``venv_dir``: where this
    preflight looks for worker venvs (``venvs.venv_dir()``), None to skip that check."""
    out: list[Finding] = []
    inside = bool(environ.get("NG_CONTAINER"))
    container = environ.get("NG_CONTAINER") or environ.get("CONTAINER")
    venv = environ.get("NG_VENV") if inside else environ.get("VENV")
    if container and venv:
        problem = container_venv_problem(
            venv, environ.get("NG_MOUNTS" if inside else "MOUNTS", ""), inside, environ.get("HOME", "")
        )
        if problem:
            out.append(error(SOURCE, problem))
    out += _venv_dir_findings(environ, venv_dir)
    out += container_path_findings(cfg, environ)
    out += _time_findings(cfg, environ)
    return out
