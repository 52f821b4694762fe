#!/usr/bin/env bash
# Claims under concurrency, three ways on one database: the in-process path (one poolmgr-local
# with its own connection pool and the prepared claim), the deployed shape (the Lambda
# configuration: --processes poolmgr-local processes with one database connection each and
# POOLMGR_DB_PREPARE_CLAIM=false, behind PgBouncer in transaction mode, our RDS Proxy stand-in;
# the load generator spreads its clients over them), and the same claim statement run directly
# by pgbench — the ceiling this machine allows.
#
#   scripts/bench-claims.sh [options]
#
# For every concurrency level and mode (claim, replay, release) the pool is emptied and seeded
# with --vms AVAILABLE rows, the load runs for --duration seconds (HTTP: after --warmup
# seconds), and the database is checked: no VM leased twice, exactly the leases the clients
# got. The processes keep running from one run to the next, as a deployment's would. Then the
# "table emptied" series: for each HTTP path, --reseeds runs back to back at --reseed-clients,
# the pool reseeded (DELETE, INSERT, VACUUM ANALYZE) before each and the same processes kept.
# Results go to a JSON-lines file; at the end docs/benchmarks.md's generated section and
# docs/bench-claims.svg are rewritten from them, and the file is copied to
# docs/bench-claims-results.jsonl. A run that handed a VM out twice stops the script with the
# violation.
#
# Options:
#   --levels "1 4 16 64 256"   concurrency levels
#   --deployed-levels "16 64 256"  levels at which the deployed shape claims too ("" skips it)
#   --processes N              poolmgr-local processes of the deployed shape (default 16; PgBouncer
#                              gets as many server connections, as many as the in-process pool)
#   --reseed-clients C         clients of the "table emptied" series (default 64; 0 skips it)
#   --reseeds N                runs in that series (default 3)
#   --repeats N                claim runs per level and path (default 3): the paths take turns
#                              (in-process, deployed, pgbench, then again), the tables show each
#                              path's median run and the median of the ratios of the runs made in
#                              the same turn, so a drift of this shared machine's speed between
#                              turns stays out of the ratio
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
#   --pgbench-protocol P       prepared (default: what the in-process poolmgr-local does with
#                              POOLMGR_DB_PREPARE_CLAIM=true) or extended (one unnamed
#                              statement per claim: what the deployed shape sends)
#
# Environment: POOLMGR_DB_POOL_SIZE (the in-process poolmgr-local's connections, default 16),
# PG_BINDIR.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
# shellcheck source=lib/pgbouncer.sh
. "$ROOT/scripts/lib/pgbouncer.sh"

LEVELS="1 4 16 64 256"
DEPLOYED_LEVELS="16 64 256"
PROCESSES=16
RESEED_CLIENTS=64
RESEEDS=3
REPEATS=3
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
        --deployed-levels) DEPLOYED_LEVELS=$2; shift 2 ;;
        --processes) PROCESSES=$2; shift 2 ;;
        --reseed-clients) RESEED_CLIENTS=$2; shift 2 ;;
        --reseeds) RESEEDS=$2; shift 2 ;;
        --repeats) REPEATS=$2; shift 2 ;;
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
        -h | --help) sed -n '2,44p' "$0"; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

PGBENCH=""
for c in "$(pg_bindir 2>/dev/null || true)/pgbench" "$(command -v pgbench || true)"; do
    [[ -x "$c" ]] && { PGBENCH=$c; break; }
done
[[ -n $PGBENCH ]] || die "pgbench not found; install the PostgreSQL client tools (postgresql-15 ships it) or set PG_BINDIR"
[[ $PROCESSES =~ ^[1-9][0-9]*$ ]] || die "--processes must be a positive number, got '$PROCESSES'"
[[ $REPEATS =~ ^[1-9][0-9]*$ ]] || die "--repeats must be a positive number, got '$REPEATS'"
[[ $RESEED_CLIENTS =~ ^[0-9]+$ && $RESEEDS =~ ^[1-9][0-9]*$ ]] ||
    die "--reseed-clients must be a number (0 skips the series) and --reseeds a positive number"

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
# Only this cluster's processes count as PostgreSQL's CPU (others may run on the machine).
PM_PID=$(head -n 1 "$WORK/pg/data/postmaster.pid")

SIM_PORT=$(free_port)
log "starting flintlock-sim on 127.0.0.1:$SIM_PORT (releases delete through it)"
: >"$WORK/flintlock-sim.log"
RUST_LOG=warn stack_sim_start "$WORK/flintlock-sim.log" --listen "127.0.0.1:$SIM_PORT" --delete-delay-ms 0

