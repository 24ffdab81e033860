//! The reference model of `acquire_all` (several limits per request, all or nothing) and a
//! seeded property test that drives real SDK clients against it: a real manager, a private
//! Redis the test pauses (SIGSTOP) for a moment, one or two hosts of one or two processes
//! (`Client`s on one host segment) each.
//!
//! Limits (one manager, tasks created once; every case runs in fresh slices, keys of its own):
//!
//! ```text
//!   P  pooled        8 per 300 ms        E  exact_fixed   4 per 300 ms
//!   Q  pooled        5 per 500 ms        K  keyed         3 per key per 300 ms (4 keys a case)
//!   S  pooled shadow 3 per 300 ms        C  concurrency   2 permits (not a part acquire_all takes)
//! ```
//!
//! A request is 1 – 3 parts (a limit and a cost of 1 … its cap + 1, a limit may repeat), sent
//! by `try_acquire_all`, `acquire_all` or `acquire_all_blocking` from one process; requests
//! are sequential, with pauses between them that cross slice boundaries, so the model knows
//! everything decided.
//!
//! The model (docs/sdk.md, "Several limits per request"):
//!
//! ```text
//!   a request is admitted (refused = None, decision allowed) or refused at part i
//!     (parts after i undecided); never both, never another index
//!   admitted:   every part is charged its cost in its limit's slice — but a shadow part
//!               whose limit refused (the answer is then ShadowLimited) is charged nothing
//!   refused:    nothing is charged, except what cannot be given back: an exact part
//!               admitted before i (its Redis call counted it; no FAILED fallback admits here:
//!               every task has on_failure = deny)
//!   per limit (per key) and slice: charged ≤ cap                                (safety)
//!   a shadow part never refuses; a permit part (C) always refuses (WouldBlock), and so
//!   does an exact part of try_acquire_all (it needs a Redis round trip)
//!   waiting calls, one host, Redis undisturbed: when every part has room in its slice
//!   (charged + cost ≤ cap, ≥ 50 ms before the slice's end), the request is admitted;
//!   try_acquire_all refused by a part "spent for the slice" (Limited beyond the 1 ms
//!   refill retry) that had room: wrong                                        (liveness)
//!   the host's local quota of P, Q and S (`Slot::consumed`: granted − left) in the slice of
//!   each call equals what the model charged that host there, right after the call: a
//!   refused request's permits are back, in the slice they came from     (all or nothing)
//!   Redis `adm` of P and Q summed over the case's slices is at least what the model
//!   charged and at most that plus the permits given back                      (counting)
//!   at the end, every process is admitted a request of every part kind in a fresh slice
//!   within 5 s                                                          (nothing stuck)
//! ```
//!
//! A request whose part decisions straddle a slice boundary (its clock read before and
//! after lie in two slices) is charged to the first slice that has room for it (for safety),
//! and neither the host's quota of those slices nor liveness in them is asked exactly (the
//! guess may be the wrong slice: `Edge` steps make such requests common; seed
//! 816154616178044451 case c8 failed liveness on this before).
//! Refunds land in the slice a part was charged to (issue 23 item 6): a refund into the
//! next slice lets the next slice admit over its cap (safety) and leaves the charged slice
//! short (liveness).
//!
//! Found (written up in docs/sdk.md, not fixed): Redis `adm` counts the permits of a
//! refused request as admitted when a flush ran between the part's admission and the
//! refusal (`Slot::account` moved them to the counters; a refund cannot take a count back,
//! counters only grow). Seen about once per 8 cases with a 100 ms flush interval, e.g.
//! `SLUICE_PROP_SEED=3879168330785068789 SLUICE_PROP_CASES=8` case c5 (timing-dependent).
//! The quota itself is right: the host's local quota shows the permits back.
//!
//! Shown to fire: with `refund_all` made a no-op, the all-or-nothing check fails in the first
//! case (`host 0's local quota of Q shows 3 spent …, the model charged it 2`). Weak spot:
//! item 6 put back (refunds into the slice the clock reads afterwards) passed 27 cases: it
//! needs a part admitted before a boundary and a later part refused after it, which `Edge`
//! steps make possible but rare; `multi::tests` covers it deterministically.
//!
//! Budget: 3 cases by default (≈ 9 s a run, 8 cases ≈ 30 s); `SLUICE_PROP_CASES`, `SLUICE_PROP_SEED`
//! replay (see `sluice_testkit::prop_config`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use sluice::{AllDecision, Decision, Key, Limit, Task};
use sluice_protocol::Keys;
use sluice_tests::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Lim {
    P,
    Q,
    S,
    E,
    K(u8),
    C,
}

