# shellcheck shell=bash
# Private, throwaway PostgreSQL clusters for tests and local development.
#
# Source this file (it does not change shell options of the caller):
#
#   . scripts/lib/pg.sh
#   PG_FAST=1 pg_start "$PWD/.dev/test-pg"   # initdb if needed, start (or reuse)
#   url=$(pg_create_db poolmgr)              # create database if missing, print URL
#   pg_stop "$PWD/.dev/test-pg"
#
# Functions:
#   pg_free_port         print a free TCP port on 127.0.0.1
#   pg_port_is_free P    succeed if nothing listens on / is bound to 127.0.0.1:P
#   pg_bindir            print the PostgreSQL server bin directory
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
#   PG_WANT_PORT=P       pg_start listens on port P instead of a free one (to restart a
#                        stopped cluster where its clients expect it)
#   PG_BINDIR            override the PostgreSQL bin directory
#
# When running as root the cluster is owned and run by the `postgres` user.

pg_log() { printf '==> %s\n' "$*" >&2; }
pg_err() { printf 'error: %s\n' "$*" >&2; }

# pg_free_port: ask the kernel for an unused port on 127.0.0.1.
pg_free_port() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()' && return 0
    fi
    # Fallback without python: probe random high ports.
    local port i
    for ((i = 0; i < 200; i++)); do
        port=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
        if pg_port_is_free "$port"; then
            printf '%s\n' "$port"
            return 0
        fi
    done
    pg_err "could not find a free TCP port on 127.0.0.1; free some ports or install python3"
    return 1
}

# pg_port_is_free PORT: true if the port can be bound on 127.0.0.1.
pg_port_is_free() {
    local port=$1
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()' "$port"
        return
    fi
    # Without python: a successful connect means something is listening.
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        return 1
    fi
    return 0
}

# pg_bindir: print the directory holding initdb/pg_ctl/postgres/psql.
pg_bindir() {
    if [[ -n "${PG_BINDIR:-}" ]]; then
        if [[ -x "$PG_BINDIR/initdb" ]]; then
            printf '%s\n' "$PG_BINDIR"
            return 0
        fi
        pg_err "PG_BINDIR=$PG_BINDIR has no initdb; unset PG_BINDIR or point it at a PostgreSQL server bin directory"
        return 1
    fi
    local dir
    if command -v pg_config >/dev/null 2>&1; then
        dir=$(pg_config --bindir 2>/dev/null || true)
        if [[ -n "$dir" && -x "$dir/initdb" ]]; then
            printf '%s\n' "$dir"
            return 0
        fi
    fi
    dir=$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -type d -name bin 2>/dev/null | sort -V | tail -n 1 || true)
    if [[ -n "$dir" && -x "$dir/initdb" ]]; then
        printf '%s\n' "$dir"
        return 0
    fi
    if command -v initdb >/dev/null 2>&1; then
        dir=$(dirname "$(command -v initdb)")
        printf '%s\n' "$dir"
        return 0
    fi
    pg_err "PostgreSQL server binaries (initdb, pg_ctl) not found; install them (e.g. apt-get install postgresql-15) or set PG_BINDIR=/path/to/bin"
    return 1
}

# Run a command as the cluster owner: `postgres` when we are root, else us.
_pg_as_owner() {
    if [[ $(id -u) -ne 0 ]]; then
        "$@"
        return
    fi
    # cd / so the postgres user is never stuck in an unreadable cwd.
    if command -v runuser >/dev/null 2>&1; then
        (cd / && runuser -u postgres -- "$@")
    else
        local cmd
        cmd=$(printf '%q ' "$@")
        (cd / && su postgres -s /bin/sh -c "$cmd")
    fi
}

# When root: make DIR owned by postgres and reachable through its parents.
_pg_prepare_dir_for_postgres() {
    local dir=$1
    if ! id -u postgres >/dev/null 2>&1; then
        pg_err "running as root but there is no 'postgres' user to run PostgreSQL as; create it (useradd --system postgres) or run as a non-root user"
        return 1
    fi
    chown -R postgres: "$dir"
    if _pg_as_owner test -x "$dir" -a -w "$dir"; then
        return 0
    fi
    # Some parent is not traversable by postgres (e.g. /root is 0700).
    local p=$dir
    while [[ "$p" != "/" ]]; do
        p=$(dirname "$p")
        if ! _pg_as_owner test -x "$p"; then
            pg_log "making $p traversable (chmod o+x) so the postgres user can reach $dir"
            chmod o+x "$p"
        fi
    done
    if ! _pg_as_owner test -x "$dir" -a -w "$dir"; then
        pg_err "the postgres user cannot access $dir; put the cluster somewhere it can reach"
        return 1
    fi
}

_pg_show_log() {
    local log=$1
    if [[ -f "$log" ]]; then
        printf -- '--- last lines of %s ---\n' "$log" >&2
        tail -n 40 "$log" >&2 || true
        printf -- '--- end of %s ---\n' "$log" >&2
    fi
}

