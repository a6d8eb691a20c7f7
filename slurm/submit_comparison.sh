#!/usr/bin/env bash
# Submit configs that differ only in the loss (e.g. ESPO vs GSPO, SPPO vs GRPO) as separate
# slurm/launch.sh jobs with the same seed and data, plus a small dependent job
# (--dependency=afterany) that builds the comparison report (`nemo-granular compare --from-runs`)
# from the run directories, with the benchmark table when the runs hold evals.json.
#
#   slurm/submit_comparison.sh [options] CONFIG.yaml CONFIG.yaml [...] [-- key=value ...]
#
#   --out DIR              comparison directory: one run directory per config + report/
#                          (default ./comparisons/<config>-vs-...-<date>)
#   --seed N               seed of every run (default 0)
#   --nodes N              nodes per training job (default 2)
#   --driver KIND          auto (default): per config, `nemo-granular train` for configs under
#                          examples/configs/local/, `-m nemo_granular.run_sppo` for SPPO configs
#                          (a name containing "sppo"), else `-m nemo_granular.run_grpo`;
#                          or train | grpo | sppo for every config
#   --sbatch "ARGS"        sbatch arguments for EVERY job (account, partition, qos)
#   --train-sbatch "ARGS"  sbatch arguments for the training jobs only (--gres, --time, ...)
#   --report-sbatch "ARGS" sbatch arguments for the report job only
#                          (default "--time=00:30:00 --cpus-per-task=2")
#   --eval-suite SUITE     after each training job (afterok), an eval job on one node with the
#                          training resources runs `nemo-granular eval-checkpoints RUN --suite SUITE`
#                          (sspo | sppo | espo | all) so the report has the benchmark table; the
#                          report waits for it (default: no eval jobs)
#   --eval-args "ARGS"     extra eval-checkpoints arguments (e.g. "--data-dir /data/benchmarks")
#   --dry-run              print the sbatch commands; submit nothing, write nothing
# Overrides after `--` go to every run. Environment: CONTAINER, MOUNTS, VENV, WORKDIR, ... are
# passed to slurm/launch.sh unchanged; NEMO_RL_PYTHON (default "uv run python") is how NeMo-RL
# drivers start Python (docs/slurm.md, "One launch story"). Prints the job ids and the report path.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LAUNCH=$HERE/launch.sh

OUT="" SEED=0 NODES=2 DRIVER=auto DRY=0 EVAL_SUITE=""
EVAL_ARGS=() SBATCH_ALL=() SBATCH_TRAIN=() SBATCH_REPORT=(--time=00:30:00 --cpus-per-task=2)
CONFIGS=() OVERRIDES=()
die() { echo "submit_comparison: $*" >&2; exit 2; }
while (( $# )); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --driver) DRIVER=$2; shift 2 ;;
    --sbatch) read -r -a SBATCH_ALL <<<"$2"; shift 2 ;;
    --train-sbatch) read -r -a SBATCH_TRAIN <<<"$2"; shift 2 ;;
    --report-sbatch) read -r -a SBATCH_REPORT <<<"$2"; shift 2 ;;
    --eval-suite) EVAL_SUITE=$2; shift 2 ;;
    --eval-args) read -r -a EVAL_ARGS <<<"$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    -*) die "unknown option $1" ;;
    *) CONFIGS+=("$1"); shift ;;
  esac
