#!/usr/bin/env bash
# Run the transaction-pooler subset of the integration suite through PgBouncer in
# pool_mode = transaction, our stand-in for RDS Proxy: no named prepared statement, SET,
# advisory lock or other session state may break it.
#
#   scripts/test-pgbouncer.sh [extra cargo test args...]
#
# Starts a private PostgreSQL under .dev/pgbouncer-pg and PgBouncer (installed with apt-get
# when missing and we are root) on a free port under .dev/pgbouncer, then runs
# `cargo test -p poolmgr-tests` on the test areas below with
#   POOLMGR_TEST_DATABASE_URL          = PostgreSQL directly (create/migrate/drop databases,
#                                        the tests' own SQL)
#   POOLMGR_TEST_POOLER_URL_TEMPLATE   = PgBouncer (what the app under test connects to)
# and stops both on exit.
#
# The subset: claims (replays, races), leases, reconcile, hooks (two-phase claims), the events
# feed (its horizon: no session state), and the database runtime (stale connections,
# statement timeout with its cancel through PgBouncer).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

# POOLMGR_PGBOUNCER_TESTS (space-separated test area names) overrides the subset.
read -r -a TEST_FILES <<<"${POOLMGR_PGBOUNCER_TESTS:-claims leases reconcile hooks events_metrics db_resilience statement_timeout}"

# An area is a module of the `api` test binary (tests/tests/api/NAME.rs) or a test binary of
# its own (tests/tests/NAME.rs). The api binary runs with --skip for every module not named,
# so filters given on the command line still narrow the subset.
TARGETS=()
API_MODULES=()
for t in "${TEST_FILES[@]}"; do
    if [[ $t != main && -f "$ROOT/tests/tests/api/$t.rs" ]]; then
        API_MODULES+=("$t")
    elif [[ -f "$ROOT/tests/tests/$t.rs" ]]; then
        TARGETS+=(--test "$t")
    else
        die "unknown test area '$t': neither tests/tests/api/$t.rs nor tests/tests/$t.rs exists"
    fi
