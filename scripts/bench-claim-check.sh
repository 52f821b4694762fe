#!/usr/bin/env bash
# What the claim's check costs (issue 23 finding 1, POOLMGR_CLAIM_VERIFY): the same claims
# with the check on (a GetMicroVM on the two-phase path) and off (the one-statement claim),
# one run after the other on one private PostgreSQL (fsync on), through the HTTP stack of an
# in-process server whose pool the real reconciler filled on an in-process flintlock-sim
# (gRPC over loopback).
#
#   scripts/bench-claim-check.sh [CLIENTS] [CLAIMS_PER_CLIENT]     (default: 1 500, then 16 x 40)
#
# Prints one line per run: latency percentiles, throughput, the CPU per claim of the bench
# process (HTTP server, claim code and simulator; PostgreSQL's is not in it) and the
# GetMicroVM calls the claims made.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
DIR=$ROOT/.dev/bench-pg
log "building release poolmgr-bench"
stack_build release -q -p poolmgr-bench
BIN=$STACK_BIN
stack_pg_fresh "$DIR"
runs=("${1:-1} ${2:-500}")
[[ $# -eq 0 ]] && runs+=("16 40")
for run in "${runs[@]}"; do
    read -r clients per <<<"$run"
    for verify in on off; do
        url=$(pg_create_db "poolmgr_bench_check_${verify}_${clients}")
        log "$clients client(s) x $per claims, POOLMGR_CLAIM_VERIFY=$verify"
        DATABASE_URL=$url RUST_LOG=warn POOLMGR_CLAIM_VERIFY=$verify \
            "$BIN/poolmgr-bench" hook-claims --clients "$clients" --claims-per-client "$per" --hook-ms 0
    done
done
