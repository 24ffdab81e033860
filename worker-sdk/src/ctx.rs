//! The context every part of the SDK shares: a client's [`Shared`] state, a task's
//! [`TaskInner`], and the per-process state of keyed tasks ([`KeyState`]). Types and their
//! accessors only: no decision, no Redis call, no thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use tokio::sync::Notify;

use crate::config::{ClockSource, Config};
use crate::error::Error;
use crate::keytable::KeyTable;
use crate::protocol::Keys;
use crate::protocol::conn::Redis;
use crate::protocol::scripts::SliceCounters;
use crate::shm::{ClaimOptions, Segment, SlotRef};
use crate::state::Machine;

pub(crate) struct Shared {
    pub(crate) cfg: Config,
    pub(crate) keys: Keys,
    pub(crate) seg: Segment,
    pub(crate) redis: Redis,
    pub(crate) tasks: Mutex<Vec<Arc<TaskInner>>>,
    pub(crate) wake: Notify,
    pub(crate) redis_calls: Arc<AtomicU64>,
    /// Slices whose counters a flush dropped (Redis refused them).
    pub(crate) flushes_dropped: AtomicU64,
    pub(crate) machine: Machine,
    pub(crate) stop: AtomicBool,
    /// The background runtime (exact-mode calls run on it).
    pub(crate) rt: tokio::runtime::Handle,
    /// Random per client: prefixes request ids and sliding-log members.
    pub(crate) nonce: u64,
    /// Sequence of request ids.
    pub(crate) requests: AtomicU64,
    /// When the client was created.
    pub(crate) started: Instant,
    /// Keyed tasks: the key table and pending key pulls.
    pub(crate) keyed: KeyState,
    /// The fast path's clock guard, µs: a coarse reading at least this far from its slice's
    /// end decides an admission; 0 = the fast clock is off ([`Config::fast_clock`]).
    pub(crate) fast_guard_us: i64,
}

impl Shared {
    #[inline]
    pub(crate) fn now_us(&self) -> i64 {
        let h = crate::clock::host_us();
        match self.cfg.clock {
            ClockSource::Host => h,
            ClockSource::Redis => h - self.seg.header().clock_offset_us.load(Ordering::Relaxed),
        }
    }

    /// Now on the coarse clock (see [`crate::clock::coarse_us`]), on the clock slices follow.
    #[inline]
    pub(crate) fn coarse_now_us(&self) -> i64 {
        let h = crate::clock::coarse_us();
        match self.cfg.clock {
            ClockSource::Host => h,
            ClockSource::Redis => h - self.seg.header().clock_offset_us.load(Ordering::Relaxed),
        }
    }

