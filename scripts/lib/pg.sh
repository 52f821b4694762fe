# shellcheck shell=bash
# Private, throwaway PostgreSQL clusters for tests and local development: the one place that
# runs initdb, pg_ctl start/stop and CREATE DATABASE. Scripts usually reach it through
# stack.sh (stack_pg_fresh wipes, starts and registers the stop); chaos.sh also calls
# pg_stop/pg_start directly to restart the server under load.
#
# Source this file (it does not change shell options of the caller; it sources common.sh
# and pg-bin.sh, so log/err/free_port and pg_bindir/pg_as_owner come with it):
#
#   . scripts/lib/pg.sh
#   PG_FAST=1 pg_start "$PWD/.dev/test-pg"   # initdb if needed, start (or reuse)
#   url=$(pg_create_db poolmgr)              # create database if missing, print URL
#   pg_stop "$PWD/.dev/test-pg"
#
# Functions:
#   pg_start DIR         initdb DIR/data if missing, start it on a free port, or
#                        reuse it if already running; exports PG_DIR, PG_PORT,
#                        PG_HOST, PG_BINDIR, PG_ADMIN_URL, PG_STARTED (1 if this
#                        call started the server, 0 if an already-running one
#                        was reused)
#   pg_create_db NAME    create database NAME on the pg_start'ed cluster if it
#                        does not exist; print its URL on stdout
#   pg_stop DIR          fast shutdown; no-op if not running
#
# Environment:
#   PG_FAST=1            start with fsync/synchronous_commit/full_page_writes off
#   PG_OPTS="-c k=v ..." more server options (test.sh's TLS server: ssl, hba_file)
#   PG_WANT_PORT=P       pg_start listens on port P instead of a free one (to restart a
#                        stopped cluster where its clients expect it)
#   PG_BINDIR            override the PostgreSQL bin directory
#
# When running as root the cluster is owned and run by the `postgres` user (pg-bin.sh).
# Never: touches a cluster outside the DIR it is given, or removes data (callers wipe).

_PG_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! declare -F at_exit >/dev/null; then
    # shellcheck source=common.sh
    . "$_PG_LIB_DIR/common.sh"
fi
# shellcheck source=pg-bin.sh
. "$_PG_LIB_DIR/pg-bin.sh"

# _pg_running DATA: true if a postmaster for DATA is alive.
_pg_running() {
    local data=$1
    [[ -f "$data/postmaster.pid" ]] || return 1
    pg_as_owner "$PG_BINDIR/pg_ctl" -D "$data" status >/dev/null 2>&1
}

_pg_export() {
    local dir=$1 port=$2 started=$3
    export PG_DIR=$dir
    export PG_PORT=$port
    export PG_HOST=127.0.0.1
    export PG_ADMIN_URL="postgres://postgres@127.0.0.1:$port/postgres"
    export PG_STARTED=$started
}

