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
#   FLINTLOCK_SIM_ARGS  extra flintlock-sim arguments, split at whitespace (no quoting),
#                     after the defaults so they win; e.g. to make every hook command
#                     containing "setup" fail with exit code 3:
#                     FLINTLOCK_SIM_ARGS='--exec-rule setup=3' scripts/dev.sh
#                     (flintlock-sim --help lists the arguments)
#   CARGO_TARGET_DIR  honoured when locating the built binaries
#
# Files under .dev/: tokens.env (generated once; delete to regenerate),
# stack.env (endpoint/tokens/addresses of the running stack), *.log, *.pid.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV=$ROOT/.dev
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

PG_DEV_DIR=$DEV/pg
SIM_LOG=$DEV/flintlock-sim.log
SIM_PIDFILE=$DEV/flintlock-sim.pid
APP_LOG=$DEV/poolmgr-local.log
APP_PIDFILE=$DEV/poolmgr-local.pid
TOKENS_FILE=$DEV/tokens.env
STACK_FILE=$DEV/stack.env

usage() {
    # The header comment (line 2 up to the first non-comment line).
    sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "${BASH_SOURCE[0]}"
}

cmd_stop() {
    stack_stop_pidfile "$APP_PIDFILE" poolmgr-local
    stack_stop_pidfile "$SIM_PIDFILE" flintlock-sim
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

# Rust (rustup's, at least the workspace's rust-version), cc, curl, kill, python3 and, unless
# DATABASE_URL is set, the PostgreSQL server binaries (scripts/lib/preflight.sh).
preflight dev || die "install what is listed above and rerun scripts/dev.sh"

mkdir -p "$DEV"

# Refuse to start a second stack on top of a running one.
for pair in "$APP_PIDFILE:poolmgr-local" "$SIM_PIDFILE:flintlock-sim"; do
    if pid=$(stack_pidfile_pid "${pair%%:*}" "${pair#*:}"); then
        die "${pair#*:} from an earlier scripts/dev.sh is still running (pid $pid); run scripts/dev.sh stop first"
    fi
    rm -f "${pair%%:*}"
done

# --- cleanup ----------------------------------------------------------------
# What starts below registers its own stop (newest first: poolmgr-local, flintlock-sim, the
# PostgreSQL this run started); this runs last.
# shellcheck disable=SC2317  # invoked at exit
stack_stopped() {
    if [[ $AT_EXIT_STATUS == 0 ]]; then
        log "local stack stopped cleanly"
    fi
}
at_exit stack_stopped
# Stop the private PostgreSQL only if this run started it (pg_start sets PG_STARTED=0 when it
# reused a running one).
# shellcheck disable=SC2317  # invoked at exit
stop_private_pg() {
    if [[ "${PG_STARTED:-1}" != 0 ]]; then
        pg_stop "$PG_DEV_DIR"
    fi
}
# Interrupting startup is a failure (130); Ctrl-C once the stack is up is the
# normal way to stop it (0).
INTERRUPT_STATUS=130
trap 'log "interrupted; shutting down"; exit "$INTERRUPT_STATUS"' INT TERM

# --- build --------------------------------------------------------------------
cd "$ROOT"
log "building poolmgr-local, flintlock-sim and poolmgrctl (cargo build --bins -p poolmgr-local -p flintlock-sim -p poolmgrctl)"
stack_build debug --bins -p poolmgr-local -p flintlock-sim -p poolmgrctl
for bin in poolmgr-local flintlock-sim; do
    [[ -x "$STACK_BIN/$bin" ]] || die "$STACK_BIN/$bin was not built; check that the $bin package defines a binary named $bin"
done

# --- database -----------------------------------------------------------------
PRIVATE_PG=0
if [[ -n "${DATABASE_URL:-}" ]]; then
    log "using DATABASE_URL from the environment"
else
    PRIVATE_PG=1
    PG_STARTED=""
    at_exit stop_private_pg
    pg_start "$PG_DEV_DIR" || die "could not start the private PostgreSQL; see above, or set DATABASE_URL to use your own database"
    DATABASE_URL=$(pg_create_db poolmgr) || die "could not create database poolmgr; see $PG_DEV_DIR/postgres.log"
fi
export DATABASE_URL

# --- flintlock-sim ------------------------------------------------------------
: >"$SIM_LOG"
at_exit rm -f "$STACK_FILE"
at_exit rm -f "$SIM_PIDFILE"
# Word-split on purpose (read -a: at whitespace only, no globbing); later flags win.
read -r -a SIM_EXTRA_ARGS <<<"${FLINTLOCK_SIM_ARGS:-}"
if [[ ${#SIM_EXTRA_ARGS[@]} -gt 0 ]]; then
    log "flintlock-sim extra arguments (FLINTLOCK_SIM_ARGS): ${SIM_EXTRA_ARGS[*]}"
fi
stack_sim_start "$SIM_LOG" --listen 127.0.0.1:0 --boot-delay-ms 500 --delete-delay-ms 200 \
    ${SIM_EXTRA_ARGS[@]+"${SIM_EXTRA_ARGS[@]}"}
echo "$SIM_PID" >"$SIM_PIDFILE"

# --- tokens -------------------------------------------------------------------
if [[ ! -f "$TOKENS_FILE" ]]; then
    log "generating API tokens into $TOKENS_FILE"
    (
        umask 077
        printf 'POOLMGR_ADMIN_TOKENS=%s\nPOOLMGR_VIEWER_TOKENS=%s\nPOOLMGR_CLIENT_TOKENS=%s\n' \
            "$(random_token)" "$(random_token)" "$(random_token)" >"$TOKENS_FILE"
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
if [[ -z "${POOLMGR_VIEWER_TOKENS:-}" ]]; then
    # A tokens file from before the viewer role: add one (for monitoring), keep the rest.
    log "adding a viewer token to $TOKENS_FILE"
    POOLMGR_VIEWER_TOKENS=$(random_token)
    printf 'POOLMGR_VIEWER_TOKENS=%s\n' "$POOLMGR_VIEWER_TOKENS" >>"$TOKENS_FILE"
    export POOLMGR_VIEWER_TOKENS
fi
VIEWER_TOKEN=${POOLMGR_VIEWER_TOKENS%%,*}
if [[ -z "${POOLMGR_CREDENTIALS_KEY:-}" ]]; then
    # The key hosts' secrets are encrypted with at rest (a tokens file from before it: add
    # one, keep the rest). Lose it and hosts with a TLS key or token must be registered again.
    log "adding a credentials key to $TOKENS_FILE"
    POOLMGR_CREDENTIALS_KEY=$(random_token)$(random_token)
    printf 'POOLMGR_CREDENTIALS_KEY=%s\n' "$POOLMGR_CREDENTIALS_KEY" >>"$TOKENS_FILE"
    export POOLMGR_CREDENTIALS_KEY
fi

# --- poolmgr-local ------------------------------------------------------------
if [[ -z "${POOLMGR_HTTP_ADDR:-}" ]]; then
    if port_is_free 8080; then
        POOLMGR_HTTP_ADDR=127.0.0.1:8080
    else
        POOLMGR_HTTP_ADDR=127.0.0.1:$(free_port)
        log "port 8080 is busy; using $POOLMGR_HTTP_ADDR instead (set POOLMGR_HTTP_ADDR to choose)"
    fi
fi
export POOLMGR_HTTP_ADDR
export POOLMGR_RECONCILE_INTERVAL_SECONDS=${POOLMGR_RECONCILE_INTERVAL_SECONDS:-2}

: >"$APP_LOG"
at_exit rm -f "$APP_PIDFILE"
stack_app_start "$POOLMGR_HTTP_ADDR" "$APP_LOG"
echo "$APP_PID" >"$APP_PIDFILE"
URL=$APP_URL
log "poolmgr-local is healthy (pid $APP_PID)"

# --- register the simulator as host "local" -------------------------------------
stack_register_host "$URL" "$ADMIN_TOKEN" local "$SIM_ADDR"

# --- report -------------------------------------------------------------------
(
    umask 077
    cat >"$STACK_FILE" <<EOF
POOLMGR_ENDPOINT=$URL
POOLMGR_TOKEN=$CLIENT_TOKEN
POOLMGR_CLIENT_TOKEN=$CLIENT_TOKEN
POOLMGR_ADMIN_TOKEN=$ADMIN_TOKEN
POOLMGR_VIEWER_TOKEN=$VIEWER_TOKEN
POOLMGR_ADMIN_TOKENS=$ADMIN_TOKEN
POOLMGR_VIEWER_TOKENS=$VIEWER_TOKEN
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
  flintlock-sim: $SIM_ADDR (registered as host "local")${SIM_EXTRA_ARGS[*]:+, with ${SIM_EXTRA_ARGS[*]}}
  database:      $DATABASE_URL
  logs:          $APP_LOG, $SIM_LOG$pg_log_line
  settings:      $STACK_FILE (tokens persist in $TOKENS_FILE; delete it to regenerate)

  export POOLMGR_ENDPOINT=$URL POOLMGR_TOKEN=$CLIENT_TOKEN
  curl -H "Authorization: Bearer $ADMIN_TOKEN" $URL/v1/hosts

EOF

if [[ $MODE == no-wait ]]; then
    at_exit_cancel
    log "left running: poolmgr-local (pid $APP_PID), flintlock-sim (pid $SIM_PID)$([[ $PRIVATE_PG == 1 ]] && printf ', PostgreSQL in %s' "$PG_DEV_DIR"); stop with scripts/dev.sh stop"
    exit 0
fi

INTERRUPT_STATUS=0
log "press Ctrl-C to stop everything"
while true; do
    if ! pid_alive "$APP_PID"; then
        show_log_tail "$APP_LOG"
        die "poolmgr-local exited unexpectedly; see $APP_LOG, then rerun scripts/dev.sh"
    fi
    if ! pid_alive "$SIM_PID"; then
        show_log_tail "$SIM_LOG"
        die "flintlock-sim exited unexpectedly; see $SIM_LOG, then rerun scripts/dev.sh"
    fi
    # Backgrounded sleep + wait so INT/TERM traps run immediately.
    sleep 1 &
    wait $! || true
done
