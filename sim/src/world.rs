//! A seeded world at the protocol level: leaders, workers and lock holders calling the
//! protocol's own functions (`sluice_protocol::scripts::roll`, `pull`, the lock scripts) over
//! [`SimConn`]s to one [`SimRedis`], on tokio's paused clock, under faults; a checker watches
//! every command the server runs.
//!
//! What is production code here: the Lua scripts (the whole decision and fencing core on the
//! Redis side) and the Rust functions that build their calls and read their replies. What is
//! not: the drivers — a leader that rolls a window ahead each tick and steps down when
//! refused, workers that pull with a request id and resend it after an I/O error, lock
//! holders. They follow the manager's and the SDK's documented behaviour but are not their
//! code; running the manager's roller and the SDK's background here needs the seams of the
//! next part (docs/simulation.md).
//!
//! Invariants (checked on every command, against the server's own state):
//! * **grants ≤ cap**: within one Redis data generation, the permits PULL granted from a slice
//!   (resends answered `replayed` not counted again) never exceed the largest cap the slice
//!   held. Data lost to a restart or failover starts a new generation: what that can cost is
//!   reported, not judged (the documented allowance).
//! * **fencing**: within one generation and epoch, a task's stored term never goes down while
//!   the stored fence is fresh (younger than `stale_after`): a deposed leader writes nothing
//!   after its successor.
//! * **fencing tokens**: every lock token handed out is above every token handed out before
//!   for that lock, across restarts and failovers (the protocol's floor at Redis `TIME`).
//! * **liveness**: after the last fault, every task is rolled by the last leader at its
//!   current spec (meta version, cap of the current slice) and grants again.
//! * **retire** (the manager's roller): every deleted task is retired by the end, and in time —
//!   10 s after the later of its deletion, the leadership's start and the last server fault.
//! * **another cluster's task** (`u0`, rolled by the second cluster's own `Roller`) is never
//!   retired, and holds its last spec at the end.
//! * **the Envoy mirror** (the manager's `envoy_import::mirror_docs`, run by this cluster's
//!   leaders and by a second cluster on the namespace): no write or delete accepted over
//!   another epoch's or a newer term's fresh fence; at the end every imported domain mirrored
//!   at its owner's version, no other.
//! * no panic anywhere (a panic fails the run with its seed).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_protocol::lease;
use sluice_protocol::scripts::{
    self, Fence, KeyPullBatch, KeyWant, PullRequest, RollOutcome, RollRequest, SliceWrite,
};
use sluice_protocol::{Fallback, Keys, Mode, OnFailure, Pacing, TaskMeta};

use crate::redis::{
    Clock, Event, Fault, FaultPlan, Observer, Reply, SimConn, SimRedis, TokioClock, sha1_hex,
};
use crate::rng::Rng;

/// What a run simulates.
#[derive(Debug, Clone)]
pub struct Config {
    /// Seeds every choice of the run.
    pub seed: u64,
    /// Simulated time (ms).
    pub duration_ms: u64,
    /// Tasks (pooled, 1 s slices unless the seed picks another length).
    pub tasks: usize,
    /// Worker hosts.
    pub hosts: usize,
    /// Manager replicas taking turns as leader.
    pub leaders: usize,
    /// Inject faults (the last 30 % of the run is always quiet).
    pub faults: bool,
    /// A trace line per event on stderr (long).
    pub verbose: bool,
    /// The leaders are the manager's own roller (`sluice_manager::roller::Roller`, default);
    /// `false`: the protocol-level driver of part 1 (a simpler leader, clocks skewed).
    pub manager_roller: bool,
    /// Apply only the faults with these numbers ([`FaultEvent::index`]); `None`: all. The
    /// schedule is decided the same either way (a masked fault is decided and skipped), so a
    /// mask replays bit for bit.
    pub only_faults: Option<std::collections::BTreeSet<u64>>,
}

impl Config {
    /// The defaults for `seed`: 5 simulated minutes, 3 tasks, 3 hosts, 2 leaders, faults on.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            duration_ms: 300_000,
            tasks: 3,
            hosts: 3,
            leaders: 2,
            faults: true,
            verbose: false,
            only_faults: None,
            manager_roller: true,
        }
    }
}

/// What a run saw.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// FNV-1a of every command, reply and time the server saw: equal for equal runs.
    pub trace_hash: u64,
    /// Commands the server ran.
    pub commands: u64,
    /// Permits granted by PULL (all generations).
    pub granted: u64,
    /// Grants above a slice's cap summed over generations of the same slice: the cost of lost
    /// Redis data (reported, allowed).
    pub lost_data_overgrant: u64,
    /// Lock tokens handed out.
    pub tokens: u64,
    /// Envoy mirror writes and deletes accepted (both clusters).
    pub mirror_writes: u64,
    /// Faults injected: restarts, failovers, sleeps, per-command faults.
    pub faults: BTreeMap<&'static str, u64>,
    /// Leader terms that ran.
    pub terms: i64,
    /// Broken invariants (empty: the run passed).
    pub violations: Vec<String>,
    /// The faults applied, in order.
    pub fault_events: Vec<FaultEvent>,
}

/// The shared "etcd": spec versions and the election's state, as every replica sees them.
#[derive(Debug)]
struct Control {
    /// Per task: (version, threshold).
    specs: Vec<(i64, u64)>,
    /// Per task: deleted (not in etcd) — the manager's roller must retire it.
    deleted: Vec<bool>,
    /// Per task: its incarnation (the create revision of its current spec).
    created: Vec<i64>,
    /// etcd's revision: every spec change, deletion and creation takes the next one.
    revision: i64,
    /// The current term and the replica it belongs to (`None`: no leader).
    term: i64,
    holder: Option<usize>,
    /// Epoch (etcd cluster id) of the current term.
    epoch: u64,
    /// Per Envoy domain of [`A_DOMAINS`]: its document's version in etcd (`None`: deleted).
    domains: Vec<Option<i64>>,
    /// Per task: when it was last deleted (world ms).
    deleted_at: Vec<i64>,
    /// When the current holder began to lead (world ms).
    holder_since: i64,
    /// Until when the last whole-server fault (restart, failover, sleep, stop, new epoch)
    /// lasted (world ms).
    disrupted_until: i64,
}

/// A task deleted in etcd must be retired within this long of the later of its deletion, the
/// current leadership's start and the last whole-server fault.
const RETIRE_BOUND_MS: i64 = 10_000;

/// The Envoy domains this cluster imports (`shared` is imported by the second cluster too).
const A_DOMAINS: [&str; 3] = ["a0", "a1", "shared"];
/// The second cluster's domains, always imported.
const B_DOMAINS: [&str; 2] = ["b0", "shared"];
/// The second manager cluster's epoch (another etcd on the same namespace): never one of
/// this cluster's epochs (1, 2, …).
const B_EPOCH: u64 = 1_000_001;

/// A second manager cluster on the namespace (another etcd): one replica mirroring its own
/// Envoy domains (the manager's `envoy_import::mirror_docs`) while it leads.
#[derive(Debug)]
struct Second {
    term: i64,
    leading: bool,
    revision: i64,
    /// Per domain of [`B_DOMAINS`], its version.
    versions: Vec<i64>,
    /// Its own task [`B_TASK`]: (version, threshold), rolled by its own `Roller`.
    task: (i64, u64),
}

/// The second cluster's task (its etcd holds no other; this cluster's etcd does not hold it).
const B_TASK: &str = "u0";

/// etcd's current revision for the second cluster's roller.
struct SecondRevisions(Arc<Mutex<Second>>);

impl sluice_manager::roller::CurrentRevision for SecondRevisions {
    async fn current_revision(&self) -> sluice_manager::error::Result<i64> {
        let b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(b.revision.max(b.term))
    }
}

/// The second cluster's task snapshot.
fn second_snapshot(b: &Second) -> Arc<sluice_manager::tasks::TaskSnapshot> {
    use sluice_manager::tasks::TaskSnapshot;
    let (version, threshold) = b.task;
    let json = format!(r#"{{"threshold":{threshold},"slice_ms":{SLICE_MS}}}"#);
    let mut tasks = BTreeMap::new();
    tasks.insert(B_TASK.to_string(), task_entry(B_TASK, &json, version, 1));
    Arc::new(TaskSnapshot {
        tasks,
        invalid: BTreeMap::new(),
        revision: b.revision,
        loaded: true,
    })
}

/// A domain's document as `envoy_import::list` reads it from etcd (its descriptors name the
/// version, so a stale value is visible in the mirror).
fn domain_doc(name: &str, version: i64) -> (sluice_manager::envoy_import::DomainDoc, i64) {
    (
        sluice_manager::envoy_import::DomainDoc {
            domain: name.to_string(),
            imported_ms: 0,
            tasks: Vec::new(),
            descriptors: vec![
                serde_json::json!({"key": "k", "value": format!("{name}@{version}")}),
            ],
        },
        version,
    )
}

/// This cluster's domain documents and the etcd revision they were read at.
fn a_docs(c: &Control) -> (Vec<(sluice_manager::envoy_import::DomainDoc, i64)>, i64) {
    let docs = A_DOMAINS
        .iter()
        .zip(&c.domains)
        .filter_map(|(name, v)| v.map(|v| domain_doc(name, v)))
        .collect();
    (docs, c.revision)
}

const SLICE_MS: u64 = 1000;
const HORIZON_MS: i64 = 3000;
const RETENTION_MS: i64 = 2000;
const STALE_AFTER_MS: u64 = 2000;
/// The manager's roller in the world: `LeaderContext::for_test` fences go stale after 10 s.
const MANAGER_STALE_AFTER_MS: u64 = 10_000;
const TICK_MS: u64 = 500;
const NS: &str = "sim";

fn task_name(i: usize) -> String {
    format!("t{i}")
}

/// Task `i`'s kind: keyed (KPULL), pooled (PULL), concurrency (LEASE), in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Keyed,
    Pooled,
    Concurrency,
}

fn kind(i: usize) -> Kind {
    match i % 3 {
        0 => Kind::Keyed,
        1 => Kind::Pooled,
        _ => Kind::Concurrency,
    }
}

const LEASE_MS: u64 = 1000;

fn meta(i: usize, slice_ms: u64, version: i64, threshold: u64) -> TaskMeta {
    TaskMeta {
        slice_ms,
        threshold,
        pull: 0,
        local_limit: 0,
        on_failure: OnFailure::Local,
        mode: if kind(i) == Kind::Concurrency {
            Mode::Concurrency
        } else {
            Mode::Pooled
        },
        fallback: Fallback::default(),
        version,
        lease_ms: if kind(i) == Kind::Concurrency {
            LEASE_MS
        } else {
            0
        },
        keyed: kind(i) == Kind::Keyed,
        key_overrides: BTreeMap::new(),
        shadow: false,
        pacing: Pacing::None,
        pace_burst: 0,
    }
}

/// Per-command faults of one connection, from its own seeded generator.
/// Every fault the world decides, numbered in the order it was decided: what a run applied,
/// and (with [`Config::only_faults`]) which ones it may apply — the handle shrinking turns.
#[derive(Debug, Default)]
struct FaultLog {
    next: u64,
    only: Option<std::collections::BTreeSet<u64>>,
    applied: Vec<FaultEvent>,
    counts: BTreeMap<&'static str, u64>,
}

