#!/usr/bin/env bash
# Reconcile pass time against the number of pools (issue 15's growth series), in one run:
# for each POOLS VMS pair, pools of VMS VMs on HOSTS in-process flintlock-sims, filled from
# empty by passes alone, then five settled passes, then three passes with 1 % of the pools
# needing work, then poolmgr-check --settled's checks. Every error of a pass is printed.
#
#   scripts/bench-reconcile.sh [--hosts N] [POOLS VMS]...  (default: 10 10 100 10 1000 10 10000 10)
#   scripts/bench-reconcile.sh 100 20 1000 10
#
# Writes the results (docs/bench-reconcile-results.jsonl), their table into the generated
# section of docs/benchmarks.md and the chart docs/bench-reconcile.svg. Release build, private
# PostgreSQL (fsync on), a fresh database per size. 10,000 pools take a while (creating the
# pools alone is 10,000 API calls): run it in the background with its output in a file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
DIR=$ROOT/.dev/bench-pg
HOSTS=4
if [[ ${1:-} == --hosts ]]; then
    HOSTS=${2:?--hosts needs a number}
    shift 2
fi
[[ $# -eq 0 ]] && set -- 10 10 100 10 1000 10 10000 10
(( $# % 2 == 0 )) || die "arguments come in pairs: POOLS VMS"
RESULTS=$ROOT/docs/bench-reconcile-results.jsonl

log "building release poolmgr-bench"
stack_build release -q -p poolmgr-bench
BIN=$STACK_BIN
stack_pg_fresh "$DIR"
started=$(date -u '+%Y-%m-%d %H:%M UTC')
: >"$RESULTS"
while [[ $# -ge 2 ]]; do
    pools=$1 vms=$2
    shift 2
    db=poolmgr_bench_${pools}x${vms}
    url=$(pg_create_db "$db")
    log "reconcile: $pools pools x $vms VMs on $HOSTS hosts (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    DATABASE_URL=$url RUST_LOG=warn "$BIN/poolmgr-bench" reconcile --pools "$pools" --vms "$vms" \
        --hosts "$HOSTS" --out "$RESULTS"
done
machine="Run $started to $(date -u '+%H:%M UTC'): $(nproc) vCPU, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, \
$("$(pg_bindir)/postgres" --version 2>/dev/null || echo PostgreSQL), $(rustc --version | cut -d' ' -f1-2); \
default reconcile settings (POOLMGR_RECONCILE_CONCURRENCY 8, POOLMGR_RECONCILE_HOST_CONCURRENCY 4), database pool 32."
"$BIN/poolmgr-bench" reconcile-report --results "$RESULTS" --machine "$machine" \
    --doc "$ROOT/docs/benchmarks.md" --svg "$ROOT/docs/bench-reconcile.svg"
