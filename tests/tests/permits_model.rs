//! Mode `concurrency` driven step by step through the SDK's decision core
//! (`sluice::concurrency::{take, begin_call, finish_call, …}`) on real host segments, against
//! a real Redis: the test is the scheduler, so it can stall a lease holder between a LEASE
//! call and its answer, let another process take the lease lock over, and deliver the answer
//! late — interleavings the background thread produces only under rare stalls.

use std::path::Path;

use sluice::concurrency::{self as conc, LeaseOutcome, LeaseParams};
use sluice::shm::{ConcCells, LockAttempt, Segment};
use sluice_protocol::lease::{self, LeaseReply};
use sluice_protocol::{Keys, OnFailure};
use sluice_tests::*;

/// Lease-lock timeout the SDK uses with the default pull timeout (3 × 1 s).
const LOCK_TIMEOUT_MS: u64 = 3_000;

/// One process of a host: its own open of the host's segment (its own participant).
struct Process {
    seg: Segment,
    slot: usize,
}

impl Process {
    fn open(path: &Path, task: &str) -> Self {
        let (seg, _) = Segment::open(path, 8).expect("open segment");
        let slot = seg.find_or_claim(task, 1_000).expect("a slot");
        Self { seg, slot }
    }

    fn k(&self) -> &ConcCells {
        &self.seg.slot(self.slot).expect("slot").conc
    }

    /// Takes permits until the host refuses; how many it handed out.
    fn take_all(&self) -> u64 {
        let mut n = 0;
        while conc::take(&self.seg, self.k(), sluice::clock::boot_ms).is_ok() {
            n += 1;
            assert!(n <= 1_000, "unbounded permits");
        }
        n
    }
}

fn params(threshold: u64) -> LeaseParams {
    LeaseParams {
        on_failure: OnFailure::Deny,
        local_limit: 0,
        threshold,
    }
}

/// The permits Redis counts for `host` now (0 once its entry expired).
fn redis_holding(keys: &Keys, task: &str, host: &str) -> u64 {
    let mut c = redis_conn(&shared_redis());
    let e: Option<String> = redis::cmd("HGET")
        .arg(keys.lease(task))
        .arg(host)
        .query(&mut c)
        .unwrap();
    let Some(e) = e else { return 0 };
    let f: Vec<i64> = e.split(':').map(|x| x.parse().unwrap()).collect();
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut c).unwrap();
    let now_ms = s * 1_000 + us / 1_000;
    if f[1] > now_ms { f[0] as u64 } else { 0 }
}