pg_start() {
    if [[ $# -ne 1 || -z "$1" ]]; then
        err "usage: pg_start DIR"
        return 1
    fi
    local dir=$1
    case "$dir" in
        *"'"* | *" "*)
            err "pg_start: DIR must not contain spaces or quotes: $dir"
            return 1
            ;;
    esac
    mkdir -p "$dir" || return 1
    dir=$(cd "$dir" && pwd) || return 1
    local data=$dir/data log=$dir/postgres.log

    PG_BINDIR=$(pg_bindir) || return 1
    export PG_BINDIR

    if [[ $(id -u) -eq 0 ]]; then
        pg_own_dir "$dir" || return 1
    fi

    # Reuse a cluster that is already running in DIR.
    if _pg_running "$data"; then
        local port
        port=$(sed -n 4p "$data/postmaster.pid")
        if [[ ! "$port" =~ ^[0-9]+$ ]]; then
            err "cannot read the port from $data/postmaster.pid; stop it (pg_ctl -D $data stop) and retry"
            return 1
        fi
        log "reusing PostgreSQL already running in $dir on 127.0.0.1:$port"
        if ! "$PG_BINDIR/pg_isready" -q -h 127.0.0.1 -p "$port" -t 10; then
            err "PostgreSQL in $dir is running but not accepting connections on 127.0.0.1:$port; stop it with pg_ctl -D $data -m fast stop and retry"
            show_log_tail "$log"
            return 1
        fi
        _pg_export "$dir" "$port" 0
        return 0
    fi

    if [[ ! -d "$data" ]]; then
        log "initializing PostgreSQL cluster in $data ($PG_BINDIR)"
        if ! pg_as_owner "$PG_BINDIR/initdb" -D "$data" -U postgres --auth=trust \
            --encoding=UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1; then
            # C.UTF-8 may be missing on very old systems; retry with plain C.
            rm -rf "$data"
            if ! pg_as_owner "$PG_BINDIR/initdb" -D "$data" -U postgres --auth=trust \
                --encoding=UTF8 --locale=C >"$dir/initdb.log" 2>&1; then
                err "initdb failed; see $dir/initdb.log, fix the cause and remove $data before retrying"
                tail -n 30 "$dir/initdb.log" >&2 || true
                return 1
            fi
        fi
    fi

    local sockdir=$dir
    # Unix socket paths are limited to ~107 bytes; we only need TCP anyway.
    if [[ $((${#dir} + 20)) -gt 100 ]]; then
        sockdir=""
    fi

    local attempt port opts
    for attempt in 1 2 3; do
        if [[ -n "${PG_WANT_PORT:-}" ]]; then
            port=$PG_WANT_PORT
        else
            port=$(free_port) || return 1
        fi
        opts="-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories='$sockdir' -c max_connections=400"
        if [[ "${PG_FAST:-}" == 1 ]]; then
            opts+=" -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        fi
        if [[ -n "${PG_OPTS:-}" ]]; then
            opts+=" $PG_OPTS"
        fi
        log "starting PostgreSQL in $dir on 127.0.0.1:$port${PG_FAST:+ (PG_FAST=$PG_FAST)}"
        if pg_as_owner "$PG_BINDIR/pg_ctl" -w -t 60 -D "$data" -l "$log" -o "$opts" start >&2; then
            _pg_export "$dir" "$port" 1
            return 0
        fi
        # Somebody may have grabbed the port between probe and bind: retry.
        if tail -n 20 "$log" 2>/dev/null | grep -q 'Address already in use'; then
            log "port $port was taken meanwhile (attempt $attempt); retrying on another port"
            continue
        fi
        break
    done
    err "PostgreSQL failed to start in $dir; read $log, fix the cause and retry (remove $dir to start from scratch)"
    show_log_tail "$log"
    return 1
}

pg_create_db() {
    if [[ $# -ne 1 || ! "$1" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
        err "usage: pg_create_db NAME (letters, digits, underscore)"
        return 1
    fi
    if [[ -z "${PG_PORT:-}" ]]; then
        err "pg_create_db: no cluster; call pg_start DIR first"
        return 1
    fi
    local name=$1 bindir
    bindir=$(pg_bindir) || return 1
    log "ensuring database $name exists"
    if ! "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres \
        -v dbname="$name" >/dev/null <<'SQL'
SELECT format('CREATE DATABASE %I', :'dbname')
WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'dbname')
\gexec
SQL
    then
        err "could not create database $name on 127.0.0.1:$PG_PORT; check ${PG_DIR:-the cluster dir}/postgres.log"
        return 1
    fi
    printf 'postgres://postgres@127.0.0.1:%s/%s\n' "$PG_PORT" "$name"
}

pg_stop() {
    if [[ $# -ne 1 || -z "$1" ]]; then
        err "usage: pg_stop DIR"
        return 1
    fi
    local dir=$1
    if [[ ! -d "$dir/data" ]]; then
        log "no PostgreSQL cluster in $dir; nothing to stop"
        return 0
    fi
    dir=$(cd "$dir" && pwd) || return 1
    PG_BINDIR=$(pg_bindir) || return 1
    export PG_BINDIR
    if ! _pg_running "$dir/data"; then
        log "PostgreSQL in $dir is not running"
        return 0
    fi
    log "stopping PostgreSQL in $dir"
    if ! pg_as_owner "$PG_BINDIR/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >&2; then
        err "pg_ctl stop failed for $dir; check $dir/postgres.log, or kill the postmaster (pid on line 1 of $dir/data/postmaster.pid)"
        return 1
    fi
}
