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
#   6 rollout-kills  a pool's template changes under a light claim load; poolmgr-local is
#                    SIGKILLed 1-2 s into its running reconcile loop and again while restarting
#                    (2 kills, 6 in the full run), flintlock-sim once, beside a burst of
#                    overlapping passes: the rollout completes, never above size + max_surge,
#                    no leased VM retired, no event lost or doubled.
#
# Starts its own PostgreSQL under .dev/chaos (wiped first), flintlock-sim and poolmgr-local on
# free ports, and stops all of them on exit. Prints one summary line per scenario; exits 1 if
# any scenario or check failed. Logs: .dev/chaos/logs/. --short is the CI version (smaller
# load, shorter outages, fewer kills; ~3 minutes after the build).
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
            sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
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
    RO_SIZE=12 RO_HOLDER_KILLS=1 RO_CLIENTS=1 RO_BURST_ROUNDS=2
else
    CLIENTS=16 DURATION=20s DOWN=6 POOL_SIZE=60 PROV_POOLS=4 PROV_SIZE=10 OV_POOLS=6 OV_SIZE=5 OV_GROW=10 HOOK_SIZE=32
    RO_SIZE=24 RO_HOLDER_KILLS=3 RO_CLIENTS=2 RO_BURST_ROUNDS=4
fi
# Scenario 6: the simulator's boot delay (ms) and how long the rollout may take (s).
RO_BOOT_MS=2000 RO_BOUND=150
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
# timeout + 30 s): 45 s here instead of ~2 min by default, so scenario 2 recovers in time
# (scenario 6 lowers it to 35 s: RECONCILE_DEADLINE_S=4 HOOK_TIMEOUT_S=1).
RECONCILE_DEADLINE_S=10 HOOK_TIMEOUT_S=5
start_app() {
    DATABASE_URL=$DB_URL POOLMGR_ADMIN_TOKENS=admin:$ADMIN POOLMGR_CLIENT_TOKENS=chaos:$CLIENT \
        POOLMGR_RECONCILE_INTERVAL_SECONDS=1 POOLMGR_DB_CONNECT_TIMEOUT_SECONDS=2 \
        POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS=5 POOLMGR_FLINTLOCK_TIMEOUT_SECONDS=2 \
        POOLMGR_RECONCILE_DEADLINE_SECONDS=$RECONCILE_DEADLINE_S POOLMGR_HOOK_TIMEOUT_SECONDS=$HOOK_TIMEOUT_S \
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

# ---- 6: a rollout through killed passes and restarted processes ------------------------------
T6=$SECONDS
log "scenario 6: a rollout of default/rolling ($RO_SIZE VMs) while poolmgr-local is SIGKILLed $((2 * RO_HOLDER_KILLS)) times and flintlock-sim once"
s6=0
notes=""
# The poolmgr-local of scenario 5 goes on until the first kill: a restart now would cost a
# loop lease (below) of idle waiting, since a stopped process does not give it back. Its fault
# point loses the answer of every 3rd fresh claim; the load and the held claims below retry
# with their request_ids and get replays. The restarted ones run without the fault point, and
# with a 35 s reconcile lease (4 s deadline + 1 s hook timeout + 30 s): a kill inside the
# pool's step leaves the lease behind by design (see docs/chaos.md), and the rollout waits it
# out. A 2 s boot keeps creates in flight at the simulator's kill.
RECONCILE_DEADLINE_S=4 HOOK_TIMEOUT_S=1
stack_stop "$SIM_PID"
start_sim "$RO_BOOT_MS"
RO_SURGE=$(((RO_SIZE * 25 + 99) / 100)) # "25%" of the target, rounded up as the server does
RO_CEILING=$((RO_SIZE + RO_SURGE))
ro_spec() { # IMAGE_TAG: the pool, IMMEDIATE_ON_LEASE, with a rollout block; the tag is the change
    printf '%s' '{"namespace": "default", "name": "rolling", "size": '"$RO_SIZE"', "flintlock_hosts": ["sim"],
      "replenishment": {"strategy": "IMMEDIATE_ON_LEASE"}, "heartbeat_interval_seconds": 300, "heartbeat_expiry_seconds": 600,
      "rollout": {"max_surge": "25%", "max_unavailable": 0, "claim_preference": "CURRENT"},
      "microvm_template": {"root_volume": {"id": "root", "source": {"container_source": "example.invalid/chaos/runner:'"$1"'"}},
                           "interfaces": [{"device_id": "eth1", "type": "TAP"}]}}'
}
ro_sql() { sql "$1" | tr '|' ' '; }
ro_state() { sql "SELECT coalesce(rollout_state, '-') FROM pools WHERE namespace = 'default' AND name = 'rolling'"; }
api POST /v1/pools "$(ro_spec 1)" >/dev/null
wait_available rolling "$RO_SIZE" 60 || die "pool default/rolling never filled; see $LOGS/poolmgr-local.log"
OLD_REV=$(sql "SELECT revision FROM pools WHERE namespace = 'default' AND name = 'rolling'")
# Two leases held across the whole rollout (on the old revision): the rollout must leave them.
for i in 0 1; do
    for attempt in 1 2 3 4 5; do
        curl -sS -f -o /dev/null -X POST "$ENDPOINT/v1/claims" -H "Authorization: Bearer $CLIENT" -H 'content-type: application/json' \
            -d '{"pool": {"namespace": "default", "name": "rolling"}, "request_id": "s6hold-'"$i"'"}' 2>/dev/null && break
        ((attempt < 5)) || die "claiming s6hold-$i failed 5 times"
        sleep 0.5
    done
