#!/usr/bin/env bash
# The main job on a fresh machine: installs what is missing, starts a local etcd and Redis,
# three sluice-manager replicas on 127.0.0.1:8080/8081/8082, a demo task with demo traffic,
# and prints the dashboard URL. Ctrl-C (or SIGTERM) stops everything it started and removes the
# demo hosts' shared memory segments.
#
# Environment: SLUICE_DEV_TRAFFIC=0 skips the demo traffic; RUST_LOG sets the log level.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
DEV_HOSTS=(host-a host-b)
# Stops everything started here (by PID), then removes the demo hosts' shared memory segments
# (the SDK keeps them across process restarts on purpose; nothing uses them any more).
DEV_SLEEP=''
dev_cleanup() {
  [ -n "$DEV_SLEEP" ] && kill "$DEV_SLEEP" 2>/dev/null
  cleanup
  local h
  for h in "${DEV_HOSTS[@]}"; do
    rm -f "/dev/shm/sluice.sluice.$h" "/dev/shm/sluice.sluice.$h".*
  done
}
trap dev_cleanup EXIT
trap 'echo; log "stopping"; exit 0' INT TERM

ensure_base_packages
for port in 8080 8081 8082; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port is in use; stop what runs there (is another scripts/dev.sh running?)"
  fi
done

if [ -f dashboard/package.json ]; then
  ensure_packages node:nodejs npm:npm
  log "building the dashboard"
  (cd dashboard && npm ci --no-audit --no-fund --loglevel=error && npm run build)
fi
log "building sluice-manager, sluice-agent and the load generator (release)"
cargo build --release -p sluice-manager -p sluice-agent
if [ -f worker-sdk/examples/loadgen.rs ]; then
  cargo build --release -p sluice-sdk --example loadgen
fi

start_etcd
start_redis
dir="$(sluice_tmp)"
for i in 0 1 2; do
  RUST_LOG="${RUST_LOG:-info}" target/release/sluice-manager \
    --etcd "$ETCD_ENDPOINT" --redis "$REDIS_URL" --listen "127.0.0.1:808$i" \
    --node-id "replica-$i" >"$dir/manager-$i.log" 2>&1 &
  SLUICE_PIDS+=($!)
done
for i in 0 1 2; do wait_for "replica-$i" 30 curl -sf "http://127.0.0.1:808$i/healthz"; done
wait_for "a leader" 30 sh -c 'curl -sf http://127.0.0.1:8080/api/v1/cluster | grep -q "\"term\""'

log "creating the demo task 'checkout' (5,000 per second, business-hours boost)"
curl -sf -X PUT http://127.0.0.1:8080/api/v1/tasks/checkout -H 'content-type: application/json' -d '{
  "threshold": 5000, "slice_ms": 1000, "local_limit": 1500, "on_failure": "local",
  "schedules": [{"cron": "* * 9-17 * * Mon-Fri", "threshold": 8000}],
  "description": "demo: checkout API, cluster-wide"}' >/dev/null

if [ -x target/release/examples/loadgen ] && [ "${SLUICE_DEV_TRAFFIC:-1}" != 0 ]; then
  log "demo traffic: two simulated hosts, two processes each, ~7,000 requests/s offered"
  for h in "${DEV_HOSTS[@]}"; do
    # A loop that restarts the host's loadgen; on SIGTERM it stops the running one (which
    # stops its children and reports) and ends. `cmd & wait` lets the trap run at once.
    (trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; exit 0' TERM
     while true; do
      target/release/examples/loadgen --redis "$REDIS_URL" --namespace sluice --task checkout \
        --host-id "$h" --procs 2 --duration-ms 600000 --rate 1750 >/dev/null 2>>"$dir/loadgen-$h.log" &
      wait $! || sleep 1
    done) &
    SLUICE_PIDS+=($!)
  done
fi

# The host agent of a third simulated host, for every other language and Envoy.
mkdir -p "$dir/shm-agent"
RUST_LOG="${RUST_LOG:-info}" target/release/sluice-agent --redis "$REDIS_URL" --namespace sluice \
  --host-id dev-agent --segment-dir "$dir/shm-agent" \
  --grpc-listen 127.0.0.1:8091 --http-listen 127.0.0.1:8092 >"$dir/agent.log" 2>&1 &
SLUICE_PIDS+=($!)
wait_for "sluice-agent" 30 curl -sf http://127.0.0.1:8092/healthz

cat <<MSG

  Sluice is running.
    dashboard   http://127.0.0.1:8080/   (any replica: :8081, :8082)
    API         http://127.0.0.1:8080/api/v1/tasks
    metrics     http://127.0.0.1:8080/metrics
    agent       gRPC 127.0.0.1:8091 (Envoy RLS v3, RLQS), HTTP http://127.0.0.1:8092 — try:
                curl -s http://127.0.0.1:8092/v1/decide -d '{"task":"checkout"}'
    etcd        $ETCD_ENDPOINT
    redis       $REDIS_URL
    logs        $dir

  Try a failover: kill the leader shown on the Cluster page; a follower takes over.
  Ctrl-C stops everything.

MSG
# Bash runs a trap only between foreground commands: sleep in the background and `wait` for it
# (wait returns at once when a signal arrives), so SIGTERM/SIGINT stop everything right away.
while true; do
  sleep 3600 &
  DEV_SLEEP=$!
  wait "$DEV_SLEEP" || true
done
