//! The reference model of keyed admission, against real Redis, a real manager and real SDK
//! clients (several `Client`s on one host segment and key table).
//!
//! The model: a key `k` of a keyed task has `limit(k)` permits per slice (the threshold, or
//! its override), shared by every process of every host; nothing else limits it. A seeded
//! sequence of decisions (`try_acquire`, `acquire`, `acquire_blocking`; costs 1 … limit + 1;
//! keys drawn from a pool larger than the key table, so entries are claimed, found full and
//! reclaimed as keys churn; pauses that cross slice boundaries) runs against the SDK, and
//! every decision is checked against the model:
//!
//! * **safety**: per key and slice, the permits admitted never exceed `limit(k)`;
//! * **liveness**: a decision that says the key's slice is spent (`Limited` until the slice's
//!   end, not the 1 ms "a pull is on its way") is wrong whenever the model still has room for
//!   its cost in that slice; and a waiting call whose cost fits is admitted;
//! * nothing falls back (`Fallback*`: Redis is up) and nothing panics.
//!
//! Budget: 4 cases by default (`SLUICE_PROP_CASES`), about 2 s each; the seed is printed and
//! replays with `SLUICE_PROP_SEED`.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use sluice::Decision;
use sluice_tests::*;

const SLICE_MS: i64 = 250;
const LIMIT: u64 = 6;
const VIP_LIMIT: u64 = 12;
/// Keys per case (the key table has 8 entries: one bucket).
const KEYS: usize = 14;
const CLIENTS: usize = 3;
/// Cases that get an override key of their own (`v<case>`).
const VIP_CASES: usize = 64;

#[derive(Debug, Clone, Copy)]
enum Call {
    Try,
    Acquire,
    Blocking,
    /// The client goes (dropped: its last counts flushed) and a new one takes its place on
    /// the same segment and key table (a new participant).
    Restart,
}

#[derive(Debug, Clone)]
struct Step {
    client: usize,
    key: usize,
    n: u64,
    call: Call,
    pause_ms: u64,
}

fn step() -> impl Strategy<Value = Step> {
    (
        0..CLIENTS,
        // Key 0 (the override) and a few hot keys more often than the rest.
        prop_oneof![3 => 0..4usize, 2 => 0..KEYS],
        prop_oneof![6 => 1..=2u64, 2 => 1..=LIMIT, 1 => LIMIT..=VIP_LIMIT + 1],
        prop_oneof![
            8 => Just(Call::Try),
            8 => Just(Call::Acquire),
            4 => Just(Call::Blocking),
            1 => Just(Call::Restart),
        ],
        prop_oneof![4 => Just(0u64), 3 => 0..30u64, 1 => 100..400u64],
    )
        .prop_map(|(client, key, n, call, pause_ms)| Step {
            client,
            key,
            n,
            call,
            pause_ms,
        })
}

/// One decision as the model sees it.
#[derive(Debug)]
struct Seen {
    /// Which client decided (printed with a failing key's history).
    #[allow(dead_code)]
    client: usize,
    key: usize,
    n: u64,
    decision: Decision,
    /// The slices the decision may have been charged to (one unless it straddled a boundary).
    slices: Vec<i64>,
    waited: bool,
}

fn limit_of(key: usize, vip: bool) -> u64 {
    if key == 0 && vip { VIP_LIMIT } else { LIMIT }
}

fn key_name(case: usize, key: usize) -> String {
    if key == 0 && case < VIP_CASES {
        format!("v{case}")
    } else {
        format!("c{case}-k{key}")
    }
}

/// Checks the decisions of one case against the model; returns (admitted, rejected) permits.
/// `restarts`: (client, how many decisions had been made) for each `Restart` step.
fn check(case: usize, seen: &[Seen], restarts: &[(usize, usize)]) -> (u64, u64) {
    let vip = case < VIP_CASES;
    // Admitted permits per (key, slice), counting a straddling decision in both slices
    // (stricter).
    let mut admitted: BTreeMap<(usize, i64), u64> = BTreeMap::new();
    let (mut adm, mut rej) = (0, 0);
    for s in seen {
        assert!(
            !matches!(
                s.decision,
                Decision::FallbackAllowed | Decision::FallbackDenied { .. }
            ),
            "a fallback with Redis up: {s:?}"
        );
        if s.decision == Decision::Allowed {
            adm += s.n;
            for sl in &s.slices {
                let a = admitted.entry((s.key, *sl)).or_default();
                *a += s.n;
                assert!(
                    *a <= limit_of(s.key, vip),
                    "safety: key {} slice {sl} admitted {a} > {} (case {case})",
                    s.key,
                    limit_of(s.key, vip)
                );
            }
        } else {
            rej += s.n;
        }
    }
    // Liveness, against the final per-slice totals (a rejection earlier in the slice can only
    // have seen fewer admissions, so this is the weaker, sound form): a "spent" answer, or a
    // waiting call refused, while the slice still had room for the cost.
    for s in seen {
        let [sl] = s.slices[..] else { continue };
        let spent = match s.decision {
            Decision::Limited { retry_after } => retry_after != Duration::from_millis(1),
            _ => false,
        };
        let refused_waiting = s.waited && s.decision != Decision::Allowed;
        if !(spent || refused_waiting) {
            continue;
        }
        let a = admitted.get(&(s.key, sl)).copied().unwrap_or(0);
        if a + s.n <= limit_of(s.key, vip) {
            // The key's whole history in the case, to read the failure by.
            let history: Vec<(usize, &Seen)> = seen
                .iter()
                .enumerate()
                .filter(|(_, x)| x.key == s.key)
                .collect();
            panic!(
                "liveness: key {} slice {sl}: {:?} for {} while only {a} of {} were admitted \
                 (case {case}); restarts (client, after this many decisions of the case): \
                 {restarts:?}; the key's decisions (with their place in the case): {history:#?}",
                s.key,
                s.decision,
                s.n,
                limit_of(s.key, vip)
            );
        }
    }
    (adm, rej)
}

