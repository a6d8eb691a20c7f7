#!/usr/bin/env bash
# Make a real NeMo-RL available to the test suite (source this file).
#
#   NEMO_RL_SRC=/path/to/NeMo-RL  source scripts/nemo_rl_env.sh   # your own checkout
#   source scripts/nemo_rl_env.sh                                # the source cache's main world
#   NEMO_RL_WORLD=v0.7.0 source scripts/nemo_rl_env.sh           # the source cache's v0.7.0 world
#
# Without NEMO_RL_SRC the trees come from the source cache (bash scripts/sources.sh fills it;
# `scripts/sources.py env WORLD` names them). With NEMO_RL_SRC, Megatron-LM / Megatron-Bridge /
# Automodel default to NeMo-RL's own submodules under 3rdparty/ when checked out there.
# Exports NEMO_RL_SRC, MEGATRON_LM_SRC, MEGATRON_BRIDGE_SRC, AUTOMODEL_SRC (those found) and installs
# the `nemo-rl-test` extra into .venv with torch held at the installed version. Returns 3 (the world
# is absent: a one-line reason on stderr) or 1 (an error). tests/conftest.py reads the variables.

# `return 1 2>/dev/null || exit 1` below: return when sourced, exit when run; shellcheck cannot know which
# shellcheck disable=SC2317
_ng_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ -z "${NEMO_RL_SRC:-}" ]; then
  _ng_exports=$(python3 "$_ng_root/scripts/sources.py" env "${NEMO_RL_WORLD:-main}") || {
    _rc=$?; unset _ng_root _ng_exports; return "$_rc" 2>/dev/null || exit "$_rc"; }
  eval "$_ng_exports"
fi

if [ ! -d "$NEMO_RL_SRC/nemo_rl" ]; then
  echo "nemo_rl_env: NEMO_RL_SRC=$NEMO_RL_SRC has no nemo_rl/ package (expected a NeMo-RL checkout)" >&2
  return 1 2>/dev/null || exit 1
fi
export NEMO_RL_SRC
_sub="$NEMO_RL_SRC/3rdparty"
[ -z "${MEGATRON_LM_SRC:-}" ] && [ -d "$_sub/Megatron-LM-workspace/Megatron-LM/megatron" ] && export MEGATRON_LM_SRC="$_sub/Megatron-LM-workspace/Megatron-LM"
[ -z "${MEGATRON_BRIDGE_SRC:-}" ] && [ -d "$_sub/Megatron-Bridge-workspace/Megatron-Bridge/src" ] && export MEGATRON_BRIDGE_SRC="$_sub/Megatron-Bridge-workspace/Megatron-Bridge/src"
[ -z "${AUTOMODEL_SRC:-}" ] && [ -d "$_sub/Automodel-workspace/Automodel" ] && export AUTOMODEL_SRC="$_sub/Automodel-workspace/Automodel"
_stamp="$_ng_root/.venv/.nemo_granular_nemo_rl_test"
if [ ! -f "$_stamp" ] || [ "$_ng_root/pyproject.toml" -nt "$_stamp" ]; then
  echo "nemo_rl_env: installing the nemo-rl-test extra into $_ng_root/.venv (first use: a few minutes) ..." >&2
  _torch=$("$_ng_root/.venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
  echo "torch==$_torch" > "$_ng_root/.venv/torch-constraint.txt"
  "$_ng_root/.venv/bin/pip" install --quiet --disable-pip-version-check --no-compile \
    -c "$_ng_root/.venv/torch-constraint.txt" -e "${_ng_root}[nemo-rl-test]" 2>&1 | grep -v "^WARNING: Location" || true
  bash "$_ng_root/scripts/compile_venv.sh"
  "$_ng_root/.venv/bin/python" -W ignore -c "import torch, ray, hydra, transformers, megatron.core" 2>/dev/null \
    || { echo "nemo_rl_env: installing the nemo-rl-test extra failed" >&2; return 1 2>/dev/null || exit 1; }
  touch "$_stamp"
fi
# Byte-compile the trees once (a no-op after): with PYTHONDONTWRITEBYTECODE set, as on CI's machines,
# every process (Ray actor, driver, rank) would compile them again on import: ~2 s each of a Megatron
# worker's ~25 s import. A file that is not 3.x-version syntax is skipped by the import too: compileall's
# failures do not matter here.
for _tree in "$NEMO_RL_SRC/nemo_rl" "${MEGATRON_LM_SRC:+$MEGATRON_LM_SRC/megatron}" "${MEGATRON_BRIDGE_SRC:-}" \
             "${AUTOMODEL_SRC:+$AUTOMODEL_SRC/nemo_automodel}"; do
  [ -n "$_tree" ] && [ -d "$_tree" ] && [ -w "$_tree" ] && "$_ng_root/.venv/bin/python" -m compileall -q -j 0 "$_tree" >/dev/null 2>&1
done
echo "NeMo-RL for tests: $NEMO_RL_SRC${MEGATRON_LM_SRC:+ | Megatron-LM: $MEGATRON_LM_SRC}"
unset _ng_root _ng_exports _sub _stamp _torch _tree
