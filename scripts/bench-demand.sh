#!/usr/bin/env bash
# Pool policies against claim traces (issue 22 item 4): the traces model-day, step and
# step-hinted replayed in scaled time against the real reconciler and flintlock-sim, with
# static-peak, static-mean, autoscaled and autoscaled-hints pools side by side, in both
# configurations at once:
#
#   local     poolmgr-local with its in-process reconciler (woken by claims)
#   deployed  poolmgr-local without one (POOLMGR_RECONCILE_TICKER=off) whose claims wake the
#             reconcile function through an emulated Lambda Invoke API; the function runs under
#             `lambda-emu schedule`, invoked every 60 s (scaled) as EventBridge Scheduler does
#
# plus a real-time segment (k = 1) per configuration, on stacks of their own, for the refill
# lag. Every stack has its own database (one private PostgreSQL) and flintlock-sim, whose boot
# times are drawn from a log-normal distribution (median 30 s, σ 0.25; divided by k for the
# scaled stacks). After the run: no double lease, no pool above its autoscaling max (the
# benchmark's own checks), then `poolmgr-check --settled` on every database.
#
# The rollout trace (issue 24; --traces rollout, not in the default list: it needs stacks of its
# own k and takes about 6 minutes more) changes the template of 50-VM pools in both
# configurations: busy (0.5 claims/s, each job holding its VM 60 s) with claim_preference
# CURRENT and ANY, the same claims without a change (the baseline), idle, and broken (an image
# the simulators fail); see functions/poolmgr-bench/src/demand/rollout.rs. Its rows go to
# .dev/bench-demand/rollout-results.jsonl and, unless --no-docs, are appended to
# docs/bench-rollout-results.jsonl with their own section in docs/benchmarks.md. Run alone, it
# skips the real-time segments and leaves the demand section and its results alone.
#
#   scripts/bench-demand.sh [options]
#
# Options:
#   --quick            a smoke run of about 6 minutes: k = 480 and 120, D = 0.025, two
#                      real-time claims each (and k = 30 for the rollout trace)
#   --scale K          the model-day's time scale (default 120: its 24 h take 12 min)
#   --step-scale K     the step traces' (default 20: their 3 h take 9 min)
#   --stagger S        the deployed rows start S real seconds after the local ones (default 75),
#                      so the two configurations' busiest minutes do not share the CPUs
#   --demand D         demand factor on every arrival rate and the burst rate (default 0.05)
#   --seed S           the traces' seed (default 1)
#   --hint-lead S      how long before a burst or the step `autoscaled-hints` announces it
#                      (unscaled seconds; default 180)
#   --rollout-scale K  the rollout trace's (default 10: its 13 min take 78 s, plus fill and settle)
#   --traces LIST      comma-separated: model-day, step, step-hinted, rollout
#                      (default model-day,step,step-hinted)
#   --policies LIST    comma-separated (default static-peak,static-mean,autoscaled,autoscaled-hints)
#   --configurations LIST  local,deployed (default both)
#   --all-rows         every (trace, policy) pair, not only the default ones (autoscaled-hints
#                      is left out on step, where there is nothing to announce, and every other
#                      policy on step-hinted, where it would send no hint)
#   --no-realtime      skip the real-time segments
#   --release          release builds (default debug, as the tests use)
#   --results FILE     rows as JSON lines (default .dev/bench-demand/results.jsonl)
#   --no-docs          do not rewrite docs/benchmarks.md's generated section
#   --env KEY=VALUE    one more variable for the scaled stacks' poolmgr-local and reconcile
#                      function (repeatable; wins over the scaled knobs below)
#
# Needs the PostgreSQL 15 server binaries (as scripts/test.sh), curl and python3. Logs and
# results: .dev/bench-demand/. A default run takes about 16 minutes after the build.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/stack.sh
. "$ROOT/scripts/lib/stack.sh"

