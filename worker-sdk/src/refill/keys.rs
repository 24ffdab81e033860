//! Keyed tasks, the refill side: the pump that batches key wants into KPULL calls (each under
//! its entry's pull lock), applying their grants, the key labels read from the meta, and the
//! host's key report (counters into the task's, top keys).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::ctx::{Labels, Locked, MAX_PULLED, Pulled, Shared, TaskInner, Want};
use crate::decide::keyed::{below_half, chunk, deposit, record_grant};
use crate::keytable::{KeyEntry, KeyTable, OWNED, TOP_KEYS, owner_alive};
use crate::plumbing::{Retry, call};
use crate::protocol::scripts::{self, KeyPullBatchReply, KeyPullReply, KeyPullRequest};
use crate::shm::{FastMeta, LockAttempt, Slot, field, tag_of, unpack_quota};
use crate::state::{Health, PullOutcome};

/// How often (host-wide) key counters are moved into the task counters and top keys reported.
const REPORT_MS: i64 = 1_000;

/// KPULL calls in flight at once per process.
const CONCURRENT_PULLS: usize = 64;

/// Most keys in one KPULL call.
const BATCH: usize = 64;

/// Labels are re-read this often (and when the meta's version changes).
const LABELS_TTL: Duration = Duration::from_secs(10);

/// Tasks whose labels a process keeps (dropped oldest first beyond this).
const MAX_LABELLED_TASKS: usize = 4_096;

/// The labels of task `task` (meta version `version`): cached, else read from its meta (one
/// `HMGET`). A failed read keeps the last known labels, or digests: never clear keys by
/// default.
pub(crate) async fn labels_of(sh: &Shared, task: &str, version: i64) -> Labels {
    {
        let map = sh.keyed.labels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((l, v, at)) = map.get(task)
            && *v == version
            && at.elapsed() < LABELS_TTL
        {
            return l.clone();
        }
    }
    use crate::protocol::meta_field::{CLEAR_KEYS, KEY_SECRET};
    let meta = sh.keys.meta(task);
    let read = call(sh, Retry::Idempotent, |mut c| {
        let meta = meta.clone();
        async move {
            redis::cmd("HMGET")
                .arg(&meta)
                .arg(CLEAR_KEYS)
                .arg(KEY_SECRET)
                .query_async::<(Option<String>, Option<String>)>(&mut c)
                .await
        }
    })
    .await;
    let mut map = sh.keyed.labels.lock().unwrap_or_else(|e| e.into_inner());
    let labels = match read {
        Ok(Ok((clear, secret))) => {
            if clear.as_deref() == Some("1") {
                Labels::Clear
            } else {
                match secret
                    .as_deref()
                    .and_then(crate::protocol::KeySecret::parse)
                {
                    Some(s) => Labels::Keyed(s),
                    None => Labels::Digest,
                }
            }
        }
        _ => {
            return map
                .get(task)
                .map(|(l, ..)| l.clone())
                .unwrap_or(Labels::Digest);
        }
    };
    if map.len() >= MAX_LABELLED_TASKS && !map.contains_key(task) {
        let oldest = map
            .iter()
            .min_by_key(|(_, (_, _, at))| *at)
            .map(|(k, _)| k.clone());
        if let Some(k) = oldest {
            map.remove(&k);
        }
    }
    map.insert(task.to_string(), (labels.clone(), version, Instant::now()));
    labels
}

/// The background thread's round for keys (host-wide, every second): key counters into the
/// task counters, and the busiest keys reported. Pulls are the [`pump`]'s.
pub(crate) async fn step(sh: &Shared) -> bool {
    if let Some(table) = sh.keyed.opened() {
        report(sh, table).await;
    }
    false
}

/// A key pull in flight on the background runtime, counted in [`crate::ctx::KeyState::in_flight`]
/// from before it is spawned until it is done (applied, failed, or dropped).
struct Flight(Arc<Shared>);

impl Flight {
    fn new(sh: &Arc<Shared>) -> Self {
        sh.keyed.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(sh.clone())
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if self.0.keyed.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.keyed.settled.notify_one();
        }
    }
}

