"""``nemo-granular preflight CONFIG [key=value ...]``: check a NeMo-RL config before the allocation.

Exit status: 0 clean (warnings allowed unless ``--strict``); 1 problems found, one line each on
stderr (``preflight: error: <message> [<NeMo-RL file:function or nemo-granular>]``); 2 the
config cannot be loaded, a bad argument, or NeMo-RL is not importable (one line). The plan goes
to stdout (``--json``: one JSON object instead).
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main", "build_parser"]

PROG = "nemo-granular preflight"


def build_parser() -> argparse.ArgumentParser:
    from ..cli_common import ArgumentParser

    p = ArgumentParser(
        prog=PROG,
        description="Offline checks of a run_grpo/run_sppo config: NeMo-RL's own "
        "set-up and worker-init checks, nemo-granular's, and the plan.",
    )
    p.add_argument("config", nargs="?", help="the YAML config run_grpo / run_sppo would get")
    p.add_argument(
        "overrides", nargs="*", help="NeMo-RL Hydra overrides, as the drivers take them (a.b=v, +a.b=v, ~a.b)"
    )
    p.add_argument("--config", dest="config_opt", metavar="CONFIG", help="same as the positional CONFIG")
    p.add_argument(
        "--driver",
        default="auto",
        choices=("auto", "grpo", "sppo"),
        help="run_grpo or run_sppo (auto: a file name containing 'sppo' → run_sppo, as submit_comparison.sh)",
    )
    p.add_argument("--json", action="store_true", help="print the findings and the plan as one JSON object")
    p.add_argument("--strict", action="store_true", help="warnings fail too (exit 1)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size for the logits estimate when the model config is not cached locally",
    )
    p.add_argument("--no-venv-check", action="store_true", help="skip the worker-venv check")
    p.add_argument(
        "--build-venvs",
        action="store_true",
        help="build the missing worker venvs now with NeMo-RL's create_local_venv (needs uv and network)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options may sit between the overrides
    config = args.config_opt or args.config
    overrides = list(args.overrides)
    if args.config_opt and args.config:
        overrides.insert(0, args.config)
    if not config:
        print(f"{PROG}: error: give the config file (see --help)", file=sys.stderr)
        return 2
    if args.vocab_size is not None and args.vocab_size <= 0:
        print(f"{PROG}: error: --vocab-size must be > 0, got {args.vocab_size}", file=sys.stderr)
        return 2
    import contextlib

    from .run import PreflightUnavailable, run_preflight

    try:  # NeMo-RL prints while it loads; stdout carries only the plan (or the JSON)
        with contextlib.redirect_stdout(sys.stderr):
            res = run_preflight(
                config, overrides, driver=args.driver, vocab_size=args.vocab_size, check_venvs=not args.no_venv_check
            )
    except PreflightUnavailable as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as err:
        text = str(err).strip()
        print(f"{PROG}: error: {text.splitlines()[0] if text else type(err).__name__}", file=sys.stderr)
        return 2
    if args.build_venvs:
        with contextlib.redirect_stdout(sys.stderr):
            _build(res)
            res = run_preflight(
                config, overrides, driver=args.driver, vocab_size=args.vocab_size, check_venvs=not args.no_venv_check
            )
    from .report import as_json, plan_text

    print(as_json(res, args.strict) if args.json else plan_text(res))
    for f in res.findings:
        print(f"preflight: {f.line()}", file=sys.stderr)
    failed = res.errors(args.strict)
    if not args.json:
        print(
            f"  result    {'FAILED: ' + str(len(failed)) + ' problem(s)' if failed else 'ok'}"
            + (f", {len(res.findings) - len(failed)} warning(s)" if len(res.findings) > len(failed) else "")
        )
    return 1 if failed else 0


def _build(res) -> None:
    """Build the worker venvs the config needs and does not have (NeMo-RL's ``create_local_venv``)."""
    from . import venvs

    entries = venvs.venv_plan(venvs.needed_actors(res.resolved, res.driver))
    force = os.environ.get("NRL_FORCE_REBUILD_VENVS", "false").lower() == "true"
    for e in entries:
        if e.needs_venv and (force or not e.built):
            for cmd in venvs.build_commands(e):
                print(f"{PROG}: $ {cmd}", file=sys.stderr)
    venvs.build_venvs(entries, log=lambda m: print(f"{PROG}: {m}", file=sys.stderr))
