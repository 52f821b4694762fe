#!/usr/bin/env bash
# Fuzz the HTTP API from its own OpenAPI document: scripts/schemathesis.sh [extra st run args...]
#
# Starts a private stack on free ports — PostgreSQL under .dev/schemathesis-pg (wiped first),
# flintlock-sim, poolmgr-local — seeds it (admin and client tokens, the simulator as host
# "local", pool default/ci with AVAILABLE VMs and one lease, host "put-target" held by the
# empty pool default/hold for fuzzed PUTs), then runs schemathesis
# (pinned, installed into .dev/schemathesis-venv on first use; settings in
# scripts/schemathesis.toml) against http://127.0.0.1:PORT/openapi.json with the admin token. Fails on any 5xx, any answer the
# document does not describe (status, content type, headers, body schema), bad data that is
# accepted, an operation that ignores its token, a method that is not refused with 405, or a
# panic in the server log. Stops everything it started on exit.
#
# Environment:
#   SCHEMATHESIS_MAX_EXAMPLES   test cases per operation and phase (default 40)
#   SCHEMATHESIS_SEED           hypothesis seed (default fixed, and with it schemathesis's
#                               deterministic generation, so CI runs are repeatable;
#                               "random" for a new, randomized run each time)
#   SCHEMATHESIS_WORKERS        concurrent workers (default 1: with more, operations
#                               interleave differently from run to run against one server)
# Extra arguments go to `st run`, e.g. --include-path-regex '^/v1/pools' or --phases fuzzing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

ST_VERSION=4.32.5
VENV=$ROOT/.dev/schemathesis-venv
WORK=$ROOT/.dev/schemathesis
PG_ST_DIR=$ROOT/.dev/schemathesis-pg
MAX_EXAMPLES=${SCHEMATHESIS_MAX_EXAMPLES:-40}
SEED=${SCHEMATHESIS_SEED:-20261129}
WORKERS=${SCHEMATHESIS_WORKERS:-1}

command -v python3 >/dev/null 2>&1 || die "python3 is needed for schemathesis (Debian: apt-get install python3 python3-venv)"
command -v curl >/dev/null 2>&1 || die "curl is needed (apt-get install curl)"

# --- schemathesis ----------------------------------------------------------------
mkdir -p "$ROOT/.dev"
if [[ "$("$VENV/bin/st" --version 2>/dev/null || true)" != *"version $ST_VERSION" ]]; then
    log "installing schemathesis==$ST_VERSION into ${VENV#"$ROOT"/}"
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv "$VENV" || die "cannot create $VENV (Debian: apt-get install python3-venv)"
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "schemathesis==$ST_VERSION" ||
        die "cannot install schemathesis==$ST_VERSION with pip"
fi
log "$("$VENV/bin/st" --version)"

# --- build --------------------------------------------------------------------------
cd "$ROOT"
log "building poolmgr-local and flintlock-sim"
stack_build debug --bins -p poolmgr-local -p flintlock-sim

rm -rf "$WORK"
mkdir -p "$WORK"

# --- PostgreSQL -----------------------------------------------------------------------
PG_FAST=1 stack_pg_fresh "$PG_ST_DIR"
DATABASE_URL=$(pg_create_db poolmgr) || die "could not create database poolmgr"
export DATABASE_URL

# --- flintlock-sim ----------------------------------------------------------------------
SIM_LOG=$WORK/flintlock-sim.log
stack_sim_start "$SIM_LOG" --listen 127.0.0.1:0 --boot-delay-ms 100 --delete-delay-ms 20

# --- poolmgr-local ------------------------------------------------------------------------
ADMIN_TOKEN=$(random_token)
CLIENT_TOKEN=$(random_token)
export POOLMGR_ADMIN_TOKENS="st-admin:$ADMIN_TOKEN" POOLMGR_CLIENT_TOKENS="st-client:$CLIENT_TOKEN"
# Hosts' secrets are encrypted at rest with it (functions/core/src/credentials.rs).
export POOLMGR_CREDENTIALS_KEY="$(random_token)$(random_token)"
export POOLMGR_FLINTLOCK_TIMEOUT_SECONDS=2 POOLMGR_HOOK_TIMEOUT_SECONDS=5
PORT=$(free_port)
URL=http://127.0.0.1:$PORT
APP_LOG=$WORK/poolmgr-local.log

# api TOKEN METHOD PATH [BODY]: print the body; fail unless 2xx.
api() {
    local tok=$1 method=$2 path=$3 body=${4:-}
    local args=(-sS --fail-with-body -X "$method" -H "Authorization: Bearer $tok" "$URL$path")
    [[ -n "$body" ]] && args+=(-H 'content-type: application/json' -d "$body")
    curl "${args[@]}" || die "$method $path failed"
}

