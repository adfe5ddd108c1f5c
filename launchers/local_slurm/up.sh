#!/usr/bin/env bash
# Bring up a real Slurm 22.05 cluster with accounting (slurmdbd + MariaDB) on this machine.
# Usage: up.sh [NODES]   NODES: how many Slurm nodes (one slurmd each) share this machine's CPUs and memory;
# default 1 (a node named after the host), or $TINKER_EXP_SLURM_NODES. Nodes n1..nN when more than one.
# Everything (config, state, logs, sockets, pid files) lives under one folder; see README.md.
# Idempotent: healthy daemons are left alone, dead/stale/reconfigured ones are (re)started.
# Progress goes to stderr; the last stdout line is `export SLURM_CONF=...` (also in $BASE/env.sh).
set -euo pipefail
umask 022

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
CTLD_PORT="${TINKER_EXP_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${TINKER_EXP_SLURM_SLURMD_PORT:-6818}"
DBD_PORT="${TINKER_EXP_SLURM_DBD_PORT:-6819}"
DB_PORT="${TINKER_EXP_SLURM_DB_PORT:-6820}"   # MariaDB; not 3306, to stay clear of a system server
CLUSTER=tinker
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

DBD_CONF="$ETC/slurmdbd.conf" KEY="$ETC/munge.key" DB_PASS_FILE="$ETC/db.pass"
MUNGE_SOCK="$RUN/munge.sock" DB_SOCK="$RUN/mysqld.sock"
HOST="$(hostname -s)"
NODE_COUNT="${1:-${TINKER_EXP_SLURM_NODES:-1}}"
[[ $NODE_COUNT =~ ^[1-9][0-9]?$ ]] || { say "ERROR: NODES must be a number from 1 to 99, got '$NODE_COUNT'"; exit 2; }
if ((NODE_COUNT == 1)); then NODES=("$HOST"); else mapfile -t NODES < <(seq -f 'n%g' 1 "$NODE_COUNT"); fi
# A node's slurmd port: the first takes SLURMD_PORT, the others the ports after the database's.
node_port() { if (($1 == 0)); then echo "$SLURMD_PORT"; else echo $((DB_PORT + $1)); fi; }
export SLURM_CONF="$CONF"

# Print why NAME failed plus the tail of its logs, then exit non-zero.
fail() {
    local name=$1 f
    shift
    say "ERROR: $name: $*"
    for f in "$LOG/$name.log" "$LOG/$name.out"; do
        [[ -s $f ]] && { echo "----- tail of $f" >&2; tail -n 25 "$f" >&2; }
    done
    exit 1
}