/// A stopping client's last step for keys: the pump stops taking wants, and the pulls it (or
/// a caller's handed-over call) has in flight finish — within the pull timeout and a margin, as
/// a Redis call does — so that what Redis granted is deposited in the host's key table, where
/// the host's other processes spend it. Dropped with the runtime instead, a pull's grant was
/// taken in Redis and lost to every host for the rest of its slice (found by the keyed model:
/// a client restarted while a decision's prefetch was in flight).
pub(crate) async fn finish(sh: &Shared, pump: tokio::task::JoinHandle<()>) {
    sh.keyed.wake.notify_one();
    let bound = sh.cfg.pull_timeout + Duration::from_millis(250);
    let waited = tokio::time::timeout(bound, async {
        let _ = pump.await;
        loop {
            let settled = sh.keyed.settled.notified();
            if sh.keyed.in_flight.load(Ordering::Acquire) == 0 {
                return;
            }
            settled.await;
        }
    })
    .await;
    if waited.is_err() {
        tracing::warn!(
            pulls = sh.keyed.in_flight.load(Ordering::Acquire),
            "client stopping with key pulls still unanswered; their grants are lost"
        );
    }
}

/// How often the pump looks for wants while prefetches come (they wake it only from its long
/// idle wait: see `Key::want_quiet`), and while a want waits for another process's pull lock.
const PREFETCH_TICK: Duration = Duration::from_millis(1);
/// The pump ticks every `PREFETCH_TICK` while a prefetch want came in this recently (ms); then
/// it waits long (10 ms, or until woken) again. Costs a timer wake-up of the background
/// thread a millisecond while a host's hot keys prefetch.
const PREFETCH_WINDOW_MS: i64 = 100;

/// Runs on the background runtime beside the rounds: takes the wants as they come and pulls
/// each on its own task (at most [`CONCURRENT_PULLS`] at once), so a cold key waits one Redis
/// round trip, not a round of the background thread.
pub(crate) async fn pump(sh: Arc<Shared>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_PULLS));
    loop {
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        let notified = sh.keyed.wake.notified();
        let wants: Vec<(usize, Want)> = {
            let mut w = sh.keyed.wants.lock().unwrap_or_else(|e| e.into_inner());
            w.drain().collect()
        };
        let mut retry = Vec::new();
        let mut groups: HashMap<(String, i64), Vec<Locked>> = HashMap::new();
        if let Some(table) = sh.keyed.opened() {
            for (i, w) in wants {
                let Some(e) = table.entry(i) else {
                    continue; // dropped: wakes its waiters
                };
                if stale(&sh, e, &w) {
                    continue;
                }
                let timeout = sh.cfg.lock_timeout.as_millis() as u64;
                let token = match sh
                    .seg
                    .lock(&e.pull_lock)
                    .try_lock(crate::clock::host_ms(), timeout)
                {
                    LockAttempt::Acquired { token, .. } => token,
                    LockAttempt::Busy { .. } => {
                        retry.push((i, w));
                        continue;
                    }
                };
                groups
                    .entry((w.task.name.clone(), w.start_ms))
                    .or_default()
                    .push((i, w, token));
            }
        }
        let mut batches: Vec<Vec<Locked>> = Vec::new();
        for (_, mut items) in groups.drain() {
            while !items.is_empty() {
                let rest = items.split_off(items.len().min(BATCH));
                batches.push(std::mem::replace(&mut items, rest));
            }
        }
        let mut batches = batches.into_iter();
        while let Some(batch) = batches.next() {
            // A stopping client sends nothing more (its last step waits for what it sent,
            // `finish`, within one pull timeout from then); the rest is released.
            let permit = match sh.stop.load(Ordering::Acquire) {
                false => permits.clone().acquire_owned().await.ok(),
                true => None,
            };
            let Some(permit) = permit.filter(|_| !sh.stop.load(Ordering::Acquire)) else {
                release(&sh, batch);
                batches.for_each(|b| release(&sh, b));
                return;
            };
            let flight = Flight::new(&sh);
            tokio::spawn(async move {
                pull(&flight.0, batch).await;
                drop(permit);
                drop(flight);
            });
        }
        let again = !retry.is_empty();
        if again {
            let mut map = sh.keyed.wants.lock().unwrap_or_else(|e| e.into_inner());
            for (i, w) in retry {
                // A newer want of the entry may have come in meanwhile: it wins; this one is
                // dropped, which wakes its waiters (they join the newer one).
                map.entry(i).or_insert(w);
            }
        }
        // Idle unless a prefetch came lately. Marked before reading when the last one came
        // (both SeqCst, as in `Key::want_quiet`, which stores the time, then clears the mark):
        // either this read sees a new prefetch, or that prefetch sees the mark and wakes us.
        sh.keyed.pump_idle.store(true, Ordering::SeqCst);
        let quiet = crate::clock::boot_ms() - sh.keyed.quiet_ms.load(Ordering::SeqCst);
        let wait = if again || quiet < PREFETCH_WINDOW_MS {
            sh.keyed.pump_idle.store(false, Ordering::SeqCst);
            PREFETCH_TICK
        } else {
            // The long wait: the next prefetch want wakes the pump (once, `Key::want_quiet`).
            Duration::from_millis(10)
        };
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(wait) => {}
        }
        sh.keyed.pump_idle.store(false, Ordering::SeqCst);
    }
}

