#!/usr/bin/env bash
# Set up the environment and run the whole test suite (the command CI runs).
#
# With NEMO_RL_SRC=<NeMo-RL checkout> (or NEMO_RL_VENDOR=<folder of source snapshots>), the
# real-host tests run against that NeMo-RL: scripts/nemo_rl_env.sh installs what they need.
# The Slurm tests (tests/test_slurm.py) install Debian's Slurm/munge packages, add node names
# to /etc/hosts and start daemons in network namespaces when run as root; opt out with
# NEMO_GRANULAR_SLURM_TESTS=0 (they then skip, which CI does not allow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
if [ -n "${NEMO_RL_SRC:-}" ] || [ -n "${NEMO_RL_VENDOR:-}" ]; then
  # shellcheck source=scripts/nemo_rl_env.sh
  source scripts/nemo_rl_env.sh
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# The suite runs on pytest-xdist workers (NEMO_GRANULAR_TEST_WORKERS, default 2; 0: one process): much
# of it waits (Ray and Megatron start-up, subprocesses) rather than computes, so two overlap even on two
# cores. tests/conftest.py keeps each module on one worker and the Ray-head modules together. The Slurm
# tests run afterwards on their own: they time daemons, requeues and signals, and failed when they shared
# two cores with the loop tests (slurmctld stopped answering; a USR1 test's job ended before its save).
WORKERS=${NEMO_GRANULAR_TEST_WORKERS:-2}
PYTEST=(.venv/bin/python -m pytest -q)
(( WORKERS > 0 )) && PYTEST+=(-n "$WORKERS" --dist loadgroup)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then exec "${PYTEST[@]}" "$@"; fi  # tests named: just those
done
rc=0 slurm_rc=0
"${PYTEST[@]}" --ignore=tests/test_slurm.py "$@" || rc=$?
echo "--- the Slurm tests, on their own"
.venv/bin/python -m pytest -q tests/test_slurm.py "$@" || slurm_rc=$?
# 5 is pytest's "no tests collected": a -k/-m selection may leave one of the two runs empty
if (( rc == 5 && slurm_rc != 5 )); then rc=0; fi
if (( slurm_rc == 5 && rc != 5 )); then slurm_rc=0; fi
exit $((rc ? rc : slurm_rc))