# Pids of processes we started (tagged environment) that are daemon NAME (slurmd-NODE: the slurmd of NODE;
# slurmd-*: every slurmd).
tagged_pids() {
    local p comm node
    for p in /proc/[0-9]*; do
        read -r comm <"$p/comm" 2>/dev/null || continue
        [[ $comm == "${1%%-*}" ]] || continue
        if [[ $1 == slurmd-* ]]; then
            node=$({ tr '\0' '\n' <"$p/cmdline"; } 2>/dev/null | sed -n '/^-N$/{n;p;}')
            [[ $1 == "slurmd-*" || $node == "${1#slurmd-}" ]] || continue
        fi
        { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "$TAG" && echo "${p#/proc/}"
    done
    return 0
}

# slurmd daemons of nodes no longer in the config (the node count changed).
stop_other_slurmds() {
    local p node keep=" ${NODES[*]} " stray=()
    for p in $(tagged_pids "slurmd-*"); do
        node=$({ tr '\0' '\n' <"/proc/$p/cmdline"; } 2>/dev/null | sed -n '/^-N$/{n;p;}')
        [[ $keep == *" $node "* ]] || stray+=("$p")
    done
    ((${#stray[@]})) || return 0
    say "stopping the slurmd of nodes no longer configured (pids ${stray[*]})"
    stop_pids "${stray[@]}"
}

# SIGTERM the pids, SIGKILL whatever is left after 20 s.
stop_pids() {
    local p end=$((SECONDS + 20))
    (($#)) || return 0
    kill -TERM "$@" 2>/dev/null || true
    for p in "$@"; do
        while kill -0 "$p" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$p/status" 2>/dev/null; do
            if ((SECONDS >= end)); then kill -KILL "$p" 2>/dev/null || true; break; fi
            sleep 0.2
        done
    done
}

# Start a daemon detached from our stdout (callers pipe us into `tail`) and from the lock fd.
launch() {
    local name=$1
    shift
    (cd / && exec env "$TAG" "$@" </dev/null >>"$LOG/$name.out" 2>&1 9>&-)
}

# Write stdin to FILE with MODE only when the content differs (keeps mtimes stable).
update_file() {
    local file=$1 mode=$2 tmp
    tmp=$(mktemp "$file.XXXXXX")
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if [[ -f $file ]] && cmp -s "$tmp" "$file"; then rm -f "$tmp"; else mv -f "$tmp" "$file"; fi
}

install_packages() {
    local bin missing=0
    for bin in slurmctld slurmd slurmdbd sinfo srun sacct sacctmgr munged munge unmunge \
        mariadbd mariadb mariadb-admin mariadb-install-db; do
        command -v "$bin" >/dev/null || missing=1
    done
    ((missing)) || return 0
    ((EUID == 0)) || { say "ERROR: missing packages and not root; install: ${PACKAGES[*]}"; exit 1; }
    say "installing ${PACKAGES[*]} (log: $LOG/apt.log)"
    # Keep package scripts from starting system-wide munge/mariadb/slurm services.
    local guard=/usr/sbin/policy-rc.d made_guard=0
    if [[ ! -e $guard ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$guard" && chmod 755 "$guard" && made_guard=1
    fi
    local rc=0
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120 install -y -qq \
            --no-install-recommends "${PACKAGES[@]}" >>"$LOG/apt.log" 2>&1
    }
    # Refresh the package lists only when they are empty or stale (install fails without it).
    if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null || ! apt_install; then
        { apt-get -o DPkg::Lock::Timeout=120 update -qq >>"$LOG/apt.log" 2>&1 && apt_install; } || rc=$?
    fi
    ((made_guard)) && rm -f "$guard"
    ((rc == 0)) || fail apt "package install failed"
}

prepare_dirs() {
    mkdir -p "$ETC" "$RUN" "$LOG" "$STATE/slurmctld" "$STATE/munge"
    local node
    for node in "${NODES[@]}"; do mkdir -p "$STATE/slurmd/$node"; done
    # munged refuses group/world-writable dirs; non-root clients need to reach the socket.
    chmod 755 "$BASE" "$ETC" "$RUN" "$LOG" "$STATE"
    chmod 700 "$STATE/munge"
    if [[ ! -s $KEY ]]; then
        dd if=/dev/urandom of="$KEY.tmp" bs=1024 count=1 status=none
        chmod 400 "$KEY.tmp" && mv -f "$KEY.tmp" "$KEY"
    fi
    if [[ ! -s $DB_PASS_FILE ]]; then
        (umask 077 && tr -dc 'A-Za-z0-9' </dev/urandom | head -c 24 >"$DB_PASS_FILE") || true
    fi
}

write_configs() {
    local hw db_pass cpus mem i node_lines=""
    db_pass=$(<"$DB_PASS_FILE")
    # e.g. "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=23990"
    hw=$(slurmd -C 2>/dev/null | sed -n '1s/^NodeName=[^ ]* //p')
    [[ $hw == CPUs=*RealMemory=* ]] || fail slurmd "cannot read the node's hardware from 'slurmd -C': $hw"
    if ((NODE_COUNT == 1)); then
        node_lines="NodeName=$HOST NodeAddr=127.0.0.1 Port=$SLURMD_PORT $hw"
    else  # the machine's CPUs and memory shared out: scheduling labels only, nothing is confined
        cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw") mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
        ((cpus >= NODE_COUNT)) || fail slurmd "$NODE_COUNT nodes need at least $NODE_COUNT CPUs; this machine has $cpus"
        for i in "${!NODES[@]}"; do
            node_lines+="NodeName=${NODES[i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(node_port "$i")"
            node_lines+=" CPUs=$((cpus / NODE_COUNT)) RealMemory=$((mem / NODE_COUNT))"$'\n'
        done
    fi

    update_file "$DBD_CONF" 600 <<EOF
# Written by launchers/local_slurm/up.sh; edits are overwritten.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$db_pass
StorageLoc=slurm_acct_db
EOF

    update_file "$CONF" 644 <<EOF
# Written by launchers/local_slurm/up.sh; edits are overwritten.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
CredType=cred/munge
StateSaveLocation=$STATE/slurmctld
# Per node (%n): several slurmd daemons share this machine.
SlurmdSpoolDir=$STATE/slurmd/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
# No cgroups/systemd here: resources are scheduling labels, nothing is confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Reject impossible requests at submit time instead of leaving them PENDING forever.
EnforcePartLimits=ALL
# A job whose begin time passes (a requeued one, held a while by Slurm) starts at the main scheduler's next pass:
# every 2 s, not Slurm's 60 (a handful of jobs: each pass is cheap; the backfill scheduler skips its passes while no
# job or node changed, so it does not start such a job either).
SchedulerParameters=batch_sched_delay=0,sched_interval=2
MinJobAge=3600
ReturnToService=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# With auth/munge this names the munge socket used to talk to slurmdbd.
AccountingStoragePass=$MUNGE_SOCK
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
${node_lines%$'\n'}
PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF

    echo "export SLURM_CONF=$CONF" | update_file "$BASE/env.sh" 644
}

# --- per daemon: command line, config fingerprint, health check --------------------------------

MUNGED_CMD=(munged --socket="$MUNGE_SOCK" --key-file="$KEY" --pid-file="$RUN/munged.pid"
    --log-file="$LOG/munged.log" --seed-file="$STATE/munge/seed")
MARIADBD_CMD=(mariadbd --no-defaults --user=root --datadir="$DB" --socket="$DB_SOCK"
    --pid-file="$RUN/mariadbd.pid" --log-error="$LOG/mariadbd.log" --port="$DB_PORT"
    --bind-address=127.0.0.1 --skip-name-resolve --innodb-buffer-pool-size=512M
    --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 --max-allowed-packet=64M)
SLURMDBD_CMD=(slurmdbd)                     # finds slurmdbd.conf next to $SLURM_CONF
SLURMCTLD_CMD=(slurmctld -f "$CONF")        # no -c: keep job/node state across restarts
# Daemon names: munged, mariadbd, slurmdbd, slurmctld, and slurmd-NODE for each node's slurmd.
cmd_of() {
    case $1 in
        munged) printf '%s\n' "${MUNGED_CMD[@]}" ;;
        mariadbd) printf '%s\n' "${MARIADBD_CMD[@]}" ;;
        slurmdbd) printf '%s\n' "${SLURMDBD_CMD[@]}" ;;
        slurmctld) printf '%s\n' "${SLURMCTLD_CMD[@]}" ;;
        slurmd-*) printf '%s\n' slurmd -f "$CONF" -N "${1#slurmd-}" ;;
    esac
}

# What a running daemon must have been started with; a mismatch means "restart it".
fingerprint() {
    case $1 in
        munged) { cmd_of munged; cat "$KEY"; } | cksum ;;
        mariadbd) cmd_of mariadbd | cksum ;;
        slurmdbd) { cmd_of slurmdbd; cat "$DBD_CONF"; } | cksum ;;
        slurmctld | slurmd-*) { cmd_of "$1"; cat "$CONF"; } | cksum ;;
    esac
}

