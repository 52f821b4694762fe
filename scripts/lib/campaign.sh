# shellcheck shell=bash
# The fault campaign of scripts/chaos.sh --campaign N SECONDS [--seed S] (issue 23): a real
# network to break, a schedule of faults from a seed, a history of what clients were told, and
# a checker of that history. Sourced by chaos.sh after stack.sh; needs root (network
# namespaces), and installs nftables and iproute2 from Debian's packages when missing.
#
# The network: a bridge pmbr0 (10.77.0.1, where the clients and the checkers run) and one
# network namespace per process, each joined to the bridge by a veth pair:
#   pm-db   10.77.0.10  PostgreSQL (port 5432)
#   pm-app1 10.77.0.21  poolmgr-local (port 8080)      pm-app2 10.77.0.22  poolmgr-local
#   pm-h1   10.77.0.31  flintlock-sim (port 9090)      pm-h2   10.77.0.32  flintlock-sim
# Faults are made by the kernel and by signals, one at a time, each for 2-7 s (hosts are
# judged dead after 5 s here, so a long hang or reboot crosses that) with 1-3 s
# between them, drawn from the seed (bash's RANDOM, seeded: the same seed replays the same
# schedule):
#   partition X Y    both directions between X and Y dropped (nftables in X's namespace)
#   oneway X Y       X's packets to Y dropped, Y's to X delivered
#   loss X P         P % of X's packets dropped at random (numgen random), both directions
#   kill APP         poolmgr-local SIGKILLed, restarted when the fault ends
#   hang HOST        flintlock-sim SIGSTOPped (a host that accepts and never answers), SIGCONT
#   pg-restart       PostgreSQL stopped (fast) and started again
#   reboot HOST      flintlock-sim SIGKILLed and started again without its state: its
#                    microVMs are gone (rows without microVMs, issue 23 finding 1)
# where X, Y are among the clients, app1, app2, db, h1, h2. At the end everything is healed.
# Then the clients finish (retrying what they were not told yet), the history is checked
# (poolmgr-chaos check: no VM with two leases, no lost lease, no request_id answered with two
# live leases, no unresolved outcome), `poolmgr-check --wait` must be clean and every pool back
# at its size within RECOVERY_BOUND seconds of the heal. One line per seed; the last line is
# `anomalies: K`.
#
# CAMPAIGN_APP_BIN=PATH runs another poolmgr-local build under the same campaign (the one
# before a fix, to see the campaign find what it fixed); RECOVERY_BOUND (120) as above.

CAMPAIGN_NET=10.77.0
CAMPAIGN_BR=pmbr0
declare -A CAMPAIGN_IP=([client]=$CAMPAIGN_NET.1 [db]=$CAMPAIGN_NET.10 [app1]=$CAMPAIGN_NET.21
    [app2]=$CAMPAIGN_NET.22 [h1]=$CAMPAIGN_NET.31 [h2]=$CAMPAIGN_NET.32)
CAMPAIGN_NODES=(db app1 app2 h1 h2)
# Seconds after the heal within which the checker must be clean and every pool at size.
RECOVERY_BOUND=${RECOVERY_BOUND:-120}

campaign_tools() {
    local missing=()
    command -v nft >/dev/null 2>&1 || missing+=(nftables)
    command -v ip >/dev/null 2>&1 || missing+=(iproute2)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} (Debian packages)"
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; then
            apt-get update -q >/dev/null 2>&1 || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null ||
                die "could not install ${missing[*]}; install them (apt-get install ${missing[*]}) and retry"
        fi
    fi
    [[ $(id -u) -eq 0 ]] || die "the campaign needs root (network namespaces and nftables); run it as root"
}

ns() { echo "pm-$1"; }

campaign_net_down() {
    local n
    for n in "${CAMPAIGN_NODES[@]}"; do
        ip netns del "$(ns "$n")" 2>/dev/null || true
    done
    ip link del "$CAMPAIGN_BR" 2>/dev/null || true
}

