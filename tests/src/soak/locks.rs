//! The lock track of the soak (issue 23): holders of one lock on several hosts, a fenced
//! resource, and the lock's own Redis run **with persistence** and restarted from its dump.
//!
//! # What runs
//!
//! * **The lock's Redis**: a second Redis (the main one stays as it is), RDB only, no
//!   automatic saves: `lock.redis` runs `SAVE`, lets the holders go on (more tokens are
//!   handed out), SIGKILLs it and restarts it from the dump, so it comes back with an
//!   **older** token counter (issue 23 item 8).
//! * **The resource's Redis**: a third Redis nobody disturbs, holding the fenced resource (a
//!   hash `token`, `value`, written by `FENCED_WRITE` of `worker-sdk/examples/holder.rs`).
//! * **Holders**: [`SLOTS`] slots on hosts `lh0 …`, each running one `holder … lock` process at
//!   a time (`examples/holder.rs`): it waits for lock [`LOCK`] (TTL [`TTL_MS`], waiting at most
//!   10 s, then exits non-zero and is replaced), prints its token, and answers the soak's
//!   `write <n>` and `held` lines every [`QUERY_MS`]; after holding 0.5 – 3 s its stdin is
//!   closed and it releases the lock and exits 0; its slot starts a new holder 0.1 – 0.5 s
//!   later. `lock.kill` SIGKILLs the current holder (its lock lapses after the TTL);
//!   `lock.stop` SIGSTOPs it past the TTL and SIGCONTs it (it wakes up deposed and writes late).
//!
//! # Invariants (each a pure function below, unit-tested with crafted ledgers)
//!
//! * **`locks.token`**: every token handed out is larger than every token handed out before
//!   it — across holders, kills, expiries and restarts of the lock's Redis from an older dump.
//!   Tokens are ordered by when their `token` line arrived; a lock is taken only after its
//!   previous holder released it or its TTL (1 s) ran out, far longer than printing a line.
//! * **`locks.fence`**: the resource never accepts a write whose token is lower than one it
//!   accepted before: a write acknowledged `written` was sent after every write acknowledged
//!   before it, so its token must be ≥ each of theirs.
//! * **`locks.overlap`**: at most one live holder believes it holds the lock. A holder's
//!   belief (`guard.is_held()`, the `held true` answer) is known from its token line to the
//!   sending of its last `held true` query (the answer was computed after that; a belief does
//!   not come back once lost unless Redis gave the lock back, below). Two holders' known
//!   beliefs must not overlap. docs/concurrency.md: `is_held` stops a quarter TTL before Redis
//!   can expire the lock (valid until the last renewal's *sending* + ¾ TTL on the boot clock,
//!   which runs on while a process is stopped), so without data loss there is no overlap at
//!   all. The documented window: a restart of Redis from an older dump can hand the lock back
//!   to an older holder whose key was in the dump, while the newer holder still believes until
//!   its next renewal fails — at most until its last renewal before the kill + ¾ TTL. So
//!   overlaps inside `[back up, kill + ¾ TTL + 100 ms]` of a restart are allowed (and a
//!   holder's belief after a restart is counted from the restart on).
//! * **`locks.liveness`**: a token is handed out at least every [`LIVE_MS`] (plus the time the
//!   lock's Redis was down meanwhile): holders hold ≤ 3 s, a stopped or killed one blocks the
//!   lock for ≤ 4 s + TTL, and some slot always waits.
//! * **`locks.holder_exit`** a holder exits other than 0 (after stdin closed) or with "lock …
//!   is held by another holder" / "Redis unreachable" (a 10 s wait that found the lock busy
//!   or Redis down); **`locks.leak`** a holder process or segment left at the end.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::check::Violation;
use super::plan::Step;
use super::rng::Rng;
use crate::{RedisServer, now_ms, remove_segment, signal, workspace_bin};

