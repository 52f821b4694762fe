#!/usr/bin/env bash
# Claims under concurrency: the HTTP stack (poolmgr-local) against the same claim statement
# run directly by pgbench on the same database — the ceiling this machine allows.
#
#   scripts/bench-claims.sh [options]
#
# For every concurrency level and mode (claim, replay, release) the pool is emptied and seeded
# with --vms AVAILABLE rows, the load runs for --duration seconds (HTTP: after --warmup
# seconds), and the database is checked: no VM leased twice, exactly the leases the clients
# got. Results go to a JSON-lines file; at the end docs/benchmarks.md's generated section and
# docs/bench-claims.svg are rewritten from them.
#
# Options:
#   --levels "1 4 16 64 256"   concurrency levels
#   --modes "claim replay release"
#   --duration S               seconds per run (default 10)
#   --warmup S                 HTTP warm-up seconds, not counted (default 1)
#   --vms N                    AVAILABLE VMs seeded before each run (default 60000)
#   --label NAME               name of this run in the results (default "current")
#   --results FILE             results file (default .dev/bench-claims/results.jsonl)
#   --append                   keep earlier results in FILE (for before/after tables)
#   --no-docs                  do not rewrite docs/benchmarks.md and the chart
#   --poolmgr-local BIN        use this poolmgr-local (e.g. a baseline build) instead of ours
#   --claim-sql FILE           pgbench script for claims instead of ours (pair with the above)
#   --pgbench-protocol P       prepared (default: what poolmgr-local does with
#                              POOLMGR_DB_PREPARE_CLAIM=true) or extended (one unnamed
#                              statement per claim, planned every time: a baseline before it)
#
# Environment: POOLMGR_DB_POOL_SIZE (poolmgr-local's connections, default 16), PG_BINDIR.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

LEVELS="1 4 16 64 256"
MODES="claim replay release"
DURATION=10
WARMUP=1
VMS=60000
LABEL=current
WORK=$ROOT/.dev/bench-claims
RESULTS=$WORK/results.jsonl
APPEND=0
DOCS=1
LOCAL_BIN=""
CLAIM_SQL=""
PROTOCOL=prepared
while [[ $# -gt 0 ]]; do
    case "$1" in
        --levels) LEVELS=$2; shift 2 ;;
        --modes) MODES=$2; shift 2 ;;
        --duration) DURATION=$2; shift 2 ;;
        --warmup) WARMUP=$2; shift 2 ;;
        --vms) VMS=$2; shift 2 ;;
        --label) LABEL=$2; shift 2 ;;
        --results) RESULTS=$2; shift 2 ;;
        --append) APPEND=1; shift ;;
        --no-docs) DOCS=0; shift ;;
        --poolmgr-local) LOCAL_BIN=$2; shift 2 ;;
        --claim-sql) CLAIM_SQL=$2; shift 2 ;;
        --pgbench-protocol) PROTOCOL=$2; shift 2 ;;
        -h | --help) sed -n '2,29p' "$0"; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

PGBENCH=""
for c in "$(pg_bindir 2>/dev/null || true)/pgbench" "$(command -v pgbench || true)"; do
    [[ -x "$c" ]] && { PGBENCH=$c; break; }
done
[[ -n $PGBENCH ]] || die "pgbench not found; install the PostgreSQL client tools (postgresql-15 ships it) or set PG_BINDIR"

mkdir -p "$WORK"
[[ $APPEND == 1 ]] || rm -f "$RESULTS"

log "building release binaries (poolmgr-local, poolmgr-bench, flintlock-sim)"
stack_build release -q -p poolmgr-local -p poolmgr-bench -p flintlock-sim
BIN=$STACK_BIN
LOCAL_BIN=${LOCAL_BIN:-$BIN/poolmgr-local}
BENCH=$BIN/poolmgr-bench

stack_pg_fresh "$WORK/pg"
DB_URL=$(pg_create_db poolmgr_bench)
PSQL=("$PG_BINDIR/psql" -X -q -At -v ON_ERROR_STOP=1 -d "$DB_URL")

