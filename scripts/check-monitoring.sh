#!/usr/bin/env bash
# Validate the operator's monitoring kit in infra/monitoring/ with promtool:
#
#   scripts/check-monitoring.sh
#
#   promtool check rules  infra/monitoring/poolmgr.rules.yml       (syntax, PromQL, templates)
#   promtool test rules   infra/monitoring/poolmgr.rules.test.yml  (each alert fires when it should)
#
# promtool comes from Debian's `prometheus` package: installed with apt-get when missing and
# we are root (the daemon is not started), otherwise this fails and says how to get it. It
# never skips: CI must not pass without having run the rule tests.
#
# That every metric and label the rules, their tests and the dashboard name is one the service
# exports is checked against a real /metrics scrape by the `monitoring` integration tests
# (scripts/test.sh -p poolmgr-tests --test api monitoring::), which scripts/test.sh runs.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/common.sh
. "$ROOT/scripts/lib/common.sh"

KIT=$ROOT/infra/monitoring

find_promtool() {
    command -v promtool 2>/dev/null || { [[ -x /usr/bin/promtool ]] && echo /usr/bin/promtool; }
}
PROMTOOL=$(find_promtool || true)
if [[ -z "$PROMTOOL" ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing promtool (apt-get install -y --no-install-recommends prometheus)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || die "apt-get update failed; install promtool yourself (Debian: apt-get install prometheus) and rerun"
        apt-get install -y -qq --no-install-recommends prometheus >/dev/null ||
            die "apt-get install prometheus failed; install promtool yourself and rerun"
        PROMTOOL=$(find_promtool || true)
    fi
    [[ -n "$PROMTOOL" ]] || die "promtool not found; install it (Debian: apt-get install prometheus, or a release from the Prometheus project) and rerun"
fi
log "using $("$PROMTOOL" --version 2>&1 | head -n 1)"

log "promtool check rules infra/monitoring/poolmgr.rules.yml"
"$PROMTOOL" check rules "$KIT/poolmgr.rules.yml" ||
    die "the alert rules do not load in Prometheus; fix infra/monitoring/poolmgr.rules.yml"

log "promtool test rules infra/monitoring/poolmgr.rules.test.yml"
# promtool resolves rule_files relative to the test file.
"$PROMTOOL" test rules "$KIT/poolmgr.rules.test.yml" ||
    die "an alert rule does not behave as its test says; see the diff above (infra/monitoring/poolmgr.rules.test.yml)"

log "monitoring kit OK"
