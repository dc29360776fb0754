#!/usr/bin/env bash
# Installs what building and testing need from Debian 12's packages, and
# nothing when it is all there already (safe to run every time).
set -euo pipefail

packages=(
  bazel-bootstrap        # Bazel 4.2.3, runs offline with third_party/ stand-ins
  g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  slurm-wlm munge        # deploy/slurm/test_slurm.sh: a real local Slurm cluster
  nodejs                 # deploy/k8s manifest validation (npm: see the end)
  prometheus             # promtool: deploy/k8s/monitoring's alert rules, checked and unit-tested
  nlohmann-json3-dev     # common/cluster_spec: the cluster description's JSON
  openssl libssl-dev     # common/transport/tls (PEM checks); deploy/tls/make_certs.sh, TLS tests
  gnuplot-nox            # bench/plot/plot_runs.sh: loss/accuracy PNGs
  dataset-fashion-mnist  # the built-in real data set (IDX under /usr/share/datasets)
  zlib1g-dev             # worker: reads gzipped IDX files
  libopenblas-dev        # kernels: the CPU backend's GEMM (cblas_sgemm)
  python3-numpy          # tests: reads an exported safetensors file as a user would
  python3-torch python3-venv  # pstrain.torch's tests: Debian's torch, and
                         # the venvs the wheel is installed into
  binutils               # worker/python/make_wheel.py: objdump reads the
                         # wheel's glibc floor
  iproute2 nftables iperf3  # tests/netns: hosts in network namespaces, partitions
                         # and loss (nft); bench/netns/link_speed.sh's raw TCP check
  qemu-system-x86        # tests/vm: Debian's own kernel (it has the tls module,
                         # this machine's has not) for //tests:kernel_tls_vm_test
  python3-grpcio curl    # deploy/grpc/grpc_check.py (health, reflection; grpcurl is
                         # not in Debian 12) and the README's operator commands
)

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" ||
    missing+=("$package")
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

if [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: no CUDA toolkit at /usr/local/cuda; building the CPU backend only"
fi

# deploy/k8s/manifests_test renders the kustomizations with kubectl. Debian's
# kubernetes-client only where no kubectl is installed (one from Kubernetes'
# or a cloud's packages is newer, and conflicts with it); the test skips,
# saying why, when kubectl's kustomize is too old for the layout.
if ! command -v kubectl >/dev/null &&
    apt-cache show kubernetes-client >/dev/null 2>&1; then
  echo "setup: installing kubernetes-client (kubectl)"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    kubernetes-client >/dev/null || echo "setup: kubernetes-client did not install; manifests_test will skip rendering"
fi

# deploy/k8s/manifests_test: node packages of the offline manifest validator
# (kubernetes-models, js-yaml; versions pinned by its package-lock.json).
# npm is installed here, not in the list above, because a nodejs from another
# source (e.g. NodeSource) already bundles npm and conflicts with Debian's.
k8s_validate="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/k8s/validate"
# Again when package-lock.json changed since (a pull that added a package).
if [[ ! -d "$k8s_validate/node_modules" ||
      "$k8s_validate/package-lock.json" -nt \
        "$k8s_validate/node_modules/.package-lock.json" ]]; then
  if ! command -v npm >/dev/null; then
    echo "setup: installing npm"
    sudo=""
    [[ $(id -u) -eq 0 ]] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends npm >/dev/null
  fi
  echo "setup: npm ci --prefix deploy/k8s/validate"
  npm ci --prefix "$k8s_validate" --no-audit --no-fund --loglevel=error >/dev/null
fi
