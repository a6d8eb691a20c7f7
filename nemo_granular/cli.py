"""``nemo-granular`` console script: ``train``, ``compare``, ``export``, ``eval-checkpoints``.

Sub-commands are imported lazily so that ``nemo-granular --help`` needs torch alone.
Errors that a user can fix (bad config, bad argument, missing or unreadable file) print one
line and exit with code 2 (so does no command at all, after the usage); Ctrl-C exits 130 (``train`` checkpoints first).
"""

from __future__ import annotations

import importlib
import os
import sys

from .cli_common import INTERRUPTED_EXIT_CODE

# name → (module, function, help); the modules are imported only when their command runs. They import
# nemo_granular.cli_common for what commands share, never this module (tests/test_layering.py).
COMMANDS = {
    "train": ("nemo_granular.embedded.cli", "train_main", "train a policy with the embedded trainer"),
    "compare": ("nemo_granular.compare", "main", "run several algorithms side by side, write report.md"),
    "export": ("nemo_granular.export.cli", "main", "export a checkpoint to Hugging Face format"),
    "eval-checkpoints": (
        "nemo_granular.evals.cli",
        "main",
        "evaluate every checkpoint of runs on a paper benchmark suite (evals.json)",
    ),
    "preflight": ("nemo_granular.preflight.cli", "main", "check a run_grpo/run_sppo config offline, print the plan"),
    "stage-benchmarks": (
        "nemo_granular.evals.staging",
        "main",
        "write the paper suites' benchmarks as <data-dir>/<key>.jsonl for offline eval jobs",
    ),
}


def version() -> str:
    from . import __version__

    return __version__


def one_line(err: BaseException) -> str:
    """The first line of an error's message, naming the file for OS errors."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    if isinstance(err, KeyError) and len(err.args) == 1:
        return f"missing key {err.args[0]!r}"
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        # asked for (--help): the usage on stdout, exit 0; no command at all: a usage error, stderr, exit 2
        stream = sys.stdout if argv else sys.stderr
        print("usage: nemo-granular {" + ",".join(COMMANDS) + "} [options]   (nemo-granular --version)\n", file=stream)
        for name, (_, _, text) in COMMANDS.items():
            print(f"  {name:<10} {text}", file=stream)
        if not argv:
            print("nemo-granular: error: no command given (see --help)", file=stream)
            return 2
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"nemo-granular {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"nemo-granular: error: unknown command {name!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except KeyboardInterrupt:
        print(f"nemo-granular {name}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except (ValueError, KeyError, OSError, ImportError) as err:
        if "NEMO_GRANULAR_DEBUG" in os.environ:
            raise
        print(f"nemo-granular {name}: error: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
