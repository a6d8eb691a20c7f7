"""``nemo-granular train`` and ``nemo-granular compare``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import load_train_config

LOCAL_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs" / "local"


def train_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nemo-granular train", description="Train with the embedded trainer.")
    ap.add_argument("--config", required=True, help="YAML config (defaults: inheritance supported)")
    ap.add_argument("--resume", action="store_true", help="continue from <output_dir>/checkpoints/latest if present")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (Hydra style: a.b=v, +a.b=v, ~a.b)")
    args = ap.parse_args(argv)
    cfg = load_train_config(args.config, args.overrides)
    from .trainer import Trainer

    return Trainer(cfg, resume=args.resume).run()


def compare_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nemo-granular compare",
                                 description="Run algorithms side by side (same data, seed and sample budget) "
                                             "and write report.md with plots.")
    ap.add_argument("--algorithms", default="grpo,gspo,sspo,espo,sppo")
    ap.add_argument("--seeds", type=int, default=1, help="number of seeds (0..N-1)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    ap.add_argument("--out", default="outputs/compare")
    ap.add_argument("--config-dir", default=str(LOCAL_CONFIGS), help="where <algorithm>.yaml live")
    ap.add_argument("--jobs", type=int, default=None, help="parallel runs (default: number of cores, max 2)")
    ap.add_argument("--smoke", action="store_true", help="tiny budget (CI): smoke.yaml settings for every run")
    ap.add_argument("--from-runs", nargs="+", default=None, metavar="RUN_DIR",
                    help="only build the report from finished run directories")
    ap.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    args = ap.parse_args(argv)
    from .compare import compare, report_from_runs

    if args.from_runs:
        report = report_from_runs([Path(p) for p in args.from_runs], Path(args.out))
    else:
        report = compare(algorithms=[a.strip() for a in args.algorithms.split(",") if a.strip()],
                         seeds=args.seeds, steps=args.steps, out=Path(args.out), config_dir=Path(args.config_dir),
                         jobs=args.jobs, smoke=args.smoke, overrides=args.overrides)
    print(f"report: {report}", file=sys.stderr)
    return 0