/// Releases the pull locks of wants that will not be pulled; the wants are dropped, which
/// wakes their waiters.
fn release(sh: &Shared, items: Vec<Locked>) {
    let Some(table) = sh.keyed.opened() else {
        return;
    };
    for (i, _, token) in items {
        unlock(sh, table, i, token);
    }
}

/// Releases entry `i`'s pull lock taken as `token`.
fn unlock(sh: &Shared, table: &KeyTable, i: usize, token: u64) {
    if let Some(e) = table.entry(i) {
        sh.seg.lock(&e.pull_lock).unlock(token);
    }
}

/// A want not worth pulling for: its entry holds another key now, or nobody can still be
/// waiting for it.
fn stale(sh: &Shared, e: &KeyEntry, w: &Want) -> bool {
    e.ident.load(Ordering::Acquire) != w.ident
        || w.since.elapsed() > sh.cfg.acquire_timeout + sh.cfg.pull_timeout
}

/// The entry holds fewer permits of the want's slice than it needs, or [`below_half`] its last chunk.
fn low(e: &KeyEntry, w: &Want, slice_ms: u64) -> bool {
    let tag = tag_of(w.start_ms);
    let last = e.grant.load(Ordering::Relaxed);
    let held: u64 = e
        .quota
        .iter()
        .map(|q| q.load(Ordering::Acquire))
        .filter(|q| *q != 0 && unpack_quota(*q).0 == tag)
        .map(|q| {
            let (_, ex, c) = unpack_quota(q);
            if ex { u64::MAX } else { c as u64 }
        })
        .max()
        .unwrap_or(0);
    held < w.n || below_half(held, last, w.start_ms, slice_ms)
}

/// The task's slot and meta, when the slot is still the task's, with the meta version the
/// fast word is at least as new as: the version is read first ([`Slot::store_meta`] writes it
/// last), so a KPULL never pairs a spec version with an older slice length.
fn slot_meta_version<'a>(sh: &'a Shared, t: &TaskInner) -> Option<(&'a Slot, FastMeta, i64)> {
    let r = t.slot_ref();
    let slot = sh.seg.slot(r.index)?;
    let version = slot.meta.version.load(Ordering::Acquire);
    let m = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire))?;
    (m.generation == r.generation).then_some((slot, m, version))
}

/// A KPULL ready to send: wants of one task and slice whose entries are still low, each
/// with its pull lock, what it asks and its key's digest.
struct Batch<'a> {
    sh: &'a Shared,
    table: &'a KeyTable,
    task: Arc<TaskInner>,
    slot: &'a Slot,
    m: FastMeta,
    version: i64,
    start_ms: i64,
    todo: Vec<(usize, Want, u64, u64, String)>,
}

