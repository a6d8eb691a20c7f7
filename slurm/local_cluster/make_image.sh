#!/usr/bin/env bash
# Make an image DIRECTORY for the local cluster's pyxis emulation (pyxis/srun, pyxis/enter.sh):
# what a NeMo-RL release container holds, made from a Python environment of this machine.
#
#   slurm/local_cluster/make_image.sh IMAGE_DIR --venv PREFIX [--nemo-rl DIR] [--layer SRC:DEST]...
#       [--env KEY=VALUE]... [--worker-venv CLASS_FQN]... [--worker-pth LINE]...
#
# The image, as NeMo-RL's Dockerfile lays it out:
#   /opt/nemo_rl_venv          the driver's venv (UV_PROJECT_ENVIRONMENT): bin/python, the console
#                              scripts of PREFIX (ray, ...) rewritten for this path, and PREFIX's
#                              site-packages, a link into the uv cache (below); its interpreter is
#                              PREFIX's base Python, a layer at the same path as on this machine
#   /root/.cache/uv            uv's cache, which the venvs' packages link into (the Dockerfile's
#                              `uv sync --link-mode symlink`): PREFIX's site-packages as a read-only
#                              layer at /root/.cache/uv/archive-v0/image-site-packages, so that a
#                              mount over /root/.cache/uv hides every package, as in NeMo-RL's image
#   /opt/ray_venvs/CLASS_FQN   a prebuilt worker venv per --worker-venv (NEMO_RL_VENV_DIR): the same
#                              packages, as the image prefetches the venvs of NeMo-RL's registry;
#                              with --worker-pth, a .pth in the worker venvs' own site-packages holds
#                              those LINEs (paths inside the image, or `import ...` lines), then
#                              PREFIX's site-packages: what only the workers have (NeMo-RL's `mcore`
#                              extra is only in its Megatron worker's venv)
#   /opt/nemo-rl               the NeMo-RL checkout the image was built from (--nemo-rl DIR)
#   /root/.local/bin/uv        PREFIX's uv, when it has one (NeMo-RL's image installs uv there)
# IMAGE_DIR/env holds the image's environment, the variables NeMo-RL's docker/Dockerfile sets (7ea279abf
# and v0.7.0; no VIRTUAL_ENV): PATH (the venv first, then /root/.local/bin), UV_PROJECT_ENVIRONMENT,
# UV_LINK_MODE, NEMO_RL_VENV_DIR=/opt/ray_venvs, NEMO_GYM_VENV_DIR, NRL_CONTAINER, TORCH_CUDA_ARCH_LIST,
# RAY_USAGE_STATS_ENABLED, RAY_ENABLE_UV_RUN_RUNTIME_ENV, then each --env (e.g. PYTHONPATH=/opt/nemo-rl:
# the real image installs NeMo-RL into its venv instead).
# IMAGE_DIR/rootfs is the image's own tree, IMAGE_DIR/layers its read-only layers (SRC DEST).
set -euo pipefail
die() { echo "make_image: $*" >&2; exit 2; }
(( $# )) || die "usage: make_image.sh IMAGE_DIR --venv PREFIX [--nemo-rl DIR] [--layer SRC:DEST] [--env K=V] [--worker-venv FQN]"
IMAGE=$1; shift
VENV="" NRL="" layers=() envs=() workers=() worker_pth=()
while (( $# )); do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --nemo-rl) NRL=$2; shift 2 ;;
    --layer) layers+=("$2"); shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    --worker-venv) workers+=("$2"); shift 2 ;;
    --worker-pth) worker_pth+=("$2"); shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ -x "$VENV/bin/python" ]] || die "--venv $VENV: no bin/python"
