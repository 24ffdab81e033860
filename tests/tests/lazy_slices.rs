//! Lazy slices (protocol 5, issue 27) against a real Redis: PULL, TAKE and SLIDE make a task's
//! missing slice from the lazy window its leader wrote into the meta (`lz_cap`, `lz_from`,
//! `lz_until`, `lz_exp`; [`scripts::LAZY_LUA`]) exactly when the rules allow it, never
//! otherwise, and never touch a slice that exists.
//!
//! * A table of the creation rules, every case called through all three scripts: the reply,
//!   the slice made (cap, rem, term, len, pacing, expiry), the meta left exactly as it was
//!   (workers only read it), and the leader's probe ([`scripts::roll_probe`]) seeing the slice.
//! * A randomized property test against a pure reference model: two leaders (terms 1 and 2 of
//!   one epoch) rolling the task lazy or ahead, workers calling the current and next slices,
//!   retirements written by hand and slices deleted (expiry). Seeded and replayable: the base
//!   seed is printed, a failure prints its case's seed and steps, and
//!   `SLUICE_LAZY_SEED=<seed>` replays that one case (`SLUICE_LAZY_CASES` sets how many cases
//!   a run draws; 200 by default, stopped early past a time budget).
//! * Workers under the documented least-privilege ACL (`deploy/redis-acl.conf`) make lazy
//!   slices.
//! * A lazy task's fence holds as long as its `fence_ttl` says (its leader refreshes it less
//!   often), and an eager write gives it back the callers' `stale_after`.
//!
//! Slices are placed by Redis `TIME`, and the rules that depend on time are judged with the
//! time each script answered with (the one it decided by), so a slow machine changes which
//! branch a step takes, never whether the model agrees.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use sluice_protocol::conn::RedisConn;
use sluice_protocol::scripts::{
    self, ExactReply, Fence, FenceRefusal, LazyWindow, PullReply, PullRequest, RollOutcome,
    RollRequest, SliceWrite,
};
use sluice_protocol::{Keys, Mode, meta_field, slice, slice_field};
use sluice_tests::*;

/// Slice length of every task here (ms).
const LEN: i64 = 1000;
/// The epoch of every leader here.
const EPOCH: u64 = 1;
/// Fences never go stale within a test: a newer term always holds the task.
const STALE_AFTER_MS: u64 = 600_000;
/// The spec version every roll writes.
const VERSION: i64 = 10;
/// How long after its end a slice rolled ahead is kept in the table (ms).
const EAGER_KEEP_MS: i64 = 30_000;
/// The term of the table's leader.
const TERM: i64 = 7;

fn fence(term: i64) -> Fence {
    Fence {
        term,
        epoch: EPOCH,
        stale_after_ms: STALE_AFTER_MS,
    }
}

/// A worker script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Pull,
    Take,
    Slide,
}

/// What a worker call answered, the three scripts alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The slice does not exist and was not made (-1).
    Missing,
    /// Outside the slice's time window (-2, PULL and TAKE).
    Outside,
    /// PULL's grant (maybe 0), or TAKE / SLIDE admitting the `want` asked for.
    Granted {
        granted: i64,
        remaining: i64,
        cap: i64,
    },
    /// TAKE / SLIDE refused.
    Refused { remaining: i64, cap: i64 },
}

/// Calls `op` for the slice of `task` at `start` (slices of `len`): the answer and the Redis
/// time (µs) the script decided by.
#[allow(clippy::too_many_arguments)]
async fn call(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    op: Op,
    start: i64,
    len: i64,
    want: u64,
    request_id: &str,
) -> (Answer, i64) {
    try_call(c, keys, task, op, start, len, want, request_id)
        .await
        .unwrap_or_else(|e| panic!("{op:?}: {e}"))
}

/// [`call`] on any connection, its error returned.
#[allow(clippy::too_many_arguments)]
async fn try_call<C: redis::aio::ConnectionLike>(
    c: &mut C,
    keys: &Keys,
    task: &str,
    op: Op,
    start: i64,
    len: i64,
    want: u64,
    request_id: &str,
) -> redis::RedisResult<(Answer, i64)> {
    let exact = match op {
        Op::Pull => {
            let req = PullRequest {
                task,
                start_ms: start,
                slice_ms: len as u64,
                want,
                host_id: "h",
                request_id,
                counters: None,
            };
            return Ok(match scripts::pull(c, keys, &req).await? {
                PullReply::Missing { redis_time_us } => (Answer::Missing, redis_time_us),
                PullReply::OutsideWindow { redis_time_us } => (Answer::Outside, redis_time_us),
                PullReply::Granted {
                    granted,
                    remaining,
                    cap,
                    redis_time_us,
                    replayed,
                } => {
                    assert!(!replayed, "a new request id was answered as a replay");
                    let granted = granted as i64;
                    let cap = cap as i64;
                    (
                        Answer::Granted {
                            granted,
                            remaining,
                            cap,
                        },
                        redis_time_us,
                    )
                }
            });
        }
        Op::Take => scripts::take(c, keys, task, start, len as u64, want, request_id).await?,
        Op::Slide => {
            scripts::slide(c, keys, task, start, len as u64, want, "n", request_id).await?
        }
    };
    Ok(match exact {
        ExactReply::Missing { redis_time_us } => (Answer::Missing, redis_time_us),
        ExactReply::OutsideWindow { redis_time_us } => (Answer::Outside, redis_time_us),
        ExactReply::Admitted {
            remaining,
            cap,
            redis_time_us,
        } => (
            Answer::Granted {
                granted: want as i64,
                remaining,
                cap: cap as i64,
            },
            redis_time_us,
        ),
        ExactReply::Refused {
            remaining,
            cap,
            redis_time_us,
            ..
        } => (
            Answer::Refused {
                remaining,
                cap: cap as i64,
            },
            redis_time_us,
        ),
    })
}

/// Redis `TIME` in Unix ms.
async fn redis_ms(c: &mut RedisConn) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(c).await.expect("TIME");
    s * 1000 + us / 1000
}

/// Whether Redis time `now` (ms) lies within the window of the slice at `start` (PULL's and
/// the lazy rule's): from one slice before its start to its end plus the grace.
fn in_window(now: i64, start: i64, len: i64) -> bool {
    now >= start - len && now <= slice::window_end(start, len as u64)
}

/// PULL's grant of `want` from a slice holding `rem` of `cap` at Redis time `now` (ms):
/// `(granted, rem after)`. `pace`: the burst of a paced slice ([`scripts::PACE_LUA`]).
fn pull_grant(
    pace: Option<i64>,
    cap: i64,
    rem: i64,
    now: i64,
    start: i64,
    want: i64,
) -> (i64, i64) {
    let (avail, forfeit) = match pace {
        None => (rem, 0),
        Some(burst) => {
            let paced = |t: i64| (cap * (t - start)).div_euclid(LEN).clamp(0, cap.max(0));
            let granted = cap - rem;
            let forfeit = rem.min(paced(now) - granted).max(0);
            let released = cap.min(paced(now + (LEN / 40).min(1000)) + burst);
            ((rem - forfeit).min(released - granted - forfeit), forfeit)
        }
    };
    if want > 0 && (avail > 0 || forfeit > 0) {
        let g = want.min(avail).max(0);
        (g, rem - g - forfeit)
    } else {
        (0, rem)
    }
}

