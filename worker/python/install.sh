#!/usr/bin/env bash
# Builds the `pstrain` Python package and installs it for the interpreter the
# build is for (bazel/python_configure.bzl: Debian's /usr/bin/python3, which
# has python3-torch), into that interpreter's site directory
# (/usr/local/lib/python3.11/dist-packages), so that `import pstrain` works
# from any directory with no path set. A copy, as installing a wheel would
# make (Debian 12's system Python refuses pip installs, PEP 668): rerun after
# changing the package; `rm -r <site>/pstrain` removes it.
#
#   worker/python/install.sh [--prefix=DIR]   # DIR/pstrain instead of the site
set -euo pipefail
cd "$(dirname "$0")/../.."

prefix=""
for arg in "$@"; do
  case "$arg" in
    --prefix=*) prefix=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

bazel build //worker/python:pstrain/_native.so
defs="$(bazel info output_base 2>/dev/null)/external/local_python/defs.bzl"
python=$(sed -n 's/^PYTHON = "\(.*\)"$/\1/p' "$defs")
site=$(sed -n 's/^PYTHON_SITE = "\(.*\)"$/\1/p' "$defs")
dest=${prefix:-$site}/pstrain
sudo=""
if [[ ! -w "$(dirname "$dest")" && -e "$(dirname "$dest")" && $(id -u) -ne 0 ]]; then
  sudo="sudo"
fi
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
cp worker/python/pstrain/*.py "$staging/"
cp bazel-bin/worker/python/pstrain/_native.so "$staging/"
chmod 644 "$staging"/*
$sudo mkdir -p "$dest"
$sudo rm -f "$dest"/*.py "$dest"/_native.so
$sudo cp "$staging"/* "$dest/"
(cd / && PYTHONPATH="$prefix" "$python" -c "import pstrain, pstrain.torch") ||
  { echo "install.sh: $python cannot import pstrain from $dest" >&2; exit 1; }
echo "pstrain installed in $dest (for $python)"
