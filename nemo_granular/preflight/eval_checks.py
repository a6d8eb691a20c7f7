"""Preflight of an eval job's runtime (what ``eval-checkpoints`` needs on the node that runs it).

* :func:`check_export_interpreter` — the interpreter that will export Megatron checkpoints
  (:func:`nemo_granular.evals.export_python.megatron_export_python`) imports Megatron-Bridge and the
  exporter: a real import in that interpreter, not a guess from paths;
* :func:`check_staged_benchmarks` — every benchmark of ``--eval-suite`` can be loaded where the job
  runs: a staged ``<data-dir>/<key>.jsonl`` (``nemo-granular stage-benchmarks``), or NeMo-RL's own
  loader when the node may download.

``python -m nemo_granular.preflight.eval_checks --eval-suite espo --data-dir DIR [--nemo-rl DIR]
[--megatron | --run RUN_DIR ...] [--export-python PYTHON]``: one line per problem on stderr, exit 1
when there is one (0 clean, 2 bad arguments). ``--run``: the export interpreter is checked when a
checkpoint of that run is a Megatron one (``slurm/submit_comparison.sh`` runs it so, first in each
eval job, inside its container). Run it in the environment of the eval job.
``eval-checkpoints`` makes the same checks itself before it runs anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from .findings import Finding, error

__all__ = ["check_export_interpreter", "check_staged_benchmarks", "has_megatron_checkpoint", "main"]

SOURCE = "nemo-granular eval-checkpoints"


def check_export_interpreter(
    nemo_rl_dir: Path | None,
    *,
    export_python: str | None = None,
    env: Mapping[str, str] = os.environ,
    timeout: float = 600,
) -> list[Finding]:
    """Megatron-Bridge importable by the interpreter that will export Megatron checkpoints."""
    from ..evals.export_python import bridge_probe_argv, megatron_export_python

    try:
        exporter = megatron_export_python(nemo_rl_dir, explicit=export_python, env=env)
    except ValueError as err:
        return [error(SOURCE, str(err))]
    try:
        probe = subprocess.run(
            bridge_probe_argv(exporter), capture_output=True, text=True, timeout=timeout, env=dict(env)
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return [error(SOURCE, f"cannot run the export interpreter {' '.join(exporter.python)}: {err}")]
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        return [
            error(
                SOURCE,
                f"the interpreter that exports Megatron checkpoints ({' '.join(exporter.python)}; "
                f"{exporter.why}) cannot import Megatron-Bridge: {last}",
            )
        ]
    return []


def check_staged_benchmarks(suite: str, data_dir: Path | None, env: Mapping[str, str] = os.environ) -> list[Finding]:
    """Every benchmark of ``suite`` staged (or loadable by NeMo-RL where the node may download)."""
    from ..evals.staging import staging_problems

    return [error("nemo-granular stage-benchmarks", p) for p in staging_problems(suite, data_dir, env)]


def has_megatron_checkpoint(run: Path) -> bool:
    """Is any ``<run>/checkpoints/step_N`` a Megatron checkpoint (exported with Megatron-Bridge)?"""
    from ..evals.nemo_rl import checkpoint_steps, is_megatron_checkpoint

    return any(is_megatron_checkpoint(step) for step in checkpoint_steps(run).values())


def main(argv: list[str] | None = None) -> int:
    from ..cli_common import ArgumentParser
    from ..evals.suite import SUITES

    ap = ArgumentParser(
        prog="python -m nemo_granular.preflight.eval_checks",
        description="Check an eval job's runtime: the Megatron export interpreter and the staged data.",
    )
    ap.add_argument("--eval-suite", required=True, choices=SUITES)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--nemo-rl", default=os.environ.get("NEMO_RL_SRC"), help="NeMo-RL checkout (default $NEMO_RL_SRC)")
    ap.add_argument("--megatron", action="store_true", help="the runs are Megatron runs: check the export interpreter")
    ap.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="a run directory to evaluate: check the export interpreter when it has a Megatron checkpoint",
    )
    ap.add_argument("--export-python", default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    findings = check_staged_benchmarks(args.eval_suite, Path(args.data_dir) if args.data_dir else None)
    if args.megatron or any(has_megatron_checkpoint(Path(r)) for r in args.run):
        findings += check_export_interpreter(
            Path(args.nemo_rl) if args.nemo_rl else None, export_python=args.export_python
        )
    for f in findings:
        print(f"preflight: {f.line()}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
