#!/usr/bin/env bash
# Submit configs that differ only in the loss (e.g. ESPO vs GSPO) as separate slurm/launch.sh jobs
# with the same seed and data, plus a dependent job (--dependency=afterany) that builds the same
# comparison report as the embedded `nemo-granular compare`, from the finished run directories.
#
#   slurm/submit_comparison.sh [options] CONFIG.yaml CONFIG.yaml [...] [-- key=value ...]
#
#   --out DIR          comparison directory: one run directory per config + report/ (default
#                      ./comparisons/<first config>-vs-...-<date>)
#   --seed N           seed of every run (default 0)
#   --nodes N          nodes per training job (default 2)
#   --driver KIND      train: `nemo-granular train` (embedded trainer; default for configs under
#                      examples/configs/local/), grpo: `python -m nemo_granular.run_grpo` (NeMo-RL)
#   --sbatch "ARGS"    extra sbatch arguments for every job (partition, account, time, gres, ...)
#   --dry-run          print the sbatch commands instead of submitting
# Overrides after `--` go to every run. Environment (CONTAINER, MOUNTS, VENV, WORKDIR, ...) is
# passed to slurm/launch.sh unchanged (docs/slurm.md). Prints the job ids and the report path.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LAUNCH=$HERE/launch.sh

OUT="" SEED=0 NODES=2 DRIVER="" DRY=0
SBATCH_EXTRA=()
CONFIGS=() OVERRIDES=()
die() { echo "submit_comparison: $*" >&2; exit 2; }
while (( $# )); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --driver) DRIVER=$2; shift 2 ;;
    --sbatch) read -r -a SBATCH_EXTRA <<<"$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    -*) die "unknown option $1" ;;
    *) CONFIGS+=("$1"); shift ;;
  esac
done
(( ${#CONFIGS[@]} >= 2 )) || die "give at least two configs (they should differ only in the loss)"
[[ "$SEED" =~ ^[0-9]+$ ]] || die "--seed must be a non-negative integer, got $SEED"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got $NODES"

WORKDIR=${WORKDIR:-$PWD}
names=()
for i in "${!CONFIGS[@]}"; do
  c=${CONFIGS[$i]}
  [[ "$c" = /* ]] || c=$PWD/$c
  [[ -f "$c" ]] || die "config not found: ${CONFIGS[$i]}"
  CONFIGS[i]=$c
  n=$(basename "$c"); n=${n%.yaml}; n=${n%.yml}
  for m in "${names[@]}"; do [[ "$m" != "$n" ]] || die "two configs are named $n"; done
  names+=("$n")
done
if [[ -z "$DRIVER" ]]; then
  DRIVER=grpo
  [[ "${CONFIGS[0]}" == */examples/configs/local/* ]] && DRIVER=train
fi
[[ "$DRIVER" == train || "$DRIVER" == grpo ]] || die "--driver must be train or grpo, got $DRIVER"
if [[ -z "$OUT" ]]; then
  OUT=$PWD/comparisons/$(IFS=-; echo "${names[*]}")-$(date +%Y%m%d-%H%M%S)
fi
[[ "$OUT" = /* ]] || OUT=$PWD/$OUT
mkdir -p "$OUT"

run() {  # run CMD... -> prints the job id (or the command with --dry-run)
  if (( DRY )); then printf '%q ' "$@" >&2; echo >&2; echo "DRYRUN$RANDOM"; return; fi
  "$@"
}

jobs=() run_dirs=()
for i in "${!CONFIGS[@]}"; do
  name=${names[$i]} cfg=${CONFIGS[$i]} rd=$OUT/${names[$i]}
  run_dirs+=("$rd")
  if [[ "$DRIVER" == train ]]; then
    cmd=(nemo-granular train --config "$cfg" "output_dir=$rd" "seed=$SEED" "${OVERRIDES[@]}")
  else
    cmd=(python -m nemo_granular.run_grpo --config "$cfg" "grpo.seed=$SEED"
         "checkpointing.checkpoint_dir=$rd/checkpoints" "logger.log_dir=$rd/logs" "${OVERRIDES[@]}")
  fi
  jid=$(WORKDIR=$WORKDIR BASE_LOG_DIR=${BASE_LOG_DIR:-$OUT/slurm-logs} run sbatch --parsable --nodes="$NODES" \
        --job-name="cmp-$name" --output="$OUT/slurm-%x-%j.out" "${SBATCH_EXTRA[@]}" "$LAUNCH" "${cmd[@]}")
  jid=${jid%%;*}
  jobs+=("$jid")
  echo "submitted $name: job $jid -> $rd"
done

# the report: afterany, so a failed or cancelled run still gets a report of the others
dep=$(IFS=:; echo "${jobs[*]}")
report_cmd=$(printf '%q ' nemo-granular compare --from-runs "${run_dirs[@]}" --out "$OUT/report")
prefix=$(printf 'cd %q && ' "$WORKDIR")
[[ -n "${VENV:-}" ]] && prefix+=$(printf 'source %q/bin/activate && ' "$VENV")
if [[ -n "${CONTAINER:-}" ]]; then
  wrap="srun --container-image=${CONTAINER} ${MOUNTS:+--container-mounts=$MOUNTS} --container-workdir=$WORKDIR --no-container-mount-home bash -c $(printf '%q' "$prefix$report_cmd")"
else
  wrap="exec bash -c $(printf '%q' "$prefix$report_cmd")"   # --wrap scripts run under /bin/sh
fi
rjid=$(run sbatch --parsable --nodes=1 --ntasks=1 --dependency="afterany:$dep" --kill-on-invalid-dep=no \
       --job-name=cmp-report --output="$OUT/slurm-%x-%j.out" "${SBATCH_EXTRA[@]}" --wrap="$wrap")
rjid=${rjid%%;*}
echo "submitted report: job $rjid (after $dep) -> $OUT/report/report.md"
printf '%s\n' "${jobs[@]}" "$rjid" >"$OUT/job_ids.txt"
