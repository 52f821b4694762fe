#!/usr/bin/env bash
# Dependency policy: licenses, banned and duplicate crates, and where crates come from,
# as deny.toml says:
#
#   scripts/deny.sh [extra cargo-deny check arguments]
#
# runs `cargo deny check bans licenses sources`. Advisories are not checked: their database
# is fetched from the network, which the build machines cannot reach (deny.toml says more).
#
# cargo-deny is installed with `cargo install --locked cargo-deny@VERSION` when missing (a
# few minutes of building, once per machine); if that fails this fails, it never skips.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/common.sh
. "$ROOT/scripts/lib/common.sh"
cd "$ROOT"

# The version deny.toml is written for (its keys change between releases).
CARGO_DENY_VERSION=0.20.2

have_deny() { cargo deny --version 2>/dev/null | grep -q "^cargo-deny $CARGO_DENY_VERSION\$"; }
if ! have_deny; then
    log "installing cargo-deny $CARGO_DENY_VERSION (cargo install --locked cargo-deny@$CARGO_DENY_VERSION; a few minutes)"
    cargo install --locked "cargo-deny@$CARGO_DENY_VERSION" ||
        die "cannot install cargo-deny $CARGO_DENY_VERSION; install it yourself (cargo install --locked cargo-deny@$CARGO_DENY_VERSION) and rerun"
    have_deny || die "cargo deny --version is not $CARGO_DENY_VERSION after installing it; is \$CARGO_HOME/bin on PATH?"
fi
log "cargo deny check bans licenses sources ($(cargo deny --version))"
cargo deny check --hide-inclusion-graph "$@" bans licenses sources ||
    die "the dependency policy (deny.toml) is broken; see cargo-deny's report above"
