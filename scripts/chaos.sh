#!/usr/bin/env bash
# Chaos scenarios, each followed by the invariant checker:  scripts/chaos.sh [--short]
# The fault campaign (network faults, a history checker):  scripts/chaos.sh --campaign N SECONDS [--seed S]
# (see scripts/lib/campaign.sh and docs/chaos.md).
#
#   1 pg-restart     PostgreSQL stopped (fast) for a few seconds under claim load through
#                    poolmgr-local: 503s with Retry-After while it is down, recovery without a
#                    restart, every lease a client believes it holds exists exactly once.
#   2 app-sigkill    poolmgr-local killed with SIGKILL under claims with request_ids and
#                    restarted; clients retry with the same ids: each ends with exactly one
#                    lease, and a replay of an answered claim returns the same lease.
#   3 sim-sigkill    flintlock-sim killed with SIGKILL while the reconciler provisions pools,
#                    restarted on the same port and state file: pools reach size, no orphan.
#   4 overlap        rounds of 8 overlapping in-process reconcile passes fill and grow pools:
#                    never above size, pools reach size, no orphan.
#   5 lost-answer    poolmgr-local restarted with its fault point on: every 3rd fresh claim on
#                    a pool with a pre-lease hook loses its answer after it committed; clients
#                    retry with the same ids and each loss comes back as a replay of its lease.
#
# Starts its own PostgreSQL under .dev/chaos (wiped first), flintlock-sim and poolmgr-local on
# free ports, and stops all of them on exit. Prints one summary line per scenario; exits 1 if
# any scenario or check failed. Logs: .dev/chaos/logs/. --short is the CI version (smaller
# load, shorter outages; ~2 minutes after the build).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

if [[ ${1:-} == --campaign ]]; then
    # The fault campaign (issue 23): scripts/chaos.sh --campaign N SECONDS [--seed S]
    [[ $# -eq 3 || ($# -eq 5 && $4 == --seed) ]] || die "usage: scripts/chaos.sh --campaign N SECONDS [--seed S]"
    # shellcheck source=lib/campaign.sh
    . "$ROOT/scripts/lib/campaign.sh"
    campaign_main "$2" "$3" "${5:-}"
    exit $?
fi

SHORT=0
for arg in "$@"; do
    case "$arg" in
        --short) SHORT=1 ;;
        -h | --help)
            sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            err "unknown argument $arg (use --short or nothing)"
            exit 2
            ;;
    esac
done

if [[ $SHORT == 1 ]]; then
    CLIENTS=6 DURATION=9s DOWN=3 POOL_SIZE=24 PROV_POOLS=2 PROV_SIZE=6 OV_POOLS=3 OV_SIZE=3 OV_GROW=6 HOOK_SIZE=12
else
    CLIENTS=16 DURATION=20s DOWN=6 POOL_SIZE=60 PROV_POOLS=4 PROV_SIZE=10 OV_POOLS=6 OV_SIZE=5 OV_GROW=10 HOOK_SIZE=32
fi
# Scenario 5: the answer of every LOSE_EVERY-th fresh claim is lost after it committed.
LOSE_EVERY=3

DIR=$ROOT/.dev/chaos
LOGS=$DIR/logs
SUMMARY=()
FAILED=0
T_START=$SECONDS

log "building poolmgr-local, flintlock-sim, poolmgr-check, poolmgr-chaos (debug)"
stack_build debug -q -p poolmgr-local -p flintlock-sim -p poolmgr-check
BIN=$STACK_BIN

# The old PostgreSQL stopped before the wipe: the logs directory is inside $DIR.
if [[ -d "$DIR/pg/data" ]]; then
    pg_stop "$DIR/pg" || die "could not stop the PostgreSQL of an earlier chaos run in $DIR/pg; kill it and remove $DIR"
fi
rm -rf "$DIR"
mkdir -p "$LOGS"
PG_FAST=1 stack_pg_fresh "$DIR/pg"
DB_URL=$(pg_create_db poolmgr_chaos)
export DATABASE_URL=$DB_URL
SIM_PORT=$(free_port)
APP_PORT=$(free_port)
ENDPOINT=http://127.0.0.1:$APP_PORT
ADMIN=chaos-admin-$(random_token)
CLIENT=chaos-client-$(random_token)
PSQL=("$PG_BINDIR/psql" -X -q -t -A -v ON_ERROR_STOP=1 -d "$DB_URL")