db_sql() { mariadb --no-defaults -S "$DB_SOCK" -u root -N -B -e "$1" 2>>"$LOG/mariadbd.out"; }

healthy_munged() { munge -n -S "$MUNGE_SOCK" 2>/dev/null | unmunge -S "$MUNGE_SOCK" >/dev/null 2>&1; }
healthy_mariadbd() { mariadb --no-defaults -S "$DB_SOCK" -u root -e 'SELECT 1' >/dev/null 2>&1; }
CLUSTERS=""   # set by healthy_slurmdbd, saves a second sacctmgr call
healthy_slurmdbd() { CLUSTERS=$(timeout 10 sacctmgr -n -P list cluster format=cluster 2>/dev/null); }
healthy_slurmctld() { timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }
declare -A RESUMED=()
healthy_slurmd() {
    local node=$1 state
    state=$(timeout 5 sinfo -h -N -n "$node" -o %t 2>/dev/null) || return 1
    case $state in
        idle | mix | alloc | comp) return 0 ;;
        drain | drng | down | fail | failg)  # answering but held back by an old reason: release it once
            if [[ -z ${RESUMED[$node]:-} ]]; then
                RESUMED[$node]=1
                say "node $node is '$state'; resuming it"
                timeout 5 scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
            fi
            return 1 ;;
        *) return 1 ;;
    esac
}
healthy() { case $1 in slurmd-*) healthy_slurmd "${1#slurmd-}" ;; *) "healthy_$1" ;; esac; }

