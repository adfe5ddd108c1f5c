#!/usr/bin/env bash
# Stop the local Slurm cluster started by up.sh: cancel all jobs, then stop the daemons by pid.
# Usage: down.sh [--purge]    --purge also deletes the folder (config, state, accounting DB, logs).
# Idempotent: fine when nothing runs or the folder does not exist.
set -euo pipefail

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PURGE=0
for arg in "$@"; do
    case $arg in
        --purge) PURGE=1 ;;
        -h | --help) sed -n '2,4s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) say "unknown argument: $arg (usage: down.sh [--purge])"; exit 2 ;;
    esac
done

# SIGTERM the pids, SIGKILL whatever is left after 20 s.
stop_pids() {
    local p end=$((SECONDS + 20))
    (($#)) || return 0
    kill -TERM "$@" 2>/dev/null || true
    for p in "$@"; do
        while alive "$p"; do
            if ((SECONDS >= end)); then kill -KILL "$p" 2>/dev/null || true; break; fi
            sleep 0.2
        done
    done
}

no_jobs() {
    local out
    out=$(timeout 5 squeue -h -o %A 2>/dev/null) || return 1
    [[ -z $out ]]
}

# Pids of what belongs to this cluster, never our own ancestors. With "jobs": job processes
# (environment names our slurm.conf and a job id). With "all": also processes up.sh started
# (tagged: daemons that lost their pid file, slurmstepd).
scan_procs() {
    local p pid env ancestors=" " a=$$
    while [[ $a =~ ^[0-9]+$ ]] && ((a > 1)); do
        ancestors+="$a "
        a=$(awk '/^PPid:/{print $2}' "/proc/$a/status" 2>/dev/null) || break
    done
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [[ $ancestors == *" $pid "* ]] && continue
        env=$( { tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
        if grep -qxF "$TAG" <<<"$env"; then
            [[ $1 == all ]] && echo "$pid"
        elif grep -qxF "SLURM_CONF=$CONF" <<<"$env" && grep -q '^SLURM_JOB_ID=' <<<"$env"; then
            echo "$pid"
        fi
    done
}

# Job processes survive a slurmd stop, so end the jobs while slurmctld/slurmd still run.
cancel_jobs() {
    [[ -f $CONF ]] && pid_of slurmctld >/dev/null || return 0
    export SLURM_CONF="$CONF"
    local jobs procs
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u) || return 0
    [[ -n $jobs ]] || return 0
    # shellcheck disable=SC2086  # one id per word
    say "cancelling jobs:" $jobs
    # shellcheck disable=SC2086
    timeout 10 scancel --full $jobs 2>/dev/null || true
    wait_until 10 no_jobs && return 0
    # A job that ignores SIGTERM would linger for KillWait (30 s): kill its processes directly.
    mapfile -t procs < <(scan_procs jobs)
    say "jobs still running after 10 s; killing their processes: ${procs[*]:-none found}"
    if ((${#procs[@]})); then kill -KILL "${procs[@]}" 2>/dev/null || true; fi
    wait_until 10 no_jobs || say "warning: jobs still listed; stopping the daemons anyway"
}

purge() {
    local entry
    [[ -d $BASE ]] || return 0
    # Only delete a folder that holds nothing but what up.sh makes.
    for entry in "$BASE"/* "$BASE"/.[!.]*; do
        [[ -e $entry ]] || continue
        case ${entry##*/} in
            etc | run | log | state | db | lock | env.sh) ;;
            *) say "ERROR: not purging $BASE: unexpected entry $entry"; exit 1 ;;
        esac
    done
    rm -rf "$BASE"
    say "purged $BASE"
}

main() {
    if [[ ! -d $BASE ]]; then
        say "nothing at $BASE"
        return 0
    fi
    exec 9>"$BASE/lock"
    flock -w 120 9 || { say "ERROR: another up.sh/down.sh holds $BASE/lock"; exit 1; }

    cancel_jobs
    local name pid stopped=()
    local slurmds=("$RUN"/slurmd-*.pid)
    slurmds=("${slurmds[@]##*/}")
    for name in "${slurmds[@]%.pid}" slurmctld slurmdbd mariadbd munged; do
        [[ $name == "slurmd-*" ]] && continue  # no slurmd pid file
        if pid=$(pid_of "$name"); then
            stop_pids "$pid"
            stopped+=("$name")
        fi
        rm -f "$RUN/$name.pid"
    done
    local rest
    mapfile -t rest < <(scan_procs all)
    if ((${#rest[@]})); then
        say "stopping leftover processes: ${rest[*]}"
        stop_pids "${rest[@]}"
    fi
    rm -f "$RUN"/*.sock "$RUN"/*.sock.lock 2>/dev/null || true
    if ((${#stopped[@]})); then say "stopped: ${stopped[*]}"; else say "nothing was running"; fi
    if ((PURGE)); then purge; fi
}

main
