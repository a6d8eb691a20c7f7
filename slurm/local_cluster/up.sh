#!/usr/bin/env bash
# Start a real Slurm cluster with NG_SLURM_NODES (default 2) compute nodes on THIS machine (and
# NG_SLURM_NOGRES_NODES more without GRES, in partition `nogres`).
#
# Each compute node is a network namespace with its own IP on a private bridge, its own hostname
# (a UTS namespace) and its own slurmd; slurmctld and munged run on the host. It is a test bed for
# slurm/launch.sh (tests/test_slurm.py uses it) and for trying the launcher by hand:
#
#     sudo bash slurm/local_cluster/up.sh --install      # Debian/Ubuntu: apt-get the daemons if missing
#     source /tmp/ng-slurm/env.sh                        # exports SLURM_CONF
#     sbatch --nodes=2 slurm/launch.sh ...               # see docs/slurm.md
#     sudo bash slurm/local_cluster/down.sh
#
# Needs root, iproute2, util-linux (nsenter, unshare), a mounted cgroup hierarchy, and the Debian
# packages slurmctld slurmd slurm-client munge. The nodes share the host's kernel, /tmp and
# /dev/shm, and they have no outside network (DNS inside them fails fast on purpose).
# Settings (environment): see _common.sh. Exit code 0 once every node is idle; 2 when the
# prerequisites are missing (not root, packages absent and --install not given or failed).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/local_cluster/_common.sh
source "$HERE/_common.sh"

INSTALL=0
for arg in "$@"; do
  case "$arg" in
    --install) INSTALL=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) ng_die "unknown argument $arg (only --install)" ;;
  esac
done

[[ $(id -u) -eq 0 ]] || { echo "[local-slurm] needs root" >&2; exit 2; }

