# shellcheck shell=bash
# What every script shares: messages, failing, log tails, the exit-cleanup registry, free
# ports and random tokens. The local stack itself (PostgreSQL, flintlock-sim, poolmgr-local)
# is started and stopped by stack.sh, which sources this file; why the scripts are a shell
# library and not a Rust xtask is written at the top of stack.sh.
#
# What lives where in scripts/lib/:
#   common.sh   this file: log/err/die, show_log_tail, at_exit, free_port, random_token
#   pg-bin.sh   where the PostgreSQL binaries are, and running them as `postgres` under root
#   pg.sh       private PostgreSQL clusters: pg_start, pg_create_db, pg_stop
#   stack.sh    the local stack: builds, a fresh cluster, flintlock-sim, poolmgr-local, any
#               other process a script runs beside them, host registration, pid files
#   http.sh     one API call at a time with its JSON answer checked (lambda-smoke.sh)
#
#   . "$ROOT/scripts/lib/common.sh"     # first thing after set -euo pipefail
#
# Sourcing it installs the traps: on EXIT the cleanups registered with at_exit run, the last
# registered first, and the script exits with its own status; INT exits 130 and TERM 143
# (through EXIT). A script may replace the INT/TERM trap afterwards (dev.sh does); it never
# replaces the EXIT trap, it registers with at_exit instead.
#
# Functions:
#   log MSG...            "==> MSG" on stderr
#   err MSG...            "error: MSG" on stderr
#   die MSG...            err, then the tail of $DIE_LOG if the script set it, then exit 1
#   show_log_tail FILE [N]  the last N (default 40) lines of FILE on stderr, framed
#   at_exit CMD [ARG...]  run CMD ARG... on exit (arguments quoted now, variables in a
#                         registered function read when it runs; $AT_EXIT_STATUS is the exit status)
#   at_exit_cancel        forget every registered cleanup (dev.sh --no-wait leaves the stack up)
#   free_port             print a free TCP port on 127.0.0.1
#   port_is_free P        succeed if nothing listens on / is bound to 127.0.0.1:P
#   random_token          print 32 random hex digits
#
# Never: changes the caller's shell options, or stops anything itself (cleanups do that).

log() { printf '==> %s\n' "$*" >&2; }
err() { printf 'error: %s\n' "$*" >&2; }
die() {
    err "$@"
    if [[ -n "${DIE_LOG:-}" ]]; then
        show_log_tail "$DIE_LOG"
    fi
    exit 1
}

show_log_tail() {
    local file=$1 lines=${2:-40}
    if [[ -f "$file" ]]; then
        printf -- '--- last lines of %s ---\n' "$file" >&2
        tail -n "$lines" "$file" >&2 || true
        printf -- '--- end of %s ---\n' "$file" >&2
    fi
}

# --- exit-cleanup registry ---------------------------------------------------------------
_AT_EXIT=()
AT_EXIT_STATUS=0

at_exit() {
    local cmd
    cmd=$(printf '%q ' "$@")
    _AT_EXIT+=("$cmd")
}

at_exit_cancel() { _AT_EXIT=(); }

# shellcheck disable=SC2317  # invoked via trap
_at_exit_run() {
    AT_EXIT_STATUS=$?
    # A second Ctrl-C while cleaning up stops the script at once.
    trap - EXIT INT TERM
    local i
    for ((i = ${#_AT_EXIT[@]} - 1; i >= 0; i--)); do
        eval "${_AT_EXIT[i]}" || true
    done
    exit "$AT_EXIT_STATUS"
}
trap _at_exit_run EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- ports and tokens --------------------------------------------------------------------

# free_port: ask the kernel for an unused port on 127.0.0.1.
free_port() {
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
        if port_is_free "$port"; then
            printf '%s\n' "$port"
            return 0
        fi
    done
    err "could not find a free TCP port on 127.0.0.1; free some ports or install python3"
    return 1
}

# port_is_free PORT: true if the port can be bound on 127.0.0.1.
port_is_free() {
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

random_token() {
    if command -v openssl >/dev/null 2>&1; then
        openssl rand -hex 16
    elif command -v python3 >/dev/null 2>&1; then
        python3 -c 'import secrets; print(secrets.token_hex(16))'
    else
        od -An -N16 -tx1 /dev/urandom | tr -d ' \n'
        echo
    fi
}
