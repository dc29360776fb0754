#!/usr/bin/env bash
# Plots the per-step CSVs workers write with --metrics_csv (deploy/local/
# launch.sh --csv writes one per worker) with gnuplot: training loss and
# accuracy against step and against wall time, one line per run.
#
#   bench/plot/plot_runs.sh [--out=PREFIX] [--title=TEXT] [--window=N] LABEL=FILE.csv...
#
#   --out=PREFIX   writes PREFIX_loss.png and PREFIX_accuracy.png, each with
#                  two panels: against step (left) and time (right)
#                  (default: bench/results/runs)
#   --title=TEXT   goes above both plots
#   --window=N     moving average over N steps: a step's loss and accuracy
#                  are those of one batch, too noisy to compare runs by
#                  (default: steps/40 of the longest run, at least 1)
#
# Example (the sync vs async comparison in bench/results):
#   deploy/local/launch.sh --mode=sync --csv --run_dir=/tmp/sync -- --steps=1500
#   deploy/local/launch.sh --mode=async --csv --run_dir=/tmp/async -- --steps=1500
#   bench/plot/plot_runs.sh --out=bench/results/sync_vs_async \
#       sync=/tmp/sync/worker0.csv async=/tmp/async/worker0.csv
#
# Needs gnuplot (Debian: gnuplot-nox, installed by deploy/setup.sh).
# Exit status: 0 plots written, 1 gnuplot failed, 2 bad usage or input.
set -euo pipefail

readonly HEADER="step,time_s,loss,train_accuracy,samples_per_sec,pull_ms,push_ms,test_loss,test_accuracy,compute_ms,network_wait"
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
usage_error() { printf 'plot_runs.sh: %s\n' "$*" >&2; exit 2; }

out=bench/results/runs
title=""
window=0
labels=()
files=()
for arg in "$@"; do
  case "$arg" in
    -h | --help) usage; exit 0 ;;
    --out=*) out=${arg#--out=} ;;
    --title=*) title=${arg#--title=} ;;
    --window=*)
      window=${arg#--window=}
      [[ $window =~ ^[1-9][0-9]*$ ]] || usage_error "--window must be a positive integer, got '$window'"
      ;;
    --*) usage_error "unknown option '$arg' (see --help)" ;;
    *=*)
      label=${arg%%=*} file=${arg#*=}
      [[ -n "$label" && "$label" != *'"'* ]] || usage_error "bad label in '$arg'"
      [[ -r "$file" ]] || usage_error "$file: cannot read"
      first=$(head -n 1 -- "$file")
      # Files written before the test_* columns existed plot the same.
      [[ "$first" == "$HEADER" || "$first" == "${HEADER%,compute_ms,network_wait}" || "$first" == "${HEADER%,test_loss,*}" ]] || usage_error "$file: not a --metrics_csv file (header '$first')"
      (($(wc -l <"$file") > 1)) || usage_error "$file: no rows"
      labels+=("$label") files+=("$file")
      ;;
    *) usage_error "'$arg' is not LABEL=FILE.csv (see --help)" ;;
  esac
done
((${#files[@]} > 0)) || usage_error "give at least one LABEL=FILE.csv (see --help)"
command -v gnuplot >/dev/null || { echo "plot_runs.sh: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
[[ -n "$out" ]] || usage_error "--out must not be empty"
mkdir -p -- "$(dirname -- "$out")"

if ((window == 0)); then
  longest=0
  for f in "${files[@]}"; do
    n=$(($(wc -l <"$f") - 1))
    ((n > longest)) && longest=$n
  done
  window=$((longest / 40))
  ((window >= 1)) || window=1
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/plot_runs.XXXXXX")
trap 'rm -rf -- "$tmp"' EXIT

# step time_s loss accuracy, each the mean of the last `window` rows.
for i in "${!files[@]}"; do
  awk -F, -v w="$window" '
    NR == 1 { next }
    {
      n++; k = n % w
      sl += $3 - l[k]; sa += $4 - a[k]; l[k] = $3; a[k] = $4
      m = n < w ? n : w
      printf "%s %s %.6g %.6g\n", $1, $2, sl / m, sa / m
    }' "${files[$i]}" >"$tmp/$i.dat"
done

# plot_panel COLUMN: the plot command for every run, x from column $1.
plot_cmd() {
  local x=$1 y=$2 cmd="" i
  for i in "${!files[@]}"; do
    cmd+="${cmd:+, }'$tmp/$i.dat' using $x:$y with lines lw 2 title \"${labels[$i]}\""
  done
  printf '%s' "$cmd"
}

smoothing="moving average over $window step(s)"
gnuplot <<GNUPLOT
set terminal pngcairo size 1400,520 font "DejaVu Sans,11"
set datafile separator " "
set grid
set key top right
set output "${out}_loss.png"
set multiplot layout 1,2 title "${title:+$title: }training loss ($smoothing)"
set xlabel "step"; set ylabel "loss"
plot $(plot_cmd 1 3)
set xlabel "wall time (s)"
plot $(plot_cmd 2 3)
unset multiplot
set output "${out}_accuracy.png"
set key bottom right
set multiplot layout 1,2 title "${title:+$title: }training accuracy ($smoothing)"
set xlabel "step"; set ylabel "accuracy"
set yrange [0:1]
plot $(plot_cmd 1 4)
set xlabel "wall time (s)"
plot $(plot_cmd 2 4)
unset multiplot
GNUPLOT
echo "plot_runs.sh: wrote ${out}_loss.png and ${out}_accuracy.png" >&2
