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
#   0. for `run_grpo` / `run_sppo`: `nemo-granular preflight` on the final command line (PREFLIGHT=0
#      skips it), so a config NeMo-RL would reject fails the job before any node starts Ray;
#   1. a Ray head on the first node and one Ray worker per other node (srun steps), each with the
#      node's CPUs and the job's GPUs per node (its --gres request; without GRES the head node's GPU
#      devices), inside CONTAINER (pyxis; the head's steps share the named container
#      `ray-head-<job id>`, as in NeMo-RL's ray.sub, removed at the end) or VENV, with one Ray
#      token-auth mode and token for every Ray process, ray.sub's fixed ports and `ulimit -n`;
#   2. waits until every node has joined (`ray.nodes()` count printed and saved), then runs the
#      driver on the head node with RAY_ADDRESS set (without the step's SLURM_*/PMI* variables);
#   3. watches Ray and every srun step: a dead Ray step, a dead driver or a Ray head that stops
#      answering fails the job within seconds with one clear ERROR line (no hang); a lost node
#      requeues it (within MAX_RESTARTS);
#   4. USR1 to the batch shell (Slurm's --signal=B:USR1@300, 300 s before the time limit, or
#      `scancel --signal=USR1 --batch JOBID`, which slurm/stop.sh JOBID sends) is forwarded to the
#      driver, which saves a checkpoint at the end of its current step and exits 99; the launcher then
#      requeues the job, and the requeued job resumes. Before the time limit that save is in time only
#      if the current step and the save end within the 300 s; for NeMo-RL runs the driver's time
#      budget (less of the job left than its longest recent step plus its last save, or
#      checkpointing.checkpoint_must_save_by) starts the last save earlier, and a driver that
#      stops that way by itself with exit 99 is requeued the same way. SIGTERM (plain scancel,
#      preemption, the time limit itself) reaches every step: the embedded trainer saves after its
#      step if that fits in KillWait/GraceTime (exit 99; the launcher does not requeue, Slurm
#      decides); a NeMo-RL run does not save (the Ray steps die of the same SIGTERM under its
#      driver), and a job that Slurm requeues resumes from the last periodic checkpoint. Before Ray
#      starts, one log line says what a preemption costs this job, from the site's PreemptMode,
#      PreemptParameters and the partition's GraceTime (docs/slurm.md, "Preemption").
# Logs: $BASE_LOG_DIR/<job name>-<job id>/ (launcher.log, ray-head.log, ray-worker-<node>.log,
# driver.log, watch.log, preflight.log, ray_nodes.json, status.json), appended across requeues.
set -euo pipefail

# ------------------------------------------------------------------ settings (environment) ------
WORKDIR=${WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}
BASE_LOG_DIR=${BASE_LOG_DIR:-$WORKDIR/slurm-logs}
CONTAINER=${CONTAINER:-}            # pyxis/enroot image (.sqsh or registry ref); empty: run on the host
MOUNTS=${MOUNTS:-}                  # pyxis --container-mounts, comma list src:dst[:ro]
VENV=${VENV:-}                      # virtual environment activated on every node (host; with CONTAINER only one inside MOUNTS)
CONTAINER_ENV=${CONTAINER_ENV:-}    # CONTAINER: variables whose host value beats the image's (pyxis --container-env)
SETUP_COMMAND=${SETUP_COMMAND:-}    # shell run on every node before Ray starts
GPUS_PER_NODE=${GPUS_PER_NODE:-}    # default: the GPUs per node the job asked for (--gres/--gpus-per-node), else the node's GRES, else the head's GPU devices
NG_GPU_DEVICE_GLOB=${NG_GPU_DEVICE_GLOB:-/dev/nvidia[0-9]*}  # the GPU devices counted without GRES (nvidia-smi -L's count)
CPUS_PER_NODE=${CPUS_PER_NODE:-}    # CPUs each Ray node advertises; default: Slurm's CPUs on the node
# Ray's ports as NeMo-RL's ray.sub pins them, all below 9000: the kernel hands out ephemeral source
# ports from 9000 up on some clusters, and a Ray port picked at random can collide with one
RAY_PORT=${RAY_PORT:-1200}          # GCS of the head
RAY_CLIENT_SERVER_PORT=${RAY_CLIENT_SERVER_PORT:-1201}
NODE_MANAGER_PORT=${NODE_MANAGER_PORT:-1301}
OBJECT_MANAGER_PORT=${OBJECT_MANAGER_PORT:-1303}
RUNTIME_ENV_AGENT_PORT=${RUNTIME_ENV_AGENT_PORT:-1305}
DASHBOARD_AGENT_GRPC_PORT=${DASHBOARD_AGENT_GRPC_PORT:-1307}
METRICS_EXPORT_PORT=${METRICS_EXPORT_PORT:-1309}
DASHBOARD_AGENT_LISTEN_PORT=${DASHBOARD_AGENT_LISTEN_PORT:-1311}
MIN_WORKER_PORT=${MIN_WORKER_PORT:-2000}
MAX_WORKER_PORT=${MAX_WORKER_PORT:-2999}
NOFILE_LIMIT=${NOFILE_LIMIT:-65535} # soft `ulimit -n` on every node (Ray's large-cluster advice, as ray.sub)
UV_CACHE_DIR_OVERRIDE=${UV_CACHE_DIR_OVERRIDE:-}  # refused with CONTAINER (NeMo-RL's image needs its /root/.cache/uv)
RAY_TMP_BASE=${RAY_TMP_BASE:-/tmp}  # Ray's --temp-dir is $RAY_TMP_BASE/rayng<jobid>_<node>
RAY_WAIT_TIMEOUT=${RAY_WAIT_TIMEOUT:-1800}  # includes each node's import of CONTAINER (ray.sub gives its workers 1800 s)
RAY_HEAD_TRIES=${RAY_HEAD_TRIES:-3}  # starts of a Ray head that exits before Ray says "Ray runtime started."
WATCH_INTERVAL=${WATCH_INTERVAL:-5}
RAY_WATCH_FAILURES=${RAY_WATCH_FAILURES:-3}  # the watchdog fails after this many failed ray.nodes() probes in a row
DRIVER_STOP_GRACE=${DRIVER_STOP_GRACE:-20}  # seconds between SIGTERM and SIGKILL when failing
AUTO_RESUME=${AUTO_RESUME:-1}       # add --auto-resume to `nemo-granular train`
CLUSTER_OVERRIDES=${CLUSTER_OVERRIDES:-1}  # add cluster.num_nodes/gpus_per_node to run_grpo/run_sppo
MAX_RESTARTS=${MAX_RESTARTS:-100}   # stop requeueing after this many restarts (docs/slurm.md: sized for 500 steps of the 30B pair)
START_RAY=${START_RAY:-auto}        # 1/0; auto: 0 only for `nemo-granular train` on one node
PREFLIGHT=${PREFLIGHT:-1}           # 0: skip `nemo-granular preflight` before a run_grpo/run_sppo job
PREEMPT_SIGNAL=${PREEMPT_SIGNAL:-USR1}  # what the driver receives when the job is preempted
DRIVER_HANDLES_PREEMPT=${DRIVER_HANDLES_PREEMPT:-auto}  # 1/0; auto: 1 for nemo-granular train, run_grpo, run_sppo
PREEMPT_RESEND=${PREEMPT_RESEND:-10}  # seconds between repeats of PREEMPT_SIGNAL until the driver stops
PREEMPT_EXIT_CODE=99                # the driver's "stopped early, checkpoint saved: requeue me" exit code

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
# (tee ignores SIGTERM: scancel and preemption send it to the whole batch step, and a dead tee
# would end the launcher with SIGPIPE while the driver is still saving)
exec > >(trap '' TERM INT; exec tee -a "$LOG_DIR/launcher.log") 2>&1
log "=== job $SLURM_JOB_ID attempt $ATTEMPT on $(hostname) nodes=$SLURM_JOB_NODELIST logs=$LOG_DIR"

