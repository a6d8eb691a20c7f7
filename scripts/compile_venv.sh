#!/usr/bin/env bash
# Byte-compile .venv's site-packages on every core (a no-op for what is compiled already). The installs
# run pip with --no-compile: pip compiles on one core. Under PYTHONDONTWRITEBYTECODE (set on CI's
# machines) nothing is compiled on import, so every process (Ray actor, rank, driver) would compile
# what it imports again. A file that is not this Python's syntax is skipped by the import too:
# compileall's failures do not matter here.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
.venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