/// What `op` answers for an existing slice (`cap`, `rem`; paced with burst `pace`) asked for
/// `want` at Redis time `now_us`, with `in_log` admissions in the sliding window (SLIDE):
/// the answer and the slice's `rem` after.
#[allow(clippy::too_many_arguments)]
fn decide(
    op: Op,
    pace: Option<i64>,
    cap: i64,
    rem: i64,
    now_us: i64,
    start: i64,
    len: i64,
    want: i64,
    in_log: i64,
) -> (Answer, i64) {
    let now = now_us / 1000;
    match op {
        Op::Pull | Op::Take if !in_window(now, start, len) => (Answer::Outside, rem),
        Op::Pull => {
            let (granted, rem) = pull_grant(pace, cap, rem, now, start, want);
            let remaining = rem;
            (
                Answer::Granted {
                    granted,
                    remaining,
                    cap,
                },
                rem,
            )
        }
        Op::Take if rem >= want => {
            let remaining = rem - want;
            let granted = want;
            (
                Answer::Granted {
                    granted,
                    remaining,
                    cap,
                },
                remaining,
            )
        }
        Op::Take => (
            Answer::Refused {
                remaining: rem,
                cap,
            },
            rem,
        ),
        Op::Slide if in_log + want <= cap && rem >= want && want <= 1000 => {
            let rem = rem - want;
            let remaining = (cap - in_log - want).min(rem);
            let granted = want;
            (
                Answer::Granted {
                    granted,
                    remaining,
                    cap,
                },
                rem,
            )
        }
        Op::Slide => {
            let remaining = (cap - in_log).min(rem);
            (Answer::Refused { remaining, cap }, rem)
        }
    }
}

/// A key's fields and its absolute expiry (`PEXPIRETIME`: -2 missing, -1 none).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stored {
    fields: HashMap<String, String>,
    expire_at: i64,
}

impl Stored {
    fn get(&self, f: &str) -> Option<&str> {
        self.fields.get(f).map(String::as_str)
    }

    fn num(&self, f: &str) -> Option<i64> {
        self.get(f).and_then(|v| v.parse().ok())
    }
}

/// The slices of `task` at `starts`, read in one round trip.
async fn read_slices(c: &mut RedisConn, keys: &Keys, task: &str, starts: &[i64]) -> Vec<Stored> {
    let mut p = redis::pipe();
    for s in starts {
        let k = keys.slice(task, *s);
        p.cmd("HGETALL").arg(&k).cmd("PEXPIRETIME").arg(&k);
    }
    let v: Vec<redis::Value> = p.query_async(c).await.expect("read slices");
    v.chunks(2)
        .map(|p| Stored {
            fields: redis::from_redis_value_ref(&p[0]).expect("slice fields"),
            expire_at: redis::from_redis_value_ref(&p[1]).expect("slice expiry"),
        })
        .collect()
}

async fn read_meta(c: &mut RedisConn, keys: &Keys, task: &str) -> Stored {
    let mut p = redis::pipe();
    p.cmd("HGETALL")
        .arg(keys.meta(task))
        .cmd("PEXPIRETIME")
        .arg(keys.meta(task));
    let (fields, expire_at) = p.query_async(c).await.expect("read meta");
    Stored { fields, expire_at }
}

// ───────────────────────────── the table of the rules ─────────────────────────────

/// What a case expects of the slice called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Made from the meta.
    Made,
    /// Not made: the call answers -1 and nothing is written.
    NotMade,
    /// It existed (rolled ahead): decided from as it is, the lazy window ignored.
    Kept,
}

/// The meta's pacing and mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain,
    /// `pacing = smooth`, `pace_burst = 3`, mode pooled.
    Paced,
    /// `pacing = smooth`, `pace_burst = 3`, mode exact_fixed.
    PacedExact,
}

/// One rule.
#[derive(Debug, Clone, Copy)]
struct Case {
    what: &'static str,
    /// The slice called, in slices from the current one (1: the next).
    at: i64,
    /// Call half a slice later than the grid start.
    off_grid: bool,
    /// The lazy window, in slices from the called slice's grid start: [`from`, `until`) …
    from: i64,
    until: i64,
    /// … with `until_ms` moved by this (ms).
    until_adj: i64,
    cap: u64,
    want: u64,
    kind: Kind,
    /// Meta fields changed by hand after the roll: set, or deleted (`None`).
    edits: &'static [(&'static str, Option<&'static str>)],
    /// The slice rolled ahead with this cap before the call.
    existing: Option<u64>,
    /// No meta at all (nothing rolled).
    no_meta: bool,
    /// The made slice is paced (burst 3).
    paced: bool,
    /// The made slice's term.
    term: i64,
    expect: Expect,
    /// The call lies within the slice's time window. The case assumes it; a call that a slow
    /// machine delayed across it is retried.
    in_time: bool,
}

const OK: Case = Case {
    what: "",
    at: 1,
    off_grid: false,
    from: -2,
    until: 3,
    until_adj: 0,
    cap: 12,
    want: 5,
    kind: Kind::Plain,
    edits: &[],
    existing: None,
    no_meta: false,
    paced: false,
    term: TERM,
    expect: Expect::Made,
    in_time: true,
};

/// How long a lazily made slice is kept after its end in the table (ms).
const LAZY_KEEP_MS: i64 = 20_000;

const fn not(what: &'static str, edits: &'static [(&'static str, Option<&'static str>)]) -> Case {
    Case {
        what,
        edits,
        expect: Expect::NotMade,
        ..OK
    }
}

const CASES: &[Case] = &[
    Case {
        what: "the next slice, inside the window",
        ..OK
    },
    Case {
        what: "the current slice, inside the window",
        at: 0,
        ..OK
    },
    Case {
        what: "the window's first slice (from = start)",
        from: 0,
        ..OK
    },
    Case {
        what: "the window's last slice (until = end)",
        until: 1,
        ..OK
    },
    Case {
        what: "a window of one slice",
        from: 0,
        until: 1,
        ..OK
    },
    Case {
        what: "want above the cap",
        want: 20,
        ..OK
    },
    Case {
        what: "want 0 (a read) makes the slice too",
        want: 0,
        ..OK
    },
    Case {
        what: "lz_cap 0",
        cap: 0,
        ..OK
    },
    Case {
        what: "smooth pacing, pooled: a paced slice",
        kind: Kind::Paced,
        paced: true,
        want: 10,
        ..OK
    },
    Case {
        what: "smooth pacing, mode absent: paced",
        kind: Kind::Paced,
        edits: &[("mode", None)],
        paced: true,
        want: 10,
        ..OK
    },
    Case {
        what: "smooth pacing, exact_fixed: not paced",
        kind: Kind::PacedExact,
        want: 10,
        ..OK
    },
    // The window is used only while the meta's fence is the one that wrote it (`lz_fence`).
    not("a meta without term", &[("term", None)]),
    not("another term's fence", &[("term", Some("99"))]),
    not("another epoch's fence", &[("epoch", Some("12345"))]),
    not("lz_fence missing", &[("lz_fence", None)]),
    not("lz_cap missing", &[("lz_cap", None)]),
    not("lz_from missing", &[("lz_from", None)]),
    not("lz_until missing", &[("lz_until", None)]),
    not("lz_exp missing", &[("lz_exp", None)]),
    not("lz_cap garbage", &[("lz_cap", Some("x"))]),
    not("lz_from garbage", &[("lz_from", Some("x"))]),
    not("lz_until garbage", &[("lz_until", Some("soon"))]),
    not("lz_exp garbage", &[("lz_exp", Some(""))]),
    not("retired", &[("retired", Some("99"))]),
    not("another slice_ms", &[("slice_ms", Some("2000"))]),
    not("slice_ms missing", &[("slice_ms", None)]),
    Case {
        what: "off the grid",
        at: 0,
        off_grid: true,
        expect: Expect::NotMade,
        ..OK
    },
    Case {
        what: "start before lz_from",
        from: 1,
        expect: Expect::NotMade,
        ..OK
    },
    Case {
        what: "end after lz_until (by 1 ms)",
        until: 1,
        until_adj: -1,
        expect: Expect::NotMade,
        ..OK
    },
    Case {
        what: "an empty window",
        from: 0,
        until: 0,
        expect: Expect::NotMade,
        ..OK
    },
    Case {
        what: "two slices ahead: before the time window",
        at: 3,
        expect: Expect::NotMade,
        in_time: false,
        ..OK
    },
    Case {
        what: "two slices back: after the time window",
        at: -2,
        from: -3,
        expect: Expect::NotMade,
        in_time: false,
        ..OK
    },
    Case {
        what: "no meta",
        no_meta: true,
        expect: Expect::NotMade,
        ..OK
    },
    Case {
        what: "the slice exists with another cap",
        existing: Some(7),
        expect: Expect::Kept,
        ..OK
    },
    Case {
        what: "the slice exists, exhausted",
        existing: Some(0),
        expect: Expect::Kept,
        ..OK
    },
];