/// The lock's name.
pub const LOCK: &str = "soaklock";
/// The lock's TTL.
pub const TTL_MS: i64 = 1_000;
/// Holder slots (one host each).
pub const SLOTS: usize = 3;
/// How often a holder is asked to write and whether it holds.
pub const QUERY_MS: i64 = 150;
/// The longest time without a new token (plus the lock Redis's downtime).
pub const LIVE_MS: i64 = 12_000;
/// The fenced resource's key.
const RESOURCE: &str = "soak:resource";

/// A token line: who, which token, when it arrived (ms, the soak's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSeen {
    /// Holder id (unique over the run).
    pub holder: u64,
    /// The token.
    pub token: u64,
    /// When its line arrived.
    pub at_ms: i64,
}

/// A write the resource acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSeen {
    /// Holder id.
    pub holder: u64,
    /// The writer's token.
    pub token: u64,
    /// When the `write` line was sent.
    pub sent_ms: i64,
    /// When `written` arrived.
    pub acked_ms: i64,
}

/// A restart of the lock's Redis: killed at `down_ms`, answering again at `up_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restart {
    /// SIGKILL.
    pub down_ms: i64,
    /// Up again (None while down).
    pub up_ms: Option<i64>,
}

/// `locks.token`: `t` after tokens whose largest is `max_before`.
pub fn check_token(max_before: Option<u64>, t: &TokenSeen) -> Option<Violation> {
    let m = max_before?;
    (t.token <= m).then(|| Violation {
        invariant: "locks.token",
        task: Some(format!("lock {LOCK}")),
        slice: None,
        evidence: format!(
            "holder {} got token {} at {} although token {m} was handed out before",
            t.holder, t.token, t.at_ms
        ),
    })
}

/// `locks.fence`: the write `w` the resource acknowledged, after the acknowledged writes
/// `acked` (any order).
pub fn check_fence(acked: &[WriteSeen], w: &WriteSeen) -> Option<Violation> {
    let before = acked
        .iter()
        .filter(|a| a.acked_ms < w.sent_ms && a.token > w.token)
        .max_by_key(|a| a.token)?;
    Some(Violation {
        invariant: "locks.fence",
        task: Some(format!("lock {LOCK}")),
        slice: None,
        evidence: format!(
            "the resource accepted holder {}'s write with token {} (sent at {}) after it had \
             accepted holder {}'s with token {} (acknowledged at {})",
            w.holder, w.token, w.sent_ms, before.holder, before.token, before.acked_ms
        ),
    })
}

/// One holder's known belief: from `from_ms` to the sending of its last `held true` query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Belief {
    /// Holder id.
    pub holder: u64,
    /// Its token.
    pub token: u64,
    /// Known to believe from (its token line, or the last restart of the lock's Redis).
    pub from_ms: i64,
    /// … until (the last `held true` query's sending).
    pub to_ms: i64,
}

/// `locks.overlap`: `b` (just extended) against the other holders' beliefs, given the
/// restarts of the lock's Redis (see the module docs for the allowed window).
pub fn check_overlap(others: &[Belief], restarts: &[Restart], b: &Belief) -> Option<Violation> {
    for o in others.iter().filter(|o| o.holder != b.holder) {
        let (from, to) = (b.from_ms.max(o.from_ms), b.to_ms.min(o.to_ms));
        if from >= to {
            continue;
        }
        let allowed = restarts.iter().any(|r| {
            r.up_ms
                .is_some_and(|up| from >= up && to <= r.down_ms + TTL_MS * 3 / 4 + 100)
        });
        if !allowed {
            return Some(Violation {
                invariant: "locks.overlap",
                task: Some(format!("lock {LOCK}")),
                slice: None,
                evidence: format!(
                    "holders {} (token {}) and {} (token {}) both believed they held the lock \
                     from {from} to {to} ({} ms; restarts of the lock's Redis: {restarts:?})",
                    o.holder,
                    o.token,
                    b.holder,
                    b.token,
                    to - from
                ),
            });
        }
    }
    None
}

/// Whether `b` overlaps another holder's belief at all (allowed or not: for the summary).
pub fn overlaps(others: &[Belief], b: &Belief) -> bool {
    others
        .iter()
        .any(|o| o.holder != b.holder && b.from_ms.max(o.from_ms) < b.to_ms.min(o.to_ms))
}