done
(( ${#CONFIGS[@]} >= 2 )) || die "give at least two configs (they should differ only in the loss)"
[[ "$SEED" =~ ^[0-9]+$ ]] || die "--seed must be a non-negative integer, got $SEED"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got $NODES"
[[ -z "$EVAL_SUITE" || "$EVAL_SUITE" =~ ^(sspo|sppo|espo|all)$ ]] || die "--eval-suite must be sspo, sppo, espo or all, got $EVAL_SUITE"
[[ "$DRIVER" =~ ^(auto|train|grpo|sppo)$ ]] || die "--driver must be auto, train, grpo or sppo, got $DRIVER"
for a in "${SBATCH_ALL[@]}"; do
  case "$a" in
    --gres*|--gpus*|-G*|--time*|-t*|--nodes*|-N*|--exclusive*)
      die "--sbatch is for every job (account, partition); put $a in --train-sbatch (the report job has --report-sbatch)" ;;
  esac
done

WORKDIR=${WORKDIR:-$PWD}
NEMO_RL_PYTHON=${NEMO_RL_PYTHON:-uv run python}
read -r -a NRL_PY <<<"$NEMO_RL_PYTHON"
names=() drivers=()
for i in "${!CONFIGS[@]}"; do
  c=${CONFIGS[$i]}
  [[ "$c" = /* ]] || c=$PWD/$c
  [[ -f "$c" ]] || die "config not found: ${CONFIGS[$i]}"
  CONFIGS[i]=$c
  n=$(basename "$c"); n=${n%.yaml}; n=${n%.yml}
  for m in "${names[@]}"; do [[ "$m" != "$n" ]] || die "two configs are named $n"; done
  names+=("$n")
  d=$DRIVER
  if [[ "$d" == auto ]]; then
    if [[ "$c" == */examples/configs/local/* ]]; then d=train
    elif [[ "$n" == *sppo* ]]; then d=sppo
    else d=grpo; fi
  fi
  drivers+=("$d")
done
if [[ -z "$OUT" ]]; then
  OUT=$PWD/comparisons/$(IFS=-; echo "${names[*]}")-$(date +%Y%m%d-%H%M%S)
fi
[[ "$OUT" = /* ]] || OUT=$PWD/$OUT
(( DRY )) || mkdir -p "$OUT"

run() {  # run CMD... -> prints the job id (or, with --dry-run, the command and a placeholder id)
  if (( DRY )); then printf '%q ' "$@" >&2; echo >&2; echo "DRYRUN$RANDOM"; return; fi
  "$@"
}

jobs=() run_dirs=()
for i in "${!CONFIGS[@]}"; do
  name=${names[$i]} cfg=${CONFIGS[$i]} rd=$OUT/${names[$i]}
  run_dirs+=("$rd")
  (( DRY )) || mkdir -p "$rd"   # exists even if the job dies before its driver writes anything
  case "${drivers[$i]}" in
    train)
      cmd=(nemo-granular train --config "$cfg" "output_dir=$rd" "seed=$SEED" "${OVERRIDES[@]}") ;;
    grpo|sppo)
      section=grpo; [[ "${drivers[$i]}" == sppo ]] && section=ppo
      cmd=("${NRL_PY[@]}" -m "nemo_granular.run_${drivers[$i]}" --config "$cfg" "$section.seed=$SEED"
           "checkpointing.checkpoint_dir=$rd/checkpoints" "logger.log_dir=$rd/logs"
           logger.tensorboard_enabled=true "${OVERRIDES[@]}") ;;
  esac
  jid=$(WORKDIR=$WORKDIR BASE_LOG_DIR=${BASE_LOG_DIR:-$OUT/slurm-logs} run sbatch --parsable --nodes="$NODES" \
        --job-name="cmp-$name" --output="$OUT/slurm-%x-%j.out" "${SBATCH_ALL[@]}" "${SBATCH_TRAIN[@]}" \
        "$LAUNCH" "${cmd[@]}")
  jid=${jid%%;*}
  jobs+=("$jid")
  echo "submitted $name (${drivers[$i]}): job $jid -> $rd"
done

wrapped() {  # wrapped CMD... -> a --wrap script: cd WORKDIR, venv/setup, optional container
  local cmd prefix
  cmd=$(printf '%q ' "$@")
  prefix=$(printf 'cd %q && ' "$WORKDIR")
  [[ -n "${VENV:-}" ]] && prefix+=$(printf 'source %q/bin/activate && ' "$VENV")
  [[ -n "${SETUP_COMMAND:-}" ]] && prefix+="$SETUP_COMMAND && "
  if [[ -n "${CONTAINER:-}" ]]; then
    echo "srun --container-image=${CONTAINER} ${MOUNTS:+--container-mounts=$MOUNTS} --container-workdir=$WORKDIR --no-container-mount-home bash -c $(printf '%q' "$prefix$cmd")"
  else
    echo "exec bash -c $(printf '%q' "$prefix$cmd")"   # --wrap scripts run under /bin/sh
  fi
}

# benchmark evaluation: one job per run after its training job succeeded, on one node with the
# training jobs' resources (run_eval needs the GPUs); the report then also waits for these
if [[ -n "$EVAL_SUITE" ]]; then
  train_jobs=("${jobs[@]}")
  for i in "${!train_jobs[@]}"; do
    ejid=$(run sbatch --parsable --nodes=1 --dependency="afterok:${train_jobs[$i]}" --kill-on-invalid-dep=yes \
           --job-name="cmp-eval-${names[$i]}" --output="$OUT/slurm-%x-%j.out" "${SBATCH_ALL[@]}" "${SBATCH_TRAIN[@]}" \
           --wrap="$(wrapped nemo-granular eval-checkpoints "${run_dirs[$i]}" --suite "$EVAL_SUITE" "${EVAL_ARGS[@]}")")
    ejid=${ejid%%;*}
    jobs+=("$ejid")
    echo "submitted eval of ${names[$i]} (suite $EVAL_SUITE): job $ejid (after ${train_jobs[$i]})"
  done
fi

# the report: afterany, so a failed or cancelled run still gets a report of the others; its own
# small allocation (one task, no GPUs, a short time limit), not the training jobs' resources
dep=$(IFS=:; echo "${jobs[*]}")
wrap=$(wrapped nemo-granular compare --from-runs "${run_dirs[@]}" --out "$OUT/report")
rjid=$(run sbatch --parsable --nodes=1 --ntasks=1 --dependency="afterany:$dep" --kill-on-invalid-dep=no \
       --job-name=cmp-report --output="$OUT/slurm-%x-%j.out" "${SBATCH_ALL[@]}" "${SBATCH_REPORT[@]}" --wrap="$wrap")
rjid=${rjid%%;*}
echo "submitted report: job $rjid (after $dep) -> $OUT/report/report.md"
if (( DRY )); then
  echo "dry run: nothing submitted, nothing written ($OUT not created)"
else
  printf '%s\n' "${jobs[@]}" "$rjid" >"$OUT/job_ids.txt.tmp" && mv -f "$OUT/job_ids.txt.tmp" "$OUT/job_ids.txt"
fi