done
HOLD_VMS=$(sql "SELECT string_agg(quote_literal(vm_id), ',') FROM leases WHERE request_id LIKE 's6hold-%'")
wait_available rolling "$RO_SIZE" 60 || die "pool default/rolling did not refill after the held claims"
# A light claim load (a claim per client every ~5 s, so the pool stays mostly warm and the
# rollout, not the claims, replaces most stale VMs); it meets the kills as connection errors.
rm -f "$STOP_LOAD"
stack_spawn poolmgr-chaos "$LOGS/s6.out" "$LOGS/s6.log" \
    "$BIN/poolmgr-chaos" claims --endpoint "$ENDPOINT" --token "$CLIENT" --principal chaos --pool default/rolling \
    --clients "$RO_CLIENTS" --keep 1 --pause 5s --duration 5s --until-file "$STOP_LOAD" --id-prefix s6
LOAD_PID=$SPAWNED_PID
seen_by_load "$LOGS/s6.log" claims_ok 60 || s6=1

# The change: a new image, so a new revision and a rollout.
api PUT /v1/pools/default/rolling "$(ro_spec 2)" >/dev/null
T_PUT=$SECONDS
REV=$(sql "SELECT revision FROM pools WHERE namespace = 'default' AND name = 'rolling'")
# The poller: every ~200 ms, in one statement (one snapshot), the VMs the ceiling counts under
# IMMEDIATE_ON_LEASE (what reconcile/rollout.rs keeps and the rollout bench polls: AVAILABLE,
# being claimed, PROVISIONING / CREATE_HOOK_RUNNING, QUARANTINED; not LEASED, not DELETING),
# and the ids of the stale AVAILABLE VMs (for the event check below). SQL, not the API: the
# API is down during the kills.
RO_POLL=$LOGS/s6.poll
RO_POLL_STOP=$DIR/s6.poll.stop
rm -f "$RO_POLL_STOP"
(
    while [[ ! -e $RO_POLL_STOP ]]; do
        # counted, stale ids, then for the log: time, AVAILABLE stale/current, PROVISIONING, LEASED, DELETING.
        sql "SELECT count(*) FILTER (WHERE v.phase IN ('AVAILABLE', 'PRE_LEASE_HOOK_RUNNING', 'PROVISIONING', 'CREATE_HOOK_RUNNING', 'QUARANTINED')
                                      OR (v.phase = 'LEASED' AND l.lease_id IS NULL))
                    || ' ' || coalesce(string_agg(v.id, ',') FILTER (WHERE v.phase = 'AVAILABLE' AND v.revision <> $REV), '-')
                    || ' ' || to_char(now(), 'HH24:MI:SS.MS')
                    || ' available=' || count(*) FILTER (WHERE v.phase = 'AVAILABLE' AND v.revision <> $REV)
                    || '/' || count(*) FILTER (WHERE v.phase = 'AVAILABLE' AND v.revision = $REV)
                    || ' provisioning=' || count(*) FILTER (WHERE v.phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING'))
                    || ' leased=' || count(*) FILTER (WHERE v.phase = 'LEASED')
                    || ' deleting=' || count(*) FILTER (WHERE v.phase = 'DELETING')
             FROM vms v LEFT JOIN leases l ON l.vm_id = v.id WHERE v.pool_namespace = 'default' AND v.pool_name = 'rolling'" \
            >>"$RO_POLL" 2>>"$LOGS/s6.poll.err" || true
        sleep 0.2
    done
) &
POLL_PID=$!
at_exit touch "$RO_POLL_STOP"