/// A full roll of `task` by the table's leader (term [`TERM`]): meta `m`, `slices`, and the
/// lazy `window`.
async fn roll_lazy(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    m: &sluice_protocol::TaskMeta,
    slices: &[SliceWrite],
    window: &LazyWindow,
) -> RollOutcome {
    let f = fence(TERM);
    let req = RollRequest {
        task,
        fence: &f,
        full: true,
        expect_rolled_to: 0,
        spec_version: VERSION,
        new_rolled_to: window.from_ms,
        force: false,
        refresh: true,
        meta: Some(m),
        meta_extra: &[],
        slices,
        lazy: Some(window),
    };
    scripts::roll(c, keys, &req).await.expect("roll")
}

/// Rolls the table's task and calls `op`: `Err` when the call fell on the other side of the
/// time window than the case assumes (a slow machine: retry), else the failures found.
async fn table_case(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    case: &Case,
    op: Op,
) -> Result<Vec<String>, ()> {
    let cur = slice::start(redis_ms(c).await, LEN as u64);
    let base = cur + case.at * LEN;
    let start = base + if case.off_grid { LEN / 2 } else { 0 };
    let window = LazyWindow {
        cap: case.cap,
        from_ms: base + case.from * LEN,
        until_ms: base + case.until * LEN + case.until_adj,
        expire_after_ms: LAZY_KEEP_MS as u64,
        fence_ttl_ms: 0,
    };
    if !case.no_meta {
        let mut m = pooled_meta(100, LEN as u64, case.kind != Kind::Plain, 3);
        m.version = VERSION;
        if case.kind == Kind::PacedExact {
            m.mode = Mode::ExactFixed;
        }
        let slices: Vec<SliceWrite> = case
            .existing
            .map(|cap| SliceWrite {
                start_ms: start,
                cap,
                expire_at_ms: start + LEN + EAGER_KEEP_MS,
            })
            .into_iter()
            .collect();
        let out = roll_lazy(c, keys, task, &m, &slices, &window).await;
        assert_eq!(
            out,
            RollOutcome::Written(slices.len() as u64),
            "{}",
            case.what
        );
        for (field, value) in case.edits {
            let mut cmd = redis::cmd(if value.is_some() { "HSET" } else { "HDEL" });
            cmd.arg(keys.meta(task)).arg(*field);
            if let Some(v) = value {
                cmd.arg(*v);
            }
            let _: () = cmd.query_async(c).await.expect("edit the meta");
        }
    }
    let meta_before = read_meta(c, keys, task).await;
    let (answer, now_us) = call(c, keys, task, op, start, LEN, case.want, "r1").await;
    let now = now_us / 1000;
    if in_window(now, start, LEN) != case.in_time {
        return Err(());
    }
    let stored = &read_slices(c, keys, task, &[start]).await[0];
    let meta = read_meta(c, keys, task).await;
    // The leader's probe sees the slice a worker made (the meta says nothing of it), and
    // still vouches for an untouched lazy task.
    let probe = scripts::roll_probe(
        c,
        keys,
        task,
        &fence(TERM),
        window.from_ms,
        VERSION,
        Some(window.until_ms),
        &[start],
    )
    .await
    .expect("probe");
    let mut bad = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            bad.push(format!("{} / {op:?}: {what}", case.what));
        }
    };
    check(
        probe.made == (case.expect != Expect::NotMade),
        format!("the probe says made = {}", probe.made),
    );
    if case.edits.is_empty() && !case.no_meta {
        check(probe.vouch, "the probe does not vouch".into());
    }
    let want = case.want as i64;
    let (cap, keep) = match case.expect {
        Expect::Made => (case.cap as i64, start + LEN + LAZY_KEEP_MS),
        Expect::Kept => (case.existing.unwrap() as i64, start + LEN + EAGER_KEEP_MS),
        Expect::NotMade => {
            // Outside the time window, a slice the meta vouches for answers -2 as an existing
            // one would (PULL, TAKE; SLIDE has no -2): never -1, which is FAILED.
            let want = if !case.in_time && !matches!(op, Op::Slide) {
                Answer::Outside
            } else {
                Answer::Missing
            };
            check(answer == want, format!("answered {answer:?}, not {want:?}"));
            check(
                stored.fields.is_empty() && stored.expire_at == -2,
                format!("a slice was written: {stored:?}"),
            );
            check(
                meta == meta_before,
                format!("the meta changed: {meta_before:?} → {meta:?}"),
            );
            return Ok(bad);
        }
    };
    let pace = (case.expect == Expect::Made && case.paced).then_some(3);
    let (expect, rem) = decide(op, pace, cap, cap, now_us, start, LEN, want, 0);
    check(
        answer == expect,
        format!("answered {answer:?}, expected {expect:?}"),
    );
    check(
        stored.num(slice_field::CAP) == Some(cap),
        format!("cap {:?}, expected {cap}", stored.get(slice_field::CAP)),
    );
    check(
        stored.num(slice_field::REM) == Some(rem),
        format!("rem {:?}, expected {rem}", stored.get(slice_field::REM)),
    );
    let term = if case.expect == Expect::Made {
        case.term
    } else {
        TERM
    };
    check(
        stored.num(slice_field::TERM) == Some(term),
        format!("term {:?}, expected {term}", stored.get(slice_field::TERM)),
    );
    check(
        stored.num(slice_field::LEN) == Some(LEN),
        format!("len {:?}", stored.get(slice_field::LEN)),
    );
    let pacing = (stored.get("pace"), stored.num("burst"));
    let expect_pacing = match pace {
        Some(b) => (Some("1"), Some(b)),
        None => (None, None),
    };
    check(
        pacing == expect_pacing,
        format!("pace/burst {pacing:?}, expected {expect_pacing:?}"),
    );
    check(
        stored.expire_at == keep,
        format!("expires at {}, expected {keep}", stored.expire_at),
    );
    let (pttl, (s, us)): (i64, (i64, i64)) = redis::pipe()
        .cmd("PTTL")
        .arg(keys.slice(task, start))
        .cmd("TIME")
        .query_async(c)
        .await
        .expect("PTTL");
    let left = keep - (s * 1000 + us / 1000);
    check(
        (pttl - left).abs() <= 20,
        format!("PTTL {pttl}, expected about {left}"),
    );
    check(
        meta == meta_before,
        format!("the meta changed: {meta_before:?} → {meta:?}"),
    );
    // A second call decides from what the first left: the slice is not made again.
    let (again, t2) = call(c, keys, task, op, start, LEN, case.want, "r2").await;
    let in_log = if op == Op::Slide && matches!(expect, Answer::Granted { .. }) {
        want
    } else {
        0
    };
    let (expect2, _) = decide(op, pace, cap, rem, t2, start, LEN, want, in_log);
    if in_window(t2 / 1000, start, LEN) {
        check(
            again == expect2,
            format!("second call answered {again:?}, expected {expect2:?}"),
        );
    }
    Ok(bad)
}

