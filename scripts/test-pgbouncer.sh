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
# The subset: claims (replays, races), leases, reconcile, hooks (two-phase claims), and the
# database runtime (stale connections, statement timeout with its cancel through PgBouncer).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/pg.sh
. "$ROOT/scripts/lib/pg.sh"

# POOLMGR_PGBOUNCER_TESTS (space-separated test area names) overrides the subset.
read -r -a TEST_FILES <<<"${POOLMGR_PGBOUNCER_TESTS:-claims leases reconcile hooks db_resilience statement_timeout}"

log() { printf '==> %s\n' "$*" >&2; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

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
STARTED_PG=0
PGB_PID=""

show_tail() {
    local file=$1
    if [[ -f "$file" ]]; then
        printf -- '--- last lines of %s ---\n' "$file" >&2
        tail -n 40 "$file" >&2 || true
        printf -- '--- end of %s ---\n' "$file" >&2
    fi
}

# The PID in PgBouncer's pidfile, if that process is a live pgbouncer.
pgbouncer_pid() {
    local pid
    pid=$(head -n 1 "$PGB_DIR/pgbouncer.pid" 2>/dev/null || true)
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == pgbouncer ]] || return 1
    printf '%s\n' "$pid"
}

stop_pgbouncer() {
    local pid i
    pid=$(pgbouncer_pid) || return 0
    log "stopping PgBouncer (pid $pid)"
    kill -INT "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
        : "$i"
    done
    kill -KILL "$pid" 2>/dev/null || true
}

# shellcheck disable=SC2317  # invoked via trap
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n "$PGB_PID" ]]; then
        stop_pgbouncer
    fi
    if [[ $STARTED_PG == 1 ]]; then
        pg_stop "$PG_DIR_OURS" || true
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

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
if pgbouncer_pid >/dev/null; then
    log "a PgBouncer from an earlier run is still running; stopping it"
    stop_pgbouncer
fi
if [[ -d "$PG_DIR_OURS/data" ]]; then
    pg_stop "$PG_DIR_OURS" || die "could not stop the old PostgreSQL in $PG_DIR_OURS; kill it and remove that directory"
fi
rm -rf "$PG_DIR_OURS"
STARTED_PG=1
PG_FAST=1 pg_start "$PG_DIR_OURS" || die "could not start PostgreSQL; see above"

# --- PgBouncer ------------------------------------------------------------------
rm -rf "$PGB_DIR"
mkdir -p "$PGB_DIR"
PGB_PORT=$(pg_free_port)
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
    _pg_prepare_dir_for_postgres "$PGB_DIR" || die "cannot prepare $PGB_DIR for the postgres user"
fi
log "starting PgBouncer on 127.0.0.1:$PGB_PORT (pool_mode = transaction; log: $PGB_DIR/pgbouncer.log)"
_pg_as_owner "$PGBOUNCER" -d -q "$PGB_DIR/pgbouncer.ini" || {
    show_tail "$PGB_DIR/pgbouncer.log"
    die "PgBouncer did not start; see $PGB_DIR/pgbouncer.log"
}
PSQL=$PG_BINDIR/psql
ready=0
for _ in $(seq 1 100); do
    if PGB_PID=$(pgbouncer_pid) &&
        "$PSQL" -X -q -h 127.0.0.1 -p "$PGB_PORT" -U postgres -d postgres -c 'SELECT 1' >/dev/null 2>&1; then
        ready=1
        break
    fi
    sleep 0.1
done
if [[ $ready != 1 ]]; then
    show_tail "$PGB_DIR/pgbouncer.log"
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
    show_tail "$PGB_DIR/pgbouncer.log"
    printf 'error: the suite failed through PgBouncer (exit %s); a test that passes with scripts/test.sh but fails here depends on session state (named prepared statements, SET, advisory locks)\n' "$status" >&2
fi
exit "$status"
