#!/usr/bin/env bash
# Creates (once) and starts a PostgreSQL server of its own for the soak
# benchmarks, with autovacuum on, and prints the export that points the
# benchmark at it:
#
#   eval "$(scripts/soak-cluster.sh)"   # then: make bench-soak
#
# The soak scenarios measure a queue table under vacuum, so they need
# autovacuum on, which CI machines and test servers often turn off. This
# server leaves every other setting at PostgreSQL's defaults. Running it
# again starts the server if it is stopped and prints the same export.
#
# With Debian's postgresql-common (pg_createcluster) it is a cluster named
# $SOAK_CLUSTER (soak) of the newest installed version; otherwise a data
# directory from initdb in ${TMPDIR:-/tmp}/pgoutbox-soak. Port: $SOAK_PORT
# (5440). Remove it with pg_dropcluster --stop VERSION soak, or by stopping
# it (pg_ctl -D DIR stop) and deleting the directory.
#
# Elsewhere, on a throwaway server of your own:
#   ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf();
# Progress goes to stderr; only the export goes to stdout.
set -euo pipefail

port=${SOAK_PORT:-5440}
name=${SOAK_CLUSTER:-soak}
dsn="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"

say() { echo "soak-cluster: $*" >&2; }
as_owner() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
wait_ready() {
  for _ in $(seq 1 60); do
    if command -v pg_isready >/dev/null 2>&1; then
      pg_isready -q -h 127.0.0.1 -p "$port" && return 0
    elif (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      sleep 1; return 0
    fi
    sleep 0.5
  done
  say "the server on port $port did not come up"
  return 1
}

if command -v pg_createcluster >/dev/null 2>&1; then
  existing=$(pg_lsclusters --no-header | awk -v n="$name" '$2 == n { print $1, $3, $4 }' | head -n 1)
  if [ -z "$existing" ]; then
    version=${SOAK_PG_VERSION:-$(ls /usr/lib/postgresql | sort -V | tail -n 1)}
    say "creating cluster $version/$name on port $port (autovacuum on)"
    pg_createcluster "$version" "$name" -p "$port" -- --auth=trust >&2
    conf=/etc/postgresql/$version/$name/conf.d
    mkdir -p "$conf"
    printf "# pgoutbox soak benchmarks: vacuum is what they measure\nautovacuum = on\nlisten_addresses = '127.0.0.1'\n" >"$conf/pgoutbox-soak.conf"
    existing="$version $port down"
  fi
  set -- $existing
  if [ "$2" != "$port" ]; then
    say "cluster $1/$name exists on port $2, not $port; using it"
    port=$2
    dsn="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"
  fi
  if [ "$3" != online ]; then
    say "starting cluster $1/$name"
    pg_ctlcluster --skip-systemctl-redirect "$1" "$name" start >&2
  fi
else
  bindir=$(dirname "$(command -v initdb 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1)")
  if [ ! -x "$bindir/initdb" ]; then
    say "neither pg_createcluster nor initdb found; install PostgreSQL, or use a throwaway server with ALTER SYSTEM SET autovacuum = on"
    exit 1
  fi
  dir="${TMPDIR:-/tmp}/pgoutbox-soak"
  if [ ! -f "$dir/PG_VERSION" ]; then
    say "creating a cluster in $dir"
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    as_owner "$bindir/initdb" -D "$dir" -U postgres --auth=trust >/dev/null
  fi
  if ! as_owner "$bindir/pg_ctl" -D "$dir" status >/dev/null 2>&1; then
    say "starting the cluster in $dir on port $port"
    as_owner "$bindir/pg_ctl" -D "$dir" -l "$dir/server.log" -w \
      -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c autovacuum=on" start >&2
  fi
fi

wait_ready
printf 'export POSTGRES_DSN=%q\n' "$dsn"
