//! Keyed tasks: one task, a limit per key (tenant, user, route), decided from a host-shared
//! key table.
//!
//! A keyed task (`"keyed": true` in its spec) gives every distinct key its own limit of
//! `threshold` permits per slice (or its `key_overrides` entry). The leader rolls only the
//! task's meta and slices; a key's slice hash `NS:{T}:k:<digest>:<start>` is created by the
//! first pull that needs it ([`crate::protocol::scripts::KPULL_LUA`]), from the task's state in
//! the same atomic call.
//!
//! # The key table
//!
//! A second shared file next to the host segment, `<segment>.keys`, holds a fixed number of
//! entries ([`crate::Config::key_slots`], default [`DEFAULT_KEY_SLOTS`], at most
//! [`MAX_KEY_SLOTS`]), grouped in buckets of [`WAYS`]. A key's bucket and identity come from a
//! 128-bit SipHash of `(task slot, key)` keyed with a random secret of the file, so keys chosen
//! by an attacker cannot be made to collide. Each entry holds two packed quota words (the
//! same `tag | exhausted | count` words as a task's, see [`crate::shm`]), so a decision on a
//! key with quota in hand is one lookup and one compare-and-swap, lock-free.
//!
//! The table outlives a replaced segment (more `max_tasks`, a new layout) while old processes
//! still map the old one, and both segments' task slots have the same indexes and
//! generations: an entry therefore also records the id of the segment that claimed it
//! ([`crate::shm::Header::segment_id`]); a process looks up, reclaims (only once idle) and
//! reports only its own segment's entries.
//!
//! An entry is claimed by compare-and-swap of its identity word, which names the claimer
//! (participant of the segment) until the claim is published by a second compare-and-swap: a
//! claim abandoned by a crash at any instruction is taken over by the next claim of its bucket
//! once its participant is dead (the kernel's byte lock, as for [`crate::shm::ShmLock`]); a
//! claimer of another segment is judged by the entry's last use instead. Nothing waits for a
//! claim: a decision skips an entry being claimed. An entry whose key has been
//! idle for two slices (or whose task slot was reclaimed) may be reclaimed for another key of
//! the same bucket; a stale decision that raced with a reclaim notices (the identity word
//! changed after its compare-and-swap) and gives the permits back. When the bucket has no
//! free or reclaimable entry the table is full for that key: the decision is made by one
//! all-or-nothing Redis call ([`Key::acquire`]) and nothing is cached, so a full table costs
//! Redis calls, never accuracy.
//!
//! # Chunks from 1 to N
//!
//! A key's first pull in a slice asks for exactly what the decision needs; each further pull
//! of the same slice doubles the previous one, up to [`max_chunk`]`(cap)` (a sixteenth of the
//! cap; 2–4 for caps of 8–63). A key pulled in the previous slice (or prefetched into this
//! one) starts at its last chunk, and a key whose chunk is 2 or more asks for the next chunk
//! once less than half of the last is left (and, decided in the last eighth of a slice, for its
//! next slice's first chunk), so it is decided from shared memory like a pooled task; a cold
//! key costs about one Redis call per decision (like an exact limiter) and nothing more. At
//! most one pull per key per host is in flight (the entry's pull lock), so one host holds less
//! than 1.5 chunks of a key's slice beyond what it is about to spend, and one prefetched chunk
//! of its next slice.
//!
//! # Failure
//!
//! Keys share the task's state machine (Redis reachability is the task's): a key pull that
//! fails, times out or finds no task slice (KPULL −1, as PULL −1) makes the task FAILED; while
//! it is FAILED, each key is decided by the task's `on_failure` with `local_limit` per key per
//! slice (a fixed window in the entry) for `local`, and the task's probe (a PULL) brings it
//! back.
//!
//! # Where the code is
//!
//! This module is the [`Key`] front: finding the key's entry, resolving a decision core's
//! answer (waiting for a pull, a direct call, the fallback). The entry's quota words are
//! `crate::decide::keyed`, the table file `crate::keytable`, the pulls and key reports
//! `crate::refill::keys`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::client::Task;
use crate::ctx::{Event, Want};
use crate::decide::fallback;
use crate::decide::keyed::{self, Direct, Entry, deposit, give_back, take_back};
pub use crate::decide::keyed::{chunk, max_chunk};
use crate::decision::{Decision, Refund};
use crate::error::Error;
pub use crate::keytable::{
    CHUNK_DIVISOR, DEFAULT_KEY_SLOTS, KeyEntry, KeyTable, MAX_KEY_SLOTS, MIN_MAX_CHUNK, TOP_KEYS,
    WAYS,
};
use crate::keytable::{Owner, owner, owner_of};
use crate::protocol::Mode;
use crate::protocol::scripts::KeyPullReply;
use crate::refill::keys::pull_failed;
use crate::shm::{FastMeta, field, tag_of};
use crate::state::Health;

/// A handle to one key of a keyed task ([`Task::key`]). Cheap to create and clone.
///
/// On a task whose spec is not keyed (or not known yet), a key decides on the task as a whole.
#[derive(Clone)]
pub struct Key {
    task: Task,
    key: Arc<str>,
    /// Identity hash (for the task's slot at creation).
    h: (u64, u64),
    slot: usize,
    /// Last entry found: `index + 1` (0 = none) and its identity word.
    cached: Arc<(AtomicU64, AtomicU64)>,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Key")
            .field("task", &self.task.name())
            .field("key", &self.key)
            .finish()
    }
}