# The kills. A poolmgr-local reconciles only while it holds the loop lease (reconcile/driver.rs:
# one loop at a time, a row renewed at every pass, 15 s long), so a killed holder stops all
# reconciling until its lease runs out and a restarted process takes it over. Force the
# moment: each holder kill waits until a live process holds the lease and lands 1-2 s into its
# running loop (inside a pass or between two); the process is restarted at once and killed
# again 1-2 s later, while it waits to take the lease over (a restart that dies before its first
# pass), and restarted again. During the first takeover wait a burst of overlapping in-process
# passes (scenario 4's, which take no loop lease) steps the pool alone; flintlock-sim is
# SIGKILLed once, inside the next running loop, and restarted on its port and state file.
KILLS=0
HOLDER_KILLS=0
MID_STEP=0
SIM_KILLED=0
BURST_PID=""
killed_owner=""
while true; do
    t0=$SECONDS
    owner=""
    while ((SECONDS - t0 < 60)); do
        owner=$(sql "SELECT coalesce(max(owner), '') FROM reconcile_loop WHERE until > now() AND owner IS DISTINCT FROM '$killed_owner'")
        [[ -n $owner ]] && break
        sleep 0.2
    done
    if [[ -z $owner ]]; then
        notes+=" no-process-took-the-loop-lease-over-in-60s"
        s6=1
        break
    fi
    if ((HOLDER_KILLS == 1)); then
        sleep 0.5
        stack_stop "$SIM_PID" KILL
        SIM_KILLED=1
        sleep 1
        start_sim "$RO_BOOT_MS"
    fi
    ((HOLDER_KILLS < RO_HOLDER_KILLS)) || break
    sleep "1.$((RANDOM % 10))"
    [[ $(ro_state) == PROGRESSING ]] || break
    stack_stop "$APP_PID" KILL
    KILLS=$((KILLS + 1))
    HOLDER_KILLS=$((HOLDER_KILLS + 1))
    killed_owner=$owner
    log "scenario 6: kill $KILLS (the loop's holder) $((SECONDS - T_PUT)) s into the rollout"
    pool_owner=$(sql "SELECT coalesce(max(reconcile_owner), '') FROM pools WHERE namespace = 'default' AND name = 'rolling' AND reconcile_until > now()")
    start_app
    # The pool's reconcile lease held at the kill and still held by the same pass once the new
    # process is up (a live pass gives it back after its step): the killed process died between
    # taking the pool and finishing its step. The lease stays until it expires (by design).
    if [[ -n $pool_owner ]]; then
        MID_STEP=$((MID_STEP + $(sql "SELECT count(*) FROM pools WHERE namespace = 'default' AND name = 'rolling' AND reconcile_owner = '$pool_owner' AND reconcile_until > now()")))
    fi
    if ((HOLDER_KILLS == 1)); then
        POOLMGR_RECONCILE_DEADLINE_SECONDS=$RECONCILE_DEADLINE_S POOLMGR_HOOK_TIMEOUT_SECONDS=$HOOK_TIMEOUT_S \
            POOLMGR_FLINTLOCK_TIMEOUT_SECONDS=2 stack_spawn poolmgr-chaos "$LOGS/s6-passes.out" "$LOGS/s6-passes.log" \
            "$BIN/poolmgr-chaos" passes --host sim --concurrency 8 --pools 0 --size 1 --grow-to 1 \
            --grow-after "$RO_BURST_ROUNDS" --pool-prefix s6-none
        BURST_PID=$SPAWNED_PID
    fi
    sleep "1.$((RANDOM % 10))"
    stack_stop "$APP_PID" KILL
    KILLS=$((KILLS + 1))
    log "scenario 6: kill $KILLS (waiting for the loop lease) $((SECONDS - T_PUT)) s into the rollout"
    start_app
done
# The load has met the kills: it winds down (a pause) while the rollout finishes.
touch "$STOP_LOAD"
# Done: COMPLETE, or an end it must never reach (HALTED, ROLLED_BACK).
while ((SECONDS - T_PUT < RO_BOUND)); do
    state=$(ro_state)
    [[ $state == PROGRESSING ]] || break
    sleep 0.5
done
STATE=$(ro_state)
stack_wait "$LOAD_PID" || s6=1
LOAD=$(tail -n 1 "$LOGS/s6.out")
grep FAIL "$LOGS/s6.log" >&2 || true
BURST="none"
if [[ -n $BURST_PID ]]; then
    stack_wait "$BURST_PID" || s6=1
    BURST=$(tail -n 1 "$LOGS/s6-passes.out")
    grep FAIL "$LOGS/s6-passes.log" >&2 || true
    BURST="$(kv passes "$BURST")(errors=$(kv pass_errors "$BURST"))"
