//! The exact modes' scripts against a real Redis (`SLUICE_TEST_REDIS`) and plain models.
//!
//! * `TAKE` (`exact_fixed`): a slice holds `rem`; a call for `n` is admitted iff `rem ≥ n`.
//! * `SLIDE` (`exact_sliding`): admitted iff the admissions with Redis time in
//!   `(now − window, now]` plus `n` are at most the slice's `cap`, and the slice's `rem ≥ n`.
//!   The script decides on Redis `TIME` and answers it, so the model replays the same times:
//!   deterministic without controlling Redis's clock.
//!
//! Properties, on randomized sequences of costs `1 … cap + 1`, pauses and retries (seeded
//! through `sluice_testkit::prop_config`):
//!
//! | property | cases | checks |
//! |---|---|---|
//! | `prop_take_sequential` | 24 | every answer equals the model's (safety and liveness); a retry with the same request id never takes twice; `adm`/`rej`/`rem` add up |
//! | `prop_take_concurrent` | 12 | 4 connections, retries sent concurrently with their originals: admitted ≤ cap, each request id charged at most once, every refused cost did not fit what was left |
//! | `prop_slide_sequential` | 10 | every answer equals the model's, on the Redis times it reports; retry-after never earlier than the model's earliest success; retries never charge twice |
//! | `prop_slide_concurrent` | 6 | 4 connections: every window of Redis time holds at most `cap`; no refusal where even the most the log could hold left room; each request id charged once |

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use redis::aio::MultiplexedConnection;
use sluice_protocol::Keys;
use sluice_protocol::scripts::{self, ExactReply};
use sluice_testkit::prop_config;
use sluice_tests::*;

const TASK: &str = "ex";

struct World {
    rt: tokio::runtime::Runtime,
    keys: Keys,
    url: String,
}

impl World {
    fn new(prefix: &str) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        Self {
            rt,
            keys: Keys::new(&unique_ns(prefix)).unwrap(),
            url: shared_redis(),
        }
    }

    async fn conn(&self) -> MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

/// Redis `TIME` in Unix ms.
async fn redis_ms(c: &mut MultiplexedConnection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(c).await.unwrap();
    s * 1_000 + us / 1_000
}

/// A fresh slice hash for `start` (and an empty log), as the leader rolls it.
async fn slice(w: &World, c: &mut MultiplexedConnection, start: i64, cap: u64, rem: u64) {
    let k = w.keys.slice(TASK, start);
    let _: () = redis::pipe()
        .del(&k)
        .del(w.keys.sliding_log(TASK))
        .del(w.keys.sliding_log_seq(TASK))
        .hset_multiple(&k, &[("cap", cap), ("rem", rem), ("adm", 0), ("rej", 0)])
        .pexpire(&k, 120_000)
        .query_async(c)
        .await
        .unwrap();
}

async fn fields(w: &World, c: &mut MultiplexedConnection, start: i64) -> (i64, u64, u64) {
    redis::cmd("HMGET")
        .arg(w.keys.slice(TASK, start))
        .arg("rem")
        .arg("adm")
        .arg("rej")
        .query_async(c)
        .await
        .unwrap()
}

/// A slice whose window is open for the whole case: start at Redis now, one minute long.
const LEN_MS: u64 = 60_000;

/// One call of a sequence: a cost, or a retry of an earlier call (its index, modulo).
#[derive(Debug, Clone)]
enum Call {
    New(u64),
    Retry(usize),
}

fn calls(cap: u64, max: usize) -> impl Strategy<Value = Vec<Call>> {
    prop::collection::vec(
        prop_oneof![
            5 => (1..=cap + 1).prop_map(Call::New),
            1 => any::<usize>().prop_map(Call::Retry),
        ],
        1..max,
    )
}

fn fail(s: String) -> TestCaseError {
    TestCaseError::fail(s)
}