campaign_net_up() {
    campaign_net_down
    log "network: bridge $CAMPAIGN_BR ($CAMPAIGN_NET.0/24), namespaces ${CAMPAIGN_NODES[*]/#/pm-}"
    ip link add "$CAMPAIGN_BR" type bridge
    ip addr add "${CAMPAIGN_IP[client]}/24" dev "$CAMPAIGN_BR"
    ip link set "$CAMPAIGN_BR" up
    local n
    for n in "${CAMPAIGN_NODES[@]}"; do
        ip netns add "$(ns "$n")"
        ip link add "pm-$n-br" type veth peer name eth0 netns "$(ns "$n")"
        ip link set "pm-$n-br" master "$CAMPAIGN_BR" up
        ip netns exec "$(ns "$n")" ip link set lo up
        ip netns exec "$(ns "$n")" ip addr add "${CAMPAIGN_IP[$n]}/24" dev eth0
        ip netns exec "$(ns "$n")" ip link set eth0 up
        ip netns exec "$(ns "$n")" nft -f - <<'EOF'
table inet chaos {
    chain input { type filter hook input priority 0; policy accept; }
    chain output { type filter hook output priority 0; policy accept; }
}
EOF
    done
    at_exit campaign_net_down
}

# The namespace where X's rules go, and the address its peers see: the clients live in the
# root namespace, so a fault "client X" is written in X's namespace against the client address.
nft_in() { ip netns exec "$(ns "$1")" nft "${@:2}"; }

fault_partition() { # X Y (X is never the client)
    nft_in "$1" add rule inet chaos output ip daddr "${CAMPAIGN_IP[$2]}" drop
    nft_in "$1" add rule inet chaos input ip saddr "${CAMPAIGN_IP[$2]}" drop
}
fault_oneway() { # X Y: X -> Y dropped (either may be the clients: the rule goes on the other side)
    if [[ $1 == client ]]; then
        nft_in "$2" add rule inet chaos input ip saddr "${CAMPAIGN_IP[client]}" drop
    else
        nft_in "$1" add rule inet chaos output ip daddr "${CAMPAIGN_IP[$2]}" drop
    fi
}
fault_loss() { # X PCT
    nft_in "$1" add rule inet chaos output numgen random mod 100 '<' "$2" drop
    nft_in "$1" add rule inet chaos input numgen random mod 100 '<' "$2" drop
}
heal_network() {
    local n
    for n in "${CAMPAIGN_NODES[@]}"; do
        nft_in "$n" flush chain inet chaos input
        nft_in "$n" flush chain inet chaos output
    done
}

# --- processes -----------------------------------------------------------------------------

declare -A CAMPAIGN_PID=()

campaign_pg_start() {
    # shellcheck disable=SC2016
    ip netns exec pm-db env PG_WANT_PORT=5432 PG_FAST=1 \
        PG_OPTS="-c listen_addresses=127.0.0.1,${CAMPAIGN_IP[db]} -c hba_file=$CDIR/hba.conf" \
        bash -c '. "$1/scripts/lib/pg.sh"; pg_start "$2"' _ "$ROOT" "$CDIR/pg" >>"$CLOGS/pg.log" 2>&1 ||
        die "PostgreSQL did not start in pm-db; see $CDIR/pg/postgres.log"
}
campaign_pg_stop() {
    # shellcheck disable=SC2016
    ip netns exec pm-db bash -c '. "$1/scripts/lib/pg.sh"; pg_stop "$2"' _ "$ROOT" "$CDIR/pg" >>"$CLOGS/pg.log" 2>&1 || true
}

campaign_sim_start() { # h1|h2
    stack_spawn "flintlock-sim" "$CLOGS/$1.log" "$CLOGS/$1.log" ip netns exec "$(ns "$1")" \
        "$BIN/flintlock-sim" --listen "0.0.0.0:9090" --boot-delay-ms 300 --delete-delay-ms 50 --state-file "$CRUN/$1.state" \
        --exec-slow setup=1500 --exec-slow reset=700
    CAMPAIGN_PID[$1]=$SPAWNED_PID
}

