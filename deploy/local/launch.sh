#!/usr/bin/env bash
# Starts a whole pstrain job (S ps_server shards + W workers) on this machine,
# waits for it, and cleans up after itself. See usage() or --help.
#
# Exit status: 0 the job finished; 1 a server or worker failed; 2 bad usage;
# 124 --timeout_s expired; 128+N killed by signal N (130 for Ctrl-C).
# Whatever happens, every process this script started is stopped before it
# exits (SIGTERM, then SIGKILL after a grace period), and the logs stay in the
# run directory.
set -euo pipefail

readonly PROG=launch.sh
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly HERE
readonly PORT_WAIT_S=30        # how long servers may take to write their port
readonly STOP_GRACE_S=10       # SIGTERM -> SIGKILL grace when stopping
readonly LOG_TAIL_LINES=20     # lines of a failed process's log shown
readonly POLL_S=0.1

usage() {
  cat <<'EOF'
Usage: deploy/local/launch.sh [options] [-- extra flags...]

Runs a parameter-server training job on this machine: S ps_server shards on
127.0.0.1 (free ports picked by the servers), then W workers against them.
Streams worker 0's progress, prints every worker's final JSON line
({"event":"final",...}; a Python worker's only if its script prints one:
exiting 0 is its success) on stdout and the final model's held-out accuracy
(one number: every worker evaluates the job's final model) on stderr, stops
the servers, prints the job as they end it ({"event":"job",...}: the step
every shard reached, steps completed short or lost, whether the final state
is checkpointed) and exits 0.

Options:
  --servers=S      number of ps_server shards (default 2)
  --replicas=R     server processes per shard (default 1): each shard's
                   primary has every change (in sync mode, each step's
                   record) on its R-1 backups before answering, and a
                   backup takes over when it dies (see
                   README.md, "Replicated shards"). All of them run on this
                   machine, so the replicas share its fate: this is for
                   trying failover, not for surviving a host.
  --replica_restarts=N  a replica that dies while the job trains is started
                   again with the same command line, at most N times each
                   (default 3; 0: never). It catches up from its shard's
                   primary and is a backup again (README.md, "Catch-up").
  --workers=W      number of workers (default 2)
  --mode=MODE      sync, async or ssp (default sync; ssp: add
                   --server.staleness=S after --)
  --bin_dir=DIR    directory holding the ps_server and worker binaries
                   (default: bazel-bin/ps_server/ps_server and
                   bazel-bin/worker/worker of this repository)
  --run_dir=DIR    where port files and logs go (default: a new
                   /tmp/pstrain-run.XXXXXX)
  --timeout_s=N    deadline of the whole job in seconds (default 600); when
                   it expires everything is killed and the exit status is 124
  --tls_dir=DIR    TLS with client certificates (mutual TLS) on every
                   channel, from the files deploy/tls/make_certs.sh writes:
                   servers get --tls_cert=DIR/server.pem --tls_key=DIR/server.key
                   --tls_client_ca=DIR/ca.pem, workers --tls_ca=DIR/ca.pem
                   --tls_cert=DIR/client.pem --tls_key=DIR/client.key (the
                   server certificate must name 127.0.0.1)
  --auth_token_file=FILE  every server requires, every worker sends, the
                   token in FILE (--auth_token_file on both)
  --metrics        Prometheus endpoints on free 127.0.0.1 ports for every
                   server and worker (ports in psI.metrics_port and
                   workerK.metrics_port; the servers' URLs are printed)
  --csv            each worker writes workerK.csv (--metrics_csv), for
                   bench/plot/plot_runs.sh (-- --metrics_csv=F with more
                   than one worker is refused: they would all write F)
  --python=SCRIPT  the workers are this Python training script (a PyTorch
                   model on pstrain.torch, see README.md), run by
                   $PSTRAIN_PYTHON (default /usr/bin/python3, which has
                   python3-torch) with the arguments after "--" that are not
                   --server.FLAG nor a client flag (--NAME=V for a NAME that
                   pstrain.client_option_names() lists: those reach the
                   workers' clients); each worker gets the job in
                   PSTRAIN_CLUSTER (with its task index, and the client
                   flags) and RANK, WORLD_SIZE, LOCAL_RANK and
                   LOCAL_WORLD_SIZE as torchrun sets them, and with several
                   workers OMP_NUM_THREADS=1 unless it is set (torchrun's
                   rule). Needs the pstrain package: worker/python/install.sh
  -h, --help       print this help and exit

Extra flags after "--":
  --server.FLAG=V  passed to every ps_server as --FLAG=V
  --worker.FLAG=V  passed to every worker as --FLAG=V
  --FLAG=V         passed to every worker (model/data flags); with --python,
                   any argument (not only --FLAG) goes to the script, but
                   client flags (see --python) go to its client

Flags the launcher sets itself (host, port, port_file, shard_id, num_shards,
num_workers, mode; cluster_spec, ps_hosts, worker_id, num_workers) cannot be
overridden.

The job is described once, in RUN/cluster.json (the cluster description of
README.md: {"ps": [...], "workers": W, "mode": ...}), written when every
server is up; each worker gets --cluster_spec=RUN/cluster.json and its
--worker_id.

Files in the run directory: cluster.json, psI.port, psI.log (server I,
stdout+stderr), workerK.out (worker K's stdout: progress and final JSON),
workerK.log (worker K's stderr); with --metrics psI.metrics_port and
workerK.metrics_port, with --csv workerK.csv.

Exit status: 0 success, 1 a server or worker failed, 2 bad usage,
124 timeout, 128+N killed by signal N.

Example:
  bazel build //ps_server:ps_server //worker:worker
  deploy/local/launch.sh --servers=2 --workers=4 --mode=async -- \
      --steps=1000 --model=mlp --hidden=128,64 --server.optimizer=adam
EOF
}

# One line on stderr, exit 2.
usage_error() {
  printf '%s: %s\n' "$PROG" "$*" >&2
  exit 2
}

info() {
  printf '%s: %s\n' "$PROG" "$*" >&2
}

# --- State used by the cleanup trap (set before any trap can fire) ----------

declare -A LIVE=()      # pid -> label, for every started process not yet reaped
SERVER_PIDS=()
WORKER_PIDS=()
RUN=""
FIFO=""
# Columns worker 0's progress bar may use when our stdout is a terminal
# (the terminal's less the "[worker 0] " prefix); 0: no terminal, no bar.
BAR_COLUMNS=0
if [[ -t 1 ]]; then
  BAR_COLUMNS=$(stty size </dev/tty 2>/dev/null | cut -d' ' -f2) || true
  [[ "$BAR_COLUMNS" =~ ^[0-9]+$ ]] || BAR_COLUMNS=80
  BAR_COLUMNS=$((BAR_COLUMNS > 31 ? BAR_COLUMNS - 11 : 20))
fi
FORCE_KILL=0
CLEANED_UP=0

# --- Time ---------------------------------------------------------------------

# Sets NOW_MS to the wall clock in milliseconds, without forking.
now_ms() {
  if [[ -n "${EPOCHREALTIME:-}" ]]; then
    local t=${EPOCHREALTIME/[.,]/}
    NOW_MS=$((10#$t / 1000))
  else
    NOW_MS=$(($(date +%s%N) / 1000000))
  fi
}

pause() {
  # A Ctrl-C kills sleep; the trap then runs, so do not let set -e act first.
  sleep "$POLL_S" || true
}

# --- Process bookkeeping ------------------------------------------------------

# Reaps pid (must have exited or be about to) and sets REAPED_RC.
reap() {
  local pid=$1
  REAPED_RC=0
  wait "$pid" 2>/dev/null || REAPED_RC=$?
  unset "LIVE[$pid]"
}

# True while pid is running and is still our child (never signal a pid that
# has been reused by someone else's process). A zombie counts as exited.
alive() {
  local pid=$1 stat state ppid
  kill -0 "$pid" 2>/dev/null || return 1
  [[ -r /proc/$pid/stat ]] || return 0
  IFS= read -r stat 2>/dev/null </proc/"$pid"/stat || return 1
  read -r state ppid _ <<<"${stat##*) }"
  [[ "$state" != Z && "$ppid" == "$$" ]]
}

# Waits up to n polls for pid to exit by itself.
wait_exit() {
  local pid=$1 n=$2 i
  for ((i = 0; i < n; i++)); do
    alive "$pid" || return 0
    pause
  done
  return 1
}

# Describes an exit status: "status 3" or "signal 9 (SIGKILL)".
describe_rc() {
  local rc=$1
  if ((rc > 128 && rc < 160)); then
    local name
    name=$(kill -l "$((rc - 128))" 2>/dev/null || echo '?')
    printf 'signal %d (SIG%s)' "$((rc - 128))" "$name"
  elif ((rc == 75)); then
    printf 'status 75 (a stale replica: it ended so that a restart catches it up)'
  else
    printf 'status %d' "$rc"
  fi
}

show_log_tail() {
  local file=$1
  printf '%s: last %d lines of %s:\n' "$PROG" "$LOG_TAIL_LINES" "$file" >&2
  if [[ -s "$file" ]]; then
    tail -n "$LOG_TAIL_LINES" "$file" | sed 's/^/  | /' >&2 || true
  else
    printf '  | (empty)\n' >&2
  fi
}

# With --server.checkpoint_dir: says whether the servers resumed from it (and
# at which step) or found nothing there, so that a mistyped directory is
# seen before a fresh job trains in place of the resumed one. Read from each
# server's log line (ps_server restores before it serves); replicas say so
# only once their set has settled, and are left out.
say_checkpoint_start() {
  local flag dir=""
  for flag in ${SERVER_FLAGS[@]+"${SERVER_FLAGS[@]}"}; do
    [[ $flag == --checkpoint_dir=* ]] && dir=${flag#--checkpoint_dir=}
  done
  [[ -n "$dir" ]] && ((REPLICAS == 1)) || return 0
  local i line steps="" fresh=0
  for ((i = 0; i < SERVERS; i++)); do
    line=$(grep -o -m1 -E 'restored [0-9]+ blocks at step [0-9.]+' -- "$RUN/ps$i.log" 2>/dev/null) || line=""
    if [[ $line == "restored 0 blocks"* ]]; then
      steps+="${steps:+, }(embedding rows only)" # a shard of sparse rows alone
    elif [[ -n "$line" ]]; then
      steps+="${steps:+, }${line##* }"
    elif grep -q -m1 'no checkpoint in ' -- "$RUN/ps$i.log" 2>/dev/null; then
      fresh=$((fresh + 1))
    fi
  done
  if ((fresh == SERVERS)); then
    info "no checkpoint in $dir yet: the job starts at step 0 (to resume a job, give the directory it checkpointed to)"
  elif [[ -n "$steps" ]]; then
    info "resuming from the checkpoints in $dir: shards at step $steps$( ((fresh == 0)) || echo "; $fresh shard(s) found none of their own")"
  fi
}

# Sends SIGTERM to the given pids, waits up to STOP_GRACE_S seconds for them to
# exit (SIGKILL after that, or at once on a second Ctrl-C), and reaps them all.
# Appends to STOP_KILLED the labels of processes that needed SIGKILL, and to
# STOP_FAILED those that exited non-zero after SIGTERM.
STOP_KILLED=()
STOP_FAILED=()
stop_pids() {
  local pid pending=() killed=" "
  for pid in "$@"; do
    [[ -n "${LIVE[$pid]+x}" ]] || continue
    pending+=("$pid")
    if alive "$pid"; then
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  ((${#pending[@]} > 0)) || return 0
  now_ms
  local deadline=$((NOW_MS + STOP_GRACE_S * 1000)) still
  while :; do
    still=()
    for pid in "${pending[@]}"; do
      alive "$pid" && still+=("$pid")
    done
    ((${#still[@]} > 0)) || break
    now_ms
    if ((NOW_MS >= deadline || FORCE_KILL)); then
      for pid in "${still[@]}"; do
        STOP_KILLED+=("${LIVE[$pid]}")
        killed+="$pid "
        kill -KILL "$pid" 2>/dev/null || true
      done
      break
    fi
    pause
  done
  local label
  for pid in "${pending[@]}"; do
    label=${LIVE[$pid]}
    reap "$pid"
    if ((REAPED_RC != 0)) && [[ "$killed" != *" $pid "* ]]; then
      STOP_FAILED+=("$label: $(describe_rc "$REAPED_RC")")
    fi
  done
  # stderr off: keeps bash's own "Killed ..." job notices out of the output.
} 2>/dev/null

stop_stream() {
  # The tail follows worker 0 (--pid) and ends on its own once that exits;
  # give it a moment to print the last lines, then stop it and the sed.
  if [[ -n "${STREAM_TAIL:-}" && -n "${LIVE[$STREAM_TAIL]+x}" ]]; then
    wait_exit "$STREAM_TAIL" 20 || true
    stop_pids "$STREAM_TAIL"
  fi
  if [[ -n "${STREAM_SED:-}" && -n "${LIVE[$STREAM_SED]+x}" ]]; then
    wait_exit "$STREAM_SED" 10 || true
    stop_pids "$STREAM_SED"
  fi
  if [[ -n "$FIFO" ]]; then
    rm -f "$FIFO"
  fi
}

cleanup() {
  local rc=$?
  set +e
  ((CLEANED_UP)) && return
  CLEANED_UP=1
  # A second Ctrl-C (or TERM) during cleanup skips the grace period.
  trap 'FORCE_KILL=1' INT TERM HUP
  if ((${#LIVE[@]} > 0)); then
    info "stopping ${#LIVE[@]} process(es) started by this run (SIGTERM, SIGKILL after ${STOP_GRACE_S}s; Ctrl-C again to SIGKILL now)"
    stop_pids "${WORKER_PIDS[@]}"
    stop_stream
    stop_pids "${SERVER_PIDS[@]}"
    # Anything else (none expected).
    stop_pids "${!LIVE[@]}"
    if ((${#STOP_KILLED[@]} > 0)); then
      info "had to SIGKILL: ${STOP_KILLED[*]}"
    fi
  fi
  [[ -n "$FIFO" ]] && rm -f "$FIFO"
  if ((rc != 0)) && [[ -n "$RUN" ]]; then
    # Stopped early (Ctrl-C, a failure): where the servers left the job,
    # which a resume from their checkpoints continues, with job_report's
    # warnings (shards at different steps, a failed final checkpoint).
    ((${#SERVER_PIDS[@]} > 0)) && report_job
    printf 'logs: %s\n' "$RUN" >&2
  fi
  trap - EXIT
  exit "$rc"
}

on_signal() {
  local name=$1 number=$2
  trap 'FORCE_KILL=1' INT TERM HUP
  # A reader that went away (`launch.sh ... | grep -m1 ...`): what is left
  # to say goes nowhere, and must not stop the cleanup.
  trap '' PIPE
  printf '\n' >&2
  info "caught SIG$name: stopping the job"
  exit $((128 + number))
}

# --- Options ------------------------------------------------------------------

SERVERS=2
REPLICAS=1
REPLICA_RESTARTS=3
WORKERS=2
MODE=sync
BIN_DIR=""
BIN_DIR_SET=0
RUN_DIR=""
RUN_DIR_SET=0
TIMEOUT_S=600
TLS_DIR=""
AUTH_TOKEN_FILE=""
PYTHON_SCRIPT=""
PYTHON=${PSTRAIN_PYTHON:-/usr/bin/python3}
CLIENT_OPTIONS=""  # --python: the names of the client flags (is_client_flag)
METRICS=0
CSV=0
SERVER_FLAGS=()
SERVER_FLAG_NAMES=() # of the --server. flags, checked against ps_server's
WORKER_FLAGS=()

check_count() {
  local name=$1 value=$2
  [[ "$value" =~ ^[1-9][0-9]{0,8}$ ]] ||
    usage_error "--$name must be an integer >= 1, got '$value'"
}

readonly SERVER_OWNED=" host port port_file shard_id num_shards num_workers mode replicas replica_index replica_hosts "
readonly WORKER_OWNED=" cluster_spec ps_hosts worker_id num_workers "

# Splits one extra flag into SERVER_FLAGS / WORKER_FLAGS.
add_extra_flag() {
  local arg=$1 target rest name
  case "$arg" in
    --server.*) target=server rest=${arg#--server.} ;;
    --worker.*) target=worker rest=${arg#--worker.} ;;
    --?*) target=worker rest=${arg#--} ;;
    *)
      [[ -n "$PYTHON_SCRIPT" ]] || usage_error "extra argument '$arg' after -- is not a --flag"
      WORKER_FLAGS+=("$arg") # a script's own argument, as it is
      return
      ;;
  esac
  name=${rest%%=*}
  [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] ||
    usage_error "extra flag '$arg' has no valid flag name"
  if [[ $target == server ]]; then
    [[ "$SERVER_OWNED" != *" $name "* ]] ||
      usage_error "extra flag '$arg': the launcher sets --$name of ps_server itself (see --help)"
    SERVER_FLAGS+=("--$rest")
    SERVER_FLAG_NAMES+=("$name")
  else
    [[ "$WORKER_OWNED" != *" $name "* ]] ||
      usage_error "extra flag '$arg': the launcher sets --$name of worker itself (see --help)"
    WORKER_FLAGS+=("--$rest")
  fi
}

# The flags a binary defines, one name per line (absl's --helpfull).
flag_names() { "$1" --helpfull 2>&1 | sed -n 's/^ *--\([A-Za-z0-9_]*\) (.*/\1/p'; }

# A --server. flag ps_server does not define fails here, before anything
# starts, and says where it belongs when the worker defines it.
check_server_flag_names() {
  ((${#SERVER_FLAG_NAMES[@]} > 0)) || return 0
  local server_names worker_names name
  server_names=" $(flag_names "$PS_BIN" | tr '\n' ' ') "
  for name in "${SERVER_FLAG_NAMES[@]}"; do
    [[ "$server_names" == *" $name "* || "$server_names" == *" ${name#no} "* ]] && continue
    [[ -n "${worker_names:-}" ]] || worker_names=" $(flag_names "$WORKER_BIN" | tr '\n' ' ') "
    if [[ "$worker_names" == *" $name "* || "$worker_names" == *" ${name#no} "* ]]; then
      usage_error "--server.$name: ps_server has no --$name; it is a worker flag (pass it as --$name)"
    fi
    usage_error "--server.$name: ps_server has no --$name (ps_server --helpfull lists its flags)"
  done
}

parse_args() {
  local arg name value
  while (($# > 0)); do
    arg=$1
    shift
    case "$arg" in
      -h | --help)
        usage
        exit 0
        ;;
      --metrics) METRICS=1 ;;
      --csv) CSV=1 ;;
      --tls_dir=* | --auth_token_file=*)
        name=${arg%%=*}
        value=${arg#*=}
        [[ -n "$value" ]] || usage_error "$name must not be empty"
        if [[ $name == --tls_dir ]]; then TLS_DIR=$value; else AUTH_TOKEN_FILE=$value; fi
        ;;
      --python=*)
        PYTHON_SCRIPT=${arg#*=}
        [[ -n "$PYTHON_SCRIPT" ]] || usage_error "--python must not be empty"
        ;;
      --python)
        (($# > 0)) || usage_error "$arg needs a value"
        PYTHON_SCRIPT=$1
        shift
        ;;
      --tls_dir | --auth_token_file)
        (($# > 0)) || usage_error "$arg needs a value"
        if [[ $arg == --tls_dir ]]; then TLS_DIR=$1; else AUTH_TOKEN_FILE=$1; fi
        shift
        ;;
      --)
        while (($# > 0)); do
          add_extra_flag "$1"
          shift
        done
        break
        ;;
      --servers* | --replicas* | --replica_restarts* | --workers* | --mode* | --bin_dir* | --run_dir* | --timeout_s*)
        if [[ "$arg" == *=* ]]; then
          name=${arg%%=*}
          value=${arg#*=}
        else
          name=$arg
          case "$name" in
            --servers | --replicas | --replica_restarts | --workers | --mode | --bin_dir | --run_dir | --timeout_s) ;;
            *) usage_error "unknown option '$arg' (see --help)" ;;
          esac
          (($# > 0)) || usage_error "$name needs a value"
          value=$1
          shift
        fi
        case "$name" in
          --servers) SERVERS=$value ;;
          --replicas) REPLICAS=$value ;;
          --replica_restarts) REPLICA_RESTARTS=$value ;;
          --workers) WORKERS=$value ;;
          --mode) MODE=$value ;;
          --bin_dir) BIN_DIR=$value BIN_DIR_SET=1 ;;
          --run_dir) RUN_DIR=$value RUN_DIR_SET=1 ;;
          --timeout_s) TIMEOUT_S=$value ;;
          *) usage_error "unknown option '$arg' (see --help)" ;;
        esac
        ;;
      --*)
        usage_error "unknown option '$arg' (flags for workers/servers go after --, see --help)"
        ;;
      *)
        usage_error "unexpected argument '$arg' (see --help)"
        ;;
    esac
  done

  if [[ -n "$TLS_DIR" ]]; then
    local f
    for f in ca.pem server.pem server.key client.pem client.key; do
      [[ -r "$TLS_DIR/$f" ]] ||
        usage_error "--tls_dir: $TLS_DIR/$f is missing (make them with deploy/tls/make_certs.sh $TLS_DIR)"
    done
    TLS_DIR=$(cd -- "$TLS_DIR" && pwd)
    SERVER_FLAGS=(--tls_cert="$TLS_DIR/server.pem" --tls_key="$TLS_DIR/server.key"
      --tls_client_ca="$TLS_DIR/ca.pem" ${SERVER_FLAGS[@]+"${SERVER_FLAGS[@]}"})
    WORKER_FLAGS=(--tls_ca="$TLS_DIR/ca.pem" --tls_cert="$TLS_DIR/client.pem"
      --tls_key="$TLS_DIR/client.key" ${WORKER_FLAGS[@]+"${WORKER_FLAGS[@]}"})
  fi
  if [[ -n "$AUTH_TOKEN_FILE" ]]; then
    [[ -r "$AUTH_TOKEN_FILE" ]] || usage_error "--auth_token_file '$AUTH_TOKEN_FILE' is not readable"
    AUTH_TOKEN_FILE=$(cd -- "$(dirname -- "$AUTH_TOKEN_FILE")" && pwd)/$(basename -- "$AUTH_TOKEN_FILE")
    SERVER_FLAGS=(--auth_token_file="$AUTH_TOKEN_FILE" ${SERVER_FLAGS[@]+"${SERVER_FLAGS[@]}"})
    WORKER_FLAGS=(--auth_token_file="$AUTH_TOKEN_FILE" ${WORKER_FLAGS[@]+"${WORKER_FLAGS[@]}"})
  fi
  if [[ -n "$PYTHON_SCRIPT" ]]; then
    [[ -f "$PYTHON_SCRIPT" && -r "$PYTHON_SCRIPT" ]] ||
      usage_error "--python: '$PYTHON_SCRIPT' is not a readable file"
    PYTHON_SCRIPT=$(cd -- "$(dirname -- "$PYTHON_SCRIPT")" && pwd)/$(basename -- "$PYTHON_SCRIPT")
    # A bare name (PSTRAIN_PYTHON=python3) is looked up on PATH, as a shell
    # would; the workers get the path it resolved to.
    if [[ "$PYTHON" != */* ]] && command -v -- "$PYTHON" >/dev/null 2>&1; then
      PYTHON=$(command -v -- "$PYTHON")
    fi
    [[ -x "$PYTHON" && ! -d "$PYTHON" ]] || usage_error "--python: no interpreter at $PYTHON (set PSTRAIN_PYTHON to a path or a name on PATH)"
    local import_error
    if ! import_error=$(cd / && "$PYTHON" -c 'import pstrain.torch' 2>&1); then
      import_error=$(tail -n 1 <<<"$import_error")
      usage_error "--python: $PYTHON cannot import pstrain.torch (${import_error:-no error text}; an interpreter without torch and numpy, or pstrain not installed in it: README.md, 'PyTorch: bring your own model', installs it)"
    fi
    # The worker flags a Python worker's client takes (the rest go to its
    # script): pstrain's own list, so a new client flag needs no change here.
    CLIENT_OPTIONS=" $(cd / && "$PYTHON" -c 'import pstrain; print(" ".join(pstrain.client_option_names()))') " ||
      usage_error "--python: $PYTHON's pstrain cannot list its client options (reinstall it: worker/python/install.sh)"
  fi
  check_count servers "$SERVERS"
  check_count replicas "$REPLICAS"
  ((REPLICAS <= 5)) || usage_error "--replicas must be at most 5, got $REPLICAS"
  [[ "$REPLICA_RESTARTS" =~ ^[0-9]{1,4}$ ]] ||
    usage_error "--replica_restarts must be an integer >= 0, got '$REPLICA_RESTARTS'"
  check_count workers "$WORKERS"
  check_count timeout_s "$TIMEOUT_S"
  local flag
  # A fixed port for every server of one host: the second cannot listen.
  for flag in ${SERVER_FLAGS[@]+"${SERVER_FLAGS[@]}"}; do
    if [[ $flag =~ ^--(data_port|health_port|metrics_port)=0*[1-9][0-9]*$ ]] &&
      ((SERVERS * REPLICAS > 1)); then
      usage_error "extra flag '--server.${flag#--}' would have all $((SERVERS * REPLICAS)) servers listen on one port; leave it out (each server gets a free one; -1 turns it off)"
    fi
  done
  for flag in ${WORKER_FLAGS[@]+"${WORKER_FLAGS[@]}"}; do
    if [[ $flag == --metrics_csv=* ]] && ((WORKERS > 1)) && [[ -z "$PYTHON_SCRIPT" ]]; then
      usage_error "extra flag '$flag' would have all $WORKERS workers write one file; use --csv (each worker writes workerK.csv in the run dir)"
    fi
  done
  [[ "$MODE" == sync || "$MODE" == async || "$MODE" == ssp ]] ||
    usage_error "--mode must be sync, async or ssp, got '$MODE'"

  local script_dir repo
  script_dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
  repo=$(cd -- "$script_dir/../.." && pwd)
  if ((BIN_DIR_SET)); then
    [[ -n "$BIN_DIR" ]] || usage_error "--bin_dir must not be empty"
    [[ -d "$BIN_DIR" ]] || usage_error "--bin_dir '$BIN_DIR' is not a directory"
    PS_BIN=$BIN_DIR/ps_server
    WORKER_BIN=$BIN_DIR/worker
    local how="in --bin_dir"
  else
    PS_BIN=$repo/bazel-bin/ps_server/ps_server
    WORKER_BIN=$repo/bazel-bin/worker/worker
    local how="(build with: bazel build //ps_server:ps_server //worker:worker, or pass --bin_dir)"
  fi
  local bin
  for bin in "$PS_BIN" "$WORKER_BIN"; do
    [[ -e "$bin" ]] || usage_error "binary $bin not found $how"
    [[ -f "$bin" && -x "$bin" ]] || usage_error "binary $bin is not an executable file"
  done
  check_server_flag_names

  if ((RUN_DIR_SET)); then
    [[ -n "$RUN_DIR" ]] || usage_error "--run_dir must not be empty"
    mkdir -p -- "$RUN_DIR" 2>/dev/null ||
      usage_error "--run_dir '$RUN_DIR' cannot be created"
    [[ -d "$RUN_DIR" && -w "$RUN_DIR" ]] ||
      usage_error "--run_dir '$RUN_DIR' is not a writable directory"
  fi
}

# --- Job ----------------------------------------------------------------------

# Fails the job with exit status 124 if the job deadline has passed.
check_job_deadline() {
  now_ms
  if ((NOW_MS >= JOB_DEADLINE_MS)); then
    info "timed out: the job did not finish within --timeout_s=$TIMEOUT_S s; killing everything"
    exit 124
  fi
}

# Per-process metrics flags (--metrics): a free port, reported in a file.
metrics_flags() {
  METRICS_FLAGS=()
  if ((METRICS)); then
    rm -f -- "$RUN/$1.metrics_port"
    METRICS_FLAGS=(--metrics_port=-1 --metrics_host=127.0.0.1
      --metrics_port_file="$RUN/$1.metrics_port")
  fi
}

# Server process i is replica i % REPLICAS of shard i / REPLICAS.
REPLICA_PORTS=() # with --replicas > 1: server i's port, picked here
declare -A RESTARTS=() # server i -> times it was started again
start_servers() {
  local i
  if ((REPLICAS > 1)); then
    # Each replica is told the others' addresses, so the ports are picked
    # here (distinct, free now) instead of by the servers.
    mapfile -t REPLICA_PORTS < <("$PYTHON" "$HERE/free_ports.py" "$((SERVERS * REPLICAS))")
    ((${#REPLICA_PORTS[@]} == SERVERS * REPLICAS)) ||
      { info "cannot pick free ports for the replicas ($HERE/free_ports.py with $PYTHON)"; exit 1; }
  fi
  for ((i = 0; i < SERVERS * REPLICAS; i++)); do
    : >"$RUN/ps$i.log"
    start_server "$i"
  done
}

# start_server I: starts server process I (again, when it died: same
# command line, same port, its log appended to).
start_server() {
  local i=$1 pid shard=$(($1 / REPLICAS)) replica=$(($1 % REPLICAS)) port=0 set="" r
  REPLICA_FLAGS=()
  if ((REPLICAS > 1)); then
    port=${REPLICA_PORTS[i]}
    for ((r = 0; r < REPLICAS; r++)); do
      set+="${set:+,}127.0.0.1:${REPLICA_PORTS[shard * REPLICAS + r]}"
    done
    REPLICA_FLAGS=(--replicas="$REPLICAS" --replica_index="$replica" --replica_hosts="$set")
  fi
  rm -f -- "$RUN/ps$i.port"
  metrics_flags "ps$i"
  "$PS_BIN" --host=127.0.0.1 --port="$port" --port_file="$RUN/ps$i.port" \
    --shard_id="$shard" --num_shards="$SERVERS" --num_workers="$WORKERS" \
    --mode="$MODE" ${REPLICA_FLAGS[@]+"${REPLICA_FLAGS[@]}"} \
    ${METRICS_FLAGS[@]+"${METRICS_FLAGS[@]}"} \
    ${SERVER_FLAGS[@]+"${SERVER_FLAGS[@]}"} \
    >>"$RUN/ps$i.log" 2>&1 &
  pid=$!
  LIVE[$pid]="ps_server $i (pid $pid)"
  SERVER_PIDS[i]=$pid
}

# Waits for every server's port file; sets PS_HOSTS.
wait_for_ports() {
  local ports=() i pid port ready
  now_ms
  local deadline=$((NOW_MS + PORT_WAIT_S * 1000))
  while :; do
    ready=0
    for ((i = 0; i < SERVERS * REPLICAS; i++)); do
      if [[ -n "${ports[i]:-}" ]]; then
        ready=$((ready + 1))
        continue
      fi
      pid=${SERVER_PIDS[i]}
      if [[ -s "$RUN/ps$i.port" ]]; then
        port=$(<"$RUN/ps$i.port")
        port=${port//[[:space:]]/}
        if [[ ! "$port" =~ ^[1-9][0-9]{0,4}$ ]]; then
          info "ps_server $i wrote a bad port '$port' to $RUN/ps$i.port"
          exit 1
        fi
        ports[i]=$port
        ready=$((ready + 1))
      elif ! alive "$pid"; then
        reap "$pid"
        info "ps_server $i exited with $(describe_rc "$REAPED_RC") before it was serving"
        show_log_tail "$RUN/ps$i.log"
        exit 1
      fi
    done
    ((ready < SERVERS * REPLICAS)) || break
    check_job_deadline
    now_ms
    if ((NOW_MS >= deadline)); then
      for ((i = 0; i < SERVERS * REPLICAS; i++)); do
        if [[ -z "${ports[i]:-}" ]]; then
          info "ps_server $i did not write $RUN/ps$i.port within $PORT_WAIT_S s"
          show_log_tail "$RUN/ps$i.log"
        fi
      done
      exit 1
    fi
    pause
  done
  # A replicated shard is its replicas' addresses joined by '|'.
  PS_HOSTS=""
  local json="" entry r
  for ((i = 0; i < SERVERS; i++)); do
    entry=""
    for ((r = 0; r < REPLICAS; r++)); do
      entry+="${entry:+|}127.0.0.1:${ports[i * REPLICAS + r]}"
    done
    PS_HOSTS+="${PS_HOSTS:+,}$entry"
    json+="${json:+, }\"$entry\""
  done
  PS_JSON=$json
  # The job's one description, which every worker reads (--cluster_spec).
  printf '{"ps": [%s], "workers": %d, "mode": "%s"}\n' "$json" "$WORKERS" "$MODE" \
    >"$RUN/cluster.json.tmp" && mv -f -- "$RUN/cluster.json.tmp" "$RUN/cluster.json"
  info "$SERVERS ps_server(s) serving ($MODE): $PS_HOSTS"
  say_checkpoint_start
  ((REPLICAS == 1)) ||
    info "each shard has $REPLICAS replicas, all on this machine (127.0.0.1): one host cannot keep them apart (on a cluster, give each replica of a shard its own host: deploy/slurm/pstrain.sbatch with REPLICAS does; so does deploy/k8s/replicas/, made by deploy/k8s/make_replicas.js)"
  if ((METRICS)); then
    local urls="" port
    for ((i = 0; i < SERVERS * REPLICAS; i++)); do
      port=$(cat -- "$RUN/ps$i.metrics_port" 2>/dev/null) || port="?"
      urls+="${urls:+ }http://127.0.0.1:${port//[[:space:]]/}/metrics"
    done
    info "server metrics: $urls (workers: $RUN/worker*.metrics_port)"
  fi
}

# Whether a worker flag (--name=value) is one of the client's
# (CLIENT_OPTIONS), which a Python worker takes from its cluster description.
is_client_flag() {
  local name=${1%%=*}
  [[ $1 == --*=* && $CLIENT_OPTIONS == *" ${name#--} "* ]]
}

# The cluster description a Python worker reads from PSTRAIN_CLUSTER: the
# job, its own task, and the client flags (TLS, token, wire types...) the
# C++ workers get on their command line.
python_cluster() {
  local k=$1 flags="" flag name value
  for flag in ${WORKER_FLAGS[@]+"${WORKER_FLAGS[@]}"}; do
    is_client_flag "$flag" || continue
    name=${flag%%=*}
    name=${name#--}
    value=${flag#*=}
    value=${value//\\/\\\\}
    value=${value//\"/\\\"}
    value=${value//$'\t'/\\t}
    value=${value//$'\n'/\\n}
    flags+="${flags:+, }\"$name\": \"$value\""
  done
  printf '{"ps": [%s], "workers": %d, "mode": "%s", "task": {"type": "worker", "index": %d}, "worker_flags": {%s}}' \
    "$PS_JSON" "$WORKERS" "$MODE" "$k" "$flags"
}

# A Python worker's arguments: the script's, less the client flags that went
# into its cluster description.
python_args() {
  PYTHON_ARGS=()
  local flag
  for flag in ${WORKER_FLAGS[@]+"${WORKER_FLAGS[@]}"}; do
    is_client_flag "$flag" || PYTHON_ARGS+=("$flag")
  done
}

start_workers() {
  local k pid omp_threads=${OMP_NUM_THREADS:-}
  python_args
  if [[ -n "$PYTHON_SCRIPT" && -z "$omp_threads" ]] && ((WORKERS > 1)); then
    # As torchrun does for several processes a host: Debian's torch runs its
    # BLAS on a pthread pool that OMP_NUM_THREADS sizes, and workers that
    # share the cores each spin a second thread in sched_yield (a fifth of
    # a CTR worker's CPU; bench/results/table_consistency.txt).
    omp_threads=1
    echo "launch.sh: OMP_NUM_THREADS=1 for the $WORKERS Python workers on this host (as torchrun sets it; set OMP_NUM_THREADS to choose)" >&2
  fi
  # The C++ workers' BLAS threads (--cpu_threads, default every core): a
  # share of the cores each, so that workers on one host do not spin each
  # other's threads. 2 cores, the README's MLP job, 5 rounds: 2 workers
  # 0.87x the job's CPU at 1.01x the samples/s (medians), 4 workers 0.77x at
  # 1.11x (bench/worker_threads.sh, bench/results/worker_threads.txt).
  local cpu_threads=()
  if [[ -z "$PYTHON_SCRIPT" ]] && ((WORKERS > 1)); then
    local flag chosen=0 cores
    for flag in ${WORKER_FLAGS[@]+"${WORKER_FLAGS[@]}"}; do
      [[ $flag == --cpu_threads=* || $flag == --cpu_threads ]] && chosen=1
    done
    if ((!chosen)); then
      cores=$(nproc)
      cpu_threads=(--cpu_threads=$((cores / WORKERS > 0 ? cores / WORKERS : 1)))
      echo "launch.sh: ${cpu_threads[0]} for each of the $WORKERS workers on this host's $cores cores (pass --cpu_threads to choose)" >&2
    fi
  fi
  for ((k = 0; k < WORKERS; k++)); do
    # Made here, not by the worker's redirection in the background: the
    # stream's tail must find worker 0's file (under load it opened it
    # first and showed nothing; examples_test saw that once).
    : >"$RUN/worker$k.out"
    if [[ -n "$PYTHON_SCRIPT" ]]; then
      PSTRAIN_CLUSTER=$(python_cluster "$k") RANK=$k WORLD_SIZE=$WORKERS \
        LOCAL_RANK=$k LOCAL_WORLD_SIZE=$WORKERS \
        env ${omp_threads:+OMP_NUM_THREADS=$omp_threads} "$PYTHON" -u "$PYTHON_SCRIPT" ${PYTHON_ARGS[@]+"${PYTHON_ARGS[@]}"} \
        >"$RUN/worker$k.out" 2>"$RUN/worker$k.log" &
      pid=$!
      LIVE[$pid]="worker $k (pid $pid)"
      WORKER_PIDS+=("$pid")
      ((k == 0)) && start_stream "$pid"
      continue
    fi
    metrics_flags "worker$k"
    local csv=()
    ((CSV)) && csv=(--metrics_csv="$RUN/worker$k.csv")
    # On a terminal, worker 0 draws its progress bar (into its .out file,
    # which start_stream shows), sized to our terminal less the prefix; a
    # --progress of the user's comes later and wins.
    local bar=()
    ((k == 0 && BAR_COLUMNS > 0)) && bar=(--progress=bar)
    COLUMNS=$BAR_COLUMNS \
      "$WORKER_BIN" --cluster_spec="$RUN/cluster.json" --worker_id="$k" \
      ${METRICS_FLAGS[@]+"${METRICS_FLAGS[@]}"} ${csv[@]+"${csv[@]}"} \
      ${bar[@]+"${bar[@]}"} ${cpu_threads[@]+"${cpu_threads[@]}"} \
      ${WORKER_FLAGS[@]+"${WORKER_FLAGS[@]}"} \
      >"$RUN/worker$k.out" 2>"$RUN/worker$k.log" &
    pid=$!
    LIVE[$pid]="worker $k (pid $pid)"
    WORKER_PIDS+=("$pid")
    if ((k == 0)); then
      start_stream "$pid"
    fi
  done
  info "$WORKERS worker(s) started; streaming worker 0"
}

# Streams worker 0's stdout to ours, prefixed with "[worker 0] ", leaving out
# its final JSON line (printed raw once the job is done). tail and sed are
# joined by a FIFO so both are our own children and can be stopped by pid.
start_stream() {
  local worker0=$1
  FIFO=$RUN/.worker0.fifo
  rm -f -- "$FIFO"
  mkfifo -- "$FIFO"
  if ((BAR_COLUMNS > 0)); then
    # The bar redraws with "\r" and no newline, so a line-based filter would
    # hold it back until the end: split at "\r" instead and prefix every
    # line and every redraw.
    awk -v RS='\r' -v prefix='[worker 0] ' '{
      n = split($0, part, "\n"); out = ""
      for (i = 1; i <= n; i++) {
        if (part[i] ~ /^\{"event":"final"/) continue
        if (i < n) out = out prefix part[i] "\n"
        else if (part[i] != "") out = out prefix part[i]
      }
      printf "\r%s", out; fflush()
    }' <"$FIFO" &
  else
    sed -u -e '/^{"event":"final"/d' -e 's/^/[worker 0] /' <"$FIFO" &
  fi
  STREAM_SED=$!
  LIVE[$STREAM_SED]="sed (pid $STREAM_SED)"
  tail -n +1 -s "$POLL_S" -f --pid="$worker0" -- "$RUN/worker0.out" >"$FIFO" &
  STREAM_TAIL=$!
  LIVE[$STREAM_TAIL]="tail (pid $STREAM_TAIL)"
}

wait_for_workers() {
  local remaining=$WORKERS k pid i
  local -a done_workers=()
  while ((remaining > 0)); do
    for ((k = 0; k < WORKERS; k++)); do
      [[ -z "${done_workers[k]:-}" ]] || continue
      pid=${WORKER_PIDS[k]}
      alive "$pid" && continue
      reap "$pid"
      done_workers[k]=1
      remaining=$((remaining - 1))
      if ((REAPED_RC != 0)); then
        info "worker $k failed: exited with $(describe_rc "$REAPED_RC")"
        show_log_tail "$RUN/worker$k.log"
        exit 1
      fi
    done
    ((remaining > 0)) || break
    for ((i = 0; i < SERVERS * REPLICAS; i++)); do
      pid=${SERVER_PIDS[i]}
      [[ -n "${LIVE[$pid]+x}" ]] || continue
      alive "$pid" && continue
      reap "$pid"
      if ((REPLICAS > 1)); then
        # Its shard goes on on its other replicas (a backup takes over);
        # started again, it catches up from the primary.
        local restarts=${RESTARTS[$i]:-0} what="ps_server $i (shard $((i / REPLICAS)), replica $((i % REPLICAS)))"
        local j others=0 fate="its shard goes on on its other replicas" back="it catches up from the primary"
        for ((j = i / REPLICAS * REPLICAS; j < (i / REPLICAS + 1) * REPLICAS; j++)); do
          ((j != i)) && alive "${SERVER_PIDS[j]}" && others=$((others + 1))
        done
        if ((others == 0)); then
          fate="no other replica of its shard is up: the job waits for one to come back"
          back="it restores its checkpoint (--server.checkpoint_dir), if it has one, or catches up from a replica that came back first"
        fi
        if ((restarts < REPLICA_RESTARTS)); then
          RESTARTS[$i]=$((restarts + 1))
          info "$what died during training: exited with $(describe_rc "$REAPED_RC"); $fate; starting it again (restart $((restarts + 1)) of $REPLICA_RESTARTS): $back"
          start_server "$i"
        else
          info "$what died during training: exited with $(describe_rc "$REAPED_RC"); $fate (not restarted: --replica_restarts=$REPLICA_RESTARTS used)"
        fi
        continue
      fi
      info "ps_server $i died during training: exited with $(describe_rc "$REAPED_RC")"
      show_log_tail "$RUN/ps$i.log"
      exit 1
    done
    check_job_deadline
    pause
  done
}

# Every worker's final JSON line: the C++ worker always prints one (none is
# a bug); a Python worker prints one only if its script does (pstrain's
# examples do), and exiting 0 is its success.
print_worker_results() {
  local k line
  WORKER_FINALS=()
  for ((k = 0; k < WORKERS; k++)); do
    line=$(grep '^{"event":"final"' "$RUN/worker$k.out" | tail -n 1) || true
    if [[ -z "$line" && -z "$PYTHON_SCRIPT" ]]; then
      info "worker $k exited 0 but printed no final JSON line to $RUN/worker$k.out"
      show_log_tail "$RUN/worker$k.log"
      exit 1
    fi
    [[ -n "$line" ]] && WORKER_FINALS+=("$line")
  done
  ((${#WORKER_FINALS[@]} == 0)) || printf '%s\n' "${WORKER_FINALS[@]}"
  ((${#WORKER_FINALS[@]} == 0)) || report_final_model "${WORKER_FINALS[@]}"
}

# The job as the servers end it, whatever the workers printed
# (deploy/local/job_report.sh): one {"event":"job",...} line on stdout,
# warnings on stderr.
report_job() {
  "$HERE/job_report.sh" --prog="$PROG" --shards="$SERVERS" --workers="$WORKERS" \
    --logs="$RUN/ps*.log" < <(cat "$RUN"/ps*.log 2>/dev/null) || true
}

# Every worker evaluates the job's final model (sync: the model after the
# last step; async/ssp: the servers' model once all workers are done), so
# their held-out figures are one number: say it, or say that they differ.
report_final_model() {
  local line value
  local -a values=()
  for line in "$@"; do
    # test_accuracy (classifiers) or auc (CTR), over the held-out examples.
    value=$(sed -n 's/.*"\(test_accuracy\|auc\)":\([0-9.]*\).*"test_examples":\([1-9][0-9]*\).*/\1 \2 on \3 held-out examples/p' <<<"$line")
    [[ -n "$value" ]] || return 0 # no held-out evaluation (no test set)
    values+=("$value")
  done
  local distinct
  distinct=$(printf '%s\n' "${values[@]}" | sort -u | wc -l)
  if ((distinct == 1)); then
    info "final model: ${values[0]} (reported by all $# worker(s))"
  else
    info "warning: the workers report different final models' figures: ${values[*]}"
  fi
}

main() {
  parse_args "$@"

  trap cleanup EXIT
  trap 'on_signal INT 2' INT
  trap 'on_signal TERM 15' TERM
  trap 'on_signal HUP 1' HUP
  # Without this a closed output pipe killed the launcher outright, and the
  # EXIT trap never stopped the servers and workers it had started.
  trap 'on_signal PIPE 13' PIPE

  now_ms
  JOB_DEADLINE_MS=$((NOW_MS + TIMEOUT_S * 1000))
  if [[ -n "$RUN_DIR" ]]; then
    RUN=$(cd -- "$RUN_DIR" && pwd)
  else
    RUN=$(mktemp -d /tmp/pstrain-run.XXXXXX)
  fi
  info "run dir $RUN; $SERVERS server(s)$( ((REPLICAS == 1)) || echo " x $REPLICAS replicas"), $WORKERS worker(s), mode $MODE, timeout ${TIMEOUT_S}s"

  start_servers
  wait_for_ports
  start_workers
  wait_for_workers
  stop_stream
  print_worker_results

  stop_pids "${SERVER_PIDS[@]}"
  if ((${#STOP_KILLED[@]} > 0)); then
    info "warning: had to SIGKILL ${STOP_KILLED[*]} after ${STOP_GRACE_S}s"
  fi
  if ((${#STOP_FAILED[@]} > 0)); then
    info "warning: after SIGTERM: ${STOP_FAILED[*]}"
  fi
  report_job
  printf 'logs: %s\n' "$RUN"
}

main "$@"
