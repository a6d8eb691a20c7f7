"""How each run shared the CPU: what a wall-time comparison would need before it meant anything (the
report compares SPPO's speed in CPU seconds instead, and shows these numbers beside it).

The embedded trainer records, per RL step, ``timing/train/cpu_time`` (CPU seconds the process used
in the step) and ``timing/train/step_end_unix`` (when it ended). From them, per run:

- *alongside*: the mean number of OTHER runs of the report training at the same time, weighted by
  the overlap of their steps with this run's steps (two parallel jobs: ≈ 1; the run that trained
  last, alone: ≈ 0). Runs that share cores, caches and memory bandwidth slow each other down.
- *CPU per wall second*: Σ cpu_time / Σ step time. Below the run's thread count when the process
  waited for a core (other jobs on the machine).

Runs without these records (NeMo-RL runs, older embedded runs) are "not recorded".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .runs import Run

CPU_KEY, END_KEY, STEP_KEY = "timing/train/cpu_time", "timing/train/step_end_unix", "timing/train/total_step_time"


@dataclass(frozen=True)
class CpuUsage:
    alongside: float  # mean number of other runs training at the same time
    share: float  # CPU seconds per wall second while training

    def describe(self) -> str:
        return f"{self.alongside:.2f} other runs alongside, {self.share:.2f} CPU s per wall s"


def _intervals(run: Run) -> np.ndarray | None:
    """[n, 3] (start, end, cpu seconds) of every RL step, or None when not recorded for every step."""
    steps = [r for r in run.recs if r["step"] > 0]
    if not steps or not all(CPU_KEY in r and END_KEY in r and STEP_KEY in r for r in steps):
        return None
    end = np.array([r[END_KEY] for r in steps], dtype=np.float64)
    dur = np.array([r[STEP_KEY] for r in steps], dtype=np.float64)
    return np.stack([end - dur, end, np.array([r[CPU_KEY] for r in steps], dtype=np.float64)], axis=1)


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Total seconds the steps of ``a`` overlap the steps of ``b`` (each set non-overlapping in itself)."""
    lo = np.maximum(a[:, None, 0], b[None, :, 0])
    hi = np.minimum(a[:, None, 1], b[None, :, 1])
    return float(np.clip(hi - lo, 0.0, None).sum())


def cpu_usage(runs: list[Run]) -> dict:
    """run.dir → :class:`CpuUsage` (None when the run did not record it), each against all the others."""
    spans = {run.dir: _intervals(run) for run in runs}
    out = {}
    for run in runs:
        own = spans[run.dir]
        if own is None:
            out[run.dir] = None
            continue
        wall = float((own[:, 1] - own[:, 0]).sum())
        shared = sum(_overlap(own, other) for d, other in spans.items() if d != run.dir and other is not None)
        out[run.dir] = CpuUsage(
            alongside=shared / wall if wall > 0 else 0.0, share=float(own[:, 2].sum()) / wall if wall > 0 else 0.0
        )
    return out
