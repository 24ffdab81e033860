#!/usr/bin/env bash
# Benchmark of the worker SDK, whole system: a release manager, Redis, and the loadgen example
# (real processes sharing host segments). Measures, in one run on the same Redis:
#   * redis-benchmark INCR (the baseline: what one Redis does with one call per decision),
#   * decisions/s of 1 host × 1 process, 1 host × 4 processes, 2 hosts × 2 processes
#     (as fast as possible, threshold far above, so the decisions are admissions),
#   * the pull policy at the acceptance workload (threshold 2,000/s, 2 hosts × 4 processes,
#     demand 8×) and at steady demand below the threshold, automatic vs the seed's fixed
#     "host share / 50" — Redis calls per admitted decision, per-slice admitted, rejections,
#   * then the criterion micro-benchmarks (`cargo bench -p sluice-sdk --bench decide`), unless
#     SLUICE_BENCH_SKIP_CRITERION=1.
#
#   scripts/bench-sdk.sh [SECONDS]  (default 5 s per throughput run)
# Everything started here is stopped by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT
trap 'exit 130' INT TERM

SECS=${1:-5}
ensure_base_packages
log "building sluice-manager and the loadgen example (release)"
cargo build --release -q -p sluice-manager --bin sluice-manager
cargo build --release -q -p sluice-sdk --example loadgen
start_etcd
start_redis
dir="$(sluice_tmp)"
port=$(free_port)
target/release/sluice-manager --etcd "$ETCD_ENDPOINT" --redis "$REDIS_URL" \
  --listen "127.0.0.1:$port" --node-id bench --namespace sluicebench >"$dir/manager.log" 2>&1 &
SLUICE_PIDS+=($!)
wait_for "manager" 30 curl -sf "http://127.0.0.1:$port/healthz"
RPORT=${REDIS_URL##*:}

log "redis-benchmark INCR (baseline)"
INCR=$(redis-benchmark -p "$RPORT" -t incr -n 300000 -q 2>/dev/null | tr '\r' '\n' |
  sed -n 's/^INCR: \([0-9.]*\) requests per second.*/\1/p' | tail -1)
[ -n "$INCR" ] || die "could not parse redis-benchmark output"

python3 - "$port" "$REDIS_URL" "$SECS" "$INCR" "$dir" <<'PY'
import json, subprocess, sys, time, urllib.request

port, redis, secs, incr, tmp = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
base = f"http://127.0.0.1:{port}"
ns = "sluicebench"
loadgen = "target/release/examples/loadgen"
run_id = str(int(time.time()))

def put(name, spec):
    req = urllib.request.Request(f"{base}/api/v1/tasks/{name}", data=json.dumps(spec).encode(),
                                 method="PUT", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status in (200, 201), r.status
    time.sleep(1.2)  # the leader writes the slices within a tick

def run(task, hosts, procs, ms, rate=0):
    ps = []
    for h in range(hosts):
        host = f"bench{run_id}-{task}-{hosts}x{procs}-{h}"
        args = [loadgen, "--redis", redis, "--namespace", ns, "--task", task, "--host-id", host,
                "--procs", str(procs), "--duration-ms", str(ms), "--rate", str(rate)]
        ps.append((host, subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(f"{tmp}/{host}.log", "w"))))
    out = []
    for host, p in ps:
        line = p.communicate(timeout=ms / 1000 + 120)[0].decode().strip()
        assert p.returncode == 0, f"loadgen failed, see {tmp}/{host}.log"
        out.append(json.loads(line))
        for suffix in ("", ".lock"):
            try:
                import os; os.remove(f"/dev/shm/sluice.{ns}.{host}{suffix}")
            except FileNotFoundError:
                pass
    return out

def summary(reps):
    adm = sum(r["admitted"] for r in reps)
    rej = sum(r["rejected"] for r in reps)
    calls = sum(r["redis_calls"] for r in reps)
    dps = sum(r["decisions_per_sec"] for r in reps)
    buckets = {}
    for r in reps:
        for k, (a, _) in r["buckets"].items():
            buckets[int(k)] = buckets.get(int(k), 0) + a
    full = [buckets[k] for k in sorted(buckets)[1:-1]]
    return adm, rej, calls, dps, full

rows = []
put("sys", {"threshold": 1_000_000_000, "slice_ms": 1000, "local_limit": 1000, "on_failure": "local"})
for hosts, procs in ((1, 1), (1, 4), (2, 2)):
    print(f"throughput: {hosts} host(s) x {procs} process(es), {secs} s, as fast as possible ...", file=sys.stderr)
    adm, rej, calls, dps, _ = summary(run("sys", hosts, procs, secs * 1000))
    rows.append((f"{hosts} host × {procs} proc, unpaced", f"{dps:,.0f}", f"{adm / max(dps * secs, 1) * 100:.1f} %",
                 f"{calls / max(adm, 1):.6f}"))

policy = []
put("acc", {"threshold": 2000, "slice_ms": 1000, "local_limit": 300, "on_failure": "local"})
put("seed", {"threshold": 2000, "slice_ms": 1000, "pull": 20, "local_limit": 300, "on_failure": "local"})
for task, label in (("acc", "automatic"), ("seed", "fixed pull 20 (seed: host share / 50)")):
    for procs, rate, what in ((4, 2000, "demand 8× threshold (2 hosts × 4 × 2,000/s)"),
                              (2, 450, "steady 90 % of threshold (2 hosts × 2 × 450/s)")):
        print(f"policy: {label}, {what} ...", file=sys.stderr)
        adm, rej, calls, dps, full = summary(run(task, 2, procs, 10_000, rate))
        policy.append((label, what, f"{min(full)}–{max(full)}", f"{rej:,}", f"{calls / max(adm, 1):.4f}"))

print()
print(f"redis-benchmark INCR (same Redis, same run): {incr:,.0f} requests/s")
print()
print("| workload | decisions/s | admitted | Redis calls / admitted |")
print("|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
print()
print("| pull policy | workload | admitted per full slice (both hosts) | rejected | Redis calls / admitted |")
print("|---|---|---|---|---|")
for p in policy:
    print("| " + " | ".join(p) + " |")
PY

if [ -z "${SLUICE_BENCH_SKIP_CRITERION:-}" ]; then
  log "criterion: decision path"
  cargo bench -q -p sluice-sdk --bench decide -- --noplot 2>/dev/null |
    grep -E '^(decide|host)/|time:|thrpt:' || true
fi