SCALE=120
STEP_SCALE=20
ROLLOUT_SCALE=10
STAGGER=75
DEMAND=0.05
SEED=1
HINT_LEAD=180
TRACES=model-day,step,step-hinted
POLICIES=static-peak,static-mean,autoscaled,autoscaled-hints
CONFIGURATIONS=local,deployed
REALTIME=1
REALTIME_CLAIMS=15
REALTIME_GAP=20
PROFILE=debug
WORK=$ROOT/.dev/bench-demand
RESULTS=""
DOCS=1
BOOT_MEDIAN_MS=30000
BOOT_SIGMA=0.25
EXTRA_ENV=()
ALL_ROWS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) SCALE=480 STEP_SCALE=120 ROLLOUT_SCALE=30 STAGGER=20 DEMAND=0.025 REALTIME_CLAIMS=2 REALTIME_GAP=15; shift ;;
        --scale) SCALE=$2; shift 2 ;;
        --step-scale) STEP_SCALE=$2; shift 2 ;;
        --stagger) STAGGER=$2; shift 2 ;;
        --demand) DEMAND=$2; shift 2 ;;
        --seed) SEED=$2; shift 2 ;;
        --hint-lead) HINT_LEAD=$2; shift 2 ;;
        --traces) TRACES=$2; shift 2 ;;
        --policies) POLICIES=$2; shift 2 ;;
        --configurations) CONFIGURATIONS=$2; shift 2 ;;
        --no-realtime) REALTIME=0; shift ;;
        --all-rows) ALL_ROWS=(--all-rows); shift ;;
        --release) PROFILE=release; shift ;;
        --results) RESULTS=$2; shift 2 ;;
        --no-docs) DOCS=0; shift ;;
        --env) EXTRA_ENV+=("$2"); shift 2 ;;
        --rollout-scale) ROLLOUT_SCALE=$2; shift 2 ;;
        -h | --help) sed -n '2,58p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
for v in "$SCALE" "$STEP_SCALE" "$ROLLOUT_SCALE"; do
    [[ $v =~ ^[0-9]+$ ]] && ((v >= 1)) || die "--scale, --step-scale and --rollout-scale must be whole numbers of at least 1, got '$v'"
done
# The rollout trace apart from the others: its own rows, results and section.
ROLLOUT=0
[[ ,$TRACES, == *,rollout,* ]] && ROLLOUT=1
OTHER_TRACES=$(printf '%s' ",$TRACES," | sed 's/,rollout,/,/g; s/^,//; s/,$//')
if [[ -z $OTHER_TRACES && $REALTIME == 1 ]]; then
    log "only the rollout trace: no real-time segments"
    REALTIME=0