impl Batch<'_> {
    fn request<'b>(
        &'b self,
        request_id: &'b str,
        wants: &'b [scripts::KeyWant<'b>],
    ) -> scripts::KeyPullBatch<'b> {
        scripts::KeyPullBatch {
            task: &self.task.name,
            start_ms: self.start_ms,
            slice_ms: self.m.slice_ms,
            host_id: &self.sh.cfg.host_id,
            request_id,
            meta_version: self.version,
            all_or_nothing: false,
            keys: wants,
        }
    }

    fn wants(&self) -> Vec<scripts::KeyWant<'_>> {
        self.todo
            .iter()
            .map(|(_, _, _, want, digest)| scripts::KeyWant {
                digest,
                want: *want,
            })
            .collect()
    }

    fn into_parts(mut self) -> Parts {
        Parts {
            task: self.task.clone(),
            m: self.m,
            version: self.version,
            start_ms: self.start_ms,
            todo: std::mem::take(&mut self.todo),
        }
    }
}

/// A [`Batch`] without its borrows, to finish on the background runtime.
struct Parts {
    task: Arc<TaskInner>,
    m: FastMeta,
    version: i64,
    start_ms: i64,
    todo: Vec<(usize, Want, u64, u64, String)>,
}

/// The batch `p` was, with the same keys and wants (so a resend under the same request id is
/// answered from KPULL's record of the first call).
fn from_parts(sh: &Shared, p: Parts) -> Option<Batch<'_>> {
    let table = sh.keyed.opened()?;
    let slot = sh.seg.slot(p.task.slot_ref().index)?;
    Some(Batch {
        sh,
        table,
        task: p.task,
        slot,
        m: p.m,
        version: p.version,
        start_ms: p.start_ms,
        todo: p.todo,
    })
}

/// Sends the batch `p` again under `request_id` on the client's shared connection, as the
/// pump sends (its retry rule and timeout; its failure makes the task FAILED), and applies the
/// answer: a call from the caller's connection that went unanswered is finished here, and
/// what it took in Redis is answered again from KPULL's record, never taken twice or lost.
async fn resend(sh: &Shared, p: Parts, request_id: String) {
    if let Some(batch) = from_parts(sh, p) {
        send(batch, &request_id).await;
    }
}

impl Drop for Batch<'_> {
    /// Releases the pull locks and drops the wants (which wakes their waiters), however the
    /// batch ends: applied, failed, or its future dropped mid-call (a caller's `acquire`
    /// cancelled while its pull is in flight must not leave the keys' locks held).
    fn drop(&mut self) {
        for (i, w, token, ..) in self.todo.drain(..) {
            unlock(self.sh, self.table, i, token);
            drop(w);
        }
    }
}

/// The batch to send for `items` (wants of one task and slice, each holding its entry's pull
/// lock), or `None` when nothing is to be pulled (locks released, wants dropped).
fn prepare(sh: &Shared, items: Vec<Locked>) -> Option<Batch<'_>> {
    let table = sh.keyed.opened()?;
    let (start_ms, task) = {
        let (_, first, _) = items.first()?;
        (first.start_ms, first.task.clone())
    };
    let meta = slot_meta_version(sh, &task).filter(|(_, m, _)| m.keyed);
    let over = |m: &FastMeta| start_ms + m.slice_ms as i64 <= sh.now_us() / 1_000;
    let (slot, m, version) = match meta {
        Some((slot, m, version)) if !over(&m) => (slot, m, version),
        _ => {
            release(sh, items);
            return None;
        }
    };
    // Another process of the host may have refilled an entry meanwhile.
    let mut todo = Vec::with_capacity(items.len());
    for (i, w, token) in items {
        match table.entry(i) {
            Some(e) if low(e, &w, m.slice_ms) => {
                let want = chunk(
                    e.grant.load(Ordering::Relaxed),
                    start_ms,
                    m.slice_ms,
                    e.cap.load(Ordering::Relaxed),
                    w.n,
                );
                let digest = crate::protocol::key_digest(&w.key);
                todo.push((i, w, token, want, digest));
            }
            _ => unlock(sh, table, i, token),
        }
    }
    if todo.is_empty() {
        return None;
    }
    Some(Batch {
        sh,
        table,
        task,
        slot,
        m,
        version,
        start_ms,
        todo,
    })
}