async fn run_case(redis: &str, ns: &str, case: usize, steps: &[Step]) -> (u64, u64) {
    let host = format!("{ns}-h{case}");
    let _guard = SegmentGuard(vec![(ns.to_string(), host.clone())]);
    // Clients 0 and 2 send their `acquire` pulls from the caller's task, client 1 through the
    // background thread (`Config::caller_pulls`): both paths against the same model.
    let client = |i: usize| {
        let mut cfg = sdk_config(redis, ns, &host);
        cfg.key_slots = 8;
        cfg.caller_pulls = i != 1;
        let c = sluice::Client::new(cfg).unwrap();
        let t = c.task("km").unwrap();
        assert!(t.wait_ready(Duration::from_secs(10)));
        (c, t)
    };
    let mut clients: Vec<(sluice::Client, sluice::Task)> = (0..CLIENTS).map(client).collect();
    let slice = |us: i64| us.div_euclid(SLICE_MS * 1_000);
    let mut seen = Vec::with_capacity(steps.len());
    let mut restarts = Vec::new();
    for s in steps {
        if let Call::Restart = s.call {
            restarts.push((s.client, seen.len()));
            clients[s.client] = client(s.client);
            continue;
        }
        let t = &clients[s.client].1;
        let k = t.key(&key_name(case, s.key)).unwrap();
        let (decision, slices, waited) = match s.call {
            Call::Try => {
                let before = t.now_us();
                let d = k.try_acquire(s.n);
                let after = t.now_us();
                (d, (slice(before)..=slice(after)).collect(), false)
            }
            Call::Acquire => {
                let (d, at) = k.acquire_stamped(s.n).await;
                (d, vec![slice(at)], true)
            }
            Call::Blocking => {
                let (d, at) = k.acquire_blocking_stamped(s.n);
                (d, vec![slice(at)], true)
            }
            Call::Restart => unreachable!(),
        };
        seen.push(Seen {
            client: s.client,
            key: s.key,
            n: s.n,
            decision,
            slices,
            waited,
        });
        if s.pause_ms > 0 {
            tokio::time::sleep(Duration::from_millis(s.pause_ms)).await;
        }
    }
    check(case, &seen, &restarts)
}

#[test]
fn keyed_admission_never_exceeds_the_model_and_admits_whenever_it_has_room() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keymodel");
    let _m = rt.block_on(async {
        let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
        let overrides: Vec<String> = (0..VIP_CASES)
            .map(|i| format!(r#""v{i}":{VIP_LIMIT}"#))
            .collect();
        let body = format!(
            r#"{{"threshold":{LIMIT},"slice_ms":{SLICE_MS},"keyed":true,
                "key_overrides":{{{}}}}}"#,
            overrides.join(",")
        );
        let (status, resp) = m.put("/api/v1/tasks/km", &body).await;
        assert!(status == 200 || status == 201, "{status} {resp}");
        m.wait_rolled("km").await;
        m
    });
    let cfg = sluice_testkit::prop_config("keyed_model", 4);
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        max_shrink_iters: 16,
        ..cfg
    });
    let case = std::cell::Cell::new(0usize);
    let totals = std::cell::Cell::new((0u64, 0u64, 0u64));
    runner
        .run(&proptest::collection::vec(step(), 30..70), |steps| {
            let i = case.get();
            case.set(i + 1);
            let (a, r) = rt.block_on(run_case(&redis, &ns, i, &steps));
            let (ta, tr, n) = totals.get();
            totals.set((ta + a, tr + r, n + steps.len() as u64));
            Ok(())
        })
        .unwrap();
    let (a, r, n) = totals.get();
    eprintln!(
        "keyed model: {} cases, {n} decisions, {a} permits admitted, {r} refused",
        case.get()
    );
}