#[test]
fn prop_take_sequential() {
    let w = World::new("exts");
    let strategy = (1u64..=30).prop_flat_map(|cap| (Just(cap), calls(cap, 40)));
    let mut runner = TestRunner::new(prop_config("exact take sequential", 24));
    runner
        .run(&strategy, |(cap, calls)| {
            w.rt.block_on(async {
                let mut c = w.conn().await;
                let start = redis_ms(&mut c).await;
                slice(&w, &mut c, start, cap, cap).await;
                let mut rem = cap;
                let (mut adm, mut rej) = (0u64, 0u64);
                // Per call: (request id, cost, admitted so far).
                let mut sent: Vec<(String, u64, bool)> = Vec::new();
                for (k, call) in calls.iter().enumerate() {
                    let (i, retry) = match call {
                        Call::New(n) => {
                            sent.push((format!("t{k}"), *n, false));
                            (sent.len() - 1, false)
                        }
                        Call::Retry(j) if !sent.is_empty() => (j % sent.len(), true),
                        Call::Retry(_) => continue,
                    };
                    let (rid, n, before) = sent[i].clone();
                    let r = scripts::take(&mut c, &w.keys, TASK, start, LEN_MS, n, &rid)
                        .await
                        .unwrap();
                    let want = before || rem >= n;
                    let got = matches!(r, ExactReply::Admitted { .. });
                    if got != want {
                        return Err(fail(format!(
                            "call {k} ({rid}, n {n}, retry {retry}): {r:?}, model rem {rem}"
                        )));
                    }
                    if got && !before {
                        rem -= n;
                        adm += n;
                        sent[i].2 = true;
                    } else if !got {
                        rej += n;
                    }
                    if let ExactReply::Admitted { remaining, .. } = r
                        && remaining != rem as i64
                    {
                        return Err(fail(format!(
                            "call {k}: remaining {remaining}, model {rem}"
                        )));
                    }
                }
                let got = fields(&w, &mut c, start).await;
                if got != (rem as i64, adm, rej) {
                    return Err(fail(format!(
                        "slice (rem, adm, rej) {got:?}, model {:?}",
                        (rem, adm, rej)
                    )));
                }
                Ok(())
            })
        })
        .unwrap();
}

#[test]
fn prop_take_concurrent() {
    let w = World::new("extc");
    let strategy = (1u64..=40).prop_flat_map(|cap| {
        (
            Just(cap),
            prop::collection::vec(
                prop::collection::vec((1..=cap + 1, any::<bool>()), 1..12),
                4,
            ),
        )
    });
    let mut runner = TestRunner::new(prop_config("exact take concurrent", 12));
    runner
        .run(&strategy, |(cap, per_conn)| {
            w.rt.block_on(async {
                let mut c = w.conn().await;
                let start = redis_ms(&mut c).await;
                slice(&w, &mut c, start, cap, cap).await;
                let mut tasks = Vec::new();
                for (p, ops) in per_conn.into_iter().enumerate() {
                    for (k, (n, resend)) in ops.into_iter().enumerate() {
                        let rid = format!("c{p}:{k}");
                        // The original and, sometimes, a resend racing it on another connection.
                        for _ in 0..1 + resend as usize {
                            let (keys, rid) = (w.keys.clone(), rid.clone());
                            let mut conn = w.conn().await;
                            tasks.push(tokio::spawn(async move {
                                let r = scripts::take(&mut conn, &keys, TASK, start, LEN_MS, n, &rid)
                                    .await
                                    .unwrap();
                                (rid, n, r)
                            }));
                        }
                    }
                }
                let mut admitted: HashMap<String, u64> = HashMap::new();
                let mut refused = Vec::new();
                for t in tasks {
                    let (rid, n, r) = t.await.unwrap();
                    match r {
                        ExactReply::Admitted { .. } => {
                            admitted.insert(rid, n);
                        }
                        ExactReply::Refused { .. } => refused.push((rid, n)),
                        other => return Err(fail(format!("{rid}: {other:?}"))),
                    }
                }
                let total: u64 = admitted.values().sum();
                let (rem, adm, _) = fields(&w, &mut c, start).await;
                if total > cap || adm != total || rem != (cap - total) as i64 {
                    return Err(fail(format!(
                        "admitted {total} (distinct request ids) of {cap}; slice adm {adm}, rem {rem}"
                    )));
                }
                for (rid, n) in refused {
                    if !admitted.contains_key(&rid) && n <= rem as u64 {
                        return Err(fail(format!("{rid}: refused {n} with {rem} left at the end")));
                    }
                }
                Ok(())
            })
        })
        .unwrap();
}

/// The SLIDE model: admissions by Redis time (µs).
#[derive(Default)]
struct SlideModel {
    log: Vec<(i64, u64)>,
}

impl SlideModel {
    fn inside(&self, now: i64, window_us: i64) -> u64 {
        self.log
            .iter()
            .filter(|(t, _)| *t > now - window_us && *t <= now)
            .map(|x| x.1)
            .sum()
    }

