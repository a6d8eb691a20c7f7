#!/usr/bin/env bash
# Set up .venv and run the test suite in every world this machine has (the command CI runs).
#
#   bash scripts/test.sh                      # every world; a line per world first and last
#   bash scripts/test.sh tests/test_x.py ...  # just those tests (in the main world when it is present)
#
# The worlds (tests/README.md; a test's pytest markers say which it runs in):
#   standalone  always: the tests not marked nemo_rl or slurm, with no NeMo-RL importable
#   main        NeMo-RL main 7ea279ab (NEMO_RL_SRC, or the source cache): the nemo_rl tests, then the
#               transformers_pin ones again on Automodel's pinned transformers
#   slurm       the local Slurm cluster (root; Debian's slurm packages): the slurm tests not marked nemo_rl
#               (in a second lane, beside the standalone world); slurm-nemo-rl: those marked nemo_rl, with
#               main's NeMo-RL (then v0.7.0's one job: in the second lane, beside the main world)
#   v0.7.0      NeMo-RL v0.7.0 (NEMO_RL_V070_SRC, or the source cache): the tests marked v070 and nemo_rl
# Fill the source cache first (bash scripts/sources.sh, or --from DIR offline); a world whose sources are
# absent does not run and says why. Under CI=true a skipped test fails its world.
# shellcheck disable=SC2317  # the world set-up functions are called indirectly (world NAME SETUP ...)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# two pytest-xdist workers (NEMO_GRANULAR_TEST_WORKERS; 0: one process): much of the suite waits on Ray,
# Megatron start-up and subprocesses, so two overlap even on two cores; tests/conftest.py keeps each module
# on one worker. The Slurm tests run without xdist (one local cluster at a time), in a lane of their own.
WORKERS=${NEMO_GRANULAR_TEST_WORKERS:-2}
PYTEST=(.venv/bin/python -m pytest -q --durations=10)
XDIST=(); (( WORKERS > 0 )) && XDIST=(-n "$WORKERS" --dist loadgroup)
LOGS=$(mktemp -d)
declare -a PLAN=() RESULTS=()

main_world() {
  unset NEMO_RL_WORLD
  [ -n "${NEMO_RL_SRC:-}" ] || export NEMO_GRANULAR_EXPECT_NEMO_RL=main   # the cache's main tree is main
  source scripts/nemo_rl_env.sh
}
v070_world() {
  unset NEMO_RL_SRC MEGATRON_LM_SRC MEGATRON_BRIDGE_SRC AUTOMODEL_SRC
  if [ -n "${NEMO_RL_V070_SRC:-}" ]; then export NEMO_RL_SRC=$NEMO_RL_V070_SRC; fi
  export NEMO_RL_WORLD=v0.7.0 NEMO_GRANULAR_EXPECT_NEMO_RL=v0.7.0
  source scripts/nemo_rl_env.sh
}
# present WORLD: whether its sources are there (quietly; a reason on stdout when not)
present() {
  case $1 in
    main) [ -n "${NEMO_RL_SRC:-}" ] || { python3 scripts/sources.py env main >/dev/null; } 2>&1 ;;
    v0.7.0) [ -n "${NEMO_RL_V070_SRC:-}" ] || { python3 scripts/sources.py env v0.7.0 >/dev/null; } 2>&1 ;;
  esac
}

for arg in "$@"; do   # tests named: just those, in the main world when present
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    if [ -n "${NEMO_RL_SRC:-}" ] || present main >/dev/null; then main_world; fi
    [[ " $* " == *test_slurm.py* ]] && XDIST=()   # one local Slurm cluster at a time
    exec "${PYTEST[@]}" "${XDIST[@]}" "$@"
  fi
done

# world NAME SETUP MARKERS [pytest args...]: runs one world in a subshell, records its line
world() {
  local name=$1 setup=$2 markers=$3 start=$SECONDS rc=0 log=$LOGS/$1.log; shift 3
  echo "=== world $name: pytest -m \"$markers\""
  ( set +u; $setup || exit 90; set -u; "${PYTEST[@]}" -m "$markers" "$@" ) 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  local counts; counts=$(python3 - "$log" <<'EOF'
import re, sys
# pytest's closing line ("1 failed, 5 passed, 9 deselected in 80.1s (0:01:20)"), not a test's output
last = [l for l in open(sys.argv[1], errors="replace")
        if re.search(r"^=*\s*(\d+ \w+, )*\d+ (passed|failed|errors?|skipped|deselected|warnings?)\b.* in [\d.]+s\b", l)]
c = {k: 0 for k in ("passed", "failed", "errors", "skipped")}
for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last[-1] if last else ""):
    c["errors" if k.startswith("error") else k] += int(n)
print(", ".join(f"{v} {k}" for k, v in c.items()))
EOF
)
  local minutes; minutes=$(awk "BEGIN{printf \"%.1f\", ($SECONDS-$start)/60}")
  if (( rc == 90 )); then RESULTS+=("world $name: FAILED to set up ($minutes min)"); FAILED=1
  elif (( rc == 0 )); then RESULTS+=("world $name: ran, passed ($counts; $minutes min)")
  elif (( rc == 5 && USER_OPTS > 0 )); then RESULTS+=("world $name: ran, no test selected by the options given ($minutes min)")
  else RESULTS+=("world $name: ran, FAILED (exit $rc: $counts; $minutes min)"); FAILED=1; fi
}
pinned_transformers() {   # main's DTensor-v2 worker venv pins Automodel's transformers (==5.5.0 at 7ea279ab)
  main_world || return 1
  local pin dir
  pin=$(sed -n 's/^ *"transformers==\([0-9.]*\)".*/\1/p' "$AUTOMODEL_SRC/pyproject.toml" | head -n 1)
  [ -n "$pin" ] || { echo "no transformers==X pin in $AUTOMODEL_SRC/pyproject.toml"; return 1; }
  dir=$PWD/.venv/pinned-transformers-$pin
  if [ ! -f "$dir/.installed" ]; then
    rm -rf "$dir.partial"
    .venv/bin/pip install --quiet --disable-pip-version-check --no-compile --no-deps --target "$dir.partial" \
      "transformers==$pin" || return 1
    .venv/bin/python -m compileall -q -j 0 "$dir.partial" >/dev/null 2>&1 || true   # scripts/compile_venv.sh's why
    rm -rf "$dir" && mv "$dir.partial" "$dir" && touch "$dir/.installed"
  fi
  export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" NEMO_GRANULAR_EXPECT_TRANSFORMERS=$pin
}
no_nemo_rl() { unset NEMO_RL_SRC MEGATRON_LM_SRC MEGATRON_BRIDGE_SRC AUTOMODEL_SRC; }

