#!/usr/bin/env bash
# Offline checks of the Kubernetes deployment (no cluster needed):
#  0. validate/job_rules.js (the Job controller's pod-failure rules) replays
#     the Kubernetes documentation's examples as documented;
#  1. every deploy/k8s/*.yaml, base/*.yaml and monitoring/*.yaml passes
#     validate/validate.js
#     (Kubernetes schema from kubernetes-models and, for the PodMonitor,
#     @kubernetes-models/prometheus-operator; unknown fields, cross-references,
#     pstrain rules: the worker Job survives a crashing worker under the Job
#     rules, checkpoints on a shared claim, the kustomization lists it all);
#  2. each testdata/bad_*.yaml is rejected with the errors it lists
#     ("# expect:" lines): typo'd fields, wrong types, inconsistent objects;
#  3. scale_workers.sh, run against a stand-in kubectl that records its calls,
#     patches the ConfigMap and the Job so that the manifests stay valid and
#     consistent (validated after applying the recorded merge patches), and
#     patching only one of them is caught; bad arguments exit 2;
#  4. every kustomization in the tree renders with `kubectl kustomize` (as
#     `kubectl apply -k` would; skipped, saying so, where kubectl is not
#     installed) and the rendered objects pass the validator.
#  5. monitoring/alerts.yaml's rules pass promtool check rules, and fire as
#     testdata/checkpoint_alerts_test.yaml expects (promtool test rules).
#
#   bash deploy/k8s/manifests_test.sh      # directly
#   bazel test //deploy/k8s:manifests_test
#
# Needs node and the npm packages of validate/ (deploy/setup.sh installs
# them: npm ci --prefix deploy/k8s/validate), and promtool (Debian's
# prometheus package, also installed by deploy/setup.sh).
set -euo pipefail

fail() { printf 'manifests_test: FAIL: %s\n' "$*" >&2; exit 1; }

runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
if [[ -n "$runfiles" && -e "$runfiles/pstrain/deploy/k8s/validate/validate.js" ]]; then
  dir=$runfiles/pstrain/deploy/k8s
else
  dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
fi
command -v node >/dev/null || fail "node not found (apt-get install nodejs; see deploy/setup.sh)"
# node resolves require() from the real path of validate.js, i.e. the source
# tree's deploy/k8s/validate/node_modules (not part of the runfiles).
validate=$(readlink -f -- "$dir/validate/validate.js")
[[ -d "$(dirname -- "$validate")/node_modules/kubernetes-models" ]] ||
  fail "$(dirname -- "$validate")/node_modules is missing: run deploy/setup.sh (npm ci --prefix deploy/k8s/validate)"

tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/manifests_test.XXXXXX")
trap 'rm -rf -- "$tmp"' EXIT