/// Item 7 of issue 23: process A of a host sends LEASE (want 5, cap 5) and stalls before it
/// applies the answer; past the lease lock's timeout process B of the same host takes the lock
/// over, the threshold is lowered to 2, and B's LEASE gives every permit back (no demand left).
/// A's answer then arrives late. Applying it would raise the host's limit to 5 while Redis
/// counts the host at 0 and lets another host take both permits of the new cap.
#[tokio::test]
async fn a_late_lease_reply_after_a_takeover_hands_out_nothing_redis_counts_as_free() {
    let ns = unique_ns("latelease");
    let keys = Keys::new(&ns).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    write_meta(&mut c, &keys, "t", &conc_meta(5, 60_000, 1)).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("segment");
    let a = Process::open(&path, "t");
    let b = Process::open(&path, "t");
    let host = "h";

    // A: five callers wait; A holds the lease lock and sends LEASE for 5 …
    a.k().waiting.store(5, std::sync::atomic::Ordering::Release);
    let lock_a = a.seg.lock(&a.k().lease_lock);
    let LockAttempt::Acquired { token: token_a, .. } =
        lock_a.try_lock(sluice::clock::host_ms(), LOCK_TIMEOUT_MS)
    else {
        panic!("the lease lock is free")
    };
    let call_a = conc::begin_call(
        a.k(),
        &params(5),
        0,
        sluice::clock::boot_ms(),
        sluice::clock::host_us(),
    );
    assert_eq!(call_a.want, 5);
    let reply_a = lease::lease(&mut c, &keys, "t", host, call_a.want, call_a.seq)
        .await
        .unwrap();
    assert!(
        matches!(reply_a, LeaseReply::Held { holding: 5, .. }),
        "{reply_a:?}"
    );
    // … and stalls here. The callers give up; the threshold is lowered to 2.
    a.k().waiting.store(0, std::sync::atomic::Ordering::Release);
    write_meta(&mut c, &keys, "t", &conc_meta(2, 60_000, 2)).await;

    // B finds the lease lock older than its timeout and takes it over; with no demand it
    // gives the host's permits back.
    let lock_b = b.seg.lock(&b.k().lease_lock);
    let later = sluice::clock::host_ms() + LOCK_TIMEOUT_MS as i64 + 1;
    let LockAttempt::Acquired {
        token: token_b,
        took_over_from: Some(_),
    } = lock_b.try_lock(later, LOCK_TIMEOUT_MS)
    else {
        panic!("B did not take the stale lease lock over")
    };
    let call_b = conc::begin_call(
        b.k(),
        &params(5),
        0,
        sluice::clock::boot_ms(),
        sluice::clock::host_us(),
    );
    assert_eq!(call_b.want, 0);
    let reply_b = lease::lease(&mut c, &keys, "t", host, call_b.want, call_b.seq)
        .await
        .unwrap();
    assert!(
        matches!(
            reply_b,
            LeaseReply::Held {
                holding: 0,
                cap: 2,
                ..
            }
        ),
        "{reply_b:?}"
    );
    conc::finish_call(
        b.k(),
        &params(5),
        &call_b,
        LeaseOutcome::Reply(reply_b),
        sluice::clock::boot_ms(),
        lock_b.holds(token_b),
    );
    assert!(lock_b.unlock(token_b));

    // A wakes up and delivers its late answer: ignored, because A lost the lease lock and,
    // on its own, because a newer call (B's) has begun since A's.
    assert!(!lock_a.holds(token_a));
    for holds_lock in [lock_a.holds(token_a), true] {
        let done = conc::finish_call(
            a.k(),
            &params(5),
            &call_a,
            LeaseOutcome::Reply(reply_a),
            sluice::clock::boot_ms(),
            holds_lock,
        );
        assert_eq!(done, conc::Finished::Superseded);
    }
    assert!(!lock_a.unlock(token_a), "A no longer holds the lease lock");

    // Another host takes the 2 permits Redis counts as free.
    let other = lease::lease(&mut c, &keys, "t", "other", 2, 1)
        .await
        .unwrap();
    assert!(
        matches!(other, LeaseReply::Held { holding: 2, .. }),
        "{other:?}"
    );

    // This host must hand out no more than Redis counts for it (0): in flight ≤ the cap of 2.
    let here = a.take_all() + b.take_all();
    let counted = redis_holding(&keys, "t", host);
    assert!(
        here <= counted,
        "the host handed out {here} permits while Redis counts {counted} for it (and 2 for \
         another host, cap 2)"
    );
}

/// Waits given by the caller are bounded by nothing but the caller: `Duration::MAX` (a wait
/// too long to add to the clock) is a wait without end, never a panic; lock TTLs outside
/// 100 ms ..= 1 day are refused by name.
#[tokio::test]
async fn waits_of_any_length_never_panic_and_lock_ttls_are_bounded() {
    let ns = unique_ns("waitmax");
    let keys = Keys::new(&ns).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    write_meta(&mut c, &keys, "t", &conc_meta(2, 60_000, 1)).await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, &host)).unwrap();
    let task = client.task("t").unwrap();
    assert!(task.wait_ready(std::time::Duration::from_secs(10)));
    let p = task
        .permit_timeout(std::time::Duration::MAX)
        .await
        .expect("a free permit");
    let q = task
        .permit_blocking(std::time::Duration::MAX)
        .expect("the second");
    drop((p, q));
    let g = client
        .lock_timeout(
            "l",
            std::time::Duration::from_secs(5),
            std::time::Duration::MAX,
        )
        .await
        .expect("a free lock");
    assert!(g.release().await.unwrap());
    for ttl in [
        std::time::Duration::from_millis(99),
        sluice::MAX_LOCK_TTL + std::time::Duration::from_millis(1),
        std::time::Duration::MAX,
    ] {
        let e = client.try_lock("l", ttl).await.expect_err("refused");
        assert_eq!(e, sluice::LockError::Ttl(ttl));
        assert!(e.to_string().contains("ttl"), "{e}");
    }
}

