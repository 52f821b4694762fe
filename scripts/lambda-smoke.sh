#!/usr/bin/env bash
# Smoke test of the functions as AWS Lambda functions, through cargo-lambda's emulator:
#
#   scripts/lambda-smoke.sh
#
# Installs cargo-lambda when missing (PyPI, into a venv under .dev/), starts a private
# PostgreSQL (.dev/lambda-pg) and migrates it, starts flintlock-sim, then
# `cargo lambda watch` on a free port with the functions' environment, and drives:
#   hosts function      register the simulator
#   pools function      create a pool of 3
#   reconcile function  `cargo lambda invoke reconcile --data-file functions/reconcile/events/scheduled.json`
#                       until the pool has 3 AVAILABLE VMs
#   claims function     claim, then the same request_id again (replay: same lease)
#   leases function     release it (204), then GET (404)
# checking every answer, measures the cold start (first request after `watch` starts a
# function) and warm claim latency, checks the EMF metric lines, prints a summary, and stops
# everything it started.
#
# Environment (optional): LAMBDA_SMOKE_PORT (default: a free port), CARGO_LAMBDA (path to
# cargo-lambda).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV=$ROOT/.dev
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
# shellcheck source=lib/http.sh
. "$ROOT/scripts/lib/http.sh"

PG_DIR_OURS=$DEV/lambda-pg
WORK=$DEV/lambda-smoke
VENV=$DEV/cargo-lambda-venv
SIM_LOG=$WORK/flintlock-sim.log
WATCH_LOG=$WORK/cargo-lambda-watch.log
FUNCTIONS=(claims leases pools hosts events reconcile)

# Every failure shows the end of the emulator's log too.
DIE_LOG=$WATCH_LOG

command -v curl >/dev/null 2>&1 || die "curl is required (apt-get install curl)"
command -v python3 >/dev/null 2>&1 || die "python3 is required"
mkdir -p "$WORK"

# --- cargo-lambda ---------------------------------------------------------------
CARGO_LAMBDA=${CARGO_LAMBDA:-}
if [[ -z "$CARGO_LAMBDA" ]]; then
    if command -v cargo-lambda >/dev/null 2>&1; then
        CARGO_LAMBDA=$(command -v cargo-lambda)
    elif [[ -x "$VENV/bin/cargo-lambda" ]]; then
        CARGO_LAMBDA=$VENV/bin/cargo-lambda
    else
        log "installing cargo-lambda 1.9 from PyPI into $VENV"
        python3 -m venv "$VENV" || die "python3 -m venv failed; install python3-venv (apt-get install python3-venv) or cargo-lambda yourself"
        "$VENV/bin/python" -m pip install -q 'cargo-lambda==1.9.*' ||
            die "pip install cargo-lambda failed; install it yourself (pip install 'cargo-lambda==1.9.*') and rerun"
        CARGO_LAMBDA=$VENV/bin/cargo-lambda
    fi
fi
# cargo finds `cargo lambda` as cargo-lambda on PATH.
PATH="$(dirname "$CARGO_LAMBDA"):$PATH"
export PATH
log "using $(cargo lambda --version 2>/dev/null || echo cargo-lambda)"

# --- build ------------------------------------------------------------------------
cd "$ROOT"
log "building migrate and flintlock-sim"
stack_build debug -q --bin migrate --bin flintlock-sim
# One binary at a time, as `cargo lambda watch` runs them (`cargo run --bin NAME`), so the
# cold starts below measure the function, not the compiler.
for f in "${FUNCTIONS[@]}"; do
    log "building the $f function (cargo build --bin $f)"
    cargo build -q --bin "$f" || die "building $f failed"
done
BIN=$STACK_BIN
# What `cargo run` itself adds to every cold start under watch (its freshness check and
# the process start): the claims binary without DATABASE_URL exits right after reading its
# configuration.
t0=$(date +%s.%N)
env -u DATABASE_URL cargo run -q --bin claims >/dev/null 2>&1 || true
t1=$(date +%s.%N)
CARGO_RUN_MS=$(python3 -c "print(round(($t1 - $t0) * 1000, 1))")

# --- PostgreSQL ---------------------------------------------------------------------
PG_FAST=1 stack_pg_fresh "$PG_DIR_OURS"
DATABASE_URL=$(pg_create_db poolmgr) || die "could not create database poolmgr"
export DATABASE_URL
log "migrating $DATABASE_URL"
"$BIN/migrate" >"$WORK/migrate.log" 2>&1 || {
    show_log_tail "$WORK/migrate.log"
    die "migrate failed"
}

# --- flintlock-sim --------------------------------------------------------------------
: >"$SIM_LOG"
stack_sim_start "$SIM_LOG" --listen 127.0.0.1:0 --boot-delay-ms 200 --delete-delay-ms 50

