#!/usr/bin/env bash
# A flintlock host dies (issue 23 finding 2): how long until it is judged dead, and how long
# from that judgement until its pool is whole again on the other host, in both shapes:
#
#   local     poolmgr-local with its in-process reconciler (ticker every 2 s)
#   deployed  poolmgr-local without one (POOLMGR_RECONCILE_TICKER=off), the reconcile function
#             under `lambda-emu schedule`, invoked every 60 s as EventBridge Scheduler does and
#             woken by claims through the emulated Lambda Invoke API (SigV4-checked)
#
# Each run: a pool of 4 over two flintlock-sim hosts (`sim` and `doomed`, boots of
# --boot-ms), filled; then `doomed` is hung (SIGSTOP: it accepts connections and never
# answers, as a host whose flintlockd froze or whose network dropped). Scenarios:
#
#   quiet     no client: only the reconciler's own calls (orphan scans) can find the host
#   claimed   two clients claim 3 s after the fault, retrying 503/429 after Retry-After as
#             poolmgr-client does, and hold their VMs
#
# Measured from the database (sampled every 0.25 s): the fault, the host marked unreachable
# (hosts.unreachable_since), judged dead (its first VM_LOST), and the pool whole again on
# `sim` (AVAILABLE + LEASED = 4). The target (issue 23): whole within one boot plus a few
# seconds of the judgement. All in real time, defaults everywhere (POOLMGR_HOST_DEAD_SECONDS
# 30, orphan scans every 10 s) unless --env says otherwise.
#
#   scripts/bench-dead-host.sh [--configurations local,deployed] [--scenarios quiet,claimed]
#                              [--boot-ms MS] [--release] [--results FILE] [--env KEY=VALUE]
#
# Prints a table and writes the rows as JSON lines (default .dev/bench-dead-host/results.jsonl).
# Needs the PostgreSQL 15 server binaries (as scripts/test.sh), curl and python3. About 2
# minutes a deployed run, 1 a local one, after the build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

CONFIGURATIONS=local,deployed
SCENARIOS=quiet,claimed
BOOT_MS=2000
PROFILE=debug
WORK=$ROOT/.dev/bench-dead-host
RESULTS=""
EXTRA_ENV=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --configurations) CONFIGURATIONS=$2; shift 2 ;;
        --scenarios) SCENARIOS=$2; shift 2 ;;
        --boot-ms) BOOT_MS=$2; shift 2 ;;
        --release) PROFILE=release; shift ;;
        --results) RESULTS=$2; shift 2 ;;
        --env) EXTRA_ENV+=("$2"); shift 2 ;;
        -h | --help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[[ $BOOT_MS =~ ^[0-9]+$ ]] || die "--boot-ms must be a whole number of milliseconds, got '$BOOT_MS'"
command -v curl >/dev/null 2>&1 || die "curl is required (apt-get install curl)"
command -v python3 >/dev/null 2>&1 || die "python3 is required"
IFS=, read -r -a CONFIGS <<<"$CONFIGURATIONS"
IFS=, read -r -a SCENS <<<"$SCENARIOS"
for c in "${CONFIGS[@]}"; do
    [[ $c == local || $c == deployed ]] || die "--configurations takes local and/or deployed, got '$c'"
done
for s in "${SCENS[@]}"; do
    [[ $s == quiet || $s == claimed ]] || die "--scenarios takes quiet and/or claimed, got '$s'"
done

mkdir -p "$WORK"
LOGS=$WORK/logs
rm -rf "$LOGS"
mkdir -p "$LOGS"
RESULTS=${RESULTS:-$WORK/results.jsonl}
: >"$RESULTS"

log "building $PROFILE binaries (flintlock-sim, lambda-emu, poolmgr-local, reconcile)"
stack_build "$PROFILE" -q -p flintlock-sim -p lambda-emu -p poolmgr-local -p reconcile
BIN=$STACK_BIN
PSQL=$(pg_bindir)/psql

PG_FAST=1 stack_pg_fresh "$WORK/pg" "see $WORK/pg/postgres.log"
stack_bench_credentials

# start_app NAME KEY=VALUE...: poolmgr-local with those variables (and only for it).
start_app() {
    local name=$1 port e
    shift
    for e in "$@"; do local -x "${e?}"; done
    port=$(free_port)
    stack_app_start --out "$LOGS/poolmgr-local-$name.out" "127.0.0.1:$port" "$LOGS/poolmgr-local-$name.log"
}

