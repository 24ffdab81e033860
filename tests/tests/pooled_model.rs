//! A reference model of pooled admission, paced and unpaced, and a seeded property test that
//! drives real SDK clients against it (issue 23: "a reference model per decision core").
//!
//! Each case writes a task with the leader's ROLL script (cap 3 – 30 per slice of 200 or
//! 400 ms; paced with a burst of 0 – cap/3, or not) and sends a random sequence of requests
//! (costs 1 … cap + 1, gaps of 0 – slice/4, so the sequence crosses slice boundaries) from
//! one to three SDK clients of one host (three `Client`s, one segment). Requests are sequential,
//! so the model knows everything admitted.
//!
//! The model:
//!
//! ```text
//!   slice S admits at most cap                         (pooled)
//!   paced: by time t of S at most min(cap, paced(t) + burst) with
//!          paced(t) = floor(cap · (t − start) / len)     (the pace, PACE_LUA and pace_check)
//!   a cost above cap is never admitted                  (Limited, no pull sized for it)
//! ```
//!
//! Properties (violations are collected and the case fails with all of them):
//!
//! * **safety**: per slice (by the stamp `try_acquire_stamped` answers) never more than the
//!   model allows, and for paced slices never more by any admission's time than the pace +
//!   burst; Redis's `adm` of every slice equals what the clients were admitted (counted once);
//! * **liveness**: a request the model has quota for is admitted in its slice, retried on
//!   `Limited` until the slice ends: unpaced when `admitted(S) + cost ≤ cap` at least 40 ms
//!   before the slice's end; paced when, even if everything the pace released before the
//!   request (the burst included) was lost (forfeited by the script or dropped by the host
//!   as stale stock), what it releases until 40 ms before the end
//!   covers the cost plus 60 ms of the pace and one permit (pulls that lag on a busy machine):
//!   `min(cap, paced(end − 40 ms) + burst) ≥ max(admitted(S), paced(t) + burst) + cost + slack`.
//!   Before item 1's fix every paced request of `burst + 2` or more failed this.
//!
//! Budget: 8 cases by default (≈ 3 – 10 s; 200 cases took 141 s, 100 cases 70 s); `SLUICE_PROP_CASES` / `SLUICE_PROP_SEED` (see
//! `sluice_testkit::prop_config`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use sluice::{Client, Decision, Task};
use sluice_protocol::Keys;
use sluice_tests::*;

#[derive(Debug, Clone)]
struct Case {
    paced: bool,
    cap: u64,
    slice_ms: u64,
    burst: u64,
    clients: usize,
    /// (client, cost, gap before the request in ms)
    steps: Vec<(usize, u64, u64)>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        any::<bool>(),
        3u64..=30,
        prop_oneof![Just(200u64), Just(400)],
        1usize..=3,
    )
        .prop_flat_map(|(paced, cap, slice_ms, clients)| {
            let burst = if paced { 0..=cap / 3 } else { 0..=0 };
            (
                Just(paced),
                Just(cap),
                Just(slice_ms),
                burst,
                Just(clients),
                prop::collection::vec((0..clients, 1..=cap + 1, 0..=slice_ms / 4), 8..=20),
            )
        })
        .prop_map(|(paced, cap, slice_ms, burst, clients, steps)| Case {
            paced,
            cap,
            slice_ms,
            burst,
            clients,
            steps,
        })
}

/// The model's view of one slice.
fn paced_at(cap: u64, len_ms: u64, start_ms: i64, t_us: i64) -> u64 {
    let elapsed = (t_us - start_ms * 1_000).max(0) as u128;
    ((cap as u128 * elapsed) / (len_ms as u128 * 1_000)).min(cap as u128) as u64
}

const MARGIN_MS: i64 = 40;

