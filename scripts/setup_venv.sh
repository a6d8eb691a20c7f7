#!/usr/bin/env bash
# Create ./.venv with everything the demo and the tests need (idempotent; CPU only).
# torch is pinned to 2.13.0: that CPU wheel is on these machines, and an unpinned torch
# would pull several GB of CUDA packages. Progress lines go to stderr; nothing when already set up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup_venv: creating $PWD/.venv ($PY -m venv)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.nemo_granular_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  SECONDS=0
  echo "setup_venv: installing torch==2.13.0 (CPU) into $PWD/.venv (first use: about a minute) ..." >&2
  # --no-compile, then compileall on every core: pip byte-compiles on one (about 40% of its time here)
  .venv/bin/pip install --quiet --disable-pip-version-check --no-compile torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  echo "setup_venv: installing nemo-granular and its extras (-e '.[all]') ..." >&2
  .venv/bin/pip install --quiet --disable-pip-version-check --no-compile -e ".[all]" 2>&1 | grep -v "^WARNING: Location" || true
  bash scripts/compile_venv.sh
  .venv/bin/python -c "import torch, transformers, nemo_granular" || { echo "setup failed" >&2; exit 1; }
  touch "$stamp"
  echo "setup_venv: done in ${SECONDS} s ($PWD/.venv/bin/nemo-granular is the command)" >&2
fi