/// Every rule, through PULL, TAKE and SLIDE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_slice_is_made_from_the_meta_exactly_when_the_rules_allow() {
    let t0 = Instant::now();
    let ns = unique_ns("lazytable");
    let keys = Keys::new(&ns).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    let mut bad = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        for op in [Op::Pull, Op::Take, Op::Slide] {
            if case.want == 0 && op != Op::Pull {
                // TAKE and SLIDE of 0 fail in Redis (`HINCRBY rem -0`: "-0" is no integer),
                // lazy or not; the SDK never sends them (a cost of 0 is admitted locally).
                continue;
            }
            let mut done = false;
            for attempt in 0..5 {
                let task = format!("c{i}{op:?}{attempt}");
                if let Ok(b) = table_case(&mut c, &keys, &task, case, op).await {
                    bad.extend(b);
                    done = true;
                    break;
                }
            }
            assert!(
                done,
                "{} / {op:?}: five calls fell outside the assumed time window",
                case.what
            );
        }
    }
    eprintln!(
        "lazy table: {} cases × 3 scripts in {:?}",
        CASES.len(),
        t0.elapsed()
    );
    assert!(
        bad.is_empty(),
        "{} failures:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

// ──────────────────────────── the model and its property ────────────────────────────

/// A slice as the model holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MSlice {
    cap: i64,
    rem: i64,
    term: i64,
    expire_at: i64,
}

/// What the meta and the slices of one task must be after the accepted writes.
#[derive(Debug, Clone, Default)]
struct Model {
    /// The fence's term.
    term: Option<i64>,
    rolled_to: Option<i64>,
    retired: Option<i64>,
    /// The meta fields (`slice_ms` = [`LEN`], …) were written (a full roll).
    spec: bool,
    /// The lazy window as last accepted.
    lazy: Option<LazyWindow>,
    slices: BTreeMap<i64, MSlice>,
    /// SLIDE's log: admissions (Redis time µs, n).
    log: Vec<(i64, i64)>,
}

impl Model {
    /// Whether the meta vouches for the missing slice at `start` (slices of `len`) at Redis
    /// time `now` (ms): [`scripts::LAZY_LUA`]'s rule.
    fn vouches(&self, start: i64, len: i64) -> Option<LazyWindow> {
        let w = self.lazy?;
        (self.retired.is_none()
            && self.spec
            && len == LEN
            && start % len == 0
            && start >= w.from_ms
            && start + len <= w.until_ms)
            .then_some(w)
    }

    /// A ROLL by `term`: what it must answer, the model changed as it must change.
    #[allow(clippy::too_many_arguments)]
    fn roll(
        &mut self,
        term: i64,
        full: bool,
        expect: i64,
        new_rolled: i64,
        slices: &[SliceWrite],
        lazy: Option<LazyWindow>,
        allowed: &mut BTreeMap<i64, BTreeSet<i64>>,
    ) -> RollOutcome {
        if let Some(t) = self.term.filter(|t| *t > term) {
            return RollOutcome::Refused(FenceRefusal::Newer { term: t, age_ms: 0 });
        }
        if !full {
            if self.term.is_none() || self.retired.is_some() || self.rolled_to.unwrap_or(0) < expect
            {
                return RollOutcome::NeedFull;
            }
        } else if let Some(r) = self.retired.filter(|r| *r >= VERSION) {
            return RollOutcome::Retired { revision: r };
        }
        // A full write leaving the task lazy (no slices) only over no meta at all or a live
        // lazy meta of this version: slices there could hold other caps.
        if full
            && lazy.is_some()
            && slices.is_empty()
            && self.term.is_some()
            && (self.retired.is_some() || !self.spec || self.lazy.is_none())
        {
            return RollOutcome::NotLazy;
        }
        if full {
            self.spec = true;
            self.retired = None;
        }
        if full || new_rolled > self.rolled_to.unwrap_or(0) {
            self.rolled_to = Some(new_rolled);
        }
        self.term = Some(term);
        let mut written = 0;
        for s in slices {
            let cap = s.cap as i64;
            allowed.entry(s.start_ms).or_default().insert(cap);
            match self.slices.get_mut(&s.start_ms) {
                None => {
                    self.slices.insert(
                        s.start_ms,
                        MSlice {
                            cap,
                            rem: cap,
                            term,
                            expire_at: s.expire_at_ms,
                        },
                    );
                    written += 1;
                }
                Some(m) => {
                    if m.cap != cap {
                        m.rem += cap - m.cap;
                        m.cap = cap;
                        m.term = term;
                        written += 1;
                    }
                    m.expire_at = m.expire_at.max(s.expire_at_ms);
                }
            }
        }
        self.lazy = lazy;
        RollOutcome::Written(written)
    }

    /// A worker's `op` at Redis time `now_us`: what it must answer, and whether it made the
    /// slice.
    fn work(
        &mut self,
        op: Op,
        start: i64,
        len: i64,
        want: i64,
        now_us: i64,
        allowed: &mut BTreeMap<i64, BTreeSet<i64>>,
    ) -> (Answer, bool) {
        let now = now_us / 1000;
        let mut made = false;
        if !self.slices.contains_key(&start) {
            let Some(w) = self.vouches(start, len) else {
                return (Answer::Missing, false);
            };
            if !in_window(now, start, len) {
                // Vouched for, but not now: -2 as for an existing slice (SLIDE has no -2).
                let a = if matches!(op, Op::Slide) {
                    Answer::Missing
                } else {
                    Answer::Outside
                };
                return (a, false);
            }
            let cap = w.cap as i64;
            allowed.entry(start).or_default().insert(cap);
            self.slices.insert(
                start,
                MSlice {
                    cap,
                    rem: cap,
                    term: self.term.unwrap_or(0),
                    expire_at: start + len + w.expire_after_ms as i64,
                },
            );
            made = true;
        }
        let s = self.slices.get_mut(&start).unwrap();
        let window = len * 1000;
        let in_log = self
            .log
            .iter()
            .filter(|(t, _)| *t > now_us - window)
            .map(|(_, n)| n)
            .sum();
        let (answer, rem) = decide(op, None, s.cap, s.rem, now_us, start, len, want, in_log);
        s.rem = rem;
        if op == Op::Slide && matches!(answer, Answer::Granted { .. }) {
            self.log.push((now_us, want));
        }
        (answer, made)
    }
}

