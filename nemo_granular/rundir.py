"""What kind of run directory a path is: an embedded run (``metrics.jsonl``) or a NeMo-RL run
(TensorBoard event files, ``checkpoints/``, ``logs/``); an embedded run's step-0 record.

A leaf module: the report (:mod:`nemo_granular.report.runs`) and the benchmark suites
(:mod:`nemo_granular.evals.cli`) both ask it, so neither imports the other for it.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_yaml(path: Path) -> dict:
    """The mapping in a YAML file; ``{}`` when it is missing, unreadable or not a mapping."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def event_files(run: Path) -> list[Path]:
    """Every TensorBoard event file under ``run``."""
    return sorted(run.rglob("events.out.tfevents.*"))


def detect(run: Path) -> str:
    """``"embedded"``, ``"nemo-rl"`` or ``"unknown"``."""
    if (run / "metrics.jsonl").is_file():
        return "embedded"
    cfg = read_yaml(run / "config.yaml") if (run / "config.yaml").is_file() else {}
    if "rl" in cfg and "policy" not in cfg:
        return "embedded"
    if event_files(run) or "policy" in cfg or (run / "checkpoints").is_dir() or (run / "logs").is_dir():
        return "nemo-rl"
    return "unknown"


def step0_record(run: Path) -> dict | None:
    """The step-0 record of an embedded run's ``metrics.jsonl`` (the starting accuracy and, after a warm
    start, its outcome: ``warmstart/*``), or None when there is none."""
    try:
        lines = (run / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if isinstance(rec, dict) and rec.get("step") == 0:
            return rec
    return None
