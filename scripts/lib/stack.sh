# shellcheck shell=bash
# The local stack, started and stopped from one place: a private PostgreSQL (pg.sh),
# flintlock-sim, poolmgr-local (or any other process a script runs beside them), the
# simulator registered as a host, and the pid files of dev.sh. Every script that runs the
# stack (dev, chaos, schemathesis, test-pgbouncer, lambda-smoke, bench-*) calls these
# functions; the scripts keep only what is their own (seeding, load, checks, reports).
#
# Why a shell library and not a Rust xtask: CI runs these scripts on a fresh machine, and the
# library costs nothing to build and nothing to install; the scripts already were bash, so the
# move changes no flag, environment variable or output file. A Rust binary would give typed
# errors and real process supervision, but it is one more crate to compile before the first
# test, and the supervision needed here is small: every process is started in its own session
# (setsid) and remembered, and the EXIT trap (common.sh's at_exit) stops what is still running,
# newest first, so a failed or interrupted script leaves nothing behind.
#
#   . "$ROOT/scripts/lib/stack.sh"      # sources common.sh, pg.sh and preflight.sh too
#
# Functions:
#   stack_build PROFILE CARGO_ARGS...  cargo build (debug|release); sets STACK_BIN to its directory
#   stack_pg_fresh DIR [HINT]   stop a cluster left in DIR, wipe DIR, pg_start it (PG_FAST from the
#                               environment), stop it on exit; HINT ends the error if it fails
#   stack_spawn NAME OUT ERR CMD...  CMD in its own session, stdout appended to OUT and stderr to
#                               ERR (may be the same file), stopped on exit; sets SPAWNED_PID
#   stack_stop PID [KILL]       stop a process stack_spawn started: TERM to its session's group,
#                               KILL after 15 s (or KILL at once), reaped; no-op if already stopped
#   stack_wait PID              wait for a process stack_spawn started to end; its exit status
#   stack_sim_start [--out FILE] LOG [ARGS...]  flintlock-sim ARGS (default --listen 127.0.0.1:0)
#                               until it prints its address; sets SIM_PID, SIM_ADDR
#   stack_app_start [--out FILE] [--bin BIN] ADDR LOG  poolmgr-local on ADDR (with the caller's
#                               environment) until /healthz answers 200; sets APP_PID, APP_URL
#   stack_register_host URL TOKEN NAME ADDR  POST /v1/hosts (PUT on 409): ADDR as host NAME
#   stack_bench_credentials     set ADMIN, CLIENT (bearer tokens), WAKE_KEY, WAKE_SECRET (the
#                               wakes' SigV4 credentials), DB_ARN and TOKENS_ARN (the secrets')
#   stack_reconcile_fn_start NAME DB_URL EMU_PORT EVERY_MS TIMEOUT_MS LOGDIR [KEY=VALUE...]
#                               the deployed shape's reconcile function: $STACK_BIN/reconcile
#                               under `lambda-emu schedule`, as stack_bench_credentials set it up;
#                               returns once its Invoke API listens; sets SPAWNED_PID
#   pid_alive PID               PID exists and is not a zombie
#   stack_pidfile_pid FILE NAME print the PID in FILE if that process is alive and runs NAME
#   stack_stop_pidfile FILE NAME [SIGNAL]  stop the process in FILE (checked as above), remove FILE
#
# Never: kills a process it did not start or cannot identify by name, or wipes a directory it
# was not given.

_STACK_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STACK_ROOT=$(cd "$_STACK_LIB_DIR/../.." && pwd)
# shellcheck source=pg.sh
. "$_STACK_LIB_DIR/pg.sh"
# shellcheck source=preflight.sh
. "$_STACK_LIB_DIR/preflight.sh"

# PIDs started by stack_spawn and not stopped yet, with their names.
declare -A _STACK_LIVE=()