log "starting poolmgr-local on $URL to seed it (reconcile every second)"
POOLMGR_RECONCILE_INTERVAL_SECONDS=1 stack_app_start "127.0.0.1:$PORT" "$APP_LOG"

# --- seed -------------------------------------------------------------------------------
log "seeding: host local ($SIM_ADDR), pool default/ci of 3 VMs, one lease"
stack_register_host "$URL" "$ADMIN_TOKEN" local "$SIM_ADDR"
api "$ADMIN_TOKEN" POST /v1/pools '{
  "namespace": "default", "name": "ci", "size": 3, "flintlock_hosts": ["local"],
  "replenishment": {"strategy": "REPLACE_ON_DELETE"},
  "microvm_template": {
    "kernel": {"image": "ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77", "filename": "boot/vmlinux"},
    "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
    "interfaces": [{"device_id": "eth1", "type": "TAP"}]
  }}' >/dev/null
available=0
for _ in $(seq 1 120); do
    available=$(api "$ADMIN_TOKEN" GET /v1/pools/default/ci | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"]["available"])')
    [[ "$available" == 3 ]] && break
    sleep 0.25
done
[[ "$available" == 3 ]] || { show_log_tail "$APP_LOG" 30; die "pool default/ci did not reach 3 AVAILABLE VMs (has $available)"; }
api "$CLIENT_TOKEN" POST /v1/claims '{"pool": {"namespace": "default", "name": "ci"}, "request_id": "seed-1"}' >/dev/null
# The host fuzzed PUTs update (scripts/schemathesis.toml), kept from fuzzed deletes by an empty
# pool naming it; nothing ever dials its address.
api "$ADMIN_TOKEN" POST /v1/hosts '{"name": "put-target", "address": "127.0.0.1:1", "tls": {"insecure": true}}' >/dev/null
api "$ADMIN_TOKEN" POST /v1/pools '{
  "namespace": "default", "name": "hold", "size": 0, "flintlock_hosts": ["put-target"],
  "replenishment": {"strategy": "REPLACE_ON_DELETE"},
  "microvm_template": {
    "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
    "interfaces": [{"device_id": "eth1", "type": "TAP"}]
  }}' >/dev/null

# The fuzzer registers hosts at whatever addresses it makes up. Restart with the reconciler
# parked (one pass at start, over the seeded state only) so nothing ever dials them: the
# only flintlock calls left are deletes of the seeded VMs and hook probes of named hosts.
log "restarting poolmgr-local with the reconciler parked"
stack_stop "$APP_PID"
POOLMGR_RECONCILE_INTERVAL_SECONDS=86400 stack_app_start "127.0.0.1:$PORT" "$APP_LOG"
log "stack ready: $(api "$ADMIN_TOKEN" GET /v1/pools/default/ci | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')"

# --- schemathesis ---------------------------------------------------------------------------
# Every check except positive_data_acceptance: valid-looking input is refused for reasons a
# schema cannot state (a pool naming an unregistered host, min_size above size, a host that is
# still in use), and those refusals are the contract.
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance
CHECKS+=,response_schema_conformance,negative_data_rejection,missing_required_header,unsupported_method
CHECKS+=,allow_header_conformance,ignored_auth,use_after_free,ensure_resource_availability
seed_args=()
[[ "$SEED" != random ]] && seed_args=(--seed "$SEED" --generation-deterministic)
# shellcheck disable=SC2054  # the commas are inside single arguments (lists for st)
cmd=("$VENV/bin/st" --config-file "$ROOT/scripts/schemathesis.toml" run "$URL/openapi.json"
    -H "Authorization: Bearer $ADMIN_TOKEN"
    --checks "$CHECKS"
    --max-examples "$MAX_EXAMPLES" "${seed_args[@]}"
    --workers "$WORKERS"
    --request-timeout 30
    --suppress-health-check too_slow,filter_too_much
    --report junit --report-dir "$WORK/report"
    "$@")
log "st run $URL/openapi.json --checks $CHECKS --max-examples $MAX_EXAMPLES ${seed_args[*]} --workers $WORKERS $*"
started=$SECONDS
status=0
"${cmd[@]}" || status=$?
log "schemathesis finished in $((SECONDS - started)) s (exit $status); report: ${WORK#"$ROOT"/}/report"

if grep -q 'panicked' "$APP_LOG"; then
    grep -m 5 'panicked' "$APP_LOG" >&2
    die "poolmgr-local panicked during the run; see ${APP_LOG#"$ROOT"/}"
fi
if [[ $status -ne 0 ]]; then
    die "schemathesis found problems (above); server log: ${APP_LOG#"$ROOT"/}"
fi
log "schemathesis: no server error, every answer as documented"
