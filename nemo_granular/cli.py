"""``nemo-granular`` console script: ``train``, ``compare``, ``export``.

Sub-commands are imported lazily so that ``nemo-granular --help`` needs torch alone.
Errors that a user can fix (bad config, missing file) print one line and exit with code 2.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("nemo_granular.embedded.cli", "train_main", "train a policy with the embedded trainer"),
    "compare": ("nemo_granular.embedded.cli", "compare_main", "run several algorithms side by side, write report.md"),
    "export": ("nemo_granular.export.cli", "main", "export a checkpoint to Hugging Face format"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: nemo-granular {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, _, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"nemo-granular: unknown command {name!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except (ValueError, KeyError, FileNotFoundError, ImportError) as err:
        if "NEMO_GRANULAR_DEBUG" in __import__("os").environ:
            raise
        msg = str(err).strip().strip("'\"").splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"nemo-granular {name}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
