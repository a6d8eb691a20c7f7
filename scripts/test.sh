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
# Two pytest-xdist workers: much of the suite waits (Slurm requeue holds, Ray and Megatron start-up)
# rather than computes, so two overlap well even on two cores. tests/conftest.py keeps each module on
# one worker and the Ray-head modules together. NEMO_GRANULAR_TEST_WORKERS=0 runs in one process;
# a -n given on the command line wins.
exec .venv/bin/python -m pytest -q -n "${NEMO_GRANULAR_TEST_WORKERS:-2}" --dist loadgroup "$@"