/// One step of a case. Times are in slices from the current one when the step runs.
#[derive(Debug, Clone)]
enum Step {
    /// Leader `term` leaves the task lazy: window [`from`, `from + span`) at `cap`, kept
    /// `keep_s` after a slice's end; no slices (as the manager). `behind`: it expects a
    /// `rolled_to` past the stored one (a non-full roll then needs a full one).
    Lazy {
        term: i64,
        full: bool,
        behind: bool,
        cap: u64,
        from: i64,
        span: i64,
        keep_s: i64,
    },
    /// Leader `term` rolls slices ahead (at, cap), kept `keep_s` after their end, no lazy
    /// window (deleting it). A key expiring later than that keeps its expiry.
    Eager {
        term: i64,
        full: bool,
        behind: bool,
        slices: Vec<(i64, u64)>,
        keep_s: i64,
    },
    /// A worker's call of the slice `at` (slices of `len`, half a slice off the grid).
    Work {
        op: Op,
        at: i64,
        len: i64,
        off_grid: bool,
        want: u64,
    },
    /// `retired = revision` written into the meta by hand.
    Retire { revision: i64 },
    /// The slice `at` deleted (as it expires).
    Del { at: i64 },
}

/// xorshift64: `next(n)` in `0..n`.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // splitmix64 of the seed: nearby seeds give unrelated streams.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The steps of one case. Leader 1 rolls until step `switch`, leader 2 (the newer term) after
/// it, and leader 1, deposed, still sends a roll now and then; the first step is a full lazy
/// roll (a new leader's first write), so most cases have a task to work on.
fn draw_case(rng: &mut Rng, steps: usize) -> Vec<Step> {
    let switch = 3 + rng.next(steps as u64 + 5) as usize;
    (0..steps)
        .map(|i| {
            let term = match i >= switch {
                true if rng.next(4) == 0 => 1,
                true => 2,
                false => 1,
            };
            let full = i == 0 || rng.next(3) == 0;
            draw(rng, term, full, i == 0)
        })
        .collect()
}

fn draw(rng: &mut Rng, term: i64, full: bool, first: bool) -> Step {
    match if first { 0 } else { rng.next(100) } {
        0..28 => Step::Lazy {
            term,
            full,
            behind: rng.next(10) == 0,
            cap: rng.next(21),
            from: [-2, -1, -1, 0, 0, 1][rng.next(6) as usize],
            span: [0, 1, 2, 2, 3, 3, 4][rng.next(7) as usize],
            keep_s: 10 + rng.next(20) as i64,
        },
        28..38 => {
            let mut at: Vec<i64> = (-1..=2).filter(|_| rng.next(2) == 0).collect();
            if at.is_empty() {
                at.push(rng.next(2) as i64);
            }
            Step::Eager {
                term,
                full,
                behind: rng.next(10) == 0,
                slices: at.into_iter().map(|a| (a, rng.next(21))).collect(),
                keep_s: [10, 20, 30][rng.next(3) as usize],
            }
        }
        38..88 => {
            let op = [Op::Pull, Op::Take, Op::Slide][rng.next(3) as usize];
            let at = [-1, 0, 0, 0, 1, 1, 1, 2][rng.next(8) as usize];
            let odd = rng.next(12);
            Step::Work {
                op,
                at,
                // SLIDE's window is its length: kept at one slice, the log is one window.
                len: if odd == 0 && op != Op::Slide {
                    2 * LEN
                } else {
                    LEN
                },
                off_grid: odd == 1,
                want: rng.next(16) + u64::from(op != Op::Pull),
            }
        }
        // A deletion newer than the spec (the task stays retired) or older (a full roll of
        // the spec brings it back).
        88..91 => Step::Retire {
            revision: [5, 5, 5, 50][rng.next(4) as usize],
        },
        _ => Step::Del {
            at: rng.next(4) as i64 - 1,
        },
    }
}

/// The meta and the slices at `starts`: compared whole around a write that must change nothing.
async fn snapshot(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    starts: &[i64],
) -> (Stored, Vec<Stored>) {
    (
        read_meta(c, keys, task).await,
        read_slices(c, keys, task, starts).await,
    )
}

/// What the runner tracks besides the model, from the scripts' answers alone.
#[derive(Default)]
struct Ledger {
    /// Per slice start: every cap an accepted eager roll wrote for it, and every `lz_cap` in
    /// force when a worker made it.
    allowed: BTreeMap<i64, BTreeSet<i64>>,
    /// Per existing slice: granted since it was made, and the largest cap it has held.
    granted: BTreeMap<i64, (i64, i64)>,
}

/// Checks Redis against the model (and the ledger's safety rules) at the slices `starts`.
async fn verify(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    model: &Model,
    ledger: &mut Ledger,
    starts: &[i64],
) -> Result<(), String> {
    let meta = read_meta(c, keys, task).await;
    let lz = match (
        meta.num(meta_field::LZ_CAP),
        meta.num(meta_field::LZ_FROM),
        meta.num(meta_field::LZ_UNTIL),
        meta.num(meta_field::LZ_EXP),
    ) {
        (Some(cap), Some(from_ms), Some(until_ms), Some(exp)) => Some(LazyWindow {
            cap: cap as u64,
            from_ms,
            until_ms,
            expire_after_ms: exp as u64,
            fence_ttl_ms: 0,
        }),
        (None, None, None, None) => None,
        other => return Err(format!("lz fields half there: {other:?}")),
    };
    let got = (
        lz,
        meta.num(meta_field::TERM),
        meta.num(meta_field::ROLLED_TO),
        meta.num(meta_field::RETIRED),
        meta.num(meta_field::SLICE_MS),
    );
    let want = (
        model.lazy,
        model.term,
        model.rolled_to,
        model.retired,
        model.spec.then_some(LEN),
    );
    if got != want {
        return Err(format!(
            "meta (lazy, term, rolled_to, retired, slice_ms) is {got:?}, model {want:?}"
        ));
    }
    for (s, st) in starts.iter().zip(read_slices(c, keys, task, starts).await) {
        let m = model.slices.get(s);
        if st.fields.is_empty() {
            if let Some(m) = m {
                return Err(format!("slice {s} missing, model {m:?}"));
            }
            ledger.granted.remove(s);
            continue;
        }
        let Some(m) = m else {
            return Err(format!("slice {s} exists, not in the model: {st:?}"));
        };
        let cap = st.num(slice_field::CAP).unwrap_or(i64::MIN);
        let rem = st.num(slice_field::REM).unwrap_or(i64::MIN);
        let got = MSlice {
            cap,
            rem,
            term: st.num(slice_field::TERM).unwrap_or(i64::MIN),
            expire_at: st.expire_at,
        };
        if got != *m || st.num(slice_field::LEN) != Some(LEN) || st.get("pace").is_some() {
            return Err(format!("slice {s} is {st:?}, model {m:?}"));
        }
        // Safety, from the answers alone: the cap is one a leader wrote or vouched for, and
        // what was granted from the slice is what left it, never more than it ever held.
        if !ledger.allowed.get(s).is_some_and(|a| a.contains(&cap)) {
            return Err(format!(
                "slice {s} has cap {cap}, none a leader wrote or vouched for ({:?})",
                ledger.allowed.get(s)
            ));
        }
        let (granted, max_cap) = ledger.granted.entry(*s).or_insert((0, cap));
        *max_cap = (*max_cap).max(cap);
        if rem != cap - *granted || *granted > *max_cap {
            return Err(format!(
                "slice {s}: cap {cap}, rem {rem}, but {granted} granted (largest cap {max_cap})"
            ));
        }
    }
    Ok(())
}

