#!/usr/bin/env bash
# Set up the environment and run the whole test suite (the command CI runs).
#
# With NEMO_RL_SRC=<NeMo-RL checkout> (or NEMO_RL_VENDOR=<folder of source snapshots>), the
# real-host tests run against that NeMo-RL: scripts/nemo_rl_env.sh installs what they need.
# Two NeMo-RL worlds (docs/nemo-rl.md, "NeMo-RL versions"): the whole suite runs against the first
# (NEMO_RL_SRC, or the vendor folder's main snapshot, 7ea279abf), then V070_TESTS against the release
# v0.7.0 (NEMO_RL_V070_SRC=<v0.7.0 checkout>, or nemo-rl-v0.7.0.tar.gz in NEMO_RL_VENDOR); opt out
# with NEMO_GRANULAR_V070_TESTS=0. Tests named on the command line run in the first world only
# (NEMO_RL_VERSION=v0.7.0 makes that world v0.7.0).
# The Slurm tests (tests/test_slurm.py) install Debian's Slurm/munge packages, add node names
# to /etc/hosts and start daemons in network namespaces when run as root; opt out with
# NEMO_GRANULAR_SLURM_TESTS=0 (they then skip, which CI does not allow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
if [ -n "${NEMO_RL_SRC:-}" ] || [ -n "${NEMO_RL_VENDOR:-}" ]; then
  # shellcheck source=scripts/nemo_rl_env.sh
  given_src=${NEMO_RL_SRC:-}
  source scripts/nemo_rl_env.sh
  # the vendor folder's default snapshot is main (tests/test_nemo_rl_compat.py checks the detection)
  if [ -z "$given_src" ] && [ -z "${NEMO_RL_VERSION:-}" ]; then export NEMO_GRANULAR_EXPECT_NEMO_RL=main; fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# The suite runs on pytest-xdist workers (NEMO_GRANULAR_TEST_WORKERS, default 2; 0: one process): much
# of it waits (Ray and Megatron start-up, subprocesses) rather than computes, so two overlap even on two
# cores. tests/conftest.py keeps each module on one worker and the Ray-head modules together. The Slurm
# tests run afterwards on their own: they time daemons, requeues and signals, and failed when they shared
# two cores with the loop tests (slurmctld stopped answering; a USR1 test's job ended before its save).
WORKERS=${NEMO_GRANULAR_TEST_WORKERS:-2}
PYTEST=(.venv/bin/python -m pytest -q --durations=15)   # the slowest tests, for the CI time budget
(( WORKERS > 0 )) && PYTEST+=(-n "$WORKERS" --dist loadgroup)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then exec "${PYTEST[@]}" "$@"; fi  # tests named: just those
done
# The NeMo-RL v0.7.0 world: the NeMo-RL-world modules that pass on v0.7.0 (the import, the losses and
# estimators against NeMo-RL's own, run_grpo / run_sppo up to setup(), preflight on the shipped configs
# and NeMo-RL's own setup(), config loading, the worker extensions against the real workers) and the
# smallest loop selection that runs both DTensor loops through v0.7.0's own refit (one GRPO run, SSPO;
# the PPO run, SPPO; 151 s alone when measured); what stays untested there: docs/nemo-rl.md, "Support matrix"
# (tests/test_nemo_rl_compat.py keeps that table and this list in step).
V070_TESTS=(tests/test_package.py tests/test_nemo_rl_compat.py tests/test_nemo_rl_dropin.py
            tests/test_nemo_rl_estimators.py tests/test_nemo_rl_glue.py tests/test_nemo_rl_loss_equivalence.py
            tests/test_loss_nemo.py tests/test_host_configs.py tests/test_host_entrypoints.py
            tests/test_host_estimators_loop.py tests/test_host_loss_paths.py tests/test_host_workers.py
            tests/test_preflight.py tests/test_preflight_nemo_rl.py tests/test_sppo_configs.py
            tests/test_sppo_entry.py tests/test_sppo_wrapper.py tests/test_loop_actor_class.py
            tests/test_loop_grpo.py::test_sspo_loop_three_steps
            tests/test_loop_grpo.py::test_sspo_loss_in_the_loop_equals_the_float64_reference
            tests/test_loop_grpo.py::test_vllm_path_up_to_its_workers tests/test_loop_sppo.py)
