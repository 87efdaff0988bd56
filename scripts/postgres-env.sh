#!/usr/bin/env bash
# Finds a PostgreSQL server for the demo and the tests, starting one if
# needed, and prints shell exports for it:
#
#   eval "$(scripts/postgres-env.sh)"
#
# It exports POSTGRES_DSN and, when it knows how to restart that server,
# PGOUTBOX_PG_RESTART_CMD (the reconnect test uses it). Order:
#   1. POSTGRES_DSN, if set;
#   2. a server accepting connections on 127.0.0.1:5432;
#   3. a locally installed server: a stopped Debian cluster (pg_ctlcluster),
#      else an ephemeral cluster from initdb in a temporary directory
#      (run as the postgres user when the caller is root);
#   4. Docker: docker compose up (docker-compose.yml, Postgres 17);
#   5. otherwise it fails and lists the ways to provide a server.
# PGOUTBOX_PG_WAYS limits the ways tried (default: "dsn local debian initdb
# docker"), to exercise one of them on a machine that has several.
# Progress goes to stderr; only the exports go to stdout.
set -euo pipefail

ways=" ${PGOUTBOX_PG_WAYS:-dsn local debian initdb docker} "
want() { [[ "$ways" == *" $1 "* ]]; }

say() { echo "postgres-env: $*" >&2; }
emit() {
  printf 'export POSTGRES_DSN=%q\n' "$1"
  if [ -n "${2:-}" ]; then printf 'export PGOUTBOX_PG_RESTART_CMD=%q\n' "$2"; fi
}

root=$(cd "$(dirname "$0")/.." && pwd)
local_dsn="postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

# port_open HOST PORT: a TCP connect, without needing psql.
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# wait_ready HOST PORT: until the server accepts queries, not just TCP.
wait_ready() {
  for _ in $(seq 1 60); do
    if command -v pg_isready >/dev/null 2>&1; then
      pg_isready -q -h "$1" -p "$2" && return 0
    elif port_open "$1" "$2"; then
      sleep 1; return 0
    fi
    sleep 0.5
  done
  return 1
}

# as_owner CMD...: run a server command as the postgres user when we are
# root (PostgreSQL refuses to run as root).
as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# debian_clusters: "VERSION NAME PORT STATUS", one line per cluster.
debian_clusters() {
  command -v pg_lsclusters >/dev/null 2>&1 || return 0
  pg_lsclusters --no-header 2>/dev/null | awk '{print $1, $2, $3, $4}' || true
}

# debian_serving PORT: the online cluster on PORT, if any. A machine may have
# several clusters; only the one serving the port can restart that server.
debian_serving() {
  debian_clusters | awk -v port="$1" '$3 == port && $4 ~ /^online/ && !n++'
}

# debian_cluster: the cluster to start: the one configured for 5432 (the
# port the tests default to), else the first.
debian_cluster() {
  debian_clusters | awk '
    NR == 1 { first = $0 }
    $3 == 5432 && found == "" { found = $0 }
    END { if (found != "") print found; else if (first != "") print first }'
}

debian_restart_cmd() {
  local c; c=$(debian_serving 5432)
  [ -n "$c" ] || return 0
  set -- $c
  echo "pg_ctlcluster --skip-systemctl-redirect $1 $2 restart"
}

# 1. Explicit DSN.
if want dsn && [ -n "${POSTGRES_DSN:-}" ]; then
  emit "$POSTGRES_DSN" "${PGOUTBOX_PG_RESTART_CMD:-}"
  exit 0
fi

# 2. A server already listening on the default port.
if want local && port_open 127.0.0.1 5432; then
  wait_ready 127.0.0.1 5432 || true
  emit "$local_dsn" "$(debian_restart_cmd)"
  exit 0
fi

# 3a. A stopped Debian cluster.
if want debian && c=$(debian_cluster) && [ -n "$c" ]; then
  set -- $c
  say "starting PostgreSQL cluster $1/$2 (port $3)"
  pg_ctlcluster --skip-systemctl-redirect "$1" "$2" start >&2 || true
  if wait_ready 127.0.0.1 "$3"; then
    emit "postgres://postgres@127.0.0.1:$3/postgres?sslmode=disable" \
      "pg_ctlcluster --skip-systemctl-redirect $1 $2 restart"
    exit 0
  fi
  say "cluster $1/$2 did not come up; trying the next way"
fi

# 3b. An ephemeral cluster from the installed binaries.
bindir=""
if ! want initdb; then
  :
elif command -v initdb >/dev/null 2>&1; then
  bindir=$(dirname "$(command -v initdb)")
else
  bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  [ -x "$bindir/initdb" ] || bindir=""
fi
if [ -n "$bindir" ]; then
  port=54329
  dir="${TMPDIR:-/tmp}/pgoutbox-postgres"
  if [ ! -f "$dir/PG_VERSION" ]; then
    say "creating an ephemeral cluster in $dir"
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    as_owner "$bindir/initdb" -D "$dir" -U postgres --auth=trust >/dev/null
  fi
  if ! port_open 127.0.0.1 "$port"; then
    say "starting the ephemeral cluster on port $port"
    as_owner "$bindir/pg_ctl" -D "$dir" -l "$dir/server.log" -w \
      -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=200" start >&2
  fi
  if wait_ready 127.0.0.1 "$port"; then
    restart="$bindir/pg_ctl -D $dir -w restart"
    [ "$(id -u)" = 0 ] && restart="runuser -u postgres -- $restart"
    emit "postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable" "$restart"
    exit 0
  fi
  say "the ephemeral cluster did not come up (see $dir/server.log); trying Docker"
fi

# 4. Docker.
if want docker && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  say "starting Postgres 17 with docker compose"
  docker compose -f "$root/docker-compose.yml" up -d --wait >&2
  emit "postgres://postgres:postgres@127.0.0.1:5432/postgres?sslmode=disable" \
    "docker compose -f $root/docker-compose.yml restart postgres"
  exit 0
fi

cat >&2 <<'MSG'
postgres-env: no PostgreSQL server found, and none could be started. Provide one of:
  1. POSTGRES_DSN=postgres://user:password@host:port/database?sslmode=disable
  2. a server on 127.0.0.1:5432 with trust auth for user postgres
     (Debian: apt-get install postgresql, then
      pg_ctlcluster --skip-systemctl-redirect <version> main start)
  3. Docker: docker compose up -d --wait (uses docker-compose.yml)
MSG
exit 1