/// One fault a run applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultEvent {
    /// Its number (in the order faults were decided).
    pub index: u64,
    /// Simulated time since the start (ms).
    pub at_ms: i64,
    /// What it was.
    pub what: String,
}

impl FaultLog {
    /// Numbers a decided fault; whether it is applied (then logged and counted).
    fn admit(&mut self, at_ms: i64, name: &'static str, detail: impl FnOnce() -> String) -> bool {
        let index = self.next;
        self.next += 1;
        if self.only.as_ref().is_some_and(|o| !o.contains(&index)) {
            return false;
        }
        *self.counts.entry(name).or_default() += 1;
        self.applied.push(FaultEvent {
            index,
            at_ms,
            what: detail(),
        });
        true
    }
}

type SharedLog = Arc<Mutex<FaultLog>>;

struct Faults {
    rng: Rng,
    on: Arc<Mutex<bool>>,
    log: SharedLog,
    clock: Arc<TokioClock>,
    start_ms: i64,
}

impl FaultPlan for Faults {
    fn on_command(&mut self, args: &[Vec<u8>]) -> Fault {
        if !*self.on.lock().unwrap_or_else(|e| e.into_inner()) {
            return Fault::Deliver;
        }
        let x = self.rng.below(1000);
        let (name, f) = match x {
            0..=9 => ("drop request", Fault::DropRequest),
            10..=19 => ("lose reply", Fault::LoseReply),
            20..=39 => (
                "delay reply",
                Fault::DelayReply(Duration::from_millis(self.rng.range_i(1, 400) as u64)),
            ),
            40..=49 => (
                "delay request",
                Fault::DelayRequest(Duration::from_millis(self.rng.range_i(1, 400) as u64)),
            ),
            _ => return Fault::Deliver,
        };
        let at_ms = self.clock.now_us() / 1000 - self.start_ms;
        let admitted =
            self.log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .admit(at_ms, name, || {
                    let cmd: Vec<String> = args
                        .iter()
                        .take(4)
                        .map(|a| {
                            let a = String::from_utf8_lossy(a);
                            if a.len() > 24 {
                                format!("{}…", &a[..12])
                            } else {
                                a.into_owned()
                            }
                        })
                        .collect();
                    format!("{name} {:?} of `{}`", f, cmd.join(" "))
                });
        if admitted { f } else { Fault::Deliver }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LockOp {
    Acquire,
    Renew,
    Release,
}

/// (generation, lock) → (owner, token, held until ms) as the checker counts it.
type Holders = BTreeMap<(u64, Vec<u8>), (Vec<u8>, i64, i64)>;

/// (generation, slice, host, request id).
type PullId = (u64, Vec<u8>, Vec<u8>, Vec<u8>);
/// (generation, key-slice hash, key digest).
type KeySlot = (u64, Vec<u8>, Vec<u8>);
/// Per host: (permits held, until when in Redis ms).
type Holdings = BTreeMap<Vec<u8>, (i64, i64)>;

/// A meta's fence as last seen: (generation, epoch, term, fenced_ms, the meta's expiry).
type StoredFence = (u64, String, i64, i64, Option<i64>);

/// The checker: sees every command the server runs.
struct Checker {
    pull_sha: String,
    kpull_sha: String,
    lease_sha: String,
    /// (generation, key-slice hash, digest) → (granted, largest cap).
    key_ledger: BTreeMap<KeySlot, (u64, u64)>,
    /// (generation, lease hash) → per host (holding, until ms) after the last LEASE.
    leases: BTreeMap<(u64, Vec<u8>), Holdings>,
    key_granted: u64,
    roll_shas: Vec<String>,
    lock_sha: String,
    hash: u64,
    commands: u64,
    /// A stored fence younger than this may not be taken over.
    stale_after_ms: u64,
    /// (generation, slice, host, request id) → what that pull was granted.
    pulls: BTreeMap<PullId, i64>,
    /// (generation, key slice, host record, request id) → that KPULL's grants.
    key_calls: BTreeMap<PullId, Vec<i64>>,
    /// Who holds each lock, by the checker's count.
    holders: Holders,
    lock_renew_sha: String,
    lock_release_sha: String,
    /// (generation, slice key) → (granted, largest cap).
    ledger: BTreeMap<(u64, Vec<u8>), (u64, u64)>,
    /// Slice key → granted summed over generations (for the data-loss report).
    across: BTreeMap<Vec<u8>, (u64, u64)>,
    /// What lost data cost the slices already forgotten by [`Checker::prune`].
    overgrant_pruned: u64,
    /// Meta key → (generation, epoch, term, fenced_ms) last seen.
    /// The meta's expiry then (a retired tombstone expires: a fence in it ends with it).
    fences: BTreeMap<Vec<u8>, StoredFence>,
    mirror_set_sha: String,
    mirror_del_sha: String,
    /// `NS:envoy`'s fence hash.
    envoy_fence: Vec<u8>,
    /// Envoy domain → (generation, epoch, term, claimed ms) of its stored fence last seen.
    mirror_fences: BTreeMap<String, (u64, String, i64, i64)>,
    /// Mirror writes and deletes accepted.
    mirror_writes: u64,
    /// Lock key → the highest token handed out and the owner it went to (a retry of the same
    /// acquisition, same owner, is answered with the same token).
    tokens: BTreeMap<Vec<u8>, (i64, Vec<u8>)>,
    tokens_issued: u64,
    granted: u64,
    /// Slice key → Redis time (ms) of its last grant > 0.
    last_grant_ms: BTreeMap<Vec<u8>, i64>,
    violations: Vec<String>,
    verbose: bool,
}

fn fnv(hash: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *hash ^= u64::from(*b);
        *hash = hash.wrapping_mul(0x100_0000_01b3);
    }
}

fn int_at(r: &Reply, i: usize) -> Option<i64> {
    match r {
        Reply::Array(items) => match items.get(i) {
            Some(Reply::Int(n)) => Some(*n),
            _ => None,
        },
        _ => None,
    }
}

fn field(ks: &crate::redis::Keyspace, key: &[u8], f: &str, now_ms: i64) -> Option<String> {
    match ks.get(key, now_ms).map(|e| &e.val) {
        Some(crate::redis::Val::Hash(h)) => h
            .get(f.as_bytes())
            .map(|v| String::from_utf8_lossy(v).into_owned()),
        _ => None,
    }
}

impl Observer for Arc<Mutex<Checker>> {
    fn on_command(&mut self, e: &Event<'_>) {
        let mut c = self.lock().unwrap_or_else(|p| p.into_inner());
        c.observe(e);
    }
}

/// The slice start a slice or key-slice key ends with (`…:s:<start>`, `…:k:<start>`).
fn slice_start(key: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(key).ok()?;
    s.rsplit(':').next()?.parse().ok()
}

impl Checker {
    /// The Envoy mirror's fencing, per domain (`envoy_import::mirror_docs`'s scripts): within
    /// one generation, a write or delete is accepted only over a fence that is this writer's
    /// epoch at no newer term, or stale; and a fresh fence never goes to another epoch or back
    /// to an older term (two manager clusters on one namespace keep their own domains).
    fn observe_mirror(&mut self, e: &Event<'_>, now_ms: i64) {
        // EVALSHA sha 2 NS:envoy <fence hash> domain term epoch stale …
        let arg = |i: usize| {
            e.args
                .get(5 + i)
                .map(|a| String::from_utf8_lossy(a).into_owned())
        };
        let (Some(domain), Some(term), Some(epoch), Some(stale)) = (
            arg(0),
            arg(1).and_then(|t| t.parse::<i64>().ok()),
            arg(2),
            arg(3).and_then(|t| t.parse::<i64>().ok()),
        ) else {
            return;
        };
        let op = if e.args[1].eq_ignore_ascii_case(self.mirror_set_sha.as_bytes()) {
            "write"
        } else {
            "delete"
        };
        let accepted = int_at(e.reply, 0) == Some(1);
        if accepted {
            self.mirror_writes += 1;
        }
        let fresh = self
            .mirror_fences
            .get(&domain)
            .filter(|(g, _, _, f)| *g == e.generation && now_ms - f < stale)
            .cloned();
        if let Some((_, ep, t, f)) = &fresh
            && accepted
            && (epoch != *ep || term < *t)
        {
            self.violations.push(format!(
                "envoy mirror fencing: a {op} of domain {domain} by term {term} epoch {epoch} was accepted over the fresh fence of term {t} epoch {ep} ({} ms old; generation {}, at {} µs)",
                now_ms - f,
                e.generation,
                e.now_us
            ));
        }
        let stored = field(e.keyspace, &self.envoy_fence, &domain, now_ms).and_then(|v| {
            let mut it = v.split(' ');
            let ep = it.next()?.to_string();
            let t = it.next()?.parse::<i64>().ok()?;
            let at = it.next()?.parse::<i64>().ok()?;
            Some((ep, t, at))
        });
        match stored {
            Some((ep2, t2, at2)) => {
                if let Some((_, ep, t, f)) = &fresh
                    && (ep2 != *ep || t2 < *t)
                {
                    self.violations.push(format!(
                        "envoy mirror fencing: domain {domain}'s fence went from term {t} epoch {ep} to term {t2} epoch {ep2} while the old one was {} ms old (a {op} by term {term} epoch {epoch}; generation {}, at {} µs)",
                        now_ms - f,
                        e.generation,
                        e.now_us
                    ));
                }
                self.mirror_fences
                    .insert(domain, (e.generation, ep2, t2, at2));
            }
            None => {
                // Only a delete of the domain (by its fence's owner, or once stale) removes it.
                if let Some((_, ep, t, f)) = &fresh
                    && (epoch != *ep || term < *t)
                {
                    self.violations.push(format!(
                        "envoy mirror fencing: domain {domain}'s fresh fence of term {t} epoch {ep} ({} ms old) was removed by a {op} of term {term} epoch {epoch} (generation {}, at {} µs)",
                        now_ms - f,
                        e.generation,
                        e.now_us
                    ));
                }
                self.mirror_fences.remove(&domain);
            }
        }
    }

    /// Forgets slices that ended more than a minute ago (their grants are final), so a long
    /// run's memory stays flat; what lost data cost them is kept as a sum.
    fn prune(&mut self, now_ms: i64) {
        let old = |k: &[u8]| slice_start(k).is_some_and(|s| s < now_ms - 60_000);
        self.ledger.retain(|(_, k), _| !old(k));
        self.key_ledger.retain(|(_, k, _), _| !old(k));
        self.pulls.retain(|(_, k, _, _), _| !old(k));
        self.key_calls.retain(|(_, k, _, _), _| !old(k));
        self.last_grant_ms
            .retain(|k, t| !old(k) || *t >= now_ms - 60_000);
        let gone: Vec<Vec<u8>> = self.across.keys().filter(|k| old(k)).cloned().collect();
        for k in gone {
            if let Some((g, cap)) = self.across.remove(&k) {
                self.overgrant_pruned += g.saturating_sub(cap);
            }
        }
    }

