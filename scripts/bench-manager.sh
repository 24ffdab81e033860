#!/usr/bin/env bash
# Benchmark: one leader rolling N tasks (default 10,000) of 1 s slices.
# Reports slice writes/s, roll calls/s, Redis commands/s, manager and Redis CPU, the initial
# fill time, and — measured in the same run on the same Redis — redis-benchmark HSET and
# EVALSHA throughput as the baseline of what Redis can do.
#
#   scripts/bench-manager.sh [TASKS] [SECONDS]
#
# The steady state is measured once every task has been idle for SLUICE_BENCH_IDLE_S (default
# 70) seconds after the fill: the leader polls and harvests tasks idle for a minute less often.
#
# SLUICE_MANAGER_BIN=path runs that manager binary instead of building this checkout's (to
# measure an older build side by side with this one). SLUICE_LAZY_AFTER=60s runs the manager
# with `--lazy-after 60s` (lazy idle tasks, protocol 5; it reads the variable itself); choose
# SLUICE_BENCH_IDLE_S above it plus a horizon, so the window written ahead has passed.
#
# SLUICE_BENCH_ACTIVE=N gives the first N tasks traffic after the idle time: one loadgen
# process (release) deciding SLUICE_BENCH_RATE (default 5) times a second per task, round-robin
# (`--spread-tasks`), from 20 s before the steady state until its end (issue 27's "100,000
# tasks, 1,000 of them with traffic").
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT
trap 'exit 130' INT TERM

TASKS=${1:-10000}
SECS=${2:-30}
ensure_base_packages
MANAGER_BIN=${SLUICE_MANAGER_BIN:-}
if [[ -z $MANAGER_BIN ]]; then
  log "building sluice-manager (release)"
  cargo build --release -q -p sluice-manager
  MANAGER_BIN=target/release/sluice-manager
fi
ACTIVE=${SLUICE_BENCH_ACTIVE:-0}
if ((ACTIVE > 0)); then
  log "building the load generator (release)"
  cargo build --release -q -p sluice-sdk --example loadgen
fi
start_etcd
start_redis
dir="$(sluice_tmp)"
port=$(free_port)
"$MANAGER_BIN" --etcd "$ETCD_ENDPOINT" --redis "$REDIS_URL" \
  --listen "127.0.0.1:$port" --node-id bench >"$dir/manager.log" 2>&1 &