const KEYS: u8 = 4;

impl Lim {
    fn cap(self) -> u64 {
        match self {
            Lim::P => 8,
            Lim::Q => 5,
            Lim::S => 3,
            Lim::E => 4,
            Lim::K(_) => 3,
            Lim::C => 2,
        }
    }

    fn slice_ms(self) -> i64 {
        match self {
            Lim::Q => 500,
            Lim::C => 1_000,
            _ => 300,
        }
    }

    fn task(self) -> usize {
        match self {
            Lim::P => 0,
            Lim::Q => 1,
            Lim::S => 2,
            Lim::E => 3,
            Lim::K(_) => 4,
            Lim::C => 5,
        }
    }
}

const TASKS: [(&str, &str); 6] = [
    ("p", r#"{"threshold":8,"slice_ms":300,"on_failure":"deny"}"#),
    ("q", r#"{"threshold":5,"slice_ms":500,"on_failure":"deny"}"#),
    (
        "s",
        r#"{"threshold":3,"slice_ms":300,"on_failure":"deny","shadow":true}"#,
    ),
    (
        "e",
        r#"{"threshold":4,"slice_ms":300,"on_failure":"deny","mode":"exact_fixed"}"#,
    ),
    (
        "k",
        r#"{"threshold":3,"slice_ms":300,"on_failure":"deny","keyed":true}"#,
    ),
    (
        "c",
        r#"{"threshold":2,"slice_ms":1000,"on_failure":"deny","mode":"concurrency"}"#,
    ),
];

/// Every case starts on a boundary of this (a multiple of every slice length), so its slices
/// are its own.
const EPOCH_MS: i64 = 1_500;
/// Liveness is asked only of requests at least this far from their slices' ends.
const MARGIN_MS: i64 = 50;
/// After Redis was paused, the SDK may decide by `on_failure` (FAILED) until its probe
/// brings the task back: no liveness asked for this long after the pause ends.
const RECOVERY: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Copy)]
enum Call {
    Try,
    Acquire,
    Blocking,
}

#[derive(Debug, Clone)]
enum Step {
    Req {
        host: usize,
        proc: usize,
        call: Call,
        parts: Vec<(Lim, u64)>,
    },
    Pause(u64),
    /// Redis stopped (SIGSTOP) for this many ms while the requests go on.
    Redis(u64),
    /// Sleep until this many ms before the next 300 ms boundary (of P, S, E and K; every
    /// other one of Q's), so the next request's parts are decided on both sides of it.
    Edge(u64),
}

fn lim() -> impl Strategy<Value = Lim> {
    prop_oneof![
        6 => Just(Lim::P),
        4 => Just(Lim::Q),
        2 => Just(Lim::S),
        3 => Just(Lim::E),
        6 => (0..KEYS).prop_map(Lim::K),
        // A permit part refuses every request it is in: rarely.
        1 => Just(Lim::C),
    ]
}

fn part() -> impl Strategy<Value = (Lim, u64)> {
    lim().prop_flat_map(|l| (Just(l), prop_oneof![3 => 1..=2u64, 2 => 1..=l.cap() + 1]))
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        40 => (
            0..2usize,
            0..2usize,
            prop_oneof![2 => Just(Call::Try), 3 => Just(Call::Acquire), 2 => Just(Call::Blocking)],
            prop::collection::vec(part(), 1..=3),
        )
            .prop_map(|(host, proc, call, parts)| Step::Req { host, proc, call, parts }),
        12 => prop_oneof![3 => 0..40u64, 1 => 100..320u64].prop_map(Step::Pause),
        4 => (0..4u64).prop_map(Step::Edge),
        1 => prop_oneof![2 => 100..250u64, 1 => 1_200..1_600u64].prop_map(Step::Redis),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    hosts: usize,
    procs: usize,
    steps: Vec<Step>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![2 => Just(1usize), 1 => Just(2usize)],
        1..=2usize,
        prop::collection::vec(step(), 20..45),
    )
        .prop_map(|(hosts, procs, steps)| Case {
            hosts,
            procs,
            steps,
        })
}