// ─── The reference model of mode `concurrency` and its property ───
//
// The model: a cluster-wide cap N (the threshold, changed at any step), hosts of one to
// three processes each, and the permits each live process holds (with the real time it took
// each). A step is one of: a process takes a permit, releases one, stalls holding the lease
// lock with a LEASE call whose answer it keeps, delivers that answer late, the host's wall
// clock steps (a forward step makes a stalled holder's lease lock look stale: taken over),
// the threshold changes, a process or a whole host crashes (its permits are gone; a dead
// host's Redis entry lapses after the TTL), a host's LEASE calls fail (never sent, or run by
// Redis with the answer lost), every live, unstalled process runs a background
// round (as its background thread does every millisecond: a step of its own, so other steps
// can fall between two rounds), or time passes (with rounds every 20 ms); callers honour
// the documented contract and release a permit within a quarter TTL (`HOLD_MS`), except those
// of a stalled (stopped) process.
//
// Safety, checked at every step:
// * S1, at every hand-out: the host's permits in use ≤ what Redis counts for it (its live
//   entry at the time of the hand-out);
// * S2, at every LEASE call: Redis' holdings never grow past the cap (after a decrease they
//   only fall);
// * S3, at every hand-out: the permits taken within the last quarter TTL, cluster-wide — the
//   ones the contract covers — are at most max(N, what Redis counts), i.e. at most N unless a
//   decrease is still being absorbed (in flight falls by attrition).
// Liveness, at the end of each case (stalled processes resumed): every free permit of the
// model (N − permits held by live processes) is handed out to a waiting caller within 4 TTLs
// (a dead host's entry lapses within one; idle permits go back at renewals). Nothing stuck:
// each live host's in-use count equals the model's permits of its live processes. No panic.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use sluice::concurrency::Clocks;

const MODEL_LEASE_MS: u64 = 1_000;
/// Callers release a permit within this (a quarter TTL): the contract S3 relies on.
const HOLD_MS: u64 = MODEL_LEASE_MS / 4;
const PULL_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
enum Step {
    Take(usize, usize),
    Release(usize, usize),
    Stall(usize, usize),
    Resume(usize, usize),
    WallClock(usize, i64),
    SetCap(u64),
    CrashProcess(usize, usize),
    CrashHost(usize),
    Sleep(u64),
    Tick,
    /// Host `h`'s LEASE calls from now on: 0 answered, 1 run by Redis but the answer lost
    /// (a timeout after the fact), 2 never reaching Redis (Redis or the network down).
    Net(usize, u8),
}

fn step() -> impl Strategy<Value = Step> {
    let hp = || (0..3usize, 0..3usize);
    // Wall-clock steps: mostly forward past the lease lock's timeout (a stalled holder is
    // taken over), sometimes small either way.
    let clock = prop_oneof![3 => 3_500..6_000i64, 1 => -2_000..2_000i64];
    prop_oneof![
        8 => hp().prop_map(|(h, p)| Step::Take(h, p)),
        4 => hp().prop_map(|(h, p)| Step::Release(h, p)),
        3 => hp().prop_map(|(h, p)| Step::Stall(h, p)),
        3 => hp().prop_map(|(h, p)| Step::Resume(h, p)),
        4 => (0..3usize, clock).prop_map(|(h, ms)| Step::WallClock(h, ms)),
        2 => (0..=6u64).prop_map(Step::SetCap),
        1 => hp().prop_map(|(h, p)| Step::CrashProcess(h, p)),
        1 => (0..3usize).prop_map(Step::CrashHost),
        2 => (0..400u64).prop_map(Step::Sleep),
        6 => Just(Step::Tick),
        1 => (0..3usize, prop_oneof![2 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)])
            .prop_map(|(h, m)| Step::Net(h, m)),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    procs: Vec<usize>,
    cap: u64,
    steps: Vec<Step>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec(1..=3usize, 1..=3).prop_map(|mut v| {
            v[0] = v[0].max(2);
            v
        }),
        1..=6u64,
        proptest::collection::vec(step(), 5..40),
    )
        .prop_map(|(procs, cap, steps)| Case { procs, cap, steps })
}

