#!/usr/bin/env bash
# Set up the environment and run the main job: GRPO, GSPO, SSPO, ESPO and SPPO side by side
# on a small Qwen3 on CPU (GPU if present), 5 seeds each (every claim gets a 95 % interval over
# seeds). Writes outputs/compare/report.md and PNG plots (--smoke: 3 seeds, outputs/compare-smoke/).
# Extra arguments go to `nemo-granular compare` (e.g. --seeds 3, --steps 50, --smoke, --out DIR,
# --resume, --force).
# An earlier comparison is never overwritten: without --out/--force/--resume the demo writes
# into the next free directory (outputs/compare-2, -3, ...) and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bash scripts/setup_venv.sh
out=$repo/outputs/compare
own_out=1
for arg in "$@"; do
  case "$arg" in
    --smoke) out=$repo/outputs/compare-smoke ;;
    --out|--out=*|--force|--resume) own_out=0 ;;
  esac
done
args=()
if (( own_out )); then
  base=$out
  n=2
  while [ -e "$out/report.md" ] || [ -e "$out/runs" ] || [ -e "$out/warmstart" ]; do out="$base-$n"; n=$((n + 1)); done
  if [ "$out" != "$base" ]; then
    echo "demo: $base already holds a comparison (kept); writing this one to $out" >&2
    [ -e "$base/report.md" ] || echo "demo: ($base was interrupted: 'bash $repo/scripts/demo.sh $* --out $base --resume' continues it)" >&2
  fi
  args=(--out "$out")
fi
exec "$repo/.venv/bin/nemo-granular" compare --algorithms grpo,gspo,sspo,espo,sppo ${args[@]+"${args[@]}"} "$@"
