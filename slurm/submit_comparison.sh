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
#   --train-sbatch "ARGS"  sbatch arguments for the training jobs only (--gres, --time, ...); a
#                          30B-A3B config's job (its file name has 30b_a3b) gets --signal=B:USR1@1800
#                          before them (launch.sh's default lead is 300 s; docs/slurm.md)
#   --report-sbatch "ARGS" sbatch arguments for the report job only
#                          (default "--time=00:30:00 --cpus-per-task=2")
#   --eval-suite SUITE     after each training job (afterok), an eval job on one whole node
#                          (--exclusive --mem=0, then --sbatch's and --train-sbatch's arguments)
#                          runs `nemo-granular eval-checkpoints RUN --suite SUITE`
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
# `submit_comparison: preflight: CONFIG: <the preflight's message>`). With CONTAINER these checks
# (and the staged-benchmarks check) run in the image, where the jobs run: one one-task container step
# (`srun --ntasks=1 --container-image=...`, launch.sh's mounts and environment rules); a step that
# cannot run them stops the submission (one line, exit 2). Environment:
# CONTAINER, MOUNTS, VENV, WORKDIR, ... are passed to slurm/launch.sh unchanged; NEMO_RL_PYTHON is
# how NeMo-RL drivers and the preflight start Python: default "uv run python", with CONTAINER
# "python" (the image's venv is first on its PATH; docs/slurm.md, "One launch story"). CONTAINER
# with a VENV the container would not have (outside MOUNTS, or its python linked outside them), or
# with UV_CACHE_DIR_OVERRIDE, is refused before anything is submitted (exit 2), as launch.sh refuses
# it in the job. Prints the job ids and the report path.
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
# in NeMo-RL's image `uv run` fails: it re-syncs the project (the image installed NeMo-RL from /opt/nemo-rl,
# a checkout mounted elsewhere is built again, offline that needs setuptools from an index) and needs a
# writable cache (under pyxis HOME is an empty directory in a read-only root); the image's PATH has
# NeMo-RL's venv first, so its `python` is the driver's environment
if [[ -n "${CONTAINER:-}" ]]; then NEMO_RL_PYTHON=${NEMO_RL_PYTHON:-python}; else NEMO_RL_PYTHON=${NEMO_RL_PYTHON:-uv run python}; fi
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
STAGING_PY='
import sys
from pathlib import Path
from nemo_granular.evals.staging import staging_refusal
line = staging_refusal(sys.argv[1], Path(sys.argv[2]) if sys.argv[2] else None)
if line:
    print(line, file=sys.stderr)
sys.exit(3 if line else 0)'

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

# pyxis, as launch.sh runs its steps: --container-env gets CONTAINER_ENV and a NEMO_RL_VENV_DIR set
# for the job; in the container the checkout this script is in (on the shared file system, in
# MOUNTS) is on PYTHONPATH, a host uv cache path is unset, and NG_CONTAINER / NG_MOUNTS / NG_VENV say
# where it runs (the preflight's runtime checks, eval-checkpoints' default launcher)
container_env() {
  local e=${CONTAINER_ENV:-}
  [[ -n "${NEMO_RL_VENV_DIR:-}" && ",$e," != *",NEMO_RL_VENV_DIR,"* ]] && e=${e:+$e,}NEMO_RL_VENV_DIR
  printf '%s' "$e"
}
container_prelude() {
  # shellcheck disable=SC2016  # expanded in the container
  printf 'unset UV_CACHE_DIR && export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH} NG_CONTAINER=%q NG_MOUNTS=%q NG_VENV=%q && ' \
    "$NG_ROOT" "$CONTAINER" "${MOUNTS:-}" "${VENV:-}"
}
container_caches() {
  # under pyxis HOME is an empty read-only directory: the eval and report jobs' compile caches (vLLM's
  # for run_eval, Triton's, torch-inductor's) and, where HOME cannot be written, XDG_CACHE_HOME,
  # MEGATRON_CONFIG_LOCK_DIR (the export's Megatron-Bridge locks in ~/.cache/huggingface otherwise),
  # job-scoped in the container's /tmp, as launch.sh gives its steps; a value that reached the container
  # (yours) is kept. Not in the submission's check step: it compiles nothing, and a `uv run` there
  # (NEMO_RL_PYTHON) must fail with uv's own reason, not find a fresh cache and fail later
  # shellcheck disable=SC2016  # expanded in the container
  printf '%s' 'ng_c=/tmp/nemo-granular-${SLURM_JOB_ID:-$$} && export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ng_c/triton} ' \
    'VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$ng_c/vllm} TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ng_c/torchinductor} && ' \
    '{ [[ -d "${HOME:-}" && -w "${HOME:-}" ]] || export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$ng_c/cache} ' \
    'MEGATRON_CONFIG_LOCK_DIR=${MEGATRON_CONFIG_LOCK_DIR:-$ng_c/megatron-config-locks}; } && '
}
ray_token() {
  # run_eval's local Ray (NeMo-RL's init_ray: a plain ray.init()) writes a fresh token to ~/.ray/auth_token
  # (Ray 2.60, token auth): under pyxis HOME is read-only (it fails), on bare metal it is the shared home
  # whose token later plain ray.init() calls pick up. A job-scoped one on the node instead, only the
  # job's user's, unless you gave one
  # shellcheck disable=SC2016  # expanded in the job
  printf '%s' 'ng_t=/tmp/nemo-granular-${SLURM_JOB_ID:-$$} && { [[ -n "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]] || ' \
    '{ mkdir -p "$ng_t" && (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d " \n" >"$ng_t/ray_auth_token") ' \
    '&& export RAY_AUTH_TOKEN_PATH=$ng_t/ray_auth_token; }; } && '
}

