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
# A second private server, TLS-only (ssl = on, a certificate for localhost signed by a CA
# generated for this run, a pg_hba.conf with hostssl lines only), is started under
# .dev/test-pg-tls for the TLS tests (tests/tests/api/db_tls.rs) when poolmgr-tests is among
# the packages tested; its port and CA are exported as POOLMGR_TEST_TLS_PG_PORT and
# POOLMGR_TEST_TLS_CA_PEM. Set both yourself to use another such server.
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

# Rust (rustup's, at least the workspace's rust-version), cc, curl, kill, python3 and, unless
# POOLMGR_TEST_DATABASE_URL is set, the PostgreSQL server binaries (scripts/lib/preflight.sh).
preflight test || die "install what is listed above and rerun scripts/test.sh"

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
packages=()
cargo_args=()
prev=
for arg in "$@"; do
    [[ $arg == -- ]] && break
    cargo_args+=("$arg")
    case "$arg" in
        -p | --package) workspace=() ;;
        -p?*) workspace=() packages+=("${arg#-p}") ;;
        --package=*) workspace=() packages+=("${arg#--package=}") ;;
        *) [[ $prev == -p || $prev == --package ]] && packages+=("$arg") ;;
    esac
    prev=$arg
done
tls_tests=0
if [[ ${#workspace[@]} -gt 0 || " ${packages[*]} " == *" poolmgr-tests "* ]]; then
    tls_tests=1
fi

cd "$ROOT"
# Built first (the same selection, so nothing is built twice): the TLS server's certificates
# come from one of the test binaries (tests/src/bin/pg-test-certs.rs).
log "building: cargo test${workspace[*]:+ ${workspace[*]}} --all-targets --no-run${cargo_args[*]:+ ${cargo_args[*]}}"
cargo test "${workspace[@]}" --all-targets --no-run "${cargo_args[@]}" ||
    die "the build failed; fix the errors above and rerun scripts/test.sh"

if [[ $tls_tests == 1 && -z "${POOLMGR_TEST_TLS_PG_PORT:-}" ]]; then
    TLS_DIR=$ROOT/.dev/test-pg-tls
    exec 8>"$ROOT/.dev/test-pg-tls.lock"
    if command -v flock >/dev/null 2>&1 && ! flock -n 8; then
        TLS_DIR=$ROOT/.dev/test-pg-tls-$$
        log "another scripts/test.sh is running here; using $TLS_DIR for the TLS server"
        at_exit rm -rf "$TLS_DIR"
    fi
    certs=$TLS_DIR/certs
    rm -rf "$certs"
    log "generating a CA and a certificate for localhost in $certs"
    "${CARGO_TARGET_DIR:-$ROOT/target}/debug/pg-test-certs" "$certs" ||
        die "could not generate the TLS test certificates (see above)"
    cat >"$certs/pg_hba.conf" <<'HBA'
# TCP clients only over TLS: no `host` line, so a plaintext client finds no entry.
hostssl all all 127.0.0.1/32 trust
hostssl all all ::1/128 trust
HBA
    if [[ $(id -u) -eq 0 ]]; then
        pg_own_dir "$certs" || die "cannot hand $certs to the postgres user"
    fi
    log "starting the TLS-only test server (ssl = on, hostssl only)"
    PG_FAST=1 PG_OPTS="-c ssl=on -c ssl_cert_file='$certs/server.crt' -c ssl_key_file='$certs/server.key' -c hba_file='$certs/pg_hba.conf'" \
        stack_pg_fresh "$TLS_DIR/pg" "or set POOLMGR_TEST_TLS_PG_PORT and POOLMGR_TEST_TLS_CA_PEM to use another TLS server" 8>&- 9>&-
    export POOLMGR_TEST_TLS_PG_PORT=$PG_PORT POOLMGR_TEST_TLS_CA_PEM=$certs/ca.pem
    log "POOLMGR_TEST_TLS_PG_PORT=$POOLMGR_TEST_TLS_PG_PORT POOLMGR_TEST_TLS_CA_PEM=$POOLMGR_TEST_TLS_CA_PEM"
fi

# The integration suite's lambda_lifecycle tests run the claims and reconcile binaries as Lambda
# does; `cargo test` builds no other package's binaries, so build them first.
if [[ $tls_tests == 1 ]]; then
    profile=()
    [[ " ${cargo_args[*]} " == *" --release "* ]] && profile=(--release)
    log "cargo build${profile[*]:+ ${profile[*]}} --bin claims --bin reconcile --bin migrate (run by the lambda_lifecycle tests)"
    cargo build "${profile[@]}" --bin claims --bin reconcile --bin migrate ||
        die "building the claims and reconcile functions failed; fix the errors above"
fi

log "RUST_BACKTRACE=1 cargo test${workspace[*]:+ ${workspace[*]}} --all-targets${*:+ $*}"
status=0
RUST_BACKTRACE=1 cargo test "${workspace[@]}" --all-targets --no-fail-fast "$@" || status=$?
# --all-targets leaves doctests out: compile the documentation examples meant to compile (the
# client's crate-level example) when the whole workspace or that crate is tested.
doc=(${workspace[*]:+poolmgr-client})
for arg in "$@"; do
    [[ $arg == -- ]] && break
    [[ $arg == poolmgr-client || $arg == --package=poolmgr-client || $arg == -ppoolmgr-client ]] && doc=(poolmgr-client)
done
if [[ ${#doc[@]} -gt 0 ]]; then
    log "cargo test --doc -p ${doc[*]}"
    cargo test --doc -p "${doc[@]}" || status=$?
fi
if [[ $status -ne 0 ]]; then
    err "cargo test failed (exit $status); read the failures above and rerun e.g. scripts/test.sh -p CRATE TEST_NAME"
fi
exit "$status"