/// Whether a key decided now in the slice starting at `start_ms` should have its next slice's
/// first chunk pulled ahead: the slice is in its last eighth (at least 5 ms left, so the pull
/// can arrive in time), the key is hot here (its last chunk around this slice,
/// [`keyed::last_chunk`], is 2 or more), and nothing is held for the next slice yet. What a prefetch strands if the key goes cold is one chunk.
#[inline]
fn next_slice_due(e: &KeyEntry, m: &FastMeta, start_ms: i64, now_us: i64) -> bool {
    let end_us = (start_ms + m.slice_ms as i64) * 1_000;
    let left = end_us - now_us;
    if left > (m.slice_ms as i64 * 1_000) / 8 || left < 5_000 {
        return false;
    }
    // Hot: its chunk grew past 1 (pulled in this slice, or prefetched into it). A key decided
    // once per slice would only strand what a prefetch brings (measured: 10,000 cold keys).
    let g = e.grant.load(Ordering::Relaxed);
    if keyed::last_chunk(g, start_ms, m.slice_ms).is_none_or(|size| size < 2) {
        return false;
    }
    let next = start_ms + m.slice_ms as i64;
    let w = e.quota[crate::shm::parity(next, m.slice_ms)].load(Ordering::Acquire);
    w == 0 || crate::shm::unpack_quota(w).0 != tag_of(next)
}

/// What a waiting call does next ([`Key::wait_step`]).
enum Next {
    /// Decided (when, and how to give the permits back).
    Done(Decision, i64, Option<Refund>),
    /// The task as a whole decides (not keyed).
    Task,
    /// One all-or-nothing Redis call decides (no key table entry), decided at `at`.
    Direct { m: FastMeta, start_ms: i64, at: i64 },
    /// Wait for this want's pull, then step again.
    Wait(Arc<Event>),
    /// Pull entry `entry` (identity `ident`) for the slice at `start_ms` from the caller's
    /// task ([`crate::Config::caller_pulls`]), then step again.
    Here {
        entry: usize,
        ident: u64,
        start_ms: i64,
    },
}

/// Where a key's decision stands.
enum KStep {
    Decided(Decision),
    /// Admitted from the entry's quota word `parity` of slice tag `tag`, while the entry held
    /// identity `ident` (refundable).
    Admitted {
        entry: usize,
        ident: u64,
        parity: usize,
        tag: u32,
    },
    /// Not a keyed decision (the task is not keyed, or its meta is unknown): the task decides,
    /// with the same flavour of call (try / async / blocking).
    Task,
    /// Quota for the slice starting at `start_ms` is being pulled into entry `entry`.
    Pending {
        entry: usize,
        ident: u64,
        start_ms: i64,
    },
    /// The table has no entry for the key: one all-or-nothing Redis call decides.
    Direct {
        m: FastMeta,
        start_ms: i64,
    },
}

impl Task {
    /// A handle to key `key` of this keyed task (any UTF-8 up to 256 bytes).
    ///
    /// ```no_run
    /// # let client = sluice::Client::new(sluice::Config::new("redis://127.0.0.1:6379"))?;
    /// let api = client.task("api-per-tenant")?;
    /// if api.key("tenant-42")?.try_acquire(1).is_allowed() { /* serve */ }
    /// # Ok::<(), sluice::Error>(())
    /// ```
    pub fn key(&self, key: &str) -> Result<Key, Error> {
        crate::protocol::validate_key(key)?;
        let table = self.shared.keyed.table(&self.shared)?;
        let slot = self.inner.slot_ref().index;
        Ok(Key {
            task: self.clone(),
            h: table.hash(slot, key),
            key: Arc::from(key),
            slot,
            cached: Arc::new((AtomicU64::new(0), AtomicU64::new(0))),
        })
    }
}

impl Key {
    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The task.
    pub fn task(&self) -> &Task {
        &self.task
    }

    /// This host's view of the key now: its cap for the slice as Redis last answered (0 when
    /// not known yet) and the permits of the current slice held in the key table. `None`
    /// when the key is not decided from the key table (not keyed, no entry).
    #[cfg(feature = "tower")]
    pub(crate) fn local_view(&self, now_us: i64) -> Option<(u64, u64)> {
        let (m, table, i, _) = self.entry_now()?;
        let e = table.entry(i)?;
        let start = now_us.div_euclid(m.slice_ms as i64 * 1_000) * m.slice_ms as i64;
        let w = e.quota[crate::shm::parity(start, m.slice_ms)].load(Ordering::Acquire);
        let (t, _, c) = crate::shm::unpack_quota(w);
        let held = if w != 0 && t == tag_of(start) {
            c as u64
        } else {
            0
        };
        Some((e.cap.load(Ordering::Relaxed), held))
    }

