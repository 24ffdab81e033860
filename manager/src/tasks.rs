//! Task specs in etcd (`/NS/tasks/<T>`): reads and writes for the API, and a watched snapshot
//! for the leader.
//!
//! The API reads and writes etcd directly, so a write through one replica is visible through
//! every other at once. The watcher keeps an immutable [`TaskSnapshot`] (swapped whole on every
//! change) for the rolling loop; a broken watch resumes from the last revision it saw, and a
//! compacted one reloads everything.
//!
//! Everything read from etcd goes through the API's validation ([`crate::spec::parse_request`]):
//! a spec written into etcd by hand that would not pass `PUT` is kept as an [`InvalidTask`]
//! (neither rolled nor retired: its slices already written keep serving until the horizon),
//! logged once per version and alerted by the leader (`invalid_spec`).
//!
//! Specs are read in key order, in ranges of at most [`RANGE_BATCH`] keys, every range of one
//! read at the revision of its first ([`TaskStore::page`]): one consistent view however many
//! requests it takes, each response bounded by its count of keys (one read of every spec, with
//! the gRPC client's default 4 MiB limit, failed from a few thousand specs on). etcd keys sort
//! bytewise, as task names do, so a range of keys is a range of names:
//!
//! ```text
//!  /NS/tasks/<prefix>            first key a prefix can match
//!  /NS/tasks/<after>\0           first key strictly after the cursor `after`
//!  /NS/tasks/<prefix + 1>        end of the prefix (its last byte incremented)
//!
//!  read [max(first of prefix, first after cursor), end of prefix), RANGE_BATCH keys a request
//! ```

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use sluice_protocol::{Keys, Mode};
use tokio::sync::watch;
use tokio::time::sleep;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::election::ETCD_TIMEOUT;
use crate::error::{Error, Result, etcd};
use crate::schedule::CompiledSchedule;
use crate::spec::{TaskSpec, parse_stored};

/// One task as stored.
#[derive(Debug, Clone)]
pub struct TaskEntry {
    /// Name.
    pub name: String,
    /// Spec.
    pub spec: TaskSpec,
    /// Version: the etcd mod revision of the spec.
    pub version: i64,
    /// Incarnation: the etcd create revision of the spec. A task deleted and created again
    /// under the same name is another incarnation; state kept for one (the dynamic
    /// controller's) is never applied to another.
    pub created: i64,
    /// The spec's schedules, compiled.
    pub schedule: Arc<CompiledSchedule>,
}

/// A stored spec that does not pass validation (written into etcd by hand, or by another
/// version): kept, reported, never rolled nor retired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTask {
    /// Name.
    pub name: String,
    /// Version (etcd mod revision).
    pub version: i64,
    /// What is wrong.
    pub error: String,
    /// The field at fault (`""` for the whole document).
    pub field: String,
}

/// One stored task: valid, or kept as invalid.
#[derive(Debug, Clone)]
pub enum Stored {
    /// A valid spec.
    Valid(TaskEntry),
    /// A spec that fails validation.
    Invalid(InvalidTask),
}

impl TaskEntry {
    /// Decodes a stored spec through the API's validation.
    pub fn decode(
        name: &str,
        value: &[u8],
        version: i64,
        created: i64,
    ) -> std::result::Result<Self, InvalidTask> {
        let spec = parse_stored(name, value).map_err(|e| InvalidTask {
            name: name.to_string(),
            version,
            error: e.error,
            field: e.field,
        })?;
        Ok(Self {
            name: name.to_string(),
            schedule: Arc::new(CompiledSchedule::new(&spec.schedules)),
            spec,
            version,
            created,
        })
    }
}

impl Stored {
    fn decode(name: &str, kv: &etcd_client::KeyValue) -> Self {
        match TaskEntry::decode(name, kv.value(), kv.mod_revision(), kv.create_revision()) {
            Ok(t) => Self::Valid(t),
            Err(e) => Self::Invalid(e),
        }
    }
}

