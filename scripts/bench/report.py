#!/usr/bin/env python3
"""Renders one result of scripts/bench.sh (JSON) into markdown and SVG plots.

  report.py RESULT.json --doc docs/benchmarks.md --svg-dir docs/img [--check]

The markdown replaces what lies between the markers `<!-- bench:peers:begin -->` and
`<!-- bench:peers:end -->` (the side-by-side run: `cases`, and in full mode the anchors, scale
curves and criterion) and between `<!-- bench:keys:begin -->` and `<!-- bench:keys:end -->`
(the keys grid of issue 26: `keys`) in --doc, each only when the JSON has its section (a run
of the keys grid alone leaves the side-by-side section as it was); the rest of the file is
kept. A --doc without a section's markers is refused (an empty or missing one gets the
sections alone). The SVGs (bench-throughput.svg, bench-p99.svg, bench-accuracy.svg, in full
mode bench-scale-*.svg, and with the keys grid bench-keys-*.svg) are drawn here from the JSON,
with nothing but the standard library. --check: fail (exit 1, naming what) unless every
section the run lists (`sections`) is there: every limiter at both demands with decisions,
latencies and at least one full window; every point of the keys grid with both designs,
decisions, latencies, no errors and its accuracy.
"""

import argparse
import html
import json
import math
import os
import sys

BEGIN, END = "<!-- bench:peers:begin -->", "<!-- bench:peers:end -->"
KBEGIN, KEND = "<!-- bench:keys:begin -->", "<!-- bench:keys:end -->"
KDESIGNS = (("sluice", "Sluice"), ("per_request", "per-request"))
PEERS = [
    ("sluice-sdk-pooled", "Sluice in-process, pooled (SDK)"),
    ("sluice-sdk-keyed", "Sluice in-process, keyed (SDK, one key)"),
    ("sluice-agent-grpc", "Sluice agent, gRPC (Envoy RLS)"),
    ("sluice-agent-http", "Sluice agent, HTTP (`/v1/decide`)"),
    ("redis-fixed-window-lua", "Redis fixed window, INCR+EXPIRE Lua (seed article)"),
    ("redis-sliding-log-zset", "Redis sliding log, ZSET Lua (seed article)"),
    ("rate-limiter-flexible", "rate-limiter-flexible (Node.js, RateLimiterRedis)"),
    ("limits", "limits (Python, moving window)"),
]
COLORS = {"sluice": "#1f77b4", "peer": "#d62728"}


def fmt(x, digits=0):
    if x is None:
        return "–"
    if digits == 0:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def sig(x):
    """A number with 3 significant digits, thousands separated."""
    if x is None:
        return "–"
    if x == 0:
        return "0"
    d = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:,.{d}f}"


# ---------------------------------------------------------------- SVG