api() { # METHOD PATH [BODY] -> body on stdout
    local method=$1 path=$2 body=${3:-}
    curl -sS -X "$method" -H "authorization: Bearer $ADMIN" -H 'content-type: application/json' \
        ${body:+--data "$body"} "$APP_URL$path"
}

# run_one CONFIG SCENARIO: one stack on its own database, one measurement, one JSON line.
run_one() {
    local config=$1 scenario=$2 name=$1-$2 db url emu_port e emu_pid=""
    db=deadhost_${name//-/_}
    url=$(pg_create_db "$db")
    RUST_LOG=info stack_sim_start "$LOGS/sim-$name.log" --listen 127.0.0.1:0 --boot-delay-ms "$BOOT_MS" --delete-delay-ms 20
    local sim_addr=$SIM_ADDR sim_pid=$SIM_PID
    RUST_LOG=info stack_sim_start "$LOGS/doomed-$name.log" --listen 127.0.0.1:0 --boot-delay-ms "$BOOT_MS" --delete-delay-ms 20
    local doomed_addr=$SIM_ADDR doomed_pid=$SIM_PID
    # A stopped process ignores SIGTERM until it runs again.
    at_exit kill -CONT "$doomed_pid"
    local common=(DATABASE_URL="$url" POOLMGR_ADMIN_TOKENS="bench:$ADMIN" POOLMGR_CLIENT_TOKENS="bench-client:$CLIENT"
        RUST_LOG="${RUST_LOG:-warn}" "${EXTRA_ENV[@]}")
    if [[ $config == deployed ]]; then
        emu_port=$(free_port)
        log "$name: poolmgr-local without a reconciler, waking the reconcile function"
        start_app "$name" "${common[@]}" POOLMGR_RECONCILE_TICKER=off POOLMGR_WAKE_LAMBDA_FUNCTION=reconcile \
            POOLMGR_LAMBDA_ENDPOINT="http://127.0.0.1:$emu_port" AWS_REGION=eu-west-1 \
            AWS_ACCESS_KEY_ID="$WAKE_KEY" AWS_SECRET_ACCESS_KEY="$WAKE_SECRET" AWS_SESSION_TOKEN=bench-session
        stack_reconcile_fn_start "$name" "$url" "$emu_port" 60000 300000 "$LOGS" "${EXTRA_ENV[@]}"
        emu_pid=$SPAWNED_PID
    else
        log "$name: poolmgr-local with its in-process reconciler"
        start_app "$name" "${common[@]}"
    fi
    stack_register_host "$APP_URL" "$ADMIN" sim "$sim_addr"
    stack_register_host "$APP_URL" "$ADMIN" doomed "$doomed_addr"
    local app_pid=$APP_PID created
    created=$(api POST /v1/pools '{"namespace": "default", "name": "ci", "size": 4, "flintlock_hosts": ["sim", "doomed"],
        "replenishment": {"strategy": "REPLACE_ON_DELETE"},
        "microvm_template": {"root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
            "kernel": {"image": "ghcr.io/liquidmetal-dev/kernel:6.1", "filename": "boot/vmlinux", "add_network_config": true},
            "interfaces": [{"device_id": "eth1", "type": "TAP"}]}}')
    [[ $created == *'"spec"'* ]] || die "$name: creating the pool answered: $created"
    q() { "$PSQL" -X -qAt -d "$url" -c "$1"; }
    log "$name: waiting for the pool to fill (2 VMs on each host)"
    local t0=$SECONDS
    until [[ $(q "SELECT count(DISTINCT flintlock_host) || ':' || count(*) FROM vms WHERE phase = 'AVAILABLE'") == 2:4 ]]; do
        ((SECONDS - t0 < 180)) || die "$name: the pool did not fill with a VM on each host within 180 s"
        sleep 0.5
    done
    # Let a scheduled or woken loop end, as on a quiet fleet.
    sleep 8
    local fault
    fault=$(q "SELECT extract(epoch FROM clock_timestamp())")
    kill -STOP "$doomed_pid"
    log "$name: host doomed hung (SIGSTOP) at $(date +%T)"
    local claimers=()
    if [[ $scenario == claimed ]]; then
        for i in 1 2; do
            python3 - "$APP_URL" "$CLIENT" "$name-$i" "$LOGS/claim-$name-$i.json" <<'PY' &
import json, sys, time, urllib.request, urllib.error
url, token, rid, out = sys.argv[1:]
time.sleep(3)
t0, tries = time.time(), 0
while True:
    tries += 1
    req = urllib.request.Request(url + "/v1/claims", method="POST",
        data=json.dumps({"pool": {"namespace": "default", "name": "ci"}, "request_id": rid}).encode(),
        headers={"authorization": "Bearer " + token, "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = json.load(r)
            json.dump({"wait_s": time.time() - t0, "tries": tries, "host": body["vm"]["flintlock_host"]["name"]}, open(out, "w"))
            break
    except urllib.error.HTTPError as e:
        wait = float(e.headers.get("retry-after") or 1)
        time.sleep(min(max(wait, 0.2), 5))
    if time.time() - t0 > 300:
        json.dump({"wait_s": None, "tries": tries}, open(out, "w"))
        break
PY
            claimers+=($!)
        done
    fi
    local row marked="" judged="" whole="" now
    t0=$SECONDS
    while ((SECONDS - t0 < 300)); do
        row=$(q "SELECT extract(epoch FROM clock_timestamp()),
                        coalesce((SELECT extract(epoch FROM unreachable_since)::text FROM hosts WHERE name = 'doomed'), ''),
                        coalesce((SELECT extract(epoch FROM min(created_at))::text FROM events WHERE type = 'VM_LOST'), ''),
                        (SELECT count(*) FROM vms WHERE flintlock_host = 'sim' AND phase IN ('AVAILABLE', 'LEASED'))")
        IFS='|' read -r now m j n <<<"$row"
        [[ -z $marked && -n $m ]] && marked=$m
        [[ -z $judged && -n $j ]] && judged=$j
        if [[ -n $judged && $n -ge 4 ]]; then
            whole=$now
            break
        fi
        sleep 0.25
    done
    for p in "${claimers[@]}"; do wait "$p" || true; done
    kill -CONT "$doomed_pid"
    local waits=""
    if [[ $scenario == claimed ]]; then
        waits=$(python3 -c 'import json,sys; print(json.dumps([json.load(open(f)) for f in sys.argv[1:]]))' "$LOGS"/claim-"$name"-*.json)
    fi
    python3 - "$config" "$scenario" "$fault" "$marked" "$judged" "$whole" "$BOOT_MS" "${waits:-[]}" >>"$RESULTS" <<'PY'
import json, sys
config, scenario, fault, marked, judged, whole, boot_ms, waits = sys.argv[1:]
f = float(fault)
d = lambda x: round(float(x) - f, 2) if x else None
row = {"configuration": config, "scenario": scenario, "boot_s": int(boot_ms) / 1000,
       "marked_s": d(marked), "judged_s": d(judged), "whole_s": d(whole),
       "whole_after_judged_s": round(float(whole) - float(judged), 2) if whole and judged else None,
       "claims": json.loads(waits)}
print(json.dumps(row))
PY
    log "$name: $(tail -n 1 "$RESULTS")"
    [[ -n $whole ]] || die "$name: the pool was not whole on sim within 300 s of the fault; logs in $LOGS"
    # The next run gets the CPUs to itself.
    for p in "$app_pid" ${emu_pid:+"$emu_pid"} "$sim_pid" "$doomed_pid"; do stack_stop "$p"; done
}

for c in "${CONFIGS[@]}"; do
    for s in "${SCENS[@]}"; do
        run_one "$c" "$s"
    done
done

python3 - "$RESULTS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| configuration | scenario | marked unreachable | judged dead | whole again | whole after judged | boot | claims: wait s (tries) |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    claims = ", ".join(f"{c['wait_s']:.1f} ({c['tries']})" if c.get("wait_s") is not None else "none" for c in r["claims"]) or "—"
    print(f"| {r['configuration']} | {r['scenario']} | {r['marked_s']} s | {r['judged_s']} s | {r['whole_s']} s | {r['whole_after_judged_s']} s | {r['boot_s']} s | {claims} |")
PY
log "done: rows in $RESULTS (times from the fault)"
