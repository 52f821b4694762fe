#!/usr/bin/env bash
# The committed OpenAPI document is enough for another language: scripts/python-client.sh
#
# Installs a pinned openapi-python-client into .dev/python-client-venv (Python 3 with venv, on
# first use), generates a Python client from docs/openapi.json into .dev/python-client/, and
# fails when the generator warns (it drops an operation or a schema it cannot handle, and says
# so only in a warning) or when an operation of the document has no generated module. Then it
# starts a private stack on free ports (PostgreSQL under .dev/python-client-pg, wiped first,
# flintlock-sim, poolmgr-local) and drives it only through the generated client
# (scripts/python-client.py): host create, pool create, claim, the same claim again (replayed),
# heartbeat, release, and the contract's errors as the generated Error model. Stops everything
# it started on exit.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

OPC_VERSION=0.29.1
VENV=$ROOT/.dev/python-client-venv
WORK=$ROOT/.dev/python-client
PG_DIR=$ROOT/.dev/python-client-pg
DOC=$ROOT/docs/openapi.json

command -v python3 >/dev/null 2>&1 || die "python3 is needed (Debian: apt-get install python3 python3-venv)"
command -v curl >/dev/null 2>&1 || die "curl is needed (apt-get install curl)"

# --- the generator ---------------------------------------------------------------------
mkdir -p "$ROOT/.dev"
if [[ "$("$VENV/bin/openapi-python-client" --version 2>/dev/null || true)" != *"version: $OPC_VERSION" ]]; then
    log "installing openapi-python-client==$OPC_VERSION into ${VENV#"$ROOT"/}"
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv "$VENV" || die "cannot create $VENV (Debian: apt-get install python3-venv)"
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "openapi-python-client==$OPC_VERSION" ||
        die "cannot install openapi-python-client==$OPC_VERSION with pip"
fi
log "$("$VENV/bin/openapi-python-client" --version)"

# --- generate ----------------------------------------------------------------------------
rm -rf "$WORK"
mkdir -p "$WORK"
# No post hooks: the formatter (ruff) is not needed to run the client, and its absence is a
# warning that would hide the ones that matter.
printf 'post_hooks: []\n' >"$WORK/config.yaml"
log "generating a Python client from ${DOC#"$ROOT"/}"
status=0
"$VENV/bin/openapi-python-client" generate --path "$DOC" --meta none --config "$WORK/config.yaml" \
    --output-path "$WORK/poolmgr_api" >"$WORK/generate.log" 2>&1 || status=$?
cat "$WORK/generate.log" >&2
[[ $status -eq 0 ]] || die "openapi-python-client failed (exit $status)"
if grep -qiE 'warning|unable to|will not be generated|cannot' "$WORK/generate.log"; then
    die "openapi-python-client warned (above): a schema or an operation of docs/openapi.json was not generated; make the schema a shape generators handle (docs/design-notes.md, \"A document other languages can generate from\")"
fi

# --- every operation was generated ----------------------------------------------------------
"$VENV/bin/python" - "$DOC" "$WORK/poolmgr_api" <<'PY'
import json, pathlib, re, sys

doc = json.loads(pathlib.Path(sys.argv[1]).read_text())
pkg = pathlib.Path(sys.argv[2])

def snake(s):
    return re.sub(r"[^a-z0-9]+", "_", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s).lower()).strip("_")

want = {}
for path, item in doc["paths"].items():
    for method, op in item.items():
        if method not in ("get", "put", "post", "delete", "patch", "head", "options", "trace"):
            continue
        if "operationId" not in op:
            sys.exit(f"{method.upper()} {path} has no operationId: generators name their functions after it")
        tag = snake(op["tags"][0]) if op.get("tags") else "default"
        want[f"api/{tag}/{snake(op['operationId'])}.py"] = f"{method.upper()} {path}"
have = {str(p.relative_to(pkg)) for p in pkg.glob("api/*/*.py") if p.name != "__init__.py"}
missing = sorted(f"{op} (expected {mod})" for mod, op in want.items() if mod not in have)
extra = sorted(have - set(want))
for mod, op in want.items():
    if mod in have and "def sync_detailed(" not in (pkg / mod).read_text():
        missing.append(f"{op} ({mod} has no sync_detailed)")
if missing:
    print("operations of the document without a generated module:", *missing, sep="\n  ", file=sys.stderr)
if extra:
    print("generated modules the document does not name:", *extra, sep="\n  ", file=sys.stderr)
if missing or extra:
    sys.exit(1)
print(f"==> all {len(want)} operations of the document were generated", file=sys.stderr)
PY

# --- a private stack --------------------------------------------------------------------
cd "$ROOT"
log "building poolmgr-local and flintlock-sim"
stack_build debug --bins -p poolmgr-local -p flintlock-sim
PG_FAST=1 stack_pg_fresh "$PG_DIR"
DATABASE_URL=$(pg_create_db poolmgr) || die "could not create database poolmgr"
export DATABASE_URL
stack_sim_start "$WORK/flintlock-sim.log" --listen 127.0.0.1:0 --boot-delay-ms 100 --delete-delay-ms 20
ADMIN_TOKEN=$(random_token)
CLIENT_TOKEN=$(random_token)
export POOLMGR_ADMIN_TOKENS="py-admin:$ADMIN_TOKEN" POOLMGR_CLIENT_TOKENS="py-client:$CLIENT_TOKEN"
export POOLMGR_CREDENTIALS_KEY="$(random_token)$(random_token)"
export POOLMGR_RECONCILE_INTERVAL_SECONDS=1
PORT=$(free_port)
APP_LOG=$WORK/poolmgr-local.log
stack_app_start "127.0.0.1:$PORT" "$APP_LOG"

# --- the generated client against it ------------------------------------------------------
log "driving $APP_URL through the generated client (scripts/python-client.py)"
status=0
PYTHONPATH=$WORK "$VENV/bin/python" "$ROOT/scripts/python-client.py" \
    --url "$APP_URL" --admin-token "$ADMIN_TOKEN" --client-token "$CLIENT_TOKEN" --host-address "$SIM_ADDR" || status=$?
if grep -q 'panicked' "$APP_LOG"; then
    grep -m 5 'panicked' "$APP_LOG" >&2
    die "poolmgr-local panicked; see ${APP_LOG#"$ROOT"/}"
fi
[[ $status -eq 0 ]] || { show_log_tail "$APP_LOG" 30; die "the generated Python client failed (above); server log: ${APP_LOG#"$ROOT"/}"; }
log "python client: every operation generated, and claim, replay, heartbeat, release, pool and host create work through it"
