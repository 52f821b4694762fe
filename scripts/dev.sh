#!/usr/bin/env bash
# Start the whole local poolmgr stack: PostgreSQL, flintlock-sim, poolmgr-local.
#
#   scripts/dev.sh            start everything, print how to use it, wait;
#                             Ctrl-C stops everything this script started
#   scripts/dev.sh --no-wait  start everything, print, exit and leave it running
#                             (PIDs in .dev/*.pid, settings in .dev/stack.env)
#   scripts/dev.sh stop       stop what a previous run left running, including
#                             the private PostgreSQL under .dev/pg
#
# Environment (all optional):
#   DATABASE_URL      use this database instead of a private PostgreSQL in .dev/pg
#   POOLMGR_HTTP_ADDR listen address for poolmgr-local (default 127.0.0.1:8080,
#                     or a free port if 8080 is busy)
#   POOLMGR_RECONCILE_INTERVAL_SECONDS  reconcile interval (default 2)
#   CARGO_TARGET_DIR  honoured when locating the built binaries
#
# Files under .dev/: tokens.env (generated once; delete to regenerate),
# stack.env (endpoint/tokens/addresses of the running stack), *.log, *.pid.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV=$ROOT/.dev
# shellcheck source=lib/pg.sh
. "$ROOT/scripts/lib/pg.sh"

PG_DEV_DIR=$DEV/pg
SIM_LOG=$DEV/flintlock-sim.log
SIM_PIDFILE=$DEV/flintlock-sim.pid
APP_LOG=$DEV/poolmgr-local.log
APP_PIDFILE=$DEV/poolmgr-local.pid
TOKENS_FILE=$DEV/tokens.env
STACK_FILE=$DEV/stack.env

log() { printf '==> %s\n' "$*" >&2; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

usage() {
    # The header comment (line 2 up to the first non-comment line).
    sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "${BASH_SOURCE[0]}"
}

show_log_tail() {
    local file=$1
    if [[ -f "$file" ]]; then
        printf -- '--- last lines of %s ---\n' "$file" >&2
        tail -n 40 "$file" >&2 || true
        printf -- '--- end of %s ---\n' "$file" >&2
    fi
}

# child_alive PID: PID exists and is not a zombie (an exited child that has
# not been reaped yet still has a /proc entry).
child_alive() {
    local pid=$1 stat
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ "${stat:0:1}" != Z && "${stat:0:1}" != X ]]
}

# proc_alive PID NAME: PID is alive and runs the program NAME (guards against
# PIDs from stale pid files having been reused by something else).
proc_alive() {
    local pid=$1 name=$2 arg
    child_alive "$pid" || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == "$name" ]] && return 0
    # Also accept NAME anywhere in argv (e.g. when it runs via an interpreter).
    while IFS= read -r -d '' arg; do
        [[ "$arg" == "$name" || "$arg" == */"$name" ]] && return 0
    done <"/proc/$pid/cmdline" 2>/dev/null || true
    return 1
}

# pidfile_alive FILE NAME: print the PID recorded in FILE if that process is alive.
pidfile_alive() {
    local file=$1 name=$2 pid
    [[ -f "$file" ]] || return 1
    pid=$(head -n 1 "$file" 2>/dev/null || true)
    proc_alive "$pid" "$name" || return 1
    printf '%s\n' "$pid"
}

# stop_proc PID NAME: TERM, wait up to 15 s, then KILL. Callers make sure PID
# is ours (a child of this script, or checked with proc_alive).
stop_proc() {
    local pid=$1 name=$2 i
    child_alive "$pid" || return 0
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 150); do
        child_alive "$pid" || return 0
        sleep 0.1
        : "$i"
    done
    log "$name (pid $pid) did not exit after 15 s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

stop_from_pidfile() {
    local file=$1 name=$2 pid
    if pid=$(pidfile_alive "$file" "$name"); then
        stop_proc "$pid" "$name"
    else
        log "$name is not running"
    fi
    rm -f "$file"
}

# spawn LOG CMD...: run CMD in the background in its own session (so a
# terminal Ctrl-C reaches only this script, which then stops it in order),
# appending output to LOG. Sets SPAWNED_PID.
spawn() {
    local logfile=$1
    shift
    if command -v setsid >/dev/null 2>&1; then
        setsid "$@" >>"$logfile" 2>&1 </dev/null &
    else
        "$@" >>"$logfile" 2>&1 </dev/null &
    fi
    SPAWNED_PID=$!
}

