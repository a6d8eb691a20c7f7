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
#                          report waits for it (default: no eval jobs). For NeMo-RL runs the job
#                          first runs `python -m nemo_granular.preflight.eval_checks` where
#                          eval-checkpoints runs (in its container): the staged benchmarks of
#                          --data-dir, the interpreter that exports the run's Megatron checkpoints
#   --eval-args "ARGS"     extra eval-checkpoints arguments (e.g. "--data-dir /data/benchmarks"). With
#                          HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set or a --data-dir, the suite's benchmarks
#                          must be staged there before anything is submitted (one line, exit 2)
#   --nemo-rl DIR          the NeMo-RL checkout in which the eval jobs run NeMo-RL's run_eval
#                          (default: $NEMO_RL_SRC, else WORKDIR when it is one, as in the launch story)
#   --no-preflight         do not run `nemo-granular preflight` on the NeMo-RL configs, nor the
#                          staged-benchmarks check, before submitting (also PREFLIGHT=0, which the
#                          training jobs then get too)
#   --dry-run              print the sbatch commands; submit nothing, write nothing
# Overrides after `--` go to every run. Before anything is submitted, each NeMo-RL config is checked
# with `$NEMO_RL_PYTHON -m nemo_granular preflight` (in WORKDIR, with the run's overrides and
# allocation; all configs at once); a problem stops the submission (exit 1, one line per problem:
# `submit_comparison: preflight: CONFIG: <the preflight's message>`). Environment:
# CONTAINER, MOUNTS, VENV, WORKDIR, ... are passed to slurm/launch.sh unchanged; NEMO_RL_PYTHON
# (default "uv run python") is how NeMo-RL drivers start Python (docs/slurm.md, "One launch
# story"). CONTAINER with a VENV the container would not have (outside MOUNTS, or its python
# linked outside them), or with UV_CACHE_DIR_OVERRIDE, is refused before anything is submitted
# (exit 2), as launch.sh refuses it in the job. Prints the job ids and the report path.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LAUNCH=$HERE/launch.sh
NG_ROOT=$(cd "$HERE/.." && pwd)

OUT="" SEED=0 NODES=2 DRIVER=auto DRY=0 EVAL_SUITE="" NEMO_RL_DIR=${NEMO_RL_SRC:-} PREFLIGHT=${PREFLIGHT:-1}
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
    --nemo-rl) NEMO_RL_DIR=$2; shift 2 ;;
    --no-preflight) PREFLIGHT=0; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '/^set -euo/q; 2,$p' "$0"; exit 0 ;;
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