stack_build() {
    local profile=$1
    shift
    local args=("$@")
    [[ $profile == release ]] && args=(--release "${args[@]}")
    (cd "$STACK_ROOT" && cargo build "${args[@]}") ||
        die "build failed; fix the errors above and rerun scripts/$(basename "$0")"
    STACK_BIN=${CARGO_TARGET_DIR:-$STACK_ROOT/target}/$profile
}

stack_pg_fresh() {
    local dir=$1 hint=${2:+, $2}
    if [[ -f "$dir/data/postmaster.pid" ]]; then
        pg_stop "$dir" || die "could not stop the PostgreSQL left in $dir; kill it and remove that directory"
    fi
    rm -rf "$dir"
    # Registered first: a start that timed out may still leave a server running.
    at_exit pg_stop "$dir"
    pg_start "$dir" || die "could not start PostgreSQL in $dir; see above$hint"
}

# --- processes ---------------------------------------------------------------------------

# An exited child that bash has not reaped yet still has a /proc entry, in state Z.
pid_alive() {
    local pid=$1 stat
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ "${stat:0:1}" != Z && "${stat:0:1}" != X ]]
}

# _stack_term PID NAME SIGNAL: SIGNAL to PID's process group (or PID alone when it leads
# none), KILL after 15 s.
_stack_term() {
    local pid=$1 name=$2 sig=$3 i
    pid_alive "$pid" || return 0
    if [[ $sig == KILL ]]; then
        log "killing $name (pid $pid) with SIGKILL"
    else
        log "stopping $name (pid $pid)"
    fi
    kill "-$sig" -- "-$pid" 2>/dev/null || kill "-$sig" "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    log "$name (pid $pid) did not exit after 15 s; killing it"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}

stack_spawn() {
    local name=$1 out=$2 errf=$3
    shift 3
    local session=()
    # Its own session: a terminal's Ctrl-C reaches only the script, which stops it in order.
    command -v setsid >/dev/null 2>&1 && session=(setsid)
    if [[ $out == "$errf" ]]; then
        "${session[@]}" "$@" >>"$out" 2>&1 </dev/null &
    else
        "${session[@]}" "$@" >>"$out" 2>>"$errf" </dev/null &
    fi
    SPAWNED_PID=$!
    _STACK_LIVE[$SPAWNED_PID]=$name
    at_exit stack_stop "$SPAWNED_PID"
}

stack_stop() {
    local pid=$1 sig=${2:-TERM}
    [[ -n "$pid" && -n "${_STACK_LIVE[$pid]:-}" ]] || return 0
    _stack_term "$pid" "${_STACK_LIVE[$pid]}" "$sig"
    unset "_STACK_LIVE[$pid]"
    wait "$pid" 2>/dev/null || true
}

stack_wait() {
    local pid=$1 status=0
    wait "$pid" || status=$?
    unset "_STACK_LIVE[$pid]"
    return "$status"
}

stack_sim_start() {
    local out=""
    if [[ ${1:-} == --out ]]; then
        out=$2
        shift 2
    fi
    local log_file=$1
    shift
    [[ $# -gt 0 ]] || set -- --listen 127.0.0.1:0
    out=${out:-$log_file}
    # Only what this start prints counts: a restarted simulator appends to the same files.
    local from t0=$SECONDS line
    from=$(($(stat -c %s "$out" 2>/dev/null || echo 0) + 1))
    log "starting flintlock-sim (log: ${log_file#"$STACK_ROOT"/})"
    stack_spawn flintlock-sim "$out" "$log_file" "$STACK_BIN/flintlock-sim" "$@"
    SIM_PID=$SPAWNED_PID
    SIM_ADDR=""
    while ((SECONDS - t0 < 30)); do
        line=$(tail -c "+$from" "$out" 2>/dev/null | grep -m 1 -oE 'flintlock-sim listening on [0-9.]+:[0-9]+' || true)
        if [[ -n "$line" ]]; then
            SIM_ADDR=${line##* }
            log "flintlock-sim listening on $SIM_ADDR (pid $SIM_PID)"
            return 0
        fi
        if ! pid_alive "$SIM_PID"; then
            show_log_tail "$log_file"
            die "flintlock-sim exited during startup; see $log_file"
        fi
        sleep 0.1
    done
    show_log_tail "$log_file"
    die "flintlock-sim did not print 'flintlock-sim listening on ADDR' within 30 s; see $log_file"
}

stack_app_start() {
    local out="" bin=""
    while [[ ${1:-} == --* ]]; do
        case $1 in
            --out) out=$2 ;;
            --bin) bin=$2 ;;
            *) die "stack_app_start: unknown option $1" ;;
        esac
        shift 2
    done
    local addr=$1 log_file=$2 host port code t0=$SECONDS
    bin=${bin:-$STACK_BIN/poolmgr-local}
    host=${addr%:*}
    port=${addr##*:}
    case "$host" in
        "" | 0.0.0.0) host=127.0.0.1 ;;
        "[::]") host="[::1]" ;;
    esac
    APP_URL=http://$host:$port
    STACK_APP_LOG=$log_file
    log "starting poolmgr-local on $addr (log: ${log_file#"$STACK_ROOT"/})"
    POOLMGR_HTTP_ADDR=$addr stack_spawn poolmgr-local "${out:-$log_file}" "$log_file" "$bin"
    APP_PID=$SPAWNED_PID
    while ((SECONDS - t0 < 60)); do
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$APP_URL/healthz" 2>/dev/null || true)
        [[ "$code" == 200 ]] && return 0
        if ! pid_alive "$APP_PID"; then
            show_log_tail "$log_file"
            die "poolmgr-local exited during startup; see $log_file"
        fi
        sleep 0.2
    done
    show_log_tail "$log_file"
    die "poolmgr-local did not answer 200 on $APP_URL/healthz within 60 s; see $log_file"
}

