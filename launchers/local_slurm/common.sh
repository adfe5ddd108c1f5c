# Shared by up.sh and down.sh (sourced): the folder layout and small process helpers.
# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this

BASE="${TINKER_EXP_SLURM_HOME:-/tmp/tinker_exp_slurm}"
ETC="$BASE/etc" RUN="$BASE/run" LOG="$BASE/log" STATE="$BASE/state" DB="$BASE/db"
CONF="$ETC/slurm.conf"
# Marks processes up.sh starts, so orphans (lost pid file) and slurmstepd can be found later.
TAG="TINKER_EXP_SLURM_DAEMON=$BASE"
PATH="$PATH:/usr/sbin:/sbin"

say() { echo "[local_slurm] $*" >&2; }

# wait_until SECONDS CMD...: poll CMD until it succeeds; fail (return 1) after SECONDS.
wait_until() {
    local end=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < end)) || return 1
        sleep 0.2
    done
}

# Running and not a zombie.
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

# Live pid of daemon NAME from its pid file (checks the pid really is NAME, not a recycled pid;
# slurmd-NODE is a slurmd).
pid_of() {
    local pid
    pid=$(cat "$RUN/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "${1%%-*}" ]] || return 1
    alive "$pid" || return 1
    echo "$pid"
}