/// One process: its client, the six tasks and the case's keys.
struct Proc {
    _client: sluice::Client,
    tasks: Vec<Task>,
    keys: Vec<Key>,
}

impl Proc {
    fn limits(&self, parts: &[(Lim, u64)]) -> Vec<Limit<'_>> {
        parts
            .iter()
            .map(|&(l, n)| match l {
                Lim::K(i) => Limit::Key(&self.keys[i as usize], n),
                l => Limit::Task(&self.tasks[l.task()], n),
            })
            .collect()
    }

    fn now_us(&self) -> i64 {
        self.tasks[0].now_us()
    }
}

/// One request as the model sees it.
#[derive(Debug)]
struct Seen {
    step: usize,
    host: usize,
    /// The host's local quota spent (granted − left: `Slot::consumed`) right after the call,
    /// of P, Q and S in the slice of the call (both slices when it straddled a boundary).
    consumed: Vec<(Lim, i64, u64)>,
    call: Call,
    parts: Vec<(Lim, u64)>,
    d: AllDecision,
    /// The process's slice clock before and after the call (Unix µs).
    t0: i64,
    t1: i64,
    /// Redis was paused during the call or within [`RECOVERY`] before it.
    disturbed: bool,
}

fn slice_of(l: Lim, t_us: i64) -> i64 {
    t_us.div_euclid(l.slice_ms() * 1_000) * l.slice_ms()
}

/// What the model charged: per (limit, slice start).
type Charged = BTreeMap<(Lim, i64), u64>;

