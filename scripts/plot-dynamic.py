#!/usr/bin/env python3
"""Plots the dynamic-limiting trajectory recorded by tests/tests/dynamic_loop.rs.

    python3 scripts/plot-dynamic.py target/debug/dynamic-trajectory.csv docs/img/dynamic-trajectory.svg

Input: CSV with columns seconds,threshold,capacity. Output: a self-contained SVG (no
dependencies): the effective threshold over time, the backend capacity, and the ±20 % band.
"""
import csv
import sys

W, H, L, R, T, B = 900, 420, 70, 20, 40, 50


def main(src, dst):
    rows = [(float(r["seconds"]), float(r["threshold"]), float(r["capacity"])) for r in csv.DictReader(open(src))]
    if not rows:
        sys.exit("no samples")
    tmax = max(r[0] for r in rows)
    ymax = max(max(r[1], r[2] * 1.2) for r in rows) * 1.1
    x = lambda t: L + (W - L - R) * t / tmax
    y = lambda v: H - B - (H - T - B) * v / ymax
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">Dynamic limiting: effective threshold vs. backend capacity</text>']
    # ±20 % band and capacity, per phase (capacity is piecewise constant).
    phases, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][2] != rows[start][2]:
            phases.append((rows[start][0], rows[i - 1][0], rows[start][2]))
            start = i
    for a, b, c in phases:
        out.append(f'<rect x="{x(a):.1f}" y="{y(c * 1.2):.1f}" width="{x(b) - x(a):.1f}" height="{y(c * 0.8) - y(c * 1.2):.1f}" fill="#2a9d8f" opacity="0.12"/>')
        out.append(f'<line x1="{x(a):.1f}" y1="{y(c):.1f}" x2="{x(b):.1f}" y2="{y(c):.1f}" stroke="#2a9d8f" stroke-dasharray="6 4" stroke-width="2"/>')
        out.append(f'<text x="{x(b) - 4:.1f}" y="{y(c * 1.2) - 4:.1f}" text-anchor="end" fill="#2a9d8f">capacity {c:.0f}/s (±20 % band)</text>')
    # Axes and grid.
    step = 1000 if ymax > 3000 else 500
    v = 0
    while v <= ymax:
        out.append(f'<line x1="{L}" y1="{y(v):.1f}" x2="{W - R}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v}</text>')
        v += step
    t = 0
    while t <= tmax:
        out.append(f'<text x="{x(t):.1f}" y="{H - B + 18}" text-anchor="middle">{t:.0f}</text>')
        t += 20
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">seconds</text>')
    out.append(f'<text x="16" y="{(T + H - B) / 2}" transform="rotate(-90 16 {(T + H - B) / 2})" text-anchor="middle">permits per 1 s slice</text>')
    pts = " ".join(f"{x(r[0]):.1f},{y(r[1]):.1f}" for r in rows)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#e76f51" stroke-width="2.5"/>')
    out.append(f'<text x="{L + 8}" y="{T + 14}" fill="#e76f51">effective threshold (sampled every second)</text>')
    out.append("</svg>")
    open(dst, "w").write("\n".join(out) + "\n")
    print(f"wrote {dst} ({len(rows)} samples)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