FAILED=0 USER_OPTS=$#   # options given (e.g. -k EXPR) go to every world
if why=$(present main); then HAVE_MAIN=1; PLAN+=("world main: will run"); else HAVE_MAIN=0; PLAN+=("world main: will NOT run: $why"); fi
if why=$(present v0.7.0); then HAVE_V070=1; PLAN+=("world v0.7.0: will run"); else HAVE_V070=0; PLAN+=("world v0.7.0: will NOT run: $why"); fi
printf '%s\n' "world standalone: will run" "${PLAN[@]}" "world slurm: will run"
(( HAVE_MAIN )) && echo "world slurm-nemo-rl: will run"

# The Slurm worlds keep about one core of two busy (daemons, requeues, Ray start-up waits): they run in a
# second lane, their output printed when the lane is done. The Slurm tests that need no NeMo-RL run beside
# the standalone world (which alone keeps 1.6 cores busy); the rest, after main's set-up, beside the main
# world. Every set-up that installs into .venv (main_world's first use) waits for the lane before it and
# runs before the lane after it: an install under a running world broke it (transformers changed under
# its imports), and the standalone world keeps the newest transformers the package allows.
lane() {  # lane NAME WORLD-CALL...: worlds one after the other, beside lane 1; their lines in $LOGS/NAME.results
  local -a RESULTS=(); FAILED=0; local name=$1; shift
  "$@"
  printf '%s\n' "${RESULTS[@]}" >"$LOGS/$name.results"; echo "$FAILED" >"$LOGS/$name.failed"
}
start_lane() {  # start_lane NAME WORLD-CALL...: in the background (LANE_PID)
  lane "$@" >"$LOGS/$1.log" 2>&1 &
  LANE_PID=$!
}
join_lane() {   # join_lane NAME: wait for it, print its output, keep its world lines
  wait "$LANE_PID" || true
  echo "=== $1 (run beside the others)"
  cat "$LOGS/$1.log"
  if [ -f "$LOGS/$1.results" ]; then
    mapfile -t lane_results <"$LOGS/$1.results"; RESULTS+=("${lane_results[@]}")
    (( $(cat "$LOGS/$1.failed") == 0 )) || FAILED=1
  else
    RESULTS+=("world ${1%% *}: FAILED: its lane ended without results (see above)"); FAILED=1
  fi
}
slurm_with_nemo_rl() {   # and Automodel's pinned transformers (a few tests), which would otherwise wait for main
  if (( HAVE_MAIN )); then
    world slurm-nemo-rl main_world "slurm and nemo_rl" "$@"
    world main-transformers-pin pinned_transformers "transformers_pin" "${XDIST[@]}" "$@"
  fi
  if (( HAVE_V070 )); then world v0.7.0-slurm v070_world "v070 and nemo_rl and slurm" "$@"; fi
}

echo "=== the Slurm tests that need no NeMo-RL run beside the standalone world; their output follows when they are done"
start_lane "slurm" world slurm no_nemo_rl "slurm and not nemo_rl" "$@"
world standalone no_nemo_rl "not nemo_rl and not slurm" "${XDIST[@]}" "$@"
join_lane "slurm"
# the NeMo-RL worlds' one-time set-up (the nemo-rl-test extra), between the lanes
if (( HAVE_MAIN )); then ( main_world ) >/dev/null || true; elif (( HAVE_V070 )); then ( v070_world ) >/dev/null || true; fi
if (( HAVE_MAIN || HAVE_V070 )); then
  echo "=== the NeMo-RL Slurm worlds and the pinned-transformers one run beside the main world; their output follows when they are done"
  start_lane "slurm-nemo-rl" slurm_with_nemo_rl "$@"
fi
if (( HAVE_MAIN )); then
  world main main_world "nemo_rl and not slurm" "${XDIST[@]}" "$@"
else
  RESULTS+=("world main: did NOT run: $(present main || true)")
fi
if (( HAVE_V070 )); then
  world v0.7.0 v070_world "v070 and nemo_rl and not slurm" "${XDIST[@]}" "$@"
else
  RESULTS+=("world v0.7.0: did NOT run: $(present v0.7.0 || true)")
fi
if (( HAVE_MAIN || HAVE_V070 )); then join_lane "slurm-nemo-rl"; fi
echo "=== the worlds"
for name in standalone main main-transformers-pin slurm slurm-nemo-rl v0.7.0 v0.7.0-slurm; do   # in this order, whichever lane
  for line in "${RESULTS[@]}"; do [[ "$line" == "world $name:"* ]] && echo "$line"; done
done
rm -rf "$LOGS"
exit "$FAILED"
