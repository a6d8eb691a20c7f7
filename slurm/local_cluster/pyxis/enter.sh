#!/usr/bin/env bash
# The task side of the local cluster's pyxis emulation (started by ./srun inside the job step, on
# the node): runs "$@" in a container root that follows pyxis' rules for --container-image, made
# with util-linux's unshare (a private mount namespace), bind mounts and chroot. Each stage is
# exec'd: no process stays in between to die of the signals Slurm sends the step (USR1, TERM).
#
# * the file system is the image: the image directory's rootfs/ (read-only) and its layers
#   (read-only), over the node's /usr and /etc as the image's base system; the node's other
#   directories ($HOME, /work, /opt, ...) do not exist inside. /tmp is the container's own: one per
#   --container-name per node, shared by the steps that name it and kept across jobs (as a named
#   container's file system is under pyxis' default global scope), a fresh one per step otherwise;
# * --container-mounts SRC:DST[:ro|:rw] are bind-mounted; $HOME only without --no-container-mount-home;
# * environment (pyxis' --container-env help): every exported variable of the step is set, but the
#   image's values (IMAGE/env) take precedence, except for the variables named in --container-env;
# * the working directory is --container-workdir (it must exist inside), else /.
# * the task runs as a non-root user, as enroot runs a user's container: NG_PYXIS_USER (in the
#   step's environment; default `nobody`), mapped in a user namespace to the step's own user (root on
#   the test cluster) as enroot maps the submitting user: inside, the task is that user with no
#   capabilities, and the job's files, the image's and the mounts' (owned by the step's user outside)
#   are its own, as a user's container and its files are the user's under enroot. HOME is that user's home
#   directory, empty and not writable: the container's root is read-only (only /tmp, /dev and the
#   mounts are writable). uv has no index and an empty cache (UV_OFFLINE=1; UV_CACHE_DIR and
#   XDG_CACHE_HOME unset). --container-remap-root (NG_PYXIS_REMAP_ROOT=1) runs the task as root.
# Network, PIDs, /dev (with /dev/shm) and /sys are the node's, as in an enroot container. The image's
# own directories are read-only, as with pyxis' --container-readonly.
set -euo pipefail
if [[ -z "${NG_PYXIS_INNER:-}" ]]; then
  NG_PYXIS_INNER=1 exec unshare --mount --propagation private bash "${BASH_SOURCE[0]}" "$@"
fi
unset NG_PYXIS_INNER
image=${NG_PYXIS_IMAGE:?} mounts=${NG_PYXIS_MOUNTS:-} workdir=${NG_PYXIS_WORKDIR:-} name=${NG_PYXIS_NAME:-}
envs=${NG_PYXIS_ENV:-} mount_home=${NG_PYXIS_MOUNT_HOME:-1} user=${NG_PYXIS_USER:-}
if [[ "${NG_PYXIS_REMAP_ROOT:-0}" == 1 ]]; then user=""; else user=${user:-nobody}; fi
unset NG_PYXIS_IMAGE NG_PYXIS_MOUNTS NG_PYXIS_WORKDIR NG_PYXIS_NAME NG_PYXIS_ENV NG_PYXIS_MOUNT_HOME NG_PYXIS_USER \
  NG_PYXIS_REMAP_ROOT
die() { echo "pyxis (emulation): $*" >&2; exit 125; }

# the container's own /tmp: a named container's is kept on its node across jobs, as pyxis' default
# container_scope=global keeps an enroot container pyxis_<name>, until `enroot remove` (../pyxis/enroot);
# a step that names an existing container runs in it, with the image it was created from, whatever
# --container-image says (as pyxis starts an existing container instead of importing the image).
# An unnamed step's is its own.
state=${NG_PYXIS_STATE:-/tmp/ng-pyxis}/${SLURM_JOB_ID:-nojob}/$(hostname)
if [[ -n "$name" ]]; then
  named=${NG_PYXIS_STATE:-/tmp/ng-pyxis}/$(hostname)/pyxis_$name
  mkdir -p "$named/tmp"
  if [[ -s "$named/image" ]]; then image=$(<"$named/image"); else printf '%s\n' "$image" >"$named/image"; fi
  ctmp=$named/tmp
else
  ctmp=$state/step-${SLURM_STEP_ID:-0}.${SLURM_PROCID:-0}/tmp
fi
mkdir -p "$ctmp" && chmod 1777 "$ctmp"

