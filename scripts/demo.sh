#!/usr/bin/env bash
# Set up the environment and run the main job: GRPO, GSPO, SSPO, ESPO and SPPO side by side
# on a small Qwen3 on CPU (GPU if present). Writes outputs/compare/report.md and PNG plots.
# Extra arguments go to `nemo-granular compare` (e.g. --seeds 3, --steps 50, --smoke).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/nemo-granular compare --algorithms grpo,gspo,sspo,espo,sppo --out outputs/compare "$@"
