"""Where the embedded trainer's per-step records go: metrics.jsonl always, TensorBoard and wandb when enabled.

Also NeMo-RL's reduction of per-microbatch metric dicts (:func:`merge_metrics`), which the
trainer applies before a step's record is written. Kept apart from the RL step so that the
trainer says what a step computes and this module how it is stored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import atomic
from .config import TrainConfig

# the loss's probability-ratio extrema: reduced by min/max, never summed or averaged
RATIO_EXTREMA = ("probs_ratio_min", "probs_ratio_clamped_min", "probs_ratio_max", "probs_ratio_clamped_max")


def merge_metrics(acc: dict, new: dict) -> dict:
    """NeMo-RL's reduction of per-microbatch metric dicts: sum, min/max for the ratio extrema."""
    for k, v in new.items():
        if k not in acc:
            acc[k] = v
        elif k in RATIO_EXTREMA:
            acc[k] = min(acc[k], v) if k.endswith("_min") else max(acc[k], v)
        else:
            acc[k] += v
    return acc


class MetricSinks:
    """metrics.jsonl (always), TensorBoard and wandb (when enabled and installed).

    On resume the records past the checkpoint's step (steps that are redone) move to
    ``metrics.superseded.jsonl``: nothing already written is lost."""

    def __init__(self, out: Path, cfg: TrainConfig, resume_step: int | None, log=None):
        self.path = out / "metrics.jsonl"
        self.last_step = self.first_accuracy = self.last_accuracy = None
        if resume_step is not None and self.path.exists():
            keep, drop = [], []
            for line in self.path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    ok = int(rec["step"]) <= resume_step
                except (ValueError, KeyError, TypeError):  # e.g. a line cut short by a kill
                    rec, ok = None, False
                (keep if ok else drop).append(line)
                if ok:
                    self._track(rec)
            if drop:
                with (out / "metrics.superseded.jsonl").open("a") as fh:
                    fh.write("".join(line + "\n" for line in drop))
                if log:
                    log(
                        f"{len(drop)} metrics.jsonl record(s) past step {resume_step} moved to "
                        "metrics.superseded.jsonl (those steps are redone)"
                    )
            atomic.write_text(self.path, "".join(line + "\n" for line in keep))
        self.fh = self.path.open("a")
        self.tb = self.wandb = None
        if cfg.logger.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError:
                self.tb = None
        if cfg.logger.wandb:
            try:
                import wandb

                self.wandb = wandb.init(
                    project=cfg.logger.wandb_project,
                    name=cfg.name,
                    dir=str(out),
                    mode=cfg.logger.wandb_mode,
                    config=cfg.model_dump(mode="json"),
                )
            except ImportError:
                self.wandb = None

    def _track(self, rec: dict) -> None:
        self.last_step = rec["step"]
        acc = rec.get("validation/accuracy")
        if isinstance(acc, (int, float)):
            self.first_accuracy = acc if self.first_accuracy is None else self.first_accuracy
            self.last_accuracy = acc

    def write(self, rec: dict) -> None:
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        self._track(rec)
        # a Unix time is no curve (and float32 TensorBoard scalars would round it to minutes): metrics.jsonl only
        scalars = {
            k: v
            for k, v in rec.items()
            if isinstance(v, (int, float)) and k != "step" and math.isfinite(v) and not k.endswith("_unix")
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])

    def close(self):
        if self.fh.closed:
            return
        self.fh.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