campaign_app_start() { # app1|app2
    DATABASE_URL=$CDB_URL POOLMGR_ADMIN_TOKENS=admin:$CADMIN POOLMGR_CLIENT_TOKENS=campaign:$CCLIENT \
        POOLMGR_HTTP_ADDR=0.0.0.0:8080 POOLMGR_RECONCILE_INTERVAL_SECONDS=1 POOLMGR_DB_CONNECT_TIMEOUT_SECONDS=2 \
        POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS=5 POOLMGR_FLINTLOCK_TIMEOUT_SECONDS=2 \
        POOLMGR_RECONCILE_DEADLINE_SECONDS=10 POOLMGR_HOOK_TIMEOUT_SECONDS=5 POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS=5 \
        POOLMGR_ORPHAN_SCAN_SECONDS=2 POOLMGR_RECONCILE_BACKOFF_MS=100 POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS=2 \
        POOLMGR_HOST_DEAD_SECONDS=5 RUST_LOG=${RUST_LOG:-warn} \
        stack_spawn poolmgr-local "$CLOGS/$1.log" "$CLOGS/$1.log" ip netns exec "$(ns "$1")" "${CAMPAIGN_APP_BIN:-$BIN/poolmgr-local}"
    CAMPAIGN_PID[$1]=$SPAWNED_PID
}

campaign_wait_app() { # app1|app2
    local t0=$SECONDS code
    while ((SECONDS - t0 < 60)); do
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://${CAMPAIGN_IP[$1]}:8080/healthz" || true)
        [[ $code == 200 ]] && return 0
        pid_alive "${CAMPAIGN_PID[$1]}" || die "poolmgr-local in pm-$1 exited; see $CLOGS/$1.log"
        sleep 0.2
    done
    die "poolmgr-local in pm-$1 did not answer /healthz in 60 s; see $CLOGS/$1.log"
}

campaign_stop_all() {
    local n
    for n in app1 app2 h1 h2; do
        [[ -n ${CAMPAIGN_PID[$n]:-} ]] || continue
        kill -CONT "${CAMPAIGN_PID[$n]}" 2>/dev/null || true
        stack_stop "${CAMPAIGN_PID[$n]}" KILL
        unset "CAMPAIGN_PID[$n]"
    done
}

