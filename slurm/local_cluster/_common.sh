# shellcheck shell=bash
# Settings shared by up.sh / down.sh / status.sh of the local test cluster (sourced, not run).
#
# Everything the cluster creates lives under NG_SLURM_DIR and is named with NG_SLURM_PREFIX, so
# down.sh removes exactly what up.sh made (daemons by their pid files, namespaces, veths, the
# bridge, and the /etc/hosts lines tagged with NG_HOSTS_TAG).

NG_SLURM_DIR=${NG_SLURM_DIR:-/tmp/ng-slurm}
NG_SLURM_NODES=${NG_SLURM_NODES:-2}
# nodes after those, without GRES (a site that declares no GPUs to Slurm), in partition `nogres`
NG_SLURM_NOGRES_NODES=${NG_SLURM_NOGRES_NODES:-0}
# shellcheck disable=SC2034  # used by up.sh / down.sh
NG_SLURM_ALL_NODES=$((NG_SLURM_NODES + NG_SLURM_NOGRES_NODES))
NG_SLURM_PREFIX=${NG_SLURM_PREFIX:-ngn}
NG_SLURM_SUBNET=${NG_SLURM_SUBNET:-10.231.77}      # /24; .1 is the controller, .11.. the nodes
NG_SLURM_CTLD_PORT=${NG_SLURM_CTLD_PORT:-16817}
NG_SLURM_SLURMD_PORT=${NG_SLURM_SLURMD_PORT:-16818}
NG_SLURM_BRIDGE=${NG_SLURM_BRIDGE:-${NG_SLURM_PREFIX}br0}
# shellcheck disable=SC2034  # used by up.sh / down.sh
NG_HOSTS_TAG="# nemo-granular-local-slurm:${NG_SLURM_PREFIX}"

ng_node_name() { echo "${NG_SLURM_PREFIX}$1"; }
ng_node_ip() { echo "${NG_SLURM_SUBNET}.$((10 + $1))"; }
ng_ctld_ip() { echo "${NG_SLURM_SUBNET}.1"; }
ng_netns() { echo "${NG_SLURM_PREFIX}ns$1"; }
ng_veth_host() { echo "${NG_SLURM_PREFIX}v$1"; }

ng_log() { echo "[local-slurm] $*" >&2; }
ng_die() { echo "[local-slurm] ERROR: $*" >&2; exit 1; }

# Kill the process whose pid is in file $1 (if it is still alive), then remove the file.
ng_kill_pidfile() {
  local f=$1 pid
  [[ -f "$f" ]] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}
