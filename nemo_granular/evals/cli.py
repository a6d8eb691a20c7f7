"""``nemo-granular eval-checkpoints RUN_DIR... --suite sspo|sppo|espo|all``.

Embedded runs are evaluated in this process on local JSONL benchmarks (held-out synthetic levels
by default); NeMo-RL runs through NeMo-RL's ``run_eval``, one command per checkpoint and
benchmark (``--dry-run`` prints them). Results go to ``<run>/evals.json``, which
``nemo-granular compare --from-runs`` turns into the benchmark table. See docs/comparison.md.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ..cli_common import ArgumentParser
from .suite import SUITES, protocols_for


def _benchmark_arg(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--benchmark: expected NAME=FILE.jsonl, got {text!r}")
    return name, Path(path)


def build_parser():
    from .nemo_rl import CONFIG_DIR, CONTAINER_LAUNCHER, DEFAULT_LAUNCHER

    ap = ArgumentParser(
        prog="nemo-granular eval-checkpoints",
        description="Evaluate every checkpoint of run directories on a paper benchmark suite; "
        "writes <run>/evals.json for `nemo-granular compare --from-runs`.",
    )
    ap.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="embedded or NeMo-RL run directories; KEY=VALUE words among them, anywhere on the command "
        "line, are overrides passed to every run_eval (e.g. env.math.num_workers=4)",
    )
    ap.add_argument(
        "--suite",
        default="all",
        choices=SUITES,
        help="sspo: greedy avg@1 every 10 steps, best checkpoint; sppo: avg@16 at T=0.6; "
        "espo: AIME/HMMT avg@32, MATH500 greedy; all: the three (default)",
    )
    g = ap.add_argument_group("NeMo-RL runs")
    g.add_argument(
        "--nemo-rl",
        default=os.environ.get("NEMO_RL_SRC"),
        help="NeMo-RL checkout where run_eval runs (default: $NEMO_RL_SRC)",
    )
    g.add_argument(
        "--data-dir",
        default=None,
        help="local JSONL benchmarks <key>.jsonl (problem/answer; `nemo-granular stage-benchmarks` "
        "writes them): needed for amc23, minerva_math, olympiadbench, hmmt25; also replaces "
        "NeMo-RL's loader for aime24/aime25/math500 (offline nodes)",
    )
    g.add_argument(
        "--export-python",
        default=None,
        metavar="PYTHON",
        help="interpreter that exports Megatron checkpoints (needs Megatron-Bridge; default: "
        "$NG_EXPORT_PYTHON, else this one if it has Megatron-Bridge, else NeMo-RL's Megatron "
        "worker venv under $NEMO_RL_VENV_DIR; see docs/export.md)",
    )
    g.add_argument(
        "--launcher",
        default=None,
        help=f"how to start run_eval (default: {DEFAULT_LAUNCHER!r}; in a container job, NG_CONTAINER "
        f"set by slurm/launch.sh or submit_comparison.sh: {CONTAINER_LAUNCHER!r}, the image's "
        "python)",
    )
    g.add_argument(
        "--config-dir",
        default=str(CONFIG_DIR),
        help="the benchmark configs (default: the packaged nemo_granular/configs/evals)",
    )
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--num-nodes", type=int, default=1)
    g.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        help="vLLM tensor parallel size (default: the run's policy.generation.vllm_cfg.tensor_parallel_size "
        "from each checkpoint's config.yaml, else 1)",
    )
    ap.add_argument(
        "--steps",
        default=None,
        help="comma-separated checkpoint steps to evaluate, each of which must exist (default: the protocol's)",
    )
    g.add_argument(
        "--benchmarks",
        default=None,
        metavar="KEY,...",
        help="comma-separated benchmarks of the suite to evaluate, e.g. aime24,math500 (default: all of "
        "them); evals.json then records the suite with those only",
    )
    g.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    e = ap.add_argument_group("embedded runs")
    e.add_argument(
        "--benchmark",
        action="append",
        type=_benchmark_arg,
        default=None,
        metavar="NAME=FILE",
        help="a JSONL benchmark (repeatable; default: the run's held-out synthetic levels)",
    )
    e.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="cap samples per problem (CPU time); the report states the number used",
    )
    e.add_argument(
        "--score-cache",
        default=None,
        metavar="DIR",
        help="keep each score in DIR under a key of everything that determines it (policy and tokenizer "
        "files, benchmark file, setting, seed, code, versions) and reuse it (compare: the step 0 "
        "that the runs of one seed share is scored once)",
    )
    return ap


OVERRIDE_RE = re.compile(r"[A-Za-z_][\w.-]*=")  # a run_eval override (KEY=VALUE), not a path


def parse_args(argv: list[str]):
    """The arguments, with ``overrides`` (the KEY=VALUE words) split from ``runs``: argparse alone
    cannot take positional overrides after options (nor tell them from run directories)."""
    args = build_parser().parse_intermixed_args(argv)
    args.overrides = [w for w in args.runs if OVERRIDE_RE.match(w)]
    args.runs = [w for w in args.runs if not OVERRIDE_RE.match(w)]
    if not args.runs:
        raise ValueError("give at least one RUN_DIR")
    return args


def runtime_checks(cmds, suite: str, data_dir: Path | None) -> None:
    """Before anything runs: each Megatron export's interpreter imports Megatron-Bridge, and every
    benchmark still to evaluate can be loaded (offline too). One-line ``ValueError`` on the first problem."""
    import subprocess

    from .export_python import bridge_probe_argv
    from .staging import staging_problems

    pending = {c.benchmark for c in cmds if c.kind == "eval" and not c.result.is_file()}
    problems = staging_problems(suite, data_dir, keys=pending)
    if problems:
        raise ValueError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    for exporter in {c.exporter for c in cmds if c.kind == "export" and c.exporter is not None}:
        probe = subprocess.run(bridge_probe_argv(exporter), capture_output=True, text=True, timeout=900)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
            raise ValueError(
                f"the interpreter that exports Megatron checkpoints ({' '.join(exporter.python)}; "
                f"{exporter.why}) cannot import Megatron-Bridge: {last}"
            )
        print(
            f"[eval-checkpoints] Megatron checkpoints exported by {' '.join(exporter.python)} ({exporter.why})",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str]) -> int:
    from ..rundir import detect
    from . import nemo_rl  # .embedded (torch) only for an embedded run: bad input answers without it

    args = parse_args(argv)
    protocols = protocols_for(args.suite)
    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {args.max_samples}")
    steps = None
    if args.steps is not None:
        try:
            steps = [int(s) for s in args.steps.split(",")]
        except ValueError:
            raise ValueError(f"--steps: expected comma-separated integers >= 0, got {args.steps!r}") from None
        if any(s < 0 for s in steps):
            raise ValueError(f"--steps: expected comma-separated integers >= 0, got {args.steps!r}")
    benchmarks = None
    if args.benchmarks is not None:
        benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        known = list(dict.fromkeys(k for p in protocols for k in p.benchmarks))
        unknown = [b for b in benchmarks if b not in known]
        if unknown or not benchmarks:
            what = f"{unknown[0]!r} is not a benchmark of" if unknown else "no benchmark given; choose from"
            raise ValueError(f"--benchmarks: {what} suite {args.suite} ({', '.join(known)})")
    from .results import check_steps

    for run in map(Path, args.runs):  # before any run is evaluated: every directory and every --steps
        if not run.is_dir():
            raise FileNotFoundError(f"{run}: no such run directory")
        if steps is not None and detect(run) in ("embedded", "nemo-rl"):
            if detect(run) == "embedded":
                from . import embedded

                have = embedded.available_steps(run)
            else:
                have = nemo_rl.checkpoint_steps(run)
            check_steps(run, steps, sorted(have))
    failures = []
    for run in map(Path, args.runs):
        kind = detect(run)
        if kind == "embedded":
            from . import embedded

            if args.dry_run:
                print(f"# {run}: embedded run, evaluated in-process (suite {args.suite})")
                continue
            files = dict(args.benchmark) if args.benchmark else None
            embedded.evaluate_run(
                run,
                protocols,
                files,
                max_samples=args.max_samples,
                steps=steps,
                log=lambda m: print(m, file=sys.stderr, flush=True),
                score_cache=Path(args.score_cache) if args.score_cache else None,
            )
            print(f"{run}: {run / 'evals.json'}")
            continue
        if kind != "nemo-rl":
            raise ValueError(f"{run}: neither an embedded run (metrics.jsonl) nor a NeMo-RL run (checkpoints/)")
        if not args.nemo_rl:
            raise ValueError("--nemo-rl: give the NeMo-RL checkout (or set NEMO_RL_SRC)")
        cmds = nemo_rl.plan(
            run,
            protocols,
            nemo_rl_dir=Path(args.nemo_rl),
            data_dir=Path(args.data_dir) if args.data_dir else None,
            launcher=args.launcher,
            config_dir=Path(args.config_dir),
            gpus_per_node=args.gpus_per_node,
            num_nodes=args.num_nodes,
            tensor_parallel=args.tensor_parallel,
            steps=steps,
            export_python=args.export_python,
            extra=args.overrides,
            benchmarks=benchmarks,
        )
        if args.dry_run:
            for c in cmds:
                print(c.shell())
            continue
        runtime_checks(cmds, args.suite, Path(args.data_dir) if args.data_dir else None)
        failures += [f"{run}: {f}" for f in nemo_rl.run_plan(cmds, log=lambda m: print(m, file=sys.stderr, flush=True))]
        nemo_rl.collect(run, protocols, cmds, benchmarks)
        print(f"{run}: {run / 'evals.json'}")
    for f in failures:
        print(f"nemo-granular eval-checkpoints: failed: {f}", file=sys.stderr)
    return 1 if failures else 0
