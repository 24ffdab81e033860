#!/usr/bin/env python3
"""Side-by-side benchmark of Sluice and the limiters users pick instead (issue 14).

Started by scripts/bench.sh, which builds the binaries, installs the Node.js and Python peers,
starts etcd, Redis, one sluice-manager and two sluice-agents, and passes their addresses here.
Every limiter runs against the SAME Redis with the SAME process count (HOSTS hosts × PROCS
processes) and the SAME demand, one after the other:

  demand "over":   every process as fast as it can (closed loop, one decision in flight),
                   far above the limit for every limiter that can go fast;
  demand "steady": every process paced so the total is 90 % of the limit.

Measured per run: decisions/s, p50/p99 decision latency (merged log histograms of every
process), Redis commands per decision (INFO commandstats deltas, INFO itself excluded; for
the peers the idle background of Sluice's own processes, measured first, is subtracted),
CPU seconds per million decisions of the limiter's processes (wait4 rusage of the client
processes; for the agent its /proc times and those of its load client separately) and of
Redis (/proc times), and the manager's CPU (a fixed cost per task, not per decision) apart, and accuracy per 1 s window: admitted ÷ limit over every full window
(min / median / max), how many windows admitted more than the limit and by how much, and the
most admitted in any 1 s span (100 ms steps).

Full mode adds scale curves (tasks, hosts, keys) and the anchors' workload (several hosts,
shifting demand), and runs the criterion decision-path benchmarks.

The keys grid (issue 26; `keys`, quick mode runs a corner of it): per-key limits, Sluice keyed
(loadgen --keys) against the per-request fixed window on the same keys (peer_redis --keys), at
every point of keys × per-key demand × hosts × slice length, with the same total rate per host,
process count, limit and Redis; key_points() says how a point's limit is derived, key_run()
what is measured, key_accuracy() how a key's slices are judged. --sections picks what runs
(default: everything in full mode, peers and keys in quick mode). Writes ONE JSON file.
"""

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

TICK = os.sysconf("SC_CLK_TCK")
BUCKET_MS = 100
WINDOW_MS = 1000


SECTIONS = ("peers", "anchors", "keys", "scale", "criterion")


