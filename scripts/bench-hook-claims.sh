#!/usr/bin/env bash
# Claim latency with a pre-lease hook: CLIENTS concurrent clients claiming from a pool whose
# pre_lease_commands take HOOK_MS in the (simulated) guest, through the HTTP stack.
#
#   scripts/bench-hook-claims.sh [CLIENTS] [HOOK_MS]     (default: 16 200)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/pg.sh
. "$ROOT/scripts/lib/pg.sh"
log() { printf '==> %s\n' "$*" >&2; }
DIR=$ROOT/.dev/bench-pg
trap 'pg_stop "$DIR" || true' EXIT
log "building release poolmgr-bench"
cargo build --release -q -p poolmgr-bench
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
rm -rf "$DIR"
pg_start "$DIR"
url=$(pg_create_db poolmgr_bench_hooks)
DATABASE_URL=$url RUST_LOG=warn "$BIN/poolmgr-bench" hook-claims --clients "${1:-16}" --hook-ms "${2:-200}"