/// A host's clocks: the real boot clock (lease validity), its wall clock with a step offset.
struct HostClocks {
    skew_us: std::cell::Cell<i64>,
}

impl Clocks for HostClocks {
    fn boot_ms(&self) -> i64 {
        sluice::clock::boot_ms()
    }
    fn host_us(&self) -> i64 {
        sluice::clock::host_us() + self.skew_us.get()
    }
}

struct Stalled {
    call: conc::LeaseCall,
    token: u64,
    outcome: LeaseOutcome,
}

struct ModelProcess {
    p: Option<Process>,
    /// When each permit it holds was taken.
    permits: Vec<Instant>,
    stalled: Option<Stalled>,
}

struct ModelHost {
    id: String,
    /// What becomes of its LEASE calls ([`Step::Net`]).
    net: u8,
    procs: Vec<ModelProcess>,
    clocks: HostClocks,
}

struct World {
    keys: Keys,
    conn: sluice_protocol::conn::RedisConn,
    cap: u64,
    version: i64,
    hosts: Vec<ModelHost>,
    takes: u64,
    calls: u64,
    /// Late answers delivered after a newer call of their host had begun.
    late: u64,
}

/// Live entries of the lease hash, by Redis' clock: host → (permits, expires_ms), and Redis
/// time (ms).
fn lease_entries(keys: &Keys) -> (std::collections::HashMap<String, (u64, i64)>, i64) {
    let mut c = redis_conn(&shared_redis());
    let (all, (s, us)): (Vec<(String, String)>, (i64, i64)) = redis::pipe()
        .cmd("HGETALL")
        .arg(keys.lease("t"))
        .cmd("TIME")
        .query(&mut c)
        .unwrap();
    let now = s * 1_000 + us / 1_000;
    let mut m = std::collections::HashMap::new();
    for (h, v) in all {
        let f: Vec<i64> = v.split(':').filter_map(|x| x.parse().ok()).collect();
        assert!(f.len() >= 3, "malformed lease entry {h} = {v}");
        m.insert(h, (f[0].max(0) as u64, f[1]));
    }
    (m, now)
}

fn live_sum(m: &std::collections::HashMap<String, (u64, i64)>, now: i64) -> u64 {
    m.values().filter(|(_, e)| *e > now).map(|(p, _)| p).sum()
}

/// LEASE for host `id`, with S2 checked around it: Redis' live holdings never grow past the
/// cap (after a decrease they only fall).
async fn checked_lease(
    mut conn: sluice_protocol::conn::RedisConn,
    keys: &Keys,
    id: &str,
    cap: u64,
    net: u8,
    call: conc::LeaseCall,
) -> LeaseOutcome {
    if net == 2 {
        return LeaseOutcome::Failed;
    }
    let (before, t) = lease_entries(keys);
    let before = live_sum(&before, t);
    let r = lease::lease(&mut conn, keys, "t", id, call.want, call.seq).await;
    let (after, t) = lease_entries(keys);
    let after = live_sum(&after, t);
    assert!(
        after <= cap || after <= before,
        "S2: Redis' holdings grew to {after} (from {before}) past the cap {cap}"
    );
    match r {
        Ok(reply) if net == 0 => LeaseOutcome::Reply(reply),
        _ => LeaseOutcome::Failed,
    }
}

impl World {
    fn params(&self) -> LeaseParams {
        LeaseParams {
            on_failure: OnFailure::Deny,
            local_limit: 0,
            threshold: self.cap,
        }
    }

    /// LEASE for host `h`, with S2 checked around it.
    async fn send(&mut self, h: usize, call: conc::LeaseCall) -> LeaseOutcome {
        self.calls += 1;
        checked_lease(
            self.conn.clone(),
            &self.keys,
            &self.hosts[h].id,
            self.cap,
            self.hosts[h].net,
            call,
        )
        .await
    }

    /// One background round of every live, unstalled process.
    async fn background(&mut self) {
        for h in 0..self.hosts.len() {
            for i in 0..self.hosts[h].procs.len() {
                self.round(h, i).await;
            }
        }
    }