/// Runs one case of `steps` on `task`; `log` gets a line per step.
async fn run_case(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    steps: &[Step],
    log: &mut Vec<String>,
    stats: &mut BTreeMap<String, u64>,
) -> Result<(), String> {
    let mut model = Model::default();
    let mut ledger = Ledger::default();
    for (i, step) in steps.iter().enumerate() {
        let cur = slice::start(redis_ms(c).await, LEN as u64);
        let mut starts: BTreeSet<i64> = model.slices.keys().copied().collect();
        starts.extend((-3..=4).map(|k| cur + k * LEN));
        let outcome = match step {
            Step::Lazy {
                term,
                full,
                behind,
                cap,
                from,
                span,
                keep_s,
            } => {
                let from_ms = cur + from * LEN;
                let w = LazyWindow {
                    cap: *cap,
                    from_ms,
                    until_ms: from_ms + span * LEN,
                    expire_after_ms: *keep_s as u64 * 1000,
                    fence_ttl_ms: 0,
                };
                let expect = model.rolled_to.unwrap_or(0) + if *behind { 5 * LEN } else { 0 };
                let new = if *full { cur } else { expect };
                roll_step(
                    c,
                    keys,
                    task,
                    &mut model,
                    &mut ledger,
                    *term,
                    *full,
                    expect,
                    new,
                    &[],
                    Some(w),
                    &starts,
                )
                .await?
            }
            Step::Eager {
                term,
                full,
                behind,
                slices,
                keep_s,
            } => {
                let writes: Vec<SliceWrite> = slices
                    .iter()
                    .map(|(at, cap)| SliceWrite {
                        start_ms: cur + at * LEN,
                        cap: *cap,
                        expire_at_ms: cur + (at + 1) * LEN + keep_s * 1000,
                    })
                    .collect();
                let expect = model.rolled_to.unwrap_or(0) + if *behind { 5 * LEN } else { 0 };
                let new = cur + (slices.last().map_or(0, |s| s.0) + 1) * LEN;
                roll_step(
                    c,
                    keys,
                    task,
                    &mut model,
                    &mut ledger,
                    *term,
                    *full,
                    expect,
                    new,
                    &writes,
                    None,
                    &starts,
                )
                .await?
            }
            Step::Work {
                op,
                at,
                len,
                off_grid,
                want,
            } => {
                let start = cur + at * LEN + if *off_grid { LEN / 2 } else { 0 };
                starts.insert(start);
                let rid = format!("r{i}");
                let (got, now_us) = call(c, keys, task, *op, start, *len, *want, &rid).await;
                let had = model.slices.contains_key(&start);
                let vouched = !had
                    && model.vouches(start, *len).is_some()
                    && in_window(now_us / 1000, start, *len);
                let in_log: i64 = model
                    .log
                    .iter()
                    .filter(|(t, _)| *t > now_us - len * 1000)
                    .map(|(_, n)| n)
                    .sum();
                let (expect, made) =
                    model.work(*op, start, *len, *want as i64, now_us, &mut ledger.allowed);
                let kind = format!("{got:?}");
                let kind = kind.split([' ', '{']).next().unwrap_or_default();
                *stats.entry(format!("{op:?} {kind}")).or_default() += 1;
                if made {
                    *stats.entry(format!("{op:?} made the slice")).or_default() += 1;
                }
                // Liveness: a missing slice the meta vouches for is made, and a want within
                // its cap is granted whole (SLIDE: when the log leaves room).
                if vouched {
                    let cap = model.slices[&start].cap;
                    let room = *op != Op::Slide || in_log + *want as i64 <= cap;
                    let whole =
                        matches!(got, Answer::Granted { granted, .. } if granted == *want as i64);
                    if got == Answer::Missing || (*want as i64 <= cap && room && !whole) {
                        return Err(format!(
                            "liveness: slice {start} vouched at {} ms (window {:?}), answered \
                             {got:?}",
                            now_us / 1000,
                            model.lazy
                        ));
                    }
                }
                if made {
                    ledger.granted.insert(start, (0, model.slices[&start].cap));
                }
                if got != expect {
                    return Err(format!(
                        "{op:?} of slice {start} (len {len}) at {} µs answered {got:?}, model \
                         {expect:?}",
                        now_us
                    ));
                }
                if let Answer::Granted { granted, .. } = got {
                    ledger.granted.entry(start).or_insert((0, 0)).0 += granted;
                }
                format!("start {start} at {} ms: {got:?}", now_us / 1000)
            }
            Step::Retire { revision } => {
                let _: () = redis::cmd("HSET")
                    .arg(keys.meta(task))
                    .arg(meta_field::RETIRED)
                    .arg(revision)
                    .query_async(c)
                    .await
                    .expect("HSET retired");
                model.retired = Some(*revision);
                String::new()
            }
            Step::Del { at } => {
                let start = cur + at * LEN;
                let _: () = redis::cmd("DEL")
                    .arg(keys.slice(task, start))
                    .query_async(c)
                    .await
                    .expect("DEL");
                model.slices.remove(&start);
                ledger.granted.remove(&start);
                String::new()
            }
        };
        if matches!(step, Step::Lazy { .. } | Step::Eager { .. }) {
            let kind = outcome.split(['(', ' ']).next().unwrap_or_default();
            *stats.entry(format!("roll {kind}")).or_default() += 1;
        }
        log.push(format!("{i:2} cur {cur}: {step:?} → {outcome}"));
        let starts: Vec<i64> = starts.into_iter().collect();
        verify(c, keys, task, &model, &mut ledger, &starts)
            .await
            .map_err(|e| format!("after step {i}: {e}"))?;
    }
    Ok(())
}

/// A roll step: the script's answer against the model's; a refused write changed nothing.
#[allow(clippy::too_many_arguments)]
async fn roll_step(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    model: &mut Model,
    ledger: &mut Ledger,
    term: i64,
    full: bool,
    expect_rolled_to: i64,
    new_rolled_to: i64,
    slices: &[SliceWrite],
    lazy: Option<LazyWindow>,
    starts: &BTreeSet<i64>,
) -> Result<String, String> {
    let starts: Vec<i64> = starts.iter().copied().collect();
    let before = snapshot(c, keys, task, &starts).await;
    let mut m = pooled_meta(100, LEN as u64, false, 0);
    m.version = VERSION;
    let f = fence(term);
    let req = RollRequest {
        task,
        fence: &f,
        full,
        expect_rolled_to,
        spec_version: VERSION,
        new_rolled_to,
        force: false,
        refresh: lazy.is_some(),
        meta: full.then_some(&m),
        meta_extra: &[],
        slices,
        lazy: lazy.as_ref(),
    };
    let got = scripts::roll(c, keys, &req).await.expect("roll");
    let expect = model.roll(
        term,
        full,
        expect_rolled_to,
        new_rolled_to,
        slices,
        lazy,
        &mut ledger.allowed,
    );
    let agree = match (&got, &expect) {
        (
            RollOutcome::Refused(FenceRefusal::Newer { term: a, age_ms }),
            RollOutcome::Refused(FenceRefusal::Newer { term: b, .. }),
        ) => a == b && (0..STALE_AFTER_MS as i64).contains(age_ms),
        (a, b) => a == b,
    };
    if !agree {
        return Err(format!(
            "roll by term {term} (full {full}) answered {got:?}, model {expect:?}"
        ));
    }
    if !matches!(got, RollOutcome::Written(_)) {
        let after = snapshot(c, keys, task, &starts).await;
        if after != before {
            return Err(format!(
                "a refused roll ({got:?}) changed the task: {before:?} → {after:?}"
            ));
        }
    }
    Ok(format!("{got:?}"))
}

