#!/usr/bin/env python3
"""Sluice side-by-side benchmark peer (issue 14): `limits`' MovingWindowRateLimiter on its
Redis storage. One decision in flight at a time; the orchestrator runs P processes for P
"processes". Contract (shared with the Node.js and Rust peers): scripts/bench/peers/README.md.
"""

import json
import math
import re
import signal
import sys
import time

PEER = "limits"
USAGE = (
    "usage: peer.py --redis URL --key K --limit L --window-ms W --duration-ms D "
    "--start-at-ms T [--rate R] [--bucket-ms B] [--proc I]"
)
# flag -> (kind, default); kind: str, int+ (> 0), int0 (>= 0), num0 (number >= 0)
FLAGS = {
    "--redis": ("str", None),
    "--key": ("str", None),
    "--limit": ("int+", None),
    "--window-ms": ("int+", None),
    "--duration-ms": ("int0", None),
    "--start-at-ms": ("int0", None),
    "--rate": ("num0", 0.0),
    "--bucket-ms": ("int+", 100),
    "--proc": ("int0", 0),
}


def die(msg):
    sys.stderr.write(f"{PEER} peer: {msg}\n")
    sys.exit(2)


def scrub(msg):
    """Error messages may carry the Redis URL: never print its credentials."""
    return re.sub(r"(rediss?://)[^@\s/]*@", r"\1***@", str(msg))


def parse_args(argv):
    vals = {}
    i = 0
    while i < len(argv):
        flag, val = argv[i], None
        if flag.startswith("--") and "=" in flag:
            flag, val = flag.split("=", 1)
        if flag in ("--help", "-h"):
            print(USAGE)
            sys.exit(0)
        if flag not in FLAGS:
            die(f"unknown flag {flag}\n{USAGE}")
        if val is None:
            if i + 1 >= len(argv):
                die(f"flag {flag} needs a value")
            i += 1
            val = argv[i]
        kind = FLAGS[flag][0]
        if kind == "str":
            if not val:
                die(f"flag {flag} must not be empty")
            vals[flag] = val
        elif kind == "num0":
            if not re.fullmatch(r"\d+(\.\d+)?", val):
                die(f'flag {flag}: "{val}" is not a number >= 0')
            vals[flag] = float(val)
        else:
            if not re.fullmatch(r"\d+", val):
                die(f'flag {flag}: "{val}" is not an integer >= 0')
            n = int(val)
            if kind == "int+" and n == 0:
                die(f"flag {flag} must be > 0")
            vals[flag] = n
        i += 1
    for flag, (_, default) in FLAGS.items():
        if flag not in vals:
            if default is None:
                die(f"missing required flag {flag}\n{USAGE}")
            vals[flag] = default
    if not re.match(r"rediss?://", vals["--redis"]):
        die("flag --redis must be a redis:// URL")
    if vals["--window-ms"] % 1000:
        die(
            f"flag --window-ms: {vals['--window-ms']} is not a multiple of 1000 "
            "(the limiter is built from whole seconds)"
        )
    return {k[2:].replace("-", "_"): v for k, v in vals.items()}


def quantile_us(hist, total, q):
    """Quantile from the log histogram (b = floor(log2(ns) * 16)), at the bucket midpoint."""
    if total == 0:
        return None
    want = max(1, math.ceil(q * total))
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= want:
            return 2 ** ((b + 0.5) / 16) / 1000
    return None


def main():
    o = parse_args(sys.argv[1:])
    stop = False

    def on_signal(_sig, _frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Imported after flag parsing so a bad flag is reported fast.
    import limits
    from limits.storage import RedisStorage
    from limits.strategies import MovingWindowRateLimiter

    try:
        version = limits.__version__
    except AttributeError:  # pragma: no cover
        from importlib.metadata import version as _v

        version = _v("limits")

    # Keys: "<K>:LIMITER/<L>/<W/1000>/second" (limited) and
    # "<K>:LIMITER/warmup/<L>/<W/1000>/second" (warm-up); see README.md.
    storage = RedisStorage(
        o["redis"],
        key_prefix=o["key"],
        socket_timeout=2.0,  # a stuck Redis becomes an error, not a hang
        socket_connect_timeout=2.0,
    )
    limiter = MovingWindowRateLimiter(storage)
    item = limits.RateLimitItemPerSecond(o["limit"], o["window_ms"] // 1000)

    try:
        limiter.hit(item, "warmup")
    except Exception as e:  # noqa: BLE001 - any failure of the warm-up is fatal
        die(f"warm-up decision failed: {scrub(e)}")

    start_at = o["start_at_ms"]
    waited = False
    # Sleep in short steps so a signal during the wait is honoured promptly.
    while not stop:
        left = start_at - time.time() * 1000
        if left <= 0:
            break
        waited = True
        time.sleep(min(0.05, left / 1000))

    hist = {}
    buckets = {}
    ok = over = errors = 0
    first_error = None
    bucket_ms = o["bucket_ms"]
    wall0 = time.time() * 1000
    t0 = time.perf_counter_ns()
    # The run is [T, T + D) on the monotonic clock (so every process stops at the same moment)
    # and decision i is due at T + i/R; if T was already past at start-up, the run starts now.
    anchor_ns = t0 - int(max(0.0, wall0 - start_at) * 1e6) if waited else t0
    end_ns = anchor_ns + o["duration_ms"] * 1_000_000
    period_ns = 1e9 / o["rate"] if o["rate"] > 0 else 0
    i = 0
    while not stop:
        now = time.perf_counter_ns()
        if now >= end_ns:
            break
        if period_ns:
            due = anchor_ns + round(i * period_ns)
            if due >= end_ns:
                # No decision is due before the end: the run still lasts until T + D.
                while not stop and (left := end_ns - time.perf_counter_ns()) > 0:
                    time.sleep(min(0.05, left / 1e9))
                break
            if due > now:
                time.sleep((due - now) / 1e9)
                if stop:
                    break
        i += 1
        s = time.perf_counter_ns()
        try:
            outcome = 0 if limiter.hit(item) else 1
        except Exception as e:  # noqa: BLE001 - a failure that is not a refusal
            outcome = 2
            if first_error is None:
                first_error = scrub(f"{type(e).__name__}: {e}")
        ns = time.perf_counter_ns() - s
        b = math.floor(math.log2(max(1, ns)) * 16)
        hist[b] = hist.get(b, 0) + 1
        if outcome == 2:
            errors += 1
            continue
        start = int(time.time() * 1000) // bucket_ms * bucket_ms
        cell = buckets.get(start)
        if cell is None:
            cell = buckets[start] = [0, 0]
        cell[outcome] += 1
        if outcome == 0:
            ok += 1
        else:
            over += 1
    seconds = (time.perf_counter_ns() - t0) / 1e9
    try:
        storage.storage.close()
    except Exception:  # noqa: BLE001 - closing is best effort
        pass

    decisions = ok + over + errors
    out = {
        "peer": PEER,
        "version": version,
        "proc": o["proc"],
        "decisions": decisions,
        "ok": ok,
        "over_limit": over,
        "errors": errors,
        "first_error": first_error,
        "seconds": seconds,
        "decisions_per_s": decisions / seconds if seconds > 0 else 0,
        "lat_hist": {str(b): hist[b] for b in sorted(hist)},
        "p50_us": quantile_us(hist, decisions, 0.5),
        "p99_us": quantile_us(hist, decisions, 0.99),
        "bucket_ms": bucket_ms,
        "buckets": {str(k): buckets[k] for k in sorted(buckets)},
    }
    sys.stdout.write(json.dumps(out, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
