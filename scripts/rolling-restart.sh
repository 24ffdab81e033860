#!/usr/bin/env bash
# Measures a rolling restart of three sluice-manager replicas in the order docs/deploy.md
# gives for script hosts: the followers first (SIGTERM, start again, wait for /readyz 200),
# then the leader. For every round it reports how long after the leader's SIGTERM another
# replica's /healthz said "is_leader": true, the exit codes, the leader changes the replicas
# counted, and whether every slice of the next 30 s of a live task was in Redis after each step.
#
#   scripts/rolling-restart.sh [ROUNDS]        # default 3 rounds (a full restart each)
#
# Environment: SLUICE_MANAGER_BIN (default target/debug/sluice-manager, built if missing);
# SLUICE_RR_ETCD / SLUICE_RR_REDIS to use running servers (else it starts etcd and Redis on
# free loopback ports); SLUICE_RR_PORT first of three HTTP ports (else free ports).
# Everything it starts is stopped by PID at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT
trap 'exit 1' INT TERM

ROUNDS=${1:-3}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer, got '$ROUNDS'"
BIN=${SLUICE_MANAGER_BIN:-${CARGO_TARGET_DIR:-target}/debug/sluice-manager}
if [ ! -x "$BIN" ]; then
  log "building sluice-manager (debug)"
  cargo build -q -p sluice-manager
fi
[ -x "$BIN" ] || die "SLUICE_MANAGER_BIN: $BIN is not an executable"
command -v python3 >/dev/null || die "python3 is needed for the timing"
command -v redis-cli >/dev/null || die "redis-cli is needed (apt-get install redis-tools)"