capi() { # METHOD PATH [JSON]
    local args=(-fsS --max-time 10 -X "$1" "http://${CAMPAIGN_IP[app1]}:8080$2" -H "Authorization: Bearer $CADMIN")
    [[ $# -ge 3 ]] && args+=(-H 'content-type: application/json' -d "$3")
    curl "${args[@]}"
}

csql() { "$PG_BINDIR/psql" -X -q -t -A -v ON_ERROR_STOP=1 -d "$CDB_URL" -c "$1"; }

# Pools: `plain` (6, no hooks) and `hooked` (4, a create and a pre-lease hook, QUARANTINE:
# a transport error taken for a hook failure would quarantine VMs and leave it short). The
# hosts run `setup` for 1.5 s and `reset` for 0.7 s, so faults meet hooks mid-command.
CAMPAIGN_POOLS=(plain:6 hooked:4)
campaign_pools() {
    local tpl='"microvm_template": {"root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}}, "interfaces": [{"device_id": "eth1", "type": "TAP"}]}'
    local common='"flintlock_hosts": ["h1", "h2"], "replenishment": {"strategy": "REPLACE_ON_DELETE"}, "heartbeat_interval_seconds": 10, "heartbeat_expiry_seconds": 30'
    capi POST /v1/pools '{"namespace": "default", "name": "plain", "size": 6, '"$common"', '"$tpl"'}' >/dev/null
    capi POST /v1/pools '{"namespace": "default", "name": "hooked", "size": 4, '"$common"', "create_commands": ["setup"], "pre_lease_commands": ["reset"], "hook_failure_policy": "QUARANTINE", '"$tpl"'}' >/dev/null
}

# Whether every pool has its size AVAILABLE and nothing else (the clients released all).
campaign_pools_at_size() {
    local p name size n
    for p in "${CAMPAIGN_POOLS[@]}"; do
        name=${p%%:*} size=${p##*:}
        n=$(csql "SELECT count(*) FROM vms WHERE pool_name = '$name' AND phase = 'AVAILABLE'") || return 1
        [[ $n -ge $size ]] || return 1
    done
}

# --- the schedule ----------------------------------------------------------------------------

# campaign_schedule SEED SECONDS: prints the schedule, one fault per line:
# START DURATION KIND ARGS... (seconds from the start of the load).
campaign_schedule() {
    RANDOM=$1
    local t=$((1 + RANDOM % 3)) dur kind a b link
    # The links that carry traffic: clients to the apps, the apps to PostgreSQL and the hosts.
    local links=("client app1" "client app2" "app1 db" "app2 db" "app1 h1" "app1 h2" "app2 h1" "app2 h2")
    local apps=(app1 app2) hosts=(h1 h2)
    while ((t < $2)); do
        dur=$((2 + RANDOM % 6))
        kind=$((RANDOM % 7))
        link=${links[RANDOM % ${#links[@]}]}
        a=${link% *} b=${link#* }
        case $kind in
            # A partition's rules go in the namespace of its side that is not the clients'.
            0) echo "$t $dur partition $b $a" ;;
            1) ((RANDOM % 2)) && echo "$t $dur oneway $a $b" || echo "$t $dur oneway $b $a" ;;
            2) echo "$t $dur loss ${CAMPAIGN_NODES[RANDOM % 5]} $((20 + RANDOM % 41))" ;;
            3) echo "$t $dur kill ${apps[RANDOM % 2]}" ;;
            4) echo "$t $dur hang ${hosts[RANDOM % 2]}" ;;
            5) echo "$t $dur pg-restart" ;;
            6) echo "$t $dur reboot ${hosts[RANDOM % 2]}" ;;
        esac
        t=$((t + dur + 1 + RANDOM % 3))
    done
}

campaign_inject() { # KIND ARGS...: start the fault
    case $1 in
        partition) fault_partition "$2" "$3" ;;
        oneway) fault_oneway "$2" "$3" ;;
        loss) fault_loss "$2" "$3" ;;
        kill) kill -KILL "${CAMPAIGN_PID[$2]}" 2>/dev/null || true ;;
        hang) kill -STOP "${CAMPAIGN_PID[$2]}" ;;
        pg-restart) campaign_pg_stop ;;
        # A host that reboots loses its microVMs: rows without microVMs (finding 1).
        reboot)
            kill -KILL "${CAMPAIGN_PID[$2]}" 2>/dev/null || true
            rm -f "$CRUN/$2.state"
            ;;
    esac
}

campaign_heal() { # KIND ARGS...: end the fault
    case $1 in
        partition | oneway | loss) heal_network ;;
        kill)
            stack_wait "${CAMPAIGN_PID[$2]}" || true
            campaign_app_start "$2"
            ;;
        hang) kill -CONT "${CAMPAIGN_PID[$2]}" ;;
        pg-restart) campaign_pg_start ;;
        reboot)
            stack_wait "${CAMPAIGN_PID[$2]}" || true
            campaign_sim_start "$2"
            ;;
    esac
}

# --- one seed ----------------------------------------------------------------------------------

