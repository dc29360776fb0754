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
#  6. replicated shards: replicas/ is what make_replicas.js writes from base/
#     (not stale); an overlay it writes for 3 shards x 3 replicas on
#     monitoring/ renders and validates; the ps pods' command line, run by sh
#     for every pod with a stand-in ps_server, passes each its shard, replica
#     index and its shard's replicas, and refuses a pod PS_HOSTS does not
#     list; the workers' wait-for-ps waits for every replica ('|'); bad
#     arguments exit 2. (testdata/bad_replicas_*.yaml, in step 2, are the
#     overlay with broken anti-affinity and counts.)
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

echo "== 6. replicated shards (replicas/, make_replicas.js)"
make_replicas=$(readlink -f -- "$dir/make_replicas.js")
src_k8s=$(dirname -- "$make_replicas")
node "$make_replicas" --check || fail "replicas/ is stale: run node deploy/k8s/make_replicas.js (it records its arguments in replicas/kustomization.yaml)"
for args in --replicas=1 --replicas=6 --replicas=x --shards=0 --base=nope --bogus; do
  rc=0
  node "$make_replicas" "$args" --out="$tmp/never" >/dev/null 2>&1 || rc=$?
  ((rc == 2)) || fail "make_replicas.js $args exited $rc, want 2"
done
[[ ! -e "$tmp/never" ]] || fail "make_replicas.js wrote an overlay for bad arguments"
node "$make_replicas" --replicas=3 --shards=3 --base=monitoring --out="$tmp/rep3" >/dev/null ||
  fail "make_replicas.js --replicas=3 --shards=3 failed"
node "$make_replicas" --check --out="$tmp/rep3" >/dev/null || fail "make_replicas.js --check disagrees with what it just wrote"
if ! command -v kubectl >/dev/null || [[ -z "$kustomize_version" || "$kustomize_version" -lt 4 ]]; then
  echo "SKIP (step 6): no kubectl with kustomize >= v4 (see step 4): the replicated overlays were not rendered"