# --- cargo lambda watch -----------------------------------------------------------------
PORT=${LAMBDA_SMOKE_PORT:-$(free_port)}
ADMIN_TOKEN=smoke-admin-$(random_token)
CLIENT_TOKEN=smoke-client-$(random_token)
export POOLMGR_ADMIN_TOKENS="admin:$ADMIN_TOKEN" POOLMGR_CLIENT_TOKENS="ci:$CLIENT_TOKEN"
# Hosts' secrets are encrypted at rest with it (functions/core/src/credentials.rs).
export POOLMGR_CREDENTIALS_KEY="$(random_token)$(random_token)"
export RUST_LOG=${RUST_LOG:-info}
# The reconcile pass must finish well inside the emulator's invoke timeout.
export POOLMGR_RECONCILE_DEADLINE_SECONDS=20
: >"$WATCH_LOG"
log "starting cargo lambda watch on 127.0.0.1:$PORT (log: $WATCH_LOG)"
stack_spawn "cargo lambda watch" "$WATCH_LOG" "$WATCH_LOG" cargo lambda watch --ignore-changes -A 127.0.0.1 -P "$PORT"
WATCH_PID=$SPAWNED_PID
URL=http://127.0.0.1:$PORT/lambda-url
up=0
for _ in $(seq 1 300); do
    pid_alive "$WATCH_PID" || die "cargo lambda watch exited"
    if curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$PORT/"; then
        up=1
        break
    fi
    sleep 0.2
done
[[ $up == 1 ]] || die "cargo lambda watch did not listen on 127.0.0.1:$PORT within 60 s"

# --- HTTP helpers -------------------------------------------------------------------------
# call METHOD FUNCTION PATH TOKEN [BODY]: one request to FUNCTION through the emulator (lib/http.sh).
http_init "$WORK"
call() { http_call "$1" "$URL/$2$3" "$4" "${5:-}"; }

# --- hosts, pools --------------------------------------------------------------------------
call POST hosts /v1/hosts "$ADMIN_TOKEN" "{\"name\":\"sim\",\"address\":\"$SIM_ADDR\",\"tls\":{\"insecure\":true}}"
http_expect 201 "POST /v1/hosts through the hosts function"
COLD_HOSTS=$(http_ms "$SECS")
http_check 'b["name"] == "sim"' "the hosts function did not answer the host"
log "hosts: registered flintlock-sim (cold start ${COLD_HOSTS} ms)"

POOL='{"namespace":"default","name":"smoke","size":3,"flintlock_hosts":["sim"],
 "replenishment":{"strategy":"REPLACE_ON_DELETE"},
 "microvm_template":{"kernel":{"image":"ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77","filename":"boot/vmlinux"},
  "root_volume":{"id":"root","source":{"container_source":"ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
  "interfaces":[{"device_id":"eth1","type":"TAP"}]}}'
call POST pools /v1/pools "$ADMIN_TOKEN" "$POOL"
http_expect 201 "POST /v1/pools through the pools function"
COLD_POOLS=$(http_ms "$SECS")
log "pools: created default/smoke, size 3 (cold start ${COLD_POOLS} ms)"

# --- reconcile ------------------------------------------------------------------------------
available=0
COLD_RECONCILE=""
for i in $(seq 1 40); do
    t0=$(date +%s.%N)
    if ! cargo lambda invoke reconcile --invoke-address 127.0.0.1 --invoke-port "$PORT" \
        --data-file functions/reconcile/events/scheduled.json >"$WORK/reconcile.json" 2>"$WORK/reconcile.err"; then
        show_log_tail "$WORK/reconcile.err"
        die "cargo lambda invoke reconcile failed (invoke $i)"
    fi
    t1=$(date +%s.%N)
    [[ -n "$COLD_RECONCILE" ]] || COLD_RECONCILE=$(python3 -c "import sys; print(round(($t1 - $t0) * 1000, 1))")
    # A loop report: its passes, and what they did in total.
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); assert r["passes"] >= 1 and "pools" in r["total"] and "created" in r["total"], r' \
        "$WORK/reconcile.json" || {
        cat "$WORK/reconcile.json" >&2
        die "the reconcile function did not answer a loop report"
    }
    call GET pools /v1/pools/default/smoke "$ADMIN_TOKEN"
    http_expect 200 "GET /v1/pools/default/smoke"
    available=$(http_json 'b["status"]["available"]')
    log "reconcile invoke $i: $(tr -d '\n' <"$WORK/reconcile.json" | cut -c1-160); available=$available"
    [[ "$available" -ge 3 ]] && break
    sleep 0.3
done
[[ "$available" -ge 3 ]] || die "the pool did not reach 3 AVAILABLE VMs after 40 reconcile invokes"

