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
# shellcheck source=lib/pgbouncer.sh
. "$ROOT/scripts/lib/pgbouncer.sh"

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

# --- PostgreSQL and PgBouncer ---------------------------------------------------
PG_FAST=1 stack_pg_fresh "$PG_DIR_OURS"
# pgbouncer_start's pool sizes suit the suite: each test app has up to 40 connections,
# and a few tests run at once.
pgbouncer_start "$ROOT/.dev/pgbouncer" "$PG_PORT"

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
    show_log_tail "$PGB_LOG"
    err "the suite failed through PgBouncer (exit $status); a test that passes with scripts/test.sh but fails here depends on session state (named prepared statements, SET, advisory locks)"
fi
exit "$status"
