"""``<run>/evals.json``: benchmark-suite results of every evaluated checkpoint of one run.

    {"format": 1, "run": "<dir name>", "source": "embedded" | "nemo-rl",
     "suites": {"<suite>": {
         "protocol": {"description": ..., "select": "best" | "last", "select_note": ...},
         "benchmarks": {"<key>": {"label", "problems", "samples_per_problem", "decoding", "metric",
                                  "max_new_tokens", "file"}},
         "checkpoints": {"<step>": {"<key>": score, ...}}}}}

A score is the mean accuracy over every sample of every problem (avg@n). Written atomically;
suites and steps evaluated later are merged in, never dropped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import atomic

FORMAT = 1


def load(path: Path) -> dict:
    if not path.is_file():
        return {"format": FORMAT, "suites": {}}
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("suites"), dict):
        raise ValueError(f"{path}: not an evals.json (no 'suites' object)")
    return data


def merge_write(
    path: Path, run_name: str, source: str, suite: str, protocol: dict, benchmarks: dict, checkpoints: dict
) -> dict:
    """Merge one suite's results into ``path`` (atomic replace) and return the whole file."""
    data = load(path)
    data.update(format=FORMAT, run=run_name, source=source)
    entry = data["suites"].setdefault(suite, {"checkpoints": {}})
    entry["protocol"] = protocol
    entry.setdefault("benchmarks", {}).update(benchmarks)
    for step, scores in checkpoints.items():
        entry["checkpoints"].setdefault(str(step), {}).update(scores)
    atomic.write_text(path, json.dumps(data, indent=1, sort_keys=True))
    return data


def select_checkpoint(suite_result: dict, select: str = "last"):
    """(step, scores, average) of the reported checkpoint among those with every benchmark
    scored: the highest average ("best") or the highest step ("last"); None when none is complete."""
    benches = list(suite_result.get("benchmarks", {}))
    rows = []
    for step, scores in suite_result.get("checkpoints", {}).items():
        vals = [scores.get(b) for b in benches]
        if benches and all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals):
            rows.append((int(step), scores, sum(vals) / len(vals)))
    if not rows:
        return None
    if select == "best":
        return max(rows, key=lambda r: (r[2], -r[0]))  # ties: the earlier checkpoint
    return max(rows, key=lambda r: r[0])


def check_steps(run: Path, asked: list[int] | None, have: list[int]) -> None:
    """``--steps``: every asked step must have a checkpoint; a one-line ``ValueError`` names those that
    do not and the steps that exist (never a silent substitution)."""
    if asked is None:
        return
    missing = sorted(set(asked) - set(have))
    if missing:
        raise ValueError(
            f"--steps: {run} has no checkpoint of step {', '.join(map(str, missing))} "
            f"(its checkpoints: {', '.join(map(str, sorted(have))) or 'none'})"
        )