# campaign_seed SEED SECONDS: runs one seed; prints its line; adds its anomalies to ANOMALIES.
campaign_seed() {
    local seed=$1 secs=$2
    CRUN=$CDIR/seed-$seed
    CLOGS=$CRUN/logs
    rm -rf "$CRUN"
    mkdir -p "$CLOGS"
    local db=campaign_$seed
    "$PG_BINDIR/psql" -X -q -d "postgres://postgres@${CAMPAIGN_IP[db]}:5432/postgres" \
        -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
    # The campaign's server is plaintext on a private veth network: say so, since a URL
    # without sslmode to a non-loopback host means verify-full.
    CDB_URL="postgres://postgres@${CAMPAIGN_IP[db]}:5432/$db?sslmode=disable"
    CADMIN=campaign-admin-$(random_token)
    CCLIENT=campaign-client-$(random_token)

    local schedule
    schedule=$(campaign_schedule "$seed" "$secs")
    log "seed $seed: $(wc -l <<<"$schedule") faults over ${secs}s:"
    sed 's/^/    t=/' <<<"$schedule" >&2

    campaign_sim_start h1
    campaign_sim_start h2
    campaign_app_start app1
    campaign_wait_app app1
    campaign_app_start app2
    campaign_wait_app app2
    stack_register_host "http://${CAMPAIGN_IP[app1]}:8080" "$CADMIN" h1 "${CAMPAIGN_IP[h1]}:9090" >/dev/null
    stack_register_host "http://${CAMPAIGN_IP[app1]}:8080" "$CADMIN" h2 "${CAMPAIGN_IP[h2]}:9090" >/dev/null
    campaign_pools
    local t0=$SECONDS
    until campaign_pools_at_size; do
        ((SECONDS - t0 < 90)) || die "seed $seed: the pools never filled; see $CLOGS"
        sleep 0.5
    done

    local heal=$CRUN/healed load_pid
    stack_spawn poolmgr-chaos "$CRUN/load.out" "$CLOGS/load.log" "$BIN/poolmgr-chaos" load \
        --endpoints "http://${CAMPAIGN_IP[app1]}:8080,http://${CAMPAIGN_IP[app2]}:8080" --token "$CCLIENT" \
        --pools default/plain,default/hooked --clients 6 --duration "${secs}s" --heal-file "$heal" \
        --give-up "${RECOVERY_BOUND}s" --history "$CRUN/history.jsonl" --lease-expiry 30
    load_pid=$SPAWNED_PID
    local start=$SECONDS line at dur kind args
    declare -A by_kind=()
    while read -r at dur kind args; do
        [[ -n $at ]] || continue
        while ((SECONDS - start < at)); do sleep 0.1; done
        # shellcheck disable=SC2086
        campaign_inject "$kind" $args
        by_kind[$kind]=$((${by_kind[$kind]:-0} + 1))
        while ((SECONDS - start < at + dur)); do sleep 0.1; done
        # shellcheck disable=SC2086
        campaign_heal "$kind" $args
    done <<<"$schedule"
    while ((SECONDS - start < secs)); do sleep 0.2; done
    heal_network
    touch "$heal"
    local t_heal=$SECONDS status=0
    stack_wait "$load_pid" || status=$?
    line=$(tail -n 1 "$CRUN/load.out")
    local anomalies
    anomalies=$(sed -n 's/.*anomalies=\([0-9]*\).*/\1/p' <<<"$line")
    [[ -n $anomalies ]] || {
        anomalies=1
        log "seed $seed: the load did not finish ($status); see $CLOGS/load.log"
    }
    grep ANOMALY "$CLOGS/load.log" >&2 || true

    # Recovery: every pool at size, then the checker clean, both within the bound of the heal.
    local check_ok=0 recovered=""
    while ((SECONDS - t_heal < RECOVERY_BOUND)); do
        if campaign_pools_at_size; then
            recovered=$((SECONDS - t_heal))
            break
        fi
        sleep 0.5
    done
    if [[ -z $recovered ]]; then
        log "seed $seed: pools not back at size ${RECOVERY_BOUND}s after the heal"
        csql "SELECT pool_name, phase, count(*) FROM vms GROUP BY 1, 2 ORDER BY 1, 2" >&2 || true
        anomalies=$((anomalies + 1))
        recovered=">$RECOVERY_BOUND"
    fi
    local left=$((RECOVERY_BOUND - (SECONDS - t_heal)))
    ((left >= 10)) || left=10
    if "$BIN/poolmgr-check" --database-url "$CDB_URL" --wait "${left}s" >"$CRUN/check.out" 2>"$CLOGS/check.log"; then
        check_ok=1
    else
        log "seed $seed: poolmgr-check not clean: $(grep VIOLATION "$CRUN/check.out" | head -n 3 | tr '\n' ' ')"
        anomalies=$((anomalies + 1))
    fi
    # The hosts' hook commands never fail by themselves: a VM_HOOK_FAILED is the network's
    # doing (finding 3), an anomaly, unless a claim's hook ran past its deadline (a hung host
    # and a hung command look alike to a claim) or its claim was abandoned (poolmgr-local
    # killed mid-hook: the VM is deleted by design, never handed out half-hooked): counted,
    # not anomalies.
    local hook_failed hook_deadline hook_abandoned
    local deadline_like="payload->>'reason' LIKE '%within the claim''s deadline%'"
    local abandoned_like="payload->>'reason' LIKE 'claim abandoned mid-hook%'"
    hook_deadline=$(csql "SELECT count(*) FROM events WHERE type = 'VM_HOOK_FAILED' AND $deadline_like")
    hook_abandoned=$(csql "SELECT count(*) FROM events WHERE type = 'VM_HOOK_FAILED' AND $abandoned_like")
    hook_failed=$(csql "SELECT count(*) FROM events WHERE type = 'VM_HOOK_FAILED' AND NOT ($deadline_like) AND NOT ($abandoned_like)")
    if ((hook_failed > 0)); then
        log "seed $seed: $hook_failed hook failures caused by faults:"
        csql "SELECT vm_id, payload->>'reason' FROM events WHERE type = 'VM_HOOK_FAILED'" >&2 || true
        anomalies=$((anomalies + hook_failed))
    fi
    local kinds=""
    for kind in "${!by_kind[@]}"; do kinds+="$kind=${by_kind[$kind]},"; done
    printf 'seed %s: %s  faults {%s} %s hook_failed=%s hook_deadline=%s hook_abandoned=%s check=%s recovered_in=%ss anomalies=%s\n' "$seed" \
        "$([[ $anomalies == 0 ]] && echo PASS || echo FAIL)" "${kinds%,}" "${line% anomalies=*}" \
        "$hook_failed" "$hook_deadline" "$hook_abandoned" "$([[ $check_ok == 1 ]] && echo clean || echo dirty)" "$recovered" "$anomalies"
    ANOMALIES=$((ANOMALIES + anomalies))
    campaign_stop_all
}

