"""The embedded trainer's run directory (``output_dir``): whether a run may start there, and its first write.

A start is planned by reading alone (:func:`plan_start`: the checkpoint to resume, or a refusal
when the directory already holds a run), so a refused start leaves everything as it was; only
once the models are set up does :func:`prepare_output_dir` replace an earlier run (``--force``),
remove the leftovers of a killed checkpoint write and set unusable checkpoints aside.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .checkpoint import LoadedCheckpoint, NothingToResume, find_resumable

# what a run writes into its output directory; a fresh run refuses a directory holding any of them
RUN_ARTIFACTS = ("metrics.jsonl", "metrics.superseded.jsonl", "checkpoints", "tensorboard")


def existing_run_artifacts(out: Path) -> list[str]:
    """The artifacts of an earlier run in ``out`` (empty directories do not count)."""
    found = []
    for name in RUN_ARTIFACTS:
        p = out / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            found.append(name + ("/" if p.is_dir() else ""))
    return found


def plan_start(
    out: Path, ckpt_dir: Path, resume: bool | str, force: bool, identity: dict, log
) -> tuple[LoadedCheckpoint | None, list[Path]]:
    """(checkpoint to resume or None, unusable checkpoints newer than it); raises one-line errors.

    ``resume``: False, True or ``"auto"`` (as :class:`~.trainer.Trainer` takes it); ``identity``:
    the config's values a checkpoint must have been written with (``algorithm``, ``seed``), else
    it belongs to a different run."""
    if resume:
        try:
            loaded, unusable = find_resumable(ckpt_dir, warn=log)
        except NothingToResume:
            if resume != "auto":
                raise
        else:
            state = loaded.state
            for key, mine in identity.items():
                if key in state and state[key] != mine:
                    raise ValueError(
                        f"--resume: {loaded.path} was written with {key}={state[key]!r}, the "
                        f"config says {key}={mine!r} (a different run: choose another output_dir)"
                    )
            return loaded, unusable
    existing = existing_run_artifacts(out)
    if existing and not force:
        raise FileExistsError(
            f"output_dir {out} already holds a run ({', '.join(existing)}): add --resume to continue "
            "it, --force to start over (deletes them), or choose another output_dir="
        )
    return None, []


def prepare_output_dir(out: Path, ckpt_dir: Path, force: bool, unusable: list[Path], log) -> None:
    """The run's first write: create ``out``; with ``force`` remove an earlier run's artifacts; remove
    the temporary directories of a checkpoint write that was killed; move ``unusable`` checkpoints
    aside (``step_N.unusable``: kept for inspection, out of the way of resume and pruning)."""
    out.mkdir(parents=True, exist_ok=True)
    if force:
        removed = existing_run_artifacts(out)
        for name in removed:
            p = out / name.rstrip("/")
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        if removed:
            log(f"--force: removed the earlier run's {', '.join(removed)} from {out}")
    if ckpt_dir.is_dir():  # leftovers of a write that was killed
        for tmp in ckpt_dir.glob(".tmp_*"):
            shutil.rmtree(tmp, ignore_errors=True)
        for bad in unusable:
            aside = bad.with_name(bad.name + ".unusable")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(bad, aside)
            log(f"moved the unusable checkpoint {bad.name} to {aside.name}")