# CONTAINER + VENV: the eval and report jobs (and every step of the training jobs, which launch.sh
# refuses there) activate VENV inside the container, where only MOUNTS exist (no $HOME): refuse a
# VENV the container would not have now, before anything is submitted (launch.sh's rules)
in_mounts() {  # in_mounts PATH: is PATH (host view) under the source of one of MOUNTS?
  local spec src
  local -a specs=()
  IFS=, read -r -a specs <<<"${MOUNTS:-}"
  for spec in "${specs[@]}"; do
    src=${spec%%:*}; src=${src%/}
    [[ -n "$src" ]] && [[ "$1" == "$src" || "$1" == "$src"/* ]] && return 0
  done
  return 1
}
# UV_CACHE_DIR_OVERRIDE (ray.sub's) would be mounted over the image's /root/.cache/uv, into which NeMo-RL's
# image links its venvs (uv sync --link-mode symlink): every step's `import torch` would fail
if [[ -n "${CONTAINER:-}" && -n "${UV_CACHE_DIR_OVERRIDE:-}" ]]; then
  die "UV_CACHE_DIR_OVERRIDE with CONTAINER hides the image's /root/.cache/uv (its venvs link there); unset it"
fi
if [[ -n "${CONTAINER:-}" && -n "${VENV:-}" ]]; then
  venv_py=$(readlink -m "$VENV/bin/python")
  keep="With CONTAINER, leave VENV unset (the image's environment runs the jobs; docs/slurm.md)"
  if [[ -z "${MOUNTS:-}" ]]; then
    [[ -z "${HOME:-}" || "$venv_py" != "$HOME"/* ]] || die "VENV=$VENV: its python is a link to $venv_py, under \$HOME, which the container does not have (--no-container-mount-home). $keep"
  elif ! in_mounts "$VENV"; then
    die "VENV=$VENV is not inside MOUNTS=$MOUNTS: the container does not have it. $keep"
  elif [[ -e "$venv_py" && "$venv_py" != /usr/* ]] && ! in_mounts "$venv_py"; then
    die "VENV=$VENV: its python is a link to $venv_py, outside MOUNTS ($MOUNTS): in the container (no \$HOME: --no-container-mount-home) it does not exist. $keep"
  fi
fi

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

# the eval jobs of NeMo-RL runs run NeMo-RL's run_eval in its checkout: find it now, not in the job
NRL_RUNS=0
for d in "${drivers[@]}"; do [[ "$d" == train ]] || NRL_RUNS=1; done
if [[ -n "$EVAL_SUITE" ]] && (( NRL_RUNS )); then
  if [[ -z "$NEMO_RL_DIR" && -f "$WORKDIR/examples/run_eval.py" && -d "$WORKDIR/nemo_rl" ]]; then NEMO_RL_DIR=$WORKDIR; fi
  [[ -n "$NEMO_RL_DIR" ]] || die "--eval-suite: the eval jobs run NeMo-RL's run_eval and need its checkout: give --nemo-rl DIR (or set NEMO_RL_SRC, or WORKDIR to the checkout)"
  [[ "$NEMO_RL_DIR" = /* ]] || NEMO_RL_DIR=$PWD/$NEMO_RL_DIR
  [[ -f "$NEMO_RL_DIR/examples/run_eval.py" ]] || die "--nemo-rl $NEMO_RL_DIR: not a NeMo-RL checkout (no examples/run_eval.py)"
fi

# the eval jobs' benchmarks, before anything is submitted: where the jobs cannot download them
# (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) or --eval-args gives --data-dir, each must be staged there;
# else every eval job failed after all the training steps (one line, exit 2; --no-preflight skips it)
EVAL_DATA_DIR=""
for ((k = 0; k < ${#EVAL_ARGS[@]}; k++)); do
  case "${EVAL_ARGS[$k]}" in
    --data-dir) EVAL_DATA_DIR=${EVAL_ARGS[$((k + 1))]:-} ;;
    --data-dir=*) EVAL_DATA_DIR=${EVAL_ARGS[$k]#--data-dir=} ;;
  esac
done
is_on() { [[ "${1,,}" =~ ^(1|true|yes|on)$ ]]; }
if [[ -n "$EVAL_SUITE" && "$PREFLIGHT" != 0 ]] && (( NRL_RUNS )) \
    && { [[ -n "$EVAL_DATA_DIR" ]] || is_on "${HF_HUB_OFFLINE:-}" || is_on "${HF_DATASETS_OFFLINE:-}"; }; then
  staged=0
  why=$(cd "$WORKDIR" && PYTHONPATH=$NG_ROOT${PYTHONPATH:+:$PYTHONPATH} "${NRL_PY[@]}" -c '
import sys
from pathlib import Path
from nemo_granular.evals.staging import staging_refusal
line = staging_refusal(sys.argv[1], Path(sys.argv[2]) if sys.argv[2] else None)
print(line or "")
sys.exit(3 if line else 0)' "$EVAL_SUITE" "$EVAL_DATA_DIR" 2>&1) || staged=$?
  # 3: a benchmark is not staged (refused); any other failure: this interpreter cannot run the check (the
  # eval job's own preflight checks the staged data again in its container): say so and go on
  if (( staged == 3 )); then die "$(tail -n 1 <<<"$why")"; fi
  (( staged == 0 )) || echo "submit_comparison: warning: --eval-suite $EVAL_SUITE: could not check the staged" \
    "benchmarks here ($(tail -n 1 <<<"$why")); the eval jobs check them before evaluating" >&2
fi

# the allocation every training job will have, for the preflight (launch.sh adds the same overrides)
TRAIN_GPUS="" TRAIN_TIME=""
for a in "${SBATCH_TRAIN[@]}"; do
  if [[ "$a" =~ ^--gres=(.*,)?gpu(:[A-Za-z0-9_.-]+)?:([0-9]+) ]]; then TRAIN_GPUS=${BASH_REMATCH[3]}
  elif [[ "$a" =~ ^--gpus-per-node=([0-9]+)$ ]]; then TRAIN_GPUS=${BASH_REMATCH[1]}
  elif [[ "$a" =~ ^--time=(.+)$ ]]; then TRAIN_TIME=${BASH_REMATCH[1]}; fi
done
run_args() {  # run_args I -> the driver command of config I, one word per line in RUN_CMD
  local i=$1 rd=$OUT/${names[$1]} section=grpo
  case "${drivers[$i]}" in
    train)
      RUN_CMD=(nemo-granular train --config "${CONFIGS[$i]}" "output_dir=$rd" "seed=$SEED" "${OVERRIDES[@]}") ;;
    grpo|sppo)
      [[ "${drivers[$i]}" == sppo ]] && section=ppo
      RUN_CMD=("${NRL_PY[@]}" -m "nemo_granular.run_${drivers[$i]}" --config "${CONFIGS[$i]}" "$section.seed=$SEED"
               "checkpointing.checkpoint_dir=$rd/checkpoints" "logger.log_dir=$rd/logs"
               logger.tensorboard_enabled=true "${OVERRIDES[@]}") ;;
  esac
}

# preflight: every NeMo-RL config checked before anything is submitted, all at once (each check is
# mostly NeMo-RL's import, tens of seconds); stderr of each in a temporary directory, removed at exit
preflight_problems() {  # preflight_problems STDERR_FILE: the problems, one a line (as slurm/launch.sh)
  local lines
  lines=$(sed -n 's/^preflight: error: //p' "$1" 2>/dev/null)
  [[ -n "$lines" ]] || lines=$(sed -n 's/^nemo-granular preflight: \(error: \)\{0,1\}//p' "$1" 2>/dev/null)
  [[ -n "$lines" ]] || lines=$(grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 3)
  if [[ -n "$lines" ]]; then printf '%s\n' "$lines"; fi
}
if (( NRL_RUNS )) && [[ "$PREFLIGHT" != 0 ]]; then
  PF_TMP=$(mktemp -d "${TMPDIR:-/tmp}/submit_comparison.XXXXXX")
  trap 'rm -rf "$PF_TMP"' EXIT
  pf_pids=()
  for i in "${!CONFIGS[@]}"; do
    [[ "${drivers[$i]}" == train ]] && continue
    run_args "$i"
    extra=()
    [[ " ${OVERRIDES[*]} " == *" cluster.num_nodes="* ]] || extra+=("cluster.num_nodes=$NODES")
    [[ -n "$TRAIN_GPUS" && " ${OVERRIDES[*]} " != *" cluster.gpus_per_node="* ]] && extra+=("cluster.gpus_per_node=$TRAIN_GPUS")
    (cd "$WORKDIR" && NG_TIME_LIMIT=$TRAIN_TIME exec "${NRL_PY[@]}" -m nemo_granular preflight --driver "${drivers[$i]}" "${CONFIGS[$i]}" \
       "${RUN_CMD[@]:${#NRL_PY[@]}+4}" "${extra[@]}" >/dev/null 2>"$PF_TMP/$i.err") &
    pf_pids[i]=$!
  done
  bad=0
  for i in "${!pf_pids[@]}"; do
    wait "${pf_pids[$i]}" && continue
    bad=1
    while IFS= read -r line; do
      [[ -n "$line" ]] && echo "submit_comparison: preflight: ${CONFIGS[$i]}: $line" >&2
    done < <(preflight_problems "$PF_TMP/$i.err")
  done
  if (( bad )); then
    echo "submit_comparison: nothing submitted; fix the configs (nemo-granular preflight CONFIG shows the plan) or pass --no-preflight" >&2
    exit 1
  fi
fi
(( DRY )) || mkdir -p "$OUT"

run() {  # run CMD... -> prints the job id (or, with --dry-run, the command and a placeholder id)
  if (( DRY )); then printf '%q ' "$@" >&2; echo >&2; echo "DRYRUN$RANDOM"; return; fi
  "$@"
}

jobs=() run_dirs=()
for i in "${!CONFIGS[@]}"; do
  name=${names[$i]} rd=$OUT/${names[$i]}
  run_dirs+=("$rd")
  (( DRY )) || mkdir -p "$rd"   # exists even if the job dies before its driver writes anything
  run_args "$i"
  jid=$(WORKDIR=$WORKDIR PREFLIGHT=$PREFLIGHT BASE_LOG_DIR=${BASE_LOG_DIR:-$OUT/slurm-logs} run sbatch --parsable \
        --nodes="$NODES" --job-name="cmp-$name" --output="$OUT/slurm-%x-%j.out" "${SBATCH_ALL[@]}" "${SBATCH_TRAIN[@]}" \
        "$LAUNCH" "${RUN_CMD[@]}")
  jid=${jid%%;*}
  jobs+=("$jid")
  echo "submitted $name (${drivers[$i]}): job $jid -> $rd"
done

wrapped() {  # wrapped nemo-granular ARGS... -> a --wrap script: cd WORKDIR, venv/setup, optional container
  # (CHECK: a command run first in the same place, e.g. the eval preflight; the job stops if it fails)
  local cmd prefix mounts=${MOUNTS:-} env_arg=""
  cmd=$(printf '%q ' "$@")
  prefix=$(printf 'cd %q && ' "$WORKDIR")
  [[ -n "${VENV:-}" ]] && prefix+=$(printf 'source %q/bin/activate && ' "$VENV")
  [[ -n "${SETUP_COMMAND:-}" ]] && prefix+="$SETUP_COMMAND && "
  if [[ -n "${CONTAINER:-}" ]]; then
    # the image has NeMo-RL's environment but no nemo-granular: the checkout this script is in
    # (on the shared file system, in MOUNTS) on PYTHONPATH, `python -m nemo_granular`, as launch.sh
    # does for its steps; no host uv cache path inside the container
    shift
    cmd="python -m nemo_granular $(printf '%q ' "$@")"
    [[ -n "${CHECK:-}" ]] && cmd="$CHECK && $cmd"
    # shellcheck disable=SC2016  # expanded in the container
    prefix="unset UV_CACHE_DIR && export PYTHONPATH=$(printf '%q' "$NG_ROOT")\${PYTHONPATH:+:\$PYTHONPATH} && $prefix"
    [[ -n "${NEMO_RL_VENV_DIR:-}" ]] && env_arg=" --container-env=NEMO_RL_VENV_DIR"
    echo "srun --container-image=${CONTAINER} ${mounts:+--container-mounts=$mounts} --container-workdir=$WORKDIR --no-container-mount-home$env_arg bash -c $(printf '%q' "$prefix$cmd")"
  else
    # (the check's nemo_granular: this checkout, as in the container; eval-checkpoints: the installed one)
    [[ -n "${CHECK:-}" ]] && cmd="PYTHONPATH=$(printf '%q' "$NG_ROOT")\${PYTHONPATH:+:\$PYTHONPATH} $CHECK && $cmd"
    echo "exec bash -c $(printf '%q' "$prefix$cmd")"   # --wrap scripts run under /bin/sh
  fi
}

# benchmark evaluation: one job per run after its training job succeeded, on one node with the
# training jobs' resources (run_eval needs the GPUs); the report then also waits for these
if [[ -n "$EVAL_SUITE" ]]; then
  # the eval preflight (nemo_granular.preflight.eval_checks) runs first in each eval job, in its
  # container: the staged benchmarks of --data-dir, the interpreter that exports the run's Megatron
  # checkpoints (--run: checked when the run has one); a problem fails the job before any export
  check_opts=()
  for ((k = 0; k < ${#EVAL_ARGS[@]}; k++)); do
    case "${EVAL_ARGS[$k]}" in
      --data-dir|--export-python) check_opts+=("${EVAL_ARGS[$k]}" "${EVAL_ARGS[$((k + 1))]:-}"); k=$((k + 1)) ;;
      --data-dir=*|--export-python=*) check_opts+=("${EVAL_ARGS[$k]}") ;;
    esac
  done
  train_jobs=("${jobs[@]}")
  for i in "${!train_jobs[@]}"; do
    nrl=()
    [[ "${drivers[$i]}" == train ]] || nrl=(--nemo-rl "$NEMO_RL_DIR")
    CHECK=""
    [[ "${drivers[$i]}" == train ]] || CHECK="python -m nemo_granular.preflight.eval_checks $(printf '%q ' \
      --eval-suite "$EVAL_SUITE" --run "${run_dirs[$i]}" "${nrl[@]}" "${check_opts[@]}")"
    CHECK=${CHECK% }
    ejid=$(run sbatch --parsable --nodes=1 --dependency="afterok:${train_jobs[$i]}" --kill-on-invalid-dep=yes \
           --job-name="cmp-eval-${names[$i]}" --output="$OUT/slurm-%x-%j.out" "${SBATCH_ALL[@]}" "${SBATCH_TRAIN[@]}" \
           --wrap="$(wrapped nemo-granular eval-checkpoints "${run_dirs[$i]}" --suite "$EVAL_SUITE" "${nrl[@]}" "${EVAL_ARGS[@]}")")
    ejid=${ejid%%;*}
    jobs+=("$ejid")
    echo "submitted eval of ${names[$i]} (suite $EVAL_SUITE): job $ejid (after ${train_jobs[$i]})"
  done
  CHECK=""
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