/// One KPULL for wants of one task and slice (each holds its entry's pull lock, released here;
/// the wants are dropped at the end, which wakes their waiters).
async fn pull(sh: &Shared, items: Vec<Locked>) {
    if let Some(batch) = prepare(sh, items) {
        send(batch, &sh.request_id()).await;
    }
}

/// Sends `batch` under `request_id` on the client's shared connection (the pump's retry rule
/// and timeout) and applies the answer.
async fn send(batch: Batch<'_>, request_id: &str) {
    let sh = batch.sh;
    let wants = batch.wants();
    let req = batch.request(request_id, &wants);
    let before = crate::clock::host_us();
    // How long the batch's oldest want waited for this call (tracing only).
    let queued_us = if tracing::enabled!(tracing::Level::TRACE) {
        batch
            .todo
            .iter()
            .map(|t| t.1.since.elapsed().as_micros() as u64)
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    let res = call(sh, Retry::Idempotent, |mut c| {
        let req = req.clone();
        async move { scripts::key_pull_batch(&mut c, &sh.keys, &req).await }
    })
    .await;
    let after = crate::clock::host_us();
    tracing::trace!(task = %batch.task.name, keys = batch.todo.len(), rtt_us = after - before, queued_us, "key pull");
    drop(wants);
    apply(batch, res, before, after);
}

/// What [`pull_here`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Here {
    /// Pulled (or nothing was left to pull): the caller re-decides.
    Done,
    /// The caller's want was taken by another pull meanwhile: the caller waits for it.
    Taken,
    /// Sent but unanswered in time (or an error): handed to the background runtime, which
    /// sends it again under the same request id (KPULL answers a resend from its record: a
    /// grant is never taken twice nor lost) and judges Redis; the caller waits for its want.
    /// `fault`: the caller's connection is to blame (an error, or no answer within the whole
    /// half pull timeout), not a budget the decision's own deadline cut short.
    Handed { fault: bool },
    /// Redis answered something other than grants (a stale spec, outside the window, no task
    /// slice): applied, and the caller goes on through the pump (which paces its retries).
    Pump,
}