PORT=$(free_port)
TOKEN=bench-$(random_token)
POOL_SIZE=${POOLMGR_DB_POOL_SIZE:-16}
URL=http://127.0.0.1:$PORT
# Every poolmgr-local runs its reconcile passes doing nothing (deadline 0: the seeded pool is
# larger than a pool may be, and a pass would shed the surplus). They all keep running to the
# end: a connection's kept plans surviving the reseeds is part of what is measured.
# POOLMGR_CLAIM_VERIFY=off: the seeded rows have no microVMs, and what is measured is the claim
# statement against pgbench's run of the same SQL (the checked claim's cost:
# scripts/bench-claim-latency.sh).
quiet_local() {
    DATABASE_URL=$1 POOLMGR_ADMIN_TOKENS=bench:$TOKEN RUST_LOG=warn POOLMGR_CLAIM_VERIFY=off \
        POOLMGR_RECONCILE_INTERVAL_SECONDS=86400 POOLMGR_RECONCILE_DEADLINE_SECONDS=0 \
        stack_app_start --bin "$LOCAL_BIN" "$2" "$3"
}
log "starting $LOCAL_BIN on 127.0.0.1:$PORT (database pool $POOL_SIZE, reconcile ticker effectively off)"
: >"$WORK/poolmgr-local.log"
POOLMGR_DB_POOL_SIZE=$POOL_SIZE quiet_local "$DB_URL" "127.0.0.1:$PORT" "$WORK/poolmgr-local.log"
LOCAL_PID=$APP_PID

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

# The deployed shape: PgBouncer in transaction mode with as many server connections as the
# in-process pool has, and PROCESSES poolmgr-local behind it, one connection each, the claim not
# prepared (PgBouncer 1.18 cannot keep a named statement; neither can RDS Proxy). Started one
# after another: each checks the schema at start, which is the only moment it prepares
# statements, and alone on PgBouncer it keeps its server connection for them.
DEPLOYED_URLS=""
DEPLOYED_PIDS=""
PGB_VERSION="PgBouncer (not run)"
if [[ -n ${DEPLOYED_LEVELS// /} || $RESEED_CLIENTS -gt 0 ]]; then
    PGB_VERSION=$("$(pgbouncer_find)" --version | head -n 1)
    pgbouncer_start "$WORK/pgbouncer" "$PG_PORT" "default_pool_size=$PROCESSES" "reserve_pool_size=0"
    POOLER_DB_URL="postgres://postgres@127.0.0.1:$PGB_PORT/poolmgr_bench"
    : >"$WORK/deployed.log"
    log "starting $PROCESSES poolmgr-local behind PgBouncer (one connection each, POOLMGR_DB_PREPARE_CLAIM=false; log: $WORK/deployed.log)"
    for i in $(seq 1 "$PROCESSES"); do
        # PgBouncer 1.18 may crash on tokio-postgres's cancel requests (db.rs, Limits).
        POOLMGR_DB_POOL_SIZE=1 POOLMGR_DB_PREPARE_CLAIM=false POOLMGR_DB_CANCEL_ON_TIMEOUT=false \
            quiet_local "$POOLER_DB_URL" "127.0.0.1:$(free_port)" "$WORK/deployed.log"
        DEPLOYED_URLS+="${DEPLOYED_URLS:+,}$APP_URL"
        DEPLOYED_PIDS+="${DEPLOYED_PIDS:+,}$APP_PID"
    done
fi

seed() { "$BENCH" claims-seed --database-url "$DB_URL" --vms "$VMS"; }
# http_run PATH CLIENTS MODE [claims-load args...]: one timed HTTP run on a freshly seeded pool
# through PATH's processes, then the database check.
http_run() {
    local path=$1 c=$2 mode=$3 got
    shift 3
    local target=(--endpoint "$URL" --server-pid "$LOCAL_PID")
    [[ $path == deployed ]] && target=(--endpoint "$DEPLOYED_URLS" --server-pid "$DEPLOYED_PIDS" --pooler-pid "$PGB_PID")
    seed
    got=$("$BENCH" claims-load "${target[@]}" --path "$path" --token "$TOKEN" --concurrency "$c" \
        --duration-secs "$DURATION" --warmup-secs "$WARMUP" --mode "$mode" --label "$LABEL" --out "$RESULTS" \
        --postmaster-pid "$PM_PID" "$@")
    case $mode in
        claim) "$BENCH" claims-verify --database-url "$DB_URL" --expect-leases "$got" ;;
        replay) "$BENCH" claims-verify --database-url "$DB_URL" --expect-leases "$c" ;;
        release) "$BENCH" claims-verify --database-url "$DB_URL" ;;
    esac
}
# pgbench_run CLIENTS MODE [SUFFIX]: the same statement straight on PostgreSQL through pgbench,
# on a freshly seeded pool, then the database check.
pgbench_run() {
    local c=$1 mode=$2 of=${3:-} threads status client_ms got cpu0 pg0 cpu1 pg1
    log "[$LABEL] pgbench $mode, $c clients, ${DURATION}s$of"
    seed
    rm -f "$WORK"/pgb.*
    threads=$((c < 2 ? c : 2))
    # CPU accounting: the machine's busy time around pgbench, and pgbench's own (bash's time).
    read -r cpu0 pg0 < <("$BENCH" machine-cpu-ms --postmaster-pid "$PM_PID")
    status=0
    TIMEFORMAT='%U %S'
    { time "$PGBENCH" -n -M "$PROTOCOL" -c "$c" -j "$threads" -T "$DURATION" \
        -D ns=default -D pool=bench -D principal=bench -f "$WORK/$mode.sql" \
        --log --log-prefix="$WORK/pgb" "$DB_URL" >"$WORK/pgbench.out" 2>&1; } 2>"$WORK/pgbench.time" || status=$?
    read -r cpu1 pg1 < <("$BENCH" machine-cpu-ms --postmaster-pid "$PM_PID")
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
}
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
T0=$SECONDS
for c in $LEVELS; do
    for mode in $MODES; do
        reps=1
        [[ $mode == claim ]] && reps=$REPEATS
        for rep in $(seq 1 "$reps"); do
            of=""
            [[ $reps -gt 1 ]] && of=" (repeat $rep of $reps)"
            log "[$LABEL] in-process HTTP $mode, $c clients, ${DURATION}s (+${WARMUP}s warm-up)$of"
            http_run http "$c" "$mode"
            if [[ $mode == claim && " $DEPLOYED_LEVELS " == *" $c "* ]]; then
                log "[$LABEL] deployed shape ($PROCESSES processes, PgBouncer) $mode, $c clients, ${DURATION}s (+${WARMUP}s warm-up)$of"
                http_run deployed "$c" "$mode"
            fi
            [[ $mode == release ]] || pgbench_run "$c" "$mode" "$of"
        done
    done
