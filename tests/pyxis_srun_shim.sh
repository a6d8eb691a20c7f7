#!/usr/bin/env bash
# Stand-in for pyxis in the Slurm tests (a test fixture): the test puts a directory with this
# script named `srun` first on the job's PATH. It appends the exact command line the launcher
# built to $NG_SRUN_LOG (one line per call, shell-quoted), drops the pyxis options
# (--container-*, --no-container-mount-home), which the local cluster's Slurm has no plugin for,
# and runs the real srun ($NG_REAL_SRUN) with the rest: the job runs for real, on the host.
set -euo pipefail
line=$(printf '%q ' "$@")
printf '%s\n' "$line" >>"${NG_SRUN_LOG:?}"    # one write per line: concurrent calls do not interleave
args=()
for a in "$@"; do
  case "$a" in
    --container-*|--no-container-mount-home) ;;
    *) args+=("$a") ;;
  esac
done
exec "${NG_REAL_SRUN:?}" "${args[@]}"