    /// A request id unique to this call (a retry of the call reuses it).
    pub(crate) fn request_id(&self) -> String {
        format!(
            "{:016x}.{:x}",
            self.nonce,
            self.requests.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// How to claim a slot now.
    pub(crate) fn claim_options(&self) -> ClaimOptions {
        ClaimOptions {
            now_ms: crate::clock::host_ms(),
            lock_timeout_ms: self.cfg.lock_timeout.as_millis() as u64,
            reclaim_idle_ms: self.cfg.reclaim_idle.as_millis().max(1) as u64,
        }
    }
}

/// The fast path's guard in ticks of the coarse clock. The kernel advances the coarse clock in
/// whole ticks, from the tick of the CPU that keeps time, so it lags by up to a tick plus the
/// lateness of that tick (1.3–5.3 ms = 0.3–1.3 ticks measured on a loaded 2-vCPU VM at
/// `HZ=250`); three ticks leave more than a tick of margin.
const FAST_GUARD_TICKS: i64 = 3;

/// Largest coarse-clock tick the fast path accepts (µs); a coarser clock turns it off.
const MAX_COARSE_TICK_US: i64 = 10_000;

/// The fast path's guard for this kernel: [`FAST_GUARD_TICKS`] ticks of the coarse clock (0 =
/// off).
pub(crate) fn fast_guard_us(enabled: bool) -> i64 {
    if !enabled {
        return 0;
    }
    match crate::clock::coarse_resolution_us() {
        Some(tick) if tick <= MAX_COARSE_TICK_US => FAST_GUARD_TICKS * tick,
        other => {
            tracing::info!(tick_us = ?other, "coarse clock too coarse or unknown: the fast \
                path reads the precise clock");
            0
        }
    }
}

pub(crate) struct TaskInner {
    pub(crate) name: String,
    /// The slot: `index:32 | generation:16`, re-resolved when the slot was reclaimed.
    slot_ref: AtomicU64,
    /// Full index of the slice the last decision fell in (saves a division per decision).
    pub(crate) index_cache: AtomicU64,
    pub(crate) poked: AtomicBool,
    pub(crate) deposited: Notify,
    pub(crate) waiters: AtomicUsize,
    /// When the background thread last woke this task's waiters whatever its round found
    /// (host ms): at most every [`crate::background::WAITER_WAKE_MS`].
    pub(crate) woken_ms: AtomicI64,
    /// `try_acquire` on an exact task was warned about (once per task per process).
    pub(crate) warned_would_block: AtomicBool,
    /// A cost too large for any slice was warned about (once per task per process).
    pub(crate) warned_too_large: AtomicBool,
    /// Slice start whose grant was dropped (it had ended): never pulled for again.
    pub(crate) dropped_start: AtomicI64,
    /// When this process last refreshed the slot's `used_ms` (host ms).
    pub(crate) touched_ms: AtomicI64,
    /// When this process last warned about pulls outside the slice window (host ms).
    pub(crate) window_warned_ms: AtomicI64,
    /// A flush whose answer was lost: `(seq, batch)`, resent with the same seq.
    pub(crate) pending_flush: Mutex<Option<FlushBatch>>,
}

impl TaskInner {
    pub(crate) fn new(name: &str, r: SlotRef) -> Self {
        let t = Self {
            name: name.to_string(),
            slot_ref: AtomicU64::new(0),
            index_cache: AtomicU64::new(0),
            poked: AtomicBool::new(false),
            deposited: Notify::new(),
            waiters: AtomicUsize::new(0),
            woken_ms: AtomicI64::new(0),
            warned_would_block: AtomicBool::new(false),
            warned_too_large: AtomicBool::new(false),
            dropped_start: AtomicI64::new(i64::MIN),
            touched_ms: AtomicI64::new(0),
            window_warned_ms: AtomicI64::new(0),
            pending_flush: Mutex::new(None),
        };
        t.set_slot_ref(r);
        t
    }

    #[inline]
    pub(crate) fn slot_ref(&self) -> SlotRef {
        let w = self.slot_ref.load(Ordering::Acquire);
        SlotRef {
            index: (w >> 16) as usize,
            generation: w as u16,
        }
    }

    pub(crate) fn set_slot_ref(&self, r: SlotRef) {
        self.slot_ref.store(
            ((r.index as u64) << 16) | r.generation as u64,
            Ordering::Release,
        );
    }
}

/// A caller waiting for a refill, counted in `waiters` for as long as it lives: the count
/// goes down when the wait ends or when the waiting future is dropped (cancelled).
pub(crate) struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    pub(crate) fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::AcqRel);
        Self(c)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A flush whose answer was lost: its sequence number and counters, resent as they were.
pub(crate) type FlushBatch = (u64, Vec<(i64, SliceCounters)>);

/// Per-process state of keyed tasks (the table is opened on first use).
#[derive(Default)]
pub(crate) struct KeyState {
    pub(crate) table: OnceLock<Result<KeyTable, String>>,
    pub(crate) wants: Mutex<HashMap<usize, Want>>,
    /// Wakes the key pump (`crate::refill::keys::pump`).
    pub(crate) wake: tokio::sync::Notify,
    /// When (`crate::clock::boot_ms`) a prefetch want was last registered: while they come,
    /// the pump looks for wants every `PREFETCH_TICK` instead of being woken for each.
    pub(crate) quiet_ms: std::sync::atomic::AtomicI64,
    /// Set by the pump for its long idle wait: the next prefetch want wakes it (once).
    pub(crate) pump_idle: AtomicBool,
    /// How each keyed task's keys are labelled, by task name: the labels, the meta version
    /// they were read at and when.
    pub(crate) labels: Mutex<HashMap<String, (Labels, i64, Instant)>>,
    /// Connections of callers' runtimes this client has open (`crate::refill::caller`).
    pub(crate) caller_conns: Arc<std::sync::atomic::AtomicUsize>,
    /// Set once the target turned out not to allow caller connections (a cluster).
    pub(crate) caller_off: AtomicBool,
    /// KPULL calls sent from callers' runtimes ([`crate::Client::caller_pulls_sent`]).
    pub(crate) caller_sent: std::sync::atomic::AtomicU64,
    /// Key pulls in flight on the background runtime (the pump's, and callers' calls handed
    /// over to it): a stopping client waits for them (`crate::refill::keys::finish`), so what
    /// Redis granted lands in the key table instead of being dropped with the runtime.
    pub(crate) in_flight: std::sync::atomic::AtomicUsize,
    /// Notified when [`KeyState::in_flight`] drops to zero.
    pub(crate) settled: tokio::sync::Notify,
    /// What this process's latest pull of each key table entry answered of the key's slice in
    /// Redis ([`crate::Key::pulled_rem`]), at most [`MAX_PULLED`] entries (when full, stale
    /// ones are dropped, then all: `crate::refill::keys::note_pulled`).
    pub(crate) pulled: Mutex<HashMap<usize, Pulled>>,
}

/// Most entries [`KeyState::pulled`] remembers.
pub(crate) const MAX_PULLED: usize = 10_000;

/// A key pull's answer for one entry: the key's quota left in Redis after it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pulled {
    /// The entry's identity when pulled (a reclaimed entry's record is another key's).
    pub(crate) ident: u64,
    pub(crate) start_ms: i64,
    /// The key's `rem` in the slice's hash after the pull (what no host has pulled yet).
    pub(crate) rem: i64,
    /// When the answer arrived.
    pub(crate) at: Instant,
}

