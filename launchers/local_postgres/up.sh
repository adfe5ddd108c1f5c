#!/usr/bin/env bash
# A throwaway PostgreSQL server on this machine for study storage (hydra.sweeper.storage=postgresql://...):
# a cluster in its own folder, on 127.0.0.1 only, password login, one database `studies`. Idempotent: a server
# already up is reused. Prints the storage URL (its password is a test's, not a secret) and writes it to URL_FILE.
# Usage: up.sh   (TINKER_EXP_POSTGRES_HOME, default /tmp/tinker_exp_postgres; TINKER_EXP_POSTGRES_PORT, 55432)
#        down:    pg_ctl -D "$TINKER_EXP_POSTGRES_HOME/data" stop (as the user that owns it)
set -euo pipefail
BASE="${TINKER_EXP_POSTGRES_HOME:-/tmp/tinker_exp_postgres}" PORT="${TINKER_EXP_POSTGRES_PORT:-55432}"
ROLE=tinker_exp PASSWORD=tinker_exp_test DB=studies
URL="postgresql://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DB" URL_FILE="$BASE/url"
say() { echo "[local_postgres] $*" >&2; }

BIN=$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -1)
if [[ -z $BIN ]]; then
    say "installing Debian's postgresql"
    pg_install() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120 install -y -qq postgresql >/dev/null; }
    # Stale or empty package lists on a fresh machine: refresh them once and try again (as local_slurm does).
    pg_install || { apt-get -o DPkg::Lock::Timeout=120 update -qq >/dev/null && pg_install; }
    BIN=$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d | sort -V | tail -1)
fi
# PostgreSQL will not run as root: the cluster belongs to the postgres user then.
as_owner() { if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

mkdir -p "$BASE"
[[ $(id -u) == 0 ]] && chown postgres "$BASE"
if ! as_owner "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT"; then
    if [[ ! -f $BASE/data/PG_VERSION ]]; then
        printf '%s\n' "$PASSWORD" >"$BASE/pwfile"
        [[ $(id -u) == 0 ]] && chown postgres "$BASE/pwfile"
        as_owner "$BIN/initdb" -D "$BASE/data" -U "$ROLE" --auth=scram-sha-256 --pwfile="$BASE/pwfile" >/dev/null
        rm -f "$BASE/pwfile"
    fi
    as_owner "$BIN/pg_ctl" -D "$BASE/data" -l "$BASE/server.log" -w -t 60 \
        -o "-p $PORT -k $BASE -c listen_addresses=127.0.0.1" start >/dev/null
fi
if ! PGPASSWORD=$PASSWORD "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U "$ROLE" -d "$DB" -qAtc 'select 1' >/dev/null 2>&1; then
    PGPASSWORD=$PASSWORD "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U "$ROLE" "$DB"
fi
printf '%s\n' "$URL" >"$URL_FILE"
say "up on 127.0.0.1:$PORT (log $BASE/server.log)"
echo "$URL"