root=$state/root-${SLURM_STEP_ID:-0}.${SLURM_PROCID:-0}.$$
mkdir -p "$root"
mount -t tmpfs -o mode=755 ng-pyxis-root "$root"
bind() {  # bind ro|rw SRC DEST: SRC visible at DEST inside the root
  if [[ -d "$2" ]]; then mkdir -p "$root$3"; else mkdir -p "$(dirname "$root$3")"; [[ -e "$root$3" ]] || : >>"$root$3"; fi
  mount --rbind "$2" "$root$3"
  [[ "$1" == rw ]] || mount -o remount,bind,ro "$root$3"
}
bind ro /usr /usr
bind ro /etc /etc
bind ro /sys /sys
bind rw /dev /dev
bind rw /proc /proc
bind rw "$ctmp" /tmp
mkdir -p "$root/var/tmp" "$root/run"
for l in bin lib lib64 sbin; do
  if [[ -L /$l ]]; then ln -s "$(readlink "/$l")" "$root/$l"; elif [[ -d /$l ]]; then bind ro "/$l" "/$l"; fi
done
for entry in "$image"/rootfs/*; do
  [[ -e "$entry" ]] || continue
  top=$(basename "$entry")
  case "$top" in usr|etc|proc|dev|sys|tmp|bin|lib|lib64|sbin) die "image $image: rootfs/$top would replace the base system" ;; esac
  bind ro "$entry" "/$top"
done
if [[ -f "$image/layers" ]]; then
  while read -r src dst; do
    [[ -z "$src" || "$src" == \#* ]] && continue
    [[ -e "$src" ]] || die "image $image: layer source $src does not exist"
    bind ro "$src" "$dst"
  done <"$image/layers"
fi
if [[ "$mount_home" == 1 && -n "${HOME:-}" && -d "$HOME" ]]; then bind rw "$HOME" "$HOME"; fi
if [[ -n "$mounts" ]]; then
  IFS=, read -r -a specs <<<"$mounts"
  for spec in "${specs[@]}"; do
    IFS=: read -r src dst flags extra <<<"$spec"
    [[ -z "${extra:-}" ]] || die "--container-mounts: cannot parse '$spec' (SRC:DST[:ro|rw])"
    dst=${dst:-$src}
    [[ -e "$src" ]] || die "--container-mounts: $src: No such file or directory"
    case "${flags:-rw}" in
      rw|ro) bind "${flags:-rw}" "$src" "$dst" ;;
      *) die "--container-mounts: unknown flag '$flags' in '$spec' (ro or rw)" ;;
    esac
  done
fi
workdir=${workdir:-/}
[[ -d "$root$workdir" ]] || die "--container-workdir: $workdir does not exist in the container"
as_user=()
if [[ -n "$user" ]]; then
  IFS=: read -r _ _ uid gid _ uhome _ < <(getent passwd "$user") || true
  [[ "${uid:-0}" != 0 ]] || die "NG_PYXIS_USER=$user: not a non-root user of $(hostname)"
  [[ -e "$root$uhome" ]] || mkdir -p "$root$uhome"   # empty; the root is read-only below
  as_user=(unshare "--map-user=$uid" "--map-group=$gid")
fi
mount -o remount,ro "$root"   # the container's own root (its submounts keep their own flags)

# the image's environment wins, except for the variables named in --container-env
declare -A from_host=()
if [[ -n "$envs" ]]; then IFS=, read -r -a names <<<"$envs"; for n in "${names[@]}"; do from_host[$n]=1; done; fi
while IFS= read -r line || [[ -n "$line" ]]; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  key=${line%%=*}
  [[ "$key" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "image $image: bad line in env: $line"
  if [[ -n "${from_host[$key]:-}" && -v "$key" ]]; then continue; fi
  export "$key=${line#*=}"
done <"$image/env"
if [[ -n "$user" ]]; then
  export HOME=$uhome USER=$user LOGNAME=$user UV_OFFLINE=1
  unset UV_CACHE_DIR XDG_CACHE_HOME
fi
# shellcheck disable=SC2016  # expanded inside the container
enter='cd "$1" && shift && exec "$@"'
if (( ${#as_user[@]} )); then   # the user namespace first: the kernel refuses one to a chrooted process
  exec "${as_user[@]}" "--root=$root" /bin/bash -c "$enter" _ "$workdir" "$@"
fi
exec chroot "$root" /bin/bash -c "$enter" _ "$workdir" "$@"
