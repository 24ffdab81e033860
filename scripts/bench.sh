#!/usr/bin/env bash
# Sluice side by side with the limiters users would pick instead (issue 14), in ONE run on ONE
# Redis, same process counts, same demand (scripts/bench/run.py says what is measured):
#   Sluice in-process (loadgen: pooled, keyed), Sluice through the agent (gRPC RLS, HTTP),
#   a per-request Redis fixed window (INCR + EXPIRE Lua) and sliding log (ZSET Lua) — the
#   seed article's limiters (tests/src/bin/peer_redis.rs) —, rate-limiter-flexible (npm,
#   RateLimiterRedis) and limits (PyPI, moving window).
#
# Sections (scripts/bench/run.py): peers (the side by side above), anchors (several hosts,
# shifting demand), keys (issue 26's grid: per-key limits against the per-request fixed window
# of peer_redis on the same keys — keys 1 … 1,000,000 × demand 0.1/1/3× the limit × 1/2 hosts
# × 1 s/60 s slices), scale (curves: hosts, keys, tasks), criterion.
#
#   scripts/bench.sh           full: every section; 10 s per run (keys grid: 5 s per run,
#                              ~11 min for its 48 runs × 2 designs); release builds;
#                              regenerates the generated parts of docs/benchmarks.md and
#                              docs/img/bench-*.svg
#   scripts/bench.sh --quick   smoke test (≤ 3 min once built; run by scripts/test.sh): peers
#                              at 3 s per run and a corner of the keys grid (100 and 10,000
#                              keys, demand 1×, 1 host, 1 s slices, 2 s per run), the binaries
#                              test.sh built (debug unless SLUICE_BENCH_PROFILE=release), report
#                              rendered to target/bench/ only — it checks the output parses,
#                              never the speed.
#   SLUICE_BENCH_SECTIONS=keys scripts/bench.sh
#                              the keys grid alone (full, release): regenerates its section of
#                              docs/benchmarks.md and docs/img/bench-keys-*.svg, nothing else.
# Environment: SLUICE_BENCH_SECONDS (per run), SLUICE_BENCH_LIMIT (default 2000 per second),
# SLUICE_BENCH_PEERS (comma list to run a subset), SLUICE_BENCH_PROFILE (debug|release),
# SLUICE_BENCH_SKIP_CRITERION=1 (full mode without the criterion benchmarks),
# SLUICE_BENCH_SECTIONS (comma list of the sections above; default all in full mode, peers,keys
# in quick mode), SLUICE_BENCH_KEYS_RATE (keys grid: decisions/s per host, default 5000),
# SLUICE_BENCH_KEYS_SECONDS (keys grid: per run; default 5, quick 2), SLUICE_BENCH_KEYS_WORKERS
# (keys grid: Sluice decision loops per process, default 16), SLUICE_BENCH_KEYS_REPORTED (keys
# grid: keys whose counts per slice are reported and judged, default 1000),
# SLUICE_BENCH_KEY_SLOTS_CAP (the SDK's MAX_KEY_SLOTS; default read from
# worker-sdk/src/keytable.rs), SLUICE_BENCH_KEYS_CALLER_PULLS=1 (keys grid: Sluice's keyed
# pulls from the decision loops' runtime, `Config::caller_pulls`; default off, as in the SDK),
# SLUICE_BENCH_KEYS_PEER_GRAIN_MS=G (keys grid: the per-request peer's due times rounded up to a
# G ms timer grain, the shape of loadgen's Tokio pacing; default 0, precise pacing),
# SLUICE_BENCH_KEYS_GRID='keys=100 demand=1,3 hosts=1,2 slice=1' (keys grid: a subset of it; the
# docs are then left alone).
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
  KEYS_SECS=${SLUICE_BENCH_KEYS_SECONDS:-2}
  PROFILE=${SLUICE_BENCH_PROFILE:-debug}
else
  SECS=${SLUICE_BENCH_SECONDS:-10}
  KEYS_SECS=${SLUICE_BENCH_KEYS_SECONDS:-5}
  PROFILE=${SLUICE_BENCH_PROFILE:-release}
fi
SECTIONS=${SLUICE_BENCH_SECTIONS:-}
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
  --sections "$SECTIONS" --keys-rate "${SLUICE_BENCH_KEYS_RATE:-5000}" \
  --keys-seconds "$KEYS_SECS" --keys-workers "${SLUICE_BENCH_KEYS_WORKERS:-16}" \
  --keys-reported "${SLUICE_BENCH_KEYS_REPORTED:-1000}" --key-slots-cap "${SLUICE_BENCH_KEY_SLOTS_CAP:-0}" \
  --keys-caller-pulls "${SLUICE_BENCH_KEYS_CALLER_PULLS:-0}" \
  --keys-peer-grain-ms "${SLUICE_BENCH_KEYS_PEER_GRAIN_MS:-0}" \
  --keys-grid "${SLUICE_BENCH_KEYS_GRID:-}" \
  --out "$OUT" --tmp "$dir" "${AGENTS[@]}"

# The docs take a full release run of every section, or of the keys grid alone (report.py then
# replaces its section only); anything else is rendered to target/bench/.
if [ "$MODE" = full ] && [ "$PROFILE" = release ] && [ -z "${SLUICE_BENCH_PEERS:-}" ] &&
  [ -z "${SLUICE_BENCH_KEYS_GRID:-}" ] &&
  { { [ -z "$SECTIONS" ] && [ -z "${SLUICE_BENCH_SKIP_CRITERION:-}" ]; } || [ "$SECTIONS" = keys ]; }; then
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