/// `locks.liveness`: no token since `last_token_ms` at `now_ms`, the lock's Redis down for
/// `down_ms` of that time.
pub fn check_liveness(last_token_ms: i64, now_ms: i64, down_ms: i64) -> Option<Violation> {
    let waited = now_ms - last_token_ms;
    (waited > LIVE_MS + down_ms).then(|| Violation {
        invariant: "locks.liveness",
        task: Some(format!("lock {LOCK}")),
        slice: None,
        evidence: format!(
            "no holder got the lock for {waited} ms (the lock's Redis down {down_ms} ms of it; \
             allowed {LIVE_MS} ms more)"
        ),
    })
}

/// What a holder process is doing.
#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the lock.
    Waiting,
    /// Holds it (as far as the soak knows) until `release_ms`.
    Holding { release_ms: i64 },
    /// Its stdin was closed: releasing and exiting.
    Leaving,
    /// SIGKILLed by the soak.
    Killed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Query {
    Write { sent_ms: i64 },
    Held { sent_ms: i64 },
}

struct Holder {
    id: u64,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<(String, i64)>,
    phase: Phase,
    /// Its token, once it has one.
    token: Option<u64>,
    /// Queries sent, answered in order.
    pending: std::collections::VecDeque<Query>,
    next_query_ms: i64,
    stopped_until: Option<i64>,
    /// Belief known so far (None before its first `held true`).
    belief: Option<Belief>,
    err: PathBuf,
}

struct Slot {
    host: String,
    holder: Option<Holder>,
    respawn_at: i64,
}

/// What the track saw, for the summary.
#[derive(Debug, Default, Clone)]
pub struct LockStats {
    /// Tokens handed out.
    pub tokens: u64,
    /// Writes accepted / refused by the resource.
    pub written: u64,
    /// Refused writes (a deposed holder's).
    pub refused: u64,
    /// `held` answers (true, false).
    pub held: (u64, u64),
    /// Holders SIGKILLed, SIGSTOPped.
    pub kills: u64,
    /// Holders SIGSTOPped.
    pub stops: u64,
    /// Restarts of the lock's Redis from its dump.
    pub restarts: u64,
    /// Restarts whose Redis came back with a counter below the last token (the case item 8
    /// is about).
    pub older_counter: u64,
    /// Holders that waited 10 s in vain (exit with Busy / Unreachable).
    pub gave_up: u64,
    /// Longest time without a new token, ms.
    pub longest_gap_ms: i64,
    /// `held true` answers whose belief overlapped another's inside a restart window.
    pub allowed_overlaps: u64,
}

struct Inner {
    ns: String,
    logs: PathBuf,
    lock_redis: RedisServer,
    resource_redis: RedisServer,
    slots: Vec<Slot>,
    rng: Rng,
    next_id: u64,
    write_seq: u64,
    max_token: Option<u64>,
    last_token_ms: i64,
    /// When each holder's token line arrived.
    token_at: BTreeMap<u64, i64>,
    acked: Vec<WriteSeen>,
    beliefs: Vec<Belief>,
    restarts: Vec<Restart>,
    /// A `lock.redis` in progress: (kill at, restart after that many ms down).
    redis_plan: Option<(i64, i64)>,
    violations: Vec<Violation>,
    stats: LockStats,
}

/// The lock track: its servers, holders and checks, driven by a thread of its own every 20 ms.
pub struct Track {
    inner: Arc<Mutex<Inner>>,
    stop: Arc<AtomicBool>,
    reported: AtomicBool,
    driver: Option<std::thread::JoinHandle<()>>,
}

