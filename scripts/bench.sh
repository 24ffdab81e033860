#!/usr/bin/env bash
# Sluice side by side with the limiters users would pick instead (issue 14), in ONE run on ONE
# Redis, same process counts, same demand (scripts/bench/run.py says what is measured):
#   Sluice in-process (loadgen: pooled, keyed), Sluice through the agent (gRPC RLS, HTTP),
#   a per-request Redis fixed window (INCR + EXPIRE Lua) and sliding log (ZSET Lua) — the
#   seed article's limiters (tests/src/bin/peer_redis.rs) —, rate-limiter-flexible (npm,
#   RateLimiterRedis) and limits (PyPI, moving window).
#
#   scripts/bench.sh           full: 10 s per run, the anchors' workload, scale curves
#                              (tasks, hosts, keys), criterion; release builds; regenerates
#                              the generated part of docs/benchmarks.md and docs/img/bench-*.svg
#   scripts/bench.sh --quick   smoke test (≤ 3 min once built; run by scripts/test.sh): 3 s per
#                              run, the binaries test.sh built (debug unless
#                              SLUICE_BENCH_PROFILE=release), report rendered to target/bench/
#                              only — it checks the output parses, never the speed.
# Environment: SLUICE_BENCH_SECONDS (per run), SLUICE_BENCH_LIMIT (default 2000 per second),
# SLUICE_BENCH_PEERS (comma list to run a subset), SLUICE_BENCH_PROFILE (debug|release),
# SLUICE_BENCH_SKIP_CRITERION=1 (full mode without the criterion benchmarks).
# Output: target/bench/result-<unix>.json (+ latest.json). Everything started here is stopped
# by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
SEG_DIR=""
NS=sluicepeers
bench_cleanup() {
  cleanup
  if [ -n "$SEG_DIR" ]; then rm -rf "$SEG_DIR"; fi
  rm -f /dev/shm/sluice."$NS".* 2>/dev/null || true
}
trap bench_cleanup EXIT
trap 'exit 130' INT TERM

MODE=full
case "${1:-}" in
  --quick) MODE=quick ;;
  "" | --full) ;;
  *) die "usage: scripts/bench.sh [--quick | --full] (got ${1@Q})" ;;
esac
if [ "$MODE" = quick ]; then
  SECS=${SLUICE_BENCH_SECONDS:-3}
  PROFILE=${SLUICE_BENCH_PROFILE:-debug}
else
  SECS=${SLUICE_BENCH_SECONDS:-10}
  PROFILE=${SLUICE_BENCH_PROFILE:-release}
fi
LIMIT=${SLUICE_BENCH_LIMIT:-2000}
case "$PROFILE" in
  debug) BIN="${CARGO_TARGET_DIR:-target}/debug"; CARGO_PROFILE=() ;;
  release) BIN="${CARGO_TARGET_DIR:-target}/release"; CARGO_PROFILE=(--release) ;;
  *) die "SLUICE_BENCH_PROFILE must be debug or release (got ${PROFILE@Q})" ;;
esac
STARTED=$(date +%s)

ensure_base_packages
log "installing the Node.js and Python peers (from their lockfiles)"
scripts/bench/peers/install.sh >/dev/null
log "building sluice-manager, sluice-agent, loadgen, peer_redis, rls_load ($PROFILE)"
if [ "$PROFILE" = debug ]; then
  # What scripts/test.sh builds, with the same feature set (a subset of packages would unify
  # features differently and rebuild half the dependencies): a no-op after it.
  cargo build -q --workspace --bins --examples
else
  cargo build "${CARGO_PROFILE[@]}" -q -p sluice-manager --bin sluice-manager \
    -p sluice-agent --bin sluice-agent -p sluice-tests --bin peer_redis --bin rls_load
  cargo build "${CARGO_PROFILE[@]}" -q -p sluice-sdk --example loadgen
fi
start_etcd
start_redis
REDIS_PID=${SLUICE_PIDS[-1]}
RPORT=${REDIS_URL##*:}
dir="$(sluice_tmp)"
SEG_DIR=$(mktemp -d /dev/shm/sluice-bench.XXXXXX)

mport=$(free_port)
"$BIN/sluice-manager" --etcd "$ETCD_ENDPOINT" --redis "$REDIS_URL" --listen "127.0.0.1:$mport" \
  --node-id bench --namespace "$NS" >"$dir/manager.log" 2>&1 &
SLUICE_PIDS+=($!)
MANAGER_PID=$!
wait_for "manager" 60 curl -sf "http://127.0.0.1:$mport/healthz"
wait_for "leadership" 60 sh -c "curl -sf http://127.0.0.1:$mport/metrics | grep -q '^sluice_leader 1'"

AGENTS=()
for i in 0 1; do
  g=$(free_port); h=$(free_port)
  "$BIN/sluice-agent" --redis "$REDIS_URL" --namespace "$NS" --host-id "bench-agent-$i" \
    --segment-dir "$SEG_DIR" --grpc-listen "127.0.0.1:$g" --http-listen "127.0.0.1:$h" \
    >"$dir/agent-$i.log" 2>&1 &
  SLUICE_PIDS+=($!)
  AGENTS+=(--agent "$!,grpc://127.0.0.1:$g,http://127.0.0.1:$h,bench-agent-$i")
  wait_for "agent $i" 60 curl -sf "http://127.0.0.1:$h/readyz"
done

mkdir -p target/bench
OUT="target/bench/result-$(date +%s).json"
CMD="scripts/bench.sh${1:+ $1}"
python3 scripts/bench/run.py --mode "$MODE" --profile "$PROFILE" --command "$CMD" \
  --redis "$REDIS_URL" --redis-port "$RPORT" --redis-pid "$REDIS_PID" --namespace "$NS" \
  --manager-url "http://127.0.0.1:$mport" --manager-pid "$MANAGER_PID" \
  --loadgen "$BIN/examples/loadgen" --peer-redis "$BIN/peer_redis" --rls-load "$BIN/rls_load" \
  --node-peer "node scripts/bench/peers/node/peer.js" \
  --py-peer "scripts/bench/peers/python/.venv/bin/python scripts/bench/peers/python/peer.py" \
  --limit "$LIMIT" --hosts 2 --procs 2 --seconds "$SECS" --peers "${SLUICE_BENCH_PEERS:-}" \
  --out "$OUT" --tmp "$dir" "${AGENTS[@]}"

if [ "$MODE" = full ] && [ "$PROFILE" = release ] && [ -z "${SLUICE_BENCH_PEERS:-}" ] &&
  [ -z "${SLUICE_BENCH_SKIP_CRITERION:-}" ]; then
  python3 scripts/bench/report.py "$OUT" --doc docs/benchmarks.md --svg-dir docs/img
  log "docs/benchmarks.md and docs/img/bench-*.svg regenerated from $OUT"
else
  check=(--check)
  if [ -n "${SLUICE_BENCH_PEERS:-}" ]; then check=(); fi
  python3 scripts/bench/report.py "$OUT" --doc target/bench/report.md --svg-dir target/bench \
    "${check[@]}"
  log "report rendered to target/bench/report.md (docs untouched: not a full release run)"
fi
log "done in $(($(date +%s) - STARTED)) s: $OUT"