def log(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def now_ms():
    return int(time.time() * 1000)


# ---------------------------------------------------------------- measurements

def proc_cpu(pid):
    """utime + stime of a live process (seconds), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


class Redis:
    def __init__(self, port, pid):
        self.port, self.pid = str(port), pid

    def cli(self, *args):
        return subprocess.run(["redis-cli", "-p", self.port, *args], capture_output=True,
                              text=True, check=True, timeout=30).stdout

    def commands(self):
        """Total commands processed (all, including those called inside scripts), INFO excluded."""
        total = 0
        for line in self.cli("INFO", "commandstats").splitlines():
            m = re.match(r"cmdstat_([^:]+):calls=(\d+)", line)
            if m and m.group(1) != "info":
                total += int(m.group(2))
        return total

    def cpu(self):
        return proc_cpu(self.pid)

    def used_memory(self):
        return int(re.search(r"used_memory:(\d+)", self.cli("INFO", "memory")).group(1))

    def unlink_matching(self, pattern):
        """Removes every key matching a glob pattern (SCAN, then UNLINK in batches)."""
        keys = subprocess.run(["redis-cli", "-p", self.port, "--scan", "--pattern", pattern],
                              capture_output=True, text=True, check=True, timeout=300).stdout.split()
        for i in range(0, len(keys), 1000):
            self.cli("UNLINK", *keys[i:i + 1000])


def hist_merge(into, h):
    for k, n in h.items():
        into[int(k)] = into.get(int(k), 0) + int(n)


def hist_pct_us(h, q):
    total = sum(h.values())
    if total == 0:
        return None
    want = max(1, int(total * q + 0.999999))
    seen = 0
    for b in sorted(h):
        seen += h[b]
        if seen >= want:
            return round(2 ** ((b + 0.5) / 16) / 1000, 4)
    return None


def accuracy(buckets, limit, full_from, full_to):
    """Per aligned 1 s window fully inside [full_from, full_to): admitted ÷ limit."""
    wins, rej = {}, {}
    for start, (ok, over) in buckets.items():
        w = start - start % WINDOW_MS
        wins[w] = wins.get(w, 0) + ok
        rej[w] = rej.get(w, 0) + over
    full = sorted(w for w in wins if w >= full_from and w + WINDOW_MS <= full_to)
    vals = [wins[w] for w in full]
    # Most admitted in any 1 s span, 100 ms steps, inside the full range.
    steps = range(full_from - full_from % BUCKET_MS, full_to - WINDOW_MS + 1, BUCKET_MS)
    span_max = 0
    for s in steps:
        if s < full_from:
            continue
        span_max = max(span_max, sum(buckets.get(b, (0, 0))[0]
                                     for b in range(s, s + WINDOW_MS, BUCKET_MS)))
    if not vals:
        return {"windows": 0}
    return {
        "windows": len(vals),
        "admitted_per_window": vals,
        "rejected_per_window": [rej[w] for w in full],
        "rejected_outside_full_windows": sum(v for w, v in rej.items() if w not in full),
        "min": round(min(vals) / limit, 4),
        "median": round(statistics.median(vals) / limit, 4),
        "max": round(max(vals) / limit, 4),
        "over_windows": sum(1 for v in vals if v > limit),
        "over_permits": sum(max(0, v - limit) for v in vals),
        "max_any_1s_span": round(span_max / limit, 4),
    }


def wait_rusage(p, deadline):
    """Waits for a Popen; returns (stdout text, rusage) with the CPU of it and its children."""
    out_chunks = []

    def reader():
        out_chunks.append(p.stdout.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            break
        if time.time() > deadline:
            p.kill()
            pid, status, ru = os.wait4(p.pid, 0)
            break
        time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)
    t.join(10)
    return (out_chunks[0].decode() if out_chunks else ""), ru


# ---------------------------------------------------------------- the context

class Bench:
    def __init__(self, a):
        self.a = a
        self.redis = Redis(a.redis_port, a.redis_pid)
        self.base = a.manager_url
        self.tmp = a.tmp
        self.limit = a.limit
        self.hosts, self.procs = a.hosts, a.procs
        self.secs = a.seconds
        self.run_id = str(int(time.time()))
        self.agents = [dict(zip(("pid", "grpc", "http", "host"), x.split(",")))
                       for x in a.agent]
        self.idle_cmds_per_s = 0.0
        # Simulated host ids whose segments are removed at the end.
        self._cleanup_hosts = []

    # -- the manager's API
    def put_task(self, name, spec):
        req = urllib.request.Request(f"{self.base}/api/v1/tasks/{name}",
                                     data=json.dumps(spec).encode(), method="PUT",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status in (200, 201), r.status

    def delete_task(self, name):
        req = urllib.request.Request(f"{self.base}/api/v1/tasks/{name}", method="DELETE")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status in (200, 204), r.status

    def task_ready(self, name):
        try:
            with urllib.request.urlopen(f"{self.base}/api/v1/tasks/{name}", timeout=10) as r:
                return json.load(r)["status"].get("effective_threshold") is not None
        except Exception:
            return False

    def wait_tasks(self, names, secs=60):
        deadline = time.time() + secs
        for n in names:
            while not self.task_ready(n):
                if time.time() > deadline:
                    sys.exit(f"bench: task {n} has no slices after {secs} s")
                time.sleep(0.1)

    def metrics(self):
        out = {}
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("#") or " " not in line:
                    continue
                k, v = line.rsplit(" ", 1)
                try:
                    out[k] = float(v)
                except ValueError:
                    pass
        return out

    def remove_segments(self, host):
        for f in os.listdir("/dev/shm"):
            if f.startswith(f"sluice.{self.a.namespace}.{host}"):
                try:
                    os.remove(os.path.join("/dev/shm", f))
                except FileNotFoundError:
                    pass

    # -- one run of one limiter at one demand
    def run_case(self, peer, demand, task=None):
        total = self.hosts * self.procs
        rate = 0.0 if demand == "over" else 0.9 * self.limit / total
        dur = int(self.secs * 1000)
        lead = 1500
        t0 = now_ms() + lead
        key = f"bench{self.run_id}:{peer}:{demand}"
        server_pids = [self.a.manager_pid]
        if peer.startswith("sluice-agent"):
            server_pids += [int(ag["pid"]) for ag in self.agents]
        c0, r0 = self.redis.commands(), self.redis.cpu()
        s0 = [proc_cpu(p) for p in server_pids]
        w0 = time.time()
        procs = self.launch(peer, demand, task, key, rate, dur, t0)
        reports, client_cpu, maxrss = [], 0.0, 0
        deadline = time.time() + lead / 1000 + dur / 1000 + 120
        for name, p, parse in procs:
            out, ru = wait_rusage(p, deadline)
            if p.returncode != 0:
                sys.exit(f"bench: {peer}/{demand}: {name} exited {p.returncode}; see {self.tmp}")
            line = [x for x in out.splitlines() if x.strip()]
            if not line:
                sys.exit(f"bench: {peer}/{demand}: {name} printed nothing; see {self.tmp}")
            reports.append(parse(json.loads(line[-1])))
            client_cpu += ru.ru_utime + ru.ru_stime
            maxrss = max(maxrss, ru.ru_maxrss)
        elapsed = time.time() - w0
        cmds = self.redis.commands() - c0
        rcpu = self.redis.cpu() - r0
        scpu = [proc_cpu(p) - c for p, c in zip(server_pids, s0)]
        if not peer.startswith("sluice"):
            # Sluice's own processes keep their background (the leader's roll, the agents'
            # refresh) while a peer runs: that is not the peer's cost.
            cmds = max(0, cmds - round(self.idle_cmds_per_s * elapsed))
        decisions = sum(r["decisions"] for r in reports)
        ok = sum(r["ok"] for r in reports)
        over = sum(r["over_limit"] for r in reports)
        errors = sum(r["errors"] for r in reports)
        seconds = statistics.median([r["seconds"] for r in reports])
        hist, buckets = {}, {}
        for r in reports:
            hist_merge(hist, r["lat_hist"])
            for b, (o, v) in r["buckets"].items():
                e = buckets.setdefault(int(b), [0, 0])
                e[0] += o
                e[1] += v
        starts = sorted(buckets)
        first = starts[0] - starts[0] % WINDOW_MS + WINDOW_MS if starts else 0
        last = starts[-1] - starts[-1] % WINDOW_MS if starts else 0
        acc = accuracy(buckets, self.limit, first, last)
        manager_cpu = scpu[0]
        agent_cpu = sum(scpu[1:])
        # The manager's CPU is a fixed cost per task (the leader's roll), not per decision:
        # reported on its own (`manager_cpu_percent`), not in the per-decision figure.
        limiter_cpu = agent_cpu if peer.startswith("sluice-agent") else client_cpu
        per_m = 1e6 / max(decisions, 1)
        res = {
            "peer": peer, "demand": demand, "processes": total, "hosts": self.hosts,
            "rate_per_process": rate, "seconds": round(seconds, 3),
            "decisions": decisions, "ok": ok, "over_limit": over, "errors": errors,
            "first_error": next((r.get("first_error") for r in reports if r.get("first_error")), None),
            "decisions_per_s": round(decisions / max(seconds, 1e-9), 1),
            "admitted_fraction": round(ok / max(decisions, 1), 4),
            "p50_us": hist_pct_us(hist, 0.50), "p99_us": hist_pct_us(hist, 0.99),
            "p999_us": hist_pct_us(hist, 0.999),
            "redis_commands": cmds,
            "redis_commands_per_decision": round(cmds / max(decisions, 1), 5),
            "sdk_redis_calls": sum(r.get("redis_calls", 0) for r in reports) if peer.startswith("sluice-sdk") else None,
            "cpu_limiter_s": round(limiter_cpu, 3), "cpu_redis_s": round(rcpu, 3),
            "cpu_manager_s": round(manager_cpu, 3),
            "manager_cpu_percent": round(100 * manager_cpu / max(elapsed, 1e-9), 2),
            "cpu_agent_s": round(agent_cpu, 3) if peer.startswith("sluice-agent") else None,
            "cpu_load_client_s": round(client_cpu, 3),
            "cpu_limiter_s_per_million": round(limiter_cpu * per_m, 3),
            "cpu_redis_s_per_million": round(rcpu * per_m, 3),
            "max_rss_kib": maxrss,
            "accuracy": acc,
            "version": reports[0].get("version"),
        }
        if res["sdk_redis_calls"] is not None:
            res["sdk_redis_calls_per_admitted"] = round(res["sdk_redis_calls"] / max(ok, 1), 5)
        log(f"{peer:24} {demand:6} {res['decisions_per_s']:>12,.0f}/s p50 {res['p50_us']} µs "
            f"p99 {res['p99_us']} µs cmds/dec {res['redis_commands_per_decision']} "
            f"acc {acc.get('min')}–{acc.get('median')}–{acc.get('max')} over {acc.get('over_windows')}")
        return res

    def launch(self, peer, demand, task, key, rate, dur, t0):
        a, ps = self.a, []
        tag = f"{peer}-{demand}"

        def spawn(name, cmd, parse):
            err = open(os.path.join(self.tmp, f"{tag}-{name}.log"), "w")
            ps.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err), parse))

        if peer in ("sluice-sdk-pooled", "sluice-sdk-keyed"):
            for h in range(self.hosts):
                host = f"b{self.run_id}-{tag}-{h}"
                cmd = [a.loadgen, "--redis", a.redis, "--namespace", a.namespace, "--task", task,
                       "--host-id", host, "--procs", str(self.procs), "--duration-ms", str(dur),
                       "--rate", str(rate), "--bucket-ms", str(BUCKET_MS),
                       "--start-at-ms", str(t0), "--latency-every", "64"]
                if peer == "sluice-sdk-keyed":
                    cmd += ["--keys", "1", "--workers", "1", "--key-report", "0"]
                spawn(host, cmd, parse_loadgen)
                self._cleanup_hosts.append(host)
        elif peer.startswith("sluice-agent"):
            proto = peer.rsplit("-", 1)[1]
            for i, ag in enumerate(self.agents[: self.hosts]):
                cmd = [a.rls_load, "--target", ag[proto], "--concurrency", str(self.procs),
                       "--connections", "1", "--seconds", str(dur / 1000), "--warmup-seconds", "0.3",
                       "--rate", str(rate * self.procs), "--window-ms", str(BUCKET_MS),
                       "--timeout-ms", "5000"]
                if proto == "grpc":
                    cmd += ["--domain", "bench", "--descriptor", f"sluice_task={task}"]
                else:
                    cmd += ["--task", task]
                spawn(f"agent{i}", cmd, parse_rls_load)
        else:
            base = {
                "redis-fixed-window-lua": [a.peer_redis, "--algo", "fixed-window"],
                "redis-sliding-log-zset": [a.peer_redis, "--algo", "sliding-log"],
                "rate-limiter-flexible": a.node_peer.split(),
                "limits": a.py_peer.split(),
            }[peer]
            for i in range(self.hosts * self.procs):
                cmd = base + ["--redis", a.redis, "--key", key, "--limit", str(self.limit),
                              "--window-ms", str(WINDOW_MS), "--duration-ms", str(dur),
                              "--start-at-ms", str(t0), "--rate", str(rate),
                              "--bucket-ms", str(BUCKET_MS), "--proc", str(i)]
                spawn(f"p{i}", cmd, parse_peer)
        return ps


def parse_loadgen(j):
    return {
        "decisions": j["admitted"] + j["rejected"], "ok": j["admitted"],
        "over_limit": j["rejected"], "errors": 0, "seconds": j["duration_ms"] / 1000,
        "lat_hist": j.get("lat_hist", {}), "buckets": j["buckets"],
        "redis_calls": j["redis_calls"], "version": "loadgen",
    }


def parse_rls_load(j):
    return {
        "decisions": j["decisions"], "ok": j["ok"], "over_limit": j["over_limit"],
        "errors": j["errors"], "first_error": j.get("first_error"), "seconds": j["seconds"],
        "lat_hist": j.get("lat_hist", {}),
        "buckets": {str(w["start_ms"]): [w["ok"], w["over_limit"]] for w in j["per_window"]},
        "version": "rls_load",
    }


def parse_peer(j):
    return j


# ---------------------------------------------------------------- scale curves, anchors

def scale_curves(b):
    a, out = b.a, {"hosts": [], "keys": [], "tasks": []}
    secs = max(3, int(b.secs // 2))
    t_start = time.time()

    def loadgen(task, host, procs, rate, extra=()):
        cmd = [a.loadgen, "--redis", a.redis, "--namespace", a.namespace, "--task", task,
               "--host-id", host, "--procs", str(procs), "--duration-ms", str(secs * 1000),
               "--rate", str(rate), "--bucket-ms", "1000", "--latency-every", "64", *extra]
        err = open(os.path.join(b.tmp, f"scale-{host}.log"), "w")
        b._cleanup_hosts.append(host)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)

    def measure(spawn):
        c0, m0, r0, w0 = b.redis.commands(), proc_cpu(a.manager_pid), b.redis.cpu(), time.time()
        ps = spawn()
        reps, rss = [], 0
        for p in ps:
            o, ru = wait_rusage(p, time.time() + secs + 120)
            if p.returncode != 0:
                sys.exit(f"bench: scale run failed (exit {p.returncode}); see {b.tmp}")
            reps.append(json.loads(o.strip().splitlines()[-1]))
            rss = max(rss, ru.ru_maxrss)
        el = time.time() - w0
        hist, buckets = {}, {}
        for r in reps:
            hist_merge(hist, r.get("lat_hist", {}))
            for k, (adm, _rej) in r["buckets"].items():
                buckets[int(k)] = buckets.get(int(k), 0) + adm
        return {
            "redis_cmds_per_s": round((b.redis.commands() - c0) / el, 1),
            "manager_cpu_per_s": round((proc_cpu(a.manager_pid) - m0) / el, 4),
            "redis_cpu_per_s": round((b.redis.cpu() - r0) / el, 4),
            "decision_p50_us": hist_pct_us(hist, 0.5),
            "decision_p99_us": hist_pct_us(hist, 0.99),
            "decisions_per_s": round(sum(r["admitted"] + r["rejected"] for r in reps) / el, 1),
            "admitted": sum(r["admitted"] for r in reps),
            "max_rss_kib": rss,
            "sdk_redis_calls": sum(r["redis_calls"] for r in reps),
            "_buckets": buckets,
        }

    # Hosts: the same total demand (2 × the limit) spread over 1 … 16 simulated hosts.
    b.put_task("scalehosts", {"threshold": b.limit, "slice_ms": 1000, "on_failure": "local"})
    b.wait_tasks(["scalehosts"])
    for h in (1, 2, 4, 8, 16):
        log(f"scale: {h} host(s), total demand {2 * b.limit}/s")
        rate = 2 * b.limit / h
        m = measure(lambda: [loadgen("scalehosts", f"sh{b.run_id}-{h}-{i}", 1, rate)
                             for i in range(h)])
        m["hosts"] = h
        m["admitted_per_slice_vs_limit"] = slices_vs_limit(m.pop("_buckets"), b.limit)
        out["hosts"].append(m)
    # Keys: one host deciding at 20,000/s spread uniformly over K keys of a keyed task.
    b.put_task("scalekeys", {"threshold": 50, "slice_ms": 1000, "keyed": True, "on_failure": "local"})
    b.wait_tasks(["scalekeys"])
    for k in (1, 100, 10_000, 100_000):
        log(f"scale: {k} key(s)")
        slots = max(1024, 1 << (2 * k - 1).bit_length())
        m = measure(lambda: [loadgen("scalekeys", f"sk{b.run_id}-{k}", 1, 20_000,
                                     ("--keys", str(k), "--key-slots", str(slots),
                                      "--key-report", "0", "--workers", "16"))])
        seg = sum(os.path.getsize(os.path.join("/dev/shm", f)) for f in os.listdir("/dev/shm")
                  if f.startswith(f"sluice.{a.namespace}.sk{b.run_id}-{k}"))
        m.pop("_buckets")
        m.update({"keys": k, "key_slots": slots, "segment_bytes": seg})
        out["keys"].append(m)
    # Tasks: N tasks of 1 s slices rolled by the leader (idle: no decisions), 1 … 10,000.
    have = 0
    for n in (1, 100, 1_000, 10_000):
        log(f"scale: {n} task(s) rolled by the leader")
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda i: b.put_task(f"scaletask{i}", {"threshold": 1000 + i % 100,
                                                               "slice_ms": 1000}),
                        range(have, n)))
        have = n
        deadline = time.time() + 600
        while True:
            m = b.metrics()
            if m.get("sluice_horizon_ahead_seconds", 0) >= 59 and m.get("sluice_tasks", 0) >= n:
                break
            if time.time() > deadline:
                sys.exit("bench: the tasks' initial fill did not finish in 10 minutes")
            time.sleep(0.5)
        time.sleep(1)
        c0, m0, w0 = b.redis.commands(), proc_cpu(a.manager_pid), time.time()
        time.sleep(secs)
        el = time.time() - w0
        out["tasks"].append({
            "tasks": n, "redis_cmds_per_s": round((b.redis.commands() - c0) / el, 1),
            "manager_cpu_per_s": round((proc_cpu(a.manager_pid) - m0) / el, 4),
            "redis_used_memory_mib": round(b.redis.used_memory() / 2**20, 1),
        })
        log(f"  {out['tasks'][-1]}")
    log(f"scale curves took {time.time() - t_start:.0f} s")
    return out


def slices_vs_limit(per_slice, limit):
    """Admitted per full slice (1 s buckets, first and last dropped) ÷ limit: min/median/max."""
    full = [per_slice[k] for k in sorted(per_slice)[1:-1]]
    if not full:
        return None
    return {"min": round(min(full) / limit, 4), "median": round(statistics.median(full) / limit, 4),
            "max": round(max(full) / limit, 4), "slices": len(full)}


def anchors(b):
    """Several hosts, shifting demand: 4 hosts, each 1,000/s for 9 s, started 3 s apart, on a
    limit of 2,000 per 1 s slice: total demand 1,000 → 2,000 → 3,000 → 3,000 → 2,000 → 1,000."""
    a = b.a
    b.put_task("anchors", {"threshold": 2000, "slice_ms": 1000, "on_failure": "local"})
    b.wait_tasks(["anchors"])
    t0 = now_ms() + 1500
    ps = []
    for i in range(4):
        host = f"an{b.run_id}-{i}"
        b._cleanup_hosts.append(host)
        cmd = [a.loadgen, "--redis", a.redis, "--namespace", a.namespace, "--task", "anchors",
               "--host-id", host, "--procs", "1", "--duration-ms", "9000", "--rate", "1000",
               "--bucket-ms", "1000", "--start-at-ms", str(t0 + 3000 * i)]
        ps.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                   stderr=open(os.path.join(b.tmp, f"anchors-{i}.log"), "w")))
    log("anchors: 4 hosts, shifting demand, 18 s")
    per = {}
    for p in ps:
        o, _ = wait_rusage(p, time.time() + 200)
        if p.returncode != 0:
            sys.exit(f"bench: anchors run failed; see {b.tmp}")
        for s, (adm, rej) in json.loads(o.strip().splitlines()[-1])["buckets"].items():
            e = per.setdefault(int(s), [0, 0])
            e[0] += adm
            e[1] += rej
    ws = sorted(per)[1:-1]
    rows = []
    for w in ws:
        adm, rej = per[w]
        demand = adm + rej
        rows.append({"start_ms": w, "demand": demand, "admitted": adm,
                     "utilisation": round(adm / max(1, min(demand, 2000)), 4),
                     "of_limit": round(adm / 2000, 4)})
    util = [r["utilisation"] for r in rows]
    return {
        "limit": 2000, "windows": rows,
        "utilisation_mean": round(statistics.mean(util), 4) if util else None,
        "utilisation_min": min(util) if util else None,
        "overshoot_max": max(r["of_limit"] for r in rows) if rows else None,
        "over_windows": sum(1 for r in rows if r["admitted"] > 2000),
    }


# ---------------------------------------------------------------- the keys grid (issue 26)

# Per-key limits side by side with the per-request fixed window (envoyproxy/ratelimit's design,
# peer_redis --algo fixed-window --keys K), on the grid of issue 26.
KEYS_GRID = {"full": {"keys": (1, 100, 10_000, 100_000, 1_000_000), "demand": (0.1, 1, 3),
                      "hosts": (1, 2), "slice_s": (1, 60)},
             "quick": {"keys": (100, 10_000), "demand": (1,), "hosts": (1,), "slice_s": (1,)}}
KEYS_PROCS = 2           # processes per host (one loadgen --procs 2; 2 peer processes)
KEYS_LEAD_MS = 1500      # processes start this long before the common start


def keys_grid_of(mode, spec):
    """The mode's grid with the dimensions named in `spec` (`--keys-grid`) replaced: words
    `name=v,v,…` for keys, demand, hosts, slice (seconds). Raises ValueError with the word."""
    grid = dict(KEYS_GRID[mode])
    names = {"keys": ("keys", int), "demand": ("demand", float), "hosts": ("hosts", int),
             "slice": ("slice_s", int)}
    for word in spec.replace(";", " ").split():
        name, _, vals = word.partition("=")
        if name not in names or not vals:
            raise ValueError(f"--keys-grid: {word!r} is not one of {', '.join(names)}=v,v,…")
        key, conv = names[name]
        try:
            vs = tuple(conv(v) for v in vals.split(","))
        except ValueError:
            raise ValueError(f"--keys-grid: {word!r} has a value that is not a number") from None
        if any(v <= 0 for v in vs):
            raise ValueError(f"--keys-grid: {word!r}: values must be positive")
        grid[key] = vs
    return grid


def key_slots_cap(a):
    """The SDK's largest key table (`MAX_KEY_SLOTS`): --key-slots-cap, else read from the
    source the binaries were built from (the constant may change), else 262,144."""
    if a.key_slots_cap:
        return a.key_slots_cap
    try:
        with open(os.path.join(os.path.dirname(__file__), "../../worker-sdk/src/keytable.rs")) as f:
            m = re.search(r"pub const MAX_KEY_SLOTS: u32 = ([\d_]+);", f.read())
        if m:
            return int(m.group(1).replace("_", ""))
    except OSError:
        pass
    return 262_144


def key_points(grid, rate):
    """The grid's points. Per host the decisions come at a fixed total `rate`/s, uniformly over
    the keys, so a key's demand per slice is rate·hosts·slice/keys; its limit L per slice is
    chosen to make that the nominal multiple of L. L ≥ 1: where the nominal demand would need
    L < 1, L = 1 and the demand actually reached is recorded (`clamped`). Nominal demands that
    come out as the same workload (same keys, hosts, slice and L: only where L is clamped for
    one of them) are one point, run once (`demands` lists them; `clamped` if any was)."""
    out, seen = [], {}
    for slice_s in grid["slice_s"]:
        for hosts in grid["hosts"]:
            for keys in grid["keys"]:
                for demand in grid["demand"]:
                    per_key = rate * hosts * slice_s / keys
                    raw = per_key / demand
                    limit = max(1, round(raw))
                    same = seen.get((keys, hosts, slice_s, limit))
                    if same:
                        same["demands"].append(demand)
                        same["clamped"] = same["clamped"] or raw < 1
                        continue
                    pt = {
                        "keys": keys, "demand": demand, "demands": [demand], "hosts": hosts,
                        "slice_s": slice_s, "limit": limit,
                        "actual_demand": round(per_key / limit, 4), "clamped": raw < 1,
                        "decisions_per_key_slice_host": round(rate * slice_s / keys, 4),
                    }
                    seen[(keys, hosts, slice_s, limit)] = pt
                    out.append(pt)
    return out


def key_accuracy(reports, limit, slice_ms):
    """Per reported key and slice, summed over every process of every host: slices that
    admitted more than the limit (all slices, partial ones included), and the utilisation
    admitted ÷ limit of the FULL slices (inside every report's run) where the key's demand
    reached its limit. Keys are `k<i>` (peer_redis) or `key-<i>` (loadgen): merged by i."""
    per = {}
    first_full, last_end = None, None
    for r in reports:
        starts = [int(s) for s in r["buckets"]]
        if starts:
            lo, hi = min(starts) + slice_ms, max(starts)
            first_full = lo if first_full is None else max(first_full, lo)
            last_end = hi if last_end is None else min(last_end, hi)
        for k, slices in r.get("keys", {}).items():
            i = int(re.sub(r"^(key-|k)", "", k))
            for s, (ok, over) in slices.items():
                e = per.setdefault((i, int(s)), [0, 0])
                e[0] += ok
                e[1] += over
    over = [(k, v[0]) for k, v in per.items() if v[0] > limit]
    full = [v for (_, s), v in per.items()
            if first_full is not None and s >= first_full and s + slice_ms <= last_end]
    util = sorted(v[0] / limit for v in full if v[0] + v[1] >= limit)
    # Every full key-slice, demand below L included: admitted ÷ what an exact limiter admits.
    servable = sum(min(v[0] + v[1], limit) for v in full)
    return {
        "key_slices": len(per), "decisions": sum(v[0] + v[1] for v in per.values()),
        "over_slices": len(over), "over_permits": sum(n - limit for _, n in over),
        "served": round(sum(v[0] for v in full) / servable, 4) if servable else None,
        "full_slices": 0 if first_full is None else max(0, (last_end - first_full) // slice_ms),
        "util_key_slices": len(util),
        "util_min": round(util[0], 4) if util else None,
        "util_median": round(statistics.median(util), 4) if util else None,
        "util_mean": round(statistics.mean(util), 4) if util else None,
        "util_ge_95": round(sum(1 for u in util if u >= 0.95) / len(util), 4) if util else None,
    }


def keys_grid(b):
    a = b.a
    grid = keys_grid_of(a.mode, a.keys_grid)
    rate, secs, workers = a.keys_rate, a.keys_seconds, a.keys_workers
    cap = key_slots_cap(a)
    points = key_points(grid, rate)
    out = {"rate_per_host": rate, "seconds_per_run": secs, "procs_per_host": KEYS_PROCS,
           "grid_subset": a.keys_grid,
           "workers_per_proc": workers, "key_slots_cap": cap, "reported_keys": a.keys_reported,
           "caller_pulls": bool(a.keys_caller_pulls), "peer_grain_ms": a.keys_peer_grain_ms,
           "grid": {k: list(v) for k, v in grid.items()}, "points": []}
    # The background now (the runs before left tasks behind), to take off the peer's counts.
    c0, w0 = b.redis.commands(), time.time()
    time.sleep(2)
    idle = (b.redis.commands() - c0) / (time.time() - w0)
    out["idle_redis_commands_per_s"] = round(idle, 1)
    t_start = time.time()
    for n, pt in enumerate(points):
        done = time.time() - t_start
        eta = f", ~{done / n * (len(points) - n):.0f} s left" if n else ""
        log(f"keys {n + 1}/{len(points)}: {pt['keys']:,} keys × {pt['demand']}× demand, "
            f"{pt['hosts']} host(s), {pt['slice_s']} s slices: L = {pt['limit']:,}"
            f"{' (clamped: demand ' + str(pt['actual_demand']) + '×)' if pt['clamped'] else ''}"
            f" ({done:.0f} s elapsed{eta})")
        slots = min(cap, max(1024, 1 << (2 * pt["keys"] - 1).bit_length()))
        # The machine's load as the point starts (anything else running skews a 2-core box).
        pt.update({"key_slots": slots, "keys_exceed_table": pt["keys"] > slots,
                   "load_1m": round(os.getloadavg()[0], 2)})
        task = f"kg{b.run_id}-{n}"
        # The point's own keyed task, ready before either run (its first fill is in neither).
        b.put_task(task, {"threshold": pt["limit"], "slice_ms": pt["slice_s"] * 1000,
                          "keyed": True, "on_failure": "local"})
        b.wait_tasks([task])
        prefix = f"kgpr{b.run_id}-{n}"
        pt["per_request"] = key_run(b, pt, "per-request", prefix, slots, workers, secs, idle)
        b.redis.unlink_matching(prefix + ":*")
        pt["sluice"] = key_run(b, pt, "sluice", task, slots, workers, secs, idle)
        b.delete_task(task)
        b.redis.unlink_matching(f"{a.namespace}:{{{task}}}:k:*")
        out["points"].append(pt)
    out["elapsed_s"] = round(time.time() - t_start, 1)
    log(f"keys grid: {len(points)} points in {out['elapsed_s']:.0f} s")
    return out


def key_run(b, pt, design, name, slots, workers, secs, idle):
    """One design at one point: its processes, started together, measured as run_case does."""
    a = b.a
    dur = int(secs * 1000)
    slice_ms = pt["slice_s"] * 1000
    t0 = now_ms() + KEYS_LEAD_MS
    per_proc = a.keys_rate / KEYS_PROCS
    report = min(pt["keys"], a.keys_reported)
    ps, hosts = [], []
    for h in range(pt["hosts"]):
        if design == "sluice":
            host = f"{name}-h{h}"
            hosts.append(host)
            cmd = [a.loadgen, "--redis", a.redis, "--namespace", a.namespace, "--task", name,
                   "--host-id", host, "--procs", str(KEYS_PROCS), "--duration-ms", str(dur),
                   "--rate", str(per_proc), "--bucket-ms", str(slice_ms), "--start-at-ms", str(t0),
                   "--keys", str(pt["keys"]), "--key-slots", str(slots),
                   "--workers", str(workers), "--key-report", str(report),
                   "--caller-pulls", "true" if a.keys_caller_pulls else "false"]
            ps.append((host, cmd, parse_loadgen))
        else:
            for i in range(KEYS_PROCS):
                proc = h * KEYS_PROCS + i
                cmd = [a.peer_redis, "--algo", "fixed-window", "--redis", a.redis, "--key", name,
                       "--limit", str(pt["limit"]), "--window-ms", str(slice_ms),
                       "--duration-ms", str(dur), "--start-at-ms", str(t0),
                       "--rate", str(per_proc), "--bucket-ms", str(slice_ms),
                       "--proc", str(proc), "--keys", str(pt["keys"]),
                       "--key-report", str(report)]
                if a.keys_peer_grain_ms:
                    cmd += ["--grain-ms", str(a.keys_peer_grain_ms)]
                ps.append((f"{name}-p{proc}", cmd, parse_peer))
    mem0 = b.redis.used_memory()
    peak = [mem0]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.5):
            try:
                peak[0] = max(peak[0], b.redis.used_memory())
            except Exception:
                pass

    c0, r0, m0, w0 = b.redis.commands(), b.redis.cpu(), proc_cpu(a.manager_pid), time.time()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    running = []
    for tag, cmd, parse in ps:
        err = open(os.path.join(b.tmp, f"keys-{tag}.log"), "w")
        running.append((tag, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err), parse))
    reports, raw = [], []
    deadline = time.time() + KEYS_LEAD_MS / 1000 + secs + 300
    try:
        for tag, p, parse in running:
            o, _ = wait_rusage(p, deadline)
            if p.returncode != 0:
                sys.exit(f"bench: keys {design} {tag} exited {p.returncode}; see {b.tmp}")
            j = json.loads(o.strip().splitlines()[-1])
            raw.append(j)
            reports.append(parse(j))
    finally:
        stop.set()
        sampler.join(5)
        for host in hosts:
            b.remove_segments(host)
    elapsed = time.time() - w0
    cmds = b.redis.commands() - c0
    rcpu, mcpu = b.redis.cpu() - r0, proc_cpu(a.manager_pid) - m0
    mem1 = b.redis.used_memory()
    peak[0] = max(peak[0], mem1)
    if design != "sluice":
        cmds = max(0, cmds - round(idle * elapsed))
    decisions = sum(r["decisions"] for r in reports)
    hist = {}
    for r in reports:
        hist_merge(hist, r.get("lat_hist", {}))
    seconds = statistics.median([r["seconds"] for r in reports])
    # Keys that had at least one decision (expected; uniform choice): each holds Redis state.
    active = pt["keys"] * (1 - math.exp(-decisions / pt["keys"]))
    res = {
        "decisions": decisions, "ok": sum(r["ok"] for r in reports),
        "over_limit": sum(r["over_limit"] for r in reports),
        "errors": sum(r.get("errors", 0) for r in reports),
        "decisions_per_s": round(decisions / max(seconds, 1e-9), 1),
        "admitted_fraction": round(sum(r["ok"] for r in reports) / max(decisions, 1), 4),
        "p50_us": hist_pct_us(hist, 0.50), "p99_us": hist_pct_us(hist, 0.99),
        # The tail's shape (extra; the goals judge p50 and p99).
        "p90_us": hist_pct_us(hist, 0.90), "p95_us": hist_pct_us(hist, 0.95),
        "p98_us": hist_pct_us(hist, 0.98), "p999_us": hist_pct_us(hist, 0.999),
        "redis_commands": cmds,
        "redis_commands_per_decision": round(cmds / max(decisions, 1), 5),
        "redis_cpu_us_per_decision": round(rcpu * 1e6 / max(decisions, 1), 3),
        "sdk_redis_calls": sum(r.get("redis_calls", 0) for r in reports) if design == "sluice" else None,
        "manager_cpu_percent": round(100 * mcpu / max(elapsed, 1e-9), 2),
        "redis_memory_delta_bytes": mem1 - mem0,
        "redis_memory_peak_delta_bytes": peak[0] - mem0,
        "active_keys": round(active),
        "redis_memory_per_active_key_bytes": round((peak[0] - mem0) / max(active, 1), 1),
        "accuracy": key_accuracy(raw, pt["limit"], slice_ms),
        # Every key, per slice, summed over the processes: [admitted, rejected].
        "slices": {s: [sum(r["buckets"].get(s, (0, 0))[i] for r in reports) for i in (0, 1)]
                   for s in sorted({s for r in reports for s in r["buckets"]})},
    }
    if res["sdk_redis_calls"] is not None:
        res["sdk_redis_calls_per_decision"] = round(res["sdk_redis_calls"] / max(decisions, 1), 5)
    acc = res["accuracy"]
    log(f"  {design:11} {res['decisions_per_s']:>9,.0f}/s p50 {res['p50_us']} µs p99 "
        f"{res['p99_us']} µs cmds/dec {res['redis_commands_per_decision']} over {acc['over_slices']}"
        f" util {acc['util_median']} (p90/95/98/99.9 {res['p90_us']:.3g}/{res['p95_us']:.3g}/"
        f"{res['p98_us']:.3g}/{res['p999_us']:.3g} µs)")
    return res


def criterion(b):
    log("criterion: cargo bench -p sluice-sdk --bench decide (release)")
    p = subprocess.run(["cargo", "bench", "-q", "-p", "sluice", "--bench", "decide", "--",
                        "--noplot"], capture_output=True, text=True, timeout=1800)
    res, name = {}, None
    for line in p.stdout.splitlines():
        m = re.match(r"^(\S+/\S+)\s*(time:.*)?$", line.strip())
        if m and "/" in m.group(1) and not m.group(1).startswith("time"):
            name = m.group(1)
        t = re.search(r"time:\s*\[\s*([\d.]+) (\w+)\s+([\d.]+) (\w+)\s+([\d.]+) (\w+)\]", line)
        if t and name:
            unit = {"ps": 1e-3, "ns": 1, "µs": 1e3, "us": 1e3, "ms": 1e6}[t.group(4)]
            res[name] = {"time_ns": round(float(t.group(3)) * unit, 3)}
        th = re.search(r"thrpt:\s*\[\s*[\d.]+ \S+\s+([\d.]+) (\w)?elem/s", line)
        if th and name:
            mult = {"K": 1e3, "M": 1e6, "G": 1e9, None: 1}[th.group(2)]
            res.setdefault(name, {})["elem_per_s"] = float(th.group(1)) * mult
    if p.returncode != 0:
        log(f"criterion failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return res


def machine():
    def cmd(*c):
        try:
            return subprocess.run(c, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return None
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) // 1024
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_mib": mem, "kernel": platform.release(),
        "os": cmd("sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"),
        "redis": cmd("redis-server", "--version"), "node": cmd("node", "--version"),
        "python": platform.python_version(), "rustc": cmd("rustc", "--version"),
        "load_before": os.getloadavg(),
        "source": source(),
    }


def source():
    """The commit the binaries were built from, and the files then changed but not committed
    (a run on a working tree says so)."""
    def git(*c):
        try:
            return subprocess.run(["git", *c], capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout
        except Exception:
            return ""
    return {"commit": git("rev-parse", "--short=12", "HEAD").strip() or None,
            "uncommitted": [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()]}


def main():
    ap = argparse.ArgumentParser()
    for f in ("mode", "profile", "redis", "namespace", "manager-url", "loadgen", "peer-redis",
              "rls-load", "node-peer", "py-peer", "out", "tmp", "command"):
        ap.add_argument(f"--{f}", required=True)
    for f in ("redis-port", "redis-pid", "manager-pid", "limit", "hosts", "procs"):
        ap.add_argument(f"--{f}", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--agent", action="append", default=[], help="pid,grpc url,http url,host")
    ap.add_argument("--peers", default="")
    ap.add_argument("--sections", default="",
                    help="comma list of " + ", ".join(SECTIONS) + " (default: all in full mode, "
                    "peers and keys in quick mode)")
    ap.add_argument("--keys-rate", type=float, default=5000.0,
                    help="keys grid: decisions per second per host (paced)")
    ap.add_argument("--keys-seconds", type=float, default=5.0, help="keys grid: seconds per run")
    ap.add_argument("--keys-workers", type=int, default=16,
                    help="keys grid: loadgen --workers (concurrent decision loops per process)")
    ap.add_argument("--keys-reported", type=int, default=1000,
                    help="keys grid: keys 0 … N-1 have their counts per slice reported (accuracy)")
    ap.add_argument("--keys-caller-pulls", type=int, choices=(0, 1), default=0,
                    help="keys grid: 1 = loadgen --caller-pulls true (Config::caller_pulls)")
    ap.add_argument("--keys-peer-grain-ms", type=int, default=0,
                    help="keys grid: peer_redis --grain-ms (its due times on a timer of this grain, "
                         "as loadgen's Tokio timer; 0 = precise pacing)")
    ap.add_argument("--keys-grid", default="",
                    help="keys grid: a subset instead of the mode's grid, e.g. "
                         "'keys=100,10000 demand=1 hosts=1,2 slice=1' (unnamed dimensions: the mode's)")
    ap.add_argument("--key-slots-cap", type=int, default=0,
                    help="keys grid: the SDK's MAX_KEY_SLOTS (0: read from worker-sdk/src/keytable.rs)")
    a = ap.parse_args()
    sections = [x for x in a.sections.split(",") if x] or (
        list(SECTIONS) if a.mode == "full" else ["peers", "keys"])
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    if a.mode == "full" and os.environ.get("SLUICE_BENCH_SKIP_CRITERION") and "criterion" in sections:
        sections.remove("criterion")
    try:
        keys_grid_of(a.mode, a.keys_grid)
    except ValueError as e:
        ap.error(str(e))
    if not (a.keys_rate > 0 and a.keys_seconds > 0 and a.keys_workers > 0 and a.keys_reported > 0):
        ap.error("--keys-rate, --keys-seconds, --keys-workers and --keys-reported must be positive")
    b = Bench(a)
    started = time.time()
    result = {
        "format": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": a.mode, "profile": a.profile, "command": a.command, "machine": machine(),
        "sections": sections,
        "limit_per_s": a.limit, "window_ms": WINDOW_MS, "bucket_ms": BUCKET_MS,
        "hosts": a.hosts, "processes_per_host": a.procs, "seconds_per_run": a.seconds,
    }
    if "peers" in sections:
        b.put_task("benchpooled", {"threshold": a.limit, "slice_ms": 1000, "on_failure": "local"})
        b.put_task("benchkeyed", {"threshold": a.limit, "slice_ms": 1000, "keyed": True,
                                  "on_failure": "local"})
        b.wait_tasks(["benchpooled", "benchkeyed"])
    # The background of Sluice's own processes on Redis, to take off the peers' counts.
    c0, w0 = b.redis.commands(), time.time()
    time.sleep(2)
    b.idle_cmds_per_s = (b.redis.commands() - c0) / (time.time() - w0)
    result["idle_redis_commands_per_s"] = round(b.idle_cmds_per_s, 1)
    log(f"idle background: {b.idle_cmds_per_s:.1f} Redis commands/s; sections: {', '.join(sections)}")
    peers = [("sluice-sdk-pooled", "benchpooled"), ("sluice-sdk-keyed", "benchkeyed"),
             ("sluice-agent-grpc", "benchpooled"), ("sluice-agent-http", "benchpooled"),
             ("redis-fixed-window-lua", None), ("redis-sliding-log-zset", None),
             ("rate-limiter-flexible", None), ("limits", None)]
    if a.peers:
        keep = set(a.peers.split(","))
        peers = [p for p in peers if p[0] in keep]
    cases = []
    try:
        if "peers" in sections:
            for peer, task in peers:
                for demand in ("over", "steady"):
                    cases.append(b.run_case(peer, demand, task))
            result["cases"] = cases
        if "anchors" in sections:
            result["anchors"] = anchors(b)
        # The keys grid before the scale curves: those leave 10,000 tasks for the leader to roll.
        if "keys" in sections:
            result["keys"] = keys_grid(b)
        if "scale" in sections:
            result["scale"] = scale_curves(b)
        if "criterion" in sections:
            result["criterion"] = criterion(b)
    finally:
        for h in b._cleanup_hosts:
            b.remove_segments(h)
    result["elapsed_s"] = round(time.time() - started, 1)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, a.out)
    shutil.copyfile(a.out, os.path.join(os.path.dirname(a.out), "latest.json"))
    log(f"wrote {a.out} ({result['elapsed_s']} s)")


if __name__ == "__main__":
    main()