# ... and, on the local Slurm cluster, a job launched as with NeMo-RL's v0.7.0 release container under
# pyxis (the test's `release` image is built from the world's NeMo-RL: here v0.7.0)
V070_SLURM_TESTS=(tests/test_slurm.py::test_real_preflight_passes_a_shipped_config_in_the_head_container)
v070_world() {   # in a subshell: the first world's variables stay as they are
  unset NEMO_RL_SRC MEGATRON_LM_SRC MEGATRON_BRIDGE_SRC AUTOMODEL_SRC
  if [ -n "${NEMO_RL_V070_SRC:-}" ]; then export NEMO_RL_SRC=$NEMO_RL_V070_SRC; else export NEMO_RL_VERSION=v0.7.0; fi
  export NEMO_GRANULAR_EXPECT_NEMO_RL=v0.7.0
  # shellcheck source=scripts/nemo_rl_env.sh
  source scripts/nemo_rl_env.sh
  local a=0 b=0
  "${PYTEST[@]}" "${V070_TESTS[@]}" "$@" || a=$?
  .venv/bin/python -m pytest -q "${V070_SLURM_TESTS[@]}" "$@" || b=$?
  if (( a && a != 5 )); then return "$a"; elif (( b && b != 5 )); then return "$b"; elif (( a == 5 && b == 5 )); then return 5; fi
}
# NeMo-RL runs its DTensor-v2 worker in the venv of its `automodel` extra, whose transformers is
# Automodel's pin (==5.5.0 at 7ea279ab), older than this world's 5.8 (its Megatron worker's `mcore`
# extra resolves to 5.8 as here): the DTensor worker-side modules run once more on that pin.
PINNED_TRANSFORMERS_TESTS=(tests/test_loop_dtensor_packing.py tests/test_export_automodel.py)
pinned_transformers_pass() {
  local pin dir
  pin=$(sed -n 's/^ *"transformers==\([0-9.]*\)".*/\1/p' "$AUTOMODEL_SRC/pyproject.toml" | head -n 1)
  [ -n "$pin" ] || { echo "no transformers==X pin in $AUTOMODEL_SRC/pyproject.toml"; return 1; }
  dir=$PWD/.venv/pinned-transformers-$pin
  if [ ! -f "$dir/.installed" ]; then
    rm -rf "$dir.partial"
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --target "$dir.partial" "transformers==$pin" \
      || return 1
    rm -rf "$dir" && mv "$dir.partial" "$dir" && touch "$dir/.installed"
  fi
  echo "--- NeMo-RL's DTensor worker side on Automodel's pinned transformers $pin"
  PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" NEMO_GRANULAR_EXPECT_TRANSFORMERS=$pin \
    "${PYTEST[@]}" "${PINNED_TRANSFORMERS_TESTS[@]}" "$@"
}
rc=0 slurm_rc=0 v070_rc=5   # 5: pytest's "no tests collected" (also: the v0.7.0 world did not run)
"${PYTEST[@]}" --ignore=tests/test_slurm.py "$@" || rc=$?
if [ -n "${AUTOMODEL_SRC:-}" ]; then
  pinned_transformers_pass "$@" || { c=$?; (( c == 5 )) || { (( rc && rc != 5 )) || rc=$c; }; }
fi
echo "--- the Slurm tests, on their own"
.venv/bin/python -m pytest -q tests/test_slurm.py "$@" || slurm_rc=$?
if [ "${NEMO_GRANULAR_V070_TESTS:-1}" != 0 ] && [ -z "${NEMO_RL_VERSION:-}" ] \
    && { [ -n "${NEMO_RL_V070_SRC:-}" ] || [ -f "${NEMO_RL_VENDOR:-/nonexistent}/nemo-rl-v0.7.0.tar.gz" ]; }; then
  echo "--- the NeMo-RL v0.7.0 world (${#V070_TESTS[@]} modules and tests)"
  start=$SECONDS
  v070_rc=0
  (v070_world "$@") || v070_rc=$?
  echo "--- the NeMo-RL v0.7.0 world took $((SECONDS - start)) s"
elif [ "${NEMO_GRANULAR_V070_TESTS:-1}" != 0 ] && { [ -n "${NEMO_RL_SRC:-}" ] || [ -n "${NEMO_RL_VENDOR:-}" ]; }; then
  echo "--- no NeMo-RL v0.7.0 here (NEMO_RL_V070_SRC, or nemo-rl-v0.7.0.tar.gz in NEMO_RL_VENDOR): its world did not run"
  [ "${CI:-}" = true ] && v070_rc=1
fi
# 5 is pytest's "no tests collected": a -k/-m selection may leave some of the runs empty
all_empty=1
for c in "$rc" "$slurm_rc" "$v070_rc"; do [ "$c" = 5 ] || all_empty=0; done
(( all_empty )) && exit 5
for c in "$rc" "$slurm_rc" "$v070_rc"; do if (( c && c != 5 )); then exit "$c"; fi; done
exit 0
