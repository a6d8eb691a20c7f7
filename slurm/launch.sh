#!/usr/bin/env bash
#SBATCH --job-name=nemo-granular
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#
# nemo-granular multi-node launcher: Ray cluster over the allocation + one driver command.
#
#   sbatch [--nodes=N --time=... --partition=... --account=...] /path/to/slurm/launch.sh \
#       python -m nemo_granular.run_grpo --config examples/configs/espo_qwen3_30b_a3b_megatron.yaml key=value ...
#   sbatch ... slurm/launch.sh nemo-granular train --config examples/configs/local/smoke.yaml output_dir=runs/x
#
# (or COMMAND="..." instead of arguments). Submit from any directory: the driver runs in WORKDIR
# (default: the submit directory), so relative config paths mean what they meant where you typed
# sbatch. Full reference: docs/slurm.md. What it does:
#   1. a Ray head on the first node and one Ray worker per other node (srun steps), each with the
#      node's CPUs and GPUs (GPU count from the node's GRES), inside CONTAINER (pyxis) or VENV;
#   2. waits until every node has joined (`ray.nodes()` count printed and saved), then runs the
#      driver on the head node with RAY_ADDRESS set;
#   3. watches Ray and every srun step: a lost node, a dead Ray step or a dead driver fails the job
#      within seconds with one clear ERROR line (no hang);
#   4. USR1 (sent by Slurm --signal=B:USR1@300 before the time limit, or by
#      `scancel --signal=USR1 --batch JOBID`) is forwarded to the driver, which saves a checkpoint
#      and exits 99; the launcher then requeues the job, and the requeued job resumes.
# Logs: $BASE_LOG_DIR/<job name>-<job id>/ (launcher.log, ray-head.log, ray-worker-<node>.log,
# driver.log, watch.log, ray_nodes.json, status.json), appended across requeues.
set -euo pipefail

# ------------------------------------------------------------------ settings (environment) ------
WORKDIR=${WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}
BASE_LOG_DIR=${BASE_LOG_DIR:-$WORKDIR/slurm-logs}
CONTAINER=${CONTAINER:-}            # pyxis/enroot image (.sqsh or registry ref); empty: run on the host
MOUNTS=${MOUNTS:-}                  # pyxis --container-mounts, comma list src:dst[:ro]
VENV=${VENV:-}                      # virtual environment activated on every node (host or container)
SETUP_COMMAND=${SETUP_COMMAND:-}    # shell run on every node before Ray starts
GPUS_PER_NODE=${GPUS_PER_NODE:-}    # default: the node's GRES gpu count (0 without GRES)
CPUS_PER_NODE=${CPUS_PER_NODE:-}    # CPUs each Ray node advertises; default: Slurm's CPUs on the node
RAY_PORT=${RAY_PORT:-6379}
RAY_TMP_BASE=${RAY_TMP_BASE:-/tmp}  # Ray's --temp-dir is $RAY_TMP_BASE/rayng<jobid>_<node>
RAY_WAIT_TIMEOUT=${RAY_WAIT_TIMEOUT:-600}
WATCH_INTERVAL=${WATCH_INTERVAL:-5}
DRIVER_STOP_GRACE=${DRIVER_STOP_GRACE:-20}  # seconds between SIGTERM and SIGKILL when failing
AUTO_RESUME=${AUTO_RESUME:-1}       # add --auto-resume to `nemo-granular train`
CLUSTER_OVERRIDES=${CLUSTER_OVERRIDES:-1}  # add cluster.num_nodes/gpus_per_node to run_grpo/run_sppo
MAX_RESTARTS=${MAX_RESTARTS:-20}    # stop requeueing after this many restarts
START_RAY=${START_RAY:-auto}        # 1/0; auto: 0 only for `nemo-granular train` on one node
PREEMPT_SIGNAL=${PREEMPT_SIGNAL:-USR1}  # what the driver receives when the job is preempted
PREEMPT_EXIT_CODE=99                # the driver's "preempted, checkpoint saved" exit code

# ------------------------------------------------------------------ helpers ---------------------
ts() { date -u '+%Y-%m-%dT%H:%M:%SZ'; }
log() { echo "[launch $(ts)] $*"; }
err() { echo "[launch $(ts)] ERROR: $*" >&2; }

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  err "not inside a Slurm job: submit with sbatch (see docs/slurm.md)"
  exit 2
fi