async fn run_case(
    keys: &Keys,
    clients: &[Client],
    name: &str,
    c: &Case,
) -> Result<(), Vec<String>> {
    let mut m = pooled_meta(c.cap, c.slice_ms, c.paced, c.burst);
    m.version = 1;
    roll_task(keys, name, &m, 30).await;
    let tasks: Vec<Task> = clients[..c.clients]
        .iter()
        .map(|cl| cl.task(name).unwrap())
        .collect();
    for t in &tasks {
        assert!(t.wait_ready(Duration::from_secs(5)), "meta of {name}");
    }
    let len = c.slice_ms as i64;
    let slice_of = |t_us: i64| t_us.div_euclid(len * 1_000) * len;
    // Admissions per slice: (stamp µs, cost), in admission order.
    let mut admitted: BTreeMap<i64, Vec<(i64, u64)>> = BTreeMap::new();
    let mut bad = Vec::new();
    for (i, &(who, cost, gap)) in c.steps.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(gap)).await;
        let t = &tasks[who];
        let first_us = t.now_us();
        let s = slice_of(first_us);
        let so_far: u64 = admitted.get(&s).map_or(0, |v| v.iter().map(|x| x.1).sum());
        let end_us = (s + len) * 1_000;
        let before_end = end_us - first_us >= MARGIN_MS * 1_000;
        let must = cost <= c.cap
            && before_end
            && if c.paced {
                // Worst case: everything the pace released before now (the burst included) is
                // lost (forfeited by the script, dropped by the host as stale stock); what it
                // releases until MARGIN before the end must cover the cost, plus 60 ms of the
                // pace and one permit: the script forfeits what a host did not pull within its
                // look-ahead (10 ms of a 400 ms slice), and on a loaded machine a pull can lag
                // that much (seed 6976076517982603099 case c72, not reproduced in its three
                // reruns, with 20 ms).
                let by_last = (paced_at(c.cap, c.slice_ms, s, end_us - MARGIN_MS * 1_000)
                    + c.burst)
                    .min(c.cap);
                let taken = so_far.max(paced_at(c.cap, c.slice_ms, s, first_us) + c.burst);
                let slack = (c.cap * 60).div_ceil(c.slice_ms) + 1;
                by_last >= taken + cost + slack
            } else {
                so_far + cost <= c.cap
            };
        let give_up = Instant::now() + Duration::from_millis(20);
        let outcome = loop {
            let (d, at) = t.try_acquire_stamped(cost);
            match d {
                Decision::Allowed => break Some(at),
                Decision::TooLarge { max } => {
                    if cost <= c.cap {
                        bad.push(format!(
                            "step {i}: cost {cost} ≤ cap {} answered TooLarge {{ max: {max} }}",
                            c.cap
                        ));
                    }
                    break None;
                }
                Decision::Limited { retry_after } => {
                    let in_slice = slice_of(t.now_us()) == s;
                    if must && in_slice {
                        tokio::time::sleep(retry_after.min(Duration::from_millis(2))).await;
                        continue;
                    }
                    if !must && Instant::now() < give_up && retry_after <= Duration::from_millis(1)
                    {
                        // A refill on its way: not a decision yet.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        continue;
                    }
                    break None;
                }
                d => {
                    bad.push(format!("step {i}: unexpected {d:?}"));
                    break None;
                }
            }
        };
        match outcome {
            Some(at) => {
                if cost > c.cap {
                    bad.push(format!("step {i}: cost {cost} > cap {} admitted", c.cap));
                }
                if must && slice_of(at) != s {
                    bad.push(format!(
                        "step {i}: liveness: cost {cost} at {} ms into slice {s} (admitted {so_far} \
                         of {}) only admitted in slice {}",
                        (first_us - s * 1_000) / 1_000,
                        c.cap,
                        slice_of(at)
                    ));
                }
                admitted.entry(slice_of(at)).or_default().push((at, cost));
            }
            None if must => bad.push(format!(
                "step {i}: liveness: cost {cost} at {} ms into slice {s} (admitted {so_far} of {}, \
                 paced {}, burst {}) never admitted in its slice",
                (first_us - s * 1_000) / 1_000,
                c.cap,
                c.paced,
                c.burst
            )),
            None => {}
        }
    }
    // Safety: per slice, and by every admission's time on paced slices.
    for (s, v) in &admitted {
        let total: u64 = v.iter().map(|x| x.1).sum();
        if total > c.cap {
            bad.push(format!(
                "safety: slice {s} admitted {total} > cap {}",
                c.cap
            ));
        }
        if c.paced {
            let mut by_time = v.clone();
            by_time.sort();
            let mut sum = 0;
            for (at, cost) in by_time {
                sum += cost;
                let allowed = (paced_at(c.cap, c.slice_ms, *s, at) + c.burst).min(c.cap);
                if sum > allowed {
                    bad.push(format!(
                        "safety: slice {s}: {sum} admitted by {} ms, the pace + burst allows {allowed}",
                        (at - s * 1_000) / 1_000
                    ));
                }
            }
        }
    }
    drop(tasks);
    // Counting: Redis's `adm` of each slice equals the admissions (after the flushes).
    let expect: BTreeMap<i64, u64> = admitted
        .iter()
        .map(|(s, v)| (*s, v.iter().map(|x| x.1).sum()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut conn = redis_conn(&shared_redis());
    loop {
        let mut got = BTreeMap::new();
        for s in expect.keys() {
            let a: Option<u64> = redis::cmd("HGET")
                .arg(keys.slice(name, *s))
                .arg("adm")
                .query(&mut conn)
                .unwrap();
            got.insert(*s, a.unwrap_or(0));
        }
        if got == expect {
            break;
        }
        if Instant::now() > deadline {
            bad.push(format!("counting: Redis adm {got:?}, admitted {expect:?}"));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if bad.is_empty() { Ok(()) } else { Err(bad) }
}

#[test]
fn pooled_and_paced_admission_follow_the_model() {
    let ns = unique_ns("poolmodel");
    let keys = Keys::new(&ns).unwrap();
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let clients: Vec<Client> = (0..3)
        .map(|_| {
            let mut cfg = sdk_config(&shared_redis(), &ns, &host);
            cfg.flush_interval = Duration::from_millis(100);
            cfg.max_tasks = 1_024; // a task per case
            Client::new(cfg).unwrap()
        })
        .collect();
    let mut config = sluice_testkit::prop_config("pooled_model", 8);
    // Each case runs in real time (seconds): shrink a little, and print every failure seen.
    config.max_shrink_iters = 8;
    let mut runner = TestRunner::new(config);
    let n = std::sync::atomic::AtomicU32::new(0);
    let result = runner.run(&case(), |c| {
        let name = format!(
            "c{}",
            n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
        );
        eprintln!("case {name}: {c:?}");
        let r = rt.block_on(run_case(&keys, &clients, &name, &c));
        if let Err(bad) = &r {
            eprintln!("case {name} FAILED: {bad:#?}");
        }
        prop_assert!(r.is_ok(), "case {name}: {:#?}", r.err().unwrap());
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