/// How often at most the task watch publishes a new snapshot while changes keep coming.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// All tasks at one etcd revision.
#[derive(Debug, Clone, Default)]
pub struct TaskSnapshot {
    /// Valid tasks by name.
    pub tasks: BTreeMap<String, Arc<TaskEntry>>,
    /// Stored specs that fail validation, by name (disjoint from `tasks`).
    pub invalid: BTreeMap<String, Arc<InvalidTask>>,
    /// The etcd revision this snapshot reflects.
    pub revision: i64,
    /// False until the first full load succeeded.
    pub loaded: bool,
}

impl TaskSnapshot {
    /// Whether a spec of this name is stored (valid or not).
    pub fn contains(&self, name: &str) -> bool {
        self.tasks.contains_key(name) || self.invalid.contains_key(name)
    }

    fn insert(&mut self, name: &str, stored: Stored) {
        match stored {
            Stored::Valid(t) => {
                self.invalid.remove(name);
                self.tasks.insert(name.to_string(), Arc::new(t));
            }
            Stored::Invalid(e) => {
                warn!(
                    task = name,
                    version = e.version,
                    field = e.field,
                    error = e.error,
                    "stored task spec is invalid: not rolled, not retired (fix or delete it)"
                );
                self.tasks.remove(name);
                self.invalid.insert(name.to_string(), Arc::new(e));
            }
        }
    }

    fn remove(&mut self, name: &str) -> bool {
        let a = self.tasks.remove(name).is_some();
        let b = self.invalid.remove(name).is_some();
        a || b
    }
}

/// Most keys one etcd range request of task specs asks for. Requests, not bytes, are what a
/// read costs: 10,000 small specs took 0.48 s in ranges of 128 and 0.10 s in ranges of 1,024
/// (a debug build on 2 cores); a page of up to 1,000 (and the one after it) is one request.
pub const RANGE_BATCH: i64 = 1024;

/// The gRPC decoding limit of range reads: whatever etcd sends (its gRPC send limit is
/// 2^31 − 1 bytes). A range is bounded by its count of keys, and what those hold by what etcd
/// stores (2 GiB by default); tonic's default (4 MiB) refused a range of a few thousand
/// specs, or of a few keyed tasks with 1,000 overrides each.
const RANGE_RESPONSE_MAX_BYTES: usize = i32::MAX as usize;

/// Most stored specs one page examines ([`TaskStore::page`] with a limit): a page filtered by
/// mode or keyed whose matches are rare stops here, short of its limit (even empty), with a
/// cursor to go on from.
pub const PAGE_SCAN_BUDGET: usize = 10_000;

/// Which tasks a listing wants, and where it starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFilter {
    /// Only names starting with this (`""`: every name).
    pub prefix: String,
    /// Only names sorted (bytewise) strictly after this: the cursor of a page.
    pub after: Option<String>,
    /// Only valid specs of this mode.
    pub mode: Option<Mode>,
    /// Only valid specs that are keyed (`true`) or not (`false`).
    pub keyed: Option<bool>,
}

impl TaskFilter {
    /// Whether a stored spec is listed. A spec that fails validation has no mode nor keyed to
    /// filter on: it is listed only when neither is asked for.
    pub fn admits(&self, stored: &Stored) -> bool {
        match stored {
            Stored::Valid(t) => {
                self.mode.is_none_or(|m| t.spec.mode == m)
                    && self.keyed.is_none_or(|k| t.spec.keyed == k)
            }
            Stored::Invalid(_) => self.mode.is_none() && self.keyed.is_none(),
        }
    }

    /// Whether a stored spec may be listed, judged from its `mode` and `keyed` fields alone
    /// (read without validating the rest: a fraction of a full decode, which a filter that
    /// skips most specs would otherwise pay for each). False only when it cannot be: a valid
    /// spec has those values, and an invalid one is left out by either filter. A spec whose
    /// two fields cannot be read so is decoded in full.
    fn may_admit(&self, value: &[u8]) -> bool {
        /// The fields filtered on; absent or null = the spec's defaults.
        #[derive(serde::Deserialize)]
        struct Peek {
            #[serde(default)]
            mode: Option<Mode>,
            #[serde(default)]
            keyed: Option<bool>,
        }
        if self.mode.is_none() && self.keyed.is_none() {
            return true;
        }
        match serde_json::from_slice::<Peek>(value) {
            Ok(p) => {
                self.mode
                    .is_none_or(|m| p.mode.unwrap_or(Mode::Pooled) == m)
                    && self.keyed.is_none_or(|k| p.keyed.unwrap_or(false) == k)
            }
            Err(_) => true,
        }
    }

