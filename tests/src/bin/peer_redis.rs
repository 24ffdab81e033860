//! The per-request Redis limiters of the seed article (`../shared/seeds/001_*.md`), as peers in
//! the side-by-side benchmark (`scripts/bench.sh`): one Lua call to Redis per decision.
//!
//! ```text
//! peer_redis --algo fixed-window|sliding-log --redis URL --key K --limit L --window-ms W
//!            --duration-ms D --start-at-ms T [--rate R] [--bucket-ms B] [--proc I]
//!            [--keys N] [--key-report R] [--grain-ms G]
//! ```
//!
//! * `fixed-window`: the article's INCR limiter, the design of envoyproxy/ratelimit: the key is
//!   `K:<now_ms / W>` (the window in the key, so windows are aligned to multiples of W), one
//!   script `INCR`s it, `EXPIRE`s it (W, rounded up to seconds) on the first increment and
//!   admits while the count is ≤ L.
//! * `sliding-log`: the article's ZSET limiter: `ZREMRANGEBYSCORE K 0 now-W`, `ZCARD K`, and
//!   below L `ZADD K now member`. Two changes the article's own text asks for or needs: the
//!   member is unique per decision (`<now>-<proc>-<seq>`: the article passes the timestamp, so
//!   two decisions in one millisecond would collapse into one member and over-admit), and the
//!   key gets a `PEXPIRE` of W on every admission (the article's script never expires it).
//!   `now` is the client's clock, as in the article.
//!
//! Both run exactly as the Node.js and Python peers do (scripts/bench/peers/README.md has the
//! contract): connect, one unrecorded warm-up decision on `K:warmup`, wait until Unix ms T,
//! then decide one permit at a time for D ms, one request in flight (`--rate 0`: closed loop;
//! `--rate R`: decision i is due at T + i·1000/R ms), and print ONE JSON line:
//! `{"peer", "version", "proc", "decisions", "ok", "over_limit", "errors", "first_error",
//! "seconds", "decisions_per_s", "lat_hist", "p50_us", "p99_us", "bucket_ms", "buckets"}`.
//! `lat_hist` maps `floor(log2(ns) · 16)` to a count of decisions (latency: monotonic ns from
//! just before the call to the answer); `buckets` maps the start (Unix ms, multiple of B) of
//! the bucket in which an answer ARRIVED to `[ok, over_limit]`. SIGTERM/SIGINT stop the loop
//! early; the JSON is still printed. Bad flags: exit 2 naming the flag.
//!
//! # Many keys (issue 26)
//!
//! `--keys N` (default 0: the one key `K`, as above) spreads the decisions uniformly at random
//! over the N keys `K:k0 … K:k{N-1}`, each its own limiter of L per W ms (for `fixed-window` the
//! Redis key of key i is `K:ki:<now_ms / W>`): per-tenant limits the way envoyproxy/ratelimit
//! keeps them, one script call per decision whatever the key. The choice is a SplitMix64 stream
//! seeded from the clock, the pid and `--proc`, so processes do not repeat each other.
//! `--key-report R` (default 0; at most N and 1,000,000) adds one field to the JSON line,
//! the counts of keys k0 … k{R-1} by the aligned window (`floor(now_ms / W) · W`, on the
//! client's clock, read just before the call: for `fixed-window` exactly the window the script
//! charged) they were decided in:
//! `"keys": {"k<i>": {"<window_start_ms>": [ok, over_limit]}}` (a key or window with no
//! answer is absent; errors are not counted there). Every other field is unchanged.
//!
//! # Timer grain
//!
//! `--grain-ms G` (default 0: each decision due at its own instant, slept for precisely) rounds
//! every due time up to the next multiple of G ms, as a timer of that grain would: at
//! `--rate 5000 --grain-ms 1` five decisions are released together every millisecond and the
//! thread sleeps about 1 ms between bursts — the shape of a Tokio-paced load generator (the
//! SDK's `loadgen` paces its loops with Tokio's 1 ms timer), so both designs pay the same
//! wake-ups when they are measured side by side.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Algo {
    FixedWindow,
    SlidingLog,
}

#[derive(Parser, Debug)]
#[command(
    name = "peer_redis",
    about = "Per-request Redis limiters (fixed window, sliding log)"
)]
struct Args {
    #[arg(long, value_enum)]
    algo: Algo,
    #[arg(long)]
    redis: String,
    #[arg(long)]
    key: String,
    #[arg(long)]
    limit: u64,
    #[arg(long)]
    window_ms: u64,
    #[arg(long)]
    duration_ms: u64,
    #[arg(long)]
    start_at_ms: Option<i64>,
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    #[arg(long, default_value_t = 100)]
    bucket_ms: i64,
    #[arg(long, default_value_t = 0)]
    proc: u32,
    /// Spread the decisions over this many keys `K:k<i>` (0 = the key `K` alone).
    #[arg(long, default_value_t = 0)]
    keys: u64,
    /// Report per-window counts of the keys k0 … k{R-1} (`"keys"` in the JSON line).
    #[arg(long, default_value_t = 0)]
    key_report: u64,
    /// Round every due time up to a multiple of this many ms (0 = precise pacing).
    #[arg(long, default_value_t = 0)]
    grain_ms: u64,
}