random_token() {
    if command -v openssl >/dev/null 2>&1; then
        openssl rand -hex 16
    elif command -v python3 >/dev/null 2>&1; then
        python3 -c 'import secrets; print(secrets.token_hex(16))'
    else
        od -An -N16 -tx1 /dev/urandom | tr -d ' \n'
        echo
    fi
}

cmd_stop() {
    stop_from_pidfile "$APP_PIDFILE" poolmgr-local
    stop_from_pidfile "$SIM_PIDFILE" flintlock-sim
    if [[ -d "$PG_DEV_DIR/data" ]]; then
        pg_stop "$PG_DEV_DIR" || die "could not stop PostgreSQL in $PG_DEV_DIR; see $PG_DEV_DIR/postgres.log"
    fi
    rm -f "$STACK_FILE"
    log "local stack stopped"
}

MODE="wait"
case "${1:-}" in
    "") ;;
    --no-wait) MODE=no-wait ;;
    stop)
        cmd_stop
        exit 0
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        usage >&2
        die "unknown argument '$1'; use --no-wait, stop or --help"
        ;;
esac
if [[ $# -gt 1 ]]; then
    die "too many arguments; usage: scripts/dev.sh [--no-wait | stop | --help]"
fi

command -v curl >/dev/null 2>&1 || die "curl is required; install it (apt-get install curl) and rerun"
command -v cargo >/dev/null 2>&1 || die "cargo is required; install Rust (https://rustup.rs) and rerun"

mkdir -p "$DEV"

# Refuse to start a second stack on top of a running one.
for pair in "$APP_PIDFILE:poolmgr-local" "$SIM_PIDFILE:flintlock-sim"; do
    if pid=$(pidfile_alive "${pair%%:*}" "${pair#*:}"); then
        die "${pair#*:} from an earlier scripts/dev.sh is still running (pid $pid); run scripts/dev.sh stop first"
    fi
    rm -f "${pair%%:*}"
done

# --- cleanup ----------------------------------------------------------------
APP_PID=""
SIM_PID=""
PRIVATE_PG=0
KEEP_RUNNING=0

# shellcheck disable=SC2317  # invoked via trap
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [[ $KEEP_RUNNING == 1 ]]; then
        exit "$status"
    fi
    if [[ -n "$APP_PID" ]]; then
        stop_proc "$APP_PID" poolmgr-local
        rm -f "$APP_PIDFILE"
    fi
    if [[ -n "$SIM_PID" ]]; then
        stop_proc "$SIM_PID" flintlock-sim
        rm -f "$SIM_PIDFILE"
    fi
    # Stop the private PostgreSQL only if this run started it.
    if [[ $PRIVATE_PG == 1 && "${PG_STARTED:-1}" != 0 ]]; then
        pg_stop "$PG_DEV_DIR" || true
    fi
    if [[ -n "$APP_PID$SIM_PID" ]]; then
        rm -f "$STACK_FILE"
    fi
    if [[ $status == 0 ]]; then
        log "local stack stopped cleanly"
    fi
    exit "$status"
}
trap cleanup EXIT
# Interrupting startup is a failure (130); Ctrl-C once the stack is up is the
# normal way to stop it (0).
INTERRUPT_STATUS=130
trap 'log "interrupted; shutting down"; exit "$INTERRUPT_STATUS"' INT TERM

# --- build --------------------------------------------------------------------
cd "$ROOT"
log "building poolmgr-local, flintlock-sim and poolmgrctl (cargo build --bins -p poolmgr-local -p flintlock-sim -p poolmgrctl)"
cargo build --bins -p poolmgr-local -p flintlock-sim -p poolmgrctl ||
    die "build failed; fix the errors above and rerun scripts/dev.sh"
BIN_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/debug
for bin in poolmgr-local flintlock-sim; do
    [[ -x "$BIN_DIR/$bin" ]] || die "$BIN_DIR/$bin was not built; check that the $bin package defines a binary named $bin"
done

# --- database -----------------------------------------------------------------
if [[ -n "${DATABASE_URL:-}" ]]; then
    log "using DATABASE_URL from the environment"
else
    PRIVATE_PG=1
    PG_STARTED=""
    pg_start "$PG_DEV_DIR" || die "could not start the private PostgreSQL; see above, or set DATABASE_URL to use your own database"
    DATABASE_URL=$(pg_create_db poolmgr) || die "could not create database poolmgr; see $PG_DEV_DIR/postgres.log"
fi
export DATABASE_URL

# --- flintlock-sim ------------------------------------------------------------
log "starting flintlock-sim (log: $SIM_LOG)"
: >"$SIM_LOG"
spawn "$SIM_LOG" "$BIN_DIR/flintlock-sim" --listen 127.0.0.1:0 --boot-delay-ms 500 --delete-delay-ms 200
SIM_PID=$SPAWNED_PID
echo "$SIM_PID" >"$SIM_PIDFILE"
SIM_ADDR=""
for _ in $(seq 1 300); do
    SIM_ADDR=$(grep -m 1 -oE 'flintlock-sim listening on [0-9.]+:[0-9]+' "$SIM_LOG" 2>/dev/null | awk '{print $4}' || true)
    [[ -n "$SIM_ADDR" ]] && break
    if ! child_alive "$SIM_PID"; then
        show_log_tail "$SIM_LOG"
        die "flintlock-sim exited during startup; see $SIM_LOG"
    fi
    sleep 0.1
done
if [[ -z "$SIM_ADDR" ]]; then
    show_log_tail "$SIM_LOG"
    die "flintlock-sim did not print 'flintlock-sim listening on ADDR' within 30 s; see $SIM_LOG"
fi
log "flintlock-sim listening on $SIM_ADDR (pid $SIM_PID)"

# --- tokens -------------------------------------------------------------------
if [[ ! -f "$TOKENS_FILE" ]]; then
    log "generating API tokens into $TOKENS_FILE"
    (
        umask 077
        printf 'POOLMGR_ADMIN_TOKENS=%s\nPOOLMGR_CLIENT_TOKENS=%s\n' "$(random_token)" "$(random_token)" >"$TOKENS_FILE"
    )
fi
set -a
# shellcheck source=/dev/null
. "$TOKENS_FILE"
set +a
if [[ -z "${POOLMGR_ADMIN_TOKENS:-}" || -z "${POOLMGR_CLIENT_TOKENS:-}" ]]; then
    die "$TOKENS_FILE must set POOLMGR_ADMIN_TOKENS and POOLMGR_CLIENT_TOKENS; delete it to regenerate"
fi
ADMIN_TOKEN=${POOLMGR_ADMIN_TOKENS%%,*}
CLIENT_TOKEN=${POOLMGR_CLIENT_TOKENS%%,*}

# --- poolmgr-local ------------------------------------------------------------
if [[ -z "${POOLMGR_HTTP_ADDR:-}" ]]; then
    if pg_port_is_free 8080; then
        POOLMGR_HTTP_ADDR=127.0.0.1:8080
    else
        POOLMGR_HTTP_ADDR=127.0.0.1:$(pg_free_port)
        log "port 8080 is busy; using $POOLMGR_HTTP_ADDR instead (set POOLMGR_HTTP_ADDR to choose)"
    fi
fi
export POOLMGR_HTTP_ADDR
export POOLMGR_RECONCILE_INTERVAL_SECONDS=${POOLMGR_RECONCILE_INTERVAL_SECONDS:-2}

http_host=${POOLMGR_HTTP_ADDR%:*}
http_port=${POOLMGR_HTTP_ADDR##*:}
case "$http_host" in
    "" | 0.0.0.0) http_host=127.0.0.1 ;;
    "[::]") http_host="[::1]" ;;