stack_register_host() {
    local url=$1 token=$2 name=$3 addr=$4 body resp code
    body=$(printf '{"name":"%s","address":"%s","tls":{"insecure":true}}' "$name" "$addr")
    resp=$(mktemp)
    code=$(curl -sS -o "$resp" -w '%{http_code}' -X POST "$url/v1/hosts" \
        -H "Authorization: Bearer $token" -H 'content-type: application/json' -d "$body" || true)
    case "$code" in
        2??) log "registered flintlock-sim as host '$name' ($addr)" ;;
        409)
            log "host '$name' already exists; updating its address to $addr"
            code=$(curl -sS -o "$resp" -w '%{http_code}' -X PUT "$url/v1/hosts/$name" \
                -H "Authorization: Bearer $token" -H 'content-type: application/json' -d "$body" || true)
            ;;
    esac
    if [[ "$code" != 2?? ]]; then
        printf 'response body: %s\n' "$(cat "$resp")" >&2
        rm -f "$resp"
        show_log_tail "${STACK_APP_LOG:-}"
        die "registering host '$name' answered '${code:-no response}'; see ${STACK_APP_LOG:-the server log}"
    fi
    rm -f "$resp"
}

# --- the deployed shape (bench scripts) ----------------------------------------------------

stack_bench_credentials() {
    ADMIN=bench-admin-$(random_token)
    CLIENT=bench-client-$(random_token)
    # The deployed poolmgr-local signs its wakes with these (the emulator checks the signature).
    WAKE_KEY=AKIDBENCH$(random_token | cut -c1-12 | tr 'a-f' 'A-F')
    WAKE_SECRET=$(random_token)
    DB_ARN=arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/db-Bench01
    TOKENS_ARN=arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/tokens-Bench01
}