if [ -n "${SLUICE_RR_ETCD:-}" ]; then ETCD_ENDPOINT=$SLUICE_RR_ETCD; else start_etcd; fi
if [ -n "${SLUICE_RR_REDIS:-}" ]; then REDIS_URL=$SLUICE_RR_REDIS; else start_redis; fi
hostport=${REDIS_URL#redis://}
REDIS_HOST=${hostport%%:*}
REDIS_PORT=${hostport##*:}
REDIS_PORT=${REDIS_PORT%%/*}
NS="rr$$"
TASK=rr
dir=$(sluice_tmp)

PORTS=()
for i in 0 1 2; do
  if [ -n "${SLUICE_RR_PORT:-}" ]; then PORTS+=($((SLUICE_RR_PORT + i))); else PORTS+=("$(free_port)"); fi
done
PIDS=(0 0 0)

start_replica() { # start_replica I
  local i=$1
  RUST_LOG=${RUST_LOG:-warn} "$BIN" --etcd "$ETCD_ENDPOINT" --redis "$REDIS_URL" \
    --listen "127.0.0.1:${PORTS[$i]}" --namespace "$NS" --node-id "n$i" \
    >>"$dir/manager-$i.log" 2>&1 &
  PIDS[i]=$!
  SLUICE_PIDS+=($!)
  wait_for "replica n$i /readyz" 30 curl -sf "http://127.0.0.1:${PORTS[$i]}/readyz"
}

# forget PID — drops an exited process from cleanup's list (its PID may be reused later).
forget() {
  local keep=() p
  for p in "${SLUICE_PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
  SLUICE_PIDS=("${keep[@]}")
}

# reap I — waits for replica I to exit (it was signalled); sets EXIT_CODE.
reap() {
  EXIT_CODE=0
  wait "${PIDS[$1]}" || EXIT_CODE=$?
  forget "${PIDS[$1]}"
}

leader_index() { # prints the index of the replica whose /healthz says is_leader, or nothing
  local i
  for i in 0 1 2; do
    if curl -sf "http://127.0.0.1:${PORTS[$i]}/healthz" 2>/dev/null | grep -q '"is_leader":true'; then
      echo "$i"; return 0
    fi
  done
}

wait_leader() {
  local deadline=$((SECONDS + 30)) l
  while [ $SECONDS -lt $deadline ]; do
    l=$(leader_index)
    [ -n "$l" ] && { echo "$l"; return 0; }
    sleep 0.1
  done
  echo none
}

# slices_ok — every slice of the next 30 s of the task is in Redis (prints the missing count).
slices_ok() {
  local now start gaps=0 s
  now=$(date +%s%3N)
  start=$((now - now % 1000))
  for s in $(seq 0 29); do
    [ "$(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" exists "$NS:{$TASK}:s:$((start + s * 1000))")" = 1 ] ||
      gaps=$((gaps + 1))
  done
  echo "$gaps"
}

leader_changes_sum() {
  local i sum=0 v
  for i in 0 1 2; do
    v=$(curl -sf "http://127.0.0.1:${PORTS[$i]}/metrics" | awk '$1 == "sluice_leader_changes_total" {print int($2)}')
    sum=$((sum + ${v:-0}))
  done
  echo "$sum"
}

log "3 replicas of namespace $NS on ports ${PORTS[*]} (etcd $ETCD_ENDPOINT, redis $REDIS_URL)"
for i in 0 1 2; do start_replica "$i"; done
leader=$(wait_leader)
curl -sf -X PUT "http://127.0.0.1:${PORTS[0]}/api/v1/tasks/$TASK" -H 'content-type: application/json' \
  -d '{"threshold":100,"slice_ms":1000}' >/dev/null || die "cannot create the task"
for _ in $(seq 100); do [ "$(slices_ok)" = 0 ] && break; sleep 0.1; done
[ "$(slices_ok)" = 0 ] || die "the task's slices of the next 30 s were not written within 10 s"

results=()
for round in $(seq "$ROUNDS"); do
  leader=$(wait_leader)
  [ "$leader" != none ] || die "no leader within 30 s"
  log "round $round: leader n$leader"
  for i in 0 1 2; do
    [ "$i" = "$leader" ] && continue
    kill -TERM "${PIDS[$i]}"
    reap "$i"
    code=$EXIT_CODE
    start_replica "$i"
    now_leader=$(wait_leader)
    log "  follower n$i: exit $code, restarted and ready; leader n$now_leader; slices missing in the next 30 s: $(slices_ok)"
    [ "$now_leader" = "$leader" ] || log "  (leadership moved during a follower's restart)"
  done
  others=()
  for i in 0 1 2; do [ "$i" = "$leader" ] || others+=("http://127.0.0.1:${PORTS[$i]}/healthz"); done
  # SIGTERM the leader and poll the two others' /healthz back to back (one keep-alive connection
  # each) until one says it leads; prints milliseconds from the signal to that answer.
  ms=$(python3 - "${PIDS[$leader]}" "${others[@]}" <<'PY'
import http.client, json, os, signal, sys, time, urllib.parse
pid = int(sys.argv[1])
conns = []
for u in sys.argv[2:]:
    p = urllib.parse.urlsplit(u)
    conns.append((http.client.HTTPConnection(p.hostname, p.port, timeout=2), p.path))
def leads(c, path):
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read()).get("is_leader") is True
    except Exception:
        c.close()
        return False
t0 = time.monotonic()
os.kill(pid, signal.SIGTERM)
deadline = t0 + 30
while time.monotonic() < deadline:
    for c, path in conns:
        if leads(c, path):
            print(f"{(time.monotonic() - t0) * 1000:.0f}")
            sys.exit(0)
print("none")
PY
)
  reap "$leader"
  code=$EXIT_CODE
  start_replica "$leader"
  new=$(wait_leader)
  gaps=$(slices_ok)
  changes=$(leader_changes_sum)
  log "  leader n$leader: SIGTERM -> n$new leads after $ms ms; old leader exit $code; restarted and ready"
  log "  after the round: slices missing in the next 30 s: $gaps; leader changes counted by the three (new) processes: $changes"
  results+=("round $round: new leader ${ms} ms after SIGTERM, exit $code, missing slices $gaps, leader changes $changes")
done
log "summary"
printf '  %s\n' "${results[@]}"
