# shellcheck shell=bash
# Where the PostgreSQL server binaries are, and the user that runs them: `postgres` when the
# scripts run as root (PostgreSQL and PgBouncer refuse root), else the caller. Sourced by
# pg.sh; test-pgbouncer.sh uses pg_as_owner and pg_own_dir to run PgBouncer the same way.
#
# Functions:
#   pg_bindir            print the PostgreSQL server bin directory ($PG_BINDIR if set, else
#                        PostgreSQL 15 (PG_PREFERRED_MAJOR), else the newest, with a warning)
#   pg_as_owner CMD...   run CMD as the cluster owner (postgres when we are root, else us)
#   pg_own_dir DIR       when root: chown DIR to postgres and make the parents postgres cannot
#                        traverse traversable (o+x; only those, and not with PG_NO_CHMOD=1)
#
# Never: installs PostgreSQL, or changes anything outside DIR but its parents' o+x bit.

# The PostgreSQL major version poolmgr is built and deployed against (RDS in the AWS template):
# the scripts prefer it when several are installed.
PG_PREFERRED_MAJOR=${PG_PREFERRED_MAJOR:-15}

# _pg_major BINDIR: print the major version of the server in BINDIR (15 for 15.10).
_pg_major() {
    "$1/postgres" --version 2>/dev/null | sed -n 's/.*) \([0-9][0-9]*\).*/\1/p' | head -n 1
}

# pg_bindir: print the directory holding initdb/pg_ctl/postgres/psql: $PG_BINDIR if set, else
# PostgreSQL $PG_PREFERRED_MAJOR (15) if installed, else the newest installed, with a warning
# on stderr (the tests pass on newer servers, but 15 is what production runs).
pg_bindir() {
    if [[ -n "${PG_BINDIR:-}" ]]; then
        if [[ -x "$PG_BINDIR/initdb" ]]; then
            printf '%s\n' "$PG_BINDIR"
            return 0
        fi
        err "PG_BINDIR=$PG_BINDIR has no initdb; unset PG_BINDIR or point it at a PostgreSQL server bin directory"
        return 1
    fi
    local candidates=() dir
    # Debian's layout, one directory per major version, newest last.
    while IFS= read -r dir; do
        [[ -x "$dir/initdb" ]] && candidates+=("$dir")
    done < <(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -type d -name bin 2>/dev/null | sort -V)
    if command -v pg_config >/dev/null 2>&1; then
        dir=$(pg_config --bindir 2>/dev/null || true)
        [[ -n "$dir" && -x "$dir/initdb" ]] && candidates+=("$dir")
    fi
    if command -v initdb >/dev/null 2>&1; then
        candidates+=("$(dirname "$(command -v initdb)")")
    fi
    for dir in "${candidates[@]}"; do
        if [[ "$(_pg_major "$dir")" == "$PG_PREFERRED_MAJOR" ]]; then
            printf '%s\n' "$dir"
            return 0
        fi
    done
    if [[ ${#candidates[@]} -gt 0 ]]; then
        # The newest: the last of Debian's sorted directories, else pg_config's or PATH's.
        local best=${candidates[0]} major best_major=-1
        for dir in "${candidates[@]}"; do
            major=$(_pg_major "$dir")
            if [[ -n "$major" && "$major" -gt "$best_major" ]]; then
                best=$dir best_major=$major
            fi
        done
        log "warning: PostgreSQL $PG_PREFERRED_MAJOR not found; using ${best_major/#-1/an unknown version} from $best (production runs $PG_PREFERRED_MAJOR: apt-get install postgresql-$PG_PREFERRED_MAJOR, or set PG_BINDIR to choose)"
        printf '%s\n' "$best"
        return 0
    fi
    err "PostgreSQL server binaries (initdb, pg_ctl) not found; install them (Debian 12: apt-get install postgresql-$PG_PREFERRED_MAJOR) or set PG_BINDIR=/path/to/bin"
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
#
# Why a parent may need o+x: PostgreSQL refuses to run as root, so as root the cluster runs
# as `postgres`, which must traverse every directory above its data directory. The clusters
# live in the checkout's .dev/ (throwaway, wiped per run); a checkout under /root (mode 0700)
# is the usual case where postgres cannot get there. Only the parents postgres cannot
# traverse get o+x (traverse, not list or read), each logged; nothing happens when postgres
# can already reach DIR, or when the scripts run as a normal user (the cluster then runs as
# that user). To change no permission at all, run the scripts as a normal user, or keep the
# checkout somewhere postgres can reach (e.g. /srv, /home/USER with o+x), or set
# PG_NO_CHMOD=1: the scripts then stop and say which directory is in the way.
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
            if [[ "${PG_NO_CHMOD:-}" == 1 ]]; then
                err "the postgres user cannot traverse $p to reach $dir, and PG_NO_CHMOD=1 forbids chmod o+x; run as a normal user or move the checkout where postgres can reach it"
                return 1
            fi
            log "making $p traversable (chmod o+x: PostgreSQL runs as postgres, not root, and must reach $dir; PG_NO_CHMOD=1 to refuse)"
            chmod o+x "$p"
        fi
    done
    if ! pg_as_owner test -x "$dir" -a -w "$dir"; then
        err "the postgres user cannot access $dir; put the cluster somewhere it can reach"
        return 1
    fi
}