/// How a keyed task's keys are written where people read them: the `key` field of its key
/// slices and the top-key sets (the meta fields `clear_keys` and `key_secret`; see
/// [`crate::protocol::key_label`]).
#[derive(Clone)]
pub(crate) enum Labels {
    /// The spec says `"clear_keys": true`.
    Clear,
    /// HMAC-SHA-256 under the namespace's secret.
    Keyed(crate::protocol::KeySecret),
    /// No secret in the meta (managers without one) or the meta not readable yet: SHA-256.
    Digest,
}

impl Labels {
    pub(crate) fn label(&self, key: &str) -> String {
        match self {
            Labels::Clear => key.to_string(),
            Labels::Keyed(s) => crate::protocol::key_label(Some(s), key),
            Labels::Digest => crate::protocol::key_label(None, key),
        }
    }
}

pub(crate) struct Want {
    /// The task (never a `Task`: the background thread must not hold the client's guard).
    pub(crate) task: Arc<TaskInner>,
    pub(crate) key: Arc<str>,
    pub(crate) ident: u64,
    pub(crate) start_ms: i64,
    pub(crate) n: u64,
    pub(crate) since: Instant,
    pub(crate) event: Arc<Event>,
}

impl Drop for Want {
    /// A want that is dropped, however (done, replaced, merged), wakes its waiters: they
    /// re-decide, and want again if they still need to.
    fn drop(&mut self) {
        self.event.complete();
    }
}

/// A want whose entry's pull lock this process holds: entry, want, lock token.
pub(crate) type Locked = (usize, Want, u64);

/// A completed want wakes its waiters.
#[derive(Default)]
pub(crate) struct Event {
    pub(crate) done: AtomicBool,
    pub(crate) notify: tokio::sync::Notify,
    pub(crate) lock: Mutex<()>,
    pub(crate) cv: Condvar,
}

impl Event {
    pub(crate) fn complete(&self) {
        self.done.store(true, Ordering::Release);
        self.notify.notify_waiters();
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }

    pub(crate) async fn wait(&self) {
        let n = self.notify.notified();
        if self.done.load(Ordering::Acquire) {
            return;
        }
        n.await;
    }

    pub(crate) fn wait_blocking(&self, until: Instant) {
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.done.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= until {
                return;
            }
            g = match self.cv.wait_timeout(g, until - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

impl KeyState {
    pub(crate) fn table(&self, sh: &Shared) -> Result<&KeyTable, Error> {
        let t = self.table.get_or_init(|| {
            let path = crate::shm::sibling(sh.seg.path(), ".keys");
            KeyTable::open(&path, sh.cfg.key_slots)
                .inspect(|t| {
                    tracing::debug!(path = %t.path.display(), entries = t.entries, "key table open");
                })
                .map_err(|e| format!("key table {}: {e}", path.display()))
        });
        t.as_ref().map_err(|e| Error::KeyTable(e.clone()))
    }

    pub(crate) fn opened(&self) -> Option<&KeyTable> {
        self.table.get().and_then(|t| t.as_ref().ok())
    }
}