# The checks before anything is submitted, all at once (each is mostly NeMo-RL's import, tens of
# seconds): the staged benchmarks (key "staging") and the preflight of every NeMo-RL config (key: its
# index). Here, or with CONTAINER in the image, where the jobs will run them: one one-task container
# step (srun from here: a small allocation of its own). Each check's exit status and stderr come
# back framed on the step's stdout ("@@ng-check KEY RC", then its lines) into $PF_TMP/KEY.rc, KEY.err.
CHECK_KEYS=() CHECK_CMDS=()
if [[ -n "$EVAL_SUITE" && "$PREFLIGHT" != 0 ]] && (( NRL_RUNS )) \
    && { [[ -n "$EVAL_DATA_DIR" ]] || is_on "${HF_HUB_OFFLINE:-}" || is_on "${HF_DATASETS_OFFLINE:-}"; }; then
  CHECK_KEYS+=(staging)
  # shellcheck disable=SC2016  # expanded where the check runs
  CHECK_CMDS+=("$(printf 'PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH} exec' "$NG_ROOT")$(printf ' %q' "${NRL_PY[@]}" -c "$STAGING_PY" "$EVAL_SUITE" "$EVAL_DATA_DIR")")
fi
if (( NRL_RUNS )) && [[ "$PREFLIGHT" != 0 ]]; then
  for i in "${!CONFIGS[@]}"; do
    [[ "${drivers[$i]}" == train ]] && continue
    run_args "$i"
    extra=()
    [[ " ${OVERRIDES[*]} " == *" cluster.num_nodes="* ]] || extra+=("cluster.num_nodes=$NODES")
    [[ -n "$TRAIN_GPUS" && " ${OVERRIDES[*]} " != *" cluster.gpus_per_node="* ]] && extra+=("cluster.gpus_per_node=$TRAIN_GPUS")
    CHECK_KEYS+=("$i")
    CHECK_CMDS+=("$(printf 'NG_TIME_LIMIT=%q exec' "$TRAIN_TIME")$(printf ' %q' "${NRL_PY[@]}" -m nemo_granular preflight \
      --driver "${drivers[$i]}" "${CONFIGS[$i]}" "${RUN_CMD[@]:${#NRL_PY[@]}+4}" "${extra[@]}")")
  done
fi
checks_script() {  # the bash that runs CHECK_CMDS at once in WORKDIR (scratch files in $d), then prints the frames
  local k s
  for k in "${!CHECK_KEYS[@]}"; do
    s+="(cd $(printf %q "$WORKDIR") && ${CHECK_CMDS[$k]}) >/dev/null 2>\"\$d/$k.err\" & p$k=\$!"$'\n'
  done
  for k in "${!CHECK_KEYS[@]}"; do
    s+="rc=0; wait \"\$p$k\" || rc=\$?; echo \"@@ng-check ${CHECK_KEYS[$k]} \$rc\"; cat \"\$d/$k.err\""$'\n'
  done
  printf '%s' "$s"
}
preflight_problems() {  # preflight_problems STDERR_FILE: the problems, one a line (as slurm/launch.sh)
  local lines
  lines=$(sed -n 's/^preflight: error: //p' "$1" 2>/dev/null)
  [[ -n "$lines" ]] || lines=$(sed -n 's/^nemo-granular preflight: \(error: \)\{0,1\}//p' "$1" 2>/dev/null)
  [[ -n "$lines" ]] || lines=$(grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 3)
  if [[ -n "$lines" ]]; then printf '%s\n' "$lines"; fi
}
if (( ${#CHECK_KEYS[@]} )); then
  PF_TMP=$(mktemp -d "${TMPDIR:-/tmp}/submit_comparison.XXXXXX")
  trap 'rm -rf "$PF_TMP"' EXIT
  step_rc=0
  if [[ -n "${CONTAINER:-}" ]]; then
    step=(srun --nodes=1 --ntasks=1 --job-name=cmp-preflight "${SBATCH_ALL[@]}" "--container-image=$CONTAINER"
          "--container-workdir=$WORKDIR" --no-container-mount-home)
    [[ -n "${MOUNTS:-}" ]] && step+=("--container-mounts=$MOUNTS")
    cenv=$(container_env)
    [[ -n "$cenv" ]] && step+=("--container-env=$cenv")
    # shellcheck disable=SC2016  # expanded in the container
    "${step[@]}" bash -c "$(container_prelude)"'d=$(mktemp -d /tmp/ng-checks.XXXXXX) || exit 1'$'\n'"$(checks_script)"$'\nrm -rf "$d"\n' \
      >"$PF_TMP/frames" 2>"$PF_TMP/step.err" || step_rc=$?
    where="in the image" how="in the image (srun --container-image=$CONTAINER exited $step_rc)"
  else
    mkdir "$PF_TMP/run"
    d=$PF_TMP/run bash -c "$(checks_script)" >"$PF_TMP/frames" 2>"$PF_TMP/step.err" || step_rc=$?
    where="here" how="here (exit $step_rc)"
  fi
  awk -v dir="$PF_TMP" '/^@@ng-check [^ ]+ [0-9]+$/ { f = dir "/" $2 ".err"; print $3 > (dir "/" $2 ".rc"); printf "" > f; next }
                         f != "" { print > f }' "$PF_TMP/frames"
  for key in "${CHECK_KEYS[@]}"; do
    if [[ ! -s "$PF_TMP/$key.rc" ]]; then
      # the step's own last line, not srun's account of its exit
      why=$(cat "$PF_TMP/step.err" "$PF_TMP/frames" 2>/dev/null | grep -v -e '^[[:space:]]*$' -e '^srun: ' | tail -n 1)
      [[ -n "$why" ]] || why=$(grep -v '^[[:space:]]*$' "$PF_TMP/step.err" 2>/dev/null | tail -n 1)
      die "preflight: the checks could not run $how: ${why:-no output}; nothing submitted"
    fi
  done
  if [[ -f "$PF_TMP/staging.rc" ]]; then
    # 3: a benchmark is not staged (refused); any other failure: this interpreter cannot run the check (the
    # eval job's own preflight checks the staged data again in its container): say so and go on
    staged=$(<"$PF_TMP/staging.rc")
    why=$(grep -v '^[[:space:]]*$' "$PF_TMP/staging.err" | tail -n 1 || true)
    if (( staged == 3 )); then die "$why"; fi
    (( staged == 0 )) || echo "submit_comparison: warning: --eval-suite $EVAL_SUITE: could not check the staged" \
      "benchmarks $where ($why); the eval jobs check them before evaluating" >&2
  fi
  bad=0
  for i in "${!CONFIGS[@]}"; do
    [[ -f "$PF_TMP/$i.rc" ]] || continue
    (( $(<"$PF_TMP/$i.rc") == 0 )) && continue
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
  # the USR1 lead before the time limit must hold the current step and the save: launch.sh's 300 s
  # cannot for a 30B-A3B run (a step of 10-15 min, then a save), so 30 min there. Before the user's
  # sbatch arguments: a --signal of theirs wins (sbatch: the last one)
  lead=()
  base=$(basename "${CONFIGS[$i]}")
  [[ "${base,,}" == *30b_a3b* ]] && lead=(--signal=B:USR1@1800)
  jid=$(WORKDIR=$WORKDIR PREFLIGHT=$PREFLIGHT BASE_LOG_DIR=${BASE_LOG_DIR:-$OUT/slurm-logs} run sbatch --parsable \
        --nodes="$NODES" --job-name="cmp-$name" --output="$OUT/slurm-%x-%j.out" "${lead[@]}" "${SBATCH_ALL[@]}" \
        "${SBATCH_TRAIN[@]}" "$LAUNCH" "${RUN_CMD[@]}")
  jid=${jid%%;*}
  jobs+=("$jid")
  echo "submitted $name (${drivers[$i]}): job $jid -> $rd"
done

wrapped() {  # wrapped nemo-granular ARGS... -> a --wrap script: cd WORKDIR, venv/setup, optional container
  # (CHECK: a command run first in the same place, e.g. the eval preflight; the job stops if it fails)
  local cmd prefix mounts=${MOUNTS:-} env_arg
  cmd=$(printf '%q ' "$@")
  prefix=$(printf 'cd %q && ' "$WORKDIR")$(ray_token)
  [[ -n "${VENV:-}" ]] && prefix+=$(printf 'source %q/bin/activate && ' "$VENV")
  [[ -n "${SETUP_COMMAND:-}" ]] && prefix+="$SETUP_COMMAND && "
  if [[ -n "${CONTAINER:-}" ]]; then
    # the image has NeMo-RL's environment but no nemo-granular: the checkout this script is in on
    # PYTHONPATH, `python -m nemo_granular`, NG_CONTAINER (eval-checkpoints then starts run_eval with the
    # image's python, not `uv run`), as launch.sh does for its steps (container_prelude)
    shift
    cmd="python -m nemo_granular $(printf '%q ' "$@")"
    [[ -n "${CHECK:-}" ]] && cmd="$CHECK && $cmd"
    prefix="$(container_prelude)$(container_caches)$prefix"
    env_arg=$(container_env)
    echo "srun --container-image=${CONTAINER} ${mounts:+--container-mounts=$mounts} --container-workdir=$WORKDIR --no-container-mount-home${env_arg:+ --container-env=$env_arg} bash -c $(printf '%q' "$prefix$cmd")"
  else
    # (the check's nemo_granular: this checkout, as in the container; eval-checkpoints: the installed one)
    [[ -n "${CHECK:-}" ]] && cmd="PYTHONPATH=$(printf '%q' "$NG_ROOT")\${PYTHONPATH:+:\$PYTHONPATH} $CHECK && $cmd"
    echo "exec bash -c $(printf '%q' "$prefix$cmd")"   # --wrap scripts run under /bin/sh
  fi
}

# benchmark evaluation: one job per run after its training job succeeded, on one whole node with the
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
  # the whole node and all its memory: the eval job exports each Megatron checkpoint (a 30B model's
  # bfloat16 weights alone are about 57 GiB) and runs vLLM, and with only --nodes=1 it got a site's
  # default memory (DefMemPerCPU: one CPU's). Before --sbatch/--train-sbatch, so that a --mem of
  # theirs wins (sbatch: the last one); no --mem=0 with their --mem-per-cpu/--mem-per-gpu (sbatch
  # refuses two of them)
  eval_node=(--exclusive --mem=0)
  for a in "${SBATCH_ALL[@]}" "${SBATCH_TRAIN[@]}"; do [[ "$a" == --mem-per-* ]] && eval_node=(--exclusive); done
  train_jobs=("${jobs[@]}")
  for i in "${!train_jobs[@]}"; do
    nrl=()
    [[ "${drivers[$i]}" == train ]] || nrl=(--nemo-rl "$NEMO_RL_DIR")
    CHECK=""
    [[ "${drivers[$i]}" == train ]] || CHECK="python -m nemo_granular.preflight.eval_checks $(printf '%q ' \
      --eval-suite "$EVAL_SUITE" --run "${run_dirs[$i]}" "${nrl[@]}" "${check_opts[@]}")"
    CHECK=${CHECK% }
    ejid=$(run sbatch --parsable --nodes=1 --dependency="afterok:${train_jobs[$i]}" --kill-on-invalid-dep=yes \
           --job-name="cmp-eval-${names[$i]}" --output="$OUT/slurm-%x-%j.out" "${eval_node[@]}" "${SBATCH_ALL[@]}" "${SBATCH_TRAIN[@]}" \
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
