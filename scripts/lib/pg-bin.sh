# shellcheck shell=bash
# Where the PostgreSQL server binaries are, and the user that runs them: `postgres` when the
# scripts run as root (PostgreSQL and PgBouncer refuse root), else the caller. Sourced by
# pg.sh; test-pgbouncer.sh uses pg_as_owner and pg_own_dir to run PgBouncer the same way.
#
# Functions:
#   pg_bindir            print the PostgreSQL server bin directory ($PG_BINDIR if set)
#   pg_as_owner CMD...   run CMD as the cluster owner (postgres when we are root, else us)
#   pg_own_dir DIR       when root: chown DIR to postgres and make its parents traversable
#
# Never: installs PostgreSQL, or changes anything outside DIR but its parents' o+x bit.

# pg_bindir: print the directory holding initdb/pg_ctl/postgres/psql.
pg_bindir() {
    if [[ -n "${PG_BINDIR:-}" ]]; then
        if [[ -x "$PG_BINDIR/initdb" ]]; then
            printf '%s\n' "$PG_BINDIR"
            return 0
        fi
        err "PG_BINDIR=$PG_BINDIR has no initdb; unset PG_BINDIR or point it at a PostgreSQL server bin directory"
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
    err "PostgreSQL server binaries (initdb, pg_ctl) not found; install them (e.g. apt-get install postgresql-15) or set PG_BINDIR=/path/to/bin"
    return 1
}

# Run a command as the cluster owner: `postgres` when we are root, else us.
pg_as_owner() {
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
pg_own_dir() {
    local dir=$1
    if ! id -u postgres >/dev/null 2>&1; then
        err "running as root but there is no 'postgres' user to run PostgreSQL as; create it (useradd --system postgres) or run as a non-root user"
        return 1
    fi
    chown -R postgres: "$dir"
    if pg_as_owner test -x "$dir" -a -w "$dir"; then
        return 0
    fi
    # Some parent is not traversable by postgres (e.g. /root is 0700).
    local p=$dir
    while [[ "$p" != "/" ]]; do
        p=$(dirname "$p")
        if ! pg_as_owner test -x "$p"; then
            log "making $p traversable (chmod o+x) so the postgres user can reach $dir"
            chmod o+x "$p"
        fi
    done
    if ! pg_as_owner test -x "$dir" -a -w "$dir"; then
        err "the postgres user cannot access $dir; put the cluster somewhere it can reach"
        return 1
    fi
}