/// At most this many keys (`--keys`).
const MAX_KEYS: u64 = 10_000_000;
/// At most this many reported keys (`--key-report`): their counts stay in memory.
const MAX_KEY_REPORT: u64 = 1_000_000;

/// The article's INCR limiter (`KEYS[1]` = window key; ARGV: limit, expiry seconds).
const FIXED_WINDOW: &str = r#"
local count = redis.call('incr', KEYS[1])
if count == 1 then
  redis.call('expire', KEYS[1], ARGV[2])
end
if count > tonumber(ARGV[1]) then
  return 0
end
return 1
"#;

/// The article's ZSET limiter (`KEYS[1]` = key; ARGV: now - window, now, limit, member,
/// window ms) with the key's expiry added.
const SLIDING_LOG: &str = r#"
redis.call('zremrangebyscore', KEYS[1], 0, ARGV[1])
local res = redis.call('zcard', KEYS[1])
if (res == nil) or (res < tonumber(ARGV[3])) then
  redis.call('zadd', KEYS[1], ARGV[2], ARGV[4])
  redis.call('pexpire', KEYS[1], ARGV[5])
  return 1
else
  return 0
end
"#;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn usage(msg: &str) -> ! {
    eprintln!("peer_redis: {msg}");
    std::process::exit(2)
}

struct Limiter {
    algo: Algo,
    script: redis::Script,
    limit: u64,
    window_ms: u64,
    proc: u32,
    seq: u64,
}

impl Limiter {
    /// One decision on `key`: whether it was admitted, and the start (Unix ms) of the aligned
    /// window of W ms the decision's clock fell in (for `fixed-window`, the window charged).
    fn decide(
        &mut self,
        con: &mut redis::Connection,
        key: &str,
    ) -> redis::RedisResult<(bool, i64)> {
        let now = unix_ms();
        let window_start = now - now.rem_euclid(self.window_ms as i64);
        let r: i64 = match self.algo {
            Algo::FixedWindow => {
                let window = now.div_euclid(self.window_ms as i64);
                let expire_s = self.window_ms.div_ceil(1000).max(1);
                self.script
                    .key(format!("{key}:{window}"))
                    .arg(self.limit)
                    .arg(expire_s)
                    .invoke(con)?
            }
            Algo::SlidingLog => {
                self.seq += 1;
                self.script
                    .key(key)
                    .arg(now - self.window_ms as i64)
                    .arg(now)
                    .arg(self.limit)
                    .arg(format!("{now}-{}-{}", self.proc, self.seq))
                    .arg(self.window_ms)
                    .invoke(con)?
            }
        };
        Ok((r == 1, window_start))
    }
}

/// SplitMix64: the key choice of `--keys` (uniform, cheap, no dependency).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` ≥ 1; multiply-shift, bias below 2⁻⁴⁰ for n ≤ 10⁷).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

fn hist_index(ns: u64) -> u32 {
    ((ns.max(1) as f64).log2() * 16.0).floor() as u32
}

fn percentile_us(hist: &BTreeMap<u32, u64>, p: f64) -> f64 {
    let total: u64 = hist.values().sum();
    if total == 0 {
        return 0.0;
    }
    let want = ((total as f64) * p).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (b, n) in hist {
        seen += n;
        if seen >= want {
            return 2f64.powf((*b as f64 + 0.5) / 16.0) / 1_000.0;
        }
    }
    0.0
}