/// Sends, from the caller's task over `conn` (a connection of the caller's runtime, see
/// [`crate::refill::caller`]), one KPULL for the caller's want of entry `entry` (identity
/// `ident`) and every other want of the same task and slice waiting in this process (at most
/// [`BATCH`]): the wants that came in while the caller yielded once ride along, so a burst of
/// cold keys costs one call, and an idle link sends at once (no batching wait). Bounded by
/// `deadline` and half the pull timeout; a call unanswered by then is finished by the
/// background runtime ([`Here::Handed`]), so a failure of the caller's connection never makes
/// the task FAILED by itself and nothing it took is lost. Only a caller's future dropped while
/// its call is in flight strands what the call took (at most one chunk per key of the batch;
/// the locks are released, [`Batch`]'s drop).
pub(crate) async fn pull_here(
    sh: &Arc<Shared>,
    conn: &mut redis::aio::MultiplexedConnection,
    entry: usize,
    ident: u64,
    deadline: Instant,
) -> Here {
    let Some(table) = sh.keyed.opened() else {
        sh.keyed.wake.notify_one();
        return Here::Pump;
    };
    let items: Vec<Locked> = {
        let mut map = sh.keyed.wants.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mine) = map.get(&entry).filter(|w| w.ident == ident) else {
            return Here::Taken;
        };
        let (task, start_ms) = (mine.task.clone(), mine.start_ms);
        let mut ids: Vec<usize> = vec![entry];
        ids.extend(
            map.iter()
                .filter(|(i, w)| {
                    **i != entry
                        && w.start_ms == start_ms
                        && w.task.name == task.name
                        && table.entry(**i).is_some_and(|e| !stale(sh, e, w))
                })
                .map(|(i, _)| *i)
                .take(BATCH - 1),
        );
        let now_ms = crate::clock::host_ms();
        let mut items = Vec::with_capacity(ids.len());
        // The caller's entry first: when its lock is busy (another pull of it is in flight,
        // from this process's pump or another process), nothing is taken and the caller
        // joins that pull; any other want whose lock is busy stays for the pump.
        for i in ids {
            let Some(e) = table.entry(i) else { continue };
            let lock = sh.seg.lock(&e.pull_lock);
            match crate::refill::try_lock(sh, lock, "key pull", now_ms) {
                Some(token) => match map.remove(&i) {
                    Some(w) => items.push((i, w, token)),
                    None => {
                        lock.unlock(token);
                    }
                },
                None if i == entry => break,
                None => {}
            }
        }
        items
    };
    if items.is_empty() {
        sh.keyed.wake.notify_one();
        return Here::Taken;
    }
    let Some(batch) = prepare(sh, items) else {
        return Here::Done;
    };
    let wants = batch.wants();
    let request_id = sh.request_id();
    let req = batch.request(&request_id, &wants);
    let before = crate::clock::host_us();
    sh.redis_calls.fetch_add(1, Ordering::Relaxed);
    sh.keyed.caller_sent.fetch_add(1, Ordering::Relaxed);
    let half = sh.cfg.pull_timeout / 2;
    let budget = half.min(deadline.saturating_duration_since(Instant::now()));
    let res = tokio::time::timeout(budget, scripts::key_pull_batch(conn, &sh.keys, &req)).await;
    let after = crate::clock::host_us();
    tracing::trace!(task = %batch.task.name, keys = batch.todo.len(), rtt_us = after - before, "key pull from the caller");
    drop(wants);
    match res {
        Ok(Ok(reply)) => {
            let granted = matches!(reply, KeyPullBatchReply::Granted { .. });
            apply(batch, Ok(Ok(reply)), before, after);
            if granted { Here::Done } else { Here::Pump }
        }
        _ => {
            let fault = res.is_ok() || budget >= half;
            let parts = batch.into_parts();
            let flight = Flight::new(sh);
            sh.rt.spawn(async move {
                resend(&flight.0, parts, request_id).await;
                drop(flight);
            });
            Here::Handed { fault }
        }
    }
}

/// Applies a KPULL's outcome to its batch's entries, then releases them.
fn apply(
    batch: Batch<'_>,
    res: Result<redis::RedisResult<KeyPullBatchReply>, ()>,
    before: i64,
    after: i64,
) {
    let Batch {
        sh,
        table,
        ref task,
        slot,
        m,
        start_ms,
        ref todo,
        ..
    } = batch;
    let failed = match res {
        Err(_) => Some(PullOutcome::Timeout),
        Ok(Err(err)) => {
            tracing::debug!(task = %task.name, error = %err, "key pull failed");
            Some(PullOutcome::Error)
        }
        Ok(Ok(KeyPullBatchReply::Granted {
            grants,
            redis_time_us,
        })) => {
            crate::plumbing::record_clock(sh, before, after, redis_time_us);
            // What each pull left in Redis, noted before its grant lands in the entry: a reader
            // of the entry's holdings that sees the grant then finds the note (the agent adds
            // the two for `limit_remaining`; the other order could count the grant twice). A
            // replayed answer's `rem` is the first attempt's, possibly older: not noted.
            let at = Instant::now();
            note_pulled(
                sh,
                todo.iter()
                    .zip(&grants)
                    .filter(|(_, g)| !g.replayed)
                    .map(|((i, w, ..), g)| {
                        (
                            *i,
                            Pulled {
                                ident: w.ident,
                                start_ms,
                                rem: g.remaining,
                                at,
                            },
                        )
                    }),
            );
            for ((i, w, _, want, ..), g) in todo.iter().zip(grants) {
                let Some(e) = table.entry(*i) else { continue };
                if e.ident.load(Ordering::Acquire) != w.ident {
                    // Reclaimed for another key while the pull was in flight (a pull slower
                    // than the idle bound): the grant is this key's, never the new one's.
                    tracing::debug!(task = %task.name, "key entry reclaimed during a pull; grant dropped");
                    continue;
                }
                e.cap.store(g.cap, Ordering::Relaxed);
                record_grant(e, start_ms, *want);
                let exhausted = g.remaining <= 0;
                if g.granted > 0 || exhausted {
                    deposit(e, start_ms, m.slice_ms, g.granted, exhausted, sh.now_us());
                }
            }
            None
        }
        Ok(Ok(KeyPullBatchReply::OutsideWindow { redis_time_us })) => {
            crate::plumbing::record_clock(sh, before, after, redis_time_us);
            if redis_time_us / 1_000 > start_ms + m.slice_ms as i64 {
                for (i, w, ..) in todo {
                    if let Some(e) = table.entry(*i)
                        && e.ident.load(Ordering::Acquire) == w.ident
                    {
                        deposit(e, start_ms, m.slice_ms, 0, true, sh.now_us());
                    }
                }
            }
            None
        }
        Ok(Ok(KeyPullBatchReply::StaleMeta { .. })) => {
            // Re-read the meta at once; the waiters re-decide (and want again).
            slot.meta.refreshed_ms.store(0, Ordering::Relaxed);
            sh.wake.notify_one();
            None
        }
        Ok(Ok(KeyPullBatchReply::Missing { redis_time_us })) => {
            // No task slice to create the key slices from (the leader gone past the horizon,
            // the task deleted or no longer keyed): FAILED, as a PULL that finds none; the
            // waiters re-decide by `on_failure` and the task's probe brings it back.
            crate::plumbing::record_clock(sh, before, after, redis_time_us);
            Some(PullOutcome::Missing)
        }
    };
    if let Some(outcome) = failed {
        pull_failed(sh, task, slot, outcome);
    }
    drop(batch);
}

