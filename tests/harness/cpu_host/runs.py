"""One loop run on the CPU host: the launcher as a subprocess, then what it left behind, read back."""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .cluster import RayHead, run_driver


@dataclass
class LoopRun:
    dir: Path
    rc: int
    log: str
    seconds: float
    facts: list = field(default_factory=list)
    scalars: dict = field(default_factory=dict)  # tag -> {step: value} (NeMo-RL's TensorBoard events)

    def of(self, kind: str) -> list:
        return [f for f in self.facts if f["kind"] == kind]

    def series(self, tag: str) -> dict:
        return self.scalars.get(tag, {})

    def steps(self, tag: str = "train/loss") -> list:
        return sorted(self.series(tag))

    def failure(self) -> str:
        return f"rc={self.rc} after {self.seconds:.0f}s; log tail:\n{self.log[-6000:]}"


def read_tensorboard(run_dir: Path) -> dict:
    from nemo_granular.report.runs import read_scalars

    return {tag: {s: v for s, (_, v) in steps.items()} for tag, steps in read_scalars(run_dir).items()}


def run_loop(
    head: RayHead, which: str, config: Path, run_dir: Path, overrides: list[str] = (), timeout: float = 900
) -> LoopRun:
    """``python -m cpu_host.launch {grpo|sppo} --config config [overrides]`` with the run's facts file."""
    facts = run_dir / "facts.jsonl"
    facts.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = run_driver(
        head,
        ["-m", "cpu_host.launch", which, "--config", str(config), *overrides],
        run_dir / "driver.log",
        timeout,
        cwd=run_dir,
        NEMO_GRANULAR_CPU_HOST_FACTS=str(facts),
    )
    out = LoopRun(dir=run_dir, rc=proc.returncode, log=proc.stdout, seconds=time.monotonic() - t0)
    if facts.is_file():
        out.facts = [json.loads(line) for line in facts.read_text().splitlines() if line.strip()]
    if any(run_dir.rglob("events.out.tfevents.*")):
        out.scalars = read_tensorboard(run_dir)
    return out


def run_ok(head: RayHead, which: str, config: Path, run_dir: Path, **kw) -> LoopRun:
    """:func:`run_loop` that must succeed (the assertion shows the driver log's tail)."""
    run = run_loop(head, which, config, run_dir, **kw)
    assert run.rc == 0, run.failure()
    return run


def copy_checkpoints(source: LoopRun, run_dir: Path, steps) -> None:
    """``source``'s ``step_N`` checkpoints into ``run_dir``: a new directory that resumes from them."""
    for step in steps:
        shutil.copytree(source.dir / "checkpoints" / f"step_{step}", run_dir / "checkpoints" / f"step_{step}")


def finite(values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
