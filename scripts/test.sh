#!/usr/bin/env bash
# Run the whole test suite: scripts/test.sh [extra cargo test args...]
#
# Without POOLMGR_TEST_DATABASE_URL a fresh private PostgreSQL is started under
# .dev/test-pg (wiped first, stopped on exit) and its admin URL is exported as
# POOLMGR_TEST_DATABASE_URL. Tests create and drop their own poolmgr_test_*
# databases through it.
#
# With POOLMGR_TEST_DATABASE_URL set (an admin/superuser URL), leftover
# poolmgr_test_* databases there are dropped first and that server is used.
#
# Extra arguments are passed to `cargo test`, e.g.
#   scripts/test.sh -p poolmgr-core
#   scripts/test.sh -- --nocapture
# When you select packages with -p/--package, --workspace is not added.
#
# When the run includes the integration suite (poolmgr-tests), the claims and reconcile
# function binaries are built first: its lambda_lifecycle tests run them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

if [[ -z "${POOLMGR_TEST_DATABASE_URL:-}" ]]; then
    PG_TEST_DIR=$ROOT/.dev/test-pg
    mkdir -p "$ROOT/.dev"
    # One private cluster per checkout: refuse to wipe one that another
    # scripts/test.sh run is still using.
    exec 9>"$ROOT/.dev/test-pg.lock"
    if command -v flock >/dev/null 2>&1 && ! flock -n 9; then
        # Another run owns .dev/test-pg: use a private cluster of our own instead.
        PG_TEST_DIR=$ROOT/.dev/test-pg-$$
        log "another scripts/test.sh is running here; using $PG_TEST_DIR"
        # Runs after the stop stack_pg_fresh registers.
        at_exit rm -rf "$PG_TEST_DIR"
    fi
    log "wiping $PG_TEST_DIR for a fresh test database server"
    # fd 9 (the lock) must not leak into the long-lived postmaster.
    PG_FAST=1 stack_pg_fresh "$PG_TEST_DIR" "or set POOLMGR_TEST_DATABASE_URL to use an existing server" 9>&-
    export POOLMGR_TEST_DATABASE_URL=$PG_ADMIN_URL
    log "POOLMGR_TEST_DATABASE_URL=$POOLMGR_TEST_DATABASE_URL"
else
    log "using POOLMGR_TEST_DATABASE_URL from the environment"
    PSQL=$(pg_bindir 2>/dev/null || true)/psql
    if [[ ! -x "$PSQL" ]]; then
        PSQL=$(command -v psql) || die "psql not found; install the PostgreSQL client or set PG_BINDIR"
    fi
    log "dropping leftover poolmgr_test_* databases"
    if ! "$PSQL" -X -q -v ON_ERROR_STOP=1 -d "$POOLMGR_TEST_DATABASE_URL" >/dev/null <<'SQL'; then
SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', datname)
FROM pg_database
WHERE datname LIKE 'poolmgr\_test\_%'
\gexec
SQL
        die "could not clean up POOLMGR_TEST_DATABASE_URL; check that the server is up and the URL is a superuser (admin) URL, or unset it to use a private server"
    fi
fi

# -p/--package selects packages explicitly; otherwise test the whole workspace.
workspace=(--workspace)
integration=0
profile=()
for arg in "$@"; do
    case "$arg" in
        --) break ;;
        -p | --package | -p?* | --package=*) workspace=() ;;
        --release) profile=(--release) ;;
    esac
    if [[ $arg == *poolmgr-tests* ]]; then integration=1; fi
done
if [[ ${#workspace[@]} -gt 0 ]]; then integration=1; fi

cd "$ROOT"
# The integration suite's lambda_lifecycle tests run the claims and reconcile binaries as Lambda
# does; `cargo test` builds no other package's binaries, so build them first.
if [[ $integration == 1 ]]; then
    log "cargo build${profile[*]:+ ${profile[*]}} --bin claims --bin reconcile (run by the lambda_lifecycle tests)"
    cargo build "${profile[@]}" --bin claims --bin reconcile ||
        die "building the claims and reconcile functions failed; fix the errors above"
fi
log "RUST_BACKTRACE=1 cargo test${workspace[*]:+ ${workspace[*]}} --all-targets${*:+ $*}"
status=0
RUST_BACKTRACE=1 cargo test "${workspace[@]}" --all-targets --no-fail-fast "$@" || status=$?
if [[ $status -ne 0 ]]; then
    err "cargo test failed (exit $status); read the failures above and rerun e.g. scripts/test.sh -p CRATE TEST_NAME"
fi
exit "$status"
