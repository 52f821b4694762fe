#!/usr/bin/env bash
# Validate the AWS SAM template offline: scripts/cfn-lint.sh [extra cfn-lint args...]
#
# Installs cfn-lint 1.x from PyPI into .dev/venv the first time (nothing outside this
# checkout is touched), then runs it on infra/template.yaml. cfn-lint expands the SAM
# transform itself, so no AWS account or credentials are needed. Exits non-zero on any
# error or warning; deliberate exceptions are in the template as per-resource
# Metadata: {cfn-lint: {config: {ignore_checks: [...]}}} with a reason beside them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$ROOT/.dev/venv
TEMPLATE=${CFN_LINT_TEMPLATE:-$ROOT/infra/template.yaml}
SPEC='cfn-lint>=1,<2'

# shellcheck source=lib/common.sh
. "$ROOT/scripts/lib/common.sh"

command -v python3 >/dev/null 2>&1 || die "python3 is needed to install cfn-lint (Debian: apt-get install python3 python3-venv)"

if [[ ! -x "$VENV/bin/cfn-lint" ]]; then
    log "installing $SPEC into $VENV"
    mkdir -p "$ROOT/.dev"
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv "$VENV" || die "cannot create $VENV (Debian: apt-get install python3-venv)"
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$SPEC" \
        || die "cannot install $SPEC from PyPI"
fi

log "$("$VENV/bin/cfn-lint" --version) on ${TEMPLATE#"$ROOT"/}"
# Every finding fails the run: errors (E) and warnings (W) both exit non-zero; informational
# findings (I) are not shown.
if "$VENV/bin/cfn-lint" "$@" -- "$TEMPLATE"; then
    log "cfn-lint: no findings"
else
    status=$?
    log "cfn-lint found problems (exit $status)"
    exit "$status"
fi