# ------------------------------------------------------------------ bookkeeping, exit -----------
declare -A STEP_PIDS=()   # name -> srun pid
DRIVER_PID=""
SIGNALED=""
FINAL_RC=""
FINAL_REASON=""
CONTAINER_NAMES=()        # with CONTAINER: the job's named pyxis containers (remove_containers)

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

# shellcheck disable=SC2317  # also run by the EXIT trap
remove_containers() {  # remove the job's named containers on every node: pyxis keeps named ones
  (( ${#CONTAINER_NAMES[@]} )) || return 0
  local names=() n node script pids=() pid
  # enroot's names for them: pyxis_<name> (container_scope=global, pyxis' default), pyxis_<job
  # id>_<name> (container_scope=job, whose epilog removes them too); only those that exist. A node
  # without enroot has none; a failure is a warning: the job's outcome is decided already
  for n in "${CONTAINER_NAMES[@]}"; do names+=("pyxis_$n" "pyxis_${SLURM_JOB_ID}_$n"); done
  log "removing the job's containers (${CONTAINER_NAMES[*]}) on ${NODES[*]}"
  CONTAINER_NAMES=()
  # shellcheck disable=SC2016  # expanded on the node, not here
  script='command -v enroot >/dev/null || exit 0
enroot list 2>/dev/null | grep -Fx'$(printf ' -e %q' "${names[@]}")' | while read -r c; do
  enroot remove -f "$c" </dev/null >/dev/null || echo "WARNING: enroot remove -f $c failed on $(hostname)"
done; exit 0'
  for node in "${NODES[@]}"; do   # a step per node: a node that is gone does not stop the others'
    timeout 120 srun --overlap --nodes=1 --ntasks=1 -w "$node" bash -c "$script" &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
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
  remove_containers
  log "=== job $SLURM_JOB_ID attempt $ATTEMPT ends: exit $rc (${FINAL_REASON:-})"
  exit "$rc"
}
trap cleanup EXIT

fail() {  # fail REASON [RC=1]  -> one clear ERROR line, exit RC (cleanup stops everything)
  FINAL_RC=${2:-1}; FINAL_REASON=$1
  err "$1"
  exit "$FINAL_RC"
}

NEXT_RESEND=0
HEAD_LOG_FROM=1   # where the Ray head's current start begins in ray-head.log (start_ray_cluster)
forward_preempt() {  # PREEMPT_SIGNAL to the driver step (srun hands it to every process of the step)
  if [[ -n "$DRIVER_PID" ]] && kill -0 "$DRIVER_PID" 2>/dev/null; then
    kill "-$PREEMPT_SIGNAL" "$DRIVER_PID" 2>/dev/null || true
  fi
  NEXT_RESEND=$((SECONDS + PREEMPT_RESEND))
}

# shellcheck disable=SC2317  # run by the signal traps
on_signal() {  # forward the preemption / time-limit signal to the driver (every time it comes)
  local sig=$1
  [[ -n "$SIGNALED" ]] || SIGNALED=$sig
  log "received SIG$sig: sending SIG$PREEMPT_SIGNAL to the driver (save a checkpoint and stop)"
  forward_preempt
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

# ------------------------------------------------------------------ the driver command ----------
if (( $# > 0 )); then
  CMD=("$@")
elif [[ -n "${COMMAND:-}" ]]; then
  # a plain list of words is taken as the command's arguments (so the launcher can add to them and
  # find the Python and config of a NeMo-RL driver); shell syntax (or NAME=value first) runs under bash -c.
  # ~ is shell syntax only as a home directory (~, ~/..., also after =): ~key.path is a Hydra delete
  if [[ "$COMMAND" =~ [\;\&\|\<\>\$\`\"\'\\\(\)\*\?\#] || "$COMMAND" =~ (^|[[:space:]=])~(/|[[:space:]]|$) \
        || "$COMMAND" =~ ^[[:space:]]*[A-Za-z_][A-Za-z0-9_]*= || "$COMMAND" == *$'\n'* ]]; then
    CMD=(bash -c "$COMMAND")
  else
    read -r -a CMD <<<"$COMMAND"
  fi
else
  fail "no driver command: pass it after the script (sbatch slurm/launch.sh python -m ...) or set COMMAND" 2
fi
joined=" ${CMD[*]} "
IS_TRAIN=0; IS_NEMO_RL=0
if [[ "$joined" =~ (nemo-granular|nemo_granular)[[:space:]]+train[[:space:]] ]]; then IS_TRAIN=1; fi
if [[ "$joined" =~ nemo_granular\.run_(grpo|sppo) ]]; then IS_NEMO_RL=1; fi
if [[ "$START_RAY" == auto ]]; then START_RAY=1; (( IS_TRAIN && SLURM_JOB_NUM_NODES == 1 )) && START_RAY=0; fi
if [[ "$DRIVER_HANDLES_PREEMPT" == auto ]]; then DRIVER_HANDLES_PREEMPT=$(( IS_TRAIN || IS_NEMO_RL )); fi
add_args() {  # add_args ARG...: append to the driver's command line (inside a bash -c string too)
  if [[ "${CMD[0]}" == bash && "${CMD[1]:-}" == -c && ${#CMD[@]} -eq 3 ]]; then
    CMD[2]+=$(printf ' %q' "$@")
  else
    CMD+=("$@")
  fi
}
# `train --resume` is strict (an error without a checkpoint); --auto-resume starts fresh on the first
# attempt and resumes on a requeued one
if (( IS_TRAIN && AUTO_RESUME )) && [[ "$joined" != *" --resume "* && "$joined" != *" --auto-resume "* && "$joined" != *" --force "* ]]; then
  add_args --auto-resume
fi
# run_grpo / run_sppo: the Python that starts them (`uv run python`, `python`, ...), their config
# and overrides, for the preflight. The drivers take every word but --config as a Hydra override
# (key=value, +key=value, ~key), and so does the preflight
PY_PREFIX=(); PF_CONFIG=""; PF_OVERRIDES=(); PF_DRIVER=""
for ((i = 0; i + 1 < ${#CMD[@]}; i++)); do
  if [[ "${CMD[i]}" == -m && "${CMD[i+1]}" =~ ^nemo_granular\.run_(grpo|sppo)$ ]]; then
    PY_PREFIX=("${CMD[@]:0:i}"); PF_DRIVER=${BASH_REMATCH[1]}
    for ((j = i + 2; j < ${#CMD[@]}; j++)); do
      case "${CMD[j]}" in
        --config) PF_CONFIG=${CMD[j+1]:-}; j=$((j + 1)) ;;
        --config=*) PF_CONFIG=${CMD[j]#--config=} ;;
        -*) ;;
        *) PF_OVERRIDES+=("${CMD[j]}") ;;
      esac
    done
    break
  fi
done

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
# what the job asked for per node (--gres=gpu:N, --gpus-per-node=N): under --exclusive a 4-GPU
# job on an 8-GPU node holds the whole node, and the node's GRES would give Ray 8 GPUs
JOB_GPUS=""
job_tres=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^TresPerNode=//p' | head -n1 || true)
if [[ "$job_tres" =~ gpu(:[A-Za-z0-9_.-]+)?[:=]([0-9]+) ]]; then JOB_GPUS=${BASH_REMATCH[2]}; fi
REQ_GPUS=${JOB_GPUS:-$GRES_GPUS}
GRES_ARGS=()
if (( REQ_GPUS > 0 )); then
  if [[ -n "$GPUS_PER_NODE" && "$GPUS_PER_NODE" != "$REQ_GPUS" ]]; then
    if [[ -n "$JOB_GPUS" ]]; then have="the job asked for $JOB_GPUS GPUs per node"; else have="node $HEAD has GRES $GRES ($GRES_GPUS GPUs)"; fi
    fail "GPUS_PER_NODE=$GPUS_PER_NODE but $have; unset GPUS_PER_NODE or make them equal" 2
  fi
  GPUS_PER_NODE=$REQ_GPUS
  GRES_ARGS=("--gres=gpu:$REQ_GPUS")
fi
GPU_SOURCE=""
if [[ -z "$GPUS_PER_NODE" ]]; then
  # a site without GRES: neither the job nor the node says, and Ray got --num-gpus=0 on GPU nodes.
  # The batch shell runs on the head node: count its GPU devices (/dev/nvidiactl and
  # /dev/nvidia-uvm are not GPUs), as nvidia-smi -L would; none: 0
  mapfile -t gpu_devices < <(compgen -G "$NG_GPU_DEVICE_GLOB" || true)
  GPUS_PER_NODE=${#gpu_devices[@]}
  GPU_SOURCE=" from $GPUS_PER_NODE GPU devices ($NG_GPU_DEVICE_GLOB) on the head node"
fi
if [[ -z "$CPUS_PER_NODE" ]]; then
  CPUS_PER_NODE=${SLURM_CPUS_ON_NODE:-$(node_field "$HEAD" CPUTot)}
fi
[[ "$CPUS_PER_NODE" =~ ^[0-9]+$ ]] || fail "cannot determine CPUs per node; set CPUS_PER_NODE" 2
[[ "$RAY_WATCH_FAILURES" =~ ^[1-9][0-9]*$ ]] || fail "RAY_WATCH_FAILURES=$RAY_WATCH_FAILURES: must be a number >= 1" 2

if [[ -z "${HEAD_IP:-}" ]]; then
  # not a loopback address: Debian/Ubuntu's /etc/hosts maps a machine's own name to 127.0.1.1,
  # and Ray workers on other nodes cannot join a head bound there. The batch shell runs on the head.
  HEAD_IP=$(getent ahostsv4 "$HEAD" 2>/dev/null | awk '$1 !~ /^127\./ {print $1; exit}' || true)
  [[ -n "$HEAD_IP" ]] || HEAD_IP=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9]+(\.[0-9]+){3}$' | grep -v '^127\.' | head -n1 || true)
  [[ -n "$HEAD_IP" ]] || fail "no non-loopback IPv4 address for the head node $HEAD (getent ahostsv4, hostname -I); set HEAD_IP" 2
fi
RAY_ADDRESS_HEAD="$HEAD_IP:$RAY_PORT"
log "nodes=${NODES[*]} head=$HEAD ($RAY_ADDRESS_HEAD) gpus_per_node=$GPUS_PER_NODE (job asked: ${JOB_GPUS:-none}, node gres: '${GRES:-none}')$GPU_SOURCE cpus_per_node=$CPUS_PER_NODE"
log "container=${CONTAINER:-none} venv=${VENV:-none} workdir=$WORKDIR ng_root=$NG_ROOT"

# ------------------------------------------------------------------ container checks -----------
# Under pyxis only MOUNTS exist in the container (the steps run with --no-container-mount-home).
# A VENV made on the host links its python to an interpreter outside it (uv's managed Pythons
# live under $HOME): that link dangles in the container and every step fails ("bad interpreter").
in_mounts() {  # in_mounts PATH: is PATH (host view) under the source of one of MOUNTS?
  local p=$1 spec src
  local -a specs=()
  IFS=, read -r -a specs <<<"$MOUNTS"
  for spec in "${specs[@]}"; do
    src=${spec%%:*}; src=${src%/}
    [[ -n "$src" ]] && [[ "$p" == "$src" || "$p" == "$src"/* ]] && return 0
  done
  return 1
}
if [[ -n "$CONTAINER" && -z "$MOUNTS" ]]; then
  # site-wide enroot mounts (mounts.d) are not visible from here: nothing to check against
  log "WARNING: CONTAINER without MOUNTS: the launcher cannot check that $NG_ROOT and $BASE_LOG_DIR${VENV:+ and VENV=$VENV} exist in the container"
  py=$(readlink -m "${VENV:-/nonexistent}/bin/python")
  if [[ -n "$VENV" && -n "${HOME:-}" && "$py" == "$HOME"/* ]]; then
    fail "VENV=$VENV: its python is a link to $py, under \$HOME, which the container does not have (--no-container-mount-home). With CONTAINER, leave VENV unset (the image's environment runs the job; docs/slurm.md)" 2
  fi
elif [[ -n "$CONTAINER" ]]; then
  for p in "$NG_ROOT" "$BASE_LOG_DIR"; do   # (WORKDIR may be the image's, e.g. /opt/nemo-rl)
    rp=$(readlink -m "$p")
    in_mounts "$p" || in_mounts "$rp" || fail "CONTAINER: $p is not inside MOUNTS=$MOUNTS; the steps could not see it (add it to MOUNTS)" 2
  done
  if [[ -n "$VENV" ]]; then
    py=$(readlink -m "$VENV/bin/python")
    if ! in_mounts "$VENV"; then
      fail "VENV=$VENV is not inside MOUNTS=$MOUNTS: the container does not have it. With CONTAINER, leave VENV unset (the image's environment runs the job; docs/slurm.md)" 2
    elif [[ -e "$py" && "$py" != /usr/* ]] && ! in_mounts "$py"; then   # (/usr: the image's base system too)
      fail "VENV=$VENV: its python is a link to $py, outside MOUNTS (${MOUNTS}): in the container (no \$HOME: --no-container-mount-home) it does not exist. With CONTAINER, leave VENV unset (the image's environment runs the job; docs/slurm.md)" 2
    fi
  fi
fi
if [[ -n "$CONTAINER" && -n "$UV_CACHE_DIR_OVERRIDE" ]]; then
  # ray.sub mounts it at /root/.cache/uv, but NeMo-RL's image builds its venvs with `uv sync --link-mode
  # symlink` (docker/Dockerfile): their packages are links into /root/.cache/uv, and a mount over it
  # hides them (`import torch` fails in every step)
  fail "UV_CACHE_DIR_OVERRIDE with CONTAINER hides the image's /root/.cache/uv (its venvs link there); unset it" 2
fi
if [[ -n "$CONTAINER" ]]; then
  # pyxis: the image's values of these win over the host's unless named in --container-env; a
  # NEMO_RL_VENV_DIR set for the job (where its worker venvs were built) must reach NeMo-RL
  [[ -n "${NEMO_RL_VENV_DIR:-}" && ",$CONTAINER_ENV," != *",NEMO_RL_VENV_DIR,"* ]] && CONTAINER_ENV=${CONTAINER_ENV:+$CONTAINER_ENV,}NEMO_RL_VENV_DIR
fi

# ------------------------------------------------------------------ Ray token authentication -----
# Ray 2.60 picks the auth mode per process when RAY_AUTH_MODE is unset: `ray start --head` and
# `ray.init()` without an address switch to token auth when ~/.ray/auth_token exists (any plain
# `ray.init()` writes it; homes are shared across nodes), `ray start --address` and
# `ray.init(address=...)` do not, so head and the rest disagreed (InvalidAuthToken). Decide once:
# RAY_AUTH_MODE (default token) and one token for the job, exported to every step.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
case "$RAY_AUTH_MODE" in
  token)
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
      AUTH_NOTE="token from RAY_AUTH_TOKEN"
    elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
      [[ -r "$RAY_AUTH_TOKEN_PATH" ]] || fail "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is not a readable file" 2
      AUTH_NOTE="token from RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH"
    else
      # a fresh token per attempt, readable by the job's user only, on the shared log directory
      export RAY_AUTH_TOKEN_PATH=$LOG_DIR/ray_auth_token
      (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH.tmp" \
        && mv -f "$RAY_AUTH_TOKEN_PATH.tmp" "$RAY_AUTH_TOKEN_PATH") || fail "cannot write $RAY_AUTH_TOKEN_PATH"
      AUTH_NOTE="the job's own token in $RAY_AUTH_TOKEN_PATH"
    fi ;;
  disabled) AUTH_NOTE="no token" ;;
  *) fail "RAY_AUTH_MODE=$RAY_AUTH_MODE: must be token or disabled" 2 ;;
esac
log "Ray auth: RAY_AUTH_MODE=$RAY_AUTH_MODE ($AUTH_NOTE)"

# ------------------------------------------------------------------ per-node environment --------
hard_nofile=$(ulimit -Hn)
if [[ "$hard_nofile" != unlimited ]] && (( hard_nofile < NOFILE_LIMIT )); then
  log "WARNING: the hard limit on open files is $hard_nofile < $NOFILE_LIMIT (Ray's advice for large clusters); raising the soft limit to $hard_nofile only. Ask the cluster admins if Ray runs out of file descriptors"
fi
NODE_ENV=$LOG_DIR/node_env.sh
{
  echo "# generated by slurm/launch.sh for job $SLURM_JOB_ID (sourced by every step)"
  printf 'cd %q\n' "$WORKDIR"
  [[ -n "$VENV" ]] && printf 'source %q/bin/activate\n' "$VENV"
  # shellcheck disable=SC2016  # expanded on the node, not here
  printf 'export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH}\n' "$NG_ROOT"
  printf 'export NG_NUM_NODES=%q NG_GPUS_PER_NODE=%q NG_LOG_DIR=%q\n' "$NNODES" "$GPUS_PER_NODE" "$LOG_DIR"
  # for the preflight's runtime checks (nemo_granular/preflight/runtime.py), in the container too
  [[ -n "$CONTAINER" ]] && printf 'export NG_CONTAINER=%q NG_MOUNTS=%q NG_VENV=%q\n' "$CONTAINER" "$MOUNTS" "$VENV"
  echo 'export RAY_DISABLE_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0'
  # ray.sub: Ray builds no uv venv per task (NeMo-RL builds its worker venvs itself, once per node)
  echo 'export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0'
  printf 'export RAY_AUTH_MODE=%q\n' "$RAY_AUTH_MODE"
  [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]] && printf 'export RAY_AUTH_TOKEN_PATH=%q\n' "$RAY_AUTH_TOKEN_PATH"
  # the soft `ulimit -n` up to NOFILE_LIMIT, at most the node's hard limit (srun copies the batch
  # shell's soft limit into every step)
  # shellcheck disable=SC2016  # expanded on the node, not here
  printf 'ng_h=$(ulimit -Hn); ng_s=$(ulimit -Sn); ng_w=%q\n' "$NOFILE_LIMIT"
  # shellcheck disable=SC2016
  echo '[[ $ng_h == unlimited ]] || (( ng_h >= ng_w )) || ng_w=$ng_h'
  # shellcheck disable=SC2016
  echo '[[ $ng_s == unlimited ]] || (( ng_s >= ng_w )) || ulimit -Sn "$ng_w"'
  # a host uv cache path means nothing inside the container (ray.sub)
  [[ -n "$CONTAINER" ]] && echo 'unset UV_CACHE_DIR'
  if [[ -n "$CONTAINER" ]]; then
    # under pyxis HOME is an empty read-only directory, and caches default under it (Triton's
    # ~/.triton/cache, vLLM's: NeMo-RL's vllm_worker uses ~/.cache/vllm): job-scoped ones in the
    # container's /tmp (writable, as for Ray's temp dirs). A value you set is kept: the image
    # defines none of them, so pyxis passes the host's. Megatron-Bridge's HF config loader
    # (AutoBridge.from_hf_pretrained: NeMo-RL's HF->Megatron import, the eval job's export) takes
    # a file lock in ~/.cache/huggingface whatever HF_HOME says, unless MEGATRON_CONFIG_LOCK_DIR
    for cache in TRITON_CACHE_DIR=triton VLLM_CACHE_ROOT=vllm TORCHINDUCTOR_CACHE_DIR=torchinductor XDG_CACHE_HOME=cache \
        MEGATRON_CONFIG_LOCK_DIR=megatron-config-locks; do
      name=${cache%%=*}
      [[ -z "${!name:-}" ]] || continue
      # XDG_CACHE_HOME and the lock folder only where HOME is not writable: uv's cache is
      # $XDG_CACHE_HOME/uv, and in a root container NeMo-RL's image has its uv cache in /root/.cache/uv
      # shellcheck disable=SC2016  # expanded on the node, not here
      [[ "$name" == XDG_CACHE_HOME || "$name" == MEGATRON_CONFIG_LOCK_DIR ]] && printf '[[ -d "${HOME:-}" && -w "${HOME:-}" ]] || '
      printf 'export %s=%q\n' "$name" "/tmp/nemo-granular-$SLURM_JOB_ID/${cache#*=}"
    done
  fi
  if [[ -n "$SETUP_COMMAND" ]]; then   # must succeed on every node: a failure ends that step, and the job
    # shellcheck disable=SC2016  # expanded on the node, not here
    printf 'if ! {\n%s\n}; then echo "ERROR: SETUP_COMMAND failed on $(hostname)" >&2; exit 3; fi\n' "$SETUP_COMMAND"
  fi
  echo ':'
} >"$NODE_ENV"

SRUN_COMMON=(--overlap --ntasks-per-node=1 --kill-on-bad-exit=1 "${GRES_ARGS[@]}")
HEAD_CONTAINER=(); WORKER_CONTAINER=()
if [[ -n "$CONTAINER" ]]; then
  SRUN_COMMON+=("--container-image=$CONTAINER" "--container-workdir=$WORKDIR" --no-container-mount-home)
  [[ -n "$MOUNTS" ]] && SRUN_COMMON+=("--container-mounts=$MOUNTS")
  [[ -n "$CONTAINER_ENV" ]] && SRUN_COMMON+=("--container-env=$CONTAINER_ENV")
  # the head's steps (Ray head, preflight, probe, watchdog, driver) share one named container on the
  # head node, as ray.sub runs its driver in the head's: what the driver builds in the container
  # (NeMo-RL's worker venvs) is there for the head's Ray workers too. Named per job: under pyxis'
  # default container_scope (global) a named container outlives the job on its node, and a step
  # naming an existing one skips the import of --container-image, so ray.sub's fixed names ran a
  # later job in an earlier job's container (its image, its files). Not per attempt: a requeued
  # attempt has the same CONTAINER, and a container the last attempt could not remove (a node lost,
  # SIGKILL) is reused by this job, never by another. remove_containers removes them at the end
  CONTAINER_NAMES=("ray-head-$SLURM_JOB_ID" "ray-worker-$SLURM_JOB_ID")
  HEAD_CONTAINER=("--container-name=${CONTAINER_NAMES[0]}")
  WORKER_CONTAINER=("--container-name=${CONTAINER_NAMES[1]}")
fi
RAY_TMP=$RAY_TMP_BASE/rayng${SLURM_JOB_ID}
RAY_COMMON="--block --disable-usage-stats --num-cpus=$CPUS_PER_NODE --num-gpus=$GPUS_PER_NODE \
--node-manager-port=$NODE_MANAGER_PORT --object-manager-port=$OBJECT_MANAGER_PORT \
--runtime-env-agent-port=$RUNTIME_ENV_AGENT_PORT --dashboard-agent-grpc-port=$DASHBOARD_AGENT_GRPC_PORT \
--dashboard-agent-listen-port=$DASHBOARD_AGENT_LISTEN_PORT --metrics-export-port=$METRICS_EXPORT_PORT \
--min-worker-port=$MIN_WORKER_PORT --max-worker-port=$MAX_WORKER_PORT"

last_error() {  # last_error LOG...: the last "ERROR: " line of the logs, without the prefix
  sed -n 's/^ERROR: //p' "$@" 2>/dev/null | tail -n1
}
ray_exit_why() {  # ray_exit_why LOG...: what `ray start --block` reported when a Ray process of its died
  # ("raylet [exit code=1]"), with the last error line of that process's log tail, which Ray prints
  local plain procs last
  plain=$(sed 's/\x1b\[[0-9;]*m//g' "$@" 2>/dev/null | sed -n '/Some Ray subprocesses exited unexpectedly/,$p')
  [[ -n "$plain" ]] || return 0
  procs=$(grep -o '[A-Za-z_]* \[exit code=[^]]*\]' <<<"$plain" | sort -u | paste -sd, -)
  last=$(grep -oE '\[[0-9-]+ [0-9:,]+ [EFC] [0-9]+ [0-9]+\].*' <<<"$plain" | tail -n1 | cut -c1-300)
  echo "Ray reports ${procs:-a process} exited${last:+; the last error in its log: $last}"
}

ray_start_error() {  # ray_start_error < LOG: the last exception or ERROR line `ray start` printed
  # ("Exception: The current node timed out during startup. ..."); nothing (and status 0) if none
  sed 's/\x1b\[[0-9;]*m//g' | { grep -E '^[A-Za-z_.]*(Error|Exception)\b|ERROR' || true; } | tail -n1 | cut -c1-300
}

preflight_problems() {  # preflight_problems STDERR_FILE: the problems, one a line: the preflight's
  # `preflight: error: ...` lines (exit 1), else its one-line reason (exit 2: `nemo-granular
  # preflight: ...`), else the last lines (e.g. a Python that has no nemo_granular)
  local lines
  lines=$(sed -n 's/^preflight: error: //p' "$1" 2>/dev/null)
  [[ -n "$lines" ]] || lines=$(sed -n 's/^nemo-granular preflight: \(error: \)\{0,1\}//p' "$1" 2>/dev/null)
  [[ -n "$lines" ]] || lines=$(grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 3)
  if [[ -n "$lines" ]]; then printf '%s\n' "$lines"; fi
}

# a step is "up" while its srun client lives; any dead step is fatal unless we are stopping anyway
check_steps() {
  local name pid rc logs why
  for name in "${!STEP_PIDS[@]}"; do
    pid=${STEP_PIDS[$name]}
    if ! kill -0 "$pid" 2>/dev/null; then
      rc=0; wait "$pid" 2>/dev/null || rc=$?
      unset "STEP_PIDS[$name]"
      [[ -n "$SIGNALED" ]] && continue
      case "$name" in
        watch) logs=("$LOG_DIR/watch.log") ;;
        ray-workers) logs=("$LOG_DIR"/ray-worker-*.log) ;;
        *) logs=("$LOG_DIR/$name.log") ;;
      esac
      why=$(last_error "${logs[@]}")
      [[ -n "$why" || "$name" == watch ]] || why=$(ray_exit_why "${logs[@]}")
      # (the head's log: this start's part only; an earlier start's error is not this one's)
      [[ -n "$why" || "$name" == watch ]] || why=$( { if [[ "$name" == ray-head ]]; then tail -c "+$HEAD_LOG_FROM" \
        "${logs[@]}"; else cat "${logs[@]}"; fi || true; } 2>/dev/null | ray_start_error)
      if [[ "$name" == watch ]]; then
        if (( rc == 4 )); then
          # a lost node (not the run's fault): requeued within MAX_RESTARTS. Slurm requeues a
          # --requeue job on a node failure itself, but only once it declares the node down
          # (SlurmdTimeout, minutes later), and the launcher has ended the job by then
          if (( ATTEMPT < MAX_RESTARTS )); then
            name_lost_nodes
            requeue "a Ray node was lost (${why:-Ray watchdog exit 4})"
          fi
          fail "${why:-a Ray node was lost} (Ray watchdog exit $rc; see $LOG_DIR/watch.log); MAX_RESTARTS=$MAX_RESTARTS reached, not requeueing"
        fi
        fail "${why:-the Ray watchdog stopped} (Ray watchdog exit $rc; see $LOG_DIR/watch.log)"
      fi
      fail "the $name step exited (code $rc): ${why:-a node or its Ray process died}; see ${logs[*]}"
    fi
  done
}

nap() { sleep "$1" & wait $! 2>/dev/null || true; }  # interruptible by traps

name_lost_nodes() {  # the nodes the watchdog lost, and how to keep the requeued job off them. Slurm
  # refuses to change a running job's ExcNodeList ("Job is no longer pending execution", Slurm
  # 22.05, tried on the local cluster) and the job is pending only after this script has ended; a
  # node whose GPU or Ray failed is not marked down unless its slurmd stops answering
  local lost current
  lost=$(grep -v '^[[:space:]]*$' "$LOG_DIR/lost_nodes" 2>/dev/null | sort -u | paste -sd, -)
  [[ -n "$lost" ]] || return 0
  current=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^ExcNodeList=//p' | head -n1)
  [[ "$current" != "(null)" ]] || current=""
  log "warning: lost node(s) $lost: Slurm may start the requeued job on them again; to prevent that, while it" \
    "waits to restart (squeue: PD): scontrol update JobId=$SLURM_JOB_ID ExcNodeList=${current:+$current,}$lost"
}

requeue() {  # requeue WHY: stop the driver and the Ray steps, requeue the job (the next attempt resumes), exit 0
  local name
  FINAL_RC=0; FINAL_REASON="$1: requeued, attempt $((ATTEMPT + 1)) will resume from the latest checkpoint"
  stop_pid "$DRIVER_PID" "$DRIVER_STOP_GRACE"; DRIVER_PID=""
  log "stopping the Ray steps"
  for name in "${!STEP_PIDS[@]}"; do stop_pid "${STEP_PIDS[$name]}" 5; unset "STEP_PIDS[$name]"; done
  write_status 0 "$FINAL_REASON"
  log "$FINAL_REASON"
  remove_containers   # before the requeue, which ends this attempt's steps
  scontrol requeue "$SLURM_JOB_ID" || fail "scontrol requeue $SLURM_JOB_ID failed (submit with --requeue)"
  exit 0
}

# one task on the head node, in the head's container (preflight, readiness probe, watchdog, driver)
ON_HEAD=(srun "${SRUN_COMMON[@]}" "${HEAD_CONTAINER[@]}" --nodes=1 --ntasks=1 -w "$HEAD")

# ------------------------------------------------------------------ 0. preflight ----------------
if (( IS_NEMO_RL && CLUSTER_OVERRIDES )) && [[ "$joined" != *"cluster.num_nodes="* ]]; then
  extra=("cluster.num_nodes=$NNODES")
  (( GPUS_PER_NODE > 0 )) && [[ "$joined" != *"cluster.gpus_per_node="* ]] && extra+=("cluster.gpus_per_node=$GPUS_PER_NODE")
  add_args "${extra[@]}"
  PF_OVERRIDES+=("${extra[@]}")
fi
if (( IS_NEMO_RL )); then
  if [[ "$PREFLIGHT" == 0 ]]; then
    log "preflight skipped (PREFLIGHT=0)"
  elif (( ${#PY_PREFIX[@]} == 0 )) || [[ -z "$PF_CONFIG" ]]; then
    log "preflight skipped: no '<python> -m nemo_granular.run_grpo|run_sppo --config FILE' in the driver command"
  else
    PF_ERR=$LOG_DIR/preflight-$ATTEMPT.err
    PF_CMD=("${PY_PREFIX[@]}" -m nemo_granular preflight --driver "$PF_DRIVER" "$PF_CONFIG" "${PF_OVERRIDES[@]}")
    log "preflight: ${PF_CMD[*]}"
    pf_rc=0
    "${ON_HEAD[@]}" --output="$LOG_DIR/preflight.log" --error="$PF_ERR" --open-mode=append \
      bash -c "source '$NODE_ENV' && exec$(printf ' %q' "${PF_CMD[@]}")" || pf_rc=$?
    if (( pf_rc != 0 )); then
      [[ -s "$PF_ERR" ]] && sed 's/^/[preflight] /' "$PF_ERR"
      problems=$(preflight_problems "$PF_ERR" | tail -n 10 | paste -sd';' - | sed 's/;/; /g' | cut -c1-800)
      fail "preflight of $PF_CONFIG: ${problems:-exit $pf_rc, see $LOG_DIR/preflight.log} (PREFLIGHT=0 skips the check)" 2
    fi
    # warnings do not stop the job (missing worker venvs, TORCH_CUDA_ARCH_LIST, ...): shown here
    pf_warnings=$(grep '^preflight: warning: ' "$PF_ERR" 2>/dev/null || true)
    if [[ -n "$pf_warnings" ]]; then
      log "preflight: no problems, $(wc -l <<<"$pf_warnings") warning(s):"
      while IFS= read -r line; do echo "[preflight] $line"; done <<<"$pf_warnings"
    else
      log "preflight: no problems"
    fi
  fi
fi

# ray.sub (7ea279abf) clears ^(PMI|PMIX|MPI|OMPI|SLURM)_ before `ray start` and before its driver: every
# Ray actor is a child of its node's raylet (NeMo-RL v0.7.0's init_ray adds the driver's whole
# environment), where MPI/PMIx (TRT-LLM's MPI_Init) and anything that takes its rank from them
# (Megatron falls back to SLURM_PROCID) would read the srun task of the step that started Ray
# shellcheck disable=SC2016  # expanded in the step, not here
CLEAR_STEP_VARS='for ng_v in $(compgen -e); do if [[ $ng_v =~ ^(PMI|PMIX|MPI|OMPI|SLURM)_ ]]; then unset "$ng_v"; fi; done; unset ng_v'

start_ray_cluster() {  # steps 1-4: head, workers, wait for every node, watchdog
  # ------------------------------------------------------------------ 1. Ray head -----------------
  # Ready when `ray start` prints "Ray runtime started.": its raylet has registered with the GCS.
  # The GCS port opens before that, and on an overloaded node `ray start` gives the raylet 30 s
  # (hard-coded in Ray 2.60's node.py), then raises "The current node timed out during startup"
  # and exits 1: nothing has run yet, so the head is started again, RAY_HEAD_TRIES times in all
  local head_try=1 rc why
  while :; do
    HEAD_LOG_FROM=$(( $(stat -c %s "$LOG_DIR/ray-head.log" 2>/dev/null || echo 0) + 1 ))   # this try's part of the log
    srun "${SRUN_COMMON[@]}" "${HEAD_CONTAINER[@]}" --nodes=1 --ntasks=1 -w "$HEAD" --output="$LOG_DIR/ray-head.log" --open-mode=append \
      bash -c "source '$NODE_ENV' && $CLEAR_STEP_VARS && exec ray start --head --node-ip-address=$HEAD_IP --port=$RAY_PORT \
        --ray-client-server-port=$RAY_CLIENT_SERVER_PORT --include-dashboard=false --temp-dir=${RAY_TMP}_head $RAY_COMMON \
        \${SLURMD_NODENAME:+--node-name=\$SLURMD_NODENAME}" &
    STEP_PIDS[ray-head]=$!
    log "starting the Ray head on $HEAD (srun pid ${STEP_PIDS[ray-head]}$( (( head_try == 1 )) || echo ", try $head_try of $RAY_HEAD_TRIES"))"
    deadline=$((SECONDS + RAY_WAIT_TIMEOUT))
    until tail -c "+$HEAD_LOG_FROM" "$LOG_DIR/ray-head.log" 2>/dev/null | grep -q "Ray runtime started"; do
      if (( head_try < RAY_HEAD_TRIES )) && [[ -z "$SIGNALED" ]] && ! kill -0 "${STEP_PIDS[ray-head]}" 2>/dev/null; then
        rc=0; wait "${STEP_PIDS[ray-head]}" 2>/dev/null || rc=$?
        unset "STEP_PIDS[ray-head]"
        why=$( { tail -c "+$HEAD_LOG_FROM" "$LOG_DIR/ray-head.log" || true; } 2>/dev/null | ray_start_error)
        log "the Ray head exited (code $rc) before it started${why:+: $why}; starting it again"
        head_try=$((head_try + 1))
        continue 2
      fi
      check_steps
      (( SECONDS < deadline )) || fail "the Ray head did not start within ${RAY_WAIT_TIMEOUT}s (see $LOG_DIR/ray-head.log)"
      [[ -z "$SIGNALED" ]] || fail "signalled (SIG$SIGNALED) before the Ray cluster was up; nothing to checkpoint"
      nap 1
    done
    break
  done
  log "Ray head is up at $RAY_ADDRESS_HEAD"

  # ------------------------------------------------------------------ 2. Ray workers --------------
  if (( NNODES > 1 )); then
    wlist=$(IFS=,; echo "${WORKERS[*]}")
    # the head is up already: a few tries ride out a slow GCS; a node that cannot start Ray
    # ends its step (and so the job) within seconds
    srun "${SRUN_COMMON[@]}" "${WORKER_CONTAINER[@]}" --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) -w "$wlist" \
      --output="$LOG_DIR/ray-worker-%N.log" --open-mode=append \
      bash -c "source '$NODE_ENV' && $CLEAR_STEP_VARS && for i in 1 2 3 4 5; do
          ray start --address=$RAY_ADDRESS_HEAD --temp-dir=${RAY_TMP}_\$(hostname) $RAY_COMMON \
            \${SLURMD_NODENAME:+--node-name=\$SLURMD_NODENAME} && exit 0
          echo \"ray start failed (try \$i of 5), retrying\"; sleep 3
        done; echo \"ERROR: ray start --address=$RAY_ADDRESS_HEAD failed 5 times on \$(hostname)\"; exit 1" &
    STEP_PIDS[ray-workers]=$!
    log "starting Ray workers on ${WORKERS[*]} (srun pid ${STEP_PIDS[ray-workers]})"
  fi

  # ------------------------------------------------------------------ 3. wait for every node ------
  "${ON_HEAD[@]}" --output="$LOG_DIR/ray-wait.log" --open-mode=append bash -c "source '$NODE_ENV' && exec python '$NG_ROOT/slurm/ray_cluster.py' wait \
    --address=$RAY_ADDRESS_HEAD --expected=$NNODES --timeout=$RAY_WAIT_TIMEOUT --out='$LOG_DIR/ray_nodes.json'" &
  wait_pid=$!
  while kill -0 "$wait_pid" 2>/dev/null; do
    check_steps
    [[ -z "$SIGNALED" ]] || fail "signalled (SIG$SIGNALED) before the Ray cluster was up; nothing to checkpoint"
    nap 1
  done
  wait_rc=0; wait "$wait_pid" || wait_rc=$?
  if (( wait_rc != 0 )); then
    why=$(last_error "$LOG_DIR/ray-wait.log")
    fail "${why:-Ray readiness probe failed: $(grep -v '^[[:space:]]*$' "$LOG_DIR/ray-wait.log" | tail -n1 | cut -c1-300)} (exit $wait_rc; see $LOG_DIR/ray-wait.log)"
  fi
  log "$(grep -h '^RAY_NODES' "$LOG_DIR/ray-wait.log" | tail -n1)"

  # ------------------------------------------------------------------ 4. watchdog -----------------
  "${ON_HEAD[@]}" --output="$LOG_DIR/watch.log" --open-mode=append bash -c "source '$NODE_ENV' && exec python '$NG_ROOT/slurm/ray_cluster.py' watch \
    --address=$RAY_ADDRESS_HEAD --expected=$NNODES --interval=$WATCH_INTERVAL --failures=$RAY_WATCH_FAILURES \
    --lost-out='$LOG_DIR/lost_nodes'" &
  STEP_PIDS[watch]=$!
}

# ------------------------------------------------------------------ what a preemption costs ----
# One line from the site's settings, so that a lost stretch of training is no surprise. A
# partition's PreemptMode beats the cluster's; a QOS's own (PreemptType=preempt/qos) is not read.
# scontrol saying nothing is not an error: the line says so.
preemption_cost() {
  local conf part mode ptype params grace signal cost
  conf=$(scontrol show config 2>/dev/null || true)
  mode=$(sed -n 's/^PreemptMode *= *//p' <<<"$conf" | head -n1)
  ptype=$(sed -n 's/^PreemptType *= *//p' <<<"$conf" | head -n1)
  params=$(sed -n 's/^PreemptParameters *= *//p' <<<"$conf" | head -n1)
  if [[ -n "${SLURM_JOB_PARTITION:-}" ]]; then
    part=$(scontrol show partition -o "$SLURM_JOB_PARTITION" 2>/dev/null | tr ' ' '\n' || true)
    grace=$(sed -n 's/^GraceTime=//p' <<<"$part" | head -n1)
    mode=$(sed -n 's/^PreemptMode=//p' <<<"$part" | head -n1 | grep . || echo "$mode")
  fi
  if [[ -z "$mode" ]]; then
    echo "preemption: unknown (scontrol show config gave no PreemptMode)"; return
  fi
  local head="PreemptMode=$mode, PreemptType=${ptype:-?}, PreemptParameters=${params:-?}, GraceTime=${grace:-?}s"
  if [[ "${mode^^}" == *OFF* || "$ptype" == preempt/none ]]; then
    echo "preemption: $head: no preemption on this cluster"; return
  fi
  if [[ "${mode^^}" == *SUSPEND* ]]; then
    echo "preemption: $head: a preempted job is suspended in memory and resumed later; no signal, no save"; return
  fi
  # the signal the job's steps get when preempted: the batch signal (this script's --signal=B:USR1)
  # with send_user_signal, else SIGTERM to every step at once
  signal=TERM; [[ "$params" == *send_user_signal* ]] && signal=USR1
  if [[ "$signal" == USR1 ]] && (( DRIVER_HANDLES_PREEMPT )); then
    cost="SIGUSR1 to the batch shell: the driver saves at the end of its current step if that step and the save end within GraceTime=${grace:-?}s (exit 99, on which the launcher runs scontrol requeue), else it is killed and loses the steps since its last checkpoint"
  elif (( IS_NEMO_RL )); then
    cost="SIGTERM to every step at once: Ray stops under the NeMo-RL driver, which does not save; the run loses the steps since its last checkpoint (checkpointing.save_period)"
  elif (( IS_TRAIN )); then
    cost="SIGTERM: the trainer saves after its current step if that ends within GraceTime=${grace:-?}s (exit 99), else it loses the steps since its last checkpoint"
  else
    cost="SIG$signal to the driver, which this launcher does not save for"
  fi
  if [[ "${mode^^}" == *REQUEUE* ]]; then
    echo "preemption: $head: $cost; Slurm requeues the job and it resumes from its latest checkpoint"
  elif [[ "${mode^^}" == *CANCEL* ]]; then
    echo "preemption: $head: $cost; Slurm cancels the job rather than requeue it"
  else
    echo "preemption: $head: $cost"
  fi
}
log "$(preemption_cost)"

if (( START_RAY )); then
  start_ray_cluster
else
  log "START_RAY=0: no Ray cluster (single-node driver that does not use Ray)"
fi

# ------------------------------------------------------------------ 5. driver -------------------
DRIVER_SH=$LOG_DIR/driver.sh
JOB_END_TIME=""
job_end=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^EndTime=//p' | head -n1 || true)
job_limit=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^TimeLimit=//p' | head -n1 || true)
if [[ "$job_end" =~ ^[0-9]{4}- && "$job_limit" != UNLIMITED ]]; then JOB_END_TIME=$(date -d "$job_end" +%s 2>/dev/null || true); fi
{
  echo "# generated by slurm/launch.sh for job $SLURM_JOB_ID attempt $ATTEMPT"
  printf 'source %q\n' "$NODE_ENV"
  (( START_RAY )) && printf 'export RAY_ADDRESS=%q\n' "$RAY_ADDRESS_HEAD"
  printf 'export NG_SLURM_ATTEMPT=%q\n' "$ATTEMPT"
  # when the job ends (epoch s), for the driver's time budget (nemo_granular/nemo_rl/time_limit.py);
  # a container has no Slurm commands to ask
  [[ -n "$JOB_END_TIME" ]] && printf 'export NG_JOB_END_TIME=%q\n' "$JOB_END_TIME"
  # the driver runs without the step's SLURM_*/PMI* variables (SLURM_PROCID=0 of SLURM_NTASKS=1 on
  # the head node), as ray.sub (7ea279abf) clears ^(PMI|PMIX|MPI|OMPI|SLURM)_ before Ray and its
  # driver: NeMo-RL v0.7.0's init_ray hands the driver's whole environment to every Ray actor, where
  # MPI/PMIx (TRT-LLM's MPI_Init) and anything that takes its rank from them read task 0 of 1. The
  # step stays a Slurm step; the time budget's SLURM_JOB_END_TIME stays as NG_JOB_END_TIME
  # shellcheck disable=SC2016  # expanded in the step, not here
  echo '[[ -n "${NG_JOB_END_TIME:-}" || -z "${SLURM_JOB_END_TIME:-}" ]] || export NG_JOB_END_TIME=$SLURM_JOB_END_TIME'
  echo "$CLEAR_STEP_VARS"
  if (( DRIVER_HANDLES_PREEMPT )) && [[ "$PREEMPT_SIGNAL" == USR[12] ]]; then
    # ignored (inherited through exec by uv run and python) until the driver installs its own
    # handlers: one that comes earlier must not kill it; the launcher repeats the signal. TERM
    # too: scancel and preemption send it to every step, the driver's included
    printf "trap '' %s TERM\n" "$PREEMPT_SIGNAL"
  fi
  printf 'exec'; printf ' %q' "${CMD[@]}"; printf '\n'
} >"$DRIVER_SH"
{ echo "=== job $SLURM_JOB_ID attempt $ATTEMPT $(ts): ${CMD[*]}"; } >>"$LOG_DIR/driver.log"
log "driver: ${CMD[*]}"
"${ON_HEAD[@]}" --output="$LOG_DIR/driver.log" --open-mode=append bash "$DRIVER_SH" &
DRIVER_PID=$!

while kill -0 "$DRIVER_PID" 2>/dev/null; do
  check_steps
  if [[ -n "$SIGNALED" ]] && (( DRIVER_HANDLES_PREEMPT && PREEMPT_RESEND > 0 && SECONDS >= NEXT_RESEND )); then
    forward_preempt   # it may have come before the driver's handler was in place
  fi
  nap 1
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
    # e.g. a driver without a handler, killed by the signal: the time limit is near anyway, so
    # come back and resume from whatever checkpoint the driver has
    err "the driver did not confirm a checkpoint after SIG$SIGNALED (exit $DRIVER_RC); requeueing to resume from its latest checkpoint"
  fi
  if (( ATTEMPT >= MAX_RESTARTS )); then
    fail "stopped early but MAX_RESTARTS=$MAX_RESTARTS reached; not requeueing"
  fi
  why=${SIGNALED:+preempted by SIG$SIGNALED}
  requeue "${why:-stopped before the end of the run} (driver exit $DRIVER_RC)"
fi
fail "the driver exited with code $DRIVER_RC (see $LOG_DIR/driver.log): $(grep -v '^===' "$LOG_DIR/driver.log" | tail -n 3 | tr '\n' ' ' | cut -c1-400)"