    /// The etcd keys `[start, end)` that can hold the names this filter wants; None when no key
    /// can (the cursor is past the prefix).
    fn key_range(&self, keys: &Keys) -> Option<(Vec<u8>, Vec<u8>)> {
        let first = keys.etcd_task(&self.prefix).into_bytes();
        let end = prefix_end(&first);
        let start = match &self.after {
            Some(after) => {
                let mut past = keys.etcd_task(after).into_bytes();
                past.push(0);
                past.max(first)
            }
            None => first,
        };
        (start < end).then_some((start, end))
    }
}

/// The first key after every key that starts with `prefix` (etcd's "range end of a prefix").
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every byte 0xff (or empty): to the end of the keyspace
}

/// One page of a listing, in name order.
#[derive(Debug, Clone, Default)]
pub struct TaskPage {
    /// The valid specs.
    pub tasks: Vec<TaskEntry>,
    /// The stored specs that fail validation.
    pub invalid: Vec<InvalidTask>,
    /// Where the next page starts (its `after`): None when no stored spec after this page
    /// matches; otherwise more may.
    pub next: Option<String>,
}

/// The last name a page lists (its two lists are each in name order).
fn last_listed(page: &TaskPage) -> Option<String> {
    let valid = page.tasks.last().map(|t| t.name.as_str());
    let invalid = page.invalid.last().map(|t| t.name.as_str());
    valid.max(invalid).map(str::to_string)
}

/// Result of a conditional write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored as a new task, at this version.
    Created(i64),
    /// Replaced an existing task, new version.
    Replaced(i64),
    /// The stored version differs from the expected one.
    Conflict {
        /// The stored version (0 = the task does not exist).
        current: i64,
    },
}

/// Writes `value` at `key` only if the key's mod revision is still `expected` (0 = the key must
/// not exist), in one transaction: `Ok(new revision)`, or `Err(current revision)` (0 = absent)
/// when someone else wrote first. Used for every optimistic-concurrency write (tasks, settings).
pub async fn put_if_version(
    client: &Client,
    op: &'static str,
    key: &str,
    value: Vec<u8>,
    expected: i64,
) -> Result<std::result::Result<i64, i64>> {
    let txn = Txn::new()
        .when([Compare::mod_revision(key, CompareOp::Equal, expected)])
        .and_then([TxnOp::put(key, value, None)])
        .or_else([TxnOp::get(key, None)]);
    let mut c = client.clone();
    let resp = etcd(op, ETCD_TIMEOUT, c.txn(txn)).await?;
    if resp.succeeded() {
        return Ok(Ok(resp.header().map_or(0, |h| h.revision())));
    }
    let current = resp
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => {
                Some(g.kvs().first().map_or(0, |kv| kv.mod_revision()))
            }
            _ => None,
        })
        .unwrap_or(0);
    Ok(Err(current))
}

/// Access to task specs in etcd.
#[derive(Clone)]
pub struct TaskStore {
    client: Client,
    keys: Keys,
    snapshot: watch::Sender<Arc<TaskSnapshot>>,
    /// True while the snapshot is loaded and a watch stream is open (for `/readyz`).
    watching: Arc<std::sync::atomic::AtomicBool>,
}

impl TaskStore {
    /// A store; call [`TaskStore::run_watch`] to keep the snapshot current.
    pub fn new(client: Client, keys: Keys) -> Self {
        let (snapshot, _) = watch::channel(Arc::new(TaskSnapshot::default()));
        Self {
            client,
            keys,
            snapshot,
            watching: Arc::default(),
        }
    }