/// Remembers what a pull answered of its keys' slices in Redis ([`crate::Key::pulled_rem`]).
/// Bounded by [`MAX_PULLED`]: when full, notes older than a second (useless: readers take
/// them for 250 ms) go first, and the whole map only if that is not enough.
fn note_pulled(sh: &Shared, pulled: impl Iterator<Item = (usize, Pulled)>) {
    let mut map = sh.keyed.pulled.lock().unwrap_or_else(|e| e.into_inner());
    for (i, p) in pulled {
        if map.len() >= MAX_PULLED && !map.contains_key(&i) {
            map.retain(|_, q| q.at.elapsed() < Duration::from_secs(1));
            if map.len() >= MAX_PULLED {
                map.clear();
            }
        }
        map.insert(i, p);
    }
}

/// A key pull failed with `outcome`: the task's state machine decides (FAILED, next probe).
pub(crate) fn pull_failed(sh: &Shared, task: &TaskInner, slot: &Slot, outcome: PullOutcome) {
    let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
    let tr = sh.machine.after_pull(health, outcome, sh.now_us() / 1_000);
    if tr.health != health || tr.next_probe_ms.is_some() {
        crate::plumbing::apply_health(task, slot, health, tr.health, tr.next_probe_ms);
    }
}

/// Host-wide, every second: key counters into the task's counters (charged to the current
/// slice) and the busiest keys into `NS:{T}:top:<minute>` / `topr:<minute>`.
async fn report(sh: &Shared, table: &KeyTable) {
    let h = sh.seg.header();
    let now_ms = crate::clock::host_ms();
    let last = h.key_report_ms.load(Ordering::Acquire);
    if now_ms - last < REPORT_MS
        || h.key_report_ms
            .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    // slot index → (adm, rej, [(key, adm, rej)])
    type PerTask = (u64, u64, Vec<(String, u64, u64)>);
    let mut per: HashMap<usize, PerTask> = HashMap::new();
    let seg_id = sh.seg.id();
    // Only the buckets decided in since the last report (the table may hold millions of
    // entries): their marks are cleared before their counters are read (a decision counts,
    // then marks), so nothing counted is missed, at worst reported a second later.
    for i in table
        .take_touched()
        .into_iter()
        .flat_map(|b| b..b + crate::keytable::WAYS)
    {
        let Some(e) = table.entry(i) else { break };
        let id = e.ident.load(Ordering::Acquire);
        if id != 0 && id & OWNED != 0 && e.segment.load(Ordering::Acquire) != seg_id {
            // Another segment's (its processes report it): keep the mark for them.
            if e.adm.load(Ordering::Relaxed) != 0 || e.rej.load(Ordering::Relaxed) != 0 {
                table.touch(i);
            }
            continue;
        }
        if id == 0 || id & OWNED == 0 || !owner_alive(&sh.seg, e, id) {
            // Free, being claimed, or of a task slot that was reclaimed since (its counts
            // belong to no task here).
            continue;
        }
        let a = e.adm.swap(0, Ordering::AcqRel);
        let r = e.rej.swap(0, Ordering::AcqRel);
        if a == 0 && r == 0 {
            continue;
        }
        let slot = ((id >> 48) & 0x7FFF) as usize;
        let p = per.entry(slot).or_default();
        p.0 = p.0.saturating_add(a);
        p.1 = p.1.saturating_add(r);
        if let Some(k) = e.key_string() {
            p.2.push((k, a, r));
        }
    }
    let minute = now_ms - now_ms.rem_euclid(60_000);
    for (slot_i, (a, r, mut keys)) in per {
        let Some(slot) = sh.seg.slot(slot_i) else {
            continue;
        };
        let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
            continue;
        };
        let Some(name) = slot.name() else { continue };
        let now = sh.now_us() / 1_000;
        let start = now - now.rem_euclid(m.slice_ms as i64);
        slot.count(start, m.slice_ms, field::ADMITTED, a);
        slot.count(start, m.slice_ms, field::REJECTED, r);
        let labels = labels_of(sh, &name, slot.meta.version.load(Ordering::Relaxed)).await;
        for k in &mut keys {
            k.0 = labels.label(&k.0);
        }
        let mut pipe = redis::pipe();
        let ka = sh.keys.top_keys(&name, minute);
        let kr = sh.keys.top_rejected_keys(&name, minute);
        keys.sort_by_key(|x| std::cmp::Reverse(x.1));
        for (k, a, _) in keys.iter().take(TOP_KEYS).filter(|x| x.1 > 0) {
            pipe.zincr(&ka, k, *a).ignore();
        }
        keys.sort_by_key(|x| std::cmp::Reverse(x.2));
        for (k, _, r) in keys.iter().take(TOP_KEYS).filter(|x| x.2 > 0) {
            pipe.zincr(&kr, k, *r).ignore();
        }
        pipe.pexpire(&ka, 600_000).ignore();
        pipe.pexpire(&kr, 600_000).ignore();
        let _ = call(sh, Retry::OnlyUnsent, |mut c| {
            let pipe = pipe.clone();
            async move { pipe.query_async::<()>(&mut c).await }
        })
        .await;
    }
}