MPID=$!
SLUICE_PIDS+=($MPID)
wait_for "manager" 30 curl -sf "http://127.0.0.1:$port/healthz"
wait_for "leadership" 30 sh -c "curl -sf http://127.0.0.1:$port/metrics | grep -q '^sluice_leader 1'"
RPORT=${REDIS_URL##*:}

python3 - "$port" "$TASKS" "$SECS" "$MPID" "$RPORT" "${SLUICE_BENCH_IDLE_S:-70}" "$ACTIVE" "$REDIS_URL" "$dir" <<'PY'
import concurrent.futures, json, os, re, subprocess, sys, time, urllib.error, urllib.request

port, tasks, secs, mpid, rport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
idle_s = float(sys.argv[6])
active, redis_url, workdir = int(sys.argv[7]), sys.argv[8], sys.argv[9]
rate_per_task = float(os.environ.get("SLUICE_BENCH_RATE", "5"))
base = f"http://127.0.0.1:{port}"
tick = os.sysconf("SC_CLK_TCK")

def metrics():
    out = {}
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            k, v = line.rsplit(" ", 1)
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out

def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

def redis_info():
    out = subprocess.run(["redis-cli", "-p", rport, "info", "all"], capture_output=True, text=True).stdout
    d = {}
    for line in out.splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            d[k] = v.strip()
    return d

import threading
retries, retries_lock = [0], threading.Lock()
def put(i):
    body = json.dumps({"threshold": 1000 + i % 100, "slice_ms": 1000}).encode()
    req = urllib.request.Request(f"{base}/api/v1/tasks/bench{i}", data=body, method="PUT",
                                 headers={"Content-Type": "application/json"})
    # A 503 (etcd busy: its write took too long) is retried with a backoff, as a client should;
    # the retries are reported.
    for attempt in range(6):
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            e.close()
            if e.code != 503 or attempt == 5:
                raise
            with retries_lock:
                retries[0] += 1
            time.sleep(0.2 * 2 ** attempt)

print(f"creating {tasks} tasks through the API ...", file=sys.stderr)
t0 = time.time()
with concurrent.futures.ThreadPoolExecutor(16) as ex:
    statuses = list(ex.map(put, range(tasks)))
assert all(s in (200, 201) for s in statuses), "some PUTs failed"
t_created = time.time() - t0
print(f"  {tasks} PUTs in {t_created:.1f}s ({tasks / t_created:.0f}/s, {retries[0]} retried after a 503)", file=sys.stderr)

print("waiting for the initial fill (every task 60 s ahead) ...", file=sys.stderr)
while True:
    m = metrics()
    if m.get("sluice_tasks") == tasks and m.get("sluice_horizon_ahead_seconds", 0) >= 59:
        break
    if time.time() - t0 > 600:
        sys.exit("initial fill did not finish within 10 minutes")
    time.sleep(0.2)
t_fill = time.time() - t0
print(f"  filled {t_fill:.1f}s after the first PUT", file=sys.stderr)

print(f"  letting every task idle for {idle_s:.0f}s ...", file=sys.stderr)
time.sleep(idle_s)
load = None
if active > 0:
    warm = 20
    print(f"traffic on {active} tasks ({rate_per_task:g} decisions/s each), {warm}s before measuring ...", file=sys.stderr)
    load_out = open(os.path.join(workdir, "loadgen.json"), "w")
    # A host of its own (its shared segment is sized for the tasks), removed at the end.
    load_host = f"bench-host-{os.getpid()}"
    load = subprocess.Popen(
        ["target/release/examples/loadgen", "--redis", redis_url, "--namespace", "sluice",
         "--task", "bench", "--spread-tasks", str(active), "--host-id", load_host,
         "--duration-ms", str(int((warm + secs + 2) * 1000)), "--rate", str(active * rate_per_task)],
        stdout=load_out, stderr=open(os.path.join(workdir, "loadgen.log"), "w"))
    time.sleep(warm)
    if load.poll() is not None:
        sys.exit(f"the load generator exited early ({load.returncode}): " + open(os.path.join(workdir, "loadgen.log")).read()[-2000:])
    woken = metrics().get("sluice_lazy_woken_total", 0)
    print(f"  {woken:.0f} tasks woken by the traffic so far", file=sys.stderr)
m0, c0, r0, w0 = metrics(), cpu_seconds(mpid), redis_info(), time.time()
print(f"measuring steady state for {secs}s ...", file=sys.stderr)
if os.environ.get("SLUICE_BENCH_PERF"):
    # The manager's profile over the steady state (SLUICE_BENCH_PERF=1; needs perf).
    subprocess.run(["perf", "record", "-g", "-p", str(mpid), "-o", os.path.join(workdir, "perf.data"),
                    "--", "sleep", str(secs)], capture_output=True)
    rest = secs - (time.time() - w0)
    if rest > 0:
        time.sleep(rest)
else:
    time.sleep(secs)
m1, c1, r1, w1 = metrics(), cpu_seconds(mpid), redis_info(), time.time()
el = w1 - w0
decided = "–"
if load is not None:
    # It ends by itself two seconds after the steady state (and reports); else stopped.
    try:
        load.wait(timeout=60)
    except subprocess.TimeoutExpired:
        load.terminate()
        try:
            load.wait(timeout=30)
        except subprocess.TimeoutExpired:
            load.kill()
            load.wait()
    try:
        rep_ = [json.loads(l) for l in open(os.path.join(workdir, "loadgen.json")) if l.strip().startswith("{")][-1]
        decided = f"{rep_.get('admitted', 0):,} admitted, {rep_.get('rejected', 0):,} rejected, {rep_.get('redis_calls', 0):,} Redis calls"
    except (IndexError, ValueError, OSError) as e:
        decided = f"no report ({e})"
        tail = open(os.path.join(workdir, "loadgen.log")).read()[-2000:]
        print(f"the load generator reported nothing; its log ends:\n{tail}", file=sys.stderr)
    try:
        os.remove(f"/dev/shm/sluice.sluice.{load_host}")
    except OSError:
        pass

def rate(k): return (m1.get(k, 0) - m0.get(k, 0)) / el
cmds = (int(r1["total_commands_processed"]) - int(r0["total_commands_processed"])) / el
rcpu = (float(r1["used_cpu_sys"]) + float(r1["used_cpu_user"]) - float(r0["used_cpu_sys"]) - float(r0["used_cpu_user"])) / el
def cmdstats(d):
    out = {}
    for k, v in d.items():
        if k.startswith("cmdstat_"):
            f = dict(x.split("=", 1) for x in v.split(","))
            out[k[8:]] = (int(f["calls"]), float(f["usec"]))
    return out
s0, s1 = cmdstats(r0), cmdstats(r1)
breakdown = sorted(
    ((name, (c - s0.get(name, (0, 0))[0]) / el, (u - s0.get(name, (0, 0))[1]) / el)
     for name, (c, u) in s1.items()),
    key=lambda x: -x[2])
ticks = m1["sluice_roll_tick_seconds_count"] - m0["sluice_roll_tick_seconds_count"]
tick_ms = 1000 * (m1["sluice_roll_tick_seconds_sum"] - m0["sluice_roll_tick_seconds_sum"]) / max(ticks, 1)
mem = int(r1["used_memory"]) / 2**20
keys = subprocess.run(["redis-cli", "-p", rport, "dbsize"], capture_output=True, text=True).stdout.strip()

def bench(args):
    out = subprocess.run(["redis-benchmark", "-p", rport, "-q", "-c", "50"] + args, capture_output=True, text=True).stdout
    found = re.findall(r"([0-9.]+) requests per second", out.replace("\r", "\n"))
    return float(found[-1]) if found else float("nan")
hset = bench(["-n", "200000", "-t", "hset"])
evalsha_script = "redis.call('HINCRBY', KEYS[1], 'rem', -1) return 1"
sha = subprocess.run(["redis-cli", "-p", rport, "script", "load", evalsha_script], capture_output=True, text=True).stdout.strip()
evalsha = bench(["-n", "200000", "evalsha", sha, "1", "bench:{x}:s"])

print(f"""
| measure ({tasks:,} tasks, {active:,} with traffic, 1 s slices, horizon 60 s, tick 500 ms, lazy after {os.environ.get('SLUICE_LAZY_AFTER') or 'off'}) | value |
|---|---|
| traffic (one loadgen, {rate_per_task:g}/s on each of {active:,} tasks; whole run) | {decided} |
| initial fill (create {tasks:,} tasks through the API, then every task 60 s ahead) | {t_fill:.1f} s ({tasks / t_created:.0f} PUT/s) |
| slice writes per second (steady) | {rate('sluice_slices_written_total'):,.0f} |
| tasks left lazy (and woken) | {m1.get('sluice_lazy_tasks', 0):,.0f} ({m1.get('sluice_lazy_woken_total', 0):,.0f}) |
| roll script calls per second | {rate('sluice_roll_calls_total'):,.0f} |
| roll probes (one HMGET) per second | {rate('sluice_roll_probes_total'):,.0f} |
| skew detector readings per second | {rate('sluice_skew_polls_total'):,.0f} |
| history slices read per second | {rate('sluice_history_slices_total'):,.0f} |
| Redis commands per second (all, incl. inside scripts) | {cmds:,.0f} |
| one rolling pass over all tasks (mean) | {tick_ms:.0f} ms |
| manager CPU | {100 * (c1 - c0) / el:.0f} % of one core |
| Redis CPU | {100 * rcpu:.0f} % of one core |
| Redis memory, keys | {mem:,.0f} MiB, {int(keys):,} keys |
| roll errors during the steady state (since the start) | {m1.get('sluice_roll_errors_total', 0) - m0.get('sluice_roll_errors_total', 0):.0f} ({m1.get('sluice_roll_errors_total', 0):.0f}) |
| baseline, same Redis: redis-benchmark HSET (50 clients) | {hset:,.0f} req/s |
| baseline, same Redis: redis-benchmark EVALSHA of a one-HINCRBY script | {evalsha:,.0f} req/s |
""")
print("Redis commands by name (steady state; those inside scripts included; `evalsha`'s time includes its commands'):\n")
print("| command | calls/s | Redis µs/s |")
print("|---|---|---|")
for name, calls, usec in breakdown:
    if calls >= 1:
        print(f"| {name} | {calls:,.0f} | {usec:,.0f} |")
PY
if [[ -n ${SLUICE_BENCH_PERF:-} && -f $dir/perf.data && ${SLUICE_BENCH_PERF} != 1 ]]; then
  # SLUICE_BENCH_PERF=<path>: the profile is kept there too.
  cp "$dir/perf.data" "$SLUICE_BENCH_PERF"
fi
if [[ -n ${SLUICE_BENCH_PERF:-} && -f $dir/perf.data ]]; then
  echo
  echo "The manager's profile over the steady state (perf, self time, top symbols):"
  perf report -i "$dir/perf.data" --no-children --percent-limit 1.5 --stdio 2>/dev/null \
    | grep -E '^ +[0-9]' | head -30
fi
if grep -q "WARN" "$dir/manager.log"; then
  echo
  echo "The manager's warnings during the run (most frequent first):"
  grep "WARN" "$dir/manager.log" | sed -E 's/\x1b\[[0-9;]*m//g; s/^[^ ]+ +WARN +//; s/task=[^ ]+ //' | cut -c1-200 | sort | uniq -c | sort -rn | head -8
fi