done
SKIPS=()
if [[ ${#API_MODULES[@]} -gt 0 ]]; then
    TARGETS+=(--test api)
    for f in "$ROOT"/tests/tests/api/*.rs; do
        m=$(basename "$f" .rs)
        [[ $m == main || " ${API_MODULES[*]} " == *" $m "* ]] || SKIPS+=(--skip "$m::")
    done
fi

PG_DIR_OURS=$ROOT/.dev/pgbouncer-pg
PGB_DIR=$ROOT/.dev/pgbouncer
PGB_PIDFILE=$PGB_DIR/pgbouncer.pid

# --- PgBouncer binary -----------------------------------------------------------
find_pgbouncer() {
    command -v pgbouncer 2>/dev/null || { [[ -x /usr/sbin/pgbouncer ]] && echo /usr/sbin/pgbouncer; }
}
PGBOUNCER=$(find_pgbouncer || true)
if [[ -z "$PGBOUNCER" ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing PgBouncer (apt-get install -y pgbouncer)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || die "apt-get update failed; install pgbouncer yourself and rerun"
        apt-get install -y -qq pgbouncer >/dev/null || die "apt-get install pgbouncer failed; install it yourself and rerun"
        PGBOUNCER=$(find_pgbouncer || true)
    fi
    [[ -n "$PGBOUNCER" ]] || die "pgbouncer not found; install it (Debian: apt-get install pgbouncer) and rerun"
fi
log "using $("$PGBOUNCER" --version 2>/dev/null | head -n 1)"

# --- PostgreSQL -----------------------------------------------------------------
if stack_pidfile_pid "$PGB_PIDFILE" pgbouncer >/dev/null; then
    log "a PgBouncer from an earlier run is still running; stopping it"
    stack_stop_pidfile "$PGB_PIDFILE" pgbouncer INT
fi
PG_FAST=1 stack_pg_fresh "$PG_DIR_OURS"

# --- PgBouncer ------------------------------------------------------------------
rm -rf "$PGB_DIR"
mkdir -p "$PGB_DIR"
PGB_PORT=$(free_port)
# trust: PgBouncer still wants the user in auth_file.
printf '"postgres" ""\n' >"$PGB_DIR/userlist.txt"
cat >"$PGB_DIR/pgbouncer.ini" <<EOF
[databases]
; every database (the tests create one each) on the private server
* = host=127.0.0.1 port=$PG_PORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PGB_PORT
unix_socket_dir =
auth_type = trust
auth_file = $PGB_DIR/userlist.txt
admin_users = postgres
pool_mode = transaction
; each test app has up to 40 connections; a few tests run at once
max_client_conn = 5000
default_pool_size = 40
reserve_pool_size = 10
query_wait_timeout = 60
; what tokio-postgres and psql may send at startup
ignore_startup_parameters = extra_float_digits
logfile = $PGB_DIR/pgbouncer.log
pidfile = $PGB_DIR/pgbouncer.pid
log_connections = 0
log_disconnections = 0
EOF
if [[ $(id -u) -eq 0 ]]; then
    # PgBouncer refuses to run as root: run it as the cluster owner.
    pg_own_dir "$PGB_DIR" || die "cannot prepare $PGB_DIR for the postgres user"
fi
log "starting PgBouncer on 127.0.0.1:$PGB_PORT (pool_mode = transaction; log: $PGB_DIR/pgbouncer.log)"
# Stopped on exit (SIGINT: PgBouncer's safe shutdown) if it started.
at_exit stack_stop_pidfile "$PGB_PIDFILE" pgbouncer INT
pg_as_owner "$PGBOUNCER" -d -q "$PGB_DIR/pgbouncer.ini" || {
    show_log_tail "$PGB_DIR/pgbouncer.log"
    die "PgBouncer did not start; see $PGB_DIR/pgbouncer.log"
}
PSQL=$PG_BINDIR/psql
ready=0
for _ in $(seq 1 100); do
    if PGB_PID=$(stack_pidfile_pid "$PGB_PIDFILE" pgbouncer) &&
        "$PSQL" -X -q -h 127.0.0.1 -p "$PGB_PORT" -U postgres -d postgres -c 'SELECT 1' >/dev/null 2>&1; then
        ready=1
        break
    fi
    sleep 0.1
done
if [[ $ready != 1 ]]; then
    show_log_tail "$PGB_DIR/pgbouncer.log"
    die "PgBouncer did not accept connections on 127.0.0.1:$PGB_PORT within 10 s"
fi
log "PgBouncer is up (pid $PGB_PID)"

# --- the suite ------------------------------------------------------------------
export POOLMGR_TEST_DATABASE_URL=$PG_ADMIN_URL
export POOLMGR_TEST_POOLER_URL_TEMPLATE="postgres://postgres@127.0.0.1:$PGB_PORT/{db}"
log "POOLMGR_TEST_POOLER_URL_TEMPLATE=$POOLMGR_TEST_POOLER_URL_TEMPLATE"
args=("$@")
if [[ ${#SKIPS[@]} -gt 0 ]]; then
    separator=0
    for a in "$@"; do
        [[ $a == -- ]] && separator=1
    done
    [[ $separator == 1 ]] || args+=(--)
    args+=("${SKIPS[@]}")
fi
cd "$ROOT"
log "RUST_BACKTRACE=1 cargo test -p poolmgr-tests ${TARGETS[*]} --no-fail-fast${args[*]:+ ${args[*]}}"
status=0
RUST_BACKTRACE=1 cargo test -p poolmgr-tests "${TARGETS[@]}" --no-fail-fast "${args[@]}" || status=$?
if [[ $status -ne 0 ]]; then
    show_log_tail "$PGB_DIR/pgbouncer.log"
    err "the suite failed through PgBouncer (exit $status); a test that passes with scripts/test.sh but fails here depends on session state (named prepared statements, SET, advisory locks)"
fi
exit "$status"
