#!/usr/bin/env bash
# Cold starts of the Lambda functions, as AWS runs them:
#
#   scripts/bench-cold-start.sh [RUNS]      (default 7)
#
# Builds the release binaries and prints each function's size, starts a private PostgreSQL
# (.dev/cold-start-pg, fsync on) and flintlock-sim, migrates, then starts every function RUNS
# times as a fresh execution environment under lambda-emu: an emulated Lambda Runtime API, and
# an emulated Parameters and Secrets extension that serves the database and tokens secrets
# only once the function asked for its first event (as AWS's does). A run's time is from
# process start to the function's first answer: secrets read, configuration, the first
# database connection (loopback) with its schema check, and the request itself. The claims
# and reconcile functions also answer a second, warm event in the same process. Prints each
# run (with its INIT: process start to the first /next), the median per function, and the
# table of docs/deploy.md ("Lifecycle and cold starts").
#
# Requests: hosts POST /v1/hosts, pools POST /v1/pools (size 1; one host and one pool are kept
# afterwards), reconcile the Scheduler's event (a whole pass over that pool against
# flintlock-sim; the first run creates its VM), claims POST /v1/claims on seeded AVAILABLE
# VMs, leases GET /v1/leases, events GET /v1/events. Function logs (RUST_LOG=info, the
# template's default) go to .dev/cold-start/functions.log.
#
# Timings on a machine busy with other work are upper bounds: run it on a quiet one (the
# warm claim, a few ms at most on an idle 2-vCPU machine, shows how busy it was).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

