#!/usr/bin/env bash
# Builds the pstrain wheel (worker/python/build_wheel.sh) and installs it with
# pip into one interpreter's environment, for this repository's own scripts
# (the demo, the benchmarks, the launchers' Python workers):
#
#   worker/python/install.sh                    # $PSTRAIN_PYTHON, default
#                                               # Debian's /usr/bin/python3
#   worker/python/install.sh --python=~/venv/bin/python
#   worker/python/install.sh --prefix=DIR       # DIR/pstrain (pip --target)
#
# Debian's /usr/bin/python3 is "externally managed" (PEP 668): for it pip is
# told so explicitly (--break-system-packages), and the package lands in
# /usr/local/lib/python3.11/dist-packages, where `pip uninstall pstrain`
# removes it. Your own training environment: pip install the wheel there
# (README.md, "PyTorch").
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${PSTRAIN_PYTHON:-/usr/bin/python3}
prefix=""
for arg in "$@"; do
  case "$arg" in
    --python=*) python=${arg#*=} ;;
    --prefix=*) prefix=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
python=${python/#\~/$HOME}
[[ -x "$python" ]] || { echo "install.sh: no interpreter at $python" >&2; exit 2; }

wheel=$(worker/python/build_wheel.sh)
pip_args=(install --no-index --no-deps --force-reinstall --quiet --disable-pip-version-check)
if [[ -n "$prefix" ]]; then
  pip_args+=(--target="$prefix" --upgrade)
elif "$python" -c 'import sys, sysconfig, os; sys.exit(not (sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED"))))'; then
  pip_args+=(--break-system-packages)
fi
sudo=""
if [[ -z "$prefix" && $(id -u) -ne 0 ]] &&
    ! "$python" -c 'import sys, sysconfig, os; sys.exit(not os.access(sysconfig.get_paths()["purelib"], os.W_OK))'; then
  sudo="sudo"
fi
$sudo "$python" -m pip "${pip_args[@]}" "$wheel"
(cd / && PYTHONPATH="$prefix" "$python" -c "import pstrain, pstrain.torch") ||
  { echo "install.sh: $python cannot import pstrain after installing $wheel" >&2; exit 1; }
echo "pstrain installed for $python${prefix:+ in $prefix} from $wheel"