# Where this script's repository is: sbatch runs a copy from the spool directory, so ask Slurm for
# the submitted path (NG_ROOT overrides).
if [[ -z "${NG_ROOT:-}" ]]; then
  submitted=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^Command=//p' | head -n1 || true)
  if [[ -n "$submitted" && -f "$submitted" ]]; then
    NG_ROOT=$(cd "$(dirname "$submitted")/.." && pwd)
  else
    NG_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  fi
fi
if [[ ! -f "$NG_ROOT/slurm/ray_cluster.py" ]]; then
  err "cannot find the nemo-granular checkout (looked in $NG_ROOT); set NG_ROOT=/path/to/nemo-granular"
  exit 2
fi

ATTEMPT=${SLURM_RESTART_COUNT:-0}
LOG_DIR=${LOG_DIR:-$BASE_LOG_DIR/${SLURM_JOB_NAME:-job}-$SLURM_JOB_ID}
mkdir -p "$LOG_DIR"
# everything the launcher says also goes to launcher.log
exec > >(tee -a "$LOG_DIR/launcher.log") 2>&1
log "=== job $SLURM_JOB_ID attempt $ATTEMPT on $(hostname) nodes=$SLURM_JOB_NODELIST logs=$LOG_DIR"

# ------------------------------------------------------------------ bookkeeping, exit -----------
declare -A STEP_PIDS=()   # name -> srun pid
DRIVER_PID=""
SIGNALED=""
FINAL_RC=""
FINAL_REASON=""