SIM_PORT=$(free_port)
log "starting flintlock-sim on 127.0.0.1:$SIM_PORT (releases delete through it)"
: >"$WORK/flintlock-sim.log"
RUST_LOG=warn stack_sim_start "$WORK/flintlock-sim.log" --listen "127.0.0.1:$SIM_PORT" --delete-delay-ms 0

PORT=$(free_port)
TOKEN=bench-$(random_token)
POOL_SIZE=${POOLMGR_DB_POOL_SIZE:-16}
URL=http://127.0.0.1:$PORT
# (Re)starts poolmgr-local, its reconcile passes doing nothing (deadline 0: the seeded pool is
# larger than a pool may be, and a pass would shed the surplus). Each HTTP run gets a fresh process: a pooled connection that
# prepared the claim before the reseeding's ANALYZE of the emptied tables keeps a plan built
# for empty tables until autovacuum analyzes them again (a minute or more; docs/benchmarks.md),
# which is not the steady state this benchmark measures.
start_local() {
    stack_stop "${APP_PID:-}"
    DATABASE_URL=$DB_URL POOLMGR_ADMIN_TOKENS=bench:$TOKEN RUST_LOG=warn \
        POOLMGR_DB_POOL_SIZE=$POOL_SIZE POOLMGR_RECONCILE_INTERVAL_SECONDS=86400 POOLMGR_RECONCILE_DEADLINE_SECONDS=0 \
        stack_app_start --bin "$LOCAL_BIN" "127.0.0.1:$PORT" "$WORK/poolmgr-local.log"
}
log "starting $LOCAL_BIN on 127.0.0.1:$PORT (database pool $POOL_SIZE, reconcile ticker effectively off)"
: >"$WORK/poolmgr-local.log"
start_local

api() { curl -fsS -o /dev/null -H "Authorization: Bearer $TOKEN" -H 'content-type: application/json' "$@"; }
log "registering the simulator as host bench-host and creating pool default/bench"
stack_register_host "$URL" "$TOKEN" bench-host "127.0.0.1:$SIM_PORT"
# The pool's size is capped at 10000; the seeded rows may exceed it since no pass runs.
api -X POST "$URL/v1/pools" -d '{"name": "bench", "size": '"$((VMS < 10000 ? VMS : 10000))"', "replenishment": {"strategy": "REPLACE_ON_DELETE"},
      "microvm_template": {"root_volume": {"id": "root", "source": {"container_source": "img"}}, "interfaces": [{"device_id": "eth1"}]}}' ||
    die "could not create the pool; see $WORK/poolmgr-local.log"

"$BENCH" pgbench-script --mode claim >"$WORK/claim.sql"
"$BENCH" pgbench-script --mode replay >"$WORK/replay.sql"
[[ -n $CLAIM_SQL ]] && cp "$CLAIM_SQL" "$WORK/claim.sql"