    fn observe(&mut self, e: &Event<'_>) {
        self.commands += 1;
        if self.commands.is_multiple_of(10_000) {
            self.prune(e.now_us.div_euclid(1000));
        }
        let mut h = self.hash;
        fnv(&mut h, &e.now_us.to_le_bytes());
        for a in e.args {
            fnv(&mut h, a);
            fnv(&mut h, b"\x00");
        }
        let mut enc = Vec::new();
        e.reply.encode(&mut enc);
        fnv(&mut h, &enc);
        self.hash = h;
        if self.verbose {
            let args: Vec<String> = e
                .args
                .iter()
                .map(|a| {
                    let s = String::from_utf8_lossy(a);
                    if s.len() > 48 {
                        format!("{}…", &s[..40])
                    } else {
                        s.into_owned()
                    }
                })
                .collect();
            eprintln!(
                "{} g{} {} → {:?}",
                e.now_us,
                e.generation,
                args.join(" "),
                e.reply
            );
        }
        let name = e.args.first().map(|a| a.to_ascii_uppercase());
        if name.as_deref() != Some(b"EVALSHA") || e.args.len() < 4 {
            return;
        }
        let sha = String::from_utf8_lossy(&e.args[1]).to_ascii_lowercase();
        let key = e.args[3].clone();
        let now_ms = e.now_us.div_euclid(1000);
        if sha == self.pull_sha {
            let (Some(granted), Some(cap), Some(replayed)) =
                (int_at(e.reply, 0), int_at(e.reply, 2), int_at(e.reply, 5))
            else {
                return;
            };
            // EVALSHA sha 1 slice want start len host rid …
            let pull_id = (
                e.generation,
                key.clone(),
                e.args.get(7).cloned().unwrap_or_default(),
                e.args.get(8).cloned().unwrap_or_default(),
            );
            if replayed == 1 {
                // A resend's answer must be a grant this pull really got.
                if granted > 0 && self.pulls.get(&pull_id) != Some(&granted) {
                    self.violations.push(format!(
                        "a resend of pull {} of {} was answered {granted} permits the pull never got ({:?}; generation {}, at {} µs)",
                        String::from_utf8_lossy(&pull_id.3),
                        String::from_utf8_lossy(&key),
                        self.pulls.get(&pull_id),
                        e.generation,
                        e.now_us
                    ));
                }
                return;
            }
            if granted <= 0 {
                return;
            }
            self.pulls.insert(pull_id, granted);
            self.granted += granted as u64;
            self.last_grant_ms.insert(key.clone(), now_ms);
            // The cap as the slice stores it (not as the script answered it).
            let stored_cap = field(e.keyspace, &key, "cap", now_ms)
                .and_then(|c| c.parse::<u64>().ok())
                .unwrap_or(0);
            let _ = cap;
            let l = self.ledger.entry((e.generation, key.clone())).or_default();
            l.0 += granted as u64;
            l.1 = l.1.max(stored_cap);
            if l.0 > l.1 {
                self.violations.push(format!(
                    "grants over the cap: slice {} granted {} of cap {} (generation {}, at {} µs)",
                    String::from_utf8_lossy(&key),
                    l.0,
                    l.1,
                    e.generation,
                    e.now_us
                ));
            }
            let a = self.across.entry(key).or_default();
            a.0 += granted as u64;
            a.1 = a.1.max(stored_cap);
        } else if sha == self.kpull_sha {
            self.observe_kpull(e, key);
        } else if sha == self.lease_sha {
            self.observe_lease(e, now_ms);
        } else if sha == self.mirror_set_sha || sha == self.mirror_del_sha {
            self.observe_mirror(e, now_ms);
        } else if sha == self.lock_renew_sha {
            self.observe_lock(e, now_ms, LockOp::Renew);
        } else if sha == self.lock_release_sha {
            self.observe_lock(e, now_ms, LockOp::Release);
        } else if self.roll_shas.contains(&sha) {
            let term = field(e.keyspace, &key, "term", now_ms).and_then(|t| t.parse::<i64>().ok());
            let epoch = field(e.keyspace, &key, "epoch", now_ms).unwrap_or_default();
            let fenced = field(e.keyspace, &key, "fenced_ms", now_ms)
                .and_then(|t| t.parse::<i64>().ok())
                .unwrap_or(0);
            // The fence stored before this command, if it still holds: same generation, fresh,
            // and its meta not expired since (a retired tombstone lives horizon + retention).
            let prior = self
                .fences
                .get(&key)
                .filter(|(g, _, _, f, x)| {
                    *g == e.generation
                        && now_ms - f < self.stale_after_ms as i64
                        && x.is_none_or(|x| now_ms < x)
                })
                .cloned();
            let expires = e
                .keyspace
                .get(&key, now_ms)
                .and_then(|entry| entry.expire_at_ms);
            // A write accepted (status 1) from a fence the stored one should have refused: a
            // fresh newer term of the same epoch, or a fresh fence of another epoch.
            if int_at(e.reply, 0) == Some(1)
                && let Some((_, ep, t, f, _)) = &prior
            {
                let numkeys = std::str::from_utf8(&e.args[2])
                    .ok()
                    .and_then(|n| n.parse::<usize>().ok())
                    .unwrap_or(0);
                let arg = |i: usize| {
                    e.args
                        .get(3 + numkeys + i)
                        .map(|a| String::from_utf8_lossy(a).into_owned())
                };
                let (w_term, w_epoch) = (arg(0).and_then(|t| t.parse::<i64>().ok()), arg(1));
                if let (Some(wt), Some(we)) = (w_term, w_epoch)
                    && (we != *ep || wt < *t)
                {
                    self.violations.push(format!(
                        "fencing: a write of term {wt} epoch {we} to {} was accepted over the fresh fence of term {t} epoch {ep} ({} ms old; generation {}, at {} µs)",
                        String::from_utf8_lossy(&key),
                        now_ms - f,
                        e.generation,
                        e.now_us
                    ));
                }
            }
            let Some(term) = term else { return };
            if let Some((_, ep, t, f, _)) = &prior
                && *ep == epoch
                && term < *t
            {
                self.violations.push(format!(
                    "fencing: {} went from term {t} to {term} while term {t}'s fence was {} ms old (generation {}, at {} µs)",
                    String::from_utf8_lossy(&key),
                    now_ms - f,
                    e.generation,
                    e.now_us
                ));
            }
            self.fences
                .insert(key, (e.generation, epoch, term, fenced, expires));
        } else if sha == self.lock_sha {
            self.observe_lock(e, now_ms, LockOp::Acquire);
            if int_at(e.reply, 0) != Some(1) {
                return;
            }
            let Some(token) = int_at(e.reply, 1) else {
                return;
            };
            // EVALSHA sha 2 lock token_counter owner ttl
            let owner = e.args.get(5).cloned().unwrap_or_default();
            let prev = self
                .tokens
                .entry(key.clone())
                .or_insert((i64::MIN, Vec::new()));
            if token == prev.0 && owner == prev.1 {
                return;
            }
            self.tokens_issued += 1;
            if token <= prev.0 {
                self.violations.push(format!(
                    "fencing token {token} of {} (owner {}) is not above {} handed out before to {} (generation {}, at {} µs)",
                    String::from_utf8_lossy(&key),
                    String::from_utf8_lossy(&owner),
                    prev.0,
                    String::from_utf8_lossy(&prev.1),
                    e.generation,
                    e.now_us
                ));
            }
            if token > prev.0 {
                *prev = (token, owner);
            }
        }
    }
}

impl Checker {
    /// KPULL: per key of a slice, the grants never exceed the key's cap (within a generation),
    /// the cap read from the task's slice as stored (the world sets no per-key override), not
    /// from the script's answer. A key twice in one call shares its quota: every occurrence's
    /// grant counts. A resend's answer must be the first call's grants.
    fn observe_kpull(&mut self, e: &Event<'_>, key: Vec<u8>) {
        let Reply::Array(items) = e.reply else { return };
        if int_at(e.reply, 0) != Some(1) {
            return;
        }
        // EVALSHA sha 2 kslices slice start len record rid ver aon meta (want digest)*
        let now_ms = e.now_us.div_euclid(1000);
        // A key's quota of a slice is fixed when the slice's key hash is made (a cap changed
        // mid-slice applies from the next slice: docs/protocol.md, KPULL): the hash's `cap`
        // as stored, or the task slice's own cap, whichever is larger.
        let slice = e.args.get(4).cloned().unwrap_or_default();
        let stored = |k: &[u8]| {
            field(e.keyspace, k, "cap", now_ms)
                .and_then(|c| c.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let slice_cap = stored(&slice).max(stored(&key));
        let pairs = e.args.get(12..).unwrap_or_default();
        let grants: Vec<i64> = items
            .get(4..)
            .unwrap_or_default()
            .iter()
            .map(|r| match r {
                Reply::Int(n) => *n,
                _ => 0,
            })
            .collect();
        let call = (
            e.generation,
            key.clone(),
            e.args.get(7).cloned().unwrap_or_default(),
            e.args.get(8).cloned().unwrap_or_default(),
        );
        let replayed = grants.get(3) == Some(&1);
        let given: Vec<i64> = grants.chunks(4).map(|c| c[0]).collect();
        if replayed {
            if self.key_calls.get(&call) != Some(&given) {
                self.violations.push(format!(
                    "a resend of key pull {} of {} was answered {given:?}, the call got {:?} (generation {}, at {} µs)",
                    String::from_utf8_lossy(&call.3),
                    String::from_utf8_lossy(&key),
                    self.key_calls.get(&call),
                    e.generation,
                    e.now_us
                ));
            }
            return;
        }
        if given.iter().any(|g| *g > 0) {
            self.key_calls.insert(call, given.clone());
        }
        for (k, pair) in pairs.chunks(2).enumerate() {
            let Some(digest) = pair.get(1) else { break };
            let granted = given.get(k).copied().unwrap_or(0);
            if granted <= 0 {
                continue;
            }
            self.key_granted += granted as u64;
            self.last_grant_ms.insert(key.clone(), now_ms);
            let l = self
                .key_ledger
                .entry((e.generation, key.clone(), digest.clone()))
                .or_default();
            l.0 += granted as u64;
            l.1 = l.1.max(slice_cap);
            if l.0 > l.1 {
                self.violations.push(format!(
                    "key grants over the key's cap: {} key {} granted {} of cap {} (generation {}, at {} µs)",
                    String::from_utf8_lossy(&key),
                    String::from_utf8_lossy(digest),
                    l.0,
                    l.1,
                    e.generation,
                    e.now_us
                ));
            }
        }
    }

    /// LEASE: a host's holding grows only while the holdings alive — each from the call that
    /// set it until `lease_ms` later, as the checker itself counts it, not as the script stored
    /// it — add up to at most the task's threshold (read from the meta).
    fn observe_lease(&mut self, e: &Event<'_>, now_ms: i64) {
        // EVALSHA sha 2 meta lease host want seq
        let (Some(meta_key), Some(lease_key), Some(host)) =
            (e.args.get(3), e.args.get(4), e.args.get(5))
        else {
            return;
        };
        if int_at(e.reply, 0) != Some(1) {
            return;
        }
        let cap = field(e.keyspace, meta_key, "threshold", now_ms)
            .and_then(|t| t.parse::<i64>().ok())
            .unwrap_or(0);
        let lease_ms = field(e.keyspace, meta_key, "lease_ms", now_ms)
            .and_then(|t| t.parse::<i64>().ok())
            .filter(|t| *t > 0)
            .unwrap_or(10_000);
        let held = int_at(e.reply, 1).unwrap_or(0);
        let slot = (e.generation, lease_key.clone());
        let hosts = self.leases.entry(slot).or_default();
        let before = hosts
            .get(host)
            .filter(|(_, until)| *until > now_ms)
            .map_or(0, |(p, _)| *p);
        hosts.insert(host.clone(), (held, now_ms + lease_ms));
        if held > 0 {
            self.last_grant_ms.insert(lease_key.clone(), now_ms);
        }
        if held > before {
            let live: i64 = hosts
                .values()
                .filter(|(_, until)| *until > now_ms)
                .map(|(p, _)| *p)
                .sum();
            if live > cap {
                self.violations.push(format!(
                    "permits in flight over the threshold: {} holds {live} of {cap} after {} grew {before} → {held} (generation {}, at {} µs)",
                    String::from_utf8_lossy(lease_key),
                    String::from_utf8_lossy(host),
                    e.generation,
                    e.now_us
                ));
            }
        }
    }

    /// Locks: at most one holder at a time — a holder holds from its acquisition until its TTL
    /// (renewals extend it) or its release, as the checker counts it.
    fn observe_lock(&mut self, e: &Event<'_>, now_ms: i64, op: LockOp) {
        let key = e.args.get(3).cloned().unwrap_or_default();
        let holder = self.holders.get(&(e.generation, key.clone())).cloned();
        match op {
            LockOp::Acquire => {
                // EVALSHA sha 2 lock counter owner ttl
                if int_at(e.reply, 0) != Some(1) {
                    return;
                }
                let owner = e.args.get(5).cloned().unwrap_or_default();
                let ttl = e
                    .args
                    .get(6)
                    .and_then(|t| std::str::from_utf8(t).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let token = int_at(e.reply, 1).unwrap_or(0);
                if let Some((o, t, until)) = &holder
                    && *o != owner
                    && *until >= now_ms
                {
                    self.violations.push(format!(
                        "lock {} acquired by {} (token {token}) while {} (token {t}) held it until {until} (generation {}, at {} µs)",
                        String::from_utf8_lossy(&key),
                        String::from_utf8_lossy(&owner),
                        String::from_utf8_lossy(o),
                        e.generation,
                        e.now_us
                    ));
                }
                self.holders
                    .insert((e.generation, key), (owner, token, now_ms + ttl));
            }
            LockOp::Renew | LockOp::Release => {
                // EVALSHA sha 1 lock token [ttl]
                if e.reply != &Reply::Int(1) {
                    return;
                }
                let token = e
                    .args
                    .get(4)
                    .and_then(|t| std::str::from_utf8(t).ok()?.parse::<i64>().ok())
                    .unwrap_or(-1);
                match &holder {
                    Some((o, t, until)) if *t == token && *until >= now_ms => {
                        let slot = (e.generation, key);
                        if op == LockOp::Release {
                            self.holders.remove(&slot);
                        } else {
                            let ttl = e
                                .args
                                .get(5)
                                .and_then(|t| std::str::from_utf8(t).ok()?.parse::<i64>().ok())
                                .unwrap_or(0);
                            self.holders.insert(slot, (o.clone(), *t, now_ms + ttl));
                        }
                    }
                    other => self.violations.push(format!(
                        "lock {} {:?} with token {token} succeeded; the holder was {:?} (generation {}, at {} µs)",
                        String::from_utf8_lossy(&key),
                        op,
                        other.as_ref().map(|(o, t, u)| (String::from_utf8_lossy(o).into_owned(), *t, *u)),
                        e.generation,
                        e.now_us
                    )),
                }
            }
        }
    }
}

/// A connection that comes back after the server broke it (a restart, a failover).
struct Link {
    redis: SimRedis,
    conn: SimConn,
    rng: Rng,
    faults_on: Arc<Mutex<bool>>,
    log: SharedLog,
    clock: Arc<TokioClock>,
    start_ms: i64,
}

impl Link {
    fn new(w: &Shared, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let conn = w.redis.conn().with_faults(w.faults(rng.next_u64()));
        Self {
            redis: w.redis.clone(),
            conn,
            rng,
            faults_on: w.faults_on.clone(),
            log: w.log.clone(),
            clock: w.clock.clone(),
            start_ms: w.start_ms,
        }
    }

    /// After an error: a new connection (the old one may be broken for good).
    fn reconnect(&mut self) {
        let seed = self.rng.next_u64();
        self.conn = self.redis.conn().with_faults(Faults {
            rng: Rng::new(seed),
            on: self.faults_on.clone(),
            log: self.log.clone(),
            clock: self.clock.clone(),
            start_ms: self.start_ms,
        });
    }
}

type SharedRef = Arc<Shared>;

/// What every actor's connections share.
struct Shared {
    redis: SimRedis,
    faults_on: Arc<Mutex<bool>>,
    log: SharedLog,
    clock: Arc<TokioClock>,
    start_ms: i64,
}

impl Shared {
    /// A connection's per-command faults, seeded by `seed`.
    fn faults(&self, seed: u64) -> Faults {
        Faults {
            rng: Rng::new(seed),
            on: self.faults_on.clone(),
            log: self.log.clone(),
            clock: self.clock.clone(),
            start_ms: self.start_ms,
        }
    }
}

/// The roll settings of every replica in the world (both clusters).
fn roll_config() -> sluice_manager::roller::RollConfig {
    sluice_manager::roller::RollConfig {
        horizon: Duration::from_millis(HORIZON_MS as u64),
        retention: Duration::from_millis(RETENTION_MS as u64),
        tick: Duration::from_millis(TICK_MS),
        fence_stale_after: Duration::from_millis(MANAGER_STALE_AFTER_MS),
    }
}

/// A task as the manager's store holds it: `json` parsed by the manager's own `parse_stored`.
fn task_entry(
    name: &str,
    json: &str,
    version: i64,
    created: i64,
) -> Arc<sluice_manager::tasks::TaskEntry> {
    let spec = sluice_manager::spec::parse_stored(name, json.as_bytes())
        .unwrap_or_else(|e| panic!("the world's spec of {name} is invalid: {e:?}"));
    let schedule = Arc::new(sluice_manager::schedule::CompiledSchedule::new(
        &spec.schedules,
    ));
    Arc::new(sluice_manager::tasks::TaskEntry {
        name: name.to_string(),
        spec,
        version,
        created,
        schedule,
    })
}

tokio::task_local! {
    /// A manager replica's clock offset from the world's (ms): `unix_ms()` in the manager's
    /// code adds it while that replica's task runs (skewed at start, jumped by faults, set
    /// right at the quiet tail, as NTP would).
    static SKEW: Arc<std::sync::atomic::AtomicI64>;
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// A manager replica: rolls every task's window ahead while it believes it leads.
async fn leader(
    id: usize,
    mut link: Link,
    clock: Arc<TokioClock>,
    skew_ms: i64,
    control: Arc<Mutex<Control>>,
    end_ms: i64,
    tasks: usize,
) {
    let keys = Keys::new(NS).expect("namespace");
    // What this replica believes: its term (None: not leading), per task rolled_to and
    // whether the next write must be full.
    let mut mine: Option<(i64, u64)> = None;
    let mut rolled: Vec<(i64, bool, i64, i64)> = vec![(0, true, 0, 0); tasks];
    // How long this replica goes on believing it leads after it lost the election (a paused
    // process, a slow lease expiry): its writes meanwhile meet the fence.
    let notice_ms = link.rng.range_i(0, 3000);
    let mut lost_since: Option<i64> = None;
    loop {
        let now = clock.now_us() / 1000 + skew_ms;
        if now >= end_ms {
            return;
        }
        let (term, epoch, holder, specs) = {
            let c = control.lock().unwrap_or_else(|e| e.into_inner());
            (c.term, c.epoch, c.holder, c.specs.clone())
        };
        // Learning of an election result is not instant: a deposed replica keeps writing with
        // its old term until it hears (the chaos actor delays `holder` changes for it).
        if holder == Some(id) && mine != Some((term, epoch)) {
            mine = Some((term, epoch));
            lost_since = None;
            for r in rolled.iter_mut() {
                *r = (0, true, 0, 0);
            }
        }
        if holder != Some(id) && mine.is_some() {
            let since = *lost_since.get_or_insert(now);
            if now - since >= notice_ms {
                mine = None;
            }
        }
        let Some((my_term, my_epoch)) = mine else {
            sleep_ms(TICK_MS).await;
            continue;
        };
        let fence = Fence {
            term: my_term,
            epoch: my_epoch,
            stale_after_ms: STALE_AFTER_MS,
        };
        for (i, (version, threshold)) in specs.iter().enumerate() {
            let task = task_name(i);
            let (rolled_to, full, written_version, claimed) = rolled[i];
            let now = clock.now_us() / 1000 + skew_ms;
            let cur = now - now.rem_euclid(SLICE_MS as i64);
            let target = cur + HORIZON_MS;
            let full = full || written_version != *version;
            let first = if full { cur } else { rolled_to.max(cur) };
            let slices: Vec<SliceWrite> = (0..)
                .map(|k| first + k * SLICE_MS as i64)
                .take_while(|s| *s < target)
                .map(|s| SliceWrite {
                    start_ms: s,
                    cap: *threshold,
                    expire_at_ms: s + SLICE_MS as i64 + RETENTION_MS,
                })
                .collect();
            let refresh = now - claimed >= STALE_AFTER_MS as i64 / 4;
            if slices.is_empty() && !refresh && !full {
                continue;
            }
            let new_rolled_to = slices
                .last()
                .map_or(rolled_to, |s| s.start_ms + SLICE_MS as i64);
            let m = meta(i, SLICE_MS, *version, *threshold);
            let req = RollRequest {
                task: &task,
                fence: &fence,
                full,
                expect_rolled_to: rolled_to,
                spec_version: *version,
                new_rolled_to,
                force: false,
                refresh,
                meta: full.then_some(&m),
                meta_extra: &[],
                slices: &slices,
                lazy: None,
            };
            match scripts::roll(&mut link.conn, &keys, &req).await {
                Ok(RollOutcome::Written(_)) => {
                    rolled[i] = (new_rolled_to, false, *version, now);
                }
                Ok(RollOutcome::NeedFull) => rolled[i].1 = true,
                Ok(RollOutcome::Refused(_)) => {
                    // A newer term holds the task: step down until elected again.
                    mine = None;
                    break;
                }
                Ok(_) => rolled[i].1 = true,
                Err(_) => {
                    rolled[i].1 = true;
                    link.reconnect();
                }
            }
        }
        sleep_ms(TICK_MS).await;
    }
}

/// etcd's current revision as the roller asks for it: above every spec version and term of
/// the world (one etcd history per epoch).
struct Revisions(Arc<Mutex<Control>>);

impl sluice_manager::roller::CurrentRevision for Revisions {
    async fn current_revision(&self) -> sluice_manager::error::Result<i64> {
        let c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(c.revision.max(c.term))
    }
}

fn spec_json(i: usize, threshold: u64) -> String {
    match kind(i) {
        Kind::Keyed => format!(r#"{{"threshold":{threshold},"slice_ms":{SLICE_MS},"keyed":true}}"#),
        Kind::Pooled => format!(r#"{{"threshold":{threshold},"slice_ms":{SLICE_MS}}}"#),
        Kind::Concurrency => {
            format!(r#"{{"threshold":{threshold},"mode":"concurrency","lease_ms":{LEASE_MS}}}"#)
        }
    }
}

/// The task snapshot a leader rolls: what etcd holds now.
fn snapshot(c: &Control) -> Arc<sluice_manager::tasks::TaskSnapshot> {
    use sluice_manager::tasks::TaskSnapshot;
    let mut tasks = BTreeMap::new();
    for (i, (version, threshold)) in c.specs.iter().enumerate() {
        if c.deleted[i] {
            continue;
        }
        let name = task_name(i);
        let entry = task_entry(&name, &spec_json(i, *threshold), *version, c.created[i]);
        tasks.insert(name, entry);
    }
    Arc::new(TaskSnapshot {
        tasks,
        invalid: BTreeMap::new(),
        revision: c.revision,
        loaded: true,
    })
}

/// A manager replica's connection: [`Faults`], and now and then a **crash** — the command
/// never answers (applied or not), the replica's task is told, and drops its tick or mirror
/// pass at that await point (the process died there).
struct CrashPlan {
    inner: Faults,
    rng: Rng,
    crash: Arc<tokio::sync::Notify>,
    /// Dead since a crash, until the replica restarts: every command (one issued beside the
    /// crashing one in the same poll, too) never answers, and no second crash is decided.
    dead: Arc<std::sync::atomic::AtomicBool>,
    /// No crash decided after this (world ms): the quiet tail starts with live replicas.
    until_ms: i64,
}

impl FaultPlan for CrashPlan {
    fn on_command(&mut self, args: &[Vec<u8>]) -> Fault {
        if self.dead.load(std::sync::atomic::Ordering::Relaxed) {
            return Fault::Hang;
        }
        let f = self.inner.on_command(args);
        if f != Fault::Deliver || !*self.inner.on.lock().unwrap_or_else(|e| e.into_inner()) {
            return f;
        }
        if self.rng.below(1000) >= 2 || self.inner.clock.now_us() / 1000 >= self.until_ms {
            return Fault::Deliver;
        }
        let applied = self.rng.chance(0.5);
        let at_ms = self.inner.clock.now_us() / 1000 - self.inner.start_ms;
        let cmd = String::from_utf8_lossy(args.first().map(Vec::as_slice).unwrap_or_default())
            .into_owned();
        let admitted = self
            .inner
            .log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(at_ms, "crash", || {
                format!(
                    "a manager replica crashed at `{cmd}` ({} the server ran it)",
                    if applied { "after" } else { "before" }
                )
            });
        if !admitted {
            return Fault::Deliver;
        }
        self.dead.store(true, std::sync::atomic::Ordering::Relaxed);
        self.crash.notify_one();
        if applied {
            Fault::HangAfterApply
        } else {
            Fault::Hang
        }
    }
}

/// A manager replica running the manager's own roller (`Roller::tick`, unchanged) over a
/// simulated connection: a new `Roller` per leadership, as the manager makes one; a tick every
/// 500 ms; stepping down when fenced. Its clock is the world's (`unix_ms` reads it on this
/// thread) plus its own offset (the task-local `SKEW`).
async fn manager_leader(
    id: usize,
    leaders: usize,
    w: SharedRef,
    control: Arc<Mutex<Control>>,
    end_ms: i64,
    quiet_from: i64,
    seed: u64,
) {
    use sluice_manager::roller::Roller;
    let keys = Keys::new(NS).expect("namespace");
    let metrics = Arc::new(sluice_manager::metrics::Metrics::new());
    let (alerts, _alert_rx) = sluice_manager::alerts::channel(metrics.clone());
    let mut rng = Rng::new(seed);
    let crash = Arc::new(tokio::sync::Notify::new());
    let dead = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let conn = w.redis.conn().reconnecting().with_faults(CrashPlan {
        inner: w.faults(rng.next_u64()),
        rng: Rng::new(rng.next_u64()),
        crash: crash.clone(),
        dead: dead.clone(),
        until_ms: quiet_from - 5_000,
    });
    let redis = Arc::new(sluice_protocol::conn::Redis::shared(conn));
    let cfg = roll_config();
    let notice_ms = rng.range_i(0, 3000);
    let mut lost_since: Option<i64> = None;
    let mut leading: Option<(Roller, sluice_manager::election::LeaderContext, i64, u64)> = None;
    let revisions = Revisions(control.clone());
    loop {
        let now = w.clock.now_us() / 1000;
        if now >= end_ms {
            return;
        }
        let (term, epoch, holder, snap) = {
            let c = control.lock().unwrap_or_else(|e| e.into_inner());
            (c.term, c.epoch, c.holder, snapshot(&c))
        };
        if holder == Some(id) && leading.as_ref().map(|l| (l.2, l.3)) != Some((term, epoch)) {
            let (ctx, _) = sluice_manager::election::LeaderContext::for_test(
                term,
                epoch,
                Duration::from_secs(86_400),
            );
            let roller = Roller::new(
                keys.clone(),
                redis.clone(),
                cfg,
                metrics.clone(),
                alerts.clone(),
            );
            leading = Some((roller, ctx, term, epoch));
            lost_since = None;
        }
        if holder != Some(id) && leading.is_some() {
            let since = *lost_since.get_or_insert(now);
            if now - since >= notice_ms {
                leading = None;
            }
        }
        let mut crashed = false;
        let mut fenced = false;
        let dynamic = std::collections::HashMap::new();
        if let Some((roller, ctx, _, _)) = &mut leading {
            // Fenced: a newer leader of this history holds a task — step down (the manager's
            // `Roller::run` does the same). Other errors end the tick; the next one retries.
            // `biased`: tokio picks among ready branches at random otherwise (a replay must
            // not depend on it).
            tokio::select! {
                biased;
                _ = crash.notified() => crashed = true,
                r = roller.tick(ctx, &revisions, &snap, &dynamic) => {
                    fenced = matches!(r, Err(sluice_manager::error::Error::Fenced { .. }));
                }
            }
        }
        if fenced {
            leading = None;
        }
        // The Envoy mirror (the manager runs it beside the roller, at the same period): a
        // deposed replica that has not noticed yet keeps passing, and meets the fence.
        if !crashed && let Some((_, ctx, _, _)) = &leading {
            let (docs, revision) = a_docs(&control.lock().unwrap_or_else(|e| e.into_inner()));
            tokio::select! {
                biased;
                _ = crash.notified() => crashed = true,
                _ = sluice_manager::envoy_import::mirror_docs(ctx, &docs, revision, &keys, &redis) => {}
            }
        }
        if crashed {
            // The process died mid-call: its memory is gone; it comes back after a restart,
            // and its leadership (its lease expired meanwhile) goes to whoever wins next.
            leading = None;
            // It leads no more from now (its lease lapses); a new term once it is back, unless
            // an election of the world's came first.
            let term = {
                let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
                if c.holder == Some(id) {
                    c.holder = None;
                }
                c.term
            };
            sleep_ms(rng.range_i(500, 5000) as u64).await;
            dead.store(false, std::sync::atomic::Ordering::Relaxed);
            let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
            if c.holder.is_none() && c.term == term {
                c.term += 1;
                c.holder = Some(rng.below(leaders as u64) as usize);
                c.holder_since = w.clock.now_us() / 1000;
            }
            continue;
        }
        sleep_ms(TICK_MS).await;
    }
}

/// The second manager cluster's replica: while it leads (its own etcd, epoch [`B_EPOCH`]; a new
/// term now and then, sometimes after a gap in which its fences go stale), every tick it rolls
/// its own task [`B_TASK`] with the manager's `Roller` (this cluster's registry walk must leave
/// it alone: another epoch's task) and mirrors [`B_DOMAINS`] into `NS:envoy`.
async fn second_cluster(w: SharedRef, second: Arc<Mutex<Second>>, end_ms: i64, seed: u64) {
    let keys = Keys::new(NS).expect("namespace");
    let mut rng = Rng::new(seed);
    let conn = w
        .redis
        .conn()
        .reconnecting()
        .with_faults(w.faults(rng.next_u64()));
    let redis = Arc::new(sluice_protocol::conn::Redis::shared(conn));
    let metrics = Arc::new(sluice_manager::metrics::Metrics::new());
    let (alerts, _alert_rx) = sluice_manager::alerts::channel(metrics.clone());
    let cfg = roll_config();
    let revisions = SecondRevisions(second.clone());
    let mut leading: Option<(
        i64,
        sluice_manager::election::LeaderContext,
        sluice_manager::roller::Roller,
    )> = None;
    loop {
        if w.clock.now_us() / 1000 >= end_ms {
            return;
        }
        let (term, on, docs, revision, snap) = {
            let b = second.lock().unwrap_or_else(|e| e.into_inner());
            let docs: Vec<_> = B_DOMAINS
                .iter()
                .zip(&b.versions)
                .map(|(name, v)| domain_doc(name, *v))
                .collect();
            (b.term, b.leading, docs, b.revision, second_snapshot(&b))
        };
        if !on {
            leading = None;
        } else if leading.as_ref().map(|l| l.0) != Some(term) {
            let (ctx, _) = sluice_manager::election::LeaderContext::for_test(
                term,
                B_EPOCH,
                Duration::from_secs(86_400),
            );
            let roller = sluice_manager::roller::Roller::new(
                keys.clone(),
                redis.clone(),
                cfg,
                metrics.clone(),
                alerts.clone(),
            );
            leading = Some((term, ctx, roller));
        }
        if let Some((_, ctx, roller)) = &mut leading
            && let Err(sluice_manager::error::Error::Fenced { .. }) = roller
                .tick(ctx, &revisions, &snap, &std::collections::HashMap::new())
                .await
        {
            leading = None;
        }
        if let Some((_, ctx, _)) = &leading {
            let _ = sluice_manager::envoy_import::mirror_docs(ctx, &docs, revision, &keys, &redis)
                .await;
        }
        sleep_ms(TICK_MS).await;
    }
}

/// A worker host: asks for permits of the current slice of a random task — PULL for a pooled
/// task, KPULL for a few keys of a keyed one, LEASE (absolute holdings, a sequence number) for
/// a concurrency task — and resends a call whose reply was lost with the same request id (or
/// sequence number), as the SDK does.
#[allow(clippy::too_many_arguments)]
async fn worker(
    host: usize,
    mut link: Link,
    clock: Arc<TokioClock>,
    skew_ms: i64,
    control: Arc<Mutex<Control>>,
    end_ms: i64,
    tasks: usize,
) {
    let keys = Keys::new(NS).expect("namespace");
    let host_id = format!("h{host}");
    let mut seq = 0u64;
    loop {
        let now = clock.now_us() / 1000 + skew_ms;
        if now >= end_ms {
            return;
        }
        let i = link.rng.below(tasks as u64) as usize;
        let task = task_name(i);
        let start = now - now.rem_euclid(SLICE_MS as i64);
        seq += 1;
        let rid = format!("{seq}");
        let want = link.rng.range_i(1, 4) as u64;
        let version = control.lock().unwrap_or_else(|e| e.into_inner()).specs[i].0;
        let digests: Vec<String> = (0..link.rng.range_i(1, 3))
            .map(|_| format!("d{}", link.rng.below(8)))
            .collect();
        let wants: Vec<KeyWant<'_>> = digests
            .iter()
            .map(|d| KeyWant { digest: d, want })
            .collect();
        let all_or_nothing = link.rng.chance(0.2);
        for _attempt in 0..3 {
            let r = match kind(i) {
                Kind::Pooled => {
                    let req = PullRequest {
                        task: &task,
                        start_ms: start,
                        slice_ms: SLICE_MS,
                        want,
                        host_id: &host_id,
                        request_id: &rid,
                        counters: None,
                    };
                    scripts::pull(&mut link.conn, &keys, &req).await.map(drop)
                }
                Kind::Keyed => {
                    let req = KeyPullBatch {
                        task: &task,
                        start_ms: start,
                        slice_ms: SLICE_MS,
                        host_id: &host_id,
                        request_id: &rid,
                        meta_version: version,
                        all_or_nothing,
                        keys: &wants,
                    };
                    scripts::key_pull_batch(&mut link.conn, &keys, &req)
                        .await
                        .map(drop)
                }
                Kind::Concurrency => {
                    lease::lease(&mut link.conn, &keys, &task, &host_id, want, seq)
                        .await
                        .map(drop)
                }
            };
            match r {
                Ok(()) => break,
                Err(_) => {
                    link.reconnect();
                    sleep_ms(20).await;
                }
            }
        }
        let pause = link.rng.range_i(5, 60) as u64;
        sleep_ms(pause).await;
    }
}

/// A lock holder: acquires (an owner name unique per attempt, resent after an error, as the
/// SDK does), holds (renewing now and then), releases.
async fn locker(host: usize, mut link: Link, clock: Arc<TokioClock>, end_ms: i64) {
    let keys = Keys::new(NS).expect("namespace");
    let mut attempt = 0u64;
    let mut resend: Option<String> = None;
    loop {
        if clock.now_us() / 1000 >= end_ms {
            return;
        }
        let owner = resend.take().unwrap_or_else(|| {
            attempt += 1;
            format!("h{host}:{attempt}")
        });
        let ttl = link.rng.range_i(200, 1500) as u64;
        match lease::lock_acquire(&mut link.conn, &keys, "lk", &owner, ttl).await {
            Ok(lease::LockReply::Acquired { token }) => {
                let hold = link.rng.range_i(10, ttl as i64 * 2) as u64;
                // Not past the run's end (the liveness checks read the last seconds).
                let left = (end_ms - clock.now_us() / 1000).max(0) as u64;
                let hold = hold.min(left);
                sleep_ms(hold / 2).await;
                if link.rng.chance(0.5) {
                    let _ = lease::lock_renew(&mut link.conn, &keys, "lk", token, ttl).await;
                }
                sleep_ms(hold / 2).await;
                let _ = lease::lock_release(&mut link.conn, &keys, "lk", token).await;
            }
            Ok(lease::LockReply::Busy { .. }) => {}
            Err(_) => {
                link.reconnect();
                resend = Some(owner);
            }
        }
        let pause = link.rng.range_i(5, 300) as u64;
        sleep_ms(pause).await;
    }
}

/// The world's schedule: elections, spec changes and server faults, until 70 % of the run.
#[allow(clippy::too_many_arguments)]
async fn chaos(
    mut rng: Rng,
    redis: SimRedis,
    control: Arc<Mutex<Control>>,
    second: Arc<Mutex<Second>>,
    skews: Vec<Arc<std::sync::atomic::AtomicI64>>,
    faults_on: Arc<Mutex<bool>>,
    log: SharedLog,
    clock: Arc<TokioClock>,
    cfg: Config,
    start_ms: i64,
) {
    let quiet_from = start_ms + cfg.duration_ms as i64 * 7 / 10;
    let mut snapshots: Vec<(i64, crate::redis::Snapshot)> = Vec::new();
    // Workload events are counted; faults go through the log (numbered, maybe masked).
    let count = |name: &'static str| {
        *log.lock()
            .unwrap_or_else(|e| e.into_inner())
            .counts
            .entry(name)
            .or_default() += 1;
    };
    let admit = |name: &'static str, detail: String| {
        let at = clock.now_us() / 1000 - start_ms;
        log.lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(at, name, || detail)
    };
    loop {
        let now = clock.now_us() / 1000;
        if now >= quiet_from {
            *faults_on.lock().unwrap_or_else(|e| e.into_inner()) = false;
            // The last election is settled: the first replica leads a fresh term.
            let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
            if c.holder.is_none() {
                c.term += 1;
                c.holder = Some(0);
                c.holder_since = now;
            }
            let mut b = second.lock().unwrap_or_else(|e| e.into_inner());
            if !b.leading {
                b.term += 1;
                b.leading = true;
            }
            // Clocks set right (NTP) for the quiet tail.
            for s in &skews {
                s.store(0, std::sync::atomic::Ordering::Relaxed);
            }
            return;
        }
        // A snapshot every step: what a lagging replica or an old dump holds.
        // (Expired keys dropped first, as Redis's active expiry does: a long run's memory stays
        // flat and a snapshot copies only live keys.)
        redis.purge_expired();
        snapshots.push((now, redis.snapshot()));
        if snapshots.len() > 20 {
            snapshots.remove(0);
        }
        let wait = rng.range_i(200, 4000) as u64;
        sleep_ms(wait).await;
        let now = clock.now_us() / 1000;
        match rng.below(100) {
            // Elections: leadership moves (a new term), sometimes through a gap.
            0..=11 => {
                count("election");
                let gap = rng.chance(0.4).then(|| rng.range_i(100, 6000) as u64);
                let next = rng.below(cfg.leaders as u64) as usize;
                {
                    let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
                    c.holder = None;
                }
                if let Some(g) = gap {
                    // A gap ends by the quiet tail (whose liveness checks need a leader).
                    let left = (quiet_from - clock.now_us() / 1000).max(0) as u64;
                    let g = g.min(left);
                    // etcd still takes writes while no leader runs: a spec written, a task
                    // deleted (a new leadership must find what it owes).
                    if rng.chance(0.7) {
                        sleep_ms(g / 2).await;
                        count("spec change in a gap");
                        spec_step(&mut rng, &control, &cfg, &clock, 0.6);
                        sleep_ms(g - g / 2).await;
                    } else {
                        sleep_ms(g).await;
                    }
                }
                let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
                c.term += 1;
                c.holder = Some(next);
                c.holder_since = clock.now_us() / 1000;
                if cfg.verbose {
                    eprintln!(
                        "{} world: election: term {} epoch {} replica {next}",
                        clock.now_us(),
                        c.term,
                        c.epoch
                    );
                }
            }
            // Another etcd cluster (a rebuilt one): a new epoch, terms start low again.
            12 | 48 if cfg.faults => {
                let term = rng.range_i(1, 3);
                let holder = rng.below(cfg.leaders as u64) as usize;
                if admit(
                    "new epoch",
                    format!("new epoch (term {term}, replica {holder})"),
                ) {
                    let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
                    c.epoch += 1;
                    c.term = term;
                    c.holder = Some(holder);
                    c.holder_since = now;
                    c.disrupted_until = c.disrupted_until.max(now);
                }
            }
            // A spec change: a new version with another threshold.
            13..=22 => {
                count("spec change");
                spec_step(&mut rng, &control, &cfg, &clock, 0.25);
            }
            // Envoy: a domain imported again (a new version), deleted, or imported after its
            // deletion (with the manager's roller: the mirror is its code).
            38..=43 if cfg.manager_roller => {
                count("envoy import");
                let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
                let i = rng.below(A_DOMAINS.len() as u64) as usize;
                c.revision += 1;
                let rev = c.revision;
                c.domains[i] = match c.domains[i] {
                    Some(_) if rng.chance(0.3) => None,
                    _ => Some(rev),
                };
                if cfg.verbose {
                    eprintln!(
                        "{} world: envoy domain {} {}",
                        clock.now_us(),
                        A_DOMAINS[i],
                        c.domains[i].map_or("deleted".to_string(), |v| format!("at version {v}"))
                    );
                }
            }
            // The second cluster: a re-import, or a new term (sometimes after a gap longer
            // than its fences stay fresh).
            44..=47 if cfg.manager_roller => {
                count("second cluster");
                if rng.chance(0.5) {
                    let mut b = second.lock().unwrap_or_else(|e| e.into_inner());
                    let i = rng.below(B_DOMAINS.len() as u64) as usize;
                    b.revision += 1;
                    b.versions[i] = b.revision;
                    if rng.chance(0.5) {
                        b.task = (b.revision, rng.range_i(5, 60) as u64);
                    }
                } else {
                    let gap = rng.chance(0.5).then(|| rng.range_i(100, 15_000) as u64);
                    second.lock().unwrap_or_else(|e| e.into_inner()).leading = false;
                    if let Some(g) = gap {
                        let left = (quiet_from - clock.now_us() / 1000).max(0) as u64;
                        sleep_ms(g.min(left)).await;
                    }
                    let mut b = second.lock().unwrap_or_else(|e| e.into_inner());
                    b.term += 1;
                    b.leading = true;
                }
            }
            // A manager replica's clock jumps (forward or back), up to a second.
            49..=50 if cfg.faults && !skews.is_empty() => {
                let i = rng.below(skews.len() as u64) as usize;
                let to = rng.range_i(-1000, 1000);
                if admit(
                    "clock jump",
                    format!("replica {i}'s clock jumps to {to:+} ms off"),
                ) {
                    skews[i].store(to, std::sync::atomic::Ordering::Relaxed);
                }
            }
            // (A fault's arm asks the log whether it may apply; when not, the `_` arm does
            // nothing, and nothing else differs.)
            23..=25 if cfg.faults && admit("restart empty", "restart empty".into()) => {
                redis.restart(None);
                disrupted(&control, now);
            }
            26..=28 if cfg.faults => {
                let i = rng.below(snapshots.len() as u64) as usize;
                let age = now - snapshots[i].0;
                if admit(
                    "restart from an older dump",
                    format!("restart from a dump {age} ms old"),
                ) {
                    redis.restart(Some(&snapshots[i].1));
                    disrupted(&control, now);
                }
            }
            29..=31 if cfg.faults => {
                let i = snapshots.len().saturating_sub(1 + rng.below(3) as usize);
                let age = now - snapshots[i].0;
                if admit(
                    "failover to a lagging replica",
                    format!("failover to a replica {age} ms behind"),
                ) {
                    redis.failover(&snapshots[i].1);
                    disrupted(&control, now);
                }
            }
            32..=35 if cfg.faults => {
                let ms = rng.range_i(50, 3000);
                if admit("DEBUG SLEEP", format!("DEBUG SLEEP {ms} ms")) {
                    redis.sleep_for(ms * 1000);
                    disrupted(&control, now + ms);
                }
            }
            36..=37 if cfg.faults => {
                let ms = rng.range_i(100, 3000) as u64;
                if admit("stopped", format!("stopped for {ms} ms")) {
                    redis.stop();
                    sleep_ms(ms).await;
                    redis.start();
                    disrupted(&control, now + ms as i64);
                }
            }
            _ => {}
        }
    }
}

/// A whole-server fault lasts until `until` (world ms).
fn disrupted(control: &Mutex<Control>, until: i64) {
    let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
    c.disrupted_until = c.disrupted_until.max(until);
}

/// Retire in time (with the manager's roller): every second, a task deleted in etcd must be
/// retired — its meta a tombstone or gone, or another epoch's (not this cluster's to judge) —
/// once [`RETIRE_BOUND_MS`] have passed since the later of its deletion, the current
/// leadership's start and the last whole-server fault. The roller's own retire list covers a
/// deletion it saw; a new leadership's registry walk one made while no leader ran (a restart's
/// walk would otherwise hide a missing one until the end of the run).
async fn retire_watch(
    redis: SimRedis,
    control: Arc<Mutex<Control>>,
    checker: Arc<Mutex<Checker>>,
    clock: Arc<TokioClock>,
    end_ms: i64,
) {
    let keys = Keys::new(NS).expect("namespace");
    let mut reported = std::collections::BTreeSet::new();
    loop {
        sleep_ms(1000).await;
        let now = clock.now_us() / 1000;
        if now >= end_ms {
            return;
        }
        // The second cluster's task is never deleted: nobody may retire it (this cluster's
        // registry walk leaves another epoch's task alone, even while its leader is away).
        let b_meta = keys.meta(B_TASK);
        if !reported.contains(&(usize::MAX, 0))
            && redis
                .read(|ks, now_ms| field(ks, b_meta.as_bytes(), "retired", now_ms))
                .is_some()
        {
            reported.insert((usize::MAX, 0));
            checker
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .violations
                .push(format!(
                    "retire: the second cluster's task {B_TASK} was retired at {now} ms (it is never deleted)"
                ));
        }
        let c = control.lock().unwrap_or_else(|e| e.into_inner());
        if c.holder.is_none() {
            continue;
        }
        for i in 0..c.specs.len() {
            let from = c.deleted_at[i].max(c.holder_since).max(c.disrupted_until);
            if !c.deleted[i]
                || now - from < RETIRE_BOUND_MS
                || reported.contains(&(i, c.deleted_at[i]))
            {
                continue;
            }
            let meta = keys.meta(&task_name(i));
            let (live, epoch) = redis.read(|ks, now_ms| {
                (
                    ks.get(meta.as_bytes(), now_ms).is_some()
                        && field(ks, meta.as_bytes(), "retired", now_ms).is_none(),
                    field(ks, meta.as_bytes(), "epoch", now_ms),
                )
            });
            if live && epoch.is_none_or(|e| e == c.epoch.to_string()) {
                reported.insert((i, c.deleted_at[i]));
                checker
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .violations
                    .push(format!(
                        "retire: t{i}, deleted at {} ms, is still live {} ms later (term {} leading since {} ms, no server fault since {} ms)",
                        c.deleted_at[i],
                        now - c.deleted_at[i],
                        c.term,
                        c.holder_since,
                        c.disrupted_until
                    ));
            }
        }
    }
}

/// A spec step of the workload: a task's spec written anew (another threshold), or — with the
/// manager's roller — the task deleted, or created again after its deletion.
fn spec_step(
    rng: &mut Rng,
    control: &Mutex<Control>,
    cfg: &Config,
    clock: &TokioClock,
    p_delete: f64,
) {
    let mut c = control.lock().unwrap_or_else(|e| e.into_inner());
    let i = rng.below(c.specs.len() as u64) as usize;
    c.revision += 1;
    let rev = c.revision;
    // With the manager's roller: a task deleted now and then (a retire is owed,
    // also when no leader runs), and created again later (a new incarnation).
    if cfg.manager_roller && rng.chance(p_delete) {
        if c.deleted[i] {
            c.deleted[i] = false;
            c.created[i] = rev;
            c.specs[i].0 = rev;
        } else {
            c.deleted[i] = true;
            c.deleted_at[i] = clock.now_us() / 1000;
        }
    } else {
        // A spec written for a deleted name creates it again (a new incarnation).
        if c.deleted[i] {
            c.deleted[i] = false;
            c.created[i] = rev;
        }
        c.specs[i].0 = rev;
        c.specs[i].1 = rng.range_i(5, 60) as u64;
    }
    if cfg.verbose {
        eprintln!(
            "{} world: t{i} {} at revision {rev} (term {}, epoch {}, holder {:?})",
            clock.now_us(),
            if c.deleted[i] { "deleted" } else { "spec" },
            c.term,
            c.epoch,
            c.holder
        );
    }
}

/// Runs one seeded world to its end and checks it.
pub fn run(cfg: &Config) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a tokio runtime");
    rt.block_on(run_in(cfg.clone()))
}

async fn run_in(cfg: Config) -> Outcome {
    // A fixed start (2026-01-01): the same seed gives the same times.
    let start_us = 1_767_225_600_000_000i64;
    let clock = TokioClock::new(start_us);
    let redis = SimRedis::new("redis", clock.clone() as Arc<dyn Clock>);
    let mut rng = Rng::new(cfg.seed);
    let checker = Arc::new(Mutex::new(Checker {
        pull_sha: sha1_hex(scripts::PULL_LUA),
        kpull_sha: sha1_hex(scripts::KPULL_LUA),
        lease_sha: sha1_hex(lease::LEASE_LUA),
        key_ledger: BTreeMap::new(),
        leases: BTreeMap::new(),
        key_granted: 0,
        roll_shas: [
            scripts::ROLL_LUA,
            scripts::RETIRE_LUA,
            scripts::ADJUST_LUA,
            scripts::RECORD_HISTORY_LUA,
        ]
        .iter()
        .map(|t| sha1_hex(t))
        .collect(),
        lock_sha: sha1_hex(lease::LOCK_ACQUIRE_LUA),
        hash: 0xcbf2_9ce4_8422_2325,
        commands: 0,
        stale_after_ms: if cfg.manager_roller {
            MANAGER_STALE_AFTER_MS
        } else {
            STALE_AFTER_MS
        },
        pulls: BTreeMap::new(),
        key_calls: BTreeMap::new(),
        holders: BTreeMap::new(),
        lock_renew_sha: sha1_hex(lease::LOCK_RENEW_LUA),
        lock_release_sha: sha1_hex(lease::LOCK_RELEASE_LUA),
        ledger: BTreeMap::new(),
        across: BTreeMap::new(),
        overgrant_pruned: 0,
        fences: BTreeMap::new(),
        mirror_set_sha: sha1_hex(sluice_manager::envoy_import::MIRROR_SET_LUA),
        mirror_del_sha: sha1_hex(sluice_manager::envoy_import::MIRROR_DEL_LUA),
        envoy_fence: Keys::new(NS).expect("namespace").envoy_fence().into_bytes(),
        mirror_fences: BTreeMap::new(),
        mirror_writes: 0,
        tokens: BTreeMap::new(),
        tokens_issued: 0,
        granted: 0,
        last_grant_ms: BTreeMap::new(),
        violations: Vec::new(),
        verbose: cfg.verbose,
    }));
    redis.set_observer(checker.clone());
    let specs = (0..cfg.tasks)
        .map(|_| (1, rng.range_i(5, 60) as u64))
        .collect();
    let deleted = vec![false; cfg.tasks];
    let created = vec![1; cfg.tasks];
    let control = Arc::new(Mutex::new(Control {
        specs,
        deleted,
        created,
        revision: 1,
        term: 1,
        holder: Some(0),
        epoch: 1,
        domains: vec![Some(1); A_DOMAINS.len()],
        deleted_at: vec![0; cfg.tasks],
        holder_since: start_us / 1000,
        disrupted_until: 0,
    }));
    let second = Arc::new(Mutex::new(Second {
        term: 1,
        leading: true,
        revision: 1,
        versions: vec![1; B_DOMAINS.len()],
        task: (1, 20),
    }));
    let faults_on = Arc::new(Mutex::new(cfg.faults));
    let log = Arc::new(Mutex::new(FaultLog {
        only: cfg.only_faults.clone(),
        ..FaultLog::default()
    }));
    let start_ms = start_us / 1000;
    let shared = Arc::new(Shared {
        redis: redis.clone(),
        faults_on: faults_on.clone(),
        log: log.clone(),
        clock: clock.clone(),
        start_ms,
    });
    // The manager's code reads `unix_ms()`: on this thread, the world's clock.
    let world_clock = clock.clone();
    sluice_protocol::sim_clock::set(Some(Arc::new(move || {
        world_clock.now_us() / 1000
            + SKEW
                .try_with(|s| s.load(std::sync::atomic::Ordering::Relaxed))
                .unwrap_or(0)
    })));
    let mut skews: Vec<Arc<std::sync::atomic::AtomicI64>> = Vec::new();
    let end_ms = start_ms + cfg.duration_ms as i64;
    let mut handles = Vec::new();
    for id in 0..cfg.leaders {
        let link = Link::new(&shared, rng.next_u64());
        let skew = if cfg.faults {
            rng.range_i(-200, 200)
        } else {
            0
        };
        if cfg.manager_roller {
            let seed = link.rng.clone().next_u64();
            let offset = Arc::new(std::sync::atomic::AtomicI64::new(skew));
            skews.push(offset.clone());
            handles.push(tokio::spawn(SKEW.scope(
                offset,
                manager_leader(
                    id,
                    cfg.leaders,
                    shared.clone(),
                    control.clone(),
                    end_ms,
                    start_ms + cfg.duration_ms as i64 * 7 / 10,
                    seed,
                ),
            )));
            continue;
        }
        handles.push(tokio::spawn(leader(
            id,
            link,
            clock.clone(),
            skew,
            control.clone(),
            end_ms,
            cfg.tasks,
        )));
    }
    for host in 0..cfg.hosts {
        let link = Link::new(&shared, rng.next_u64());
        let skew = if cfg.faults {
            rng.range_i(-150, 150)
        } else {
            0
        };
        handles.push(tokio::spawn(worker(
            host,
            link,
            clock.clone(),
            skew,
            control.clone(),
            end_ms,
            cfg.tasks,
        )));
        let link = Link::new(&shared, rng.next_u64());
        handles.push(tokio::spawn(locker(host, link, clock.clone(), end_ms)));
    }
    if cfg.manager_roller {
        handles.push(tokio::spawn(retire_watch(
            redis.clone(),
            control.clone(),
            checker.clone(),
            clock.clone(),
            end_ms,
        )));
        handles.push(tokio::spawn(second_cluster(
            shared.clone(),
            second.clone(),
            end_ms,
            rng.next_u64(),
        )));
    }
    handles.push(tokio::spawn(chaos(
        Rng::new(rng.next_u64()),
        redis.clone(),
        control.clone(),
        second.clone(),
        skews,
        faults_on.clone(),
        log.clone(),
        clock.clone(),
        cfg.clone(),
        start_ms,
    )));
    let mut outcome = Outcome {
        seed: cfg.seed,
        ..Outcome::default()
    };
    for h in handles {
        if let Err(e) = h.await {
            outcome.violations.push(format!("an actor panicked: {e}"));
        }
    }
    sluice_protocol::sim_clock::set(None);
    // Liveness: the quiet tail had a leader at the latest specs, and grants.
    let keys = Keys::new(NS).expect("namespace");
    let now_ms = clock.now_us() / 1000;
    let ks = redis.keyspace();
    let (specs, deleted, epoch) = {
        let c = control.lock().unwrap_or_else(|e| e.into_inner());
        (c.specs.clone(), c.deleted.clone(), c.epoch)
    };
    let c = checker.lock().unwrap_or_else(|e| e.into_inner());
    for (i, (version, threshold)) in specs.iter().enumerate() {
        let task = task_name(i);
        let meta_key = keys.meta(&task);
        if deleted[i] {
            // Every deleted task eventually retired: its meta a tombstone (or gone), and no
            // slice of it alive that a leader wrote after the deletion.
            let retired = field(&ks, meta_key.as_bytes(), "retired", now_ms);
            let has_meta = ks.get(meta_key.as_bytes(), now_ms).is_some();
            // A live meta of an earlier epoch (it came back from before the etcd was
            // rebuilt) is left alone by design (docs/operations.md: a task another etcd
            // cluster wrote is not this one's to judge).
            let stored_epoch = field(&ks, meta_key.as_bytes(), "epoch", now_ms);
            let foreign = stored_epoch.is_some_and(|e| e != epoch.to_string());
            if has_meta && retired.is_none() && !foreign {
                outcome.violations.push(format!(
                    "retire: {task} was deleted, and its meta is not a tombstone at the end"
                ));
            }
            continue;
        }
        let stored = field(&ks, meta_key.as_bytes(), "version", now_ms);
        if stored.as_deref() != Some(&version.to_string()) {
            outcome.violations.push(format!(
                "liveness: {task}'s meta holds version {stored:?} at the end, the spec is {version}"
            ));
        }
        let last = now_ms - 1500;
        let slice = keys.slice(&task, last - last.rem_euclid(SLICE_MS as i64));
        // A concurrency task has no slices (the manager writes none): its meta's threshold.
        let (what, cap) = if kind(i) == Kind::Concurrency {
            (
                meta_key.clone(),
                field(&ks, meta_key.as_bytes(), "threshold", now_ms),
            )
        } else {
            (slice.clone(), field(&ks, slice.as_bytes(), "cap", now_ms))
        };
        let slice = what;
        if cap.as_deref() != Some(&threshold.to_string()) {
            outcome.violations.push(format!(
                "liveness: {task}'s slice {slice} holds cap {cap:?} at the end, the spec says {threshold}"
            ));
        }
        // The last 3 s before the run's end (actors finishing a call may run past it).
        let granted_late = c.last_grant_ms.iter().any(|(k, t)| {
            k.starts_with(format!("{NS}:{{{task}}}:").as_bytes()) && *t >= end_ms - 3000
        });
        if !granted_late {
            outcome.violations.push(format!(
                "liveness: {task} granted nothing in the last 3 s of a quiet tail"
            ));
        }
    }
    // Needs a quiet tail longer than a fence stays fresh plus a refresh and a tick (shorter
    // runs skip it: a foreign fence from the last fault may still hold a domain).
    if cfg.manager_roller && cfg.duration_ms * 3 / 10 >= MANAGER_STALE_AFTER_MS + 5_000 {
        check_mirror(&ks, now_ms, &control, &second, &mut outcome.violations);
    }
    if cfg.manager_roller {
        // The second cluster's task: rolled at its last spec, never retired by this cluster.
        let (version, threshold) = second.lock().unwrap_or_else(|e| e.into_inner()).task;
        let meta = keys.meta(B_TASK);
        let stored = field(&ks, meta.as_bytes(), "version", now_ms);
        let retired = field(&ks, meta.as_bytes(), "retired", now_ms);
        let last = now_ms - 1500;
        let slice = keys.slice(B_TASK, last - last.rem_euclid(SLICE_MS as i64));
        let cap = field(&ks, slice.as_bytes(), "cap", now_ms);
        if stored.as_deref() != Some(&version.to_string())
            || retired.is_some()
            || cap.as_deref() != Some(&threshold.to_string())
        {
            outcome.violations.push(format!(
                "second cluster: its task {B_TASK} holds version {stored:?} (retired {retired:?}) and cap {cap:?} at the end; its spec is version {version}, threshold {threshold}"
            ));
        }
    }
    outcome.mirror_writes = c.mirror_writes;
    outcome.trace_hash = c.hash;
    outcome.commands = c.commands;
    outcome.granted = c.granted + c.key_granted;
    outcome.tokens = c.tokens_issued;
    outcome.lost_data_overgrant = c.overgrant_pruned
        + c.across
            .values()
            .map(|(g, cap)| g.saturating_sub(*cap))
            .sum::<u64>();
    outcome.violations.extend(c.violations.iter().cloned());
    {
        let l = log.lock().unwrap_or_else(|e| e.into_inner());
        outcome.faults = l.counts.clone();
        outcome.fault_events = l.applied.clone();
    }
    outcome.terms = control.lock().unwrap_or_else(|e| e.into_inner()).term;
    outcome
}

/// At the end (after a quiet tail): `NS:envoy` holds every domain some cluster imports, at
/// the version of the cluster whose fence holds it, and nothing else (this cluster's deleted
/// domains are gone).
fn check_mirror(
    ks: &crate::redis::Keyspace,
    now_ms: i64,
    control: &Mutex<Control>,
    second: &Mutex<Second>,
    violations: &mut Vec<String>,
) {
    let keys = Keys::new(NS).expect("namespace");
    let (routes, fences) = (keys.envoy_routes(), keys.envoy_fence());
    let c = control.lock().unwrap_or_else(|e| e.into_inner());
    let b = second.lock().unwrap_or_else(|e| e.into_inner());
    let mut names: Vec<&str> = A_DOMAINS.iter().chain(B_DOMAINS.iter()).copied().collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let a = A_DOMAINS
            .iter()
            .position(|d| *d == name)
            .and_then(|i| c.domains[i]);
        let bv = B_DOMAINS
            .iter()
            .position(|d| *d == name)
            .map(|i| b.versions[i]);
        let stored = field(ks, routes.as_bytes(), name, now_ms);
        let fence = field(ks, fences.as_bytes(), name, now_ms);
        let owner = fence
            .as_deref()
            .and_then(|f| f.split(' ').next())
            .map(str::to_string);
        let want = match owner.as_deref() {
            Some(e) if e == B_EPOCH.to_string() => bv,
            Some(e) if e == c.epoch.to_string() => a,
            _ => a.or(bv),
        };
        let got = stored.as_deref().and_then(|v| {
            serde_json::from_str::<serde_json::Value>(v)
                .ok()?
                .get("version")?
                .as_i64()
        });
        let ok = match (a.or(bv), want) {
            (None, _) => stored.is_none(),
            (Some(_), Some(w)) => got == Some(w),
            (Some(_), None) => false,
        };
        if !ok {
            violations.push(format!(
                "envoy mirror: domain {name} holds version {got:?} at the end (fence {fence:?}); this cluster (epoch {}) imports it at {a:?}, the second cluster at {bv:?}",
                c.epoch
            ));
        }
    }
}

/// Looks for the fewest faults of a failing run that still make it fail (ddmin over the fault
/// numbers, at most `budget` runs): the mask to replay with, and that run's outcome. The
/// workload (elections, spec changes, requests) is never removed, only faults.
pub fn shrink(
    cfg: &Config,
    failing: &Outcome,
    budget: usize,
    mut progress: impl FnMut(usize, usize),
) -> (std::collections::BTreeSet<u64>, Outcome) {
    let mut keep: Vec<u64> = failing.fault_events.iter().map(|e| e.index).collect();
    let mut best = failing.clone();
    let mut runs = 0;
    let try_set = |set: &[u64], runs: &mut usize| {
        *runs += 1;
        let mut c = cfg.clone();
        c.only_faults = Some(set.iter().copied().collect());
        let o = run(&c);
        (!o.violations.is_empty()).then_some(o)
    };
    // No fault at all first: a failure of the workload alone is the shortest story.
    if let Some(o) = try_set(&[], &mut runs) {
        return (Default::default(), o);
    }
    let mut n = 2usize;
    while !keep.is_empty() && runs < budget {
        let chunk = keep.len().div_ceil(n);
        let mut reduced = false;
        let mut start = 0;
        while start < keep.len() && runs < budget {
            let candidate: Vec<u64> = keep[..start]
                .iter()
                .chain(keep[(start + chunk).min(keep.len())..].iter())
                .copied()
                .collect();
            if let Some(o) = try_set(&candidate, &mut runs) {
                keep = candidate;
                best = o;
                n = (n - 1).max(2);
                reduced = true;
                break;
            }
            start += chunk;
        }
        progress(runs, keep.len());
        if !reduced {
            if n >= keep.len() {
                break;
            }
            n = (n * 2).min(keep.len());
        }
    }
    (keep.into_iter().collect(), best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_bit_for_bit() {
        let mut cfg = Config::new(7);
        cfg.duration_ms = 20_000;
        let a = run(&cfg);
        let b = run(&cfg);
        assert_eq!(a.trace_hash, b.trace_hash, "{a:?}\n{b:?}");
        assert!(a.commands > 1000, "{a:?}");
        assert!(a.violations.is_empty(), "{:?}", a.violations);
        assert!(!a.fault_events.is_empty(), "{a:?}");
    }

    #[test]
    fn a_mask_replays_and_masks_only_faults() {
        let mut cfg = Config::new(11);
        cfg.duration_ms = 20_000;
        let all = run(&cfg);
        let first: std::collections::BTreeSet<u64> =
            all.fault_events.iter().take(3).map(|e| e.index).collect();
        cfg.only_faults = Some(first.clone());
        let a = run(&cfg);
        let b = run(&cfg);
        assert_eq!(a.trace_hash, b.trace_hash);
        let applied: std::collections::BTreeSet<u64> =
            a.fault_events.iter().map(|e| e.index).collect();
        assert!(applied.is_subset(&first), "{applied:?} ⊄ {first:?}");
        cfg.only_faults = Some(Default::default());
        assert!(run(&cfg).fault_events.is_empty());
    }
}
