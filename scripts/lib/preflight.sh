# shellcheck shell=bash
# What scripts/dev.sh and scripts/test.sh need on the machine, checked before they build
# anything: each missing piece is named with the Debian package (or command) that provides
# it, all at once, instead of a compiler or shell error halfway through.
#
#   . "$ROOT/scripts/lib/preflight.sh"   # after common.sh (stack.sh sources both)
#   preflight dev|test                   # returns 1 after listing what is missing
#
# Checked: cargo and rustc at least the workspace's `rust-version` (Debian's rustc is older:
# the toolchain comes from rustup), a C toolchain (cc: build scripts compile C), curl (the
# scripts probe and register through the HTTP API), procps's `kill` (the CLI tests signal
# processes by pid), python3 (free ports, JSON checks) and, unless the caller points at its
# own database (DATABASE_URL for dev, POOLMGR_TEST_DATABASE_URL for test), the PostgreSQL
# server binaries (initdb, pg_ctl: preferably 15, see pg-bin.sh).
#
# Never: installs anything, or fails for something the run does not need.

# _preflight_rust_at_least HAVE WANT: HAVE >= WANT as dotted versions.
_preflight_version_ge() {
    [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" == "$2" ]]
}

preflight() {
    local what=${1:-dev} root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    local missing=() apt=()
    local want
    want=$(sed -n 's/^rust-version *= *"\([0-9.]*\)".*/\1/p' "$root/Cargo.toml" | head -n 1)
    if ! command -v cargo >/dev/null 2>&1 || ! command -v rustc >/dev/null 2>&1; then
        missing+=("Rust ${want:+>= $want }(cargo, rustc): install rustup (https://rustup.rs; Debian 13 and later: apt-get install rustup), then: rustup default stable")
    else
        local have
        have=$(rustc --version 2>/dev/null | awk '{print $2}')
        have=${have%%-*}
        if [[ -n "$want" && -n "$have" ]] && ! _preflight_version_ge "$have" "$want"; then
            missing+=("Rust >= $want (this rustc is $have; Debian's packaged rustc is too old): rustup default stable (or rustup update stable), or install rustup from https://rustup.rs")
        fi
    fi
    if ! command -v cc >/dev/null 2>&1; then
        missing+=("a C toolchain (cc, for build scripts): apt-get install build-essential")
        apt+=(build-essential)
    fi
    if ! command -v curl >/dev/null 2>&1; then
        missing+=("curl: apt-get install curl")
        apt+=(curl)
    fi
    # `type -P`: the program on PATH, not bash's builtin (the tests run it as a program).
    if ! type -P kill >/dev/null 2>&1; then
        missing+=("kill (the CLI tests signal processes): apt-get install procps")
        apt+=(procps)
    fi
    if ! command -v python3 >/dev/null 2>&1; then
        missing+=("python3: apt-get install python3")
        apt+=(python3)
    fi
    local own_db=
    case "$what" in
        dev) own_db=${DATABASE_URL:-} ;;
        # The TLS-only test server is started even with a database URL, unless both of its
        # variables are given too (scripts/test.sh).
        test) own_db=${POOLMGR_TEST_DATABASE_URL:-}
              [[ -n "${POOLMGR_TEST_TLS_PG_PORT:-}" && -n "${POOLMGR_TEST_TLS_CA_PEM:-}" ]] || own_db= ;;
    esac
    if [[ -z "$own_db" ]] && ! pg_bindir >/dev/null 2>&1; then
        missing+=("the PostgreSQL 15 server binaries (initdb, pg_ctl): apt-get install postgresql-15 (Debian 12; on a newer Debian apt-get install postgresql works too, with a warning), or set PG_BINDIR to a server bin directory")
        apt+=(postgresql-15)
    fi
    if [[ ${#missing[@]} -eq 0 ]]; then
        return 0
    fi
    err "scripts/$(basename "$0") needs what this machine lacks:"
    local m
    for m in "${missing[@]}"; do
        printf '  - %s\n' "$m" >&2
    done
    if [[ ${#apt[@]} -gt 0 ]]; then
        printf 'the Debian packages at once: apt-get install -y %s\n' "${apt[*]}" >&2
    fi
    return 1
}