pre_start_mariadbd() {
    # Initialise the data dir once; a half-made one (no marker) is redone from scratch.
    if [[ ! -f $DB/.tinker_initialized ]]; then
        rm -rf "$DB"
        say "initialising MariaDB data dir $DB"
        mariadb-install-db --no-defaults --user=root --datadir="$DB" --auth-root-authentication-method=socket \
            --skip-test-db >>"$LOG/mariadbd.out" 2>&1 || fail mariadbd "mariadb-install-db failed"
        touch "$DB/.tinker_initialized"
    fi
    rm -f "$DB_SOCK"
}

# Every slurmdbd (re)start: make sure its database and user exist (cheap, idempotent).
pre_start_slurmdbd() {
    local pass
    pass=$(<"$DB_PASS_FILE")
    db_sql "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
        ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
        GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
        fail mariadbd "cannot create the accounting database/user"
}

launch_munged() { launch munged "${MUNGED_CMD[@]}"; }
launch_mariadbd() { launch mariadbd setsid -f "${MARIADBD_CMD[@]}"; } # it does not daemonize itself
launch_slurmdbd() { launch slurmdbd "${SLURMDBD_CMD[@]}"; }
launch_slurmctld() { launch slurmctld "${SLURMCTLD_CMD[@]}"; }
launch_daemon() {
    local cmd
    case $1 in
        slurmd-*) mapfile -t cmd < <(cmd_of "$1"); launch "$1" "${cmd[@]}" ;;
        *) "launch_$1" ;;
    esac
}

declare -A PORT=([mariadbd]=$DB_PORT [slurmdbd]=$DBD_PORT [slurmctld]=$CTLD_PORT)
for i in "${!NODES[@]}"; do PORT[slurmd-${NODES[i]}]=$(node_port "$i"); done
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
declare -A START_TIMEOUT=([munged]=15 [mariadbd]=60 [slurmdbd]=90 [slurmctld]=60 [slurmd]=60)
STARTED=()

