#!/usr/bin/env bash
# Benchmark of the host agent against the per-request design (issue 12), in ONE run on ONE
# Redis: a release sluice-manager, a release sluice-agent, and rls_baseline (envoyproxy/ratelimit's
# design: one pipelined INCRBY+EXPIRE round trip to Redis per descriptor per request), all
# driven by rls_load (tests/src/bin/rls_load.rs) over gRPC (Envoy RLS v3) and HTTP
# (POST /v1/decide). For each of agent/gRPC, agent/HTTP, baseline/gRPC, baseline/HTTP:
#   * closed loop, as fast as possible, limit far above demand (every decision an admission);
#   * open loop at a fixed rate both sustain (default: min(20,000, half the slowest max), or
#     SLUICE_BENCH_RATE), same limit — latency measured from the scheduled send time;
#   * open loop at 3× a limit of LIMIT/s (default 2,000, SLUICE_BENCH_LIMIT): per full 1 s
#     window, OK answers ≤ limit (by arrival time at the client; for the agent also the slice's
#     granted quota read from Redis).
# Then per-key limits over gRPC (issue 26): for each K of SLUICE_BENCH_AGENT_KEYS (default
# "1 100 10000"; --quick: "100"), a keyed task of L = max(1, RATE_K / K) per key per 1 s
# slice on the agent (direct form `sluice_task=keyedK,sluice_key=*`, rls_load --keys K: the
# value of request i is v<i mod K>) against an rls_baseline of limit L on the same request,
# open loop at SLUICE_BENCH_KEYS_RATE (default 5,000/s): demand 1× per key (below 1× where
# L is clamped to 1). Per full window, OK answers ≤ K·L. SLUICE_BENCH_AGENT_KEYS_ONLY=1 runs
# only these (no single-key runs, no goals line).
# Around every run: Redis commands (INFO commandstats deltas, INFO itself excluded), CPU seconds
# (/proc/<pid>/stat utime+stime) of the limiter process, redis-server and the manager, and the
# load client's own CPU; per-thread CPU of the limiter (by thread name) for the max runs.
# Prints markdown tables and writes target/bench-agent/result-<unix>.json (+ latest.json).
# SLUICE_BENCH_PERF=1: also `perf record` the agent during its max runs and print the profile.
#
#   scripts/bench-agent.sh [SECONDS]   (default 10 s per run, plus 1 s warm-up)
#   scripts/bench-agent.sh --quick     (smoke: 2 s runs, ≤ 60 s once built; checks the output)
# Everything started here is stopped by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
SEG_DIR=""
bench_cleanup() {
  cleanup
  if [ -n "$SEG_DIR" ]; then rm -rf "$SEG_DIR"; fi
}
trap bench_cleanup EXIT
trap 'exit 130' INT TERM

QUICK=0
SECS=10
WARM=1
case "${1:-}" in
  --quick) QUICK=1; SECS=2; WARM=0.25 ;;
  "") ;;
  *[!0-9]* ) die "usage: scripts/bench-agent.sh [SECONDS | --quick] (got ${1@Q})" ;;
  *) SECS=$1 ;;
esac
LIMIT=${SLUICE_BENCH_LIMIT:-2000}
RATE=${SLUICE_BENCH_RATE:-}
KRATE=${SLUICE_BENCH_KEYS_RATE:-5000}
if [ "$QUICK" = 1 ]; then AGENT_KEYS=${SLUICE_BENCH_AGENT_KEYS:-100}; else AGENT_KEYS=${SLUICE_BENCH_AGENT_KEYS:-1 100 10000}; fi
keys_norm=""
for k in $AGENT_KEYS; do
  case "$k" in
    ''|*[!0-9]*|???????*) die "SLUICE_BENCH_AGENT_KEYS: key counts are whole numbers 1 … 1,000,000 (got ${k@Q})" ;;
  esac
  k=$((10#$k)) # decimal, whatever leading zeros (bash reads 0100 as octal)
  [ "$k" -ge 1 ] && [ "$k" -le 1000000 ] || die "SLUICE_BENCH_AGENT_KEYS: 1 … 1,000,000 keys (got $k)"
  case " $keys_norm " in *" $k "*) ;; *) keys_norm="$keys_norm $k" ;; esac