RUNS=${1:-7}
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "usage: scripts/bench-cold-start.sh [RUNS] (a positive number, default 7)"
WORK=$ROOT/.dev/cold-start
FUNCTIONS=(claims leases pools hosts events reconcile)
mkdir -p "$WORK"
rm -f "$WORK"/*.json "$WORK/functions.log"

cd "$ROOT"
log "building release binaries (the six functions, migrate, flintlock-sim, lambda-emu); the first build takes minutes"
bins=()
for f in "${FUNCTIONS[@]}" migrate flintlock-sim lambda-emu; do bins+=(--bin "$f"); done
stack_build release -q "${bins[@]}"
BIN=$STACK_BIN

# --- sizes ---------------------------------------------------------------------------
# As built, and deflated (about what Lambda fetches: the zip of the bootstrap).
declare -A SIZE ZIPPED
for f in "${FUNCTIONS[@]}"; do
    read -r size zipped < <(python3 -c '
import os, sys, zlib
data = open(sys.argv[1], "rb").read()
print(f"{len(data) / 1048576:.1f} {len(zlib.compress(data, 9)) / 1048576:.1f}")' "$BIN/$f")
    SIZE[$f]=$size
    ZIPPED[$f]=$zipped
    log "$f: $BIN/$f is ${SIZE[$f]} MiB (${ZIPPED[$f]} MiB deflated)"
done

# --- PostgreSQL, flintlock-sim ---------------------------------------------------------
stack_pg_fresh "$ROOT/.dev/cold-start-pg"
DB_URL=$(pg_create_db poolmgr) || die "could not create database poolmgr"
log "migrating $DB_URL"
DATABASE_URL=$DB_URL "$BIN/migrate" >"$WORK/migrate.log" 2>&1 || {
    show_log_tail "$WORK/migrate.log"
    die "migrate failed"
}
stack_sim_start "$WORK/flintlock-sim.log" --listen 127.0.0.1:0 --boot-delay-ms 100 --delete-delay-ms 20

# --- secrets and environment, as infra/template.yaml sets them ---------------------------
ADMIN=cold-admin-$(random_token)
CLIENT=cold-client-$(random_token)
DB_ARN=arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/db-AbCdEf
TOKENS_ARN=arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/tokens-XyZ123
# RDS's shape; its host is the instance, which the functions never use: the POOLMGR_DATABASE_*
# overrides point them at the proxy (here the private PostgreSQL).
printf '{"engine": "postgres", "username": "postgres", "password": "", "host": "poolmgr-db.abcdefghijkl.eu-west-1.rds.amazonaws.com", "port": 5432, "dbname": "postgres"}' >"$WORK/db-secret.json"
printf '{"admin_tokens": "admin:%s", "client_tokens": "ci:%s"}' "$ADMIN" "$CLIENT" >"$WORK/tokens-secret.json"
COMMON=(
    --secret "$DB_ARN=$WORK/db-secret.json" --secret "$TOKENS_ARN=$WORK/tokens-secret.json"
    --env "POOLMGR_DATABASE_SECRET_ARN=$DB_ARN" --env "POOLMGR_TOKENS_SECRET_ARN=$TOKENS_ARN"
    --env POOLMGR_DATABASE_HOST=127.0.0.1 --env "POOLMGR_DATABASE_PORT=$PG_PORT" --env POOLMGR_DATABASE_NAME=poolmgr
    --env RUST_LOG=info --runs "$RUNS" --log "$WORK/functions.log"
    # The seeded rows have no microVMs: the claims measured are the one-statement ones.
    --env POOLMGR_CLAIM_VERIFY=off
)

# event FILE METHOD PATH TOKEN [BODY]: an API Gateway HTTP API event into FILE.
event() {
    local file=$1 method=$2 path=$3 token=$4 body=${5:-}
    "$BIN/lambda-emu" http-event "$method" "$path" --header "authorization: Bearer $token" \
        ${body:+--body "$body"} >"$WORK/$file" || die "lambda-emu http-event failed"
}
TEMPLATE='{"kernel": {"image": "ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77", "filename": "boot/vmlinux"},
  "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
  "interfaces": [{"device_id": "eth1", "type": "TAP"}]}'
event hosts.json POST /v1/hosts "$ADMIN" "{\"name\": \"cold-{run}\", \"address\": \"$SIM_ADDR\", \"tls\": {\"insecure\": true}}"
event pools.json POST /v1/pools "$ADMIN" "{\"namespace\": \"default\", \"name\": \"cold-{run}\", \"size\": 1,
  \"flintlock_hosts\": [\"cold-1\"], \"replenishment\": {\"strategy\": \"REPLACE_ON_DELETE\"}, \"microvm_template\": $TEMPLATE}"
event claims.json POST /v1/claims "$CLIENT" '{"pool": {"namespace": "default", "name": "cold-1"}, "request_id": "cold-{run}-{ulid}"}'
cp "$WORK/claims.json" "$WORK/claims-warm.json"
event leases.json GET '/v1/leases?page_size=10' "$CLIENT"
event events.json GET '/v1/events?limit=10' "$ADMIN"
cp functions/reconcile/events/scheduled.json "$WORK/reconcile.json"

# seed_claims: 2 AVAILABLE VMs per run in pool default/cold-1, as rows (with
# POOLMGR_CLAIM_VERIFY=off a claim never calls flintlock); no reconcile pass runs after this, so none is shed.
seed_claims() {
    local n=$((2 * RUNS))
    "$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d "$DB_URL" -c "
        INSERT INTO vms (id, uid, pool_namespace, pool_name, flintlock_host, phase, network_interfaces)
        SELECT 'seeded-' || g, 'UID' || g, 'default', 'cold-1', 'cold-1', 'AVAILABLE',
               '{\"eth1\": {\"host_device_name\": \"fltap0000001\", \"index\": 3, \"mac_address\": \"aa:bb:cc:dd:ee:ff\"}}'
        FROM generate_series(1, $n) g;" -c "VACUUM ANALYZE;" >/dev/null ||
        die "seeding AVAILABLE VMs failed (has the vms table changed? see the INSERT above)"
}

# --- the runs -------------------------------------------------------------------------------
declare -A MEDIAN WARM
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for f in hosts pools reconcile claims leases events; do
    events=(--event "$WORK/$f.json")
    extra=()
    case $f in
        claims)
            seed_claims
            events+=(--event "$WORK/claims-warm.json")
            ;;
        reconcile)
            extra=(--env POOLMGR_DB_POOL_SIZE=4)
            events+=(--event "$WORK/reconcile.json")
            ;;
    esac
    "$BIN/lambda-emu" cold-start --bin "$BIN/$f" "${COMMON[@]}" "${extra[@]}" "${events[@]}" | tee "$WORK/$f.out" ||
        die "the $f function failed; its log is in $WORK/functions.log"
    MEDIAN[$f]=$(sed -n 's/^median_ms=//p' "$WORK/$f.out")
    case $f in
        # Every host registered points at the one simulator: keep one, or each would see the
        # others' VMs as its orphans.
        hosts) keep="DELETE FROM hosts WHERE name <> 'cold-1'" ;;
        # The reconcile runs work on one pool of one VM, whatever RUNS is.
        pools) keep="DELETE FROM pools WHERE name <> 'cold-1'" ;;
        *) keep="" ;;
    esac
    if [[ -n $keep ]]; then
        "$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d "$DB_URL" -c "$keep" || die "could not run: $keep"
    fi
    if [[ $f == claims || $f == reconcile ]]; then
        WARM[$f]=$(python3 -c '
import re, statistics, sys
w = [float(m) for m in re.findall(r"then warm ([0-9.]+) ms", open(sys.argv[1]).read())]
print(f"{statistics.median(w):.1f}")' "$WORK/$f.out")
    fi
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
mem=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
echo
echo "Measured $(date -u +%Y-%m-%d) with scripts/bench-cold-start.sh $RUNS: $(nproc) vCPU ($cpu), $mem RAM,"
echo "Linux $(uname -r), $(rustc --version | cut -d' ' -f1-2), x86_64 release build; load average $LOAD_START before, $LOAD_END after."
echo
echo "| function | binary, deflated (MiB) | cold start, median of $RUNS (ms) | request |"
echo "|---|---:|---:|---|"
for f in "${FUNCTIONS[@]}"; do
    case $f in
        claims) what="POST /v1/claims (then a warm claim: ${WARM[claims]} ms)" ;;
        leases) what="GET /v1/leases" ;;
        pools) what="POST /v1/pools" ;;
        hosts) what="POST /v1/hosts" ;;
        events) what="GET /v1/events" ;;
        reconcile)
            start=$(sed -n 's/^median_start_ms=//p' "$WORK/reconcile.out")
            what="the Scheduler's event: one pass over one pool of one VM on flintlock-sim (run 1 creates the VM), $start ms of it not in the pass's own duration_ms (then a warm pass: ${WARM[reconcile]} ms)"
            ;;
    esac
    echo "| $f | ${SIZE[$f]}, ${ZIPPED[$f]} | ${MEDIAN[$f]} | $what |"
done
