"""Wall time of the embedded comparison against its budgets (issue: ≤ 10 min full, ≤ 2 min smoke).

Runs ``nemo-granular compare`` for the five algorithms in its smoke and full settings, one seed,
and writes the times (with the budget as the baseline ratio) to docs/benchmarks.md.

    python benchmarks/compare_budget.py [--skip-full]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, update_section

ALGS = "grpo,gspo,sspo,espo,sppo"


def timed(args: list[str]) -> float:
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "nemo_granular", "compare", "--algorithms", ALGS, *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-full", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        smoke = timed(["--smoke", "--out", f"{tmp}/smoke"])
        rows.append(("smoke (`--smoke`, CI)", smoke, 120.0))
        print(f"smoke: {smoke:.0f} s (budget 120 s)")
        if not args.skip_full:
            full = timed(["--out", f"{tmp}/full"])
            rows.append(("full (defaults: warm start + 100 RL steps each)", full, 600.0))
            print(f"full: {full:.0f} s (budget 600 s)")
    md = [
        "## Embedded comparison wall time (`benchmarks/compare_budget.py`)",
        "",
        f"Machine: {machine()}. Five algorithms ({ALGS}), one seed, two runs at a time, one thread each.",
        "",
        "| setting | wall time (s) | budget (s) | ratio to budget |",
        "|---|---|---|---|",
    ]
    md += [f"| {name} | {t:.0f} | {b:.0f} | {t / b:.2f} |" for name, t, b in rows]
    update_section("compare_budget", "\n".join(md))


if __name__ == "__main__":
    main()