start_sim() {
    stack_sim_start --out "$LOGS/flintlock-sim.out" "$LOGS/flintlock-sim.log" --listen "127.0.0.1:$SIM_PORT" \
        --boot-delay-ms "${1:-400}" --delete-delay-ms 50 --state-file "$DIR/sim.state"
}

# A pass killed mid-pool leaves that pool's reconcile lease until it expires (deadline + hook
# timeout + 30 s): 45 s here instead of ~2 min by default, so scenario 2 recovers in time.
start_app() {
    DATABASE_URL=$DB_URL POOLMGR_ADMIN_TOKENS=admin:$ADMIN POOLMGR_CLIENT_TOKENS=chaos:$CLIENT \
        POOLMGR_RECONCILE_INTERVAL_SECONDS=1 POOLMGR_DB_CONNECT_TIMEOUT_SECONDS=2 \
        POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS=5 POOLMGR_FLINTLOCK_TIMEOUT_SECONDS=2 \
        POOLMGR_RECONCILE_DEADLINE_SECONDS=10 POOLMGR_HOOK_TIMEOUT_SECONDS=5 \
        POOLMGR_ORPHAN_SCAN_SECONDS=2 POOLMGR_RECONCILE_BACKOFF_MS=100 POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS=2 \
        RUST_LOG=${RUST_LOG:-warn} stack_app_start --out "$LOGS/poolmgr-local.out" "127.0.0.1:$APP_PORT" "$LOGS/poolmgr-local.log"
}