write_status() {  # write_status RC REASON  (status.json, atomic; REASON JSON-escaped)
  local tmp="$LOG_DIR/.status.json.$$" reason
  reason=$(printf '%s' "$2" | tr -d '\000-\037')
  reason=${reason//\\/\\\\}
  reason=${reason//\"/\\\"}
  printf '{"job_id": "%s", "attempt": %s, "exit_code": %s, "reason": "%s", "time": "%s", "nodes": %s}\n' \
    "$SLURM_JOB_ID" "$ATTEMPT" "$1" "$reason" "$(ts)" "${NNODES:-0}" >"$tmp"
  mv -f "$tmp" "$LOG_DIR/status.json"
}

stop_pid() {  # stop_pid PID GRACE  (TERM, wait up to GRACE s, KILL)
  local pid=$1 grace=$2 i
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
  disown "$pid" 2>/dev/null || true   # no "Killed <command>" job notice from bash; status not needed
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < grace * 5; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
}

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  local rc=$?
  trap - EXIT USR1 TERM INT
  [[ -n "$FINAL_RC" ]] && rc=$FINAL_RC
  (( ${#STEP_PIDS[@]} )) && log "stopping the Ray steps (srun reports them as killed; that is expected)"
  stop_pid "$DRIVER_PID" "$DRIVER_STOP_GRACE"
  local name
  for name in "${!STEP_PIDS[@]}"; do stop_pid "${STEP_PIDS[$name]}" 5; done
  write_status "$rc" "${FINAL_REASON:-exit $rc}"
  log "=== job $SLURM_JOB_ID attempt $ATTEMPT ends: exit $rc (${FINAL_REASON:-})"
  exit "$rc"
}
trap cleanup EXIT

fail() {  # fail REASON [RC=1]  -> one clear ERROR line, exit RC (cleanup stops everything)
  FINAL_RC=${2:-1}; FINAL_REASON=$1
  err "$1"
  exit "$FINAL_RC"
}

# shellcheck disable=SC2317  # run by the signal traps
on_signal() {  # forward the preemption / time-limit signal to the driver once
  local sig=$1
  [[ -n "$SIGNALED" ]] && return 0
  SIGNALED=$sig
  log "received SIG$sig: sending SIG$PREEMPT_SIGNAL to the driver (save a checkpoint and stop)"
  if [[ -n "$DRIVER_PID" ]] && kill -0 "$DRIVER_PID" 2>/dev/null; then
    kill "-$PREEMPT_SIGNAL" "$DRIVER_PID" 2>/dev/null || true   # srun forwards it to the task
  fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

# ------------------------------------------------------------------ the driver command ----------
if (( $# > 0 )); then
  CMD=("$@")
elif [[ -n "${COMMAND:-}" ]]; then
  CMD=(bash -c "$COMMAND")
else
  fail "no driver command: pass it after the script (sbatch slurm/launch.sh python -m ...) or set COMMAND" 2
fi
joined=" ${CMD[*]} "
IS_TRAIN=0; IS_NEMO_RL=0
if [[ "$joined" =~ (nemo-granular|nemo_granular)[[:space:]]+train[[:space:]] ]]; then IS_TRAIN=1; fi
if [[ "$joined" =~ nemo_granular\.run_(grpo|sppo) ]]; then IS_NEMO_RL=1; fi
if [[ "$START_RAY" == auto ]]; then START_RAY=1; (( IS_TRAIN && SLURM_JOB_NUM_NODES == 1 )) && START_RAY=0; fi
# `train --resume` is strict (an error without a checkpoint); --auto-resume starts fresh on the first
# attempt and resumes on a requeued one
if (( IS_TRAIN && AUTO_RESUME )) && [[ "$joined" != *" --resume "* && "$joined" != *" --auto-resume "* && "$joined" != *" --force "* ]]; then
  CMD+=(--auto-resume)
fi

# ------------------------------------------------------------------ nodes, CPUs, GPUs -----------
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${#NODES[@]}
HEAD=${NODES[0]}
WORKERS=("${NODES[@]:1}")

node_field() {  # node_field NODE FIELD -> value of FIELD= in `scontrol show node -o`
  scontrol show node -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n1
}
GRES=$(node_field "$HEAD" Gres || true)
GRES_GPUS=0
if [[ "$GRES" =~ gpu(:[A-Za-z0-9_.-]+)?:([0-9]+) ]]; then GRES_GPUS=${BASH_REMATCH[2]}; fi
GRES_ARGS=()
if (( GRES_GPUS > 0 )); then
  if [[ -n "$GPUS_PER_NODE" && "$GPUS_PER_NODE" != "$GRES_GPUS" ]]; then
    fail "GPUS_PER_NODE=$GPUS_PER_NODE but node $HEAD has GRES $GRES ($GRES_GPUS GPUs); unset GPUS_PER_NODE or make them equal" 2
  fi
  GPUS_PER_NODE=$GRES_GPUS
  GRES_ARGS=("--gres=gpu:$GRES_GPUS")
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-0}
if [[ -z "$CPUS_PER_NODE" ]]; then
  CPUS_PER_NODE=${SLURM_CPUS_ON_NODE:-$(node_field "$HEAD" CPUTot)}
fi
[[ "$CPUS_PER_NODE" =~ ^[0-9]+$ ]] || fail "cannot determine CPUs per node; set CPUS_PER_NODE" 2

if [[ -n "${HEAD_IP:-}" ]]; then :
else
  HEAD_IP=$(getent ahostsv4 "$HEAD" 2>/dev/null | awk 'NR==1{print $1}' || true)
  [[ -n "$HEAD_IP" ]] || HEAD_IP=$(hostname -I | awk '{print $1}')
fi
RAY_ADDRESS_HEAD="$HEAD_IP:$RAY_PORT"
log "nodes=${NODES[*]} head=$HEAD ($RAY_ADDRESS_HEAD) gpus_per_node=$GPUS_PER_NODE (gres='${GRES:-none}') cpus_per_node=$CPUS_PER_NODE"
log "container=${CONTAINER:-none} venv=${VENV:-none} workdir=$WORKDIR ng_root=$NG_ROOT"

# ------------------------------------------------------------------ per-node environment --------
NODE_ENV=$LOG_DIR/node_env.sh
{
  echo "# generated by slurm/launch.sh for job $SLURM_JOB_ID (sourced by every step)"
  printf 'cd %q\n' "$WORKDIR"
  [[ -n "$VENV" ]] && printf 'source %q/bin/activate\n' "$VENV"
  # shellcheck disable=SC2016  # expanded on the node, not here
  printf 'export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH}\n' "$NG_ROOT"
  printf 'export NG_NUM_NODES=%q NG_GPUS_PER_NODE=%q NG_LOG_DIR=%q\n' "$NNODES" "$GPUS_PER_NODE" "$LOG_DIR"
  echo 'export RAY_DISABLE_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0'
  [[ -n "$SETUP_COMMAND" ]] && printf '%s\n' "$SETUP_COMMAND"
  echo ':'
} >"$NODE_ENV"

SRUN_COMMON=(--overlap --ntasks-per-node=1 --kill-on-bad-exit=1 "${GRES_ARGS[@]}")
if [[ -n "$CONTAINER" ]]; then
  SRUN_COMMON+=("--container-image=$CONTAINER" "--container-workdir=$WORKDIR" --no-container-mount-home)
  [[ -n "$MOUNTS" ]] && SRUN_COMMON+=("--container-mounts=$MOUNTS")
fi
RAY_TMP=$RAY_TMP_BASE/rayng${SLURM_JOB_ID}
RAY_COMMON="--block --disable-usage-stats --num-cpus=$CPUS_PER_NODE --num-gpus=$GPUS_PER_NODE"

# a step is "up" while its srun client lives; any dead step is fatal unless we are stopping anyway
check_steps() {
  local name pid rc
  for name in "${!STEP_PIDS[@]}"; do
    pid=${STEP_PIDS[$name]}
    if ! kill -0 "$pid" 2>/dev/null; then
      rc=0; wait "$pid" 2>/dev/null || rc=$?
      unset "STEP_PIDS[$name]"
      [[ -n "$SIGNALED" ]] && continue
      case "$name" in
        watch)
          fail "$(grep -h 'ERROR' "$LOG_DIR/watch.log" 2>/dev/null | tail -n1 | sed 's/^.*ERROR: //' || true) (Ray watchdog exit $rc; see $LOG_DIR/watch.log)" ;;
        *)
          fail "the $name step exited (code $rc): a node or its Ray process died; see $LOG_DIR/$name.log" ;;
      esac
    fi
  done
}

nap() { sleep "$1" & wait $! 2>/dev/null || true; }  # interruptible by traps

# one task on the head node (readiness probe, watchdog, driver)
PROBE=(srun "${SRUN_COMMON[@]}" --nodes=1 --ntasks=1 -w "$HEAD")

start_ray_cluster() {  # steps 1-4: head, workers, wait for every node, watchdog
  # ------------------------------------------------------------------ 1. Ray head -----------------
  srun "${SRUN_COMMON[@]}" --nodes=1 --ntasks=1 -w "$HEAD" --output="$LOG_DIR/ray-head.log" --open-mode=append \
    bash -c "source '$NODE_ENV' && exec ray start --head --node-ip-address=$HEAD_IP --port=$RAY_PORT \
      --include-dashboard=false --temp-dir=${RAY_TMP}_head $RAY_COMMON" &
  STEP_PIDS[ray-head]=$!
  log "starting the Ray head on $HEAD (srun pid ${STEP_PIDS[ray-head]})"
  deadline=$((SECONDS + RAY_WAIT_TIMEOUT))
  until timeout 2 bash -c "exec 3<>/dev/tcp/$HEAD_IP/$RAY_PORT" 2>/dev/null; do
    check_steps
    (( SECONDS < deadline )) || fail "the Ray head did not open $RAY_ADDRESS_HEAD within ${RAY_WAIT_TIMEOUT}s (see $LOG_DIR/ray-head.log)"
    [[ -z "$SIGNALED" ]] || fail "signalled (SIG$SIGNALED) before the Ray cluster was up; nothing to checkpoint"
    nap 1
  done
  log "Ray head is listening on $RAY_ADDRESS_HEAD"

  # ------------------------------------------------------------------ 2. Ray workers --------------
  if (( NNODES > 1 )); then
    wlist=$(IFS=,; echo "${WORKERS[*]}")
    srun "${SRUN_COMMON[@]}" --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) -w "$wlist" \
      --output="$LOG_DIR/ray-worker-%N.log" --open-mode=append \
      bash -c "source '$NODE_ENV' && for i in \$(seq 1 20); do
          ray start --address=$RAY_ADDRESS_HEAD --temp-dir=${RAY_TMP}_\$(hostname) $RAY_COMMON && exit 0
          echo \"ray start failed (try \$i), retrying\"; sleep 3
        done; exit 1" &
    STEP_PIDS[ray-workers]=$!
    log "starting Ray workers on ${WORKERS[*]} (srun pid ${STEP_PIDS[ray-workers]})"
  fi

  # ------------------------------------------------------------------ 3. wait for every node ------
  "${PROBE[@]}" --output="$LOG_DIR/ray-wait.log" --open-mode=append bash -c "source '$NODE_ENV' && exec python '$NG_ROOT/slurm/ray_cluster.py' wait \
    --address=$RAY_ADDRESS_HEAD --expected=$NNODES --timeout=$RAY_WAIT_TIMEOUT --out='$LOG_DIR/ray_nodes.json'" &
  wait_pid=$!
  while kill -0 "$wait_pid" 2>/dev/null; do
    check_steps
    [[ -z "$SIGNALED" ]] || fail "signalled (SIG$SIGNALED) before the Ray cluster was up; nothing to checkpoint"
    nap 1
  done
  wait_rc=0; wait "$wait_pid" || wait_rc=$?
  (( wait_rc == 0 )) || fail "$(grep -h 'ERROR' "$LOG_DIR/ray-wait.log" | tail -n1 || echo "Ray readiness probe failed") (exit $wait_rc; see $LOG_DIR/ray-wait.log)"
  log "$(grep -h '^RAY_NODES' "$LOG_DIR/ray-wait.log" | tail -n1)"

  # ------------------------------------------------------------------ 4. watchdog -----------------
  "${PROBE[@]}" --output="$LOG_DIR/watch.log" --open-mode=append bash -c "source '$NODE_ENV' && exec python '$NG_ROOT/slurm/ray_cluster.py' watch \
    --address=$RAY_ADDRESS_HEAD --expected=$NNODES --interval=$WATCH_INTERVAL" &
  STEP_PIDS[watch]=$!
}

if (( START_RAY )); then
  start_ray_cluster
else
  log "START_RAY=0: no Ray cluster (single-node driver that does not use Ray)"
fi

# ------------------------------------------------------------------ 5. driver -------------------
if (( IS_NEMO_RL && CLUSTER_OVERRIDES )) && [[ "$joined" != *"cluster.num_nodes="* ]]; then
  CMD+=("cluster.num_nodes=$NNODES")
  (( GPUS_PER_NODE > 0 )) && [[ "$joined" != *"cluster.gpus_per_node="* ]] && CMD+=("cluster.gpus_per_node=$GPUS_PER_NODE")
fi
DRIVER_SH=$LOG_DIR/driver.sh
{
  echo "# generated by slurm/launch.sh for job $SLURM_JOB_ID attempt $ATTEMPT"
  printf 'source %q\n' "$NODE_ENV"
  (( START_RAY )) && printf 'export RAY_ADDRESS=%q\n' "$RAY_ADDRESS_HEAD"
  printf 'export NG_SLURM_ATTEMPT=%q\n' "$ATTEMPT"
  printf 'exec'; printf ' %q' "${CMD[@]}"; printf '\n'
} >"$DRIVER_SH"
{ echo "=== job $SLURM_JOB_ID attempt $ATTEMPT $(ts): ${CMD[*]}"; } >>"$LOG_DIR/driver.log"
log "driver: ${CMD[*]}"
"${PROBE[@]}" --output="$LOG_DIR/driver.log" --open-mode=append bash "$DRIVER_SH" &
DRIVER_PID=$!

while kill -0 "$DRIVER_PID" 2>/dev/null; do
  check_steps
  nap 2
done
DRIVER_RC=0; wait "$DRIVER_PID" || DRIVER_RC=$?
DRIVER_PID=""
log "driver exited with code $DRIVER_RC${SIGNALED:+ after SIG$SIGNALED}"

# ------------------------------------------------------------------ 6. outcome ------------------
if (( DRIVER_RC == 0 )); then
  FINAL_RC=0; FINAL_REASON="driver finished"
  exit 0
fi
if (( DRIVER_RC == PREEMPT_EXIT_CODE )) || [[ "$SIGNALED" == "USR1" ]]; then
  if [[ "$SIGNALED" == "TERM" || "$SIGNALED" == "INT" ]]; then
    # scancel / Slurm's own preemption: Slurm decides whether the job comes back (PreemptMode=REQUEUE)
    FINAL_RC=0; FINAL_REASON="checkpoint saved after SIG$SIGNALED; not requeued by the launcher"
    exit 0
  fi
  if (( DRIVER_RC != PREEMPT_EXIT_CODE )); then
    # e.g. the signal came before the driver installed its handler: the time limit is near anyway,
    # so come back and resume from whatever checkpoint the driver has
    err "the driver did not confirm a checkpoint after SIGUSR1 (exit $DRIVER_RC); requeueing to resume from its latest checkpoint"
  fi
  if (( ATTEMPT >= MAX_RESTARTS )); then
    fail "preempted but MAX_RESTARTS=$MAX_RESTARTS reached; not requeueing"
  fi
  FINAL_RC=0; FINAL_REASON="preempted (driver exit $DRIVER_RC): requeued, attempt $((ATTEMPT + 1)) will resume from the latest checkpoint"
  log "stopping the Ray steps"
  for name in "${!STEP_PIDS[@]}"; do stop_pid "${STEP_PIDS[$name]}" 5; unset "STEP_PIDS[$name]"; done
  write_status 0 "$FINAL_REASON"
  log "$FINAL_REASON"
  scontrol requeue "$SLURM_JOB_ID" || fail "scontrol requeue $SLURM_JOB_ID failed (submit with --requeue)"
  exit 0
fi
fail "the driver exited with code $DRIVER_RC (see $LOG_DIR/driver.log): $(grep -v '^===' "$LOG_DIR/driver.log" | tail -n 3 | tr '\n' ' ' | cut -c1-400)"