done
if [[ $RESEED_CLIENTS -gt 0 ]]; then
    for path in http deployed; do
        for round in $(seq 1 "$RESEEDS"); do
            log "[$LABEL] table emptied: $path, $RESEED_CLIENTS clients, run $round of $RESEEDS on the same processes"
            http_run "$path" "$RESEED_CLIENTS" claim --round "$round"
        done
    done
fi
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
vacuumed before it; the poolmgr-local processes keep running from the first run to the last. Claims: $REPEATS \
run(s) per level and path, the paths taking turns (in-process, deployed, pgbench, then again); a row shows each path's \
run with the median claims/s, and a ratio is the median of the ratios of the runs made in the same turn (their range \
in brackets), which keeps a drift of this shared machine's speed between turns out of the ratio, so a row's ratio \
need not equal the ratio of the throughputs it shows; its errors are those of every run. PostgreSQL: a private \
cluster with default settings (fsync and synchronous_commit on) except max_connections = 400. In-process: one \
release-built poolmgr-local (database pool $POOL_SIZE connections, POOLMGR_DB_PREPARE_CLAIM \
${POOLMGR_DB_PREPARE_CLAIM:-true}). Deployed: $PROCESSES release-built poolmgr-local with one database connection each \
and POOLMGR_DB_PREPARE_CLAIM false, behind $PGB_VERSION in transaction mode with \
$PROCESSES server connections; the load generator's clients spread over the processes round-robin. Load generator: \
\`poolmgr-bench claims-load\` (one keep-alive HTTP/1.1 connection per client, spoken by hand: one write per request, the \
response read on the client's own task, no HTTP library or connection pool in between; random UUID request_ids) on the same machine. pgbench: \`-M $PROTOCOL -j 2\` running \`poolmgr-bench pgbench-script\`, i.e. \`store::LEASE_CLAIM_SQL\` \
with pgbench variables. Latencies are per operation as the client sees them. CPU per operation: the machine's busy \
time (/proc/stat) over the timed window, the client's, the poolmgr-local processes', PgBouncer's and this cluster's \
postgres processes' own (/proc/PID/stat, exited backends included); the rest is time no process is charged with (the \
kernel's network softirqs) and other processes (pgbench's window also covers its connection set-up). After every run \
the database is checked: no VM leased twice, every LEASED VM with exactly one lease, exactly as many leases and \
VM_CLAIMED events as the clients were given."
    "$BENCH" claims-report --results "$RESULTS" --label "$LABEL" --machine "$MACHINE" --settings "$SETTINGS" \
        --doc "$ROOT/docs/benchmarks.md" --svg "$ROOT/docs/bench-claims.svg"
    cp "$RESULTS" "$ROOT/docs/bench-claims-results.jsonl"
    log "raw results copied to docs/bench-claims-results.jsonl"
fi
