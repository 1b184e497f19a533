#!/usr/bin/env bash
# Starts the secured Kafka broker of docker-compose.yml (apache/kafka image): renders
# server.properties from this host's listeners and deploy/kafka/secure.properties (the
# same security the tests run), writes the SCRAM users at the first start, runs the
# broker. Passwords come from the secrets in /run/secrets.
#
# Two client listeners: CLIENT (kafka:9092) for containers of the compose network, and
# EXTERNAL (container port 9094, published by docker-compose.yml) for model servers
# elsewhere, advertised as KAFKA_EXTERNAL_ADVERTISED (host:port they reach this broker
# by; default localhost:9094). Both speak SASL/SCRAM over plaintext: on a network you do
# not trust, put TLS in front (SASL_SSL is not configured here).
#
#   start.sh            render, format storage (once), run the broker
#   start.sh --render   print server.properties and stop (used by tests/test_compose.py)
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
SECRETS="${SECRETS_DIR:-/run/secrets}"
DATA="${KAFKA_DATA_DIR:-/var/lib/kafka/data}"
HOST="${KAFKA_HOST:-kafka}"
KAFKA_HOME="${KAFKA_HOME:-/opt/kafka}"
CLUSTER_ID="${KAFKA_CLUSTER_ID:-attention-monitor-cluster1}"   # 22 base64 characters
PROPS="${KAFKA_PROPERTIES:-/tmp/server.properties}"
ADMIN_PROPS="${KAFKA_ADMIN_PROPERTIES:-/tmp/admin.properties}"
CLIENT_PORT="${KAFKA_CLIENT_PORT:-9092}"
CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-9093}"
EXTERNAL_PORT="${KAFKA_EXTERNAL_PORT:-9094}"
EXTERNAL_ADVERTISED="${KAFKA_EXTERNAL_ADVERTISED:-localhost:${EXTERNAL_PORT}}"

secret() { tr -d '\n' < "$SECRETS/$1"; }

render() {
  local admin controller
  admin="$(secret kafka_admin_password)"
  controller="$(secret kafka_controller_password)"
  cat <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@${HOST}:${CONTROLLER_PORT}
listeners=CLIENT://:${CLIENT_PORT},EXTERNAL://:${EXTERNAL_PORT},CONTROLLER://:${CONTROLLER_PORT}
advertised.listeners=CLIENT://${HOST}:${CLIENT_PORT},EXTERNAL://${EXTERNAL_ADVERTISED}
controller.listener.names=CONTROLLER
inter.broker.listener.name=CLIENT
log.dirs=${DATA}
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
auto.create.topics.enable=false
PROPS
  sed -e "s/{admin_password}/${admin}/g" -e "s/{controller_password}/${controller}/g" \
    -e '/^#/d' "$HERE/secure.properties"
}

if [[ "${1:-}" == "--render" ]]; then
  render
  exit 0
fi

render > "$PROPS"
cat > "$ADMIN_PROPS" <<ADMIN
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(secret kafka_admin_password)";
ADMIN
if [[ ! -f "$DATA/meta.properties" ]]; then
  users=()
  for user in admin monitor model-server operator; do
    users+=(--add-scram "SCRAM-SHA-512=[name=${user},password=$(secret "kafka_${user//-/_}_password")]")
  done
  "$KAFKA_HOME/bin/kafka-storage.sh" format -t "$CLUSTER_ID" -c "$PROPS" "${users[@]}"
fi
exec "$KAFKA_HOME/bin/kafka-server-start.sh" "$PROPS"