esac
URL=http://$http_host:$http_port

log "starting poolmgr-local on $POOLMGR_HTTP_ADDR (log: $APP_LOG)"
: >"$APP_LOG"
spawn "$APP_LOG" "$BIN_DIR/poolmgr-local"
APP_PID=$SPAWNED_PID
echo "$APP_PID" >"$APP_PIDFILE"

log "waiting for $URL/healthz"
healthy=0
for _ in $(seq 1 120); do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$URL/healthz" 2>/dev/null || true)
    if [[ "$code" == 200 ]]; then
        healthy=1
        break
    fi
    if ! child_alive "$APP_PID"; then
        show_log_tail "$APP_LOG"
        die "poolmgr-local exited during startup; see $APP_LOG"
    fi
    sleep 0.5
done
if [[ $healthy != 1 ]]; then
    show_log_tail "$APP_LOG"
    die "poolmgr-local did not answer 200 on $URL/healthz within 60 s; see $APP_LOG"
fi
log "poolmgr-local is healthy (pid $APP_PID)"

# --- register the simulator as host "local" -------------------------------------
HOST_BODY=$(printf '{"name":"local","address":"%s","tls":{"insecure":true}}' "$SIM_ADDR")
resp=$(mktemp)
code=$(curl -sS -o "$resp" -w '%{http_code}' -X POST "$URL/v1/hosts" \
    -H "Authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' \
    -d "$HOST_BODY" || true)
case "$code" in
    2??) log "registered flintlock-sim as host 'local' ($SIM_ADDR)" ;;
    409)
        log "host 'local' already exists; updating its address to $SIM_ADDR"
        if ! curl -fsS -o /dev/null -X PUT "$URL/v1/hosts/local" \
            -H "Authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' \
            -d "$HOST_BODY"; then
            rm -f "$resp"
            show_log_tail "$APP_LOG"
            die "PUT /v1/hosts/local failed; see $APP_LOG"
        fi
        ;;
    *)
        printf 'response body: %s\n' "$(cat "$resp")" >&2
        rm -f "$resp"
        show_log_tail "$APP_LOG"
        die "POST /v1/hosts answered '${code:-no response}'; see $APP_LOG"
        ;;