def bar_chart(title, rows, unit, log=True, width=760):
    """Horizontal bars: rows = [(label, value, kind)]."""
    rows = [r for r in rows if r[1] is not None and r[1] > 0]
    h = 40 + 26 * len(rows) + 30
    left, right = 330, width - 90
    vals = [r[1] for r in rows] or [1]
    if log:
        lo = 10 ** math.floor(math.log10(min(vals)))
        hi = 10 ** math.ceil(math.log10(max(vals)))
        if hi <= lo:
            hi = lo * 10

        def x(v):
            return left + (right - left) * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        ticks = [10 ** e for e in range(int(math.log10(lo)), int(math.log10(hi)) + 1)]
    else:
        lo, hi = 0, max(vals) * 1.1

        def x(v):
            return left + (right - left) * v / hi
        ticks = [hi * i / 5 for i in range(6)]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">{html.escape(title)}</text>']
    for t in ticks:
        tx = x(t)
        out.append(f'<line x1="{tx:.1f}" y1="30" x2="{tx:.1f}" y2="{h - 28}" stroke="#ddd"/>')
        out.append(f'<text x="{tx:.1f}" y="{h - 12}" text-anchor="middle" fill="#555">{sig(t)}</text>')
    for i, (label, v, kind) in enumerate(rows):
        y = 36 + 26 * i
        out.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{html.escape(label)}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{max(1, x(v) - left):.1f}" height="18" '
                   f'fill="{COLORS[kind]}"/>')
        out.append(f'<text x="{x(v) + 4:.1f}" y="{y + 14}">{sig(v)} {html.escape(unit)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def range_chart(title, rows, width=760):
    """Accuracy per window: rows = [(label, min, median, max, kind)], as a fraction of the
    limit; a line at 1.0."""
    rows = [r for r in rows if r[1] is not None]
    h = 40 + 26 * len(rows) + 30
    left, right = 330, width - 90
    hi = max([1.2] + [r[3] for r in rows])
    lo = min([0.8] + [r[1] for r in rows])

    def x(v):
        return left + (right - left) * (v - lo) / (hi - lo)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">{html.escape(title)}</text>']
    steps = 6
    for i in range(steps + 1):
        t = lo + (hi - lo) * i / steps
        out.append(f'<line x1="{x(t):.1f}" y1="30" x2="{x(t):.1f}" y2="{h - 28}" stroke="#eee"/>')
        out.append(f'<text x="{x(t):.1f}" y="{h - 12}" text-anchor="middle" fill="#555">{t:.2f}</text>')
    out.append(f'<line x1="{x(1):.1f}" y1="30" x2="{x(1):.1f}" y2="{h - 28}" stroke="#333" '
               f'stroke-dasharray="4 3"/>')
    for i, (label, mn, md, mx, kind) in enumerate(rows):
        y = 36 + 26 * i + 9
        out.append(f'<text x="{left - 6}" y="{y + 5}" text-anchor="end">{html.escape(label)}</text>')
        out.append(f'<line x1="{x(mn):.1f}" y1="{y}" x2="{x(mx):.1f}" y2="{y}" stroke="{COLORS[kind]}" '
                   f'stroke-width="4"/>')
        out.append(f'<circle cx="{x(md):.1f}" cy="{y}" r="5" fill="{COLORS[kind]}"/>')
        out.append(f'<text x="{x(mx) + 6:.1f}" y="{y + 5}">{mn:.3f} / {md:.3f} / {mx:.3f}</text>')
    out.append("</svg>")
    return "\n".join(out)


def line_chart(title, xs_label, series, ylabel, width=560, logx=True, logy=False):
    """series = [(name, [(x, y)])]."""
    h, left, right, top, bottom = 300, 70, width - 20, 30, 250
    pts = [p for _, s in series for p in s if p[1] is not None and p[1] > 0]
    if not pts:
        return None
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    fx = (lambda v: math.log10(v)) if logx else (lambda v: v)
    fy = (lambda v: math.log10(v)) if logy else (lambda v: v)
    x0, x1 = fx(min(xs)), fx(max(xs))
    y0, y1 = (fy(min(ys)), fy(max(ys))) if logy else (0, max(ys) * 1.15)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1

    def X(v):
        return left + (right - left) * (fx(v) - x0) / (x1 - x0)

    def Y(v):
        return bottom - (bottom - top) * (fy(v) - y0) / (y1 - y0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">{html.escape(title)}</text>',
           f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>',
           f'<text x="{(left + right) / 2}" y="{h - 10}" text-anchor="middle">{html.escape(xs_label)}</text>',
           f'<text x="14" y="{(top + bottom) / 2}" transform="rotate(-90 14 {(top + bottom) / 2})" '
           f'text-anchor="middle">{html.escape(ylabel)}</text>']
    for v in sorted(set(xs)):
        out.append(f'<text x="{X(v):.1f}" y="{bottom + 16}" text-anchor="middle" fill="#555">{sig(v)}</text>')
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        val = 10 ** yv if logy else yv
        yy = bottom - (bottom - top) * i / 4
        out.append(f'<text x="{left - 4}" y="{yy + 4:.1f}" text-anchor="end" fill="#555">{sig(val)}</text>')
        out.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{right}" y2="{yy:.1f}" stroke="#eee"/>')
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for si, (name, s) in enumerate(series):
        s = [p for p in s if p[1] is not None and p[1] > 0]
        c = palette[si % len(palette)]
        if len(s) > 1:
            d = " ".join(f"{X(a):.1f},{Y(b):.1f}" for a, b in s)
            out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"/>')
        for a, b in s:
            out.append(f'<circle cx="{X(a):.1f}" cy="{Y(b):.1f}" r="3" fill="{c}"/>')
        out.append(f'<text x="{right - 4}" y="{top + 14 + 14 * si}" text-anchor="end" fill="{c}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------- markdown

def case(r, peer, demand):
    return next((c for c in r.get("cases", []) if c["peer"] == peer and c["demand"] == demand), None)


def goals(r):
    """The issue's goals, evaluated on this run's numbers."""
    sluice = [p for p, _ in PEERS if p.startswith("sluice-sdk")]
    per_req = [p for p, _ in PEERS if not p.startswith("sluice")]
    over = {p: case(r, p, "over") for p, _ in PEERS}
    best = max((over[p] for p in per_req if over[p]), key=lambda c: c["decisions_per_s"], default=None)
    best_p99 = min((over[p]["p99_us"] for p in per_req if over[p] and over[p]["p99_us"]), default=None)
    s = over.get("sluice-sdk-pooled")
    out = []
    if s and best:
        ratio = s["decisions_per_s"] / max(best["decisions_per_s"], 1e-9)
        out.append(("decisions/s ≥ 200× the best per-request peer "
                    f"({best['peer']}: {sig(best['decisions_per_s'])}/s)",
                    f"{sig(ratio)}×", ratio >= 200))
    if s and best_p99 and s["p99_us"]:
        ratio = s["p99_us"] / best_p99
        out.append(("p99 ≤ 1/100 of the best per-request peer's", f"{ratio:.4f} (1/{sig(1 / ratio)})",
                    ratio <= 0.01))
    for p in sluice:
        c = over.get(p)
        if c and c["accuracy"].get("windows"):
            out.append((f"{p}: ≥ 98 % utilisation under demand above the limit (median window)",
                        f"{c['accuracy']['median'] * 100:.1f} %", c["accuracy"]["median"] >= 0.98))
            out.append((f"{p}: zero over-admission (windows above the limit)",
                        f"{c['accuracy']['over_windows']}", c["accuracy"]["over_windows"] == 0))
    cr = r.get("criterion") or {}
    a = cr.get("decide/allowed", {}).get("time_ns")
    b = cr.get("decide/allowed_precise_clock", {}).get("time_ns")
    if a:
        out.append(("fast path ≤ 15 ns (`decide/allowed`; before, the precise clock: "
                    f"`decide/allowed_precise_clock` {sig(b)} ns, same run)", f"{sig(a)} ns", a <= 15))
    h4 = cr.get("host/4", {}).get("elem_per_s")
    h4p = cr.get("host/4_precise_clock", {}).get("elem_per_s")
    if h4:
        before = f"; before: {sig(1e9 / h4p)} ns" if h4p else ""
        out.append((f"≤ 30 ns per decision with 4 processes on one quota (`host/4`{before})",
                    f"{sig(1e9 / h4)} ns", 1e9 / h4 <= 30))
    s = over.get("sluice-sdk-pooled")
    if s and s.get("sdk_redis_calls_per_admitted") is not None:
        out.append(("≤ 0.01 Redis calls per admitted decision (2 hosts, demand far above the limit)",
                    f"{s['sdk_redis_calls_per_admitted']:.4f}", s["sdk_redis_calls_per_admitted"] <= 0.01))
    return out


def render(r, svg_rel):
    m = r["machine"]
    L = r["limit_per_s"]
    lines = [BEGIN, "",
             "<!-- Generated by scripts/bench/report.py from the JSON of one run of "
             "scripts/bench.sh: edit the script, not this section. -->", "",
             "## Side by side with the limiters users pick instead", "",
             f"One run of `{r['command']}` on {r['date'][:10]} ({r['mode']} mode, {r['profile']} build"
             f", {r['elapsed_s']:.0f} s in all), every limiter against the same Redis one after the other, "
             f"{r['hosts']} hosts × {r['processes_per_host']} processes each (one decision in flight "
             f"per process), limit **{L:,} per {r['window_ms'] // 1000} s**, {r['seconds_per_run']:g} s per run. "
             "Demand *over*: every process as fast as it can; *steady*: paced to 90 % of the limit in total. "
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_mib'] // 1024} GiB, {m['os']}, "
             f"kernel {m['kernel']}; {m['redis']}; Node.js {m['node']}; Python {m['python']}; "
             f"{m['rustc']}. Load average before: {', '.join(f'{x:.2f}' for x in m['load_before'])}.", "",
             "What the columns mean: *Redis cmds/decision* is the `INFO commandstats` delta (all commands, "
             "those inside scripts included, `INFO` excluded) over the run ÷ decisions; for the peers the idle "
             f"background of Sluice's own processes ({r['idle_redis_commands_per_s']:.1f} commands/s, measured "
             "first) is subtracted, for Sluice the manager's and agents' commands are counted in. "
             "*CPU s / M* is CPU seconds per million decisions: the limiter's processes (the client "
             "processes for in-process limiters; for the agent the agents, their load client not counted) and "
             "Redis, separately; *manager* is the Sluice manager's CPU over the run (% of one core: the leader's "
             "roll, a fixed cost per task whatever the traffic). *Accuracy* is admitted ÷ limit "
             "per full aligned 1 s window (min / median / max), windows above the limit, and the most "
             "admitted in any 1 s span (100 ms steps) ÷ limit. Latency is per decision, from just before "
             "the call to its answer, merged over every process (log histogram, ±2 %); Sluice in-process "
             "times one decision in 64, the cost of the timing itself subtracted.", ""]
    lines += ["| limiter | demand | decisions/s | p50 µs | p99 µs | Redis cmds/decision | CPU s / M (limiter, Redis) | manager | admitted % | accuracy min / median / max | windows over (permits) | max any 1 s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, label in PEERS:
        for d in ("over", "steady"):
            c = case(r, p, d)
            if not c:
                continue
            a = c["accuracy"]
            acc = f"{a['min']:.3f} / {a['median']:.3f} / {a['max']:.3f}" if a.get("windows") else "–"
            over = f"{a['over_windows']} ({a['over_permits']:,})" if a.get("windows") else "–"
            mgr = f"{c['manager_cpu_percent']:.1f} %" if p.startswith("sluice") else "–"
            lines.append(f"| {label} | {d} | {sig(c['decisions_per_s'])} | {sig(c['p50_us'])} | {sig(c['p99_us'])} | "
                         f"{c['redis_commands_per_decision']:.4f} | {sig(c['cpu_limiter_s_per_million'])}, "
                         f"{sig(c['cpu_redis_s_per_million'])} | {mgr} | {c['admitted_fraction'] * 100:.1f} % | {acc} | "
                         f"{over} | {a.get('max_any_1s_span', 0):.3f} |")
    lines += ["", "Errors: " + (", ".join(f"{c['peer']}/{c['demand']}: {c['errors']} ({c['first_error']})"
                                          for c in r["cases"] if c["errors"]) or "none") + ".", ""]
    st = [c for c in r["cases"] if c["demand"] == "steady" and c["over_limit"]]
    if st:
        lines += ["Rejections under steady demand (below the limit), and how many fell outside the full windows "
                  "(in the first or last partial window of the run): " +
                  "; ".join(f"{c['peer']} {c['over_limit']:,} ({c['accuracy'].get('rejected_outside_full_windows', 0):,} outside)"
                            for c in st) + ".", ""]
    sdk = [c for c in r["cases"] if c.get("sdk_redis_calls_per_admitted") is not None]
    if sdk:
        lines += ["SDK round trips to Redis per admitted decision (the SDK's own count): " +
                  "; ".join(f"{c['peer']}/{c['demand']} {c['sdk_redis_calls_per_admitted']:.4f}" for c in sdk) + ".", ""]
    lines += [f"![decisions/s]({svg_rel}/bench-throughput.svg)", "",
              f"![p99 latency]({svg_rel}/bench-p99.svg)", "",
              f"![accuracy per window]({svg_rel}/bench-accuracy.svg)", ""]
    g = goals(r)
    if g:
        lines += ["### The goals, on this run", "", "| goal | this run | met |", "|---|---|---|"]
        lines += [f"| {n} | {v} | {'✓' if ok else '✗'} |" for n, v, ok in g]
        lines.append("")
    an = r.get("anchors")
    if an:
        lines += ["### Accuracy against the published figures", "",
                  "The anchors' kind of workload: 4 hosts, each asking 1,000/s for 9 s, started 3 s apart, "
                  f"on one limit of {an['limit']:,} per 1 s slice — total demand 1,000 → 2,000 → 3,000 → 2,000 → "
                  "1,000/s, the hosts' shares shifting every 3 s. Utilisation = admitted ÷ min(demand, limit) "
                  "per full window; overshoot = admitted ÷ limit.", "",
                  "| system | figure | source |", "|---|---|---|",
                  "| Doorman (simulation) | 96.6 % of capacity handed out; overshoot up to 106 % | Doorman's design doc, simulation |",
                  "| Databricks' rate limiter | ~5 % overshoot accepted | Databricks engineering blog |",
                  "| Sentry Relay | admitted equals the limit (Redis-backed quotas, checked per request) | Relay docs |",
                  f"| **Sluice (this run)** | utilisation mean {an['utilisation_mean'] * 100:.1f} %, min "
                  f"{an['utilisation_min'] * 100:.1f} %; overshoot max {an['overshoot_max'] * 100:.1f} %; "
                  f"{an['over_windows']} window(s) above the limit | `anchors` in the JSON |", "",
                  "| window | demand | admitted | utilisation |", "|---|---|---|---|"]
        t0 = an["windows"][0]["start_ms"] if an["windows"] else 0
        for w in an["windows"]:
            lines.append(f"| +{(w['start_ms'] - t0) // 1000} s | {w['demand']:,} | {w['admitted']:,} | "
                         f"{w['utilisation'] * 100:.1f} % |")
        lines.append("")
    sc = r.get("scale")
    if sc:
        lines += ["### Scale curves", "",
                  f"![scale]({svg_rel}/bench-scale-hosts.svg) ![scale]({svg_rel}/bench-scale-keys.svg) "
                  f"![scale]({svg_rel}/bench-scale-tasks.svg)", "",
                  "| simulated hosts (1 process each, total demand 2× the limit) | Redis cmds/s | manager CPU | decision p50 µs | admitted ÷ limit per full slice (min / median / max) |",
                  "|---|---|---|---|---|"]
        for x in sc["hosts"]:
            a = x.get("admitted_per_slice_vs_limit")
            acc = f"{a['min']:.3f} / {a['median']:.3f} / {a['max']:.3f}" if a else "–"
            lines.append(f"| {x['hosts']} | {sig(x['redis_cmds_per_s'])} | {x['manager_cpu_per_s'] * 100:.1f} % | "
                         f"{sig(x['decision_p50_us'])} | {acc} |")
        lines += ["", "| keys (one host, 20,000 decisions/s, uniform) | Redis cmds/s | decision p50 / p99 µs | SDK memory: max RSS | host segment + key table |",
                  "|---|---|---|---|---|"]
        for x in sc["keys"]:
            lines.append(f"| {x['keys']:,} | {sig(x['redis_cmds_per_s'])} | {sig(x['decision_p50_us'])} / "
                         f"{sig(x['decision_p99_us'])} | {x['max_rss_kib'] / 1024:.1f} MiB | "
                         f"{x['segment_bytes'] / 2**20:.1f} MiB |")
        lines += ["", "| tasks (1 s slices, rolled by one leader, no traffic; plus the 4 tasks of the runs above) | Redis cmds/s | manager CPU | Redis memory |",
                  "|---|---|---|---|"]
        for x in sc["tasks"]:
            lines.append(f"| {x['tasks']:,} | {sig(x['redis_cmds_per_s'])} | {x['manager_cpu_per_s'] * 100:.1f} % | "
                         f"{x['redis_used_memory_mib']:.1f} MiB |")
        lines.append("")
    cr = r.get("criterion")
    if cr:
        lines += ["### Decision path (criterion, same run)", "",
                  "`host/N`: N clients (N mappings of one segment, like N processes of one host), one thread "
                  "each, deciding on one shared quota; an iteration is one decision by every client, so *time per "
                  "iteration* is a round of N; *per decision* is 1 ÷ the host's throughput (the round ÷ N, the "
                  "measure of the issue's \"59 ns each\" with 4 processes).", "",
                  "| benchmark | time per iteration | throughput | per decision |", "|---|---|---|---|"]
        for k in sorted(cr):
            v = cr[k]
            thr = f"{sig(v['elem_per_s'])}/s" if v.get("elem_per_s") else ""
            per = ""
            n = k.split("/", 1)[1].split("_", 1)[0] if k.startswith("host/") else None
            if n and n.isdigit() and v.get("elem_per_s"):
                per = f"{sig(1e9 / v['elem_per_s'])} ns"
            elif v.get("time_ns") is not None:
                per = f"{sig(v['time_ns'])} ns"
            lines.append(f"| `{k}` | {sig(v.get('time_ns'))} ns | {thr} | {per} |")
        lines.append("")
    lines += ["Reproduce: `scripts/bench.sh` (full, ~30 min with the keys grid, regenerates this section and the plots) or "
              "`scripts/bench.sh --quick` (smoke test); the raw numbers are in `target/bench/latest.json`.",
              "", END]
    return "\n".join(lines)


# ---------------------------------------------------------------- the keys grid (issue 26)

def ratio(s, p):
    """Sluice ÷ per-request (≤ 1: never worse; ≤ 0.1: 10× better); None when unknown."""
    if s is None or p is None:
        return None
    if p == 0:
        return 0.0 if s == 0 else math.inf
    return s / p


def rfmt(x):
    if x is None:
        return "–"
    if x == math.inf:
        return "∞"
    return f"{x:.3f}" if x < 0.1 else f"{x:.2f}"


def key_goals(pt):
    """(never worse, ≥ 10× better or None where a key sees < 10 decisions per slice per host)."""
    s, p = pt["sluice"], pt["per_request"]
    rs = [ratio(s["redis_commands_per_decision"], p["redis_commands_per_decision"]),
          ratio(s["redis_cpu_us_per_decision"], p["redis_cpu_us_per_decision"]),
          ratio(s["p50_us"], p["p50_us"]), ratio(s["p99_us"], p["p99_us"])]
    never_worse = all(x is not None and x <= 1 for x in rs)
    if pt["decisions_per_key_slice_host"] < 10:
        return never_worse, None
    return never_worse, rs[0] is not None and rs[0] <= 0.1 and rs[2] is not None and rs[2] <= 0.1


def demands(pt):
    """The nominal demands a point stands for (several where L = 1 made them one workload)."""
    return ", ".join(f"{d:g}×" for d in pt.get("demands", [pt["demand"]]))


def provenance(m):
    src = m.get("source") or {}
    if not src.get("commit"):
        return ""
    dirty = src.get("uncommitted") or []
    extra = f" with {len(dirty)} file(s) changed but not committed" if dirty else ""
    return f"Built from commit `{src['commit']}`{extra}. "


def in_run(pt, k):
    """A slice longer than the run: the decisions per key and host the run saw of it."""
    if pt["slice_s"] <= k["seconds_per_run"]:
        return ""
    return f" ({sig(k['rate_per_host'] * k['seconds_per_run'] / pt['keys'])} in run)"


def frac(x):
    return "n/a" if x is None else f"{x:.3f}"


def tick(x):
    return "–" if x is None else ("✓" if x else "✗")


def key_series(k, slice_s, field, design, demand=1, hosts=1):
    pts = [pt for pt in k["points"] if pt["slice_s"] == slice_s and pt["hosts"] == hosts
           and demand in pt.get("demands", [pt["demand"]])]
    return [(pt["keys"], pt[design][field]) for pt in sorted(pts, key=lambda x: x["keys"])]


def keys_svgs(k):
    """Redis commands per decision, p50 and p99 against keys: one line per design and slice
    length; demand 1× the limit, one host (2 processes)."""
    slices = sorted({pt["slice_s"] for pt in k["points"]})

    def chart(title, field, ylabel):
        return line_chart(f"{title} (demand 1×, 1 host)", "keys",
                          [(f"{label}, {sl} s slices", key_series(k, sl, field, d))
                           for sl in slices for d, label in KDESIGNS], ylabel, logy=True)
    return {"bench-keys-commands.svg": chart("Redis commands per decision",
                                             "redis_commands_per_decision", "commands / decision"),
            "bench-keys-p50.svg": chart("Decision p50", "p50_us", "µs"),
            "bench-keys-p99.svg": chart("Decision p99", "p99_us", "µs")}


def render_keys(r, svg_rel, svgs):
    k = r["keys"]
    m = r["machine"]
    pts = k["points"]
    g = k["grid"]
    lines = [KBEGIN, "",
             "<!-- Generated by scripts/bench/report.py from the JSON of one run of "
             "scripts/bench.sh: edit the script, not this section. -->", "",
             f"One run of `{r['command']}` on {r['date'][:10]} ({r['mode']} mode, {r['profile']} build; "
             f"the grid took {k['elapsed_s']:.0f} s): keys {' · '.join(f'{x:,}' for x in g['keys'])} × demand "
             f"{' · '.join(f'{x:g}×' for x in g['demand'])} × hosts {' · '.join(map(str, g['hosts']))} "
             f"({k['procs_per_host']} processes each) × slices {' · '.join(f'{x} s' for x in g['slice_s'])}; "
             f"{k['rate_per_host']:,.0f} decisions/s per host (paced), {k['seconds_per_run']:g} s per run, "
             f"Sluice with {k['workers_per_proc']} decision loops per process"
             f"{' pulling from their own runtime (caller pulls)' if k.get('caller_pulls') else ''}"
             f"{'; the per-request peer paced on a ' + str(k['peer_grain_ms']) + ' ms timer grain' if k.get('peer_grain_ms') else ''}, key table cap "
             f"{k['key_slots_cap']:,} entries. Machine: {m['cpu']}, {m['cores']} cores; {m['redis']}. "
             f"{provenance(m)}"
             f"Idle background subtracted from the per-request counts: {k['idle_redis_commands_per_s']:.1f} "
             "commands/s.", "",
             "Ratios are Sluice ÷ per-request (≤ 1: Sluice no worse; ≤ 0.1: 10× better). *never worse*: "
             "commands, Redis CPU, p50 and p99 per decision all ≤ the per-request design's. *10×*: commands "
             "and p50 both ≤ 1/10, judged only where a key sees ≥ 10 decisions per slice per host (– elsewhere; "
             "for a slice longer than the run, the brackets say how many of them the run saw: the slice's "
             "start only). "
             "† L clamped to 1: the demand reached is the *actual* column, not the nominal one (nominal demands "
             "that came out as the same workload were run once, one row). ‡ more keys "
             "than key table entries (keys beyond the table are decided by direct calls).", "",
             "| keys | demand (actual) | hosts | slice | L | dec/key/slice/host | decisions/s S · P | "
             "Redis cmds/dec S · P (ratio) | Redis CPU µs/dec S · P | p50 µs S · P (ratio) | "
             "p99 µs S · P (ratio) | SDK calls/dec | never worse | 10× |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nw = ten = ten_n = 0
    for pt in pts:
        s, p = pt["sluice"], pt["per_request"]
        ok_nw, ok_ten = key_goals(pt)
        nw += ok_nw
        if ok_ten is not None:
            ten_n += 1
            ten += ok_ten
        mark = ("†" if pt["clamped"] else "") + ("‡" if pt["keys_exceed_table"] else "")
        lines.append(
            f"| {pt['keys']:,}{mark} | {demands(pt)} ({pt['actual_demand']:g}×) | {pt['hosts']} | "
            f"{pt['slice_s']} s | {pt['limit']:,} | {sig(pt['decisions_per_key_slice_host'])}{in_run(pt, k)} | "
            f"{sig(s['decisions_per_s'])} · {sig(p['decisions_per_s'])} | "
            f"{s['redis_commands_per_decision']:.4f} · {p['redis_commands_per_decision']:.4f} "
            f"({rfmt(ratio(s['redis_commands_per_decision'], p['redis_commands_per_decision']))}) | "
            f"{sig(s['redis_cpu_us_per_decision'])} · {sig(p['redis_cpu_us_per_decision'])} | "
            f"{sig(s['p50_us'])} · {sig(p['p50_us'])} ({rfmt(ratio(s['p50_us'], p['p50_us']))}) | "
            f"{sig(s['p99_us'])} · {sig(p['p99_us'])} ({rfmt(ratio(s['p99_us'], p['p99_us']))}) | "
            f"{s['sdk_redis_calls_per_decision']:.4f} | {tick(ok_nw)} | {tick(ok_ten)} |")
    loads = [pt["load_1m"] for pt in pts if pt.get("load_1m") is not None]
    load = f" Load average (1 min) as the points started: {min(loads):.2f}–{max(loads):.2f}." if loads else ""
    lines += ["", f"Never worse at {nw} of {len(pts)} points; 10× better at {ten} of the {ten_n} points "
              f"where a key sees ≥ 10 decisions per slice per host.{load}", ""]
    lines += ["Accuracy per reported key (the first "
              f"{k['reported_keys']:,} keys, or all when fewer) and slice, summed over every process of every "
              "host: *over* counts key-slices that admitted more than L (every slice, the run's partial ones "
              "included; must be 0 for Sluice), with the permits above L; *utilisation* is admitted ÷ L over the "
              "key-slices fully inside the run whose demand reached L (median, min, share ≥ 95 %, and how many "
              "key-slices; n/a where no slice is full: 60 s slices in a short run); *served* is admitted ÷ "
              "min(demand, L) over every full key-slice (1 = what an exact limiter admits, demand below L "
              "included); *admitted* is the share of all decisions admitted. *Redis memory* is the peak "
              "`used_memory` during the run (sampled every 0.5 s) minus the value before, ÷ the keys that had at "
              "least one decision (expected, K·(1 − e^(−decisions/K))). *Manager* is its CPU over the run, % of "
              "one core.", "",
              "| keys | demand | hosts | slice | L | over S · P (permits) | utilisation S: median / min / ≥ 95 % (n) | "
              "utilisation P: median / min (n) | served S · P | admitted S · P | Redis memory B/active key S · P | "
              "active keys | manager CPU |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def util(a, full=True):
        if a["util_median"] is None:
            return "n/a"
        share = f" / {a['util_ge_95'] * 100:.0f} %" if full else ""
        return f"{a['util_median']:.3f} / {a['util_min']:.3f}{share} ({a['util_key_slices']:,})"

    for pt in pts:
        s, p = pt["sluice"], pt["per_request"]
        sa, pa = s["accuracy"], p["accuracy"]
        mark = ("†" if pt["clamped"] else "") + ("‡" if pt["keys_exceed_table"] else "")
        lines.append(
            f"| {pt['keys']:,}{mark} | {demands(pt)} | {pt['hosts']} | {pt['slice_s']} s | {pt['limit']:,} | "
            f"{sa['over_slices']} ({sa['over_permits']:,}) · {pa['over_slices']} ({pa['over_permits']:,}) | "
            f"{util(sa)} | {util(pa, False)} | {frac(sa.get('served'))} · {frac(pa.get('served'))} | "
            f"{s['admitted_fraction'] * 100:.1f} % · {p['admitted_fraction'] * 100:.1f} % | "
            f"{sig(s['redis_memory_per_active_key_bytes'])} · {sig(p['redis_memory_per_active_key_bytes'])} | "
            f"{s['active_keys']:,} | {s['manager_cpu_percent']:.1f} % |")
    over = sum(pt["sluice"]["accuracy"]["over_slices"] for pt in pts)
    lines += ["", f"Sluice over-admitted {over} key-slice(s) in this run"
              f"{' (the goal is 0)' if over else ''}.", ""]
    shown = [f"![{name[:-4]}]({svg_rel}/{name})" for name in
             ("bench-keys-commands.svg", "bench-keys-p50.svg", "bench-keys-p99.svg") if svgs.get(name)]
    lines += [" ".join(shown), ""]
    lines += ["The plots: demand 1× the limit, one host (2 processes), a line per design and slice "
              "length; x = keys (log), y log (a value of 0 is not drawn). "
              "Reproduce the grid alone: `SLUICE_BENCH_SECTIONS=keys scripts/bench.sh` (release, "
              "regenerates this section only); the raw numbers are under `keys` in "
              "`target/bench/latest.json`.", "", KEND]
    return "\n".join(lines)


def check_keys(r):
    k = r.get("keys")
    if not k:
        return ["keys: missing"]
    if not k.get("points"):
        return ["keys: no point"]
    problems = []
    for pt in k["points"]:
        name = f"keys {pt['keys']}/{pt['demand']}×/{pt['hosts']}h/{pt['slice_s']}s"
        for d, _ in KDESIGNS:
            c = pt.get(d)
            if not c:
                problems.append(f"{name}: {d} missing")
                continue
            problems += run_problems(f"{name}: {d}", c)
            if "over_slices" not in c.get("accuracy", {}):
                problems.append(f"{name}: {d}: no accuracy")
        if pt.get("sluice") and pt["sluice"].get("sdk_redis_calls") is None:
            problems.append(f"{name}: sluice: no SDK redis_calls")
    return problems


def run_problems(label, c):
    """What every measured run must have: decisions, both latency percentiles, no errors."""
    out = []
    if c["decisions"] <= 0:
        out.append(f"{label}: no decisions")
    if c["p50_us"] is None or c["p99_us"] is None:
        out.append(f"{label}: no latency")
    if c["errors"]:
        first = f" ({c['first_error']})" if c.get("first_error") else ""
        out.append(f"{label}: {c['errors']} errors{first}")
    return out


def check(r):
    problems = []
    sections = r.get("sections", ["peers"])
    if "keys" in sections:
        problems += check_keys(r)
    if "peers" not in sections:
        return problems
    for p, _ in PEERS:
        for d in ("over", "steady"):
            c = case(r, p, d)
            if not c:
                problems.append(f"{p}/{d}: missing")
                continue
            problems += run_problems(f"{p}/{d}", c)
            if not c["accuracy"].get("windows"):
                problems.append(f"{p}/{d}: no full window")
            if c["ok"] <= 0:
                problems.append(f"{p}/{d}: nothing admitted")
    return problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--doc", required=True)
    ap.add_argument("--svg-dir", required=True)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    with open(a.result) as f:
        r = json.load(f)
    if a.check:
        problems = check(r)
        if problems:
            sys.exit("report: the result is incomplete:\n  " + "\n  ".join(problems))
    os.makedirs(a.svg_dir, exist_ok=True)
    label = dict(PEERS)
    kind = lambda p: "sluice" if p.startswith("sluice") else "peer"  # noqa: E731
    svgs, keys_svgs_ = {}, {}
    if r.get("cases"):
        over = [c for p, _ in PEERS for c in r["cases"] if c["peer"] == p and c["demand"] == "over"]
        svgs = {
            "bench-throughput.svg": bar_chart("Decisions per second (demand above the limit, log scale)",
                                              [(label[c["peer"]].replace("`", ""), c["decisions_per_s"], kind(c["peer"])) for c in over],
                                              "/s"),
            "bench-p99.svg": bar_chart("p99 decision latency (demand above the limit, log scale)",
                                       [(label[c["peer"]].replace("`", ""), c["p99_us"], kind(c["peer"])) for c in over],
                                       "µs"),
            "bench-accuracy.svg": range_chart("Admitted ÷ limit per 1 s window (min, median, max; demand above)",
                                              [(label[c["peer"]].replace("`", ""), c["accuracy"].get("min"),
                                                c["accuracy"].get("median"), c["accuracy"].get("max"), kind(c["peer"]))
                                               for c in over if c["accuracy"].get("windows")]),
        }
    sc = r.get("scale")
    if sc:
        svgs["bench-scale-hosts.svg"] = line_chart(
            "Cost as hosts grow (same total demand)", "simulated hosts",
            [("Redis cmds/s", [(x["hosts"], x["redis_cmds_per_s"]) for x in sc["hosts"]])], "Redis commands/s")
        svgs["bench-scale-keys.svg"] = line_chart(
            "Cost as keys grow (20,000 decisions/s)", "keys",
            [("Redis cmds/s", [(x["keys"], x["redis_cmds_per_s"]) for x in sc["keys"]])], "Redis commands/s", logy=True)
        svgs["bench-scale-tasks.svg"] = line_chart(
            "Cost as tasks grow (idle, rolled)", "tasks",
            [("Redis cmds/s", [(x["tasks"], x["redis_cmds_per_s"]) for x in sc["tasks"]])], "Redis commands/s", logy=True)
    if r.get("keys"):
        keys_svgs_ = keys_svgs(r["keys"])
    for name, svg in {**svgs, **keys_svgs_}.items():
        if svg:
            with open(os.path.join(a.svg_dir, name), "w") as f:
                f.write(svg + "\n")
    rel = os.path.relpath(a.svg_dir, os.path.dirname(os.path.abspath(a.doc)) or ".")
    sections = []
    if r.get("cases"):
        sections.append((BEGIN, END, render(r, rel)))
    if r.get("keys"):
        sections.append((KBEGIN, KEND, render_keys(r, rel, keys_svgs_)))
    text = ""
    if os.path.exists(a.doc):
        with open(a.doc) as f:
            text = f.read()
    # A doc made of generated sections alone (target/bench/report.md) is made again whole.
    rest = text
    for begin, end in ((BEGIN, END), (KBEGIN, KEND)):
        if begin in rest and end in rest:
            head, tail = rest.split(begin, 1)
            rest = head + tail.split(end, 1)[1]
    fresh = not rest.strip()
    if fresh:
        text = ""
    for begin, end, section in sections:
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            tail = rest.split(end, 1)[1]
            text = head + section + tail
        elif fresh:
            text += section + "\n\n"
        else:
            sys.exit(f"report: {a.doc} has no {begin} … {end} markers; add them where the section goes")
    with open(a.doc + ".tmp", "w") as f:
        f.write(text)
    os.replace(a.doc + ".tmp", a.doc)


if __name__ == "__main__":
    main()
