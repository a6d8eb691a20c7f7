"""The one-command comparison, in its CI (smoke) setting: report.md and plots from real runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALGS = ["grpo", "gspo", "sspo", "espo", "sppo"]


@pytest.mark.slow
def test_smoke_comparison_writes_report_and_plots(tmp_path):
    out = tmp_path / "cmp"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "nemo_granular", "compare", "--smoke", "--algorithms", ",".join(ALGS),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1200)
    elapsed = time.time() - t0
    print(f"smoke comparison of {len(ALGS)} algorithms: {elapsed:.0f} s")  # recorded by CI's -rA/-s output
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    for alg in ALGS:
        assert f"| {alg} | 1 |" in report  # one table row per algorithm
    assert "directional claims" in report and report.count("| holds |") + report.count("does NOT hold") >= 4
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 8 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    for alg in ALGS:  # every run really trained: metrics for every step and a final checkpoint
        run = out / "runs" / f"{alg}_seed0"
        steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert len(steps) == 11
        assert (run / "checkpoints" / "latest").is_file()
    # the report can be rebuilt from the run directories alone (the Slurm comparison does this)
    again = subprocess.run([sys.executable, "-m", "nemo_granular", "compare", "--from-runs",
                            *[str(out / "runs" / f"{a}_seed0") for a in ALGS], "--out", str(tmp_path / "again")],
                           capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    def tables(text):
        return text.split("## Final held-out accuracy")[1].split("## Plots")[0]
    assert tables((tmp_path / "again" / "report.md").read_text()) == tables(report)
