#!/usr/bin/env bash
# Claim latency of one client through the HTTP stack: N sequential claims against a
# release-built poolmgr-local on a private PostgreSQL (fsync on, default settings).
#
#   scripts/bench-claim-latency.sh [N]      (default 1000)
#
# Prints median/p95/p99/max for claims without and with a request_id. The VMs are seeded as
# AVAILABLE rows directly (with POOLMGR_CLAIM_VERIFY=off a claim never calls flintlock, so no
# simulator is needed; the checked claim: scripts/bench-claim-check.sh); the pool's
# size matches the seeded rows so the reconciler neither adds nor sheds VMs meanwhile.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"
N=${1:-1000}
DIR=$ROOT/.dev/bench-pg

log "building release binaries (poolmgr-local, poolmgr-bench)"
stack_build release -q -p poolmgr-local -p poolmgr-bench
BIN=$STACK_BIN

stack_pg_fresh "$DIR"
DB_URL=$(pg_create_db poolmgr_bench)
PORT=$(free_port)
TOKEN=bench-$(random_token)
: >"$ROOT/.dev/bench-poolmgr-local.log"
DATABASE_URL=$DB_URL POOLMGR_ADMIN_TOKENS=bench:$TOKEN RUST_LOG=warn POOLMGR_CLAIM_VERIFY=off \
    stack_app_start "127.0.0.1:$PORT" "$ROOT/.dev/bench-poolmgr-local.log"

log "creating pool default/bench and seeding $((2 * N)) AVAILABLE VMs"
curl -fsS -o /dev/null -X POST "http://127.0.0.1:$PORT/v1/pools" -H "Authorization: Bearer $TOKEN" \
    -H 'content-type: application/json' -d '{"name": "bench", "size": '"$((2 * N))"', "replenishment": {"strategy": "REPLACE_ON_DELETE"},
      "microvm_template": {"root_volume": {"id": "root", "source": {"container_source": "img"}}, "interfaces": [{"device_id": "eth1"}]}}'
"$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d "$DB_URL" -c "
    INSERT INTO hosts (name, address) VALUES ('bench-host', '127.0.0.1:1');
    INSERT INTO vms (id, uid, pool_namespace, pool_name, flintlock_host, phase, network_interfaces)
    SELECT 'bench-' || g, 'UID' || g, 'default', 'bench', 'bench-host', 'AVAILABLE',
           '{\"eth1\": {\"host_device_name\": \"fltap0000001\", \"index\": 3, \"mac_address\": \"aa:bb:cc:dd:ee:ff\"}}'
    FROM generate_series(1, $((2 * N))) g;" -c "VACUUM ANALYZE;"

"$BIN/poolmgr-bench" claim-latency --endpoint "http://127.0.0.1:$PORT" --token "$TOKEN" --n "$N"
"$BIN/poolmgr-bench" claim-latency --endpoint "http://127.0.0.1:$PORT" --token "$TOKEN" --n "$N" --request-ids