impl Track {
    /// Starts the lock's Redis (RDB, saves only when told), the resource's Redis and the
    /// holders of namespace `<ns>-locks` (so the main track's segment and process checks keep
    /// to their own).
    pub fn start(ns: &str, logs: &Path, seed: u64) -> Self {
        let lock_redis = RedisServer::start_with(&["--save", "", "--appendonly", "no"]);
        let resource_redis = RedisServer::start();
        let ns = format!("{ns}-locks");
        let slots = (0..SLOTS)
            .map(|i| Slot {
                host: format!("{ns}-lh{i}"),
                holder: None,
                respawn_at: 0,
            })
            .collect();
        let inner = Arc::new(Mutex::new(Inner {
            ns,
            logs: logs.to_path_buf(),
            lock_redis,
            resource_redis,
            slots,
            rng: Rng::new(seed ^ 0x10c4_5eed),
            next_id: 0,
            write_seq: 0,
            max_token: None,
            last_token_ms: now_ms(),
            token_at: BTreeMap::new(),
            acked: Vec::new(),
            beliefs: Vec::new(),
            restarts: Vec::new(),
            redis_plan: None,
            violations: Vec::new(),
            stats: LockStats::default(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (i2, s2) = (inner.clone(), stop.clone());
        let driver = std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                if let Ok(mut g) = i2.lock() {
                    g.tick();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self {
            inner,
            stop,
            reported: AtomicBool::new(false),
            driver: Some(driver),
        }
    }

    /// Applies a lock step; what it did.
    pub fn apply(&self, step: &Step) -> String {
        let Ok(mut g) = self.inner.lock() else {
            return "lock track poisoned".into();
        };
        g.apply(step)
    }

    /// The violations seen since the last call (once: `locks.track` if the track's driver
    /// panicked, e.g. the lock's Redis did not come back).
    pub fn take_violations(&self) -> Vec<Violation> {
        match self.inner.lock() {
            Ok(mut g) => std::mem::take(&mut g.violations),
            Err(_) if !self.reported.swap(true, Ordering::Relaxed) => vec![Violation {
                invariant: "locks.track",
                task: Some(format!("lock {LOCK}")),
                slice: None,
                evidence: "the lock track's driver panicked (see the soak's stderr)".into(),
            }],
            Err(_) => Vec::new(),
        }
    }

    /// Stops the holders (closing stdin: each releases and exits 0), the servers; checks that
    /// nothing is left. The violations not taken yet and a summary line.
    pub fn shutdown(mut self) -> (Vec<Violation>, String) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(d) = self.driver.take() {
            let _ = d.join();
        }
        let Ok(mut g) = self.inner.lock() else {
            return (Vec::new(), "lock track poisoned".into());
        };
        g.finish()
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(d) = self.driver.take() {
            let _ = d.join();
        }
        if let Ok(mut g) = self.inner.lock() {
            for s in &mut g.slots {
                if let Some(mut h) = s.holder.take() {
                    let _ = h.child.kill();
                    let _ = h.child.wait();
                }
            }
        }
    }
}

impl Inner {
    fn violate(&mut self, v: Option<Violation>) {
        if let Some(v) = v {
            self.violations.push(v);
        }
    }

    fn spawn(&mut self, slot: usize) {
        self.next_id += 1;
        let id = self.next_id;
        let err = self.logs.join(format!("lock-holder-{id}.err"));
        let mut cmd = Command::new(workspace_bin("examples/holder"));
        cmd.args(["--redis", &self.lock_redis.url()])
            .args(["--namespace", &self.ns])
            .args(["--host-id", &self.slots[slot].host])
            .args(["lock", "--name", LOCK, "--ttl-ms", &TTL_MS.to_string()])
            .args(["--resource", RESOURCE])
            .args(["--resource-redis", &self.resource_redis.url()])
            .env("RUST_LOG", "sluice=info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(
                std::fs::File::create(&err)
                    .map(Stdio::from)
                    .unwrap_or_else(|_| Stdio::null()),
            );
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                self.violate(Some(Violation {
                    invariant: "locks.holder_exit",
                    task: None,
                    slice: None,
                    evidence: format!("cannot start a holder: {e}"),
                }));
                self.slots[slot].respawn_at = now_ms() + 1_000;
                return;
            }
        };
        let stdin = child.stdin.take();
        let out = child.stdout.take();
        let (tx, rx) = channel();
        if let Some(out) = out {
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((line, now_ms())).is_err() {
                        break;
                    }
                }
            });
        }
        self.slots[slot].holder = Some(Holder {
            id,
            child,
            stdin,
            lines: rx,
            phase: Phase::Waiting,
            token: None,
            pending: Default::default(),
            next_query_ms: 0,
            stopped_until: None,
            belief: None,
            err,
        });
    }

    fn tick(&mut self) {
        let now = now_ms();
        // The lock's Redis: kill and restart as planned.
        if let Some((kill_at, down)) = self.redis_plan {
            let up_at = kill_at + down;
            if now >= kill_at && self.restarts.last().is_none_or(|r| r.up_ms.is_some()) {
                self.lock_redis.kill();
                self.restarts.push(Restart {
                    down_ms: now_ms(),
                    up_ms: None,
                });
            }
            if now >= up_at && self.restarts.last().is_some_and(|r| r.up_ms.is_none()) {
                self.lock_redis.restart();
                let up = now_ms();
                if let Some(r) = self.restarts.last_mut() {
                    r.up_ms = Some(up);
                }
                self.redis_plan = None;
                self.stats.restarts += 1;
                let mut c = self.lock_redis.admin_conn();
                let counter: Option<u64> = redis::cmd("GET")
                    .arg(format!("{}:{{{LOCK}}}:lock:token", self.ns))
                    .query(&mut c)
                    .ok()
                    .flatten();
                if counter.unwrap_or(0) < self.max_token.unwrap_or(0) {
                    self.stats.older_counter += 1;
                }
                // Beliefs known so far end here: after the restart each starts anew.
                for s in &mut self.slots {
                    if let Some(h) = &mut s.holder {
                        h.belief = None;
                    }
                }
            }
        }
        // Every holder's new lines, in the order they arrived (tokens are judged in that
        // order, whichever slot they came from).
        let mut lines = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(h) = &s.holder {
                while let Ok((line, at)) = h.lines.try_recv() {
                    lines.push((at, i, line));
                }
            }
        }
        lines.sort_by_key(|l| (l.0, l.1));
        for (at, i, line) in lines {
            if let Some(mut h) = self.slots[i].holder.take() {
                self.on_line(&mut h, &line, at);
                self.slots[i].holder = Some(h);
            }
        }
        for i in 0..self.slots.len() {
            self.tend(i, now);
        }
        let down: i64 = self
            .restarts
            .iter()
            .map(|r| {
                let (a, b) = (r.down_ms.max(self.last_token_ms), r.up_ms.unwrap_or(now));
                (b - a).max(0)
            })
            .sum();
        let v = check_liveness(self.last_token_ms, now, down);
        if v.is_some() {
            // Once per stall.
            self.last_token_ms = now;
        }
        self.violate(v);
    }

    fn tend(&mut self, i: usize, now: i64) {
        let Some(mut h) = self.slots[i].holder.take() else {
            if now >= self.slots[i].respawn_at {
                self.spawn(i);
            }
            return;
        };
        if let Some(until) = h.stopped_until
            && now >= until
        {
            signal(h.child.id(), libc::SIGCONT);
            h.stopped_until = None;
        }
        // Exited? (Its last lines first.)
        if let Ok(Some(st)) = h.child.try_wait() {
            while let Ok((line, at)) = h.lines.try_recv() {
                self.on_line(&mut h, &line, at);
            }
            let err = std::fs::read_to_string(&h.err).unwrap_or_default();
            match h.phase {
                Phase::Killed => {}
                Phase::Leaving if st.success() => {}
                Phase::Waiting
                    if err.contains("is held by another holder")
                        || err.contains("Redis unreachable") =>
                {
                    self.stats.gave_up += 1;
                }
                _ => self.violate(Some(Violation {
                    invariant: "locks.holder_exit",
                    task: Some(format!("lock {LOCK}")),
                    slice: None,
                    evidence: format!(
                        "holder {} ({:?}) exited {st}: {}",
                        h.id,
                        h.phase,
                        err.lines().last().unwrap_or("")
                    ),
                })),
            }
            self.slots[i].respawn_at = now + self.rng.range(100, 500) as i64;
            return;
        }
        if h.stopped_until.is_none()
            && let Phase::Holding { release_ms, .. } = h.phase
        {
            if now >= release_ms {
                h.stdin = None;
                h.phase = Phase::Leaving;
            } else if now >= h.next_query_ms
                && let Some(stdin) = h.stdin.as_mut()
            {
                self.write_seq += 1;
                let ok = writeln!(stdin, "write {}\nheld", self.write_seq).is_ok()
                    && stdin.flush().is_ok();
                if ok {
                    let sent_ms = now_ms();
                    h.pending.push_back(Query::Write { sent_ms });
                    h.pending.push_back(Query::Held { sent_ms });
                }
                h.next_query_ms = now + QUERY_MS;
            }
        }
        self.slots[i].holder = Some(h);
    }

    fn on_line(&mut self, h: &mut Holder, line: &str, at: i64) {
        if let Some(t) = line.strip_prefix("token ") {
            let Ok(token) = t.trim().parse::<u64>() else {
                return;
            };
            let seen = TokenSeen {
                holder: h.id,
                token,
                at_ms: at,
            };
            let v = check_token(self.max_token, &seen);
            self.violate(v);
            self.max_token = Some(self.max_token.unwrap_or(0).max(token));
            self.stats.longest_gap_ms = self.stats.longest_gap_ms.max(at - self.last_token_ms);
            self.last_token_ms = at;
            self.stats.tokens += 1;
            h.token = Some(token);
            self.token_at.insert(h.id, at);
            if h.phase == Phase::Waiting {
                h.phase = Phase::Holding {
                    release_ms: at + self.rng.range(500, 3_000) as i64,
                };
            }
            return;
        }
        let Some(q) = h.pending.pop_front() else {
            return;
        };
        let Some(token) = h.token else {
            return;
        };
        match (q, line.split_whitespace().collect::<Vec<_>>().as_slice()) {
            (Query::Write { sent_ms }, ["written"]) => {
                let w = WriteSeen {
                    holder: h.id,
                    token,
                    sent_ms,
                    acked_ms: at,
                };
                let v = check_fence(&self.acked, &w);
                self.violate(v);
                self.acked.push(w);
                // Only the largest token matters for later writes: keep the list short.
                if self.acked.len() > 512 {
                    let cut = self.acked.len() - 256;
                    let keep_max = self.acked[..cut].iter().max_by_key(|a| a.token).copied();
                    self.acked.drain(..cut);
                    if let Some(m) = keep_max {
                        self.acked.insert(0, m);
                    }
                }
                self.stats.written += 1;
            }
            (Query::Write { .. }, ["refused", _]) => self.stats.refused += 1,
            (Query::Held { sent_ms }, ["held", "true"]) => {
                self.stats.held.0 += 1;
                let since_restart = self
                    .restarts
                    .iter()
                    .filter_map(|r| r.up_ms)
                    .filter(|up| *up <= sent_ms)
                    .max()
                    .unwrap_or(i64::MIN);
                let b = match h.belief {
                    Some(b) => Belief {
                        to_ms: sent_ms,
                        ..b
                    },
                    None => {
                        let from = self
                            .beliefs_start(h.id)
                            .unwrap_or(sent_ms)
                            .max(since_restart);
                        Belief {
                            holder: h.id,
                            token,
                            from_ms: from,
                            to_ms: sent_ms,
                        }
                    }
                };
                h.belief = Some(b);
                let v = check_overlap(&self.beliefs, &self.restarts, &b);
                if v.is_none() && overlaps(&self.beliefs, &b) {
                    self.stats.allowed_overlaps += 1;
                }
                self.violate(v);
                match self.beliefs.iter_mut().find(|x| x.holder == b.holder) {
                    Some(x) => *x = b,
                    None => self.beliefs.push(b),
                }
                // Beliefs that ended long ago cannot overlap new ones.
                let horizon = sent_ms - 10 * TTL_MS;
                self.beliefs.retain(|x| x.to_ms >= horizon);
            }
            (Query::Held { .. }, ["held", "false"]) => self.stats.held.1 += 1,
            (_, ["error", ..]) => {}
            (q, other) => self.violate(Some(Violation {
                invariant: "locks.holder_exit",
                task: Some(format!("lock {LOCK}")),
                slice: None,
                evidence: format!("holder {}: answer {other:?} to {q:?}", h.id),
            })),
        }
    }

    /// When a holder's token line arrived (its belief starts there).
    fn beliefs_start(&self, holder: u64) -> Option<i64> {
        self.token_at.get(&holder).copied()
    }

    fn current_holder(&self) -> Option<usize> {
        self.slots.iter().position(|s| {
            s.holder.as_ref().is_some_and(|h| {
                matches!(h.phase, Phase::Holding { .. }) && h.stopped_until.is_none()
            })
        })
    }

    fn apply(&mut self, step: &Step) -> String {
        match step {
            Step::LockKill => {
                let Some(i) = self.current_holder() else {
                    return "no holder holds the lock now".into();
                };
                let host = self.slots[i].host.clone();
                let h = self.slots[i].holder.as_mut().expect("a holder");
                let _ = h.child.kill();
                h.phase = Phase::Killed;
                let id = h.id;
                self.stats.kills += 1;
                format!("SIGKILL holder {id} on {host}")
            }
            Step::LockStop { ms } => {
                let Some(i) = self.current_holder() else {
                    return "no holder holds the lock now".into();
                };
                let host = self.slots[i].host.clone();
                let h = self.slots[i].holder.as_mut().expect("a holder");
                signal(h.child.id(), libc::SIGSTOP);
                h.stopped_until = Some(now_ms() + *ms as i64);
                // After it wakes up it holds (as far as it knows) a little longer, and writes.
                if let Phase::Holding { release_ms, .. } = &mut h.phase {
                    *release_ms = (*release_ms).max(now_ms() + *ms as i64 + 600);
                }
                let id = h.id;
                self.stats.stops += 1;
                format!("SIGSTOP holder {id} on {host} for {ms} ms")
            }
            Step::LockRedisRestart { more_ms, down_ms } => {
                if self.redis_plan.is_some() {
                    return "a restart of the lock's Redis is in progress".into();
                }
                let mut c = self.lock_redis.admin_conn();
                if let Err(e) = redis::cmd("SAVE").query::<()>(&mut c) {
                    return format!("SAVE failed: {e}");
                }
                self.redis_plan = Some((now_ms() + *more_ms as i64, *down_ms as i64));
                format!(
                    "SAVE the lock's Redis (last token {:?}), SIGKILL it in {more_ms} ms, \
                     restart it from the dump {down_ms} ms later",
                    self.max_token
                )
            }
            other => format!("not a lock step: {other}"),
        }
    }

    fn finish(&mut self) -> (Vec<Violation>, String) {
        for s in &mut self.slots {
            if let Some(h) = &mut s.holder {
                if h.stopped_until.take().is_some() {
                    signal(h.child.id(), libc::SIGCONT);
                }
                h.stdin = None;
            }
        }
        let deadline = now_ms() + 5_000;
        for s in &mut self.slots {
            if let Some(mut h) = s.holder.take() {
                loop {
                    match h.child.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if now_ms() < deadline => {
                            std::thread::sleep(Duration::from_millis(20))
                        }
                        _ => {
                            let _ = h.child.kill();
                            let _ = h.child.wait();
                            self.violations.push(Violation {
                                invariant: "locks.leak",
                                task: Some(format!("lock {LOCK}")),
                                slice: None,
                                evidence: format!(
                                    "holder {} did not exit 5 s after its stdin closed",
                                    h.id
                                ),
                            });
                            break;
                        }
                    }
                }
            }
        }
        for s in &self.slots {
            remove_segment(&self.ns, &s.host);
        }
        let _ = std::fs::write(self.logs.join("lock-redis.log"), self.lock_redis.log());
        self.lock_redis.kill();
        self.resource_redis.kill();
        let s = &self.stats;
        let note = format!(
            "lock track: {} tokens, {} writes accepted, {} refused (deposed holders), held \
             answers {} true / {} false, {} holders killed, {} stopped past the TTL, {} \
             restarts of the lock's Redis from its dump ({} with an older counter), {} holders \
             gave up waiting, longest wait for a token {} ms, {} held answers overlapping \
             another holder's inside a restart window",
            s.tokens,
            s.written,
            s.refused,
            s.held.0,
            s.held.1,
            s.kills,
            s.stops,
            s.restarts,
            s.older_counter,
            s.gave_up,
            s.longest_gap_ms,
            s.allowed_overlaps
        );
        (std::mem::take(&mut self.violations), note)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(holder: u64, token: u64, at_ms: i64) -> TokenSeen {
        TokenSeen {
            holder,
            token,
            at_ms,
        }
    }

    #[test]
    fn a_token_must_exceed_every_token_before_it() {
        assert!(check_token(None, &tok(1, 5, 0)).is_none());
        assert!(check_token(Some(5), &tok(2, 6, 1)).is_none());
        // A repeat (Redis back with an older counter and no floor) and a smaller one fire.
        let v = check_token(Some(6), &tok(3, 6, 2)).expect("a repeated token");
        assert_eq!(v.invariant, "locks.token");
        assert!(check_token(Some(6), &tok(3, 4, 2)).is_some());
    }

    fn w(holder: u64, token: u64, sent_ms: i64, acked_ms: i64) -> WriteSeen {
        WriteSeen {
            holder,
            token,
            sent_ms,
            acked_ms,
        }
    }

    #[test]
    fn the_resource_must_refuse_a_token_below_one_it_accepted() {
        let acked = [w(1, 10, 0, 5), w(2, 20, 10, 15)];
        // Sent after token 20 was acknowledged, with 10: the resource must have refused it.
        let v = check_fence(&acked, &w(1, 10, 16, 18)).expect("a late deposed write");
        assert_eq!(v.invariant, "locks.fence");
        // Sent before 20 was acknowledged: the order on the resource is not known.
        assert!(check_fence(&acked, &w(1, 10, 14, 18)).is_none());
        // Equal or larger tokens are fine.
        assert!(check_fence(&acked, &w(2, 20, 16, 18)).is_none());
        assert!(check_fence(&acked, &w(3, 30, 16, 18)).is_none());
    }

    fn b(holder: u64, token: u64, from_ms: i64, to_ms: i64) -> Belief {
        Belief {
            holder,
            token,
            from_ms,
            to_ms,
        }
    }

    #[test]
    fn two_believers_overlap_only_within_a_restart_window() {
        let x = b(1, 10, 0, 1_000);
        // Y took the lock after X stopped believing: fine.
        assert!(check_overlap(&[x], &[], &b(2, 20, 1_001, 1_500)).is_none());
        // Y's token arrived at 900 while X still answered `held true` for a query sent at
        // 1 000: both believed from 900 to 1 000.
        let v = check_overlap(&[x], &[], &b(2, 20, 900, 1_500)).expect("an overlap");
        assert_eq!(v.invariant, "locks.overlap");
        // The same after a restart of the lock's Redis from an older dump (killed at 950, up
        // at 980): the older holder may get the lock back while the newer still believes,
        // until its last renewal before the kill + ¾ TTL.
        let r = Restart {
            down_ms: 950,
            up_ms: Some(980),
        };
        let x2 = b(1, 10, 980, 1_400);
        assert!(check_overlap(&[x2], &[r], &b(2, 20, 900, 1_500)).is_none());
        // … but not past that window.
        let x3 = b(1, 10, 980, 2_000);
        assert!(check_overlap(&[x3], &[r], &b(2, 20, 900, 2_000)).is_some());
        // A holder is never compared with itself.
        assert!(check_overlap(&[x], &[], &b(1, 10, 0, 2_000)).is_none());
        assert!(overlaps(&[x2], &b(2, 20, 900, 1_500)));
        assert!(!overlaps(&[x], &b(2, 20, 1_001, 1_500)));
    }

    #[test]
    fn liveness_allows_the_redis_downtime() {
        assert!(check_liveness(0, LIVE_MS, 0).is_none());
        assert!(check_liveness(0, LIVE_MS + 1, 0).is_some());
        assert!(check_liveness(0, LIVE_MS + 1_000, 1_000).is_none());
    }
}
