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
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/pg.sh
. "$ROOT/scripts/lib/pg.sh"

log() { printf '==> %s\n' "$*" >&2; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

PG_TEST_DIR=$ROOT/.dev/test-pg
STARTED_PG=0

# shellcheck disable=SC2317  # invoked via trap
cleanup() {
    local status=$?
    if [[ $STARTED_PG == 1 ]]; then
        pg_stop "$PG_TEST_DIR" || true
        case "$PG_TEST_DIR" in *test-pg-[0-9]*) rm -rf "$PG_TEST_DIR" ;; esac
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ -z "${POOLMGR_TEST_DATABASE_URL:-}" ]]; then
    mkdir -p "$ROOT/.dev"
    # One private cluster per checkout: refuse to wipe one that another
    # scripts/test.sh run is still using.
    exec 9>"$ROOT/.dev/test-pg.lock"
    if command -v flock >/dev/null 2>&1 && ! flock -n 9; then
        # Another run owns .dev/test-pg: use a private cluster of our own instead.
        PG_TEST_DIR=$ROOT/.dev/test-pg-$$
        log "another scripts/test.sh is running here; using $PG_TEST_DIR"
    fi
    # A crashed earlier run may have left its server running.
    if [[ -d "$PG_TEST_DIR/data" ]]; then
        pg_stop "$PG_TEST_DIR" 9>&- || die "could not stop the old test PostgreSQL in $PG_TEST_DIR; kill it and remove that directory"
    fi
    log "wiping $PG_TEST_DIR for a fresh test database server"
    rm -rf "$PG_TEST_DIR"
    STARTED_PG=1
    # fd 9 (the lock) must not leak into the long-lived postmaster.
    PG_FAST=1 pg_start "$PG_TEST_DIR" 9>&- || die "could not start the test PostgreSQL; see above, or set POOLMGR_TEST_DATABASE_URL to use an existing server"
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
for arg in "$@"; do
    case "$arg" in
        --) break ;;
        -p | --package | -p?* | --package=*) workspace=() ;;
    esac
done

cd "$ROOT"
log "RUST_BACKTRACE=1 cargo test${workspace[*]:+ ${workspace[*]}} --all-targets${*:+ $*}"
status=0
RUST_BACKTRACE=1 cargo test "${workspace[@]}" --all-targets --no-fail-fast "$@" || status=$?
if [[ $status -ne 0 ]]; then
    printf 'error: cargo test failed (exit %s); read the failures above and rerun e.g. scripts/test.sh -p CRATE TEST_NAME\n' "$status" >&2
fi
exit "$status"