else
  kubectl kustomize "$tmp/rep3" >"$tmp/rep3.yaml" 2>"$tmp/kustomize.err" ||
    fail "kubectl kustomize of a 3 x 3 overlay failed: $(cat "$tmp/kustomize.err")"
  node "$validate" "$tmp/rep3.yaml" >"$tmp/rep3.out" || { cat "$tmp/rep3.out"; fail "the 3 shards x 3 replicas overlay is invalid"; }
  grep -q 'PodMonitor/' "$tmp/rep3.out" || fail "--base=monitoring left out the PodMonitor"
  echo "rendered 3 shards x 3 replicas on monitoring/: $(grep -c '^kind:' "$tmp/rep3.yaml") objects, valid"

  # Each ps pod's command line and the workers' wait-for-ps, from what
  # replicas/ renders, run here: ConfigMap as the environment, stand-in
  # ps_server printing its flags, local listeners for the replicas.
  kubectl kustomize "$src_k8s/replicas" >"$tmp/rep.yaml" 2>"$tmp/kustomize.err" ||
    fail "kubectl kustomize deploy/k8s/replicas failed: $(cat "$tmp/kustomize.err")"
  js_yaml=$src_k8s/validate/node_modules/js-yaml
  # shellcheck disable=SC2016  # JavaScript, not shell
  REP_YAML=$tmp/rep.yaml OUT=$tmp JS_YAML=$js_yaml node -e '
    const fs = require("fs"), yaml = require(process.env.JS_YAML), out = process.env.OUT;
    const docs = yaml.loadAll(fs.readFileSync(process.env.REP_YAML, "utf8")).filter(Boolean);
    const cm = docs.find((d) => d.kind === "ConfigMap");
    fs.writeFileSync(`${out}/env`, Object.entries(cm.data).map(([k, v]) => `${k}=${v}`).join("\n") + "\n");
    const ps = docs.filter((d) => d.kind === "StatefulSet").map((d) => d.spec.template.spec.containers[0].args[0]);
    if (new Set(ps).size !== 1) throw new Error("the ps StatefulSets run different commands");
    fs.writeFileSync(`${out}/ps.sh`, ps[0]);
    const job = docs.find((d) => d.kind === "Job");
    fs.writeFileSync(`${out}/wait.sh`, job.spec.template.spec.initContainers[0].args[0]);
  ' || fail "cannot read the rendered replicas/ overlay"
  mkdir -p "$tmp/bin"
  printf '#!/bin/sh\nprintf "%%s\\n" "$@"\n' >"$tmp/bin/ps_server"
  chmod +x "$tmp/bin/ps_server"
  sed "s|/opt/pstrain/bin/ps_server|$tmp/bin/ps_server|" "$tmp/ps.sh" >"$tmp/ps_local.sh"
  grep -q "$tmp/bin/ps_server" "$tmp/ps_local.sh" || fail "the ps pods do not exec /opt/pstrain/bin/ps_server"
  mapfile -t env_vars <"$tmp/env"
  replicas=$(sed -n 's/^REPLICAS=//p' "$tmp/env")
  shards=$(sed -n 's/^NUM_SHARDS=//p' "$tmp/env")
  for ((s = 0; s < shards; s++)); do
    want_hosts=""
    for ((r = 0; r < replicas; r++)); do want_hosts+="${want_hosts:+,}ps-$s-$r.ps:5000"; done
    for ((r = 0; r < replicas; r++)); do
      env -i PATH="$PATH" HOSTNAME="ps-$s-$r" "${env_vars[@]}" sh "$tmp/ps_local.sh" >"$tmp/flags" 2>&1 ||
        { cat "$tmp/flags"; fail "pod ps-$s-$r: its command line failed"; }
      for flag in --shard_id="$s" --num_shards="$shards" --replicas="$replicas" --replica_index="$r" \
        --replica_hosts="$want_hosts"; do
        grep -qxF -- "$flag" "$tmp/flags" || { cat "$tmp/flags"; fail "pod ps-$s-$r: ps_server is not given $flag"; }
      done
    done
  done
  echo "pods ps-<shard>-<replica> of $shards x $replicas: ps_server gets its shard, replica index and replica set"
  rc=0
  env -i PATH="$PATH" HOSTNAME="ps-$shards-0" "${env_vars[@]}" sh "$tmp/ps_local.sh" >"$tmp/flags" 2>&1 || rc=$?
  if ((rc != 2)) || ! grep -q 'does not list' "$tmp/flags"; then
    cat "$tmp/flags"; fail "pod ps-$shards-0 (no such shard) was not refused (exit $rc)"
  fi
  rc=0
  env -i PATH="$PATH" HOSTNAME="ps-0-$replicas" "${env_vars[@]}" sh "$tmp/ps_local.sh" >"$tmp/flags" 2>&1 || rc=$?
  ((rc == 2)) || { cat "$tmp/flags"; fail "pod ps-0-$replicas (no such replica) was not refused (exit $rc)"; }

  # wait-for-ps with two shards of two replicas on local ports.
  # shellcheck disable=SC2016  # JavaScript, not shell
  node -e '
    const net = require("net"), fs = require("fs");
    const ports = [];
    for (let i = 0; i < 4; i++) {
      const srv = net.createServer((c) => c.destroy()).listen(0, "127.0.0.1", () => {
        ports.push(srv.address().port);
        if (ports.length === 4) fs.writeFileSync(process.argv[1] + ".tmp", ports.join(" ") + "\n"), fs.renameSync(process.argv[1] + ".tmp", process.argv[1]);
      });
    }
    setTimeout(() => process.exit(0), 60000);
  ' "$tmp/ports" &
  listener=$!
  for _ in $(seq 100); do [[ -s "$tmp/ports" ]] && break; sleep 0.1; done
  read -r p0 p1 p2 p3 <"$tmp/ports" || { kill "$listener"; fail "no local listeners for wait-for-ps"; }
  rc=0
  PS_HOSTS="127.0.0.1:$p0|127.0.0.1:$p1,127.0.0.1:$p2|127.0.0.1:$p3" \
    timeout 30 bash "$tmp/wait.sh" >"$tmp/wait.out" 2>&1 || rc=$?
  kill "$listener" 2>/dev/null || true
  wait "$listener" 2>/dev/null || true
  if ((rc != 0)) || (($(grep -c 'is up' "$tmp/wait.out") != 4)); then
    cat "$tmp/wait.out"; fail "wait-for-ps did not see each of 4 replicas up (exit $rc)"
  fi
  echo "wait-for-ps waits for each replica of each shard"