# Leave NAME alone if it runs with the current config and answers; otherwise (re)start it.
ensure() {
    local name=$1 pid want reason
    want=$(fingerprint "$name")
    if pid=$(pid_of "$name"); then
        if [[ $(cat "$RUN/$name.fingerprint" 2>/dev/null) != "$want" ]]; then
            reason="config changed"
        elif wait_until 10 healthy "$name"; then
            return 0
        else
            reason="running (pid $pid) but not answering"
        fi
        say "restarting $name: $reason"
        stop_pids "$pid"
    fi
    # A copy that lost its pid file would hold our ports/sockets.
    # shellcheck disable=SC2046
    stop_pids $(tagged_pids "$name")
    rm -f "$RUN/$name.pid"
    if [[ -n ${PORT[$name]:-} ]] && port_busy "${PORT[$name]}"; then
        say "ERROR: $name: port ${PORT[$name]} on 127.0.0.1 is taken by another program" \
            "(set TINKER_EXP_SLURM_{CTLD,SLURMD,DBD,DB}_PORT to move this cluster)"
        exit 1
    fi
    if declare -F "pre_start_$name" >/dev/null; then "pre_start_$name"; fi
    say "starting $name"
    launch_daemon "$name" || fail "$name" "failed to start"
    echo "$want" >"$RUN/$name.fingerprint"
    STARTED+=("$name")
    local t0=$SECONDS timeout=${START_TIMEOUT[${name%%-*}]}
    until healthy "$name"; do
        if ((SECONDS - t0 >= timeout)); then
            fail "$name" "not ready after $timeout s"
        fi
        # Give it a few seconds to write its pid file before declaring it dead.
        if ((SECONDS - t0 >= 5)) && ! pid_of "$name" >/dev/null; then
            fail "$name" "exited during start-up"
        fi
        sleep 0.2
    done
}

ensure_cluster_registered() {
    grep -qx "$CLUSTER" <<<"$CLUSTERS" && return 0
    say "registering cluster $CLUSTER with slurmdbd"
    timeout 20 sacctmgr -i add cluster "$CLUSTER" >>"$LOG/slurmdbd.out" 2>&1 ||
        fail slurmdbd "sacctmgr add cluster $CLUSTER failed"
}

main() {
    ((${#MUNGE_SOCK} < 100)) || { say "ERROR: $BASE is too long for socket paths; pick a shorter folder"; exit 1; }
    mkdir -p "$LOG"
    ((EUID == 0)) || { say "ERROR: run as root (daemons run as SlurmUser=root)"; exit 1; }
    # One up/down at a time. fd 9 is closed for the daemons, so they never hold the lock.
    exec 9>"$BASE/lock"
    flock -w 600 9 || { say "ERROR: another up.sh/down.sh holds $BASE/lock"; exit 1; }

    install_packages
    prepare_dirs
    write_configs

    ensure munged
    ensure mariadbd
    ensure slurmdbd
    ensure_cluster_registered
    ensure slurmctld
    stop_other_slurmds
    local node
    for node in "${NODES[@]}"; do ensure "slurmd-$node"; done

    # "idle" can show before slurmd has really registered: prove it with a job after any start.
    # Skipped when jobs are queued: they prove it, and the probe would wait behind them.
    local out
    if ((${#STARTED[@]})) && [[ -n $(timeout 10 squeue -h -o %A 2>/dev/null) ]]; then
        say "up (started: ${STARTED[*]}); jobs are queued, so no probe job"
    elif ((${#STARTED[@]})); then
        out=$(timeout 60 srun -N"$NODE_COUNT" -n"$NODE_COUNT" -J up-probe -t 1 true 2>&1) || {
            echo "$out" >&2
            tail -n 15 "$LOG/slurmctld.log" >&2
            fail "slurmd-${NODES[0]}" "probe job 'srun -N$NODE_COUNT -n$NODE_COUNT true' did not complete within 60 s"
        }
        say "up (started: ${STARTED[*]})"
    else
        say "already up"
    fi
    timeout 10 sacct -n -X -S now -E now -o JobID >/dev/null 2>&1 || fail slurmdbd "sacct does not answer"
    cat "$BASE/env.sh"
}

main "$@"