# _pg_running DATA: true if a postmaster for DATA is alive.
_pg_running() {
    local data=$1
    [[ -f "$data/postmaster.pid" ]] || return 1
    _pg_as_owner "$PG_BINDIR/pg_ctl" -D "$data" status >/dev/null 2>&1
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
        pg_err "usage: pg_start DIR"
        return 1
    fi
    local dir=$1
    case "$dir" in
        *"'"* | *" "*)
            pg_err "pg_start: DIR must not contain spaces or quotes: $dir"
            return 1
            ;;
    esac
    mkdir -p "$dir" || return 1
    dir=$(cd "$dir" && pwd) || return 1
    local data=$dir/data log=$dir/postgres.log

    PG_BINDIR=$(pg_bindir) || return 1
    export PG_BINDIR

    if [[ $(id -u) -eq 0 ]]; then
        _pg_prepare_dir_for_postgres "$dir" || return 1
    fi

    # Reuse a cluster that is already running in DIR.
    if _pg_running "$data"; then
        local port
        port=$(sed -n 4p "$data/postmaster.pid")
        if [[ ! "$port" =~ ^[0-9]+$ ]]; then
            pg_err "cannot read the port from $data/postmaster.pid; stop it (pg_ctl -D $data stop) and retry"
            return 1
        fi
        pg_log "reusing PostgreSQL already running in $dir on 127.0.0.1:$port"
        if ! "$PG_BINDIR/pg_isready" -q -h 127.0.0.1 -p "$port" -t 10; then
            pg_err "PostgreSQL in $dir is running but not accepting connections on 127.0.0.1:$port; stop it with pg_ctl -D $data -m fast stop and retry"
            _pg_show_log "$log"
            return 1
        fi
        _pg_export "$dir" "$port" 0
        return 0
    fi

    if [[ ! -d "$data" ]]; then
        pg_log "initializing PostgreSQL cluster in $data ($PG_BINDIR)"
        if ! _pg_as_owner "$PG_BINDIR/initdb" -D "$data" -U postgres --auth=trust \
            --encoding=UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1; then
            # C.UTF-8 may be missing on very old systems; retry with plain C.
            rm -rf "$data"
            if ! _pg_as_owner "$PG_BINDIR/initdb" -D "$data" -U postgres --auth=trust \
                --encoding=UTF8 --locale=C >"$dir/initdb.log" 2>&1; then
                pg_err "initdb failed; see $dir/initdb.log, fix the cause and remove $data before retrying"
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
            port=$(pg_free_port) || return 1
        fi
        opts="-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories='$sockdir' -c max_connections=400"
        if [[ "${PG_FAST:-}" == 1 ]]; then
            opts+=" -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        fi
        pg_log "starting PostgreSQL in $dir on 127.0.0.1:$port${PG_FAST:+ (PG_FAST=$PG_FAST)}"
        if _pg_as_owner "$PG_BINDIR/pg_ctl" -w -t 60 -D "$data" -l "$log" -o "$opts" start >&2; then
            _pg_export "$dir" "$port" 1
            return 0
        fi
        # Somebody may have grabbed the port between probe and bind: retry.
        if tail -n 20 "$log" 2>/dev/null | grep -q 'Address already in use'; then
            pg_log "port $port was taken meanwhile (attempt $attempt); retrying on another port"
            continue
        fi
        break
    done
    pg_err "PostgreSQL failed to start in $dir; read $log, fix the cause and retry (remove $dir to start from scratch)"
    _pg_show_log "$log"
    return 1
}

pg_create_db() {
    if [[ $# -ne 1 || ! "$1" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
        pg_err "usage: pg_create_db NAME (letters, digits, underscore)"
        return 1
    fi
    if [[ -z "${PG_PORT:-}" ]]; then
        pg_err "pg_create_db: no cluster; call pg_start DIR first"
        return 1
    fi
    local name=$1 bindir
    bindir=$(pg_bindir) || return 1
    pg_log "ensuring database $name exists"
    if ! "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres \
        -v dbname="$name" >/dev/null <<'SQL'
SELECT format('CREATE DATABASE %I', :'dbname')
WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'dbname')
\gexec
SQL
    then
        pg_err "could not create database $name on 127.0.0.1:$PG_PORT; check ${PG_DIR:-the cluster dir}/postgres.log"
        return 1
    fi
    printf 'postgres://postgres@127.0.0.1:%s/%s\n' "$PG_PORT" "$name"
}

pg_stop() {
    if [[ $# -ne 1 || -z "$1" ]]; then
        pg_err "usage: pg_stop DIR"
        return 1
    fi
    local dir=$1
    if [[ ! -d "$dir/data" ]]; then
        pg_log "no PostgreSQL cluster in $dir; nothing to stop"
        return 0
    fi
    dir=$(cd "$dir" && pwd) || return 1
    PG_BINDIR=$(pg_bindir) || return 1
    export PG_BINDIR
    if ! _pg_running "$dir/data"; then
        pg_log "PostgreSQL in $dir is not running"
        return 0
    fi
    pg_log "stopping PostgreSQL in $dir"
    if ! _pg_as_owner "$PG_BINDIR/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >&2; then
        pg_err "pg_ctl stop failed for $dir; check $dir/postgres.log, or kill the postmaster (pid on line 1 of $dir/data/postmaster.pid)"
        return 1
    fi
}