done
AGENT_KEYS=${keys_norm# }
case "$KRATE" in
  ''|*[!0-9]*|????????*) die "SLUICE_BENCH_KEYS_RATE: decisions/s, a whole number 1 … 9,999,999 (got ${KRATE@Q})" ;;
esac
KRATE=$((10#$KRATE))
[ "$KRATE" -ge 1 ] || die "SLUICE_BENCH_KEYS_RATE: decisions/s, at least 1 (got $KRATE)"
case "${SLUICE_BENCH_AGENT_KEYS_ONLY:-0}" in
  0|1) ;;
  *) die "SLUICE_BENCH_AGENT_KEYS_ONLY: 0 or 1 (got ${SLUICE_BENCH_AGENT_KEYS_ONLY@Q})" ;;
esac

ensure_base_packages
BIN="${CARGO_TARGET_DIR:-target}/release"
log "building sluice-manager, sluice-agent, rls_baseline, rls_load (release)"
cargo build --release -q -p sluice-manager --bin sluice-manager -p sluice-agent --bin sluice-agent \
  -p sluice-tests --bin rls_baseline --bin rls_load
start_etcd
start_redis
REDIS_PID=${SLUICE_PIDS[-1]}
RPORT=${REDIS_URL##*:}
dir="$(sluice_tmp)"
NS=agentbench
SEG_DIR=$(mktemp -d /dev/shm/sluice-bench-agent.XXXXXX)

mport=$(free_port)
"$BIN/sluice-manager" --etcd "$ETCD_ENDPOINT" --redis "$REDIS_URL" --listen "127.0.0.1:$mport" \
  --node-id bench --namespace "$NS" >"$dir/manager.log" 2>&1 &
SLUICE_PIDS+=($!)
MANAGER_PID=$!
wait_for "manager" 30 curl -sf "http://127.0.0.1:$mport/healthz"

put_task() {
  curl -sf -X PUT "http://127.0.0.1:$mport/api/v1/tasks/$1" -H 'content-type: application/json' \
    -d "$2" >/dev/null || die "PUT /api/v1/tasks/$1 failed (see $dir/manager.log)"
}
# big: far above any demand (every decision an admission); acc: the accuracy limit.
put_task big '{"threshold": 1000000000, "slice_ms": 1000, "local_limit": 1000, "on_failure": "local"}'
put_task acc "{\"threshold\": $LIMIT, \"slice_ms\": 1000, \"on_failure\": \"local\"}"
task_ready() {
  curl -sf "http://127.0.0.1:$mport/api/v1/tasks/$1" | python3 -c \
    'import json,sys; s=json.load(sys.stdin)["status"]; sys.exit(0 if s.get("effective_threshold") is not None else 1)'
}
wait_for "task big's slices" 30 task_ready big
wait_for "task acc's slices" 30 task_ready acc
# Per-key limits: one keyed task per key count, L per key per slice (demand 1×).
klimit() { local l=$((KRATE / $1)); [ "$l" -ge 1 ] || l=1; echo "$l"; }
for k in $AGENT_KEYS; do
  put_task "keyed$k" "{\"threshold\": $(klimit "$k"), \"slice_ms\": 1000, \"keyed\": true, \"on_failure\": \"local\"}"
done
for k in $AGENT_KEYS; do wait_for "task keyed$k's slices" 30 task_ready "keyed$k"; done

ag=$(free_port); ah=$(free_port)
"$BIN/sluice-agent" --redis "$REDIS_URL" --namespace "$NS" --host-id bench-agent \
  --segment-dir "$SEG_DIR" --grpc-listen "127.0.0.1:$ag" --http-listen "127.0.0.1:$ah" \
  >"$dir/agent.log" 2>&1 &
SLUICE_PIDS+=($!)
AGENT_PID=$!
wait_for "agent" 30 curl -sf "http://127.0.0.1:$ah/readyz"

start_baseline() { # NAME LIMIT → sets <NAME>_PID, <NAME>_GRPC, <NAME>_HTTP
  local g h; g=$(free_port); h=$(free_port)
  "$BIN/rls_baseline" --redis "$REDIS_URL" --grpc-listen "127.0.0.1:$g" --http-listen "127.0.0.1:$h" \
    --limit "$2" --unit second >"$dir/$1.log" 2>&1 &
  SLUICE_PIDS+=($!)
  printf -v "${1}_PID" %s $!
  printf -v "${1}_GRPC" %s "$g"
  printf -v "${1}_HTTP" %s "$h"
  wait_for "baseline $1" 30 curl -sf "http://127.0.0.1:$h/healthz"
}
start_baseline BASEBIG 1000000000
start_baseline BASEACC "$LIMIT"
KEYED_PROCS=()
for k in $AGENT_KEYS; do
  start_baseline "BASEK$k" "$(klimit "$k")"
  pv="BASEK${k}_PID" gv="BASEK${k}_GRPC" hv="BASEK${k}_HTTP"
  KEYED_PROCS+=("basek$k:${!pv}:${!gv}:${!hv}")
done
log "agent pid $AGENT_PID (gRPC $ag, HTTP $ah), baselines pids $BASEBIG_PID / $BASEACC_PID, redis pid $REDIS_PID"

mkdir -p target/bench-agent
OUT="target/bench-agent/result-$(date +%s).json"
python3 - "$BIN/rls_load" "$RPORT" "$REDIS_PID" "$MANAGER_PID" "$NS" "$SECS" "$WARM" "$LIMIT" \
  "${RATE:-0}" "$OUT" "$dir" "$QUICK" "$KRATE" "$AGENT_KEYS" "${SLUICE_BENCH_AGENT_KEYS_ONLY:-0}" \
  "agent:$AGENT_PID:$ag:$ah" "base:$BASEBIG_PID:$BASEBIG_GRPC:$BASEBIG_HTTP" \
  "baseacc:$BASEACC_PID:$BASEACC_GRPC:$BASEACC_HTTP" "${KEYED_PROCS[@]}" <<'PY'
import json, os, subprocess, sys, time

(load, rport, redis_pid, manager_pid, ns, secs, warm, limit, rate, out, tmp, quick, krate,
 agent_keys, keys_only, *procs) = sys.argv[1:]
keys_only = keys_only == "1"
secs, warm, limit, rate, quick = float(secs), float(warm), int(limit), float(rate), quick == "1"
krate, agent_keys = int(krate), [int(k) for k in agent_keys.split()]
P = {}
for p in procs:
    name, pid, g, h = p.split(":")
    P[name] = {"pid": int(pid), "grpc": f"grpc://127.0.0.1:{g}", "http": f"http://127.0.0.1:{h}"}
TICK = os.sysconf("SC_CLK_TCK")

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK   # utime + stime (fields 14, 15)

def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                s = f.read()
        except FileNotFoundError:
            continue
        comm = s[s.index("(") + 1:s.rindex(")")]
        fields = s.rsplit(")", 1)[1].split()
        out[comm] = out.get(comm, 0) + (int(fields[11]) + int(fields[12])) / TICK
    return out

def cmdstats():
    txt = subprocess.run(["redis-cli", "-p", rport, "INFO", "commandstats"], capture_output=True,
                         text=True, check=True).stdout
    calls = {}
    for line in txt.splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_"):].split(":", 1)
            calls[name] = int(dict(kv.split("=") for kv in rest.split(","))["calls"])
    return calls

def run(label, who, proto, rate, extra, seconds=secs, limiter=None):
    pr = P[who]
    args = [load, "--target", pr[proto], "--rate", str(rate), "--concurrency", "64",
            "--connections", "2", "--threads", "2", "--window-ms", "1000"] + extra
    print(f"{label}: {who} {proto} rate={rate or 'max'} ...", file=sys.stderr)
    if warm > 0:
        # The warm-up is its own invocation, outside the counters below (rls_load's
        # --warmup-seconds would leave its Redis commands and CPU in the deltas).
        w = subprocess.run(args + ["--seconds", str(warm)], capture_output=True, text=True)
        if w.returncode != 0:
            sys.exit(f"rls_load warm-up failed ({label}, {who} {proto}): {w.stderr.strip()}")
    args += ["--seconds", str(seconds)]
    c0, l0, r0, m0, t0 = cmdstats(), cpu(pr["pid"]), cpu(redis_pid), cpu(manager_pid), threads(pr["pid"])
    perf = None
    if os.environ.get("SLUICE_BENCH_PERF") and label == "max" and who == "agent":
        # Where the agent's time goes: a sampled profile of the agent during this run.
        perf = subprocess.Popen(["perf", "record", "-q", "-F", "999", "-g", "-o",
                                 f"{tmp}/perf-{proto}.data", "-p", str(pr["pid"])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(f"{tmp}/load.out", "w") as so, open(f"{tmp}/load.err", "w") as se:
        p = subprocess.Popen(args, stdout=so, stderr=se)
        try:
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:
            p.kill(); raise
    if perf:
        perf.send_signal(2)
        perf.wait(timeout=60)
        rep = subprocess.run(["perf", "report", "-q", "--stdio", "--no-children", "-g", "none",
                              "--percent-limit", "1.5", "--sort", "dso,sym", "-i",
                              f"{tmp}/perf-{proto}.data"], capture_output=True, text=True).stdout
        print(f"perf: agent {proto} max, self time by symbol (≥ 1.5 %):\n{rep}", file=sys.stderr)
    c1, l1, r1, m1, t1 = cmdstats(), cpu(pr["pid"]), cpu(redis_pid), cpu(manager_pid), threads(pr["pid"])
    err = open(f"{tmp}/load.err").read().strip()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"rls_load failed ({label}, {who} {proto}): {err}")
    r = json.loads(open(f"{tmp}/load.out").read())
    # The second INFO counts the first; every INFO is left out. Everything else is counted:
    # the manager's and the agent's background calls are part of what Sluice costs Redis.
    delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if k != "info"}
    delta = {k: v for k, v in delta.items() if v}
    n = max(r["decisions"], 1)
    r.update(label=label, limiter=limiter or who, redis_commands=sum(delta.values()), redis_by_command=delta,
             redis_commands_per_decision=sum(delta.values()) / n,
             limiter_cpu_s=l1 - l0, redis_cpu_s=r1 - r0, manager_cpu_s=m1 - m0,
             client_cpu_s=ru.ru_utime + ru.ru_stime,
             limiter_threads_cpu_s={k: round(v - t0.get(k, 0), 3) for k, v in t1.items() if v - t0.get(k, 0) > 0})
    r["cpu_us_per_decision"] = {k: r[f"{k}_cpu_s"] * 1e6 / n for k in ("limiter", "redis", "client")}
    if r["errors"]:
        print(f"  {r['errors']} errors, first: {r['first_error']}", file=sys.stderr)
    return r

# Redis commands/s with no load at all (the manager's leader ticks, the agent's polls): part
# of every run's count below, reported on its own so it can be told apart.
i0 = cmdstats(); time.sleep(2); i1 = cmdstats()
idle_cmds_per_s = sum(v - i0.get(k, 0) for k, v in i1.items() if k != "info") / 2

targets = [] if keys_only else [("agent", "grpc"), ("agent", "http"), ("base", "grpc"), ("base", "http")]
def extra(who, proto, task):
    if proto == "grpc":
        # The agent's direct form addresses a task created through the API; the baseline
        # ignores what the entries say (one limit for all), so both get the same request.
        return ["--domain", "bench", "--descriptor", f"sluice_task={task}"]
    return ["--task", task]

results = []
maxes = {}
for who, proto in targets:
    r = run("max", who, proto, 0, extra(who, proto, "big"))
    maxes[(who, proto)] = r["decisions_per_s"]
    results.append(r)
if rate <= 0 and maxes:
    rate = max(1000, min(20000, int(min(maxes.values()) * 0.5) // 1000 * 1000))
for who, proto in targets:
    results.append(run("fixed", who, proto, rate, extra(who, proto, "big")))

def window_counts(r, cap):
    """OK answers per full window of run `r` against `cap` (into `r`); the full windows."""
    wins = r["per_window"][1:-1]           # full windows only
    r["full_windows"] = len(wins)
    r["max_ok_per_window"] = max((x["ok"] for x in wins), default=0)
    r["windows_ok_over_limit"] = sum(1 for x in wins if x["ok"] > cap)
    r["windows_ok_over_limit_sent_in_window"] = sum(1 for x in wins if x["ok"] - x["ok_sent_before"] > cap)
    r["mean_ok_per_window"] = sum(x["ok"] for x in wins) / max(len(wins), 1)
    return wins

acc = []
acc_secs = max(secs, 3)
for who, proto in targets:
    w = "agent" if who == "agent" else "baseacc"
    r = run("3x-limit", w, proto, 3 * limit, extra(who, proto, "acc"), seconds=acc_secs)
    wins = window_counts(r, limit)
    if who == "agent":
        # Authoritative for Sluice: the quota the slice granted (cap - rem), read from Redis.
        g = []
        for x in wins:
            v = subprocess.run(["redis-cli", "-p", rport, "HMGET", f"{ns}:{{acc}}:s:{x['start_ms']}",
                                "cap", "rem"], capture_output=True, text=True).stdout.split()
            if len(v) == 2 and all(s.lstrip("-").isdigit() for s in v):
                g.append(int(v[0]) - int(v[1]))
        r["slice_granted"] = g
    r["target_kind"] = who
    acc.append(r)
    results.append(r)

# Per-key limits over gRPC: the agent's keyed task (direct form, one key per value) against
# the per-request design on the same requests, open loop at krate.
keyed = []
for k in agent_keys:
    L = max(1, krate // k)
    desc = ["--domain", "bench", "--descriptor", f"sluice_task=keyed{k},sluice_key=*", "--keys", str(k)]
    for who in ("agent", f"basek{k}"):
        r = run(f"keys-{k}", who, "grpc", krate, desc, seconds=max(secs, 3),
                limiter="agent" if who == "agent" else "base")
        window_counts(r, k * L)
        r.update(keys=k, key_limit=L)
        keyed.append(r)

def row(r):
    c = r["cpu_us_per_decision"]
    return (f"| {'agent' if r['limiter'] == 'agent' else 'per-request'} | {r['protocol']} | {r['label']} "
            f"| {r['decisions_per_s']:,.0f} | {r['p50_us']:,.0f} | {r['p99_us']:,.0f} | {r['p999_us']:,.0f} "
            f"| {r['redis_commands_per_decision']:.4f} | {c['limiter']:.1f} | {c['redis']:.1f} "
            f"| {c['client']:.1f} | {r['errors']} |")

print()
print(f"2 targets × 2 protocols, {secs:g} s runs (+{warm:g} s warm-up), fixed load {rate:,.0f}/s, "
      f"accuracy limit {limit:,}/s at 3× demand; same Redis throughout; "
      f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
      f"Redis commands/s with no load: {idle_cmds_per_s:.1f}")
print()
print("| limiter | protocol | load | decisions/s | p50 µs | p99 µs | p99.9 µs | Redis cmds/decision "
      "| limiter CPU µs/dec | Redis CPU µs/dec | client CPU µs/dec | errors |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in results:
    if r["label"] != "3x-limit":
        print(row(r))
print()
print(f"| limiter | protocol | demand | full windows | OK per window max / mean (limit {limit:,}) "
      "| windows OK > limit (by arrival / sent in window) | slice granted max (agent) | OVER_LIMIT |")
print("|---|---|---|---|---|---|---|---|")
for r in acc:
    g = max(r.get("slice_granted") or [0]) if r["target_kind"] == "agent" else "—"
    print(f"| {'agent' if r['target_kind'] == 'agent' else 'per-request'} | {r['protocol']} | {3 * limit:,}/s "
          f"| {r['full_windows']} | {r['max_ok_per_window']:,} / {r['mean_ok_per_window']:,.0f} "
          f"| {r['windows_ok_over_limit']} / {r['windows_ok_over_limit_sent_in_window']} | {g} "
          f"| {r['over_limit']:,} |")
print()
print(f"Per-key limits over gRPC (direct form, one key per value; open loop {krate:,}/s; L per key per "
      "1 s slice, demand 1× per key, below where L is clamped to 1):")
print()
print("| keys | L | limiter | decisions/s | p50 µs | p99 µs | p99.9 µs | Redis cmds/decision "
      "| limiter CPU µs/dec | Redis CPU µs/dec | OK per window max / mean (≤ K·L) | windows OK > K·L (arrival / sent in window) | errors |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in keyed:
    c = r["cpu_us_per_decision"]
    print(f"| {r['keys']:,} | {r['key_limit']:,} | {'agent' if r['limiter'] == 'agent' else 'per-request'} "
          f"| {r['decisions_per_s']:,.0f} | {r['p50_us']:,.0f} | {r['p99_us']:,.0f} | {r['p999_us']:,.0f} "
          f"| {r['redis_commands_per_decision']:.4f} | {c['limiter']:.1f} | {c['redis']:.1f} "
          f"| {r['max_ok_per_window']:,} / {r['mean_ok_per_window']:,.0f} ({r['keys'] * r['key_limit']:,}) "
          f"| {r['windows_ok_over_limit']} / {r['windows_ok_over_limit_sent_in_window']} | {r['errors']} |")
print()
for r in results:
    if r["label"] == "max" and r["limiter"] == "agent":
        top = sorted(r["limiter_threads_cpu_s"].items(), key=lambda kv: -kv[1])[:6]
        print(f"agent {r['protocol']} max: CPU by thread (s over {r['seconds']:g} s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in top))

def get(label, who, proto):
    return next(r for r in results if r["label"] == label and r["limiter"] == who and r["protocol"] == proto)
goals = []
for proto in () if keys_only else ("grpc", "http"):
    a, b = get("fixed", "agent", proto), get("fixed", "base", proto)
    am, bm = get("max", "agent", proto), get("max", "base", proto)
    goals.append({"protocol": proto,
                  "agent_redis_cmds_per_decision": a["redis_commands_per_decision"],
                  "baseline_redis_cmds_per_decision": b["redis_commands_per_decision"],
                  "p99_ratio_agent_over_baseline": a["p99_us"] / max(b["p99_us"], 1e-9),
                  "max_ratio_agent_over_baseline": am["decisions_per_s"] / max(bm["decisions_per_s"], 1e-9),
                  "agent_p99_us_fixed": a["p99_us"]})
print()
for g in goals:
    print(f"{g['protocol']}: Redis cmds/decision agent {g['agent_redis_cmds_per_decision']:.4f} "
          f"(goal ≤ 0.05) vs per-request {g['baseline_redis_cmds_per_decision']:.2f}; "
          f"p99 agent/per-request {g['p99_ratio_agent_over_baseline']:.2f} (goal ≤ 0.20); "
          f"max decisions/s agent/per-request {g['max_ratio_agent_over_baseline']:.2f} (goal ≥ 2); "
          f"agent p99 {g['agent_p99_us_fixed']:,.0f} µs (goal ≤ 1,000)")

doc = {"unix": int(time.time()), "seconds": secs, "warmup_seconds": warm, "fixed_rate": rate,
       "limit": limit, "quick": quick, "cpus": os.cpu_count(), "idle_redis_cmds_per_s": idle_cmds_per_s,
       "loadavg_before_report": os.getloadavg(), "runs": results, "goals": goals,
       "keys_rate": krate, "keyed_runs": keyed}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
latest = os.path.join(os.path.dirname(out), "latest.json")
if os.path.lexists(latest):
    os.remove(latest)
os.symlink(os.path.basename(out), latest)
print(f"\nresults: {out}", file=sys.stderr)

# The smoke check (--quick) and every run: the output parses and every run got answers.
bad = [f"{r['label']} {r['limiter']} {r['protocol']}" for r in results + keyed
       if r["decisions"] == 0 or r["ok"] + r["over_limit"] == 0 or r["errors"] > 0]
if bad:
    sys.exit("runs with errors or without answers: " + ", ".join(bad))
PY