[[ -z "$NRL" || -d "$NRL/nemo_rl" ]] || die "--nemo-rl $NRL: no nemo_rl/ package"
[[ ! -e "$IMAGE" ]] || die "$IMAGE exists"
VENV=$(cd "$VENV" && pwd -P)
read -r base pyver site < <("$VENV/bin/python" -c 'import sys, sysconfig, os
print(os.path.realpath(sys.executable), f"python{sys.version_info[0]}.{sys.version_info[1]}", sysconfig.get_paths()["purelib"])')
base_prefix=$(dirname "$(dirname "$base")")
mkdir -p "$IMAGE/rootfs/opt" "$IMAGE/rootfs/root/.cache/uv"   # ray.sub mounts a uv cache there
: >"$IMAGE/layers"
layer() {  # layer SRC DEST: read-only content of the image (a folder or a file), visible only at DEST
  if [[ -d "$1" ]]; then mkdir -p "$IMAGE/rootfs$2"; else mkdir -p "$(dirname "$IMAGE/rootfs$2")"; : >"$IMAGE/rootfs$2"; fi
  echo "$1 $2" >>"$IMAGE/layers"
}
[[ "$base_prefix" == /usr || "$base_prefix" == /usr/* ]] || layer "$base_prefix" "$base_prefix"

make_venv() {  # make_venv DEST [PTH_LINE...]: a venv at DEST with PREFIX's packages (after the PTH_LINEs)
  local dest=$1 f first
  shift
  mkdir -p "$IMAGE/rootfs$dest/bin"
  ln -s "$base" "$IMAGE/rootfs$dest/bin/python"
  ln -s python "$IMAGE/rootfs$dest/bin/python3"
  ln -s python "$IMAGE/rootfs$dest/bin/$pyver"
  printf 'home = %s\ninclude-system-site-packages = false\nversion = %s\n' "$(dirname "$base")" "${pyver#python}" \
    >"$IMAGE/rootfs$dest/pyvenv.cfg"
  for f in "$VENV"/bin/*; do
    [[ -f "$f" && ! -L "$f" && "$(basename "$f")" != nemo-granular ]] || continue   # NeMo-RL's image has no nemo-granular
    IFS= read -r first <"$f" || continue
    if [[ "$first" == "#!$VENV/bin/python"* ]]; then
      { echo "#!$dest/bin/python"; tail -n +2 "$f"; } >"$IMAGE/rootfs$dest/bin/$(basename "$f")"
      chmod 755 "$IMAGE/rootfs$dest/bin/$(basename "$f")"
    fi
  done
  if (( $# )); then   # its own site-packages: a .pth of the lines, then the driver venv's packages
    mkdir -p "$IMAGE/rootfs$dest/lib/$pyver/site-packages"
    printf '%s\n' "$@" "/opt/nemo_rl_venv/lib/$pyver/site-packages" >"$IMAGE/rootfs$dest/lib/$pyver/site-packages/image_worker.pth"
  else   # the packages are the uv cache's (one link for the folder; the real image links each package)
    mkdir -p "$IMAGE/rootfs$dest/lib/$pyver"
    ln -s "$UV_SITE" "$IMAGE/rootfs$dest/lib/$pyver/site-packages"
  fi
}
UV_SITE=/root/.cache/uv/archive-v0/image-site-packages
layer "$site" "$UV_SITE"
make_venv /opt/nemo_rl_venv
for w in "${workers[@]}"; do make_venv "/opt/ray_venvs/$w" "${worker_pth[@]}"; done
mkdir -p "$IMAGE/rootfs/opt/ray_venvs"
[[ -z "$NRL" ]] || layer "$(cd "$NRL" && pwd)" /opt/nemo-rl
[[ ! -x "$VENV/bin/uv" ]] || layer "$VENV/bin/uv" /root/.local/bin/uv
for l in "${layers[@]}"; do layer "${l%%:*}" "${l#*:}"; done
{
  echo "PATH=/opt/nemo_rl_venv/bin:/root/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  echo "NRL_CONTAINER=1"
  echo "RAY_USAGE_STATS_ENABLED=0"
  echo "RAY_ENABLE_UV_RUN_RUNTIME_ENV=0"
  echo "NEMO_RL_VENV_DIR=/opt/ray_venvs"
  echo "NEMO_GYM_VENV_DIR=/opt/gym_venvs"
  echo "UV_PROJECT_ENVIRONMENT=/opt/nemo_rl_venv"
  echo "UV_LINK_MODE=copy"
  echo "TORCH_CUDA_ARCH_LIST=9.0 10.0"
  for e in "${envs[@]}"; do echo "$e"; done
} >"$IMAGE/env"
echo "make_image: $IMAGE (python $base, packages of $VENV${NRL:+, NeMo-RL $NRL})"
