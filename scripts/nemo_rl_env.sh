#!/usr/bin/env bash
# Make a real NeMo-RL checkout available to the test suite (source this file).
#
#   NEMO_RL_SRC=/path/to/NeMo-RL  source scripts/nemo_rl_env.sh   # your own clone
#   NEMO_RL_VENDOR=/dir/of/tarballs source scripts/nemo_rl_env.sh # unmodified source snapshots
#   NEMO_RL_VENDOR=/dir/of/tarballs NEMO_RL_VERSION=v0.7.0 source scripts/nemo_rl_env.sh
#
# With NEMO_RL_VENDOR, the snapshot nemo-rl-$NEMO_RL_VERSION.tar.gz (default 7ea279abf, the commit
# the plugin is written against; v0.7.0 is the release) and the megatron-lm-*.tar.gz,
# megatron-bridge-*.tar.gz and automodel-*.tar.gz found there are extracted into .vendor/
# (once; keyed by the tarball name). The Megatron/Automodel snapshots are the ones 7ea279abf pins;
# v0.7.0 pins the same Automodel but a Megatron-Bridge that the vendor folder does not hold. With NEMO_RL_SRC, the Megatron-LM / Megatron-Bridge /
# Automodel sources default to NeMo-RL's own submodules under 3rdparty/ when present.
# Exports NEMO_RL_SRC, MEGATRON_LM_SRC, MEGATRON_BRIDGE_SRC, AUTOMODEL_SRC (those found) and
# installs the `nemo-rl-test` extra into .venv with torch held at the installed version.
# tests/conftest.py reads the variables; nothing else in the project depends on them.

# `return 1 2>/dev/null || exit 1` below: return when sourced, exit when run; shellcheck cannot know which
# shellcheck disable=SC2317
_ng_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

_ng_extract() {  # _ng_extract NAME [VERSION] -> extracts NEMO_RL_VENDOR/NAME-VERSION.tar.gz (no VERSION: the
  # only / first NAME-*.tar.gz), prints its top folder
  local tarball="" candidate name dest
  if [ -n "${2:-}" ]; then
    tarball="$NEMO_RL_VENDOR/$1-$2.tar.gz"
    [ -f "$tarball" ] || { echo "nemo_rl_env: no $1-$2.tar.gz in NEMO_RL_VENDOR=$NEMO_RL_VENDOR" >&2; return 1; }
  fi
  for candidate in "$NEMO_RL_VENDOR/$1"-*.tar.gz; do
    [ -z "$tarball" ] && [ -f "$candidate" ] && { tarball=$candidate; break; }
  done
  [ -n "$tarball" ] || return 0
  name=$(basename "$tarball" .tar.gz)
  dest="$_ng_root/.vendor/$name"
  if [ ! -f "$dest/.extracted" ]; then
    rm -rf "$dest.partial" && mkdir -p "$dest.partial"
    tar xzf "$tarball" -C "$dest.partial" || { echo "nemo_rl_env: cannot extract $tarball" >&2; return 1; }
    rm -rf "$dest" && mv "$dest.partial" "$dest" && touch "$dest/.extracted"
  fi
  # each snapshot holds one top folder (nemo-rl/, Megatron-LM/, ...)
  find "$dest" -mindepth 1 -maxdepth 1 -type d | head -n 1
}

if [ -z "${NEMO_RL_SRC:-}" ] && [ -n "${NEMO_RL_VENDOR:-}" ]; then
  [ -d "$NEMO_RL_VENDOR" ] || { echo "nemo_rl_env: NEMO_RL_VENDOR=$NEMO_RL_VENDOR is not a folder" >&2; return 1 2>/dev/null || exit 1; }
  NEMO_RL_SRC=$(_ng_extract nemo-rl "${NEMO_RL_VERSION:-7ea279abf}") || { unset NEMO_RL_SRC; return 1 2>/dev/null || exit 1; }
  _d=$(_ng_extract megatron-lm); [ -n "$_d" ] && export MEGATRON_LM_SRC=${MEGATRON_LM_SRC:-$_d}
  _d=$(_ng_extract megatron-bridge); [ -n "$_d" ] && export MEGATRON_BRIDGE_SRC=${MEGATRON_BRIDGE_SRC:-$_d/src}
  _d=$(_ng_extract automodel); [ -n "$_d" ] && export AUTOMODEL_SRC=${AUTOMODEL_SRC:-$_d}
fi

if [ -n "${NEMO_RL_SRC:-}" ]; then
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
    _torch=$("$_ng_root/.venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
    echo "torch==$_torch" > "$_ng_root/.venv/torch-constraint.txt"
    "$_ng_root/.venv/bin/pip" install --quiet --disable-pip-version-check -c "$_ng_root/.venv/torch-constraint.txt" \
      -e "${_ng_root}[nemo-rl-test]" 2>&1 | grep -v "^WARNING: Location" || true
    "$_ng_root/.venv/bin/python" -W ignore -c "import torch, ray, hydra, transformers, megatron.core" 2>/dev/null \
      || { echo "nemo_rl_env: installing the nemo-rl-test extra failed" >&2; return 1 2>/dev/null || exit 1; }
    touch "$_stamp"
  fi
  echo "NeMo-RL for tests: $NEMO_RL_SRC${MEGATRON_LM_SRC:+ | Megatron-LM: $MEGATRON_LM_SRC}"
fi
unset -f _ng_extract; unset _ng_root _d _sub _stamp _torch
