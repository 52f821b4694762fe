#!/usr/bin/env bash
# Claim latency with a pre-lease hook: CLIENTS concurrent clients claiming from a pool whose
# pre_lease_commands take HOOK_MS in the (simulated) guest, through the HTTP stack.
#
#   scripts/bench-hook-claims.sh [CLIENTS] [HOOK_MS]     (default: 16 200)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
DIR=$ROOT/.dev/bench-pg
log "building release poolmgr-bench"
stack_build release -q -p poolmgr-bench
BIN=$STACK_BIN
stack_pg_fresh "$DIR"
url=$(pg_create_db poolmgr_bench_hooks)
DATABASE_URL=$url RUST_LOG=warn "$BIN/poolmgr-bench" hook-claims --clients "${1:-16}" --hook-ms "${2:-200}"
