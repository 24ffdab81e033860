#!/usr/bin/env bash
# Benchmark: the cost of TLS on the Redis link, plain and TLS measured side by side in one run.
#   * pull latency: examples/pull_bench (one PULL script at a time on one connection, and fresh
#     connections) against a plain redis-server and a TLS one (mutual TLS), alternating;
#   * manager CPU: two leaders at the same time, each rolling TASKS tasks of 1 s slices (one on
#     the plain Redis, one on the TLS Redis), CPU of each manager and each Redis over SECS.
# Both Redis servers run the same binary with the same settings except TLS; the default user
# (no ACL), so only TLS differs.
#
#   scripts/bench-tls.sh [TASKS] [SECS] [PULLS]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT
trap 'exit 130' INT TERM

TASKS=${1:-2000}
SECS=${2:-20}
PULLS=${3:-20000}
ensure_base_packages
log "building sluice-manager and the examples (release)"
cargo build --release -q -p sluice-manager -p sluice-sdk --bins --examples
dir="$(sluice_tmp)"
pki="$dir/pki"; mkdir -p "$pki"
(
  cd "$pki"
  ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
  openssl req -x509 "${ec[@]}" -keyout ca.key -out ca.crt -days 2 -subj /CN=bench-ca \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >server.ext
  printf 'extendedKeyUsage=clientAuth\n' >client.ext
  for n in server client; do
    openssl req "${ec[@]}" -keyout $n.key -out $n.csr -subj /CN=bench-$n 2>/dev/null
    openssl x509 -req -in $n.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out $n.crt -days 2 \
      -extfile $n.ext 2>/dev/null
  done
)
start_etcd
start_redis
PLAIN_URL=$REDIS_URL
PLAIN_PID=${SLUICE_PIDS[-1]}
tport=$(free_port)
mkdir -p "$dir/redis-tls"
redis-server --port 0 --tls-port "$tport" --tls-cert-file "$pki/server.crt" \
  --tls-key-file "$pki/server.key" --tls-ca-cert-file "$pki/ca.crt" --tls-auth-clients yes \
  --bind 127.0.0.1 --save "" --appendonly no --dir "$dir/redis-tls" >"$dir/redis-tls/redis.log" 2>&1 &
TLS_PID=$!
SLUICE_PIDS+=($TLS_PID)
TLS_URL="rediss://127.0.0.1:$tport"
TLS_FLAGS=(--redis-ca "$pki/ca.crt" --redis-cert "$pki/client.crt" --redis-key "$pki/client.key")
wait_for "redis (TLS)" 30 redis-cli --tls --cacert "$pki/ca.crt" --cert "$pki/client.crt" \
  --key "$pki/client.key" -p "$tport" ping
log "redis (TLS) on $TLS_URL (pid $TLS_PID)"

log "pull latency: $PULLS pulls and 200 fresh connections per run, plain and TLS alternating"
for round in 1 2; do
  target/release/examples/pull_bench --redis "$PLAIN_URL" --pulls "$PULLS" | sed "s/^/plain $round: /"
  target/release/examples/pull_bench --redis "$TLS_URL" "${TLS_FLAGS[@]}" --pulls "$PULLS" | sed "s/^/tls   $round: /"
done

mport=$(free_port); tmport=$(free_port)
target/release/sluice-manager --etcd "$ETCD_ENDPOINT" --redis "$PLAIN_URL" --namespace benchp \
  --listen "127.0.0.1:$mport" --node-id plain >"$dir/manager-plain.log" 2>&1 &
MPID=$!; SLUICE_PIDS+=($MPID)
target/release/sluice-manager --etcd "$ETCD_ENDPOINT" --redis "$TLS_URL" "${TLS_FLAGS[@]}" \
  --namespace bencht --listen "127.0.0.1:$tmport" --node-id tls >"$dir/manager-tls.log" 2>&1 &
TMPID=$!; SLUICE_PIDS+=($TMPID)
for p in $mport $tmport; do
  wait_for "manager :$p" 30 curl -sf "http://127.0.0.1:$p/healthz"
  wait_for "leadership :$p" 30 sh -c "curl -sf http://127.0.0.1:$p/metrics | grep -q '^sluice_leader 1'"
done

python3 - "$TASKS" "$SECS" "$mport,$MPID,$PLAIN_PID" "$tmport,$TMPID,$TLS_PID" <<'PY'
import concurrent.futures, json, os, sys, time, urllib.request

tasks, secs = int(sys.argv[1]), int(sys.argv[2])
sides = {name: dict(zip(("port", "mpid", "rpid"), arg.split(","))) for name, arg in (("plain", sys.argv[3]), ("tls", sys.argv[4]))}
tick = os.sysconf("SC_CLK_TCK")

def metrics(port):
    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            k, v = line.rsplit(" ", 1)
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

def put(arg):
    port, i = arg
    body = json.dumps({"threshold": 1000 + i % 100, "slice_ms": 1000}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/tasks/bench{i}", data=body, method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status

print(f"creating {tasks} tasks on each manager ...", file=sys.stderr)
with concurrent.futures.ThreadPoolExecutor(16) as ex:
    for s in sides.values():
        assert all(st in (200, 201) for st in ex.map(put, [(s["port"], i) for i in range(tasks)]))
t0 = time.time()
for name, s in sides.items():
    while True:
        m = metrics(s["port"])
        if m.get("sluice_tasks") == tasks and m.get("sluice_horizon_ahead_seconds", 0) >= 59:
            break
        if time.time() - t0 > 600:
            sys.exit(f"{name}: initial fill did not finish within 10 minutes")
        time.sleep(0.2)
time.sleep(2)
before = {n: (metrics(s["port"]), cpu(s["mpid"]), cpu(s["rpid"])) for n, s in sides.items()}
w0 = time.time()
print(f"measuring both for {secs}s ...", file=sys.stderr)
time.sleep(secs)
el = time.time() - w0
print(f"\n| {tasks:,} tasks, 1 s slices, {el:.0f} s | plain | TLS (mutual) |\n|---|---|---|")
print(f"pids: {sides}", file=sys.stderr)
rows = {}
for n, s in sides.items():
    m0, c0, r0 = before[n]
    m1, c1, r1 = metrics(s["port"]), cpu(s["mpid"]), cpu(s["rpid"])
    ticks = m1["sluice_roll_tick_seconds_count"] - m0["sluice_roll_tick_seconds_count"]
    rows[n] = {
        "slice writes/s": f"{(m1['sluice_slices_written_total'] - m0['sluice_slices_written_total']) / el:,.0f}",
        "roll calls/s": f"{(m1['sluice_roll_calls_total'] - m0['sluice_roll_calls_total']) / el:,.0f}",
        "rolling pass (mean)": f"{1000 * (m1['sluice_roll_tick_seconds_sum'] - m0['sluice_roll_tick_seconds_sum']) / max(ticks, 1):.0f} ms",
        "manager CPU (% of one core)": f"{100 * (c1 - c0) / el:.1f} %",
        "Redis CPU (% of one core)": f"{100 * (r1 - r0) / el:.1f} %",
        "manager CPU seconds": f"{c1 - c0:.2f} s",
        "roll errors (during the measurement)": f"{m1.get('sluice_roll_errors_total', 0) - m0.get('sluice_roll_errors_total', 0):.0f}",
    }
for k in rows["plain"]:
    print(f"| {k} | {rows['plain'][k]} | {rows['tls'][k]} |")
PY