fi
[[ $STAGGER =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--stagger must be a number of seconds, got '$STAGGER'"
[[ $DEMAND =~ ^[0-9]*([.][0-9]+)?$ ]] && awk "BEGIN {exit !($DEMAND > 0)}" ||
    die "--demand must be a number above 0, got '$DEMAND'"
command -v curl >/dev/null 2>&1 || die "curl is required (apt-get install curl)"
command -v python3 >/dev/null 2>&1 || die "python3 is required"
IFS=, read -r -a CONFIGS <<<"$CONFIGURATIONS"
for c in "${CONFIGS[@]}"; do
    [[ $c == local || $c == deployed ]] || die "--configurations takes local and/or deployed, got '$c'"
done

mkdir -p "$WORK"
LOGS=$WORK/logs
rm -rf "$LOGS"
mkdir -p "$LOGS"
RESULTS=${RESULTS:-$WORK/results.jsonl}
SUMMARY=$WORK/summary.json
ROLLOUT_RESULTS=$WORK/rollout-results.jsonl
rm -f "$ROLLOUT_RESULTS"

# knob VALUE: VALUE / k, at least MIN, rounded to a whole number ("knob 2000 10": 2000/k ms, ≥ 10).
knob() { awk -v v="$1" -v k="$SCALE" -v min="${2:-1}" 'BEGIN {x = v / k; if (x < min) x = min; printf "%d", x + 0.5}'; }
# fknob VALUE: VALUE / k with three decimals.
fknob() { awk -v v="$1" -v k="$SCALE" 'BEGIN {printf "%.3f", v / k}'; }

log "building $PROFILE binaries (poolmgr-bench, flintlock-sim, lambda-emu, poolmgr-local, reconcile, poolmgr-check)"
stack_build "$PROFILE" -q -p poolmgr-bench -p flintlock-sim -p lambda-emu -p poolmgr-local -p reconcile -p poolmgr-check
BIN=$STACK_BIN

PG_FAST=1 stack_pg_fresh "$WORK/pg" "see $WORK/pg/postgres.log"
stack_bench_credentials

# The knobs that set how fast things happen, divided by k; the safety bounds (timeouts,
# deadlines, heartbeat expiry, the loop budget POOLMGR_RECONCILE_LOOP_SECONDS) are not. Each
# as poolmgr reads it. Two have floors, because every pass costs real CPU (about 9 ms of
# PostgreSQL and poolmgr-local together, debug build, with nothing to do): the ticker
# (poolmgr-local's schedule stand-in, 2 s; claims wake the reconciler anyway) at
# TICK_FLOOR_MS, and the loop's pause between passes at LOOP_FLOOR_MS.
TICK_FLOOR_MS=${TICK_FLOOR_MS:-100}
LOOP_FLOOR_MS=${LOOP_FLOOR_MS:-25}
scaled_env() {
    printf '%s\n' \
        "POOLMGR_RECONCILE_INTERVAL_MS=$(knob 2000 "$TICK_FLOOR_MS")" \
        "POOLMGR_RECONCILE_LOOP_INTERVAL_MS=$(knob 500 "$LOOP_FLOOR_MS")" \
        "POOLMGR_RECONCILE_LINGER_MS=$(knob 5000 20)" \
        "POOLMGR_WAKE_DEBOUNCE_MS=$(knob 1000 5)" \
        "POOLMGR_AUTOSCALE_WINDOW_SECONDS=$(fknob 60)" \
        "POOLMGR_AUTOSCALE_DEFAULT_PROVISIONING_SECONDS=$(fknob 30)"
}

# with_env KEY=VALUE... -- CMD...: CMD (a function too) with those variables exported.
with_env() {
    local -a kv=()
    while [[ $1 != -- ]]; do
        kv+=("$1")
        shift
    done
    shift
    local e
    for e in "${kv[@]}"; do
        local -x "$e"
    done
    "$@"
}

# start_stack NAME K: flintlock-sim, poolmgr-local (and for deployed* the reconcile function
# under lambda-emu) on database demand_NAME, time scaled by K. Sets URLS[NAME], SIMLOGS[NAME].
declare -A URLS SIMLOGS CHECK_URLS
CPU_ARGS=()
start_stack() {
    local name=$1 k=$2 db url sim_log boot env_lines=() e
    # Every knob of this stack (knob, fknob) divided by its own k.
    local SCALE=$k
    db=demand_${name//-/_}
    url=$(pg_create_db "$db")
    CHECK_URLS[$name]=$url
    sim_log=$LOGS/flintlock-sim-$name.log
    SIMLOGS[$name]=$sim_log
    boot="lognormal:$(awk -v m=$BOOT_MEDIAN_MS -v k="$k" 'BEGIN {printf "%.3f", m / k}'):$BOOT_SIGMA"
    : >"$sim_log"
    # info: each VM's boot draw is logged with its creation.
    # The rollout trace's broken template: an image the simulator fails (no other trace uses it).
    local fail=()
    [[ $ROLLOUT == 1 ]] && fail=(--fail-image broken)
    RUST_LOG=info stack_sim_start "$sim_log" --listen 127.0.0.1:0 --boot-delay-dist "$boot" --delete-delay-ms 20 "${fail[@]}"
    local sim_addr=$SIM_ADDR
    CPU_ARGS+=(--cpu-pid "flintlock-sim-$name=$SIM_PID")
    mapfile -t env_lines < <(scaled_env)
    [[ $k == 1 ]] || env_lines+=("${EXTRA_ENV[@]}")
    local port emu_port
    port=$(free_port)
    local common=(DATABASE_URL="$url" POOLMGR_ADMIN_TOKENS="bench:$ADMIN" POOLMGR_CLIENT_TOKENS="bench-client:$CLIENT"
        POOLMGR_DB_POOL_SIZE=16 RUST_LOG="${RUST_LOG:-warn}" "${env_lines[@]}")
    if [[ $name == deployed* ]]; then
        emu_port=$(free_port)
        log "stack $name (k = $k): poolmgr-local without a reconciler, waking the reconcile function on 127.0.0.1:$emu_port"
        with_env "${common[@]}" POOLMGR_RECONCILE_TICKER=off POOLMGR_WAKE_LAMBDA_FUNCTION=reconcile \
            POOLMGR_LAMBDA_ENDPOINT="http://127.0.0.1:$emu_port" AWS_REGION=eu-west-1 \
            AWS_ACCESS_KEY_ID="$WAKE_KEY" AWS_SECRET_ACCESS_KEY="$WAKE_SECRET" AWS_SESSION_TOKEN=bench-session -- \
            stack_app_start --out "$LOGS/poolmgr-local-$name.out" "127.0.0.1:$port" "$LOGS/poolmgr-local-$name.log"
        stack_reconcile_fn_start "$name" "$url" "$emu_port" "$(knob 60000 10)" 120000 "$LOGS" "${env_lines[@]}"
        CPU_ARGS+=(--cpu-pid "lambda-emu+reconcile-$name=$SPAWNED_PID")
    else
        log "stack $name (k = $k): poolmgr-local with its in-process reconciler"
        with_env "${common[@]}" -- stack_app_start --out "$LOGS/poolmgr-local-$name.out" "127.0.0.1:$port" "$LOGS/poolmgr-local-$name.log"
    fi
    CPU_ARGS+=(--cpu-pid "poolmgr-local-$name=$APP_PID")
    stack_register_host "$APP_URL" "$ADMIN" sim "$sim_addr"
    URLS[$name]=$APP_URL
}

# A stack per configuration and time scale (the reconciler's knobs are process-wide).
SCALES=()
[[ ,$TRACES, == *,model-day,* ]] && SCALES+=("$SCALE")
[[ ,$TRACES, == *,step* && $STEP_SCALE != "$SCALE" ]] && SCALES+=("$STEP_SCALE")
[[ $ROLLOUT == 1 && " ${SCALES[*]} " != *" $ROLLOUT_SCALE "* ]] && SCALES+=("$ROLLOUT_SCALE")
((${#SCALES[@]} > 0)) || SCALES=("$SCALE")
STACK_ARGS=()
for c in "${CONFIGS[@]}"; do
    for k in "${SCALES[@]}"; do
        start_stack "$c-k$k" "$k"
        STACK_ARGS+=(--stack "$c@$k=${URLS[$c-k$k]}" --sim-log "$c@$k=${SIMLOGS[$c-k$k]}")
    done
    if [[ $REALTIME == 1 ]]; then
        start_stack "$c-rt" 1
        STACK_ARGS+=(--realtime-stack "$c=${URLS[$c-rt]}" --sim-log "$c-realtime=${SIMLOGS[$c-rt]}")
    fi
done

settings="a stack per configuration and time scale, each poolmgr-local ($PROFILE build) on its own database, \
knobs at k = $SCALE (at k = $STEP_SCALE: each divided by $STEP_SCALE instead): \
POOLMGR_RECONCILE_INTERVAL_MS=$(knob 2000 "$TICK_FLOOR_MS") (2 s / k, at least $TICK_FLOOR_MS), \
POOLMGR_RECONCILE_LOOP_INTERVAL_MS=$(knob 500 "$LOOP_FLOOR_MS") (500 ms / k, at least $LOOP_FLOOR_MS), \
POOLMGR_RECONCILE_LINGER_MS=$(knob 5000 20), POOLMGR_WAKE_DEBOUNCE_MS=$(knob 1000 5), \
POOLMGR_AUTOSCALE_WINDOW_SECONDS=$(fknob 60), \
POOLMGR_AUTOSCALE_DEFAULT_PROVISIONING_SECONDS=$(fknob 30)$([[ $ROLLOUT == 1 ]] && echo " (at k = $ROLLOUT_SCALE for the rollout trace: each divided by $ROLLOUT_SCALE)"); deployed: the reconcile function under \
\`lambda-emu schedule\` every $(knob 60000 10) ms (60 s / k), one execution environment, invocations one at a \
time, an Event merged into one still queued (--coalesce), wakes SigV4-checked; the real-time stacks with \
the defaults (a schedule every 60 s). flintlock-sim boots: lognormal:$(fknob $BOOT_MEDIAN_MS):$BOOT_SIGMA \
(ms; lognormal:$BOOT_MEDIAN_MS:$BOOT_SIGMA on the real-time stacks)."

# The rollout trace's stacks, at their own k (the knobs above divided by it instead).
rollout_settings=$(
    SCALE=$ROLLOUT_SCALE
    printf '%s' "a stack per configuration, each poolmgr-local ($PROFILE build) on its own database, knobs at \
k = $SCALE: POOLMGR_RECONCILE_INTERVAL_MS=$(knob 2000 "$TICK_FLOOR_MS") (2 s / k, at least $TICK_FLOOR_MS), \
POOLMGR_RECONCILE_LOOP_INTERVAL_MS=$(knob 500 "$LOOP_FLOOR_MS") (500 ms / k, at least $LOOP_FLOOR_MS), \
POOLMGR_RECONCILE_LINGER_MS=$(knob 5000 20), POOLMGR_WAKE_DEBOUNCE_MS=$(knob 1000 5); deployed: the reconcile \
function under \`lambda-emu schedule\` every $(knob 60000 10) ms (60 s / k), one execution environment, \
invocations one at a time, an Event merged into one still queued (--coalesce), wakes SigV4-checked. flintlock-sim \
boots: lognormal:$(fknob $BOOT_MEDIAN_MS):$BOOT_SIGMA (ms)."
)

log "running the demand benchmark (k = $SCALE for model-day, $STEP_SCALE for the steps$([[ $ROLLOUT == 1 ]] && echo ", $ROLLOUT_SCALE for the rollout trace"), D = $DEMAND; progress every 30 s)"
bench_status=0
RUST_BACKTRACE=0 "$BIN/poolmgr-bench" demand "${STACK_ARGS[@]}" "${CPU_ARGS[@]}" \
    --postmaster-pid "$(head -n 1 "$WORK/pg/data/postmaster.pid")" --admin-token "$ADMIN" --client-token "$CLIENT" \
    --scale "$SCALE" --step-scale "$STEP_SCALE" --stagger-s "$STAGGER" --demand "$DEMAND" --seed "$SEED" --hint-lead-s "$HINT_LEAD" --traces "$TRACES" --policies "$POLICIES" "${ALL_ROWS[@]}" \
    --boot-median-ms "$BOOT_MEDIAN_MS" --boot-sigma "$BOOT_SIGMA" \
    --realtime-claims "$REALTIME_CLAIMS" --realtime-gap-s "$REALTIME_GAP" \
    --rollout-scale "$ROLLOUT_SCALE" --rollout-results "$ROLLOUT_RESULTS" \
    --results "$RESULTS" --summary "$SUMMARY" --settings "$settings" | tee "$WORK/table.txt" || bench_status=$?
if [[ -n $OTHER_TRACES ]]; then
    [[ -s $RESULTS ]] || die "the benchmark wrote no results (exit $bench_status); see the lines above and $LOGS"
fi
if [[ $ROLLOUT == 1 ]]; then
    [[ -s $ROLLOUT_RESULTS ]] || die "the benchmark wrote no rollout results (exit $bench_status); see the lines above and $LOGS"
fi

log "poolmgr-check --settled on every database"
checks=()
check_failed=0
for name in "${!CHECK_URLS[@]}"; do
    out=$("$BIN/poolmgr-check" --database-url "${CHECK_URLS[$name]}" --wait 90s 2>>"$LOGS/check-$name.progress") || check_failed=1
    printf '%s\n' "$out" >"$LOGS/check-$name.out"
    line=$(printf '%s\n' "$out" | grep '^poolmgr-check:' | tail -n 1)
    printf '%s\n' "$out" | grep -v '^poolmgr-check:' >&2 || true
    checks+=("$name: ${line#poolmgr-check: }")
done
check_text=$(IFS=';'; printf '%s' "${checks[*]}" | sed 's/;/; /g')
log "poolmgr-check: $check_text"

if [[ $DOCS == 1 ]]; then
    machine="$(nproc) vCPU ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), \
$(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, $("$(pg_bindir)/postgres" --version 2>/dev/null || echo PostgreSQL), \
$(rustc --version | cut -d' ' -f1-2)."
    if [[ -n $OTHER_TRACES ]]; then
        "$BIN/poolmgr-bench" demand-report --results "$RESULTS" --summary "$SUMMARY" --machine "$machine" \
            --checks "$check_text" --doc "$ROOT/docs/benchmarks.md"
        [[ "$RESULTS" -ef "$ROOT/docs/bench-demand-results.jsonl" ]] || cp "$RESULTS" "$ROOT/docs/bench-demand-results.jsonl"
    fi
    if [[ $ROLLOUT == 1 ]]; then
        "$BIN/poolmgr-bench" demand-rollout-report --results "$ROLLOUT_RESULTS" --machine "$machine" \
            --settings "$rollout_settings" --checks "$check_text" --doc "$ROOT/docs/benchmarks.md"
        cat "$ROLLOUT_RESULTS" >>"$ROOT/docs/bench-rollout-results.jsonl"
    fi
fi
if [[ $bench_status -ne 0 ]]; then
    die "the benchmark found a violation (exit $bench_status): read the VIOLATION lines above; logs in $LOGS"
fi
if [[ $check_failed -ne 0 ]]; then
    die "poolmgr-check found a problem: see $LOGS/check-*.out and the poolmgr-local logs in $LOGS"
fi
log "done: rows in $([[ -n $OTHER_TRACES ]] && echo "$RESULTS")$([[ -n $OTHER_TRACES && $ROLLOUT == 1 ]] && echo " and ")$([[ $ROLLOUT == 1 ]] && echo "$ROLLOUT_RESULTS"), the table in $WORK/table.txt$([[ $DOCS == 1 ]] && echo ", docs/benchmarks.md updated")"