/// Leaders of terms 1 and 2 rolling a task lazy or ahead, workers pulling, taking and sliding
/// the current and next slices, hand retirements and expiries: Redis always holds what the
/// model says, every slice's cap is one a leader wrote or vouched for, no slice grants more
/// than it held, a stale leader changes nothing, and a vouched slice is always made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_slices_follow_the_model() {
    const STEPS: usize = 30;
    const BUDGET: Duration = Duration::from_secs(40);
    let replay: Option<u64> = std::env::var("SLUICE_LAZY_SEED")
        .ok()
        .map(|s| s.parse().expect("SLUICE_LAZY_SEED: an integer"));
    let cases: u64 = match replay {
        Some(_) => 1,
        None => std::env::var("SLUICE_LAZY_CASES")
            .ok()
            .map_or(200, |s| s.parse().expect("SLUICE_LAZY_CASES: an integer")),
    };
    let base = replay.unwrap_or_else(|| now_ms() as u64 ^ 0x5EED_1A2B_3C4D_5E6F);
    eprintln!("lazy model: base seed {base}, {cases} cases of {STEPS} steps");
    let ns = unique_ns("lazymodel");
    let keys = Keys::new(&ns).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    let t0 = Instant::now();
    let mut ran = 0;
    let mut stats = BTreeMap::new();
    for i in 0..cases {
        if t0.elapsed() > BUDGET {
            eprintln!("lazy model: time budget spent, stopping after {ran} cases");
            break;
        }
        let seed = if replay.is_some() {
            base
        } else {
            base.wrapping_add(i.wrapping_mul(0x9E37_79B9))
        };
        let mut rng = Rng::new(seed);
        let steps = draw_case(&mut rng, STEPS);
        let mut log = Vec::new();
        let task = format!("p{i}");
        if let Err(e) = run_case(&mut c, &keys, &task, &steps, &mut log, &mut stats).await {
            panic!(
                "lazy model: case {i} failed (replay: SLUICE_LAZY_SEED={seed}): {e}\nsteps:\n{}\n\
                 ran:\n{}",
                steps
                    .iter()
                    .enumerate()
                    .map(|(i, s)| format!("{i:2} {s:?}"))
                    .collect::<Vec<_>>()
                    .join("\n"),
                log.join("\n")
            );
        }
        ran += 1;
    }
    eprintln!(
        "lazy model: {ran} cases (base seed {base}) in {:?}; steps taken: {stats:?}",
        t0.elapsed()
    );
    assert!(ran > 0, "no case ran");
}

/// Workers under the documented least-privilege ACL (`deploy/redis-acl.conf`, namespace
/// substituted: they may read the meta, `%R~NS:{*}:meta`, never write it) make a lazy task's
/// slice through PULL, TAKE and SLIDE, and pull from a slice rolled ahead; Redis's `ACL LOG`
/// records no denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_under_the_documented_acl_make_lazy_slices() {
    let ns = unique_ns("lazyacl");
    let keys = Keys::new(&ns).unwrap();
    let doc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/redis-acl.conf");
    let text = std::fs::read_to_string(&doc).expect("deploy/redis-acl.conf");
    let line = text
        .lines()
        .find(|l| l.starts_with("user sluice-worker "))
        .expect("the worker user in deploy/redis-acl.conf")
        .replace("sluice:", &format!("{ns}:"));
    let user = format!("w-{ns}");
    let mut admin = redis_conn(&shared_redis());
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg(&user);
    for w in line.split_whitespace().skip(2) {
        setuser.arg(if w == ">CHANGE-ME" { ">pw-lazy-acl" } else { w });
    }
    let () = setuser.query(&mut admin).expect("ACL SETUSER");
    let url = shared_redis().replacen("redis://", &format!("redis://{user}:pw-lazy-acl@"), 1);
    let mut worker = redis::Client::open(url)
        .expect("worker url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect as the worker user");
    // The user works: it reads a meta.
    let _: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(keys.meta("Pull"))
        .arg(meta_field::SLICE_MS)
        .query_async(&mut worker)
        .await
        .expect("the worker user reads the meta");
    let mut c = protocol_conn(&shared_redis()).await;
    let mut m = pooled_meta(100, LEN as u64, false, 0);
    m.version = VERSION;
    let cur = slice::start(redis_ms(&mut c).await, LEN as u64);
    let start = cur + LEN;
    let window = LazyWindow {
        cap: 9,
        from_ms: cur - LEN,
        until_ms: cur + 4 * LEN,
        expire_after_ms: LAZY_KEEP_MS as u64,
        fence_ttl_ms: 0,
    };
    let mut got = Vec::new();
    for op in [Op::Pull, Op::Take, Op::Slide] {
        let task = format!("{op:?}");
        let out = roll_lazy(&mut c, &keys, &task, &m, &[], &window).await;
        assert_eq!(out, RollOutcome::Written(0));
        let r = try_call(&mut worker, &keys, &task, op, start, LEN, 5, "r1").await;
        got.push((
            format!("lazy {op:?}"),
            r.map(|(a, _)| a).map_err(|e| e.to_string()),
        ));
    }
    // A slice rolled ahead, pulled as before protocol 5.
    let eager = [SliceWrite {
        start_ms: start,
        cap: 9,
        expire_at_ms: start + LEN + EAGER_KEEP_MS,
    }];
    let out = roll_lazy(&mut c, &keys, "eager", &m, &eager, &window).await;
    assert_eq!(out, RollOutcome::Written(1));
    let r = try_call(&mut worker, &keys, "eager", Op::Pull, start, LEN, 5, "r1").await;
    got.push((
        "rolled ahead Pull".into(),
        r.map(|(a, _)| a).map_err(|e| e.to_string()),
    ));
    let denials: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query(&mut admin)
        .expect("ACL LOG");
    let () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query::<i64>(&mut admin)
        .map(|_| ())
        .expect("ACL DELUSER");
    let denied = format!("{denials:?}");
    let expect = Answer::Granted {
        granted: 5,
        remaining: 4,
        cap: 9,
    };
    let wrong: Vec<_> = got.iter().filter(|(_, r)| *r != Ok(expect)).collect();
    assert!(
        wrong.is_empty(),
        "as the documented worker user: {wrong:?} (expected {expect:?}); ACL LOG mentions this \
         namespace: {}",
        denied.contains(&ns)
    );
    assert!(!denied.contains(&ns), "ACL LOG: {denied}");
}