    /// The earliest time ≥ now at which `n` fits (nothing else admitted meanwhile).
    fn earliest(&self, now: i64, window_us: i64, n: u64, cap: u64) -> Option<i64> {
        let mut t = now;
        let mut times: Vec<i64> = self
            .log
            .iter()
            .map(|x| x.0 + window_us)
            .filter(|e| *e > now)
            .collect();
        times.sort();
        loop {
            if self.inside(t, window_us) + n <= cap {
                return Some(t);
            }
            t = *times.iter().find(|e| **e > t)?;
        }
    }
}

#[test]
fn prop_slide_sequential() {
    let w = World::new("exss");
    let strategy = (1u64..=8, 40u64..=120, any::<bool>()).prop_flat_map(|(cap, win, tight)| {
        let pauses = prop::collection::vec(prop_oneof![3 => Just(0u64), 2 => 0..=win], 1..24);
        (Just(cap), Just(win), Just(tight), calls(cap, 24), pauses)
    });
    let mut runner = TestRunner::new(prop_config("exact slide sequential", 10));
    runner
        .run(&strategy, |(cap, win, tight, calls, pauses)| {
            w.rt.block_on(async {
                let mut c = w.conn().await;
                let start = redis_ms(&mut c).await;
                // `rem` binds too when tight: the slice has less than the window's cap twice over.
                let mut rem = if tight { cap + cap / 2 } else { 1_000 };
                slice(&w, &mut c, start, cap, rem).await;
                let wu = win as i64 * 1_000;
                let mut model = SlideModel::default();
                let mut sent: Vec<(String, u64, bool)> = Vec::new();
                for (k, call) in calls.iter().enumerate() {
                    let pause = pauses[k % pauses.len()];
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    let i = match call {
                        Call::New(n) => {
                            sent.push((format!("s{k}"), *n, false));
                            sent.len() - 1
                        }
                        Call::Retry(j) if !sent.is_empty() => j % sent.len(),
                        Call::Retry(_) => continue,
                    };
                    let (rid, n, before) = sent[i].clone();
                    let r = scripts::slide(&mut c, &w.keys, TASK, start, win, n, "nonce", &rid)
                        .await
                        .unwrap();
                    let (now, got) = match r {
                        ExactReply::Admitted { redis_time_us, .. } => (redis_time_us, true),
                        ExactReply::Refused { redis_time_us, .. } => (redis_time_us, false),
                        other => return Err(fail(format!("call {k}: {other:?}"))),
                    };
                    let inside = model.inside(now, wu);
                    let want = before || (inside + n <= cap && rem >= n);
                    if got != want {
                        return Err(fail(format!(
                            "call {k} at {now} ({rid}, n {n}): {r:?}; model: {inside} in the \
                             window of {cap}, rem {rem}, admitted before {before}"
                        )));
                    }
                    if got && !before {
                        model.log.push((now, n));
                        rem -= n;
                        sent[i].2 = true;
                    }
                    if let ExactReply::Refused { retry_after_us, .. } = r
                        && inside + n > cap
                        && let Some(e) = model.earliest(now, wu, n, cap)
                        && now + (retry_after_us as i64) > e
                    {
                        return Err(fail(format!(
                            "call {k}: retry after {retry_after_us} µs, but {n} fits at {e} (now {now})"
                        )));
                    }
                }
                let (rem_got, _, _) = fields(&w, &mut c, start).await;
                if rem_got != rem as i64 {
                    return Err(fail(format!("slice rem {rem_got}, model {rem}")));
                }
                Ok(())
            })
        })
        .unwrap();
}