esac
rm -f "$resp"

# --- report -------------------------------------------------------------------
(
    umask 077
    cat >"$STACK_FILE" <<EOF
POOLMGR_ENDPOINT=$URL
POOLMGR_TOKEN=$CLIENT_TOKEN
POOLMGR_CLIENT_TOKEN=$CLIENT_TOKEN
POOLMGR_ADMIN_TOKEN=$ADMIN_TOKEN
POOLMGR_ADMIN_TOKENS=$ADMIN_TOKEN
POOLMGR_CLIENT_TOKENS=$CLIENT_TOKEN
DATABASE_URL=$DATABASE_URL
FLINTLOCK_SIM_ADDR=$SIM_ADDR
POOLMGR_LOCAL_PID=$APP_PID
FLINTLOCK_SIM_PID=$SIM_PID
EOF
)

pg_log_line=""
if [[ $PRIVATE_PG == 1 ]]; then
    pg_log_line=", $PG_DEV_DIR/postgres.log"
fi
cat <<EOF

poolmgr local stack is up
  API:           $URL
  admin token:   $ADMIN_TOKEN
  client token:  $CLIENT_TOKEN
  flintlock-sim: $SIM_ADDR (registered as host "local")
  database:      $DATABASE_URL
  logs:          $APP_LOG, $SIM_LOG$pg_log_line
  settings:      $STACK_FILE (tokens persist in $TOKENS_FILE; delete it to regenerate)

  export POOLMGR_ENDPOINT=$URL POOLMGR_TOKEN=$CLIENT_TOKEN
  curl -H "Authorization: Bearer $ADMIN_TOKEN" $URL/v1/hosts

EOF

if [[ $MODE == no-wait ]]; then
    KEEP_RUNNING=1
    log "left running: poolmgr-local (pid $APP_PID), flintlock-sim (pid $SIM_PID)$([[ $PRIVATE_PG == 1 ]] && printf ', PostgreSQL in %s' "$PG_DEV_DIR"); stop with scripts/dev.sh stop"
    exit 0
fi

INTERRUPT_STATUS=0
log "press Ctrl-C to stop everything"
while true; do
    if ! child_alive "$APP_PID"; then
        show_log_tail "$APP_LOG"
        APP_PID=""
        die "poolmgr-local exited unexpectedly; see $APP_LOG, then rerun scripts/dev.sh"
    fi
    if ! child_alive "$SIM_PID"; then
        show_log_tail "$SIM_LOG"
        SIM_PID=""
        die "flintlock-sim exited unexpectedly; see $SIM_LOG, then rerun scripts/dev.sh"
    fi
    # Backgrounded sleep + wait so INT/TERM traps run immediately.
    sleep 1 &
    wait $! || true
done