# stack_reconcile_fn_start NAME DB_URL EMU_PORT EVERY_MS TIMEOUT_MS LOGDIR [KEY=VALUE...]: the
# reconcile function invoked every EVERY_MS as EventBridge Scheduler does and woken through the
# emulated Invoke API on 127.0.0.1:EMU_PORT, each invocation at most TIMEOUT_MS; it reads
# DB_URL's database (port and name; the secret's host is a stand-in) and the tokens from
# emulated Secrets Manager secrets; each KEY=VALUE is one more variable of the function.
stack_reconcile_fn_start() {
    local name=$1 url=$2 emu_port=$3 every=$4 timeout=$5 logdir=$6 e
    shift 6
    local db=${url##*/} pg_port=${url##*:} fenv=() db_secret tokens_secret
    db=${db%%\?*}
    pg_port=${pg_port%%/*}
    for e in "$@"; do fenv+=(--env "$e"); done
    db_secret='{"engine": "postgres", "username": "postgres", "password": "", "host": "poolmgr-db.abcdefghijkl.eu-west-1.rds.amazonaws.com", "port": 5432, "dbname": "postgres"}'
    tokens_secret=$(printf '{"admin_tokens": "bench:%s", "client_tokens": "bench-client:%s"}' "$ADMIN" "$CLIENT")
    local out=$logdir/lambda-emu-$name.out errlog=$logdir/lambda-emu-$name.log
    : >"$out"
    log "stack $name: lambda-emu schedule, the reconcile function every $every ms (log: $errlog)"
    stack_spawn "lambda-emu $name" "$out" "$errlog" \
        "$STACK_BIN/lambda-emu" schedule --bin "$STACK_BIN/reconcile" --name reconcile \
        --every-ms "$every" --invoke-addr "127.0.0.1:$emu_port" --timeout-ms "$timeout" --coalesce \
        --credentials "$WAKE_KEY:$WAKE_SECRET" \
        --secret "$DB_ARN=$db_secret" --secret "$TOKENS_ARN=$tokens_secret" \
        --env "POOLMGR_DATABASE_SECRET_ARN=$DB_ARN" --env "POOLMGR_TOKENS_SECRET_ARN=$TOKENS_ARN" \
        --env POOLMGR_DATABASE_HOST=127.0.0.1 --env "POOLMGR_DATABASE_PORT=$pg_port" --env "POOLMGR_DATABASE_NAME=$db" \
        --env POOLMGR_DB_POOL_SIZE=4 --env POOLMGR_WAKE_LAMBDA_FUNCTION=reconcile \
        --env "POOLMGR_LAMBDA_ENDPOINT=http://127.0.0.1:$emu_port" --env "RUST_LOG=${RUST_LOG:-warn}" "${fenv[@]}"
    local t0=$SECONDS
    until grep -q 'lambda-emu invoke API listening on' "$out" 2>/dev/null; do
        pid_alive "$SPAWNED_PID" || { show_log_tail "$errlog"; die "lambda-emu exited during startup; see $errlog"; }
        ((SECONDS - t0 < 60)) || die "lambda-emu did not print its address within 60 s; see $errlog"
        sleep 0.1
    done
}

# --- pid files (processes another run left running) ---------------------------------------

# _stack_proc_is PID NAME: PID is alive and runs NAME (a PID from an old pid file may have been
# reused by something else).
_stack_proc_is() {
    local pid=$1 name=$2 arg
    pid_alive "$pid" || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == "$name" ]] && return 0
    # Also accept NAME anywhere in argv (e.g. when it runs via an interpreter).
    while IFS= read -r -d '' arg; do
        [[ "$arg" == "$name" || "$arg" == */"$name" ]] && return 0
    done <"/proc/$pid/cmdline" 2>/dev/null || true
    return 1
}

stack_pidfile_pid() {
    local file=$1 name=$2 pid
    [[ -f "$file" ]] || return 1
    pid=$(head -n 1 "$file" 2>/dev/null || true)
    _stack_proc_is "$pid" "$name" || return 1
    printf '%s\n' "$pid"
}

stack_stop_pidfile() {
    local file=$1 name=$2 sig=${3:-TERM} pid
    if pid=$(stack_pidfile_pid "$file" "$name"); then
        _stack_term "$pid" "$name" "$sig"
    else
        log "$name is not running"
    fi
    rm -f "$file"
}
