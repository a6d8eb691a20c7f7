"""Run a writer module as WORLD separate processes (one gloo rank each) and wait for all of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, jobs: list[dict], world: int, log_dir: Path, timeout: float = 900) -> None:
    """``python tests/harness/export_cpu/<module>.py RANK WORLD PORT JOBS_JSON`` for every rank; raises with the
    failing rank's log tail. The environment is the test process's (NeMo-RL sources on PYTHONPATH)."""
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    logs = [log_dir / f"{module}.rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(ROOT / "tests" / "harness" / "export_cpu" / f"{module}.py"),
                        str(r),
                        str(world),
                        port,
                        json.dumps(jobs),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        if p.returncode != 0:
            tail = logs[r].read_text()[-4000:]
            raise AssertionError(f"{module} rank {r} exited with {p.returncode}:\n{tail}")