fi

echo "== 7. a Python worker pod's command line (base/worker-job.yaml)"
# Run here with the ConfigMap's PYTHON_SCRIPT set and a stand-in python3
# that prints what it gets: the job in PSTRAIN_CLUSTER, with every
# --name=value of WORKER_EXTRA_FLAGS for the script's client, and the
# script's own arguments.
# shellcheck disable=SC2016  # JavaScript, not shell
JOB_YAML=$dir/base/worker-job.yaml OUT=$tmp JS_YAML=$src_k8s/validate/node_modules/js-yaml node -e '
  const fs = require("fs"), yaml = require(process.env.JS_YAML);
  const job = yaml.loadAll(fs.readFileSync(process.env.JOB_YAML, "utf8")).find((d) => d && d.kind === "Job");
  fs.writeFileSync(`${process.env.OUT}/worker.sh`, job.spec.template.spec.containers[0].args[0]);
' || fail "cannot read base/worker-job.yaml"
mkdir -p "$tmp/pybin"
printf '#!/bin/sh\nprintf "%%s\\n" "$PSTRAIN_CLUSTER" "$@"\n' >"$tmp/pybin/python3"
chmod +x "$tmp/pybin/python3"
env -i PATH="$tmp/pybin:$PATH" PYTHON_SCRIPT=/opt/train.py PYTHON_ARGS="--epochs=2" \
  PS_HOSTS="ps-0.ps:5000,ps-1.ps:5000" NUM_WORKERS=4 JOB_COMPLETION_INDEX=1 \
  WORKER_EXTRA_FLAGS="--hidden=128,64 --tls_ca=/etc/pstrain/tls/ca.pem --parameter_wire_type=bf16 --verbose" \
  sh "$tmp/worker.sh" >"$tmp/worker.out" 2>&1 || { cat "$tmp/worker.out"; fail "the Python worker's command line failed"; }
# shellcheck disable=SC2016  # JavaScript, not shell
OUT=$tmp node -e '
  const lines = require("fs").readFileSync(`${process.env.OUT}/worker.out`, "utf8").trim().split("\n");
  const spec = JSON.parse(lines[0]);
  const want = {ps: ["ps-0.ps:5000", "ps-1.ps:5000"], workers: 4,
    worker_flags: {hidden: "128,64", tls_ca: "/etc/pstrain/tls/ca.pem", parameter_wire_type: "bf16"}};
  if (JSON.stringify(spec) !== JSON.stringify(want)) throw new Error(`PSTRAIN_CLUSTER ${lines[0]}, want ${JSON.stringify(want)}`);
  if (lines.slice(1).join(" ") !== "-u /opt/train.py --epochs=2") throw new Error(`python3 got ${lines.slice(1)}`);
' || { cat "$tmp/worker.out"; fail "a Python worker pod does not get the job and its client flags"; }
echo "a Python worker pod gets the job and WORKER_EXTRA_FLAGS' --name=value flags in PSTRAIN_CLUSTER"

echo "manifests_test: PASS"