/// Checks the requests of one case against the model; the charges per (limit, slice) and
/// the violations.
fn check(seen: &[Seen], one_host: bool) -> (Charged, Stats, Vec<String>) {
    let mut charged: Charged = BTreeMap::new();
    // The same per host (P, Q, S only): what its local quota must show as spent.
    let mut by_host: BTreeMap<(usize, Lim, i64), u64> = BTreeMap::new();
    // Slices of a host and limit a charge straddled into (which one it went to is not
    // known): not compared.
    let mut unsure: std::collections::BTreeSet<(usize, Lim, i64)> = Default::default();
    // The same for any host: the model's count of these is a guess, so no liveness is asked
    // of them (a straddling charge guessed into the earlier slice leaves the later one
    // looking emptier than it is).
    let mut unsure_any: std::collections::BTreeSet<(Lim, i64)> = Default::default();
    let mut bad = Vec::new();
    let mut st = Stats::default();
    for s in seen {
        let i = s.step;
        let d = s.d;
        let admitted = s.d.refused.is_none();
        // The answer's shape.
        if admitted != d.decision.is_allowed() || d.is_allowed() != admitted {
            bad.push(format!("step {i}: inconsistent answer {d:?}"));
            continue;
        }
        if let Some(r) = d.refused
            && r >= s.parts.len()
        {
            bad.push(format!(
                "step {i}: refused by part {r} of {}",
                s.parts.len()
            ));
            continue;
        }
        if matches!(d.decision, Decision::FallbackAllowed) {
            bad.push(format!(
                "step {i}: FallbackAllowed with on_failure = deny: {d:?}"
            ));
        }
        if matches!(d.decision, Decision::FallbackDenied { .. }) && !s.disturbed {
            bad.push(format!("step {i}: FallbackDenied with Redis up: {d:?}"));
        }
        if matches!(d.decision, Decision::TooLarge { .. }) {
            bad.push(format!("step {i}: TooLarge for costs ≤ cap + 1: {d:?}"));
        }
        let refused_at = d.refused.unwrap_or(s.parts.len());
        if let Some(r) = d.refused
            && s.parts[r].0 == Lim::S
        {
            bad.push(format!("step {i}: the shadow part {r} refused: {d:?}"));
        }
        // Parts that can never be admitted here refuse at the first of them.
        let never = s
            .parts
            .iter()
            .position(|&(l, _)| l == Lim::C || (l == Lim::E && matches!(s.call, Call::Try)));
        if let Some(j) = never {
            if refused_at > j {
                bad.push(format!(
                    "step {i}: part {j} ({:?}) can never be admitted by {:?}, answer {d:?}",
                    s.parts[j].0, s.call
                ));
            } else if refused_at == j && d.decision != Decision::WouldBlock {
                bad.push(format!(
                    "step {i}: part {j} ({:?}) refused with {:?}, not WouldBlock",
                    s.parts[j].0, d.decision
                ));
            }
        }
        if d.decision.is_shadowed() && !s.parts.iter().any(|p| p.0 == Lim::S) {
            bad.push(format!("step {i}: ShadowLimited without a shadow part"));
        }
        // What each limit needs (a limit may repeat) and its slice at the call.
        let mut need: BTreeMap<Lim, u64> = BTreeMap::new();
        for &(l, n) in &s.parts {
            *need.entry(l).or_default() += n;
        }
        let room = |charged: &Charged, l: Lim, n: u64| {
            let sl = slice_of(l, s.t0);
            if unsure_any.contains(&(l, sl)) {
                return false;
            }
            let end_us = (sl + l.slice_ms()) * 1_000;
            charged.get(&(l, sl)).copied().unwrap_or(0) + n <= l.cap()
                && end_us - s.t1.max(s.t0) >= MARGIN_MS * 1_000
        };
        // Liveness, against what was charged before this request.
        if one_host && !s.disturbed && never.is_none() {
            let waiting = !matches!(s.call, Call::Try);
            let all_room = need
                .iter()
                .all(|(&l, &n)| l == Lim::S || room(&charged, l, n));
            st.live_checked += usize::from(waiting && all_room);
            if waiting && all_room && !admitted {
                bad.push(format!(
                    "step {i}: liveness: {:?} {:?} refused ({d:?}) while every part had room \
                     (charged {:?})",
                    s.call,
                    s.parts,
                    need.keys()
                        .map(|&l| (
                            l,
                            charged.get(&(l, slice_of(l, s.t0))).copied().unwrap_or(0)
                        ))
                        .collect::<Vec<_>>()
                ));
            }
            if !waiting
                && let Some(r) = d.refused
                && let Decision::Limited { retry_after } = d.decision
                && retry_after > Duration::from_millis(2)
            {
                let l = s.parts[r].0;
                let upto: u64 = s.parts[..=r].iter().filter(|p| p.0 == l).map(|p| p.1).sum();
                if room(&charged, l, upto) {
                    bad.push(format!(
                        "step {i}: liveness: try_acquire_all refused by part {r} ({l:?}) as \
                         spent for the slice ({retry_after:?}) while it had room for {upto} \
                         (charged {})",
                        charged.get(&(l, slice_of(l, s.t0))).copied().unwrap_or(0)
                    ));
                }
            }
        }
        st.admitted += usize::from(admitted);
        if !admitted {
            for &(l, n) in &s.parts[..refused_at] {
                if matches!(l, Lim::P | Lim::Q | Lim::K(_)) {
                    *st.given_back.entry(l).or_default() += n;
                }
            }
        }
        st.undone += usize::from(
            s.parts[..refused_at.min(s.parts.len())]
                .iter()
                .any(|p| matches!(p.0, Lim::P | Lim::Q | Lim::K(_))),
        ) * usize::from(!admitted);
        // The charges. A shadowed answer says one shadow part's limit refused; with the shadow
        // limit in the request twice, which of them were charged is not known (costs 3 then 1
        // with 3 left: the first; 2, 3, 1: the first and the last): none is counted for
        // safety (weaker, never wrong) and the host's S quota there is not compared.
        let shadow_parts = s.parts.iter().filter(|p| p.0 == Lim::S).count();
        if admitted && d.decision.is_shadowed() && shadow_parts > 1 {
            let (mut sl, s1) = (slice_of(Lim::S, s.t0), slice_of(Lim::S, s.t1));
            while sl <= s1 {
                unsure.insert((s.host, Lim::S, sl));
                unsure_any.insert((Lim::S, sl));
                sl += Lim::S.slice_ms();
            }
        }
        for (j, &(l, n)) in s.parts.iter().enumerate() {
            let charge = if admitted {
                l != Lim::C && !(l == Lim::S && d.decision.is_shadowed())
            } else {
                // What cannot be given back: an exact part admitted before the refusal.
                l == Lim::E && j < refused_at && !matches!(s.call, Call::Try)
            };
            if !charge {
                continue;
            }
            let (s0, s1) = (slice_of(l, s.t0), slice_of(l, s.t1));
            let fits = |c: &Charged, sl: i64| c.get(&(l, sl)).copied().unwrap_or(0) + n <= l.cap();
            let at = if s0 == s1 || fits(&charged, s0) {
                s0
            } else {
                s1
            };
            if s0 != s1 {
                let mut sl = s0;
                while sl <= s1 {
                    unsure_any.insert((l, sl));
                    sl += l.slice_ms();
                }
            }
            if matches!(l, Lim::P | Lim::Q | Lim::S) {
                *by_host.entry((s.host, l, at)).or_default() += n;
                if s0 != s1 {
                    let mut sl = s0;
                    while sl <= s1 {
                        unsure.insert((s.host, l, sl));
                        sl += l.slice_ms();
                    }
                }
            }
            let c = charged.entry((l, at)).or_default();
            *c += n;
            if *c > l.cap() {
                bad.push(format!(
                    "step {i}: safety: {l:?} slice {at}: {c} charged > cap {} ({:?} {:?} {d:?})",
                    l.cap(),
                    s.call,
                    s.parts
                ));
            }
        }
        // All or nothing, on the host's quota itself: what its local quota shows as spent
        // in the slice of the call is exactly what the model charged the host there (a
        // refused request's permits are back, in the slice they were taken from).
        for &(l, sl, got) in &s.consumed {
            if unsure.contains(&(s.host, l, sl)) {
                continue;
            }
            let want = by_host.get(&(s.host, l, sl)).copied().unwrap_or(0);
            if got != want {
                bad.push(format!(
                    "step {i}: all or nothing: host {}'s local quota of {l:?} shows {got} spent \
                     in slice {sl}, the model charged it {want} ({:?} {:?} {d:?})",
                    s.host, s.call, s.parts
                ));
            }
        }
    }
    (charged, st, bad)
}