#[test]
fn prop_slide_concurrent() {
    let w = World::new("exsc");
    let strategy = (1u64..=10, 30u64..=80).prop_flat_map(|(cap, win)| {
        (
            Just(cap),
            Just(win),
            prop::collection::vec(
                prop::collection::vec((1..=cap + 1, 0..=win / 2, any::<bool>()), 1..12),
                4,
            ),
        )
    });
    let mut runner = TestRunner::new(prop_config("exact slide concurrent", 6));
    runner
        .run(&strategy, |(cap, win, per_conn)| {
            w.rt.block_on(async {
                let mut c = w.conn().await;
                let start = redis_ms(&mut c).await;
                let rem0 = 100_000u64;
                slice(&w, &mut c, start, cap, rem0).await;
                let mut tasks = Vec::new();
                for (p, ops) in per_conn.into_iter().enumerate() {
                    let keys = w.keys.clone();
                    let mut conn = w.conn().await;
                    let mut resend_conn = w.conn().await;
                    tasks.push(tokio::spawn(async move {
                        let mut out = Vec::new();
                        for (k, (n, pause, resend)) in ops.into_iter().enumerate() {
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                            let rid = format!("c{p}:{k}");
                            let a = scripts::slide(&mut conn, &keys, TASK, start, win, n, "x", &rid);
                            if resend {
                                let b = scripts::slide(
                                    &mut resend_conn, &keys, TASK, start, win, n, "y", &rid,
                                );
                                let (a, b) = tokio::join!(a, b);
                                out.push((rid.clone(), n, a.unwrap()));
                                out.push((rid, n, b.unwrap()));
                            } else {
                                let r = a.await.unwrap();
                                out.push((rid.clone(), n, r));
                            }
                        }
                        out
                    }));
                }
                let mut replies = Vec::new();
                for t in tasks {
                    replies.extend(t.await.unwrap());
                }
                let wu = win as i64 * 1_000;
                // First admission of each request id (a replay answers "admitted" later).
                let mut first: BTreeMap<String, (i64, u64)> = BTreeMap::new();
                let mut refusals = Vec::new();
                for (rid, n, r) in &replies {
                    match r {
                        ExactReply::Admitted { redis_time_us, .. } => {
                            let e = first.entry(rid.clone()).or_insert((*redis_time_us, *n));
                            e.0 = e.0.min(*redis_time_us);
                        }
                        ExactReply::Refused { redis_time_us, .. } => {
                            refusals.push((rid.clone(), *n, *redis_time_us))
                        }
                        other => return Err(fail(format!("{rid}: {other:?}"))),
                    }
                }
                let log: Vec<(i64, u64)> = first.values().copied().collect();
                for (t, _) in &log {
                    let inside: u64 =
                        log.iter().filter(|(s, _)| *s > t - wu && s <= t).map(|x| x.1).sum();
                    if inside > cap {
                        return Err(fail(format!("{inside} admitted in the window ending {t} µs, cap {cap}")));
                    }
                }
                for (rid, n, t) in refusals {
                    if first.contains_key(&rid) {
                        continue;
                    }
                    // The most the log could hold then: everything admitted up to that time.
                    let most: u64 =
                        log.iter().filter(|(s, _)| *s > t - wu && *s <= t).map(|x| x.1).sum();
                    if most + n <= cap {
                        return Err(fail(format!("{rid}: refused {n} at {t} µs with at most {most} of {cap} in the window")));
                    }
                }
                let total: u64 = log.iter().map(|x| x.1).sum();
                let (rem, adm, _) = fields(&w, &mut c, start).await;
                if adm != total || rem != (rem0 - total) as i64 {
                    return Err(fail(format!(
                        "admitted {total} (distinct request ids); slice adm {adm}, rem {rem}"
                    )));
                }
                Ok(())
            })
        })
        .unwrap();
}

/// A call whose slice window is over is refused untouched; a retry of an admitted call is
/// answered "admitted" even then, and takes nothing.
#[test]
fn take_outside_the_window_changes_nothing_and_retries_still_replay() {
    let w = World::new("exow");
    w.rt.block_on(async {
        let mut c = w.conn().await;
        let now = redis_ms(&mut c).await;
        // A 1 s slice that ended 10 s ago.
        let old = now - now.rem_euclid(1_000) - 10_000;
        slice(&w, &mut c, old, 5, 5).await;
        let r = scripts::take(&mut c, &w.keys, TASK, old, 1_000, 1, "late")
            .await
            .unwrap();
        assert!(matches!(r, ExactReply::OutsideWindow { .. }), "{r:?}");
        assert_eq!(fields(&w, &mut c, old).await, (5, 0, 0));
        // Admitted while open (a one-minute window), then the window is closed by a shorter
        // length argument: the retry still replays.
        let r = scripts::take(&mut c, &w.keys, TASK, old, LEN_MS, 2, "early")
            .await
            .unwrap();
        assert!(matches!(r, ExactReply::Admitted { .. }), "{r:?}");
        let r = scripts::take(&mut c, &w.keys, TASK, old, 1_000, 2, "early")
            .await
            .unwrap();
        assert!(
            matches!(r, ExactReply::Admitted { remaining: 3, .. }),
            "{r:?}"
        );
        assert_eq!(fields(&w, &mut c, old).await, (3, 2, 0));
        // A request id over the bound is refused before anything is sent.
        assert!(
            scripts::take(&mut c, &w.keys, TASK, old, LEN_MS, 1, &"r".repeat(65))
                .await
                .is_err()
        );
    });
}