need_pkgs=()
for bin in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  command -v "${bin%%:*}" >/dev/null 2>&1 || need_pkgs+=("${bin#*:}")
done
if (( ${#need_pkgs[@]} )); then
  if (( INSTALL )) && command -v apt-get >/dev/null 2>&1; then
    ng_log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}"; } >"${TMPDIR:-/tmp}/ng-slurm-apt.log" 2>&1; then
      echo "[local-slurm] apt-get could not install ${need_pkgs[*]} (log: ${TMPDIR:-/tmp}/ng-slurm-apt.log)" >&2
      exit 2
    fi
  else
    echo "[local-slurm] missing packages: ${need_pkgs[*]} (run with --install, or apt-get install them)" >&2
    exit 2
  fi
fi
for bin in ip nsenter unshare; do
  command -v "$bin" >/dev/null 2>&1 || { echo "[local-slurm] missing $bin" >&2; exit 2; }
done

if [[ -f "$NG_SLURM_DIR/run/slurmctld.pid" ]] && kill -0 "$(cat "$NG_SLURM_DIR/run/slurmctld.pid")" 2>/dev/null; then
  ng_die "a local cluster is already running under $NG_SLURM_DIR (run down.sh first)"
fi

# Undo a partial start if anything below fails.
undo_on_failure() {
  local rc=$?
  if (( rc != 0 )); then
    ng_log "start failed (rc=$rc), cleaning up"
    bash "$HERE/down.sh" >/dev/null 2>&1 || true
  fi
}
trap undo_on_failure EXIT

rm -rf "$NG_SLURM_DIR"
mkdir -p "$NG_SLURM_DIR"/{state,spool,run,log,munge}
chmod 755 "$NG_SLURM_DIR"

# ---- munge (own socket, pid and log; the package's key) ------------------------------------------
MUNGE_DIR=$NG_SLURM_DIR/munge
chown munge: "$MUNGE_DIR"; chmod 755 "$MUNGE_DIR"
[[ -s /etc/munge/munge.key ]] || { command -v mungekey >/dev/null && mungekey --create --force >/dev/null; }
[[ -s /etc/munge/munge.key ]] || ng_die "no /etc/munge/munge.key"
runuser -u munge -- munged --socket="$MUNGE_DIR/munge.socket" --pid-file="$MUNGE_DIR/munged.pid" \
  --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" --num-threads=2 \
  || ng_die "munged did not start (see $MUNGE_DIR/munged.log)"
for _ in $(seq 1 50); do [[ -S "$MUNGE_DIR/munge.socket" ]] && break; sleep 0.1; done
[[ -S "$MUNGE_DIR/munge.socket" ]] || ng_die "munged socket missing"

# ---- network: bridge + one namespace per node ---------------------------------------------------
CTLD_IP=$(ng_ctld_ip)
ip link add "$NG_SLURM_BRIDGE" type bridge
ip addr add "$CTLD_IP/24" dev "$NG_SLURM_BRIDGE"
ip link set "$NG_SLURM_BRIDGE" up
printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"$NG_SLURM_DIR/resolv.conf"
for i in $(seq 1 "$NG_SLURM_ALL_NODES"); do
  ns=$(ng_netns "$i"); vh=$(ng_veth_host "$i")
  ip netns add "$ns"
  ip link add "$vh" type veth peer name "${vh}p"
  ip link set "$vh" master "$NG_SLURM_BRIDGE"
  ip link set "$vh" up
  ip link set "${vh}p" netns "$ns"
  ip -n "$ns" link set "${vh}p" name eth0
  ip -n "$ns" addr add "$(ng_node_ip "$i")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "$ns" route add default via "$CTLD_IP"
done
# node names resolve everywhere through /etc/hosts (tagged lines, removed by down.sh)
sed -i "\|${NG_HOSTS_TAG}\$|d" /etc/hosts
# NG_SLURM_HEAD_LOOPBACK=1: the first node's name also maps to 127.0.1.1, listed first, as
# Debian/Ubuntu's installer writes a machine's own name into /etc/hosts (what a DGX node has)
if [[ "${NG_SLURM_HEAD_LOOPBACK:-0}" == 1 ]]; then
  echo "127.0.1.1 $(ng_node_name 1) ${NG_HOSTS_TAG}" >>/etc/hosts
fi
for i in $(seq 1 "$NG_SLURM_ALL_NODES"); do
  echo "$(ng_node_ip "$i") $(ng_node_name "$i") ${NG_HOSTS_TAG}" >>/etc/hosts
done

# ---- slurm.conf ---------------------------------------------------------------------------------
# Each node claims the host's topology (as `slurmd -C` prints it); they share the same cores.
# optional fake GPUs (GRES without device files) to exercise GRES detection: NG_SLURM_FAKE_GPUS=N
FAKE_GPUS=${NG_SLURM_FAKE_GPUS:-0}
GRES_NODE=""
if (( FAKE_GPUS > 0 )); then
  GRES_NODE="Gres=gpu:$FAKE_GPUS "
  mkdir -p "$NG_SLURM_DIR/dev"
  for ((g = 0; g < FAKE_GPUS; g++)); do : >"$NG_SLURM_DIR/dev/fakegpu$g"; done
  echo "NodeName=${NG_SLURM_PREFIX}[1-$NG_SLURM_NODES] Name=gpu File=$NG_SLURM_DIR/dev/fakegpu[0-$((FAKE_GPUS - 1))]" >"$NG_SLURM_DIR/gres.conf"
fi
TOPO=$(slurmd -C | head -n1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
CONF=$NG_SLURM_DIR/slurm.conf
{
  echo "ClusterName=nglocal"
  echo "SlurmctldHost=$(hostname -s)($CTLD_IP)"
  echo "SlurmctldPort=$NG_SLURM_CTLD_PORT"
  echo "SlurmdPort=$NG_SLURM_SLURMD_PORT"
  echo "AuthType=auth/munge"
  echo "CredType=cred/munge"
  # cred_expire (default 120 s) is also how long Slurm holds a requeued job before it may start
  # again: slurmd refuses a batch launch whose credential is not newer (1 s resolution) than the
  # revocation of the previous attempt's. 30 s keeps that protection and a short requeue test.
  echo "AuthInfo=socket=$MUNGE_DIR/munge.socket,cred_expire=${NG_SLURM_CRED_EXPIRE:-30}"
  echo "MailProg=/bin/true"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_Core"
  echo "SlurmUser=root"
  echo "SlurmdUser=root"
  echo "StateSaveLocation=$NG_SLURM_DIR/state"
  echo "SlurmdSpoolDir=$NG_SLURM_DIR/spool/%n"
  echo "SlurmctldPidFile=$NG_SLURM_DIR/run/slurmctld.pid"
  echo "SlurmdPidFile=$NG_SLURM_DIR/run/slurmd-%n.pid"
  echo "SlurmctldLogFile=$NG_SLURM_DIR/log/slurmctld.log"
  echo "SlurmdLogFile=$NG_SLURM_DIR/log/slurmd-%n.log"
  echo "ReturnToService=2"
  echo "SlurmdTimeout=30"
  echo "MessageTimeout=10"
  echo "KillWait=10"
  echo "MinJobAge=3600"
  echo "JobRequeue=1"
  # a requeued job becomes eligible when its credential hold ends, but nothing then wakes the
  # scheduler: it started at the next periodic pass (sched_interval, default 60 s) or backfill
  # pass after some other event, 6-30 s late. A pass every 2 s starts it on time.
  echo "SchedulerParameters=defer_batch=0,sched_interval=2"
  echo "SchedulerTimeSlice=5"
  (( FAKE_GPUS > 0 )) && echo "GresTypes=gpu"
  for i in $(seq 1 "$NG_SLURM_ALL_NODES"); do
    gres=$GRES_NODE
    (( i <= NG_SLURM_NODES )) || gres=""
    echo "NodeName=$(ng_node_name "$i") NodeAddr=$(ng_node_ip "$i") NodeHostname=$(ng_node_name "$i") ${TOPO}${gres}RealMemory=1000 State=UNKNOWN"
  done
  echo "PartitionName=local Nodes=${NG_SLURM_PREFIX}[1-$NG_SLURM_NODES] Default=YES MaxTime=INFINITE State=UP"
  if (( NG_SLURM_NOGRES_NODES > 0 )); then
    echo "PartitionName=nogres Nodes=${NG_SLURM_PREFIX}[$((NG_SLURM_NODES + 1))-$NG_SLURM_ALL_NODES] MaxTime=INFINITE State=UP"
  fi
} >"$CONF"
for i in $(seq 1 "$NG_SLURM_ALL_NODES"); do mkdir -p "$NG_SLURM_DIR/spool/$(ng_node_name "$i")"; done
printf 'export SLURM_CONF=%q\n' "$CONF" >"$NG_SLURM_DIR/env.sh"
export SLURM_CONF=$CONF

# ---- daemons ------------------------------------------------------------------------------------
slurmctld -c -f "$CONF" || ng_die "slurmctld did not start (see $NG_SLURM_DIR/log/slurmctld.log)"
for i in $(seq 1 "$NG_SLURM_ALL_NODES"); do
  name=$(ng_node_name "$i")
  # own netns (IP), own mount ns (fail-fast resolv.conf) and own UTS ns (hostname = node name)
  # shellcheck disable=SC2016  # the inner script gets its values as arguments
  nsenter --net="/run/netns/$(ng_netns "$i")" unshare --mount --uts -- /bin/bash -c '
    set -e
    hostname "$1"
    mount --bind "$2" /etc/resolv.conf
    exec slurmd -N "$1" -f "$3"' _ "$name" "$NG_SLURM_DIR/resolv.conf" "$CONF" \
    || ng_die "slurmd $name did not start (see $NG_SLURM_DIR/log/slurmd-$name.log)"
done

# ---- wait until every node is idle --------------------------------------------------------------
for _ in $(seq 1 120); do
  idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l || true)
  (( idle >= NG_SLURM_ALL_NODES )) && break
  sleep 0.5
done
if (( idle < NG_SLURM_ALL_NODES )); then
  sinfo -N >&2 || true
  ng_die "only $idle of $NG_SLURM_ALL_NODES nodes became idle (logs: $NG_SLURM_DIR/log)"
fi
trap - EXIT
ng_log "cluster up: $NG_SLURM_ALL_NODES nodes idle; run: source $NG_SLURM_DIR/env.sh"
