#!/usr/bin/env bash
# Stop the local test cluster started by up.sh and remove everything it created: the daemons
# (by their pid files), any process still running inside a node namespace (leftover job steps,
# Ray), the namespaces, veths and bridge, and the tagged /etc/hosts lines. Safe to run twice.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/local_cluster/_common.sh
source "$HERE/_common.sh"

[[ $(id -u) -eq 0 ]] || { echo "[local-slurm] needs root" >&2; exit 2; }

# Cancel jobs first so their steps end cleanly.
if [[ -f "$NG_SLURM_DIR/slurm.conf" ]] && [[ -f "$NG_SLURM_DIR/run/slurmctld.pid" ]]; then
  SLURM_CONF=$NG_SLURM_DIR/slurm.conf timeout 10 scancel --full --quiet 2>/dev/null || true
fi

# slurmd of every node, then every process left in a node's network namespace (job steps, Ray).
for i in $(seq 1 "$NG_SLURM_ALL_NODES"); do
  ng_kill_pidfile "$NG_SLURM_DIR/run/slurmd-$(ng_node_name "$i").pid"
  nsf=/run/netns/$(ng_netns "$i")
  [[ -e "$nsf" ]] || continue
  ns_ino=$(stat -L -c %i "$nsf" 2>/dev/null || true)
  [[ -n "$ns_ino" ]] || continue
  for round in TERM KILL; do
    pids=()
    for p in /proc/[0-9]*; do
      [[ "$(stat -L -c %i "$p/ns/net" 2>/dev/null)" == "$ns_ino" ]] && pids+=("${p#/proc/}")
    done
    (( ${#pids[@]} )) || break
    kill "-$round" "${pids[@]}" 2>/dev/null || true
    sleep 1
  done
done
ng_kill_pidfile "$NG_SLURM_DIR/run/slurmctld.pid"
ng_kill_pidfile "$NG_SLURM_DIR/munge/munged.pid"

for i in $(seq 1 "$NG_SLURM_ALL_NODES"); do
  ip link del "$(ng_veth_host "$i")" 2>/dev/null || true
  ip netns del "$(ng_netns "$i")" 2>/dev/null || true
done
ip link del "$NG_SLURM_BRIDGE" 2>/dev/null || true
sed -i "\|${NG_HOSTS_TAG}\$|d" /etc/hosts 2>/dev/null || true
ng_log "cluster down ($NG_SLURM_DIR kept for its logs)"
exit 0