# campaign_main N SECONDS [SEED]
campaign_main() {
    local n=$1 secs=$2 seed=${3:-}
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $secs =~ ^[0-9]+$ && $secs -ge 5 ]] ||
        die "usage: scripts/chaos.sh --campaign N SECONDS [--seed S] (N >= 1 seeds, SECONDS >= 5)"
    if [[ -z $seed ]]; then
        seed=$(((RANDOM << 15 | RANDOM) % 1000000))
        log "no --seed given: starting from seed $seed (rerun one with --campaign 1 $secs --seed SEED)"
    fi
    campaign_tools
    log "building poolmgr-local, flintlock-sim, poolmgr-check, poolmgr-chaos (debug)"
    stack_build debug -q -p poolmgr-local -p flintlock-sim -p poolmgr-check
    BIN=$STACK_BIN
    CDIR=$ROOT/.dev/campaign
    CLOGS=$CDIR
    campaign_net_up
    if [[ -d $CDIR/pg/data ]]; then campaign_pg_stop; fi
    rm -rf "$CDIR"
    mkdir -p "$CDIR"
    CLOGS=$CDIR
    PG_BINDIR=$(pg_bindir)
    # The apps and the checkers reach it over the bridge: trust the campaign's network only.
    printf 'local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all %s.0/24 trust\n' "$CAMPAIGN_NET" >"$CDIR/hba.conf"
    chmod 644 "$CDIR/hba.conf"
    campaign_pg_start
    at_exit campaign_pg_stop
    at_exit campaign_stop_all
    ANOMALIES=0
    local i
    for ((i = 0; i < n; i++)); do
        campaign_seed $((seed + i)) "$secs"
    done
    echo "anomalies: $ANOMALIES"
    [[ $ANOMALIES == 0 ]]
}
