"""``nemo-granular train`` and ``nemo-granular compare``."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

from ..cli import INTERRUPTED_EXIT_CODE, ArgumentParser
from .config import LOCAL_CONFIGS, load_train_config, packaged_configs


def train_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="nemo-granular train", description="Train with the embedded trainer.",
                        epilog=f"packaged configs (--config NAME): {', '.join(packaged_configs())}")
    ap.add_argument("--config", required=True,
                    help="YAML config (defaults: inheritance supported) or the name of a packaged config")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue from the newest complete checkpoint in <output_dir>/checkpoints (an error "
                           "when there is none)")
    mode.add_argument("--auto-resume", action="store_true",
                      help="continue when <output_dir> has a checkpoint, else start fresh (requeueing launchers)")
    mode.add_argument("--force", action="store_true",
                      help="start over in an output_dir that holds an earlier run (deletes its metrics and "
                           "checkpoints)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (Hydra style: a.b=v, +a.b=v, ~a.b)")
    args = ap.parse_args(argv)
    cfg = load_train_config(args.config, args.overrides)
    import logging

    # import-time chatter of optional packages (torchao's kernels, torch's pytree deprecations) is not
    # about this run; keep the output to the run's own lines
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from .trainer import PREEMPTED_EXIT_CODE, Trainer

    resume = "auto" if args.auto_resume else args.resume
    try:
        trainer = Trainer(cfg, resume=resume, force=args.force)
        rc = trainer.run()
    except KeyboardInterrupt:
        print("nemo-granular train: aborted by a second Ctrl-C: the steps since the last checkpoint are lost",
              file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    if rc in (INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE):
        again = [a for a in argv if a not in ("--force", "--resume", "--auto-resume")] + ["--resume"]
        print(f"resume with: nemo-granular train {shlex.join(again)}", file=sys.stderr)
    return rc


def _algorithm_list(text: str) -> list[str]:
    names = []
    for name in (a.strip() for a in text.split(",")):
        if name and name not in names:
            names.append(name)
    return names


def compare_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="nemo-granular compare",
                        description="Run algorithms side by side (same data, seed and sample budget) "
                                    "and write report.md with plots.")
    ap.add_argument("--algorithms", default="grpo,gspo,sspo,espo,sppo",
                    help="comma-separated config names from --config-dir")
    ap.add_argument("--seeds", type=int, default=1, help="number of seeds (0..N-1)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    ap.add_argument("--out", default="outputs/compare")
    ap.add_argument("--config-dir", default=str(LOCAL_CONFIGS), help="where <algorithm>.yaml live")
    ap.add_argument("--jobs", type=int, default=None, help="parallel runs (default: number of cores, max 2)")
    ap.add_argument("--smoke", action="store_true", help="tiny budget (CI): smoke.yaml settings for every run")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--force", action="store_true", help="redo a comparison whose --out already holds one")
    mode.add_argument("--resume", action="store_true",
                      help="continue an interrupted comparison in --out (runs resume from their checkpoints)")
    ap.add_argument("--from-runs", nargs="+", default=None, metavar="RUN_DIR",
                    help="only build the report from finished run directories")
    ap.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    args = ap.parse_args(argv)
    from .compare import CompareInterrupted, RunFailed, compare, report_from_runs

    if args.from_runs:
        if args.resume:
            raise ValueError("--resume continues a comparison's runs; --from-runs only builds a report")
        runs = [Path(p) for p in args.from_runs]
        for run in runs:   # embedded (metrics.jsonl) or NeMo-RL (TensorBoard events) run directories
            if not run.is_dir():
                raise FileNotFoundError(f"--from-runs {run}: no such directory")
        if (Path(args.out) / "report.md").exists() and not args.force:
            raise FileExistsError(f"--out {args.out} already holds a report.md: add --force to replace it, "
                                  "or choose another --out")
        created = not Path(args.out).exists()
        try:
            report = report_from_runs(runs, Path(args.out))
        except BaseException:
            if created:  # leave no empty --out behind when no report could be built
                shutil.rmtree(args.out, ignore_errors=True)
            raise
    else:
        try:
            report = compare(algorithms=_algorithm_list(args.algorithms), seeds=args.seeds, steps=args.steps,
                             out=Path(args.out), config_dir=Path(args.config_dir), jobs=args.jobs,
                             smoke=args.smoke, overrides=args.overrides, force=args.force, resume=args.resume)
        except CompareInterrupted as err:
            again = [a for a in argv if a not in ("--force", "--resume")] + ["--resume"]
            print(f"nemo-granular compare: {err}; continue with: nemo-granular compare {shlex.join(again)}",
                  file=sys.stderr)
            return INTERRUPTED_EXIT_CODE
        except RunFailed as err:
            print(f"nemo-granular compare: error: {err}", file=sys.stderr)
            return 1
    print(f"report: {report}", file=sys.stderr)
    return 0
