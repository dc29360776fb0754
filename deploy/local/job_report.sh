#!/usr/bin/env bash
# The job as its servers end it, whatever its workers printed: reads the
# lines each ps_server prints when it stops ({"event":"shard_final",...},
# anywhere in a line, so srun's "0: " labels may stay) on stdin and prints
# one line on stdout,
#
#   {"event":"job","mode":"sync","shards":2,"workers":2,"step":938,
#    "step_max":938,"steps_short":0,"steps_lost":0,"updates_lost":0,
#    "late_gradients_dropped":0,"shards_without_model":0,"shards_behind":0,
#    "final_checkpoint":"written"}
#
# step: what every shard reached (sync: steps; async/ssp: the fewest updates
# of a block); steps_short / steps_lost: the most any shard completed short
# (without some worker's gradient) or lost to a restore; final_checkpoint:
# "written" when every shard's final state is in a checkpoint, "none" when
# some ran without --checkpoint_dir, "failed" when a final checkpoint failed;
# shards_behind: shards whose state is older than the final model the
# workers reported (a server killed after the job's last step and restored
# from an older checkpoint: those steps are not in the servers' model).
# Anything that weakened the job, or shards that did not report, is said on
# stderr, one line each, prefixed with --prog. Of a replicated shard
# (ps_server --replicas), whose every replica reports, only the primary's
# line counts.
#
#   cat RUN/ps*.log | deploy/local/job_report.sh --shards=S --workers=W \
#       [--prog=NAME] [--logs=WHERE]
#
# Exit status: 0 (a report, or a warning that there is none); 2 bad usage.
set -euo pipefail

prog=job_report.sh shards="" workers="" logs="the servers' logs"
for arg in "$@"; do
  case "$arg" in
    --prog=*) prog=${arg#*=} ;;
    --shards=*) shards=${arg#*=} ;;
    --workers=*) workers=${arg#*=} ;;
    --logs=*) logs=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "job_report.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$shards" =~ ^[1-9][0-9]*$ && "$workers" =~ ^[1-9][0-9]*$ ]] ||
  { echo "job_report.sh: --shards and --workers must be positive integers" >&2; exit 2; }
warn() { printf '%s: warning: %s\n' "$prog" "$*" >&2; }

finals=$(grep -o '{"event":"shard_final".*}' | grep -v '"replica_role":"\(backup\|stale\|joining\|catching_up\)"' || true)
reported=$(grep -c . <<<"$finals" || true)
if ((reported != shards)); then
  warn "$reported of $shards server(s) said how they ended (a server killed, or older than this script?); see $logs"
  exit 0
fi
job=$(awk -v workers="$workers" -v shards="$shards" '
  function field(name,   m) {
    if (match($0, "\"" name "\":\"?[^,\"}]*")) {
      m = substr($0, RSTART, RLENGTH); sub(/^[^:]*:"?/, "", m); return m
    }
    return ""
  }
  {
    # version -1: a shard with no step (it holds no part of the model, or
    # async tables only).
    mode = field("mode"); v = field("version") + 0
    if (v >= 0 && (!stepped || v < step)) step = v
    if (v >= 0 && (!stepped || v > top)) top = v
    if (v >= 0) stepped = 1
    if (field("steps_short") + 0 > short) short = field("steps_short") + 0
    if (field("steps_lost") + 0 > lost) lost = field("steps_lost") + 0
    updates_lost += field("updates_lost")
    late += field("late_gradients_dropped")
    c = field("final_checkpoint")
    if (checkpoint == "" || c == "failed" || (c == "none" && checkpoint == "written")) checkpoint = c
    if (field("model_registered") != "true") unregistered++
    if (field("behind") == "true") behind++
  }
  END {
    if (!stepped) step = top = -1
    printf "{\"event\":\"job\",\"mode\":\"%s\",\"shards\":%d,\"workers\":%d,\"step\":%d,\"step_max\":%d,", mode, shards, workers, step, top
    printf "\"steps_short\":%d,\"steps_lost\":%d,\"updates_lost\":%d,\"late_gradients_dropped\":%d,", short, lost, updates_lost, late
    printf "\"shards_without_model\":%d,\"shards_behind\":%d,\"final_checkpoint\":\"%s\"}\n", unregistered, behind, checkpoint
  }' <<<"$finals")
printf '%s\n' "$job"

number() { sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p" <<<"$job"; }
mode=$(sed -n 's/.*"mode":"\([a-z]*\)".*/\1/p' <<<"$job")
step=$(number step) top=$(number step_max)
(($(number shards_without_model) == 0)) ||
  warn "$(number shards_without_model) server(s) never had a model registered: did the workers train at all? see $logs"
((step == top)) ||
  warn "the shards ended at different steps ($step to $top): the servers' model is not one step's"
(($(number steps_short) == 0)) ||
  warn "$(number steps_short) sync step(s) completed with fewer than $workers workers' gradients (steps_short: a worker lapsed, died mid-push or never came, --min_workers, --replicas_to_aggregate); see $logs"
(($(number steps_lost) == 0)) ||
  warn "a server lost $(number steps_lost) step(s) (restored from an older checkpoint); see $logs"
(($(number shards_behind) == 0)) ||
  warn "$(number shards_behind) server(s) ended behind the final model the workers reported (killed after the last step and restored from an older checkpoint): the servers' model, and an export of it, lack those steps; see $logs"
grep -q '"final_checkpoint":"failed"' <<<"$job" &&
  warn "a server's final checkpoint failed: its last steps are not on disk; see $logs"
echo "$prog: the servers ended the $mode job at step $step" >&2