    /// The round of process `i` of host `h`, through the SDK's own `locked_call`.
    async fn round(&mut self, h: usize, i: usize) {
        let params = self.params();
        let host = &self.hosts[h];
        let mp = &host.procs[i];
        let Some(p) = mp.p.as_ref().filter(|_| mp.stalled.is_none()) else {
            return;
        };
        let k = p.k();
        conc::reclaim_dead(&p.seg, k);
        if !conc::round_due(k, sluice::clock::boot_ms()) {
            return;
        }
        let (conn, keys, id, cap, net) =
            (self.conn.clone(), &self.keys, &host.id, self.cap, host.net);
        let sent = std::cell::Cell::new(false);
        conc::locked_call(
            &p.seg,
            k,
            &params,
            &host.clocks,
            conc::lease_lock_timeout_ms(PULL_TIMEOUT),
            k.denied.load(std::sync::atomic::Ordering::Relaxed),
            |call| {
                sent.set(true);
                checked_lease(conn, keys, id, cap, net, call)
            },
        )
        .await;
        self.calls += sent.get() as u64;
    }

    /// Releases, as callers do, every permit held for `HOLD_MS` or longer (not those of a
    /// stalled process: it is stopped).
    fn contract_releases(&mut self) {
        for host in &mut self.hosts {
            for mp in &mut host.procs {
                let (Some(p), None) = (mp.p.as_ref(), mp.stalled.as_ref()) else {
                    continue;
                };
                while mp
                    .permits
                    .first()
                    .is_some_and(|t| t.elapsed() >= Duration::from_millis(HOLD_MS))
                {
                    mp.permits.remove(0);
                    conc::release(&p.seg, p.k());
                }
            }
        }
    }

    fn live_permits(&self) -> usize {
        self.hosts
            .iter()
            .flat_map(|h| &h.procs)
            .filter(|p| p.p.is_some())
            .map(|p| p.permits.len())
            .sum()
    }

    /// Process `i` of host `h` takes a permit; S1 and S3 checked when it gets one.
    fn take(&mut self, h: usize, i: usize) -> bool {
        let mp = &self.hosts[h].procs[i];
        let (Some(p), None) = (mp.p.as_ref(), mp.stalled.as_ref()) else {
            return false;
        };
        let at = Instant::now();
        if conc::take(&p.seg, p.k(), sluice::clock::boot_ms).is_err() {
            return false;
        }
        let in_use = conc::unpack(p.k().permits.load(std::sync::atomic::Ordering::Acquire)).1;
        self.hosts[h].procs[i].permits.push(at);
        self.takes += 1;
        let (m, now) = lease_entries(&self.keys);
        let since = at.elapsed().as_millis() as i64;
        // S1: live when handed out (Redis' clock, allowing for the time since).
        let (held, exp) = m.get(&self.hosts[h].id).copied().unwrap_or((0, 0));
        assert!(
            exp + since + 1 > now && in_use <= held,
            "S1: host {h} has {in_use} permits in use; Redis counts {held} (expiring at {exp}, \
             now {now}, {since} ms after the hand-out)"
        );
        // S3: the permits of the last quarter TTL, cluster-wide.
        let fresh = self
            .hosts
            .iter()
            .flat_map(|h| &h.procs)
            .flat_map(|p| &p.permits)
            .filter(|t| t.elapsed() < Duration::from_millis(HOLD_MS))
            .count() as u64;
        let counted = live_sum(&m, now - since);
        assert!(
            fresh <= self.cap.max(counted),
            "S3: {fresh} permits taken within {HOLD_MS} ms are in flight; cap {}, Redis \
             counts {counted}",
            self.cap
        );
        true
    }