manifests=("$dir"/*.yaml "$dir"/base/*.yaml "$dir"/monitoring/*.yaml)
((${#manifests[@]} >= 10)) || fail "expected the manifests in $dir, found: ${manifests[*]}"

echo "== 0. the Job controller's failure rules, as encoded, agree with the documented examples"
node "$validate" --self-test || fail "validate/job_rules.js disagrees with the Kubernetes documentation"

echo "== 1. the manifests are valid (the worker Job replayed under those rules)"
node "$validate" "${manifests[@]}" || fail "deploy/k8s manifests are invalid"

echo "== 2. broken manifests are rejected"
bad=("$dir"/testdata/bad_*.yaml)
((${#bad[@]} >= 3)) || fail "expected testdata/bad_*.yaml, found: ${bad[*]}"
node "$validate" --expect-invalid "${bad[@]}" || fail "a broken manifest was accepted or not for the expected reason"
# And the plain mode must fail on them (exit 1), not crash.
rc=0
node "$validate" "$dir/testdata/bad_fields.yaml" >"$tmp/plain.out" 2>&1 || rc=$?
((rc == 1)) || { cat "$tmp/plain.out"; fail "validate.js on bad_fields.yaml exited $rc, want 1"; }

echo "== 3. scale_workers.sh"
cat >"$tmp/kubectl" <<'EOF'
#!/usr/bin/env bash
# Stand-in kubectl: records its arguments, one per line, then "<<end>>".
printf '%s\n' "$@" >>"$KUBECTL_LOG"
echo '<<end>>' >>"$KUBECTL_LOG"
EOF
chmod +x "$tmp/kubectl"
scale=$dir/scale_workers.sh

export KUBECTL_LOG=$tmp/scale5.log
KUBECTL="$tmp/kubectl" bash "$scale" -n training 5 2>"$tmp/scale.err" || { cat "$tmp/scale.err"; fail "scale_workers.sh 5 failed"; }
grep -qx -- '--namespace' "$KUBECTL_LOG" && grep -qx training "$KUBECTL_LOG" ||
  fail "scale_workers.sh -n training did not pass the namespace: $(tr '\n' ' ' <"$KUBECTL_LOG")"
node "$validate" --kubectl-log="$KUBECTL_LOG" "${manifests[@]}" >"$tmp/scaled.out" ||
  { cat "$tmp/scaled.out"; fail "the manifests are invalid after scale_workers.sh 5"; }
cat "$tmp/scaled.out"
grep -q 'patched ConfigMap/pstrain-config: {"data":{"NUM_WORKERS":"5"}}' "$tmp/scaled.out" ||
  fail "scale_workers.sh 5 did not set NUM_WORKERS to \"5\""
grep -q 'patched Job/worker: {"spec":{"parallelism":5,"completions":5}}' "$tmp/scaled.out" ||
  fail "scale_workers.sh 5 did not set parallelism = completions = 5"

# Only the Job patched (ConfigMap left at 2): must be caught.
awk 'BEGIN{RS="<<end>>\n"; ORS=""} /\njob\n/ {print $0 "<<end>>\n"}' "$KUBECTL_LOG" >"$tmp/job_only.log"
grep -q '^job$' "$tmp/job_only.log" || fail "could not extract the Job patch from the log"
rc=0
node "$validate" --kubectl-log="$tmp/job_only.log" "${manifests[@]}" >"$tmp/job_only.out" || rc=$?
((rc == 1)) && grep -q 'parallelism 5 != NUM_WORKERS 2' "$tmp/job_only.out" ||
  { cat "$tmp/job_only.out"; fail "patching only the Job was not caught (exit $rc)"; }

# --dry-run runs nothing; bad counts are usage errors.
export KUBECTL_LOG=$tmp/dry.log
KUBECTL="$tmp/kubectl" bash "$scale" --dry-run 3 2>/dev/null || fail "--dry-run failed"
[[ ! -e "$KUBECTL_LOG" ]] || fail "--dry-run ran kubectl"
for arg in 0 -3 abc ""; do
  rc=0
  KUBECTL="$tmp/kubectl" bash "$scale" "$arg" 2>/dev/null || rc=$?
  ((rc == 2)) || fail "scale_workers.sh '$arg' exited $rc, want 2"
done
[[ ! -e "$KUBECTL_LOG" ]] || fail "scale_workers.sh ran kubectl for a bad count"

echo "== 4. every kustomization renders, and what it renders is valid"
# kustomize v4 (kubectl >= 1.21) first took directories under resources:.
kustomize_version=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\).*/\1/p' || true)
if ! command -v kubectl >/dev/null; then
  echo "SKIP (step 4): kubectl is not installed (deploy/setup.sh installs it where Debian has kubernetes-client), so the kustomizations were not rendered"
elif [[ -z "$kustomize_version" || "$kustomize_version" -lt 4 ]]; then
  echo "SKIP (step 4): $(kubectl version --client 2>&1 | head -n 1) embeds a kustomize older than v4, which cannot render directory resources; kubectl >= 1.21 is needed"
else
  # From the source tree: kustomize reads the directories, not runfiles'
  # symlinks (it refuses files outside a kustomization's root).
  src=$(cd -- "$(dirname -- "$(readlink -f -- "$dir/base/kustomization.yaml")")/.." && pwd)
  mapfile -t roots < <(find "$src" -name kustomization.yaml -not -path '*/node_modules/*' \
    -not -path '*/testdata/*' -printf '%h\n' | sort)
  ((${#roots[@]} >= 3)) || fail "expected 3 kustomizations under $src, found: ${roots[*]}"
  for root in "${roots[@]}"; do
    name=${root#"$src"}
    kubectl kustomize "$root" >"$tmp/rendered.yaml" 2>"$tmp/kustomize.err" ||
      fail "kubectl kustomize deploy/k8s$name failed: $(cat "$tmp/kustomize.err")"
    node "$validate" "$tmp/rendered.yaml" >"$tmp/rendered.out" ||
      { cat "$tmp/rendered.out"; fail "what deploy/k8s$name renders is invalid"; }
    echo "rendered deploy/k8s$name/: $(grep -c '^kind:' "$tmp/rendered.yaml") objects, valid"
  done
fi

echo "== 5. the alert rules (promtool, from Debian's prometheus package)"
command -v promtool >/dev/null || fail "promtool not found (apt-get install prometheus; see deploy/setup.sh)"
# promtool reads plain rule files: the PrometheusRule's spec is one.
sed -n '/^spec:/,$p' "$dir/monitoring/alerts.yaml" | tail -n +2 | sed 's/^  //' \
  >"$tmp/checkpoint_alerts.rules.yaml"
promtool check rules "$tmp/checkpoint_alerts.rules.yaml" ||
  fail "monitoring/alerts.yaml: promtool check rules failed"
cp "$dir/testdata/checkpoint_alerts_test.yaml" "$tmp/"
(cd "$tmp" && promtool test rules checkpoint_alerts_test.yaml) ||
  fail "monitoring/alerts.yaml: the alerts do not fire as testdata/checkpoint_alerts_test.yaml expects"

echo "manifests_test: PASS"