fi
touch "$RO_POLL_STOP"
wait "$POLL_PID" || true
MAX_VMS=$(cut -d ' ' -f 1 "$RO_POLL" | sort -n | tail -n 1)
POLLS=$(wc -l <"$RO_POLL")
ABOVE=$(awk -v c="$RO_CEILING" '$1 > c' "$RO_POLL" | wc -l)

if [[ $STATE != COMPLETE ]]; then
    notes+=" state=$STATE-after-$((SECONDS - T_PUT))s(want COMPLETE)"
    s6=1
fi
if [[ -z $MAX_VMS || $MAX_VMS -gt $RO_CEILING ]]; then
    notes+=" ${ABOVE}-polls-above-the-ceiling"
    s6=1
fi
# Killed fewer times than planned because the rollout was already done, or retiring nothing
# (the claims used every stale VM up): it proved less.
if [[ $KILLS -lt $((2 * RO_HOLDER_KILLS)) || $SIM_KILLED -ne 1 ]]; then
    notes+=" only-${KILLS}-kills-and-${SIM_KILLED}-sim-kills-during-the-rollout"
    s6=1
fi
STALE_LEFT=$(sql "SELECT count(*) FROM vms WHERE pool_namespace = 'default' AND pool_name = 'rolling' AND phase = 'AVAILABLE' AND revision <> $REV")
if [[ $STALE_LEFT -ne 0 ]]; then
    notes+=" stale-available-left=$STALE_LEFT"
    s6=1
fi
# The rollout's events for this revision: exactly one start and one completion, no halt.
read -r STARTED COMPLETED HALTED TOOK <<<"$(ro_sql "SELECT
    count(*) FILTER (WHERE type = 'ROLLOUT_STARTED' AND (payload->>'to')::int = $REV),
    count(*) FILTER (WHERE type = 'POOL_ROLLOUT_COMPLETED' AND (payload->>'revision')::int = $REV),
    count(*) FILTER (WHERE type IN ('ROLLOUT_HALTED', 'ROLLOUT_ROLLED_BACK')),
    coalesce(round(extract(epoch FROM max(created_at) FILTER (WHERE type = 'POOL_ROLLOUT_COMPLETED')
                   - min(created_at) FILTER (WHERE type = 'ROLLOUT_STARTED')))::text, '-')
    FROM events WHERE pool_namespace = 'default' AND pool_name = 'rolling'")"
if [[ $STARTED -ne 1 || $COMPLETED -ne 1 || $HALTED -ne 0 ]]; then
    notes+=" events(started,completed,halted)=$STARTED,$COMPLETED,$HALTED(want 1,1,0)"
    s6=1
fi
# "Loses no event", checked three ways; the first does not trust the product's own counting:
# - every VM the poller saw AVAILABLE on the old revision and that is gone now (its row
#   deleted or DELETING) left either through a claim (VM_CLAIMED: a lease, released by the
#   load) or for the rollout (VM_DELETED_FOR_ROLLOUT); one with neither left without its
#   event (UNACCOUNTED). A stale VM retired between two polls is not in the set: the check
#   misses nothing it claims, it only sees fewer VMs;
# - no VM has two VM_DELETED_FOR_ROLLOUT (a retirement replayed by a restarted pass);
# - the VM_DELETED_FOR_ROLLOUT events of this revision number the status' extra boots and
#   the POOL_ROLLOUT_COMPLETED's extra_boots (each is written in the retiring statement).
SEEN=$(cut -d ' ' -f 2 "$RO_POLL" | tr ',' '\n' | grep -v '^-$' | sort -u | sed "s/.*/'&'/" | paste -sd, -)
read -r SEEN_N UNACCOUNTED <<<"$(ro_sql "SELECT count(*), count(*) FILTER (WHERE NOT EXISTS (
        SELECT 1 FROM vms v WHERE v.id = s.id AND v.phase <> 'DELETING') AND NOT EXISTS (
        SELECT 1 FROM events e WHERE e.vm_id = s.id AND e.type IN ('VM_CLAIMED', 'VM_DELETED_FOR_ROLLOUT')))
    FROM unnest(ARRAY[${SEEN:-NULL}]::text[]) s(id) WHERE s.id IS NOT NULL")"