/// A ROLL of `task` by a leader of `epoch` and `term` whose fence goes stale after `stale_ms`:
/// in full (meta `m`) or not, with or without a lazy window.
#[allow(clippy::too_many_arguments)]
async fn roll_as(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    (epoch, term, stale_ms): (u64, i64, u64),
    m: &sluice_protocol::TaskMeta,
    full: bool,
    rolled_to: i64,
    window: Option<&LazyWindow>,
) -> RollOutcome {
    let f = Fence {
        term,
        epoch,
        stale_after_ms: stale_ms,
    };
    let req = RollRequest {
        task,
        fence: &f,
        full,
        expect_rolled_to: rolled_to,
        spec_version: VERSION,
        new_rolled_to: rolled_to,
        force: false,
        refresh: true,
        meta: full.then_some(m),
        meta_extra: &[],
        slices: &[],
        lazy: window,
    };
    scripts::roll(c, keys, &req).await.expect("roll")
}

/// Issue 27: a lazy task's fence is refreshed every `lazy_refresh` (up to 30 s), not every
/// quarter of `stale_after`, so its meta says how long it holds (`fence_ttl`). Another epoch (a
/// second manager cluster) or an older term is refused until that has passed, though the
/// callers' own `stale_after` has; then taken over. Rolled ahead again, the task's fence has
/// the callers' `stale_after` again, claimed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_fence_holds_for_its_ttl_and_an_eager_write_gives_it_back() {
    let keys = Keys::new(&unique_ns("lazyttl")).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    let mut m = pooled_meta(100, LEN as u64, false, 0);
    m.version = VERSION;
    const STALE: u64 = 300;
    const TTL: u64 = 2_500;
    let ours = (EPOCH, TERM, STALE);
    let foreign = (EPOCH + 1, 1, STALE);
    let older = (EPOCH, TERM - 1, STALE);
    let cur = slice::start(redis_ms(&mut c).await, LEN as u64);
    let window = LazyWindow {
        cap: 9,
        from_ms: cur - LEN,
        until_ms: cur + 60 * LEN,
        expire_after_ms: LAZY_KEEP_MS as u64,
        fence_ttl_ms: TTL,
    };
    let fence_fields = async |c: &mut RedisConn, task: &str| -> (Option<String>, Option<i64>) {
        let (ttl, at): (Option<String>, Option<i64>) = redis::cmd("HMGET")
            .arg(keys.meta(task))
            .arg(meta_field::FENCE_TTL)
            .arg(meta_field::FENCED_MS)
            .query_async(c)
            .await
            .expect("HMGET");
        (ttl, at)
    };

    // Lazy, with its ttl: refused to both past `stale_after`, taken over past the ttl.
    let task = "lazy";
    let w = roll_as(&mut c, &keys, task, ours, &m, true, cur, Some(&window)).await;
    assert_eq!(w, RollOutcome::Written(0));
    let (ttl, claimed) = fence_fields(&mut c, task).await;
    assert_eq!(
        ttl.as_deref(),
        Some("2500"),
        "the fence's lifetime is stored"
    );
    let claimed = claimed.expect("fenced_ms");
    tokio::time::sleep(Duration::from_millis(2 * STALE)).await;
    let mut judged = 0;
    for (who, f) in [("another epoch", foreign), ("an older term", older)] {
        let r = roll_as(&mut c, &keys, task, f, &m, true, cur, None).await;
        let now = redis_ms(&mut c).await;
        if now - claimed < TTL as i64 {
            judged += 1;
            assert!(
                matches!(r, RollOutcome::Refused(_)),
                "{who} past stale_after but within fence_ttl: refused, got {r:?}"
            );
        }
    }
    assert!(
        judged > 0,
        "the machine was too slow to call within fence_ttl ({TTL} ms)"
    );
    // Past the ttl (by Redis time): the foreign cluster takes the task over.
    while redis_ms(&mut c).await - claimed <= TTL as i64 + 50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = roll_as(&mut c, &keys, task, foreign, &m, true, cur, None).await;
    assert_eq!(
        r,
        RollOutcome::Written(0),
        "a fence past its ttl is taken over"
    );
    let (ttl, _) = fence_fields(&mut c, task).await;
    assert_eq!(ttl, None, "an eager takeover deletes the lifetime");

    // Woken: the eager write (no window) claims the fence with the callers' stale_after, so
    // the other epoch takes it over past stale_after, not past the old ttl.
    let task = "woken";
    let w = roll_as(&mut c, &keys, task, ours, &m, true, cur, Some(&window)).await;
    assert_eq!(w, RollOutcome::Written(0));
    let (_, lazy_claim) = fence_fields(&mut c, task).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Not full, no refresh of the window, rolled_to unchanged: only the ttl changes.
    let f = Fence {
        term: TERM,
        epoch: EPOCH,
        stale_after_ms: STALE,
    };
    let req = RollRequest {
        task,
        fence: &f,
        full: false,
        expect_rolled_to: cur,
        spec_version: VERSION,
        new_rolled_to: cur,
        force: false,
        refresh: false,
        meta: None,
        meta_extra: &[],
        slices: &[],
        lazy: None,
    };
    let r = scripts::roll(&mut c, &keys, &req).await.expect("roll");
    assert_eq!(r, RollOutcome::Written(0));
    let (ttl, eager_claim) = fence_fields(&mut c, task).await;
    assert_eq!(ttl, None, "rolled ahead: no lifetime");
    assert!(
        eager_claim > lazy_claim,
        "dropping the lifetime claims the fence anew ({eager_claim:?} after {lazy_claim:?})"
    );
    let eager_claim = eager_claim.expect("fenced_ms");
    while redis_ms(&mut c).await - eager_claim <= STALE as i64 + 50 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = roll_as(&mut c, &keys, task, foreign, &m, true, cur, None).await;
    assert!(
        redis_ms(&mut c).await - eager_claim < TTL as i64,
        "the machine was too slow to tell stale_after from the old ttl"
    );
    assert_eq!(r, RollOutcome::Written(0), "stale after stale_after again");

    // Values a leader never writes: what does not parse counts as none (the callers'
    // stale_after), what is too large counts as 10 minutes.
    for (i, (stored, holds)) in [
        ("abc", false),
        ("nan", false),
        ("-5", false),
        ("", false),
        ("inf", true),
        ("1e300", true),
        ("600001", true),
    ]
    .into_iter()
    .enumerate()
    {
        let task = format!("hostile{i}");
        let w = roll_as(&mut c, &keys, &task, ours, &m, true, cur, None).await;
        assert_eq!(w, RollOutcome::Written(0));
        let () = redis::cmd("HSET")
            .arg(keys.meta(&task))
            .arg(meta_field::FENCE_TTL)
            .arg(stored)
            .query_async(&mut c)
            .await
            .expect("HSET");
        let (_, at) = fence_fields(&mut c, &task).await;
        let at = at.expect("fenced_ms");
        while redis_ms(&mut c).await - at <= STALE as i64 + 50 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let r = roll_as(&mut c, &keys, &task, foreign, &m, true, cur, None).await;
        if holds {
            assert!(
                matches!(r, RollOutcome::Refused(_)),
                "fence_ttl {stored:?}: held (10 minutes), got {r:?}"
            );
        } else {
            assert_eq!(
                r,
                RollOutcome::Written(0),
                "fence_ttl {stored:?}: the callers' stale_after"
            );
        }
    }
}
