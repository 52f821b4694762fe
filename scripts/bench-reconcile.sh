#!/usr/bin/env bash
# Time of reconcile passes against flintlock-sim: POOLS pools of VMS VMs each, filled from
# empty by passes alone, then the time of a settled pass (nothing left to do).
#
#   scripts/bench-reconcile.sh [POOLS VMS]...   (default: 100 20)
#   scripts/bench-reconcile.sh 100 20 1000 10
#
# Release build, private PostgreSQL (fsync on), simulator in-process (boot delay 50 ms).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
DIR=$ROOT/.dev/bench-pg
[[ $# -eq 0 ]] && set -- 100 20

log "building release poolmgr-bench"
stack_build release -q -p poolmgr-bench
BIN=$STACK_BIN
stack_pg_fresh "$DIR"
while [[ $# -ge 2 ]]; do
    pools=$1 vms=$2
    shift 2
    db=poolmgr_bench_${pools}x${vms}
    url=$(pg_create_db "$db")
    log "reconcile: $pools pools x $vms VMs"
    DATABASE_URL=$url RUST_LOG=warn "$BIN/poolmgr-bench" reconcile --pools "$pools" --vms "$vms"
done