api() { # METHOD PATH [JSON]
    local args=(-fsS -X "$1" "$ENDPOINT$2" -H "Authorization: Bearer $ADMIN")
    [[ $# -ge 3 ]] && args+=(-H 'content-type: application/json' -d "$3")
    curl "${args[@]}"
}

create_pool() { # NAME SIZE [EXTRA_FIELDS]  (EXTRA_FIELDS: more PoolSpec JSON fields, e.g. hooks)
    api POST /v1/pools '{"namespace": "default", "name": "'"$1"'", "size": '"$2"', "flintlock_hosts": ["sim"],'"${3:+ $3,}"'
      "replenishment": {"strategy": "REPLACE_ON_DELETE"}, "heartbeat_interval_seconds": 300, "heartbeat_expiry_seconds": 600,
      "microvm_template": {"root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
                           "interfaces": [{"device_id": "eth1", "type": "TAP"}]}}' >/dev/null
}

sql() { "${PSQL[@]}" -c "$1"; }

wait_available() { # POOL_NAME_LIKE WANT TIMEOUT_S
    local t0=$SECONDS n=0
    while ((SECONDS - t0 < $3)); do
        n=$(sql "SELECT count(*) FROM vms WHERE pool_name LIKE '$1' AND phase = 'AVAILABLE'")
        [[ $n -ge $2 ]] && return 0
        sleep 0.5
    done
    log "only $n of $2 VMs AVAILABLE in pools $1 after $3 s"
    return 1
}

# run_check NAME: the settled checker; prints its summary into CHECK_LINE.
run_check() {
    local out status=0
    out=$("$BIN/poolmgr-check" --database-url "$DB_URL" --wait 90s 2>>"$LOGS/check-$1.progress") || status=$?
    printf '%s\n' "$out" >"$LOGS/check-$1.out"
    printf '%s\n' "$out" | grep -v '^poolmgr-check:' >&2 || true
    CHECK_LINE=$(printf '%s\n' "$out" | grep '^poolmgr-check:' | tail -n 1)
    CHECK_LINE=${CHECK_LINE#poolmgr-check: }
    return "$status"
}

record() { # NAME STATUS(0=pass) DETAILS
    local verdict=PASS
    if [[ $2 -ne 0 ]]; then
        verdict=FAIL
        FAILED=1
    fi
    local line
    line=$(printf '%-13s %s  %s' "$1" "$verdict" "$3")
    SUMMARY+=("$line")
    log "$line"
}

# kv KEY LINE: the value of KEY=value in a summary line.
kv() { printf '%s\n' "$2" | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1; }

# seen_by_load LOG KEY TIMEOUT_S: waits until the load's progress lines in LOG (one every 2 s)
# count KEY above 0, so a fault is undone only once the load has met it; 1 after TIMEOUT_S.
seen_by_load() {
    local t0=$SECONDS
    while ((SECONDS - t0 < $3)); do
        grep -Eq " $2=[1-9]" "$1" && return 0
        sleep 0.2
    done
    log "the load saw no $2 in $3 s; see $1"
    return 1
}

# The loads run until the script says its fault is over (this file exists) and at least their
# --duration: a fault can never land after the load has finished, however slow the machine.
STOP_LOAD=$DIR/load.stop

log "starting flintlock-sim (state file $DIR/sim.state) and poolmgr-local"
start_sim
start_app
stack_register_host "$ENDPOINT" "$ADMIN" sim "127.0.0.1:$SIM_PORT"
create_pool chaos "$POOL_SIZE"
log "filling pool default/chaos ($POOL_SIZE VMs)"
wait_available chaos "$POOL_SIZE" 60 || die "pool default/chaos never filled; see $LOGS/poolmgr-local.log"

# ---- 1: PostgreSQL restart under claim load ------------------------------------------------
log "scenario 1: PostgreSQL stopped for ${DOWN}s under claim load"
rm -f "$STOP_LOAD"
stack_spawn poolmgr-chaos "$LOGS/s1.out" "$LOGS/s1.log" \
    "$BIN/poolmgr-chaos" claims --endpoint "$ENDPOINT" --token "$CLIENT" --principal chaos --pool default/chaos \
    --clients "$CLIENTS" --keep 1 --duration "$DURATION" --until-file "$STOP_LOAD" --expect-503 --id-prefix s1
LOAD_PID=$SPAWNED_PID
sleep 2
APP_PID_BEFORE=$APP_PID
s1=0
T_DOWN=$SECONDS
pg_stop "$DIR/pg" >>"$LOGS/pg.log" 2>&1
sleep 1
HEALTH_DOWN=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$ENDPOINT/healthz" || true)
RETRY_AFTER=$(curl -s -o /dev/null -D - --max-time 10 -X POST "$ENDPOINT/v1/claims" -H "Authorization: Bearer $CLIENT" \
    -H 'content-type: application/json' -d '{"pool": {"namespace": "default", "name": "chaos"}}' |
    tr -d '\r' | sed -n 's/^[Rr]etry-[Aa]fter: //p')
# Force the moment: PostgreSQL comes back only once the load has met the outage (a 503).
seen_by_load "$LOGS/s1.log" 503s 60 || s1=1
while ((SECONDS - T_DOWN < DOWN)); do sleep 0.2; done
PG_WANT_PORT=$PG_PORT PG_FAST=1 pg_start "$DIR/pg" >>"$LOGS/pg.log" 2>&1 || die "PostgreSQL did not come back on port $PG_PORT; see $DIR/pg/postgres.log"
touch "$STOP_LOAD"
stack_wait "$LOAD_PID" || s1=1
LOAD=$(tail -n 1 "$LOGS/s1.out")
grep FAIL "$LOGS/s1.log" >&2 || true
notes=""
if [[ $HEALTH_DOWN != 503 ]]; then
    notes+=" healthz-while-down=$HEALTH_DOWN(want 503)"
    s1=1
fi
if [[ -z $RETRY_AFTER ]]; then
    notes+=" claim-while-down-had-no-Retry-After"
    s1=1
fi
if ! kill -0 "$APP_PID_BEFORE" 2>/dev/null; then
    notes+=" poolmgr-local-died"
    s1=1
fi
run_check s1 || s1=1
record "1 pg-restart" "$s1" "claims=$(kv claims_ok "$LOAD") 503s=$(kv 503s "$LOAD") retry_after=${RETRY_AFTER:-none} retries=$(kv retries "$LOAD") replayed_after_error=$(kv replayed_after_error "$LOAD") releases=$(kv releases "$LOAD") 429s=$(kv exhausted_429 "$LOAD") leases=$(kv leases_in_db "$LOAD")/$(kv leases_held "$LOAD") unexpected=$(kv unexpected "$LOAD") same_process=yes${notes} | check: $CHECK_LINE"

# ---- 2: SIGKILL of poolmgr-local under claims with request_ids -------------------------------
log "scenario 2: poolmgr-local killed with SIGKILL under claims, restarted"
rm -f "$STOP_LOAD"
stack_spawn poolmgr-chaos "$LOGS/s2.out" "$LOGS/s2.log" \
    "$BIN/poolmgr-chaos" claims --endpoint "$ENDPOINT" --token "$CLIENT" --principal chaos --pool default/chaos \
    --clients "$CLIENTS" --keep 1 --duration "$DURATION" --until-file "$STOP_LOAD" --expect-conn-errors --id-prefix s2
LOAD_PID=$SPAWNED_PID
sleep 2
KILLS=0
s2=0
for _ in 1 $([[ $SHORT == 1 ]] || echo 2); do
    stack_stop "$APP_PID" KILL
    KILLS=$((KILLS + 1))
    sleep 1.5
    # Force the moment: the restart waits until the load has met the dead server.
    seen_by_load "$LOGS/s2.log" conn_errors 60 || s2=1
    start_app
    sleep 2
done
touch "$STOP_LOAD"
stack_wait "$LOAD_PID" || s2=1
LOAD=$(tail -n 1 "$LOGS/s2.out")
grep FAIL "$LOGS/s2.log" >&2 || true
# s1's clients kept their leases too: every chaos lease is one of s1's or s2's, one per client.
OWNERS=$(sql "SELECT count(*) FILTER (WHERE request_id LIKE 's2-%'), count(DISTINCT split_part(request_id, '-', 2)) FILTER (WHERE request_id LIKE 's2-%') FROM leases WHERE principal = 'chaos'")
run_check s2 || s2=1
record "2 app-sigkill" "$s2" "kills=$KILLS claims=$(kv claims_ok "$LOAD") conn_errors=$(kv conn_errors "$LOAD") 503s=$(kv 503s "$LOAD") retries=$(kv retries "$LOAD") replayed_after_error=$(kv replayed_after_error "$LOAD") replay_checks=$(kv replay_checks "$LOAD") 429s=$(kv exhausted_429 "$LOAD") 409s=$(kv aborted_409 "$LOAD") leases(s2,clients)=${OWNERS/|/,} unexpected=$(kv unexpected "$LOAD") | check: $CHECK_LINE"

# ---- 3: SIGKILL of flintlock-sim while pools provision ---------------------------------------
log "scenario 3: flintlock-sim killed with SIGKILL while $PROV_POOLS pools of $PROV_SIZE provision"
# Force the moment: with a 6 s boot every VM stays PROVISIONING >= 6 s, so on any machine the
# kill lands with creates in flight (the sim keeps its VMs across the restart: --state-file).
stack_stop "$SIM_PID"
start_sim 6000
for i in $(seq 0 $((PROV_POOLS - 1))); do create_pool "prov-$i" "$PROV_SIZE"; done
s3=0
t0=$SECONDS
prov_counts() { sql "SELECT count(*) FILTER (WHERE phase = 'AVAILABLE') || ' ' || count(*) FILTER (WHERE phase = 'PROVISIONING') FROM vms WHERE pool_name LIKE 'prov-%'"; }
# Wait for the first PROVISIONING rows, then kill a second into the creates (still in flight).
while ((SECONDS - t0 < 30)) && [[ $(prov_counts) == *" 0" ]]; do sleep 0.05; done
sleep 1
AT_KILL=$(prov_counts)
read -r avail prov <<<"$AT_KILL"
stack_stop "$SIM_PID" KILL
sleep 3
start_sim
LOADED=$(grep 'state loaded' "$LOGS/flintlock-sim.log" | tail -n 1 | sed -n 's/.*[^_]vms=\([0-9]*\).*/\1/p')
run_check s3 || s3=1
PROV_AVAIL=$(sql "SELECT count(*) FROM vms WHERE pool_name LIKE 'prov-%' AND phase = 'AVAILABLE'")
ADOPTED=$(sql "SELECT count(*) FROM events WHERE type = 'VM_ADOPTED'")
ORPHANS=$(sql "SELECT count(*) FROM events WHERE type = 'VM_ORPHAN_DELETED'")
[[ $PROV_AVAIL -eq $((PROV_POOLS * PROV_SIZE)) ]] || s3=1
# Killed with nothing in flight, the scenario proved nothing: a failure, not a pass.
[[ $prov -ge 1 ]] || s3=1
record "3 sim-sigkill" "$s3" "at_kill(available,provisioning)=$avail,$prov sim_vms_loaded=${LOADED:-?} pools_available=$PROV_AVAIL/$((PROV_POOLS * PROV_SIZE)) adopted=$ADOPTED orphans_deleted=$ORPHANS | check: $CHECK_LINE"

# ---- 4: 8 overlapping reconcile passes -----------------------------------------------------
log "scenario 4: rounds of 8 overlapping reconcile passes (poolmgr-local stopped)"
stack_stop "$APP_PID"
s4=0
"$BIN/poolmgr-chaos" passes --host sim --concurrency 8 --pools "$OV_POOLS" --size "$OV_SIZE" --grow-to "$OV_GROW" \
    >"$LOGS/s4.out" 2>"$LOGS/s4.log" || s4=1
LOAD=$(tail -n 1 "$LOGS/s4.out")
grep FAIL "$LOGS/s4.log" >&2 || true
run_check s4 || s4=1
record "4 overlap" "$s4" "passes=$(kv passes "$LOAD") rounds=$(kv rounds "$LOAD") created=$(kv created "$LOAD") max_over_size=$(kv max_over_size "$LOAD") pass_errors=$(kv pass_errors "$LOAD") pools=${OV_POOLS}x${OV_GROW} | check: $CHECK_LINE"

# ---- 5: claim answers lost after commit, on a pool with a pre-lease hook ---------------------
log "scenario 5: every ${LOSE_EVERY}rd fresh claim loses its answer after commit (pool with a pre-lease hook)"
# poolmgr-local's fault point (functions/poolmgr-local/src/fault.rs): off unless this variable
# is set, and absent from the Lambda functions.
LOST_BEFORE=$(grep -c 'claim answer lost on purpose' "$LOGS/poolmgr-local.log" || true)
POOLMGR_LOCAL_FAULT_LOSE_CLAIM_ANSWER_EVERY=$LOSE_EVERY start_app
create_pool hooked "$HOOK_SIZE" '"pre_lease_commands": ["rm -rf /tmp/job && mkdir /tmp/job"]'
s5=0
wait_available hooked "$HOOK_SIZE" 60 || s5=1
stack_spawn poolmgr-chaos "$LOGS/s5.out" "$LOGS/s5.log" \
    "$BIN/poolmgr-chaos" claims --endpoint "$ENDPOINT" --token "$CLIENT" --principal chaos --pool default/hooked \
    --clients "$CLIENTS" --keep 1 --duration "$DURATION" --expect-conn-errors --id-prefix s5
LOAD_PID=$SPAWNED_PID
stack_wait "$LOAD_PID" || s5=$?
LOAD=$(tail -n 1 "$LOGS/s5.out")
grep FAIL "$LOGS/s5.log" >&2 || true
LOST=$(($(grep -c 'claim answer lost on purpose' "$LOGS/poolmgr-local.log" || true) - LOST_BEFORE))
REPLAYED=$(kv replayed_after_error "$LOAD")
HOOKED_VMS=$(sql "SELECT count(*) FROM events WHERE type = 'VM_CLAIMED' AND pool_name = 'hooked'")
notes=""
# Every lost answer must come back as exactly one replay: a retry that claimed anew would
# show as a fresh claim (and a lease no client holds, which poolmgr-chaos reports).
if [[ $LOST -lt 1 ]]; then
    notes+=" no-answer-was-lost"
    s5=1
fi
if [[ $REPLAYED != "$LOST" ]]; then
    notes+=" replays($REPLAYED)!=lost($LOST)"
    s5=1
fi
# One VM_CLAIMED per logical claim: answered fresh, or lost and replayed; never one per attempt.
FRESH=$(kv fresh "$LOAD")
if [[ -z $FRESH || $HOOKED_VMS -ne $((FRESH + LOST)) ]]; then
    notes+=" vm_claimed_events($HOOKED_VMS)!=fresh+lost($FRESH+$LOST)"
    s5=1
fi
run_check s5 || s5=1
record "5 lost-answer" "$s5" "lost_answers=$LOST replayed_after_error=$REPLAYED claims=$(kv claims_ok "$LOAD") fresh=$FRESH vm_claimed_events=$HOOKED_VMS conn_errors=$(kv conn_errors "$LOAD") 429s=$(kv exhausted_429 "$LOAD") leases=$(kv leases_in_db "$LOAD")/$(kv leases_held "$LOAD") unexpected=$(kv unexpected "$LOAD")${notes} | check: $CHECK_LINE"

printf '\n'
printf 'chaos summary (%s, %ss):\n' "$([[ $SHORT == 1 ]] && echo short || echo full)" "$((SECONDS - T_START))"
printf '  %s\n' "${SUMMARY[@]}" | tee "$DIR/summary.txt"
if [[ $FAILED -ne 0 ]]; then
    err "a chaos scenario failed; read the FAIL and VIOLATION lines above and the logs in $LOGS"
    exit 1
fi
