# shellcheck shell=bash
# PgBouncer in pool_mode = transaction in front of a private PostgreSQL (pg.sh): our stand-in
# for RDS Proxy. test-pgbouncer.sh runs the suite through it; bench-claims.sh measures the
# deployed claim path through it.
#
#   . "$ROOT/scripts/lib/pgbouncer.sh"   # after stack.sh (or pg.sh)
#   pgbouncer_start "$ROOT/.dev/pgbouncer" "$PG_PORT" default_pool_size=16
#
# Functions:
#   pgbouncer_find         print the pgbouncer binary; when it is missing and we are root,
#                          install it first (apt-get install pgbouncer)
#   pgbouncer_start DIR PG_PORT [KEY=VALUE...]  wipe DIR, write DIR/pgbouncer.ini (every
#                          database on 127.0.0.1:PG_PORT, trust auth, transaction pooling; each
#                          KEY=VALUE overrides a setting), start it on a free port as the
#                          cluster owner and wait until it accepts connections; stopped on
#                          exit. Sets PGB_PORT, PGB_PID, PGB_LOG
#
# Never: stops a PgBouncer it cannot identify by its pid file and name.

pgbouncer_find() {
    local bin
    bin=$(command -v pgbouncer 2>/dev/null || { [[ -x /usr/sbin/pgbouncer ]] && echo /usr/sbin/pgbouncer; } || true)
    if [[ -z "$bin" ]] && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing PgBouncer (apt-get install -y pgbouncer)"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null ||
            die "apt-get update failed; install pgbouncer yourself and rerun"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null ||
            die "apt-get install pgbouncer failed; install it yourself and rerun"
        bin=$(command -v pgbouncer 2>/dev/null || { [[ -x /usr/sbin/pgbouncer ]] && echo /usr/sbin/pgbouncer; } || true)
    fi
    [[ -n "$bin" ]] || die "pgbouncer not found; install it (Debian: apt-get install pgbouncer) and rerun"
    printf '%s\n' "$bin"
}

pgbouncer_start() {
    local dir=$1 pg_port=$2
    shift 2
    local bin pidfile=$dir/pgbouncer.pid setting
    bin=$(pgbouncer_find)
    log "using $("$bin" --version 2>/dev/null | head -n 1)"
    if stack_pidfile_pid "$pidfile" pgbouncer >/dev/null; then
        log "a PgBouncer from an earlier run is still running in $dir; stopping it"
        stack_stop_pidfile "$pidfile" pgbouncer INT
    fi
    rm -rf "$dir"
    mkdir -p "$dir"
    PGB_PORT=$(free_port)
    PGB_LOG=$dir/pgbouncer.log
    # trust: PgBouncer still wants the user in auth_file.
    printf '"postgres" ""\n' >"$dir/userlist.txt"
    {
        cat <<EOF
[databases]
; every database on the private server
* = host=127.0.0.1 port=$pg_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PGB_PORT
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
admin_users = postgres
pool_mode = transaction
max_client_conn = 5000
default_pool_size = 40
reserve_pool_size = 10
query_wait_timeout = 60
; what tokio-postgres and psql may send at startup
ignore_startup_parameters = extra_float_digits
logfile = $PGB_LOG
pidfile = $pidfile
log_connections = 0
log_disconnections = 0
EOF
        # A later line of the same key wins.
        for setting in "$@"; do
            printf '%s = %s\n' "${setting%%=*}" "${setting#*=}"
        done
    } >"$dir/pgbouncer.ini"
    if [[ $(id -u) -eq 0 ]]; then
        # PgBouncer refuses to run as root: run it as the cluster owner.
        pg_own_dir "$dir" || die "cannot prepare $dir for the postgres user"
    fi
    log "starting PgBouncer on 127.0.0.1:$PGB_PORT (pool_mode = transaction${*:+; $*}; log: $PGB_LOG)"
    # Stopped on exit (SIGINT: PgBouncer's safe shutdown) if it started.
    at_exit stack_stop_pidfile "$pidfile" pgbouncer INT
    pg_as_owner "$bin" -d -q "$dir/pgbouncer.ini" || {
        show_log_tail "$PGB_LOG"
        die "PgBouncer did not start; see $PGB_LOG"
    }
    local _
    for _ in $(seq 1 100); do
        if PGB_PID=$(stack_pidfile_pid "$pidfile" pgbouncer) &&
            "$PG_BINDIR/psql" -X -q -h 127.0.0.1 -p "$PGB_PORT" -U postgres -d postgres -c 'SELECT 1' >/dev/null 2>&1; then
            log "PgBouncer is up (pid $PGB_PID)"
            return 0
        fi
        sleep 0.1
    done
    show_log_tail "$PGB_LOG"
    die "PgBouncer did not accept connections on 127.0.0.1:$PGB_PORT within 10 s; see $PGB_LOG"
}
