#!/usr/bin/env bash
# Changes the number of pstrain workers on Kubernetes.
#
#   deploy/k8s/scale_workers.sh [-n NAMESPACE] [--dry-run] N
#
# It patches (kubectl patch --type=merge, in this order):
#   1. ConfigMap pstrain-config: data.NUM_WORKERS = "N", so that worker pods
#      created from now on pass --num_workers=N;
#   2. Job worker: spec.parallelism = spec.completions = N. The Job is Indexed:
#      scaling up creates the pods of indexes old..N-1, scaling down deletes
#      those of indexes >= N. Changing completions of an Indexed Job needs
#      Kubernetes >= 1.27 (ElasticIndexedJob) and completions == parallelism,
#      which this keeps.
#
# The servers are not touched: they run with --max_workers=MAX_WORKERS
# (configmap.yaml), so a running sync job follows the new membership at a
# step boundary. New pods join at the step the job is at; the pods of
# removed indexes get SIGTERM, finish their step and leave the job. Keep N
# <= MAX_WORKERS: the servers refuse worker ids >= MAX_WORKERS (raising
# MAX_WORKERS needs a new job: the servers read it when they start).
#
# Environment: KUBECTL (default kubectl) is the command run, e.g.
# KUBECTL="kubectl --context=prod". Exit status: 0 done, 1 kubectl failed,
# 2 bad usage.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
usage_error() { printf 'scale_workers.sh: %s (see --help)\n' "$*" >&2; exit 2; }

namespace=()
dry_run=0
count=""
while (($# > 0)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    -n | --namespace)
      (($# > 1)) || usage_error "$1 needs a value"
      namespace=(--namespace "$2")
      shift
      ;;
    --namespace=*) namespace=(--namespace "${1#*=}") ;;
    --dry-run) dry_run=1 ;;
    -*) usage_error "unknown option '$1'" ;;
    *)
      [[ -z "$count" ]] || usage_error "one worker count, got '$count' and '$1'"
      count=$1
      ;;
  esac
  shift
done
[[ -n "$count" ]] || usage_error "give the number of workers"
[[ "$count" =~ ^[1-9][0-9]{0,4}$ ]] || usage_error "the number of workers must be an integer >= 1, got '$count'"

read -r -a kubectl <<<"${KUBECTL:-kubectl}"
run() {
  printf '+ %s\n' "$*" >&2
  ((dry_run)) || "$@"
}

run "${kubectl[@]}" ${namespace[@]+"${namespace[@]}"} patch configmap pstrain-config --type=merge \
  -p "{\"data\":{\"NUM_WORKERS\":\"$count\"}}" || exit 1
run "${kubectl[@]}" ${namespace[@]+"${namespace[@]}"} patch job worker --type=merge \
  -p "{\"spec\":{\"parallelism\":$count,\"completions\":$count}}" || exit 1
printf 'scale_workers.sh: %s worker(s) requested\n' "$count" >&2