# --- claims: claim, replay ---------------------------------------------------------------------
CLAIM='{"pool":{"namespace":"default","name":"smoke"},"request_id":"smoke-1"}'
call POST claims /v1/claims "$CLIENT_TOKEN" "$CLAIM"
http_expect 200 "POST /v1/claims (first claim)"
COLD_CLAIM=$(http_ms "$SECS")
http_check 'b["replayed"] is False' "the first claim must not be a replay"
http_check 'b["lease"]["request_id"] == "smoke-1" and b["vm"]["flintlock_host"]["name"] == "sim"' "claim answer lacks the lease or VM"
LEASE=$(http_json 'b["lease"]["lease_id"]')
log "claims: leased $LEASE (cold start ${COLD_CLAIM} ms)"

call POST claims /v1/claims "$CLIENT_TOKEN" "$CLAIM"
http_expect 200 "POST /v1/claims (replay)"
http_check "b['replayed'] is True and b['lease']['lease_id'] == '$LEASE'" "the replay must return the same lease with replayed=true"
grep -qi '^idempotent-replayed: *true' "$HTTP_HEADERS" || {
    cat "$HTTP_HEADERS" >&2
    die "the replay lacks the Idempotent-Replayed: true header"
}
log "claims: replay returned the same lease, replayed=true, Idempotent-Replayed: true ($(http_ms "$SECS") ms)"

# --- leases: release ------------------------------------------------------------------------------
call DELETE leases "/v1/leases/$LEASE" "$CLIENT_TOKEN"
http_expect 204 "DELETE /v1/leases/$LEASE"
COLD_RELEASE=$(http_ms "$SECS")
call GET leases "/v1/leases/$LEASE" "$CLIENT_TOKEN"
http_expect 404 "GET /v1/leases/$LEASE after the release"
http_check 'b["error"]["status"] == "NOT_FOUND"' "a released lease answers NOT_FOUND"
log "leases: released (cold start ${COLD_RELEASE} ms), then 404"

# --- warm latency ------------------------------------------------------------------------------------
WARM=()
for n in 2 3; do
    call POST claims /v1/claims "$CLIENT_TOKEN" "{\"pool\":{\"namespace\":\"default\",\"name\":\"smoke\"},\"request_id\":\"smoke-$n\"}"
    http_expect 200 "POST /v1/claims (warm claim smoke-$n)"
    http_check 'b["replayed"] is False' "a fresh claim must not be a replay"
    WARM+=("$(http_ms "$SECS")")
done
REPLAYS=()
for _ in $(seq 1 20); do
    call POST claims /v1/claims "$CLIENT_TOKEN" '{"pool":{"namespace":"default","name":"smoke"},"request_id":"smoke-2"}'
    http_expect 200 "POST /v1/claims (warm replay)"
    REPLAYS+=("$(http_ms "$SECS")")
done
REPLAY_STATS=$(python3 -c 'import statistics, sys
v = sorted(float(x) for x in sys.argv[1:])
print(f"median {statistics.median(v):.1f} ms, p90 {v[int(len(v) * 0.9) - 1]:.1f} ms, min {v[0]:.1f} ms")' "${REPLAYS[@]}")

# --- EMF metrics on the functions' stdout ---------------------------------------------------------------
# cargo lambda watch copies the functions' stdout into its log on its own schedule: wait (bounded) for
# the line instead of reading the log at one moment.
python3 - "$WATCH_LOG" <<'PY' || die "no CloudWatch EMF line for poolmgr_vm_claims_total in the watch log within 30 s"
import json, sys, time
def found():
    for line in open(sys.argv[1], errors="replace"):
        line = line.strip()
        if not line.startswith("{") or '"_aws"' not in line:
            continue
        doc = json.loads(line)
        d = doc["_aws"]["CloudWatchMetrics"][0]
        if d["Namespace"] == "poolmgr" and any(m["Name"] == "poolmgr_vm_claims_total" for m in d["Metrics"]):
            assert d["Dimensions"] == [["pool_namespace", "pool_name", "replayed"]], d
            assert isinstance(doc["_aws"]["Timestamp"], int)
            return True
    return False
deadline = time.monotonic() + 30
while not found():
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.2)
PY
log "EMF: claims metrics found on the functions' stdout"
if grep -q 'Compiling' <(sed -n '/starting Runtime server/,$p' "$WATCH_LOG"); then
    log "note: cargo compiled something after watch started; the cold starts above include it"
fi

cat <<EOF

lambda smoke test passed (cargo lambda watch on 127.0.0.1:$PORT, debug build)
  cold start, first request to a function (cargo run + process start + init + first DB connection + request;
  cargo run alone, to a configuration error: ${CARGO_RUN_MS} ms):
    hosts     POST /v1/hosts            ${COLD_HOSTS} ms
    pools     POST /v1/pools            ${COLD_POOLS} ms
    reconcile invoke (whole CLI call)   ${COLD_RECONCILE} ms
    claims    POST /v1/claims           ${COLD_CLAIM} ms
    leases    DELETE /v1/leases/ID      ${COLD_RELEASE} ms
  warm claims (fresh VM):               ${WARM[*]} ms
  warm claim replays (20):              ${REPLAY_STATS}
EOF
