#!/usr/bin/env bash
# Starts, on loopback, the servers the storage tests need (idempotent):
#   - one redis-server with requirepass (AUTH tests)          port $KVTIER_REDIS_PORT (6390)
#   - a 3-master Redis Cluster, no replicas                    ports $KVTIER_REDIS_CLUSTER_PORT.. +2 (7000-7002)
#   - on each of them the ACL users of the tenant isolation test: kvtier-tenant-a / kvtier-tenant-b
#     (password pw-<user>), limited to the key prefixes kvtier-iso:ta:* / kvtier-iso:tb:* and to
#     the commands the storage backend sends (docs/storage.md, "Tenants")
# and prints the environment the tests read, as `export` lines:
#   eval "$(scripts/start-test-services.sh)"
# `scripts/start-test-services.sh stop` shuts them down. State lives in $KVTIER_TEST_SERVICES_DIR
# (default /tmp/kvtier-test-services). Needs redis-server and redis-cli (Debian package redis-server).
set -euo pipefail

DIR=${KVTIER_TEST_SERVICES_DIR:-/tmp/kvtier-test-services}
PORT=${KVTIER_REDIS_PORT:-6390}
PASSWORD=${KVTIER_REDIS_PASSWORD:-kvtier-test-pw}
CPORT=${KVTIER_REDIS_CLUSTER_PORT:-7000}
CPORTS=("$CPORT" "$((CPORT + 1))" "$((CPORT + 2))")
HOST=127.0.0.1

log() { echo "start-test-services: $*" >&2; }

for tool in redis-server redis-cli; do
  command -v "$tool" >/dev/null || { log "$tool not found (apt-get install redis-server)"; exit 1; }
done

if [[ "${1:-}" == "stop" ]]; then
  redis-cli -h $HOST -p "$PORT" -a "$PASSWORD" --no-auth-warning shutdown nosave >/dev/null 2>&1 || true
  for p in "${CPORTS[@]}"; do redis-cli -h $HOST -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  log "stopped"
  exit 0
fi

mkdir -p "$DIR"

wait_ping() {  # port [password]
  local port=$1 pw=${2:-}
  for _ in $(seq 1 100); do
    if [[ -n "$pw" ]]; then
      [[ "$(redis-cli -h $HOST -p "$port" -a "$pw" --no-auth-warning ping 2>/dev/null)" == "PONG" ]] && return 0
    else
      [[ "$(redis-cli -h $HOST -p "$port" ping 2>/dev/null)" == "PONG" ]] && return 0
    fi
    sleep 0.1
  done
  log "redis on port $port did not answer"
  return 1
}

# ---- single server with AUTH ------------------------------------------------
if [[ "$(redis-cli -h $HOST -p "$PORT" -a "$PASSWORD" --no-auth-warning ping 2>/dev/null)" != "PONG" ]]; then
  mkdir -p "$DIR/single"
  redis-server --bind $HOST --port "$PORT" --requirepass "$PASSWORD" --daemonize yes \
    --dir "$DIR/single" --logfile "$DIR/single/redis.log" --pidfile "$DIR/single/redis.pid" \
    --save "" --appendonly no --protected-mode yes --maxmemory 2gb --maxmemory-policy allkeys-lru >/dev/null
  wait_ping "$PORT" "$PASSWORD"
  log "redis-server (requirepass) on $HOST:$PORT"
else
  log "redis-server already running on $HOST:$PORT"
fi

# ---- 3-master cluster ---------------------------------------------------------
for p in "${CPORTS[@]}"; do
  if [[ "$(redis-cli -h $HOST -p "$p" ping 2>/dev/null)" != "PONG" ]]; then
    mkdir -p "$DIR/cluster-$p"
    rm -f "$DIR/cluster-$p/nodes.conf"  # a restarted node must not remember a dead cluster
    redis-server --bind $HOST --port "$p" --cluster-enabled yes --cluster-config-file nodes.conf \
      --cluster-node-timeout 5000 --daemonize yes --dir "$DIR/cluster-$p" --logfile "$DIR/cluster-$p/redis.log" \
      --pidfile "$DIR/cluster-$p/redis.pid" --save "" --appendonly no --maxmemory 1gb \
      --maxmemory-policy allkeys-lru >/dev/null
    wait_ping "$p"
  fi
done
if ! redis-cli -h $HOST -p "$CPORT" cluster info 2>/dev/null | grep -q "cluster_state:ok"; then
  # Nodes from an earlier, half-created cluster are reset before the cluster is created.
  for p in "${CPORTS[@]}"; do
    redis-cli -h $HOST -p "$p" flushall >/dev/null 2>&1 || true
    redis-cli -h $HOST -p "$p" cluster reset hard >/dev/null 2>&1 || true
  done
  redis-cli --cluster create "$HOST:${CPORTS[0]}" "$HOST:${CPORTS[1]}" "$HOST:${CPORTS[2]}" \
    --cluster-replicas 0 --cluster-yes >"$DIR/cluster-create.log" 2>&1 || {
    cat "$DIR/cluster-create.log" >&2
    exit 1
  }
  for _ in $(seq 1 100); do
    ok=1
    for p in "${CPORTS[@]}"; do
      redis-cli -h $HOST -p "$p" cluster info 2>/dev/null | grep -q "cluster_state:ok" || ok=0
    done
    [[ $ok == 1 ]] && break
    sleep 0.1
  done
  [[ $ok == 1 ]] || { log "cluster did not reach cluster_state:ok"; exit 1; }
  log "redis cluster on $HOST:${CPORTS[0]}-${CPORTS[2]}"
else
  log "redis cluster already running on $HOST:${CPORTS[0]}-${CPORTS[2]}"
fi

# ---- tenant ACL users (ACLs are per node: set on every server) -----------------
# A tenant's user may run only what the Redis backend sends (GETRANGE SET DEL STRLEN; EVAL of its
# delete-if-unchanged script; PING at create in single mode; CLUSTER SLOTS and ASKING in a cluster) on keys under
# its tenant's prefix.
acl_users() {  # redis-cli args...
  local user tenant
  for pair in kvtier-tenant-a:ta kvtier-tenant-b:tb; do
    user=${pair%%:*} tenant=${pair##*:}
    "$@" ACL SETUSER "$user" reset on ">pw-$user" "~kvtier-iso:$tenant:*" resetchannels -@all \
      +getrange +set +del +strlen +eval +ping +asking '+cluster|slots' >/dev/null
  done
}
acl_users redis-cli -h $HOST -p "$PORT" -a "$PASSWORD" --no-auth-warning
for p in "${CPORTS[@]}"; do acl_users redis-cli -h $HOST -p "$p"; done

echo "export KVTIER_TEST_REDIS=$HOST:$PORT"
echo "export KVTIER_TEST_REDIS_PASSWORD=$PASSWORD"
echo "export KVTIER_TEST_REDIS_CLUSTER=$HOST:$CPORT"