/// What a case exercised.
#[derive(Debug, Default)]
struct Stats {
    admitted: usize,
    /// Refused requests with a part admitted before the refusal that had to be given back.
    undone: usize,
    /// Requests liveness applied to.
    live_checked: usize,
    /// Permits given back, per limit.
    given_back: BTreeMap<Lim, u64>,
}

/// Resumes a SIGSTOPped process when dropped (also when the test fails).
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

async fn run_case(
    redis: &RedisServer,
    keys: &Keys,
    ns: &str,
    case: usize,
    c: &Case,
) -> Result<(), Vec<String>> {
    // Start on a fresh epoch: the slices of this case are its own.
    let wait = EPOCH_MS - now_ms().rem_euclid(EPOCH_MS) + 5;
    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    let hosts: Vec<String> = (0..c.hosts).map(|h| format!("{ns}-c{case}-h{h}")).collect();
    let _seg = SegmentGuard(hosts.iter().map(|h| (ns.to_string(), h.clone())).collect());
    let procs: Vec<Vec<Proc>> = hosts
        .iter()
        .map(|h| {
            (0..c.procs)
                .map(|_| {
                    let mut cfg = sdk_config(&redis.url(), ns, h);
                    cfg.flush_interval = Duration::from_millis(100);
                    // A task FAILED while Redis was paused is probed back within 1 s (the
                    // default 5 s would outlast RECOVERY).
                    cfg.probe_interval = Duration::from_secs(1);
                    let client = sluice::Client::new(cfg).unwrap();
                    let tasks: Vec<Task> =
                        TASKS.iter().map(|(n, _)| client.task(n).unwrap()).collect();
                    for t in &tasks {
                        assert!(
                            t.wait_ready(Duration::from_secs(10)),
                            "meta of {}",
                            t.name()
                        );
                    }
                    let keys = (0..KEYS)
                        .map(|k| tasks[4].key(&format!("c{case}-k{k}")).unwrap())
                        .collect();
                    Proc {
                        _client: client,
                        tasks,
                        keys,
                    }
                })
                .collect()
        })
        .collect();
    // The test's own view of each host segment, to read its local quotas.
    let views: Vec<(sluice::shm::Segment, [usize; 3])> = hosts
        .iter()
        .map(|h| {
            let path = sluice::shm::Segment::path_for(std::path::Path::new("/dev/shm"), ns, h);
            let (seg, _) =
                sluice::shm::Segment::open(&path, sluice::Config::new("redis://x").max_tasks)
                    .unwrap();
            let slots = [0, 1, 2].map(|t| seg.find(TASKS[t].0).expect("the task's slot"));
            (seg, slots)
        })
        .collect();
    let first_us = procs[0][0].now_us();
    let pid = redis.pid();
    // The last pause of Redis: (start, end).
    let mut paused: Option<(Instant, Instant)> = None;
    let mut pauser: Option<std::thread::JoinHandle<()>> = None;
    let mut seen = Vec::new();
    for (i, step) in c.steps.iter().enumerate() {
        match step {
            Step::Pause(ms) => tokio::time::sleep(Duration::from_millis(*ms)).await,
            Step::Edge(before) => {
                let now = procs[0][0].now_us() / 1_000;
                let left = 300 - now.rem_euclid(300) - *before as i64;
                if left > 0 {
                    tokio::time::sleep(Duration::from_millis(left as u64)).await;
                }
            }
            Step::Redis(ms) => {
                if let Some(h) = pauser.take() {
                    h.join().unwrap();
                }
                let ms = *ms;
                let start = Instant::now();
                paused = Some((start, start + Duration::from_millis(ms)));
                signal(pid, libc::SIGSTOP);
                let guard = Resume(pid);
                pauser = Some(std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(ms));
                    drop(guard);
                }));
            }
            Step::Req {
                host,
                proc,
                call,
                parts,
            } => {
                let p = &procs[host % c.hosts][proc % c.procs];
                let limits = p.limits(parts);
                let i0 = Instant::now();
                let t0 = p.now_us();
                let d = match call {
                    Call::Try => sluice::try_acquire_all(&limits),
                    Call::Acquire => sluice::acquire_all(&limits).await,
                    Call::Blocking => sluice::acquire_all_blocking(&limits),
                };
                let t1 = p.now_us();
                let (seg, slots) = &views[host % c.hosts];
                let mut consumed = Vec::new();
                for (j, l) in [Lim::P, Lim::Q, Lim::S].into_iter().enumerate() {
                    // The slice of the call's end, and of its start when it straddled a
                    // boundary (a refund must land there: issue 23 item 6).
                    let (s0, s1) = (slice_of(l, t0), slice_of(l, t1));
                    let slot = seg.slot(slots[j]).unwrap();
                    for sl in if s0 == s1 { vec![s1] } else { vec![s0, s1] } {
                        consumed.push((l, sl, slot.consumed(sl, l.slice_ms() as u64)));
                    }
                }
                let disturbed =
                    paused.is_some_and(|(a, b)| i0 < b + RECOVERY && a < Instant::now());
                seen.push(Seen {
                    step: i,
                    host: host % c.hosts,
                    consumed,
                    call: *call,
                    parts: parts.clone(),
                    d,
                    t0,
                    t1,
                    disturbed,
                });
            }
        }
    }
    if let Some(h) = pauser.take() {
        h.join().unwrap();
    }
    let (charged, mut st, mut bad) = check(&seen, c.hosts == 1);
    let last_us = procs
        .iter()
        .flatten()
        .map(Proc::now_us)
        .max()
        .unwrap_or(first_us);

    // Nothing stuck: from a fresh slice of every limit, every process is admitted one of each
    // part kind (within 5 s: after a pause of Redis, the probe brings the tasks back).
    if let Some((_, end)) = paused {
        let left = (end + Duration::from_millis(200)).saturating_duration_since(Instant::now());
        tokio::time::sleep(left).await;
    }
    let wait = EPOCH_MS - now_ms().rem_euclid(EPOCH_MS) + 5;
    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    let probe = [(Lim::P, 1), (Lim::Q, 1), (Lim::E, 1), (Lim::K(0), 1)];
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut probes_us = Vec::new();
    for (h, host) in procs.iter().enumerate() {
        for (j, p) in host.iter().enumerate() {
            loop {
                let t0 = p.now_us();
                let d = sluice::acquire_all(&p.limits(&probe)).await;
                if d.is_allowed() {
                    probes_us.push((t0, p.now_us()));
                    break;
                }
                // Refused (K(0) admits 3 a slice: a fourth process waits for the next): what
                // the parts before took was given back.
                for &(l, n) in &probe[..d.refused.unwrap_or(0)] {
                    *st.given_back.entry(l).or_default() += n;
                }
                if Instant::now() > deadline {
                    bad.push(format!(
                        "stuck: host {h} process {j} refused {probe:?} for 5 s: {d:?}"
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    drop(procs);

    // Counting: Redis's `adm` of P and Q over the case's slices is what the model charged
    // (plus the probes), and at most what was given back more: a flush that runs between a
    // part's admission and the refusal of a later part has counted the part's permits as
    // admitted, and a refund cannot take a count back (see the module docs). Only when Redis
    // was never paused (a flush lost with Redis stopped is dropped, not retried forever).
    if paused.is_none() {
        for l in [Lim::P, Lim::Q] {
            let expect: u64 = charged
                .iter()
                .filter(|((x, _), _)| *x == l)
                .map(|(_, n)| n)
                .sum::<u64>()
                + probes_us.len() as u64;
            let back = st.given_back.get(&l).copied().unwrap_or(0);
            let name = TASKS[l.task()].0;
            let from = slice_of(l, first_us);
            let to = probes_us
                .iter()
                .map(|p| slice_of(l, p.1))
                .max()
                .unwrap_or(slice_of(l, last_us));
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut conn = redis_conn(&redis.url());
            loop {
                let mut got = 0u64;
                let mut sl = from;
                while sl <= to {
                    let a: Option<u64> = redis::cmd("HGET")
                        .arg(keys.slice(name, sl))
                        .arg("adm")
                        .query(&mut conn)
                        .unwrap();
                    got += a.unwrap_or(0);
                    sl += l.slice_ms();
                }
                if got >= expect && got <= expect + back {
                    if got > expect {
                        eprintln!(
                            "case c{case}: Redis adm of {l:?} {got}: {} given back after a \
                             flush counted them (model {expect})",
                            got - expect
                        );
                    }
                    break;
                }
                if Instant::now() > deadline {
                    bad.push(format!(
                        "counting: Redis adm of {l:?} over the case's slices {got}, the model \
                         charged {expect} and {back} were given back"
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    eprintln!(
        "case c{case}: {} requests, {} hosts × {} processes, {st:?}, Redis paused: {}",
        seen.len(),
        c.hosts,
        c.procs,
        paused.is_some()
    );
    if !bad.is_empty() {
        for s in &seen {
            eprintln!(
                "  step {} {:?} {:?} → {:?} at {} … {} µs{}",
                s.step,
                s.call,
                s.parts,
                s.d,
                s.t0,
                s.t1,
                if s.disturbed { " (disturbed)" } else { "" }
            );
        }
    }
    if bad.is_empty() { Ok(()) } else { Err(bad) }
}

#[test]
fn acquire_all_follows_the_model() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let etcd = shared_etcd();
    let redis = RedisServer::start();
    let ns = unique_ns("allmodel");
    let keys = Keys::new(&ns).unwrap();
    let _m = rt.block_on(async {
        let m = Manager::start(ManagerOpts::new(&etcd, &redis.url(), &ns, "m1")).await;
        for (name, body) in TASKS {
            let (status, resp) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
            assert!(status == 200 || status == 201, "{name}: {status} {resp}");
            m.wait_rolled(name).await;
        }
        m
    });
    let mut config = sluice_testkit::prop_config("acquire_all_model", 3);
    config.max_shrink_iters = 8;
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let n = std::cell::Cell::new(0usize);
    let result = runner.run(&case(), |c| {
        let i = n.get();
        n.set(i + 1);
        eprintln!("case c{i}: {c:?}");
        let r = rt.block_on(run_case(&redis, &keys, &ns, i, &c));
        if let Err(bad) = &r {
            eprintln!("case c{i} FAILED: {bad:#?}");
        }
        prop_assert!(r.is_ok(), "case c{i}: {:#?}", r.err().unwrap());
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
