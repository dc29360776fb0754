#!/usr/bin/env bash
# Kernel TLS for real: this machine's kernel has no `tls` module, so
# TlsDataPlaneTest.SyncMlpOverKernelTlsEqualsThePlaintextJob skips here. This
# runs it under Debian 12's own kernel, which has the module, in a QEMU
# virtual machine (tests/vm/run_in_vm.sh): a sync MLP job whose data-plane
# records are sealed by the kernel must end with exactly the plaintext job's
# model, and every worker connection must report kernel TLS. Fails if the
# test skipped in the guest (kernel TLS did not come up there).
set -euo pipefail
runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n $runfiles ]] || { echo "run me with bazel test //tests:kernel_tls_vm_test" >&2; exit 1; }
runfiles=$(cd "$runfiles" && pwd)
root=$runfiles/pstrain
command -v qemu-system-x86_64 >/dev/null ||
  { echo "FAIL: qemu-system-x86_64 is not installed (deploy/setup.sh installs it)" >&2; exit 1; }
out=$("$root/tests/vm/run_in_vm.sh" --timeout_s=600 -- env \
  TEST_SRCDIR="$runfiles" RUNFILES_DIR="$runfiles" TEST_WORKSPACE=pstrain \
  TEST_TMPDIR=/tmp "$root/tests/tls_data_plane_test" \
  --gtest_filter='*SyncMlpOverKernelTls*') || { echo "$out"; exit 1; }
echo "$out"
grep -q '^\[  PASSED  \] 1 test' <<<"$out" && ! grep -q '^\[  SKIPPED \]' <<<"$out" ||
  { echo "FAIL: the kernel-TLS test did not run and pass in the guest" >&2; exit 1; }