    /// What this process's latest pull of this key answered of the key's quota in Redis: the
    /// slice's start (Unix ms), the key's `rem` there after the pull (what no host has pulled
    /// yet), and when the answer arrived. `None` when this process has not pulled the key
    /// since its entry was claimed (another process of the host may have), or the key is not
    /// decided from the key table. A reading for estimates (the agent's `limit_remaining`
    /// uses it instead of reading the key's field again after a decision that pulled it);
    /// never a decision.
    #[doc(hidden)]
    pub fn pulled_rem(&self) -> Option<(i64, i64, Instant)> {
        let (_, _, i, ident) = self.entry_now()?;
        let p = *self
            .task
            .shared
            .keyed
            .pulled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&i)?;
        (p.ident == ident).then_some((p.start_ms, p.rem, p.at))
    }

    /// Benchmarks and tests only: puts `n` permits of the current slice (exhausted after them
    /// when `exhausted`) into this host's entry for the key, claiming one. False when the key
    /// is not decided from the key table (not keyed, meta unknown, table full).
    #[doc(hidden)]
    pub fn fill_local(&self, n: u64, exhausted: bool) -> bool {
        let Some((_, m)) = self.task.slot_meta() else {
            return false;
        };
        let Some(table) = self.table() else {
            return false;
        };
        let r = self.task.inner.slot_ref();
        let now_us = self.task.now_us();
        let Some((i, _)) = self.entry(
            table,
            owner(&self.task.shared.seg, r.index, r.generation),
            m.slice_ms,
            now_us / 1_000,
        ) else {
            return false;
        };
        let Some(e) = table.entry(i) else {
            return false;
        };
        let start = now_us.div_euclid(m.slice_ms as i64 * 1_000) * m.slice_ms as i64;
        e.quota[crate::shm::parity(start, m.slice_ms)].store(0, Ordering::Relaxed);
        deposit(e, start, m.slice_ms, n, exhausted, now_us)
    }

    /// Decides `n` permits of this key now, from the host's local quota. Never waits: a key
    /// with no quota in hand on this host answers `Limited` with a 1 ms retry and starts a
    /// pull ([`Key::acquire`] waits for it instead); a key the table has no room for answers
    /// [`Decision::WouldBlock`] (call [`Key::acquire`]).
    #[inline]
    pub fn try_acquire(&self, n: u64) -> Decision {
        self.try_refundable(n).0
    }

    /// [`Key::try_acquire`], with how to give the permits back.
    #[inline]
    pub(crate) fn try_refundable(&self, n: u64) -> (Decision, Option<Refund>) {
        let now_us = self.task.now_us();
        let d = match self.decide(n, now_us) {
            KStep::Decided(d) => d,
            KStep::Admitted {
                entry,
                ident,
                parity,
                tag,
            } => {
                return (
                    Decision::Allowed,
                    Some(Refund::Key {
                        entry,
                        ident,
                        parity,
                        tag,
                    }),
                );
            }
            KStep::Task => {
                // The task as a whole decides, shadow mode included (a shadow task's
                // rejection is a would-reject here as in every other decision path).
                let (d, r) = self.task.try_refundable(n, now_us);
                return (self.task.shadowed(n, now_us, d), r);
            }
            KStep::Pending {
                entry,
                ident,
                start_ms,
            } => {
                self.want(entry, ident, start_ms, n);
                self.count_rejected(entry, n);
                Decision::Limited {
                    retry_after: Duration::from_millis(1),
                }
            }
            KStep::Direct { .. } => Decision::WouldBlock,
        };
        (self.task.shadowed(n, now_us, d), None)
    }

    /// Like [`Key::try_acquire`], but waits for a pull of the key (at most
    /// [`crate::Config::acquire_timeout`]); with a full table, one Redis call decides.
    pub async fn acquire(&self, n: u64) -> Decision {
        self.acquire_stamped(n).await.0
    }

    /// [`Key::acquire`] that also says when the decision was made (Unix µs on the slice
    /// clock): the slice it was charged to. For load generators and tests.
    #[doc(hidden)]
    pub async fn acquire_stamped(&self, n: u64) -> (Decision, i64) {
        let (d, at, _) = self.acquire_refundable(n).await;
        (d, at)
    }

    /// [`Key::acquire_stamped`], with how to give the permits back.
    pub(crate) async fn acquire_refundable(&self, n: u64) -> (Decision, i64, Option<Refund>) {
        let deadline = crate::clock::deadline_after(self.task.shared.cfg.acquire_timeout);
        let mut here = self.task.shared.cfg.caller_pulls;
        // Pulls from the caller per call: a key pulled for and still pending (an entry
        // reclaimed meanwhile, a new slice) tries again, at most 3 times, then the pump paces it.
        let mut tries = 0;
        loop {
            match self.wait_step(n, deadline, here) {
                Next::Done(d, at, r) => return (d, at, r),
                Next::Here {
                    entry,
                    ident,
                    start_ms,
                } => {
                    tries += 1;
                    if tries >= 4 || !self.pull_here(entry, ident, start_ms, n, deadline).await {
                        // Through the background thread from now on (this call).
                        here = false;
                    }
                }
                Next::Task => {
                    // Stamped where the task charged it: a refund goes to that slice.
                    let (d, at) = self.task.acquire_stamped(n).await;
                    return (d, at, self.task.refund_of(d, at));
                }
                Next::Direct { m, start_ms, at } => {
                    let fut = self.direct(m, start_ms, n);
                    let reply = self.task.shared.rt.spawn(fut).await.ok().flatten();
                    let d = self.direct_decision(reply, &m, start_ms, n);
                    return (self.task.shadowed(n, at, d), at, None);
                }
                Next::Wait(ev) => {
                    ev.wait().await;
                }
            }
        }
    }

    /// [`Key::acquire`] for programs without an async runtime.
    pub fn acquire_blocking(&self, n: u64) -> Decision {
        self.acquire_blocking_stamped(n).0
    }

    /// [`Key::acquire_blocking`] that also says when the decision was made (see
    /// [`Key::acquire_stamped`]).
    #[doc(hidden)]
    pub fn acquire_blocking_stamped(&self, n: u64) -> (Decision, i64) {
        let (d, at, _) = self.acquire_blocking_refundable(n);
        (d, at)
    }

    /// [`Key::acquire_blocking_stamped`], with how to give the permits back.
    pub(crate) fn acquire_blocking_refundable(&self, n: u64) -> (Decision, i64, Option<Refund>) {
        let deadline = crate::clock::deadline_after(self.task.shared.cfg.acquire_timeout);
        loop {
            match self.wait_step(n, deadline, false) {
                Next::Done(d, at, r) => return (d, at, r),
                Next::Here {
                    entry,
                    ident,
                    start_ms,
                } => {
                    // Not asked for (no caller pulls without a runtime): waits as for a want.
                    self.want(entry, ident, start_ms, n).wait_blocking(deadline);
                }
                Next::Task => {
                    let (d, at) = self.task.acquire_blocking_stamped(n);
                    return (d, at, self.task.refund_of(d, at));
                }
                Next::Direct { m, start_ms, at } => {
                    let (tx, rx) = std::sync::mpsc::channel();
                    let fut = self.direct(m, start_ms, n);
                    self.task.shared.rt.spawn(async move {
                        let _ = tx.send(fut.await);
                    });
                    let wait = self.task.shared.cfg.pull_timeout * 2 + Duration::from_millis(100);
                    let reply = rx.recv_timeout(wait).ok().flatten();
                    let d = self.direct_decision(reply, &m, start_ms, n);
                    return (self.task.shadowed(n, at, d), at, None);
                }
                Next::Wait(ev) => {
                    ev.wait_blocking(deadline);
                }
            }
        }
    }

    /// One step of the waiting calls (`acquire`, `acquire_blocking`; only how they wait and
    /// make a Redis call differs): decide; a pull still pending registers the wait, or at the
    /// deadline is a rejection. A pull that failed (or found no task slice) made the task
    /// FAILED: the next step decides by `on_failure`.
    ///
    /// With `here`, a pending pull is the caller's to make ([`Next::Here`]; it joins another
    /// pull of the entry in flight, [`Key::pull_here`]).
    fn wait_step(&self, n: u64, deadline: Instant, here: bool) -> Next {
        let now_us = self.task.now_us();
        match self.decide(n, now_us) {
            KStep::Decided(d) => Next::Done(self.task.shadowed(n, now_us, d), now_us, None),
            KStep::Admitted {
                entry,
                ident,
                parity,
                tag,
            } => Next::Done(
                Decision::Allowed,
                now_us,
                Some(Refund::Key {
                    entry,
                    ident,
                    parity,
                    tag,
                }),
            ),
            KStep::Task => Next::Task,
            KStep::Direct { m, start_ms } => Next::Direct {
                m,
                start_ms,
                at: now_us,
            },
            KStep::Pending {
                entry,
                ident,
                start_ms,
            } => {
                if Instant::now() >= deadline {
                    self.count_rejected(entry, n);
                    let d = self.task.shadowed(n, now_us, Self::pending_limited());
                    return Next::Done(d, now_us, None);
                }
                if here {
                    return Next::Here {
                        entry,
                        ident,
                        start_ms,
                    };
                }
                Next::Wait(self.want(entry, ident, start_ms, n))
            }
        }
    }

    /// Gives back what [`Refund`] says this key's decision took (see [`crate::multi`]).
    pub(crate) fn refund(&self, r: &Refund, n: u64) {
        match *r {
            Refund::Key {
                entry,
                ident,
                parity,
                tag,
            } => {
                // Only into the entry while it still holds this key: an entry reclaimed for
                // another key in the same slice has a word with the same tag, and the permits
                // would become that key's (review of issue 23). A reclaim racing the give-back
                // is undone as far as the permits are still there; what the other key spent of
                // them meanwhile is its excess (at most `n`; the task's slice still holds).
                if let Some(e) = self.table().and_then(|t| t.entry(entry))
                    && e.ident.load(Ordering::Acquire) == ident
                {
                    give_back(&e.quota[parity], tag, n);
                    if e.ident.load(Ordering::Acquire) != ident {
                        take_back(&e.quota[parity], tag, n);
                        return;
                    }
                    let _ = e
                        .adm
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| {
                            Some(a.saturating_sub(n))
                        });
                }
            }
            Refund::Task { .. } => self.task.refund(r, n),
        }
    }

    fn pending_limited() -> Decision {
        Decision::Limited {
            retry_after: Duration::from_millis(1),
        }
    }

    fn table(&self) -> Option<&KeyTable> {
        self.task.shared.keyed.opened()
    }

    /// The key's entry in this host's key table as it is (none is claimed): the meta, the
    /// table, the entry's index and identity. `None` when the task is not keyed or the key has
    /// no entry.
    fn entry_now(&self) -> Option<(FastMeta, &KeyTable, usize, u64)> {
        let (_, m) = self.task.slot_meta()?;
        if !m.keyed {
            return None;
        }
        let table = self.table()?;
        let r = self.task.inner.slot_ref();
        let own = owner(&self.task.shared.seg, r.index, r.generation);
        let (i, ident) = table.lookup(self.h, own)?;
        Some((m, table, i, ident))
    }

    /// The key's entry: cached, looked up, or claimed.
    #[inline]
    fn entry(
        &self,
        table: &KeyTable,
        owner: Owner,
        slice_ms: u64,
        now_ms: i64,
    ) -> Option<(usize, u64)> {
        let c = self.cached.0.load(Ordering::Relaxed);
        if c != 0 {
            let i = (c - 1) as usize;
            let id = self.cached.1.load(Ordering::Relaxed);
            if let Some(e) = table.entry(i)
                && e.ident.load(Ordering::Acquire) == id
                && owner_of(id) == owner.bits
                && e.segment.load(Ordering::Relaxed) == owner.segment
            {
                return Some((i, id));
            }
        }
        let found = table.lookup(self.h, owner).or_else(|| {
            table.claim(
                &self.task.shared.seg,
                self.h,
                owner,
                &self.key,
                slice_ms,
                now_ms,
            )
        })?;
        self.cached.0.store(found.0 as u64 + 1, Ordering::Relaxed);
        self.cached.1.store(found.1, Ordering::Relaxed);
        Some(found)
    }

    #[inline]
    fn decide(&self, n: u64, now_us: i64) -> KStep {
        if n == 0 {
            return KStep::Decided(Decision::Allowed);
        }
        if n > crate::protocol::MAX_COUNT {
            // As for tasks: no slice can hold it; refused and counted nowhere (a count this
            // large would overflow the key table's report and the slice's counters).
            return KStep::Decided(self.task.too_large(n, crate::protocol::MAX_COUNT));
        }
        let r = self.task.inner.slot_ref();
        let Some((slot, m)) = self.task.slot_meta() else {
            return KStep::Task;
        };
        let Some(table) = self.table() else {
            return KStep::Task;
        };
        if !m.keyed || m.mode != Mode::Pooled {
            // Not keyed: the task as a whole decides.
            return KStep::Task;
        }
        if r.index != self.slot {
            // The task moved to another slot (the identity hash covers the slot): re-made.
            return match self.rebuilt() {
                Some(k) => k.decide(n, now_us),
                None => KStep::Task,
            };
        }
        let slice_us = m.slice_ms * 1_000;
        let index = now_us.max(0) as u64 / slice_us.max(1);
        let start_ms = (index * m.slice_ms) as i64;
        let now_ms = now_us / 1_000;
        let own = owner(&self.task.shared.seg, r.index, r.generation);
        let Some((i, id)) = self.entry(table, own, m.slice_ms, now_ms) else {
            if let Health::Failed { .. } = Health::decode(slot.ctl.state.load(Ordering::Acquire)) {
                return KStep::Decided(fallback::key(slot, &m, None, start_ms, n, now_us));
            }
            return KStep::Direct { m, start_ms };
        };
        let Some(e) = table.entry(i) else {
            return KStep::Direct { m, start_ms };
        };
        if now_ms - e.used_ms.load(Ordering::Relaxed) >= 50 {
            e.used_ms.store(now_ms, Ordering::Relaxed);
        }
        match keyed::decide(slot, table, i, e, id, &m, index, n, now_us) {
            Entry::Admitted { low } => {
                if low {
                    // Running low: the next chunk is on its way before it is needed.
                    self.want_quiet(i, id, start_ms, n);
                } else if next_slice_due(e, &m, start_ms, now_us) {
                    // A key pulled in this slice, in its last eighth: its first decision of
                    // the next slice should not wait for Redis (issue 26).
                    self.want_quiet(i, id, start_ms + m.slice_ms as i64, 1);
                }
                KStep::Admitted {
                    entry: i,
                    ident: id,
                    parity: (index & 1) as usize,
                    tag: tag_of(start_ms),
                }
            }
            Entry::Reclaimed => {
                self.cached.0.store(0, Ordering::Relaxed);
                self.decide(n, now_us)
            }
            Entry::Failed => KStep::Decided(fallback::key(slot, &m, Some(e), start_ms, n, now_us)),
            Entry::Limited { retry_after } => {
                if next_slice_due(e, &m, start_ms, now_us) {
                    // Its quota of this slice is spent and it is still asked for: the next
                    // slice's first decision should not wait either (measured: at 3× its
                    // limit, every key's first decision of a slice waited, 2 % of them).
                    self.want_quiet(i, id, start_ms + m.slice_ms as i64, 1);
                }
                KStep::Decided(Decision::Limited { retry_after })
            }
            Entry::Pending => KStep::Pending {
                entry: i,
                ident: id,
                start_ms,
            },
        }
    }

    /// A fresh handle for the task's current slot (the slot was re-claimed elsewhere).
    #[cold]
    fn rebuilt(&self) -> Option<Key> {
        let k = self.task.key(&self.key).ok()?;
        (k.slot != self.slot).then_some(k)
    }

    fn count_rejected(&self, entry: usize, n: u64) {
        if let Some(t) = self.table()
            && let Some(e) = t.entry(entry)
        {
            e.rej.fetch_add(n, Ordering::Relaxed);
            t.touch(entry);
        }
    }

    /// Registers (or joins) a pull of entry `entry` for slice `start_ms`.
    fn want(&self, entry: usize, ident: u64, start_ms: i64, n: u64) -> Arc<Event> {
        self.register(entry, ident, start_ms, n, true)
    }

    /// [`Key::want`]; `wake`: wake the pump (else the caller sends it, [`Key::pull_here`]).
    fn register(&self, entry: usize, ident: u64, start_ms: i64, n: u64, wake: bool) -> Arc<Event> {
        let sh = &self.task.shared;
        let ev = {
            let mut wants = sh.keyed.wants.lock().unwrap_or_else(|e| e.into_inner());
            let w = wants.entry(entry).or_insert_with(|| Want {
                task: self.task.inner.clone(),
                key: self.key.clone(),
                ident,
                start_ms,
                n,
                since: Instant::now(),
                event: Arc::new(Event::default()),
            });
            if w.start_ms != start_ms || w.ident != ident {
                // A want of an older slice (or key) is replaced; its waiters re-decide.
                let old = std::mem::replace(
                    w,
                    Want {
                        task: self.task.inner.clone(),
                        key: self.key.clone(),
                        ident,
                        start_ms,
                        n,
                        since: Instant::now(),
                        event: Arc::new(Event::default()),
                    },
                );
                old.event.complete();
            }
            w.n = w.n.max(n);
            w.event.clone()
        };
        if wake {
            sh.keyed.wake.notify_one();
        }
        ev
    }

    /// Pulls entry `entry` for the slice at `start_ms` from the caller's task, over the
    /// caller's runtime's connection ([`crate::refill::caller`]), together with the other
    /// wants of the task and slice waiting in this process. False when no pull was made for
    /// the caller here: it then goes through the background thread. A failure of the caller's
    /// connection never makes the task FAILED by itself (the background thread's resend
    /// judges Redis); an answer that finds no task slice does, as on the background thread.
    async fn pull_here(
        &self,
        entry: usize,
        ident: u64,
        start_ms: i64,
        n: u64,
        deadline: Instant,
    ) -> bool {
        use crate::refill::keys::Here;
        let sh = &self.task.shared;
        let Some((mut conn, failed)) = crate::refill::caller::conn(sh, deadline).await else {
            return false;
        };
        // Registered without waking the pump; one yield lets the decisions that are ready
        // on this runtime now register theirs, and the first to come back sends them all.
        let ev = self.register(entry, ident, start_ms, n, false);
        tokio::task::yield_now().await;
        let r = crate::refill::keys::pull_here(sh, &mut conn, entry, ident, deadline).await;
        match r {
            Here::Done => true,
            Here::Taken | Here::Handed { .. } => {
                if r == (Here::Handed { fault: true }) {
                    crate::refill::caller::forget(sh, &failed);
                }
                tokio::select! {
                    _ = ev.wait() => {}
                    _ = tokio::time::sleep_until(deadline.into()) => {}
                }
                true
            }
            Here::Pump => false,
        }
    }

    /// A prefetch want: nobody waits for it. Best effort: skipped when the wants map is busy
    /// (a refused decision of a hot key must not queue on the lock), and it wakes the pump
    /// only when the pump is in its long idle wait: a wake from here costs the deciding
    /// thread tens of µs (the woken thread takes its core; measured: 10 % of a hot key's
    /// decisions over 27 µs), so while prefetches keep coming the pump looks for them every
    /// `PREFETCH_TICK` instead (`crate::refill::keys::pump`).
    fn want_quiet(&self, entry: usize, ident: u64, start_ms: i64, n: u64) {
        let sh = &self.task.shared;
        let fresh = {
            let mut wants = match sh.keyed.wants.try_lock() {
                Ok(w) => w,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return,
            };
            match wants.entry(entry) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Want {
                        task: self.task.inner.clone(),
                        key: self.key.clone(),
                        ident,
                        start_ms,
                        n,
                        since: Instant::now(),
                        event: Arc::new(Event::default()),
                    });
                    true
                }
            }
        };
        if fresh {
            sh.keyed
                .quiet_ms
                .store(crate::clock::boot_ms(), Ordering::SeqCst);
            if sh.keyed.pump_idle.swap(false, Ordering::SeqCst) {
                sh.keyed.wake.notify_one();
            }
        }
    }

    /// One all-or-nothing KPULL of `n` (the table has no entry for the key). The future
    /// holds no `Task` (it runs on the background thread, which must not own the client).
    fn direct(
        &self,
        m: FastMeta,
        start_ms: i64,
        n: u64,
    ) -> impl std::future::Future<Output = Option<KeyPullReply>> + Send + 'static {
        crate::refill::keys::direct(
            self.task.shared.clone(),
            self.task.inner.clone(),
            self.key.clone(),
            m,
            start_ms,
            n,
        )
    }

    fn direct_decision(
        &self,
        reply: Option<KeyPullReply>,
        m: &FastMeta,
        start_ms: i64,
        n: u64,
    ) -> Decision {
        let Some((slot, _)) = self.task.slot_meta() else {
            return self.task.try_acquire(n);
        };
        let now_us = self.task.now_us();
        let d = match keyed::direct(reply, m, start_ms, n, now_us) {
            Direct::Decided(d) => d,
            Direct::StaleMeta => {
                slot.meta.refreshed_ms.store(0, Ordering::Relaxed);
                self.task.shared.wake.notify_one();
                Decision::Limited {
                    retry_after: Duration::from_millis(1),
                }
            }
            Direct::Failed(outcome) => {
                // No task slice (the leader gone past the horizon, the task deleted) or no
                // answer: FAILED, as a PULL that finds none or fails.
                pull_failed(&self.task.shared, &self.task.inner, slot, outcome);
                return fallback::key(slot, m, None, start_ms, n, now_us);
            }
        };
        let f = if d.is_allowed() {
            field::ADMITTED
        } else {
            field::REJECTED
        };
        slot.count(start_ms, m.slice_ms, f, n);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keytable::tests::table;
    use crate::shm::{pack_quota, unpack_quota};

    #[test]
    fn chunks_grow_from_one_by_doubling_up_to_a_sixteenth() {
        let s = 10_000;
        let tag = (tag_of(s) as u64) << 32;
        assert_eq!(chunk(0, s, 1_000, 0, 1), 1);
        assert_eq!(chunk(0, s, 1_000, 1_000, 3), 3);
        assert_eq!(chunk(tag | 1, s, 1_000, 1_000, 1), 2);
        assert_eq!(chunk(tag | 32, s, 1_000, 1_000, 1), 62);
        assert_eq!(chunk(tag | 62, s, 1_000, 1_000, 1), 62);
        assert_eq!(chunk(tag | 62, s, 1_000, 1_000, 100), 100);
        // The previous slice was hot: start at its last chunk.
        let prev = (tag_of(s - 1_000) as u64) << 32;
        assert_eq!(chunk(prev | 40, s, 1_000, 1_000, 1), 40);
        assert_eq!(chunk(prev | 1, s, 1_000, 1_000, 1), 1);
        // Older: cold again.
        let old = (tag_of(s - 5_000) as u64) << 32;
        assert_eq!(chunk(old | 40, s, 1_000, 1_000, 1), 1);
        // A prefetch's record (the next slice's) sizes this slice's pulls too.
        let next = (tag_of(s + 1_000) as u64) << 32;
        assert_eq!(chunk(next | 40, s, 1_000, 1_000, 1), 40);
        // A small cap: chunks up to min(4, cap / 4) (max_chunk), at least 1.
        assert_eq!(chunk(tag | 1, s, 1_000, 10, 1), 2);
        assert_eq!(chunk(tag | 4, s, 1_000, 10, 1), 2);
        assert_eq!(chunk(tag | 4, s, 1_000, 50, 1), 4);
        assert_eq!(chunk(tag | 1, s, 1_000, 1, 1), 1);
        assert_eq!(chunk(tag | 2, s, 1_000, 3, 1), 1);
        assert_eq!(chunk(tag | 2, s, 1_000, 3, 3), 3);
        assert_eq!(chunk(tag | 4, s, 1_000, 64, 1), 4);
        assert_eq!(chunk(tag | 4, s, 1_000, 160, 1), 8);
        assert_eq!(chunk(tag | 8, s, 1_000, 160, 1), 10);
        for (cap, max) in [
            (0, 1),
            (1, 1),
            (7, 1),
            (8, 2),
            (15, 3),
            (16, 4),
            (63, 4),
            (64, 4),
            (80, 5),
        ] {
            assert_eq!(max_chunk(cap), max, "cap {cap}");
        }
    }

    /// Issue 26: a chunk of one is never "low" (a cold key pulled once per slice would double
    /// its calls); a chunk of 2 or more is low below its half, odd sizes included.
    #[test]
    fn low_is_below_half_a_chunk_of_two_or_more() {
        use crate::decide::keyed::below_half;
        let s = 10_000;
        let g = |start: i64, size: u64| ((tag_of(start) as u64) << 32) | size;
        let low = |held, last| below_half(held, last, s, 1_000);
        assert!(!low(0, g(s, 1)));
        assert!(low(0, g(s, 2)));
        assert!(!low(1, g(s, 2)));
        assert!(low(1, g(s, 3)));
        assert!(!low(2, g(s, 3)));
        assert!(low(1, g(s, 4)));
        assert!(!low(2, g(s, 4)));
        // The previous slice's last chunk sized this one's first (prefetched) chunk.
        assert!(low(1, g(s - 1_000, 4)));
        assert!(!low(2, g(s - 1_000, 4)));
        // The next slice's (a prefetch): this slice's mark holds through it.
        assert!(low(1, g(s + 1_000, 4)));
        // Older or further: says nothing about this one.
        assert!(!low(0, g(s - 2_000, 8)));
        assert!(!low(0, g(s + 2_000, 8)));
        assert!(!low(0, 0));
    }

    #[test]
    fn deposits_and_give_back_follow_the_tag() {
        let (_d, t, _seg) = table(8);
        let e = t.entry(0).unwrap();
        assert!(deposit(e, 10_000, 1_000, 5, false, 10_000_000));
        let q = &e.quota[crate::shm::parity(10_000, 1_000)];
        assert_eq!(
            unpack_quota(q.load(Ordering::Relaxed)),
            (tag_of(10_000), false, 5)
        );
        give_back(q, tag_of(10_000), 2);
        assert_eq!(unpack_quota(q.load(Ordering::Relaxed)).2, 7);
        give_back(q, tag_of(12_000), 2);
        assert_eq!(
            unpack_quota(q.load(Ordering::Relaxed)).2,
            7,
            "another slice: dropped"
        );
        assert!(
            !deposit(e, 10_000, 1_000, 5, false, 11_000_000),
            "ended slice"
        );
    }

    /// Review of issue 23: a refund (a refused `acquire_all`'s key part) went into the entry
    /// it was taken from even after the entry was reclaimed for another key in the same slice
    /// (its word has the same tag): that key gained the permits. Now only while the entry still
    /// holds the key.
    #[test]
    fn a_refund_never_goes_to_another_key_of_a_reclaimed_entry() {
        use crate::protocol::TaskMeta;
        use crate::{Client, Config};
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new("redis://127.0.0.1:1");
        cfg.shm_dir = dir.path().to_path_buf();
        cfg.host_id = "refundowner".into();
        cfg.max_tasks = 1;
        cfg.key_slots = 64;
        let client = Client::new(cfg).unwrap();
        let task = client.task("a").unwrap();
        let (seg, _) = crate::shm::Segment::open(client.segment_path(), 1).unwrap();
        let slot = seg.slot(seg.find("a").unwrap()).unwrap();
        let m = TaskMeta {
            keyed: true,
            ..crate::client::tests::meta(86_400_000)
        };
        assert!(slot.store_meta(&m, slot.generation()));
        let key = task.key("k").unwrap();
        assert!(key.fill_local(10, false));
        let (d, r) = key.try_refundable(1);
        assert_eq!(d, Decision::Allowed);
        let Some(r @ Refund::Key { entry, parity, .. }) = r else {
            panic!("not a key refund: {r:?}");
        };
        let e = key.table().unwrap().entry(entry).unwrap();
        let held = || unpack_quota(e.quota[parity].load(Ordering::Relaxed)).2;
        assert_eq!(held(), 9);
        // While the entry still holds the key, the refund lands.
        key.refund(&r, 1);
        assert_eq!(held(), 10);
        let (_, r) = key.try_refundable(1);
        let r = r.unwrap();
        // Reclaimed for another key (a new identity; the word keeps this slice's tag).
        let other = e.ident.load(Ordering::Acquire) ^ 1;
        e.ident.store(other, Ordering::Release);
        key.refund(&r, 1);
        assert_eq!(held(), 9, "the other key gained this key's refund");
    }

    /// A keyed pooled task's meta of 1 s slices.
    fn keyed_meta() -> FastMeta {
        FastMeta {
            slice_ms: 1_000,
            mode: Mode::Pooled,
            on_failure: crate::protocol::OnFailure::Local,
            algorithm: crate::protocol::FallbackAlgorithm::TokenBucket,
            generation: 1,
            keyed: true,
            shadow: false,
            paced: false,
        }
    }

    /// Issue 26: a key pulled in this slice asks for its next slice's first chunk in the last
    /// eighth of the slice (not earlier, not with less than 5 ms left, not twice).
    #[test]
    fn the_next_slice_is_prefetched_only_late_for_a_hot_key() {
        let (_d, t, _seg) = table(8);
        let e = t.entry(0).unwrap();
        let m = keyed_meta();
        let start = 10_000i64;
        let at = |ms: i64| (start + ms) * 1_000;
        // Not pulled in this slice, or once for one permit: cold, no prefetch.
        assert!(!next_slice_due(e, &m, start, at(950)));
        e.grant
            .store(((tag_of(start) as u64) << 32) | 1, Ordering::Relaxed);
        assert!(!next_slice_due(e, &m, start, at(950)));
        e.grant
            .store(((tag_of(start) as u64) << 32) | 3, Ordering::Relaxed);
        assert!(!next_slice_due(e, &m, start, at(800)), "too early");
        assert!(next_slice_due(e, &m, start, at(900)));
        assert!(!next_slice_due(e, &m, start, at(996)), "too late to arrive");
        // Once the next slice's chunk is held: no more.
        assert!(deposit(e, start + 1_000, 1_000, 2, false, at(900)));
        assert!(!next_slice_due(e, &m, start, at(900)));
        // Issue 26: a key whose first chunk of this slice was prefetched and sufficed has no
        // pull of this slice yet (its grant word is the last slice's): still hot, still
        // prefetched; two slices back: cold.
        let next = start + 1_000;
        e.grant
            .store(((tag_of(start) as u64) << 32) | 4, Ordering::Relaxed);
        assert!(next_slice_due(e, &m, next, (next + 900) * 1_000));
        e.grant.store(
            ((tag_of(start - 1_000) as u64) << 32) | 4,
            Ordering::Relaxed,
        );
        assert!(!next_slice_due(e, &m, next, (next + 900) * 1_000));
    }

    /// Issue 26: a prefetch of the next slice keeps the current slice's low-water mark, and a
    /// key whose prefetched chunk sufficed (no pull in its slice) stays hot and prefetches its
    /// next slice at the same size (it decayed to 1, then to cold).
    #[test]
    fn a_prefetch_keeps_the_low_water_mark_and_the_size() {
        use crate::decide::keyed::{below_half, record_grant};
        let (_d, t, _seg) = table(8);
        let e = t.entry(0).unwrap();
        let m = keyed_meta();
        let s = 10_000i64;
        record_grant(e, s, 8);
        // The prefetch of slice s + 1 (asked at 900 ms), sized from this slice's record.
        assert!(next_slice_due(e, &m, s, (s + 900) * 1_000));
        let want = chunk(e.grant.load(Ordering::Relaxed), s + 1_000, 1_000, 1_000, 1);
        assert_eq!(want, 8);
        record_grant(e, s + 1_000, want);
        let g = e.grant.load(Ordering::Relaxed);
        assert!(
            below_half(3, g, s, 1_000),
            "this slice's low-water mark holds"
        );
        // Slice s + 1: its prefetched 8 suffice, nothing pulled in it; at 900 ms it is still
        // hot and its next slice is asked for 8 again.
        assert!(next_slice_due(e, &m, s + 1_000, (s + 1_900) * 1_000));
        assert_eq!(chunk(g, s + 2_000, 1_000, 1_000, 1), 8);
        // A pull in slice s + 1 doubles.
        assert_eq!(chunk(g, s + 1_000, 1_000, 1_000, 1), 16);
    }

    /// Review of issue 23 (F7): a give-back undone after a reclaim takes what is left of the
    /// permits when the other key spent some of them (all or nothing left them all there).
    #[test]
    fn take_back_takes_what_is_left() {
        let q = AtomicU64::new(0);
        let tag = tag_of(10_000);
        q.store(pack_quota(tag, false, 3), Ordering::Relaxed);
        take_back(&q, tag, 5);
        assert_eq!(unpack_quota(q.load(Ordering::Relaxed)).2, 0);
        q.store(pack_quota(tag, false, 9), Ordering::Relaxed);
        take_back(&q, tag, 5);
        assert_eq!(unpack_quota(q.load(Ordering::Relaxed)).2, 4);
        // Another slice's word is left alone.
        take_back(&q, tag_of(11_000), 4);
        assert_eq!(unpack_quota(q.load(Ordering::Relaxed)).2, 4);
    }
}