    async fn apply(&mut self, s: &Step) {
        let hn = self.hosts.len();
        let pick = |h: usize, i: usize, w: &World| (h % hn, i % w.hosts[h % hn].procs.len());
        match *s {
            Step::Take(h, i) => {
                let (h, i) = pick(h, i, self);
                self.take(h, i);
            }
            Step::Release(h, i) => {
                let (h, i) = pick(h, i, self);
                let mp = &mut self.hosts[h].procs[i];
                if let (Some(p), None) = (mp.p.as_ref(), mp.stalled.as_ref())
                    && !mp.permits.is_empty()
                {
                    mp.permits.remove(0);
                    conc::release(&p.seg, p.k());
                }
            }
            Step::Stall(h, i) => {
                let (h, i) = pick(h, i, self);
                let mp = &self.hosts[h].procs[i];
                let Some(p) = mp.p.as_ref().filter(|_| mp.stalled.is_none()) else {
                    return;
                };
                let k = p.k();
                let clocks = &self.hosts[h].clocks;
                let lock = p.seg.lock(&k.lease_lock);
                let LockAttempt::Acquired { token, .. } = lock.try_lock(
                    clocks.host_us().div_euclid(1_000),
                    conc::lease_lock_timeout_ms(PULL_TIMEOUT),
                ) else {
                    return;
                };
                let call = conc::begin_call(
                    k,
                    &self.params(),
                    k.denied.load(std::sync::atomic::Ordering::Relaxed),
                    clocks.boot_ms(),
                    clocks.host_us(),
                );
                let outcome = self.send(h, call).await;
                self.hosts[h].procs[i].stalled = Some(Stalled {
                    call,
                    token,
                    outcome,
                });
            }
            Step::Resume(h, i) => {
                // One of the stalled processes (any host), if there are.
                let stalled: Vec<(usize, usize)> = (0..hn)
                    .flat_map(|h| (0..self.hosts[h].procs.len()).map(move |i| (h, i)))
                    .filter(|&(h, i)| self.hosts[h].procs[i].stalled.is_some())
                    .collect();
                if !stalled.is_empty() {
                    let (h, i) = stalled[(h * 3 + i) % stalled.len()];
                    self.resume(h, i);
                }
            }
            Step::WallClock(h, ms) => {
                // Mostly the host of a stalled process, if there is one.
                let h = (0..hn)
                    .find(|&x| h < 2 && self.hosts[x].procs.iter().any(|p| p.stalled.is_some()))
                    .unwrap_or(h % hn);
                let c = &self.hosts[h].clocks;
                c.skew_us.set(c.skew_us.get() + ms * 1_000);
            }
            Step::SetCap(cap) => {
                self.cap = cap;
                self.version += 1;
                write_meta(
                    &mut self.conn,
                    &self.keys,
                    "t",
                    &conc_meta(cap, MODEL_LEASE_MS, self.version),
                )
                .await;
            }
            Step::CrashProcess(h, i) => {
                let (h, i) = pick(h, i, self);
                let mp = &mut self.hosts[h].procs[i];
                mp.p = None;
                mp.permits.clear();
                mp.stalled = None;
            }
            Step::CrashHost(h) => {
                for mp in &mut self.hosts[h % hn].procs {
                    mp.p = None;
                    mp.permits.clear();
                    mp.stalled = None;
                }
            }
            Step::Tick => self.background().await,
            Step::Net(h, m) => self.hosts[h % hn].net = m,
            Step::Sleep(ms) => {
                // Time passes; the background threads run meanwhile.
                let until = Instant::now() + Duration::from_millis(ms);
                while Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    self.contract_releases();
                    self.background().await;
                }
            }
        }
    }

    fn resume(&mut self, h: usize, i: usize) {
        let params = self.params();
        let late = &mut self.late;
        let mp = &mut self.hosts[h].procs[i];
        let (Some(p), Some(st)) = (mp.p.as_ref(), mp.stalled.take()) else {
            return;
        };
        let k = p.k();
        let lock = p.seg.lock(&k.lease_lock);
        if k.seq.load(std::sync::atomic::Ordering::Acquire) != st.call.seq {
            *late += 1;
        }
        conc::finish_call(
            k,
            &params,
            &st.call,
            st.outcome,
            sluice::clock::boot_ms(),
            lock.holds(st.token),
        );
        lock.unlock(st.token);
    }

    /// Liveness and nothing stuck, at the end of a case.
    async fn settle(&mut self) {
        for h in 0..self.hosts.len() {
            self.hosts[h].net = 0;
            for i in 0..self.hosts[h].procs.len() {
                self.resume(h, i);
            }
        }
        let deadline = Instant::now() + Duration::from_millis(4 * MODEL_LEASE_MS);
        let live: Vec<(usize, usize)> = (0..self.hosts.len())
            .flat_map(|h| (0..self.hosts[h].procs.len()).map(move |i| (h, i)))
            .filter(|&(h, i)| self.hosts[h].procs[i].p.is_some())
            .collect();
        if live.is_empty() {
            return;
        }
        let mut turn = 0;
        while (self.live_permits() as u64) < self.cap {
            let (h, i) = live[turn % live.len()];
            turn += 1;
            if !self.take(h, i) {
                self.background().await;
                assert!(
                    Instant::now() < deadline,
                    "liveness: {} of {} permits handed out {} ms after the last step; \
                     hosts' in use {:?}",
                    self.live_permits(),
                    self.cap,
                    4 * MODEL_LEASE_MS,
                    self.in_use()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // The settle holds every permit (no contract releases): renewals keep them.
        }
        // Nothing stuck: each live host counts exactly its live processes' permits.
        for h in 0..self.hosts.len() {
            for i in 0..self.hosts[h].procs.len() {
                if let Some(p) = self.hosts[h].procs[i].p.as_ref() {
                    conc::reclaim_dead(&p.seg, p.k());
                }
            }
            let model: usize = self.hosts[h]
                .procs
                .iter()
                .filter(|p| p.p.is_some())
                .map(|p| p.permits.len())
                .sum();
            if let Some(k) = self.hosts[h]
                .procs
                .iter()
                .find_map(|p| p.p.as_ref().map(|p| p.k()))
            {
                let in_use = conc::unpack(k.permits.load(std::sync::atomic::Ordering::Acquire)).1;
                assert_eq!(in_use, model as u64, "host {h}: in use vs the model");
            }
        }
    }

    fn in_use(&self) -> Vec<Option<u64>> {
        self.hosts
            .iter()
            .map(|h| {
                h.procs.iter().find_map(|p| {
                    p.p.as_ref().map(|p| {
                        conc::unpack(p.k().permits.load(std::sync::atomic::Ordering::Acquire)).1
                    })
                })
            })
            .collect()
    }
}

async fn run_case(c: &Case) -> (u64, u64, u64) {
    let ns = unique_ns("pmodel");
    let keys = Keys::new(&ns).unwrap();
    let mut conn = protocol_conn(&shared_redis()).await;
    write_meta(&mut conn, &keys, "t", &conc_meta(c.cap, MODEL_LEASE_MS, 1)).await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = c
        .procs
        .iter()
        .enumerate()
        .map(|(h, &n)| {
            let path = dir.path().join(format!("host{h}"));
            ModelHost {
                id: format!("h{h}"),
                net: 0,
                procs: (0..n)
                    .map(|_| ModelProcess {
                        p: Some(Process::open(&path, "t")),
                        permits: Vec::new(),
                        stalled: None,
                    })
                    .collect(),
                clocks: HostClocks {
                    skew_us: std::cell::Cell::new(0),
                },
            }
        })
        .collect();
    let mut w = World {
        keys,
        conn,
        cap: c.cap,
        version: 1,
        hosts,
        takes: 0,
        calls: 0,
        late: 0,
    };
    for s in &c.steps {
        w.contract_releases();
        w.apply(s).await;
    }
    w.settle().await;
    (w.takes, w.calls, w.late)
}

#[test]
fn permits_never_exceed_the_model_and_free_permits_are_handed_out() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = sluice_testkit::prop_config("permits_model", 12);
    cfg.max_shrink_iters = 64;
    let mut runner = proptest::test_runner::TestRunner::new(cfg);
    let totals = std::cell::Cell::new((0u64, 0u64, 0u64, 0u32));
    runner
        .run(&case(), |c| {
            let (takes, calls, late) = rt.block_on(run_case(&c));
            let (t, l, d, n) = totals.get();
            totals.set((t + takes, l + calls, d + late, n + 1));
            Ok(())
        })
        .unwrap();
    let (t, l, d, n) = totals.get();
    eprintln!(
        "permits model: {n} cases, {t} permits handed out, {l} LEASE calls, {d} late answers \
         delivered after a newer call"
    );
}

/// Found by the model: a host whose last LEASE answer said cap 0 (threshold 0) holds nothing,
/// so it never renews, and it believed the cap reached, so it never grew: a threshold raised
/// later never reached it (seed 14413755746203448581, shrunk).
#[test]
fn a_threshold_raised_from_zero_reaches_a_host_that_holds_nothing() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run_case(&Case {
        procs: vec![1, 1],
        cap: 0,
        steps: vec![Step::Take(0, 0), Step::Take(1, 0), Step::SetCap(3)],
    }));
}
