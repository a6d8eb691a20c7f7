#!/usr/bin/env bash
# Stop a launch.sh job so that it saves: USR1 to the batch shell, which forwards it to the driver; the
# driver saves a checkpoint and exits 99, and the launcher requeues the job (cancel it afterwards with
# scancel if you do not want the requeued attempt). A plain scancel (SIGTERM to every step) would stop a
# NeMo-RL run's Ray under its driver before it could save (docs/slurm.md).
#   bash slurm/stop.sh JOBID [JOBID...]
set -euo pipefail
(( $# )) || { echo "usage: slurm/stop.sh JOBID [JOBID...]" >&2; exit 2; }
for job in "$@"; do
  [[ "$job" =~ ^[0-9]+(_[0-9]+)?$ ]] || { echo "stop.sh: $job is not a Slurm job id" >&2; exit 2; }
done
exec scancel --signal=USR1 --batch "$@"
