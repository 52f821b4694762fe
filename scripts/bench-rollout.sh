#!/usr/bin/env bash
# Issue 24's rollout scenarios, in real time: a 50-VM pool on an in-process flintlock-sim
# (a fixed boot time), the real reconciler on the local shape's 2 s ticker, clients calling the
# service in process (poolmgr-bench rollout; see functions/poolmgr-bench/src/rollout.rs).
#
#   scripts/bench-rollout.sh [BOOT_MS]     (default 2000; about 18 minutes)
#   SCENARIOS="busy-any idle" scripts/bench-rollout.sh     (some of them)
#
#   busy    0.5 claims/s, each VM held 30 s, the template changed after 130 s of warm-up (the
#           rollout's 120 s window of claims behind it, as a pool at a steady rate has), and
#           the same trace without a change: rollout_seconds, extra_boots, leases_disrupted,
#           warm_hit_delta_pp (claim_preference CURRENT, the default)
#   busy-any  the same with claim_preference ANY: claims consume stale VMs too
#   idle    no claims: rollout_seconds, min_available
#   broken  a template whose VMs end FAILED: failed_vms before the halt, healthy_vms_retired,
#           min_available, state (ROLLED_BACK)
#
# One JSON line per scenario on stdout and in docs/bench-rollout-results.jsonl.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
BOOT_MS=${1:-2000}
DIR=$ROOT/.dev/bench-pg
OUT=$ROOT/docs/bench-rollout-results.jsonl
log "building release poolmgr-bench"
stack_build release -q -p poolmgr-bench
BIN=$STACK_BIN
stack_pg_fresh "$DIR"
for scenario in ${SCENARIOS:-idle broken busy busy-any}; do
    url=$(pg_create_db "poolmgr_bench_rollout_${scenario//-/_}")
    extra=()
    if [[ $scenario == busy* ]]; then
        extra=(--baseline-url "$(pg_create_db "poolmgr_bench_rollout_baseline_${scenario//-/_}")")
    fi
    log "scenario $scenario (boot $BOOT_MS ms)"
    DATABASE_URL=$url RUST_LOG=warn POOLMGR_RECONCILE_INTERVAL_SECONDS=2 \
        "$BIN/poolmgr-bench" rollout --scenario "$scenario" --boot-ms "$BOOT_MS" --out "$OUT" "${extra[@]}"
done
log "results appended to $OUT"
