#!/usr/bin/env bash
# Makes sure the brokers of the relay tests answer: RabbitMQ on
# 127.0.0.1:5672 and NATS with JetStream on 127.0.0.1:4222. A broker that
# does not answer is started from a local installation (Debian's packages)
# when there is one; otherwise this script says what to provide and fails.
set -euo pipefail

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_up() { # name port seconds
  for _ in $(seq 1 $(( $3 * 5 ))); do
    up "$2" && return 0
    sleep 0.2
  done
  echo "brokers-up: $1 did not answer on 127.0.0.1:$2 within $3 s" >&2
  return 1
}

if ! up 5672; then
  if command -v rabbitmq-server >/dev/null; then
    echo "brokers-up: starting RabbitMQ" >&2
    rabbitmq-server -detached
    wait_up RabbitMQ 5672 60
  else
    echo "brokers-up: RabbitMQ is not reachable on 127.0.0.1:5672 and not installed; install rabbitmq-server or start one there" >&2
    exit 1
  fi
fi

if ! up 4222; then
  if command -v nats-server >/dev/null; then
    echo "brokers-up: starting nats-server with JetStream" >&2
    store="${NATS_STORE_DIR:-/var/lib/nats-server}"
    mkdir -p "$store" 2>/dev/null || store="$(mktemp -d)"
    nohup nats-server -a 127.0.0.1 -p 4222 -js -sd "$store" >/dev/null 2>&1 &
    wait_up NATS 4222 20
  else
    echo "brokers-up: NATS is not reachable on 127.0.0.1:4222 and not installed; install nats-server or start one there (with -js)" >&2
    exit 1
  fi
fi