read -r RETIRED RETIRED_TWICE EXTRA_BOOTS COMPLETED_EXTRA LEASED_RETIRED HOLD_OK <<<"$(ro_sql "SELECT
    (SELECT count(*) FROM events WHERE pool_name = 'rolling' AND type = 'VM_DELETED_FOR_ROLLOUT' AND (payload->>'to')::int = $REV),
    (SELECT count(*) FROM (SELECT vm_id FROM events WHERE pool_name = 'rolling' AND type = 'VM_DELETED_FOR_ROLLOUT'
                           GROUP BY vm_id HAVING count(*) > 1) d),
    (SELECT rollout_extra_boots FROM pools WHERE namespace = 'default' AND name = 'rolling'),
    (SELECT coalesce(max(payload->>'extra_boots'), '-') FROM events WHERE pool_name = 'rolling' AND type = 'POOL_ROLLOUT_COMPLETED'),
    (SELECT count(*) FROM events r WHERE r.pool_name = 'rolling' AND r.type = 'VM_DELETED_FOR_ROLLOUT'
       AND EXISTS (SELECT 1 FROM events c WHERE c.vm_id = r.vm_id AND c.type = 'VM_CLAIMED')),
    (SELECT count(*) FROM leases l JOIN vms v ON v.id = l.vm_id
     WHERE l.request_id LIKE 's6hold-%' AND v.phase = 'LEASED' AND v.revision = $OLD_REV AND v.id IN ($HOLD_VMS))")"
if [[ $RETIRED -lt 1 ]]; then
    notes+=" nothing-retired(the-claims-used-every-stale-VM)"
    s6=1
fi
if [[ $UNACCOUNTED -ne 0 ]]; then
    notes+=" stale-vms-gone-without-event=$UNACCOUNTED"
    s6=1
    sql "SELECT s.id, coalesce(string_agg(e.type, ',' ORDER BY e.id), 'no events') FROM unnest(ARRAY[$SEEN]::text[]) s(id)
         LEFT JOIN events e ON e.vm_id = s.id GROUP BY s.id" >"$LOGS/s6-stale-vms.txt" || true
fi
if [[ $RETIRED_TWICE -ne 0 || $RETIRED != "$EXTRA_BOOTS" || $RETIRED != "$COMPLETED_EXTRA" ]]; then
    notes+=" retired_events=$RETIRED(twice=$RETIRED_TWICE)!=extra_boots(status=$EXTRA_BOOTS,completed=$COMPLETED_EXTRA)"
    s6=1
fi
# No leased VM retired: no VM_DELETED_FOR_ROLLOUT names a VM that was ever claimed, and the
# two leases held through the rollout still hold their old-revision VMs.
if [[ $LEASED_RETIRED -ne 0 || $HOLD_OK -ne 2 ]]; then
    notes+=" claimed-vms-retired=$LEASED_RETIRED held-leases-intact=$HOLD_OK/2"
    s6=1
fi
for lease in $(sql "SELECT lease_id FROM leases WHERE request_id LIKE 's6hold-%'"); do
    curl -fsS -o /dev/null -X DELETE "$ENDPOINT/v1/leases/$lease" -H "Authorization: Bearer $CLIENT" || notes+=" release-of-$lease-failed"
done
# The pool's story, for whoever reads a failure: its events, and the poll lines in s6.poll.
sql "SELECT id, to_char(created_at, 'HH24:MI:SS.MS'), type, coalesce(vm_id, ''), payload FROM events
     WHERE pool_namespace = 'default' AND pool_name = 'rolling' ORDER BY id" >"$LOGS/s6-events.txt" || true
run_check s6 || s6=1
record "6 rollout-kills" "$s6" "kills=$KILLS(loop_holders=$HOLDER_KILLS,mid_step=$MID_STEP)+sim=$SIM_KILLED burst_passes=$BURST max_vms=$MAX_VMS/ceiling=$RO_CEILING polls=$POLLS complete_in=${TOOK}s events(started,completed)=$STARTED,$COMPLETED retired=$RETIRED extra_boots=$EXTRA_BOOTS stale_seen=$SEEN_N unaccounted=$UNACCOUNTED claimed_retired=$LEASED_RETIRED held=$HOLD_OK/2 claims=$(kv claims_ok "$LOAD") conn_errors=$(kv conn_errors "$LOAD") 429s=$(kv exhausted_429 "$LOAD") scenario_s=$((SECONDS - T6))${notes} | check: $CHECK_LINE"

printf '\n'
printf 'chaos summary (%s, %ss):\n' "$([[ $SHORT == 1 ]] && echo short || echo full)" "$((SECONDS - T_START))"
printf '  %s\n' "${SUMMARY[@]}" | tee "$DIR/summary.txt"
if [[ $FAILED -ne 0 ]]; then
    err "a chaos scenario failed; read the FAIL and VIOLATION lines above and the logs in $LOGS"
    exit 1
fi
