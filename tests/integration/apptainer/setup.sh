#!/usr/bin/env bash
# Test infrastructure for the apptainer sandbox tier (Debian 12 has no apptainer package).
# Builds, once, under $MEGATRON_RL_APPTAINER_ROOT (default /var/cache/megatron-rl/apptainer):
#   rootfs/   a Debian sid root filesystem (debootstrap) with apptainer and python3-minimal
#   image/    the container image the tests run (a sandbox-directory image: a second, small
#             sid rootfs with python3-minimal)
#   apptainer a wrapper that runs rootfs/usr/bin/apptainer inside rootfs, entered with
#             bubblewrap (chroot fails there; see ../shared/notes/FEASIBILITY.md)
# Needs root, bubblewrap, debootstrap and Debian's package mirror. Idempotent: ~2-3 min the
# first time, instant afterwards.
set -euo pipefail
ROOT=${MEGATRON_RL_APPTAINER_ROOT:-/var/cache/megatron-rl/apptainer}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

write_wrapper() {
  # Host /tmp is bound (the tests check that the container's /tmp does not reach it), and so
  # are the directories apptainer is asked to bind (`--bind SRC:DST`: the workspace). The test
  # servers keep their workspaces outside /tmp (sandbox_servers.py): a recursive bind of /tmp
  # copies every mount below it, and a workspace (its own tmpfs) unmounted meanwhile made bwrap
  # fail ("Can't bind mount ... No such file or directory") as a setup error of another execution.
  # A root server runs the wrapper as nobody (--sandbox-uid), whose bwrap cannot make mount
  # points in the root-owned rootfs: the image's mount point is made here, and workspaces (under
  # host /var/tmp) are reached through a bind of /var/tmp, which rootfs has.
  (umask 022 && mkdir -p "$ROOT/rootfs$ROOT/image")
  cat > "$ROOT/apptainer" <<WRAP
#!/usr/bin/env bash
# apptainer from $ROOT/rootfs, entered with bubblewrap; host /tmp, the directories apptainer
# binds (the sandbox server's workspace) and the image are visible at the same paths.
binds=()
prev=
for arg in "\$@"; do
  if [[ \$prev == --bind ]]; then src=\${arg%%:*}; [[ \$src == /var/tmp/* ]] || binds+=(--bind "\$src" "\$src"); fi
  prev=\$arg
done
exec bwrap --bind "$ROOT/rootfs" / --dev-bind /dev /dev --dev-bind /proc /proc --bind /sys /sys \\
  --bind /tmp /tmp --bind /var/tmp /var/tmp "\${binds[@]}" --tmpfs /run --ro-bind "$ROOT/image" "$ROOT/image" \\
  --ro-bind /etc/resolv.conf /etc/resolv.conf --die-with-parent /usr/bin/apptainer "\$@"
WRAP
  chmod +x "$ROOT/apptainer"
}

if [[ -x "$ROOT/apptainer" && -f "$ROOT/.complete" ]]; then
  write_wrapper  # cheap: an older cached wrapper is replaced
  exit 0
fi
command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
command -v bwrap >/dev/null || { apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; }
mkdir -p "$ROOT"

enter() {  # run a command inside a root filesystem
  local rootfs=$1; shift
  bwrap --bind "$rootfs" / --dev-bind /dev /dev --proc /proc --bind /sys /sys --tmpfs /tmp --tmpfs /run \
        --ro-bind /etc/resolv.conf /etc/resolv.conf --die-with-parent "$@"
}

bootstrap() {  # debootstrap a minimal sid root with extra packages
  local rootfs=$1; shift
  if [[ ! -f "$rootfs/.bootstrapped" ]]; then
    rm -rf "$rootfs"
    debootstrap --variant=minbase sid "$rootfs" "$MIRROR" >/dev/null
    touch "$rootfs/.bootstrapped"
  fi
  printf '127.0.0.1 localhost\n' > "$rootfs/etc/hosts"
  enter "$rootfs" /usr/bin/env DEBIAN_FRONTEND=noninteractive apt-get -qq -o Acquire::Check-Valid-Until=false update
  enter "$rootfs" /usr/bin/env DEBIAN_FRONTEND=noninteractive apt-get -qq -y --no-install-recommends install "$@" >/dev/null
}

echo "[apptainer-setup] building $ROOT/rootfs (apptainer) and $ROOT/image (python3)" >&2
bootstrap "$ROOT/rootfs" apptainer python3-minimal
bootstrap "$ROOT/image" python3-minimal

write_wrapper
"$ROOT/apptainer" --version >&2
touch "$ROOT/.complete"
