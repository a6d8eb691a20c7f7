"""What the embedded trainer says on stderr while it runs: the start line, then its progress.

The start line names what the run will do (algorithm, seed, device, steps, run directory and the
checkpoints it will write); :class:`Progress` then shows a tqdm bar on a terminal, else one plain
line every ``logger.log_every`` steps (a batch job's log stays short and greppable).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .config import TrainConfig


def checkpoint_plan(start: int, steps: int, every: int) -> str:
    """What the checkpoints of steps ``start+1..steps`` will be, as the start line says it: a run
    shorter than ``checkpoint.every`` writes one checkpoint, at the end."""
    if not every or (start // every + 1) * every >= steps:  # no multiple of ``every`` before the last step
        return "checkpoint at the end"
    return f"checkpoints every {every} steps" + ("" if steps % every == 0 else " and at the end")


def start_line(cfg: TrainConfig, device: torch.device, out: Path, latest) -> str:
    """The run's first line; ``latest``: the checkpoint it resumes from (``LoadedCheckpoint``) or None."""
    dev = device.type + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    head = f"train {cfg.algorithm} (seed {cfg.seed}) on {dev}"
    if latest:
        start = int(latest.state["step"])
        return (
            f"{head}: resuming at step {start} of {cfg.rl.steps} from {latest.path} "
            f"→ {out}/ (metrics.jsonl; {checkpoint_plan(start, cfg.rl.steps, cfg.checkpoint.every)})"
        )
    warm = not cfg.model.init_from and cfg.warmstart.enabled
    steps = f"{cfg.rl.steps} RL step{'s' if cfg.rl.steps != 1 else ''}"
    if warm:  # rl.steps=0: a warm start alone, as compare starts one (not "then 0 RL steps")
        steps = "warm start only, no RL steps" if cfg.rl.steps == 0 else f"warm start, then {steps}"
    return f"{head}: {steps} → {out}/ (metrics.jsonl; {checkpoint_plan(0, cfg.rl.steps, cfg.checkpoint.every)})"


class Progress:
    """A tqdm bar when stderr is a terminal and ``logger.progress`` is on; else one plain line
    every ``logger.log_every`` steps (and at the last step). Accuracy shows its latest value."""

    def __init__(self, cfg: TrainConfig, step: int, accuracy: float | None, log):
        self.total, self.every, self.log = cfg.rl.steps, cfg.logger.log_every, log
        self.acc = accuracy
        self.t0, self.step0 = time.time(), step
        self.bar = None
        if cfg.logger.progress and sys.stderr.isatty() and step < cfg.rl.steps:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.rl.steps, initial=step, desc=cfg.algorithm, dynamic_ncols=True, file=sys.stderr)

    def update(self, rec: dict) -> None:
        self.acc = rec.get("validation/accuracy", self.acc)
        clip = rec.get("train/clip_frac_low", 0.0) + rec.get("train/clip_frac_high", 0.0)
        fields = {"reward": f"{rec['train/reward']:.3f}", "clip": f"{clip:.4f}"}
        if self.acc is not None:
            fields["acc"] = f"{self.acc:.3f}"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(fields)
            return
        step = rec["step"]
        if self.every and (step % self.every == 0 or step == self.total):
            rate = (time.time() - self.t0) / max(1, step - self.step0)
            self.log(
                f"step {step}/{self.total}: "
                + ", ".join(f"{k} {v}" for k, v in fields.items())
                + f" ({rate:.2f} s/step)"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
