#!/usr/bin/env bash
# Runs a command under Debian 12's own kernel in a QEMU virtual machine that
# sees this machine's root file system read-only: for what this machine's
# kernel lacks. Today that is the `tls` module, without which kernel TLS
# (--data_plane_ktls) cannot be tried here (this kernel is built without
# CONFIG_TLS; Debian's has it as a module).
#
#   tests/vm/run_in_vm.sh [--out=DIR] [--accel=tcg|kvm] [--cpus=N]
#                         [--memory_mb=M] [--timeout_s=S] -- COMMAND [ARG...]
#
# COMMAND runs as root in the current directory, with PATH and HOME, after
# the guest loaded the `tls` module and brought up its loopback. The guest
# sees this machine's files as they are, and what it writes stays in its
# memory (an overlay on a read-only share) and is gone when it ends, except
# under --out=DIR, which it writes through to this machine. Its network is
# its own loopback (it has no network device). The script
# prints COMMAND's output and exits with its exit status; 124 when the guest
# did not finish in --timeout_s, and 2 with one line on a bad flag or a
# missing part.
#
# Accelerator: tcg (the default) emulates the CPU, so the guest runs some
# 10-50x slower than this machine and its timings say nothing about speed;
# use it to check that code paths work. --accel=kvm needs a usable /dev/kvm
# (on this project's 2-core VMs /dev/kvm opens but a guest kernel never gets
# past its decompressor, so it is not the default).
#
# What it fetches (once, into $PSTRAIN_VM_CACHE, default
# /var/cache/pstrain-vm): Debian's linux-image and busybox-static packages,
# by `apt-get download`, unpacked there; nothing is installed on this
# machine. It needs qemu-system-x86 installed (deploy/setup.sh installs it).
set -euo pipefail

out=""
accel=tcg
cpus=2
memory_mb=4096
timeout_s=900
die() {
  echo "run_in_vm.sh: $*" >&2
  exit 2
}
while [[ $# -gt 0 ]]; do
  case $1 in
    --out=*) out=${1#*=} ;;
    --accel=*) accel=${1#*=} ;;
    --cpus=*) cpus=${1#*=} ;;
    --memory_mb=*) memory_mb=${1#*=} ;;
    --timeout_s=*) timeout_s=${1#*=} ;;
    --) shift; break ;;
    *) die "unknown flag $1 (flags go before --, the command after it)" ;;
  esac
  shift