/// The Redis call of a key decision when the key table has no entry for the key: one
/// all-or-nothing KPULL of exactly `n` (nothing cached), as a future the caller runs.
pub(crate) async fn direct(
    sh: Arc<Shared>,
    task: Arc<TaskInner>,
    key: Arc<str>,
    m: FastMeta,
    start_ms: i64,
    n: u64,
) -> Option<KeyPullReply> {
    let digest = crate::protocol::key_digest(&key);
    let request_id = sh.request_id();
    // The version of the meta `m` was decided under, or 0 (never newer: a newer version with
    // `m`'s older slice length could make a key quota hash of the wrong length).
    let version = slot_meta_version(&sh, &task)
        .filter(|(_, now, _)| *now == m)
        .map_or(0, |(_, _, v)| v);
    let req = KeyPullRequest {
        task: &task.name,
        digest: &digest,
        start_ms,
        slice_ms: m.slice_ms,
        want: n,
        host_id: &sh.cfg.host_id,
        request_id: &request_id,
        meta_version: version,
        all_or_nothing: true,
    };
    let shr = &*sh;
    match call(shr, Retry::Idempotent, |mut c| {
        let req = req.clone();
        async move { scripts::key_pull(&mut c, &shr.keys, &req).await }
    })
    .await
    {
        Ok(Ok(r)) => Some(r),
        _ => None,
    }
}