    /// Whether the task watch is in sync: tasks loaded and a watch stream open.
    pub fn watch_synced(&self) -> bool {
        self.watching.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set_watching(&self, on: bool) {
        self.watching
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The latest snapshot (changes are announced on [`TaskStore::subscribe`]).
    pub fn snapshot(&self) -> Arc<TaskSnapshot> {
        self.snapshot.borrow().clone()
    }

    /// A receiver of new snapshots.
    pub fn subscribe(&self) -> watch::Receiver<Arc<TaskSnapshot>> {
        self.snapshot.subscribe()
    }

    fn name_of<'a>(&self, key: &'a [u8]) -> Option<&'a str> {
        let key = std::str::from_utf8(key).ok()?;
        // An empty name (a key of the prefix alone, written by hand) is no task.
        key.strip_prefix(self.keys.etcd_tasks_prefix().as_str())
            .filter(|n| !n.is_empty())
    }

    /// The stored specs `filter` admits, in name order, read from etcd now (one consistent
    /// view). With `limit`, at most that many (valid and invalid together) and a cursor to the
    /// next page: the page ends after `limit` entries, or when [`PAGE_SCAN_BUDGET`] specs were
    /// examined (a filter by mode or keyed skips specs), or at the end of the range. Without
    /// `limit`, every match.
    pub async fn page(&self, filter: &TaskFilter, limit: Option<NonZeroUsize>) -> Result<TaskPage> {
        let limit = limit.map(NonZeroUsize::get);
        let mut page = TaskPage::default();
        let Some(range) = filter.key_range(&self.keys) else {
            return Ok(page);
        };
        // Without a filter on the specs, a page needs its entries and one more.
        let first = match limit {
            Some(l) if filter.mode.is_none() && filter.keyed.is_none() => l as i64 + 1,
            _ => RANGE_BATCH,
        };
        let (mut listed, mut examined) = (0usize, 0usize);
        let mut last_examined: Option<String> = None;
        self.scan("list tasks", range, first, |kv| {
            let Some(name) = self.name_of(kv.key()) else {
                return ControlFlow::Continue(());
            };
            if limit.is_some() {
                if examined == PAGE_SCAN_BUDGET {
                    // Everything up to the last spec examined is answered.
                    page.next = last_examined.take();
                    return ControlFlow::Break(());
                }
                examined += 1;
            }
            if !filter.may_admit(kv.value()) {
                last_examined = Some(name.to_string());
                return ControlFlow::Continue(());
            }
            let stored = Stored::decode(name, kv);
            if filter.admits(&stored) {
                if limit == Some(listed) {
                    // One more match: the page is full and another one follows it.
                    page.next = last_listed(&page);
                    return ControlFlow::Break(());
                }
                listed += 1;
                match stored {
                    Stored::Valid(t) => page.tasks.push(t),
                    Stored::Invalid(e) => page.invalid.push(e),
                }
            }
            last_examined = Some(name.to_string());
            ControlFlow::Continue(())
        })
        .await?;
        Ok(page)
    }