done
[[ $# -gt 0 ]] || die "no command: give it after --"
[[ $accel == tcg || $accel == kvm ]] || die "--accel=$accel: tcg or kvm"
for n in cpus memory_mb timeout_s; do
  [[ ${!n} =~ ^[1-9][0-9]*$ ]] || die "--$n=${!n}: a positive whole number"
done
if [[ -n $out ]]; then
  [[ -d $out ]] || die "--out=$out: not a directory"
  out=$(cd "$out" && pwd)
fi
qemu=$(command -v qemu-system-x86_64) ||
  die "qemu-system-x86_64 not found (deploy/setup.sh installs it)"
[[ $accel == tcg || -w /dev/kvm ]] || die "--accel=kvm: /dev/kvm not usable"
[[ $(id -u) == 0 ]] || die "needs root (the guest runs the command as root)"

# The initramfs: busybox, the modules that reach the host's files over
# virtio 9p and lay a writable layer in memory over them (overlay), `tls`, and the AES-GCM the kernel's TLS asks the crypto API for
# (without them TLS_TX fails with ENOENT and OpenSSL quietly stays in user
# space), in load order: each after what it depends on.
load_order=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev
  virtio_pci 9pnet 9pnet_virtio netfs fscache 9p overlay
  cryptd crypto_simd aesni-intel gf128mul ghash-generic ghash-clmulni-intel
  ctr gcm tls)

# Kept between runs: the kernel and the initramfs made for it, rebuilt when
# the module list above changes.
cache=${PSTRAIN_VM_CACHE:-/var/cache/pstrain-vm}
kernel=$cache/vmlinuz
initramfs=$cache/initramfs.gz
stamp="${load_order[*]}"
if [[ ! -f $cache/ready || $(cat "$cache/ready") != "$stamp" ]]; then
  echo "run_in_vm.sh: fetching Debian's kernel and busybox into $cache" >&2
  kernel_package() {
    apt-cache depends linux-image-amd64 2>/dev/null |
      awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
  }
  image=$(kernel_package)
  if [[ -z $image ]]; then  # a machine whose package lists were never read
    apt-get update -qq >/dev/null 2>&1 || true
    image=$(kernel_package)
  fi
  [[ -n $image ]] || die "apt-cache knows no linux-image-amd64 (apt-get update?)"
  mkdir -p "$cache"
  work=$(mktemp -d "$cache/fetch.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download "$image" busybox-static >/dev/null 2>&1) ||
    die "apt-get download $image busybox-static failed"
  for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
  modules=$(ls -d "$work"/root/lib/modules/* | head -1)
  staging=$work/initramfs
  mkdir -p "$staging"/{bin,lib/modules,proc,sys,dev,host}
  cp "$work/root/bin/busybox" "$staging/bin/"
  for m in "${load_order[@]}"; do
    found=$(find "$modules" -name "$m.ko" | head -1)
    [[ -n $found ]] || die "module $m not in $image"
    cp "$found" "$staging/lib/modules/"
  done
  cat >"$staging/init" <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in ${load_order[*]}; do
  insmod /lib/modules/\$m.ko || echo "guest: insmod \$m failed"
done
opts=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /lower /rw
mount -t 9p -o \$opts,ro,cache=loose hostroot /lower
mount -t tmpfs tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /host
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/shm
for d in run dev/shm; do mount -t tmpfs tmpfs /host/\$d; done
mkdir -p /host/run/pstrain-vm
mount -t 9p -o \$opts control /host/run/pstrain-vm
out=\$(cat /host/run/pstrain-vm/out)
if [ -n "\$out" ]; then
  mkdir -p "/host\$out" 2>/dev/null
  mount -t 9p -o \$opts out "/host\$out"
fi
ip link set lo up
chroot /host /bin/bash /run/pstrain-vm/run.sh >/host/run/pstrain-vm/log 2>&1
echo \$? >/host/run/pstrain-vm/rc
sync
poweroff -f
INIT
  chmod +x "$staging/init"
  (cd "$staging" && find . | "$work/root/bin/busybox" cpio -o -H newc 2>/dev/null |
    gzip -1) >"$work/initramfs.gz"
  # Moved into place whole, so a run that starts meanwhile never boots half
  # a file.
  mv "$work/initramfs.gz" "$initramfs"
  mv "$(ls "$work"/root/boot/vmlinuz-* | head -1)" "$kernel"
  rm -rf "$work"
  trap - EXIT
  echo "$stamp" >"$cache/ready"
fi

control=$(mktemp -d)
trap 'rm -rf "$control"' EXIT
printf '%s' "$out" >"$control/out"
{
  echo "export PATH=$(printf %q "$PATH") HOME=/root"
  echo "cd $(printf %q "$PWD")"
  printf '%q ' "$@"
  echo
} >"$control/run.sh"

args=(-nographic -no-reboot -smp "$cpus" -m "$memory_mb"
  -kernel "$kernel" -initrd "$initramfs"
  -append "console=ttyS0 quiet panic=-1"
  -nic none
  -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
  -virtfs "local,path=$control,mount_tag=control,security_model=none")
[[ -n $out ]] && args+=(-virtfs "local,path=$out,mount_tag=out,security_model=none")
if [[ $accel == kvm ]]; then
  args+=(-enable-kvm -cpu host)
else
  args+=(-accel tcg,thread=multi -cpu max)
fi
set +e
timeout "$timeout_s" "$qemu" "${args[@]}" >"$control/console" 2>&1
qemu_rc=$?
set -e
[[ -f $control/log ]] && cat "$control/log"
if [[ -f $control/rc ]]; then
  exit "$(cat "$control/rc")"
fi
if [[ $qemu_rc == 124 ]]; then
  echo "run_in_vm.sh: the guest did not finish in ${timeout_s} s" >&2
  exit 124
fi
echo "run_in_vm.sh: the guest ended without running the command (qemu exit $qemu_rc); its console:" >&2
tail -20 "$control/console" >&2
exit 1