seed() { "$BENCH" claims-seed --database-url "$DB_URL" --vms "$VMS"; }
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
T0=$SECONDS
for c in $LEVELS; do
    for mode in $MODES; do
        log "[$LABEL] HTTP $mode, $c clients, ${DURATION}s (+${WARMUP}s warm-up)"
        seed
        start_local
        got=$("$BENCH" claims-load --endpoint "$URL" --token "$TOKEN" --concurrency "$c" --duration-secs "$DURATION" \
            --warmup-secs "$WARMUP" --mode "$mode" --label "$LABEL" --out "$RESULTS" --server-pid "$APP_PID")
        case $mode in
            claim) "$BENCH" claims-verify --database-url "$DB_URL" --expect-leases "$got" ;;
            replay) "$BENCH" claims-verify --database-url "$DB_URL" --expect-leases "$c" ;;
            release) "$BENCH" claims-verify --database-url "$DB_URL" ;;
        esac
        [[ $mode == release ]] && continue

        log "[$LABEL] pgbench $mode, $c clients, ${DURATION}s"
        seed
        rm -f "$WORK"/pgb.*
        threads=$((c < 2 ? c : 2))
        # CPU accounting: the machine's busy time around pgbench, and pgbench's own (bash's time).
        read -r cpu0 pg0 < <("$BENCH" machine-cpu-ms)
        status=0
        TIMEFORMAT='%U %S'
        { time "$PGBENCH" -n -M "$PROTOCOL" -c "$c" -j "$threads" -T "$DURATION" \
            -D ns=default -D pool=bench -D principal=bench -f "$WORK/$mode.sql" \
            --log --log-prefix="$WORK/pgb" "$DB_URL" >"$WORK/pgbench.out" 2>&1; } 2>"$WORK/pgbench.time" || status=$?
        read -r cpu1 pg1 < <("$BENCH" machine-cpu-ms)
        if [[ $status -ne 0 ]]; then
            tail -n 20 "$WORK/pgbench.out" >&2
            die "pgbench failed (exit $status); its output is above and in $WORK/pgbench.out"
        fi
        client_ms=$(awk '{printf "%.0f", ($1 + $2) * 1000}' "$WORK/pgbench.time")
        got=$("$BENCH" pgbench-summary --log-prefix "$WORK/pgb" --concurrency "$c" --duration-secs "$DURATION" \
            --mode "$mode" --label "$LABEL" --out "$RESULTS" \
            --machine-cpu-ms "$((cpu1 - cpu0))" --client-cpu-ms "$client_ms" --postgres-cpu-ms "$((pg1 - pg0))")
        case $mode in
            claim) "$BENCH" claims-verify --database-url "$DB_URL" --expect-leases "$got" ;;
            replay) "$BENCH" claims-verify --database-url "$DB_URL" --expect-leases "$c" ;;
        esac
    done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
log "all runs done in $((SECONDS - T0)) s; results in $RESULTS"

if grep -q '"429"' "$RESULTS"; then
    log "warning: some runs found the pool empty (HTTP 429); rerun with a larger --vms"
fi

if [[ $DOCS == 1 ]]; then
    cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
    mem=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
    pgv=$("${PSQL[@]}" -c 'SHOW server_version')
    MACHINE="$(nproc) vCPU ($cpu), $mem RAM, Linux $(uname -r), PostgreSQL $pgv, $(rustc --version | cut -d' ' -f1-2); \
load average $LOAD_START before the runs, $LOAD_END after; $(date -u +%Y-%m-%d)."
    SETTINGS="Each run: ${DURATION} s (HTTP after ${WARMUP} s of warm-up), pool reseeded with $VMS AVAILABLE VMs and \
vacuumed before it. PostgreSQL: a private cluster with default settings (fsync and synchronous_commit on) except \
max_connections = 400. HTTP: release-built poolmgr-local (database pool $POOL_SIZE connections, POOLMGR_DB_PREPARE_CLAIM \
${POOLMGR_DB_PREPARE_CLAIM:-true}) and the Rust load \
generator (\`poolmgr-bench claims-load\`, reqwest, one keep-alive connection per client) on the same machine. \
pgbench: \`-M $PROTOCOL -j 2\` running \
\`poolmgr-bench pgbench-script\`, i.e. \`store::LEASE_CLAIM_SQL\` with pgbench variables. Latencies are per \
operation as the client sees them. CPU per operation: the machine's busy time (/proc/stat) over the timed \
window, the client's, poolmgr-local's and all postgres processes' own (/proc/PID/stat, exited backends included); \
the rest is time no process is charged with (the kernel's network softirqs) and other processes (pgbench's window \
also covers its connection set-up). After every run the database is checked: no VM leased twice, every LEASED VM \
with exactly one lease, exactly as many leases and VM_CLAIMED events as the clients were given."
    "$BENCH" claims-report --results "$RESULTS" --label "$LABEL" --machine "$MACHINE" --settings "$SETTINGS" \
        --doc "$ROOT/docs/benchmarks.md" --svg "$ROOT/docs/bench-claims.svg"
fi