    /// Reads the keys of `[start, end)` in key order, `first` keys in the first request and
    /// [`RANGE_BATCH`] in each after it, every request at the revision of the first; `visit`
    /// sees each key until it breaks. Returns the revision read at (a compaction past it
    /// between two requests fails the read).
    async fn scan(
        &self,
        op: &'static str,
        (start, end): (Vec<u8>, Vec<u8>),
        first: i64,
        mut visit: impl FnMut(&KeyValue) -> ControlFlow<()>,
    ) -> Result<i64> {
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(RANGE_RESPONSE_MAX_BYTES);
        let (mut from, mut revision, mut batch) = (start, 0, first.clamp(1, RANGE_BATCH));
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(batch);
            batch = RANGE_BATCH;
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let resp = etcd(op, ETCD_TIMEOUT, kv.get(from, Some(opts))).await?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                if visit(kv).is_break() {
                    return Ok(revision);
                }
            }
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(revision),
            }
        }
    }

    /// The etcd revision now (one cheap request; used to tell numbers of another etcd history
    /// from numbers of this one).
    pub async fn current_revision(&self) -> Result<i64> {
        let mut c = self.client.clone();
        let resp = etcd(
            "current revision",
            ETCD_TIMEOUT,
            c.get(
                self.keys.etcd_tasks_prefix(),
                Some(GetOptions::new().with_count_only()),
            ),
        )
        .await?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    /// One task, read from etcd now.
    pub async fn get(&self, name: &str) -> Result<Option<Stored>> {
        let mut c = self.client.clone();
        let resp = etcd(
            "get task",
            ETCD_TIMEOUT,
            c.get(self.keys.etcd_task(name), None),
        )
        .await?;
        Ok(resp.kvs().first().map(|kv| Stored::decode(name, kv)))
    }

    /// Stores `spec`. With `expected = Some(v)` the write happens only if the stored version is
    /// `v` (0 = the task must not exist): no lost updates.
    pub async fn put(
        &self,
        name: &str,
        spec: &TaskSpec,
        expected: Option<i64>,
    ) -> Result<PutOutcome> {
        let key = self.keys.etcd_task(name);
        let value = serde_json::to_vec(spec).map_err(|e| Error::Corrupt {
            what: "spec".into(),
            why: e.to_string(),
        })?;
        let mut c = self.client.clone();
        match expected {
            None => {
                let resp = etcd(
                    "put task",
                    ETCD_TIMEOUT,
                    c.put(key, value, Some(PutOptions::new().with_prev_key())),
                )
                .await?;
                let rev = resp.header().map_or(0, |h| h.revision());
                Ok(if resp.prev_key().is_some() {
                    PutOutcome::Replaced(rev)
                } else {
                    PutOutcome::Created(rev)
                })
            }
            Some(v) => Ok(
                match put_if_version(&self.client, "put task (conditional)", &key, value, v).await?
                {
                    Ok(rev) if v == 0 => PutOutcome::Created(rev),
                    Ok(rev) => PutOutcome::Replaced(rev),
                    Err(current) => PutOutcome::Conflict { current },
                },
            ),
        }
    }

    /// Deletes a task; returns the etcd revision of the deletion and etcd's cluster id (the
    /// epoch), or None if it did not exist.
    pub async fn delete(&self, name: &str) -> Result<Option<(i64, u64)>> {
        let mut c = self.client.clone();
        let resp = etcd(
            "delete task",
            ETCD_TIMEOUT,
            c.delete(self.keys.etcd_task(name), None),
        )
        .await?;
        Ok((resp.deleted() > 0).then(|| {
            resp.header()
                .map_or((0, 0), |h| (h.revision(), h.cluster_id()))
        }))
    }

    async fn load(&self) -> Result<TaskSnapshot> {
        let mut snap = TaskSnapshot {
            loaded: true,
            ..Default::default()
        };
        let first = self.keys.etcd_tasks_prefix().into_bytes();
        let end = prefix_end(&first);
        snap.revision = self
            .scan("load tasks", (first, end), RANGE_BATCH, |kv| {
                if let Some(name) = self.name_of(kv.key()) {
                    snap.insert(name, Stored::decode(name, kv));
                }
                ControlFlow::Continue(())
            })
            .await?;
        Ok(snap)
    }

    /// Keeps the snapshot current until `shutdown`: a full load, then a watch from the next
    /// revision, resumed from the last seen revision whenever it breaks.
    pub async fn run_watch(self, shutdown: CancellationToken) {
        let prefix = self.keys.etcd_tasks_prefix();
        let mut snap: Option<TaskSnapshot> = None;
        let mut backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let mut current = match snap.take() {
                Some(s) => s,
                None => match self.load().await {
                    Ok(s) => {
                        info!(
                            tasks = s.tasks.len(),
                            invalid = s.invalid.len(),
                            revision = s.revision,
                            "tasks loaded"
                        );
                        self.snapshot.send_replace(Arc::new(s.clone()));
                        s
                    }
                    Err(e) => {
                        warn!(%e, "cannot load tasks; retrying");
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                        continue;
                    }
                },
            };
            let c = self.client.clone();
            let opts = WatchOptions::new()
                .with_prefix()
                .with_start_revision(current.revision + 1)
                .with_progress_notify();
            let mut stream = match etcd(
                "watch tasks",
                ETCD_TIMEOUT,
                // As large as a range read may be: a watch catching up sends up to 1,000
                // revisions in one message.
                c.watch_client()
                    .max_decoding_message_size(RANGE_RESPONSE_MAX_BYTES)
                    .watch(prefix.as_str(), Some(opts)),
            )
            .await
            {
                Ok(s) => s,
                Err(e) => {
                    warn!(%e, "cannot watch tasks; retrying");
                    snap = Some(current);
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            self.set_watching(true);
            // Changes are published at once, but at most every PUBLISH_EVERY while they keep
            // coming: each publication copies the task map (100,000 tasks created at 500 a
            // second copied it 500 times a second, starving the runtime until etcd calls timed
            // out), and wakes every leader loop.
            let mut last_pub = tokio::time::Instant::now() - PUBLISH_EVERY;
            let mut dirty = false;
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep_until(last_pub + PUBLISH_EVERY), if dirty => {
                        self.snapshot.send_replace(Arc::new(current.clone()));
                        last_pub = tokio::time::Instant::now();
                        dirty = false;
                        continue;
                    }
                    m = stream.message() => m,
                };
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        warn!(revision = current.revision, "task watch closed; resuming");
                        if dirty {
                            self.snapshot.send_replace(Arc::new(current.clone()));
                        }
                        snap = Some(current);
                        break;
                    }
                    Err(e) => {
                        warn!(%e, revision = current.revision, "task watch broke; resuming");
                        if dirty {
                            self.snapshot.send_replace(Arc::new(current.clone()));
                        }
                        snap = Some(current);
                        break;
                    }
                };
                if resp.compact_revision() > 0 || resp.canceled() {
                    warn!(
                        compact = resp.compact_revision(),
                        reason = resp.cancel_reason(),
                        "task watch cancelled (history compacted?); reloading"
                    );
                    // What was applied is published (the reload may fail for a while).
                    if dirty {
                        self.snapshot.send_replace(Arc::new(current.clone()));
                    }
                    break; // snap stays None: full reload
                }
                let mut changed = false;
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let Some(name) = self.name_of(kv.key()) else {
                        continue;
                    };
                    current.revision = current.revision.max(kv.mod_revision());
                    match ev.event_type() {
                        EventType::Put => {
                            debug!(task = name, version = kv.mod_revision(), "task changed");
                            current.insert(name, Stored::decode(name, kv));
                            changed = true;
                        }
                        EventType::Delete => {
                            debug!(task = name, "task deleted");
                            changed |= current.remove(name);
                        }
                    }
                }
                // A progress notification (no events) promises everything up to its header's
                // revision was delivered; event responses only vouch for their events.
                // Not the response that says the watch was created: its header carries the
                // store's revision now, before the catch-up events from the load's revision have
                // come (resuming from it after a break would skip them: the review's finding).
                if resp.events().is_empty()
                    && !resp.created()
                    && let Some(h) = resp.header()
                {
                    current.revision = current.revision.max(h.revision());
                }
                if changed {
                    if last_pub.elapsed() >= PUBLISH_EVERY {
                        self.snapshot.send_replace(Arc::new(current.clone()));
                        last_pub = tokio::time::Instant::now();
                        dirty = false;
                    } else {
                        dirty = true;
                    }
                }
            }
            self.set_watching(false);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = sleep(backoff) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(prefix: &str, after: Option<&str>) -> Option<(String, String)> {
        let f = TaskFilter {
            prefix: prefix.into(),
            after: after.map(str::to_string),
            ..Default::default()
        };
        let keys = Keys::new("ns").unwrap();
        f.key_range(&keys)
            .map(|(a, b)| (String::from_utf8(a).unwrap(), String::from_utf8(b).unwrap()))
    }

    #[test]
    fn a_filter_reads_the_keys_of_its_names_only() {
        let r = |a: &str, b: &str| Some((a.to_string(), b.to_string()));
        // Every task: the prefix of the tasks' keys ('/' + 1 = '0').
        assert_eq!(range("", None), r("/ns/tasks/", "/ns/tasks0"));
        assert_eq!(range("chk", None), r("/ns/tasks/chk", "/ns/tasks/chl"));
        assert_eq!(range("a-", None), r("/ns/tasks/a-", "/ns/tasks/a."));
        // The cursor: strictly after it, within the prefix.
        assert_eq!(range("", Some("b")), r("/ns/tasks/b\0", "/ns/tasks0"));
        assert_eq!(
            range("chk", Some("chk.1")),
            r("/ns/tasks/chk.1\0", "/ns/tasks/chl")
        );
        // A cursor before the prefix starts at the prefix; one past it reads nothing.
        assert_eq!(range("chk", Some("a")), r("/ns/tasks/chk", "/ns/tasks/chl"));
        assert_eq!(range("chk", Some("chl")), None);
        assert_eq!(range("chk", Some("z")), None);
        // The prefix itself as the cursor: the names that extend it.
        assert_eq!(
            range("chk", Some("chk")),
            r("/ns/tasks/chk\0", "/ns/tasks/chl")
        );
    }

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"ab"), b"ac");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    #[test]
    fn a_spec_that_fails_validation_has_no_mode_to_filter_on() {
        let valid = Stored::Valid(
            TaskEntry::decode("k", br#"{"threshold": 1, "keyed": true}"#, 2, 2).unwrap(),
        );
        let invalid = Stored::Invalid(TaskEntry::decode("x", b"{}", 3, 3).unwrap_err());
        let f = |mode: Option<Mode>, keyed: Option<bool>| TaskFilter {
            mode,
            keyed,
            ..Default::default()
        };
        assert!(f(None, None).admits(&valid) && f(None, None).admits(&invalid));
        assert!(f(Some(Mode::Pooled), Some(true)).admits(&valid));
        assert!(!f(Some(Mode::Pooled), None).admits(&invalid));
        assert!(!f(None, Some(false)).admits(&invalid));
        assert!(!f(None, Some(false)).admits(&valid));
        assert!(!f(Some(Mode::Local), None).admits(&valid));
    }

    #[test]
    fn the_peek_leaves_out_only_specs_that_cannot_be_listed() {
        let f = |mode: Option<Mode>, keyed: Option<bool>| TaskFilter {
            mode,
            keyed,
            ..Default::default()
        };
        let specs: &[&[u8]] = &[
            br#"{"threshold": 1}"#,
            br#"{"threshold": 1, "mode": null, "keyed": null}"#,
            br#"{"threshold": 1, "mode": "local"}"#,
            br#"{"threshold": 1, "mode": "pooled", "keyed": true}"#,
            br#"{"threshold": 1, "mode": "concurrency", "keyed": false}"#,
            br#"{"threshold": 1, "mode": "local", "keyed": true}"#,
            br#"{"threshold": 1, "mode": "fast"}"#,
            br#"{"threshold": 1, "keyed": "yes"}"#,
            br#"{"threshold": 1, "mode": "local", "mode": "pooled"}"#,
            br#"{"threshold": -1, "mode": "local"}"#,
            b"not json",
            b"[]",
        ];
        let mut filters = vec![f(None, None)];
        for m in Mode::ALL {
            let m: Mode = m.parse().unwrap();
            for k in [None, Some(true), Some(false)] {
                filters.push(f(Some(m), k));
            }
        }
        filters.push(f(None, Some(true)));
        filters.push(f(None, Some(false)));
        for value in specs {
            let stored = match TaskEntry::decode("t", value, 1, 1) {
                Ok(t) => Stored::Valid(t),
                Err(e) => Stored::Invalid(e),
            };
            for filter in &filters {
                if filter.admits(&stored) {
                    assert!(
                        filter.may_admit(value),
                        "{filter:?} admits {}",
                        String::from_utf8_lossy(value)
                    );
                }
            }
        }
        // It does leave out what cannot match.
        assert!(!f(Some(Mode::Pooled), None).may_admit(br#"{"mode": "local"}"#));
        assert!(!f(None, Some(true)).may_admit(br#"{"threshold": 1}"#));
        assert!(!f(Some(Mode::Local), None).may_admit(br#"{"threshold": 1}"#));
    }
}