fn main() {
    let args = Args::try_parse().unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(2)
    });
    if args.limit == 0 {
        usage("--limit must be at least 1");
    }
    if args.window_ms == 0 {
        usage("--window-ms must be at least 1");
    }
    if args.duration_ms == 0 || args.duration_ms > 3_600_000 {
        usage("--duration-ms must be 1..=3600000");
    }
    if !(args.rate >= 0.0 && args.rate.is_finite()) {
        usage("--rate must be ≥ 0");
    }
    if args.bucket_ms <= 0 {
        usage("--bucket-ms must be at least 1");
    }
    if args.grain_ms > 1_000 {
        usage("--grain-ms must be 0..=1000");
    }
    if args.keys > MAX_KEYS {
        usage(&format!("--keys must be at most {MAX_KEYS}"));
    }
    if args.key_report > args.keys.min(MAX_KEY_REPORT) {
        usage(&format!(
            "--key-report must be at most --keys ({}) and {MAX_KEY_REPORT}",
            args.keys
        ));
    }
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let client = redis::Client::open(args.redis.as_str())
        .unwrap_or_else(|e| usage(&format!("--redis: {e}")));
    let mut con = client
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap_or_else(|e| usage(&format!("cannot connect to --redis: {e}")));
    let _ = con.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = con.set_write_timeout(Some(Duration::from_secs(5)));
    let mut lim = Limiter {
        algo: args.algo,
        script: redis::Script::new(match args.algo {
            Algo::FixedWindow => FIXED_WINDOW,
            Algo::SlidingLog => SLIDING_LOG,
        }),
        limit: args.limit,
        window_ms: args.window_ms,
        proc: args.proc,
        seq: 0,
    };
    if let Err(e) = lim.decide(&mut con, &format!("{}:warmup", args.key)) {
        usage(&format!("warm-up decision failed: {e}"));
    }
    let start_at = args.start_at_ms.unwrap_or_else(unix_ms);
    while !STOP.load(Ordering::Relaxed) {
        let wait = start_at - unix_ms();
        if wait <= 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(wait.min(50) as u64));
    }
    let started = Instant::now();
    let duration = Duration::from_millis(args.duration_ms);
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / args.rate));
    let (mut ok, mut over, mut errors) = (0u64, 0u64, 0u64);
    let mut first_error: Option<String> = None;
    let mut hist: BTreeMap<u32, u64> = BTreeMap::new();
    let mut buckets: BTreeMap<i64, [u64; 2]> = BTreeMap::new();
    // `--key-report`: (key index, window start) → [ok, over_limit].
    let mut key_counts: BTreeMap<(u64, i64), [u64; 2]> = BTreeMap::new();
    let mut rng = SplitMix(
        (unix_ms() as u64)
            ^ (u64::from(std::process::id()) << 32)
            ^ u64::from(args.proc).wrapping_mul(0xA24B_AED4_963E_E407),
    );
    let mut key_buf = String::new();
    let mut i: u64 = 0;
    // Bounded by the duration (and the stop flag).
    while !STOP.load(Ordering::Relaxed) {
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        if let Some(iv) = interval {
            let mut due = iv.mul_f64(i as f64);
            if args.grain_ms > 0 {
                let g = args.grain_ms as u128 * 1_000_000;
                due = Duration::from_nanos((due.as_nanos().div_ceil(g) * g) as u64);
            }
            if due >= duration {
                break;
            }
            if due > elapsed {
                std::thread::sleep((due - elapsed).min(Duration::from_millis(50)));
                continue;
            }
        }
        i += 1;
        let k = (args.keys > 0).then(|| rng.below(args.keys));
        let key = match k {
            Some(k) => {
                use std::fmt::Write as _;
                key_buf.clear();
                let _ = write!(key_buf, "{}:k{k}", args.key);
                key_buf.as_str()
            }
            None => args.key.as_str(),
        };
        let t0 = Instant::now();
        let r = lim.decide(&mut con, key);
        let ns = t0.elapsed().as_nanos() as u64;
        *hist.entry(hist_index(ns)).or_insert(0) += 1;
        let ms = unix_ms();
        let b = buckets
            .entry(ms - ms.rem_euclid(args.bucket_ms))
            .or_insert([0, 0]);
        if let (Ok((admitted, window)), Some(k)) = (&r, k)
            && k < args.key_report
        {
            key_counts.entry((k, *window)).or_insert([0, 0])[usize::from(!admitted)] += 1;
        }
        match r {
            Ok((true, _)) => {
                ok += 1;
                b[0] += 1;
            }
            Ok((false, _)) => {
                over += 1;
                b[1] += 1;
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let decisions = ok + over + errors;
    let mut out = serde_json::json!({
        "peer": match args.algo {
            Algo::FixedWindow => "redis-fixed-window-lua",
            Algo::SlidingLog => "redis-sliding-log-zset",
        },
        "version": env!("CARGO_PKG_VERSION"),
        "proc": args.proc,
        "decisions": decisions,
        "ok": ok,
        "over_limit": over,
        "errors": errors,
        "first_error": first_error,
        "seconds": secs,
        "decisions_per_s": decisions as f64 / secs,
        "lat_hist": hist.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        "p50_us": percentile_us(&hist, 0.50),
        "p99_us": percentile_us(&hist, 0.99),
        "bucket_ms": args.bucket_ms,
        "buckets": buckets.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
    });
    if args.key_report > 0 {
        let mut keys: BTreeMap<String, BTreeMap<String, [u64; 2]>> = BTreeMap::new();
        for ((k, w), v) in &key_counts {
            keys.entry(format!("k{k}"))
                .or_default()
                .insert(w.to_string(), *v);
        }
        out["keys"] = serde_json::json!(keys);
    }
    println!("{out}");
}
