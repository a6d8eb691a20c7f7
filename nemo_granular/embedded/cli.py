"""``nemo-granular train`` (``nemo-granular compare`` is :mod:`nemo_granular.compare`)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..cli_common import INTERRUPTED_EXIT_CODE, ArgumentParser, command_prefix
from .config import load_train_config, packaged_configs

# the line that tells how to continue a stopped run (``compare`` leaves it out of its echo: it has its own)
RESUME_HINT = "resume with: "


def resume_command(argv: list[str], output_dir: str) -> str:
    """The command that continues this run, runnable as printed from any directory: the tool as it can
    be run (:func:`command_prefix`), a config file's path and ``output_dir`` made absolute."""
    again, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--force", "--resume", "--auto-resume") or a.lstrip("+").startswith("output_dir="):
            i += 1
            continue
        if a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
            again += ["--config", str(Path(path).absolute()) if Path(path).is_file() else path]
            i += 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
            a = f"--config={Path(path).absolute()}" if Path(path).is_file() else a
        again.append(a)
        i += 1
    again += [f"output_dir={Path(output_dir).absolute()}", "--resume"]
    return f"{command_prefix()} train {shlex.join(again)}"


def train_main(argv: list[str]) -> int:
    ap = ArgumentParser(
        prog="nemo-granular train",
        description="Train with the embedded trainer.",
        epilog=f"packaged configs (--config NAME): {', '.join(packaged_configs())}",
    )
    ap.add_argument(
        "--config", required=True, help="YAML config (defaults: inheritance supported) or the name of a packaged config"
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in <output_dir>/checkpoints (an error when there is none)",
    )
    mode.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue when <output_dir> has a checkpoint, else start fresh (requeueing launchers)",
    )
    mode.add_argument(
        "--force",
        action="store_true",
        help="start over in an output_dir that holds an earlier run (deletes its metrics and checkpoints)",
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides (Hydra style: a.b=v, +a.b=v, ~a.b)")
    args = ap.parse_args(argv)
    cfg = load_train_config(args.config, args.overrides)
    cfg.output_dir = str(Path(cfg.output_dir).absolute())  # every path printed holds from any directory
    import logging

    # import-time chatter of optional packages (torchao's kernels, torch's pytree deprecations) is not
    # about this run; keep the output to the run's own lines
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from .trainer import PREEMPTED_EXIT_CODE, Trainer

    resume = "auto" if args.auto_resume else args.resume
    try:
        # progress (every other line) on stderr, the closing summary on stdout
        trainer = Trainer(cfg, resume=resume, force=args.force, summary=lambda msg: print(msg, flush=True))
        rc = trainer.run()
    except KeyboardInterrupt:
        print(
            "nemo-granular train: aborted by a second Ctrl-C: the steps since the last checkpoint are lost",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE
    if rc in (INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE):
        print(f"{RESUME_HINT}{resume_command(argv, cfg.output_dir)}", file=sys.stderr)
    return rc
