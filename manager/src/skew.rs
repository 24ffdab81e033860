//! Clock-skew detection (leader only).
//!
//! Hosts pick the slice to pull from by their own clock. When clocks agree, at any moment all
//! hosts consume from the current slice — around a boundary, from the current and the previous
//! one. A host whose clock is off by more than a fraction of a slice consumes from a slice the
//! others are not in, and steals quota from the future (or spends the past).
//!
//! **Key movement (the seed's rule).** Every poll (≤ slice/2, 500 ms for 1 s slices) the leader
//! reads the slices around its current one and counts those whose *consumption* (`cap − rem`,
//! so its own threshold changes don't count) changed since the previous poll. More than two at
//! once means hosts are spread over more slices than clock agreement allows: a `clock_skew`
//! alert for the task, with the slices that moved and their distance from the leader's current
//! slice. "At once" is measured honestly: when the time actually covered by two polls spans
//! more than two slices (100 ms slices, or a poll delayed on a loaded leader), the allowance
//! grows to the slices that time overlaps ([`allowed_moving`]).
//!
//! ```text
//!   slices:        c−2   c−1    c    c+1   c+2   c+3
//!   agreeing hosts        ●────●                        (at most two, at a boundary)
//!   host at +1.5 s                     ●                → three moved at once: skew
//! ```
//!
//! **Host attribution.** The SDK measures each host's offset to Redis `TIME` on its pulls and
//! reports it in `NS:hosts`. A host whose |offset| (minus the measurement's error bound,
//! rtt/2) exceeds `skew_threshold_ms` gets its own `clock_skew` alert, and a key-movement alert
//! names the hosts whose offsets explain it.
//!
//! Both kinds go to the alert loop ([`crate::alerts::run`]) as momentary observations: one
//! firing alert per episode and one resolved alert after a quiet period; open episodes live in
//! Redis, so a new leader continues them instead of alerting twice.
//!
//! **Hosts.** `NS:hosts` is read every [`HOSTS_READ_MS`] (the SDK reports every 10 s), every
//! second while a host alert is open, and at once for a new key-movement episode. Entries not seen for [`HOST_RETENTION_MS`] (by
//! Redis time, corrected by the host's offset), and unreadable ones, are pruned by a script
//! that re-checks each entry when it runs, so the hash does not grow with every host that
//! ever ran. The API and the dashboard show the hosts of this hash.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use sluice_protocol::conn::Redis;
use sluice_protocol::{HostReport, Keys, scripts, slice, unix_ms};
use tokio::sync::watch;
use tracing::{debug, info};

use crate::alerts::{AlertTx, Condition, Signal};
use crate::election::LeaderContext;
use crate::metrics::Metrics;
use crate::settings::Settings;
use crate::tasks::TaskStore;

/// Slices read around the leader's current one: `c − BEHIND ..= c + AHEAD`.
pub const BEHIND: i64 = 2;
/// See [`BEHIND`].
pub const AHEAD: i64 = 3;
/// More than this many slices moving at once is skew (the seed's rule) — when polls are a small
/// fraction of a slice apart. See [`allowed_moving`] for short slices and late polls.
pub const MAX_MOVING: usize = 2;
/// A task whose slices have not moved for this long is polled once a slice instead.
pub const IDLE_AFTER_MS: i64 = 2_000;
/// A task that neither moved nor showed any consumption in the slices read for this long is
/// dormant: polled every [`DORMANT_POLL_MS`] (issue 27: thousands of idle tasks cost a script
/// call each per second for nothing).
pub const DORMANT_AFTER_MS: i64 = 60_000;
/// How often a dormant task is polled. Its first poll after traffic resumes sees consumption
/// in the slices around the current one and ends the dormancy; movement is judged from the
/// next poll on (the first has nothing of the same slices to compare with), so skew on a task
/// that wakes is flagged at most this much plus a slice later than on a busy one.
pub const DORMANT_POLL_MS: i64 = 5_000;

/// How often at most the detector looks among the lazy tasks it parked for those woken.
const UNPARK_EVERY_MS: i64 = 1_000;
/// Host reports older than this are ignored.
pub const HOST_FRESH_MS: i64 = 60_000;
/// Host entries not seen for this long are pruned from `NS:hosts` (10 minutes).
pub const HOST_RETENTION_MS: i64 = 600_000;
/// How often the leader reads `NS:hosts` (every second while a host alert is open).
pub const HOSTS_READ_MS: i64 = 5_000;

/// One poll's reading of a slice: `(start, cap, rem)`, `None` when it does not exist.
pub type Reading = (i64, Option<(i64, i64)>);

/// How many slices hosts with agreeing clocks can move between two polls: every slice that
/// overlaps the time from the start of the previous poll to the end of this one, and at least
/// [`MAX_MOVING`]. With 1 s slices and polls up to 500 ms apart that is the seed's two; with 100 ms
/// slices, or a poll delayed on a loaded leader, it grows with the time actually covered.
///
/// ```
/// use sluice_manager::skew::allowed_moving;
/// assert_eq!(allowed_moving(10_100, 10_350, 1_000), 2);
/// assert_eq!(allowed_moving(10_050, 10_210, 100), 3); // slices 10000, 10100, 10200
/// ```
pub fn allowed_moving(prev_started_ms: i64, finished_ms: i64, slice_ms: u64) -> usize {
    let first = slice::start(prev_started_ms, slice_ms);
    let last = slice::start(finished_ms.max(prev_started_ms), slice_ms);
    (((last - first) / slice_ms.max(1) as i64) as usize + 1).max(MAX_MOVING)
}

/// What one poll found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Movement {
    /// Starts of the slices whose consumption changed since the previous poll.
    pub moved: Vec<i64>,
    /// How many may move with agreeing clocks ([`allowed_moving`]).
    pub allowed: usize,
}

impl Movement {
    /// More slices moved than agreeing clocks explain.
    pub fn is_skew(&self) -> bool {
        self.moved.len() > self.allowed
    }
}

/// What the detector remembers of one task between polls.
#[derive(Debug, Clone, Default)]
pub struct TaskWatch {
    consumed: BTreeMap<i64, i64>,
    prev_started_ms: Option<i64>,
    last_moved_ms: Option<i64>,
    /// Last poll that moved or found any slice consumed (or the first poll).
    last_busy_ms: Option<i64>,
}

impl TaskWatch {
    /// Feeds one poll, which started reading at `started_ms` and finished at `finished_ms`.
    ///
    /// ```
    /// use sluice_manager::skew::TaskWatch;
    /// let mut w = TaskWatch::default();
    /// let m = w.observe(&[(0, Some((100, 100))), (1000, Some((100, 100)))], 100, 105, 1000);
    /// assert!(m.moved.is_empty());
    /// // Consumption in slice 0; slice 1000's threshold raised by the leader: not movement.
    /// let m = w.observe(&[(0, Some((100, 90))), (1000, Some((150, 150)))], 350, 352, 1000);
    /// assert_eq!(m.moved, [0]);
    /// assert!(!m.is_skew());
    /// ```
    pub fn observe(
        &mut self,
        readings: &[Reading],
        started_ms: i64,
        finished_ms: i64,
        slice_ms: u64,
    ) -> Movement {
        let allowed = allowed_moving(
            self.prev_started_ms.unwrap_or(started_ms),
            finished_ms,
            slice_ms,
        );
        self.prev_started_ms = Some(started_ms);
        let moved = self.changed(readings);
        if !moved.is_empty() || self.last_moved_ms.is_none() {
            self.last_moved_ms = Some(finished_ms);
        }
        let consumed = readings
            .iter()
            .any(|(_, r)| r.is_some_and(|(cap, rem)| cap != rem));
        if consumed || !moved.is_empty() || self.last_busy_ms.is_none() {
            self.last_busy_ms = Some(finished_ms);
        }
        Movement { moved, allowed }
    }

    /// How long no slice of the task has moved, as of `now_ms`.
    pub fn idle_for(&self, now_ms: i64) -> i64 {
        self.last_moved_ms.map_or(0, |t| now_ms - t)
    }

    /// How long no poll found a slice of the task moved or consumed at all, as of `now_ms`.
    pub fn dormant_for(&self, now_ms: i64) -> i64 {
        self.last_busy_ms.map_or(0, |t| now_ms - t)
    }

    fn changed(&mut self, readings: &[Reading]) -> Vec<i64> {
        let mut moved = Vec::new();
        let mut next = BTreeMap::new();
        for (start, r) in readings {
            let Some((cap, rem)) = r else { continue };
            let consumed = cap - rem;
            if self.consumed.get(start).is_some_and(|c| *c != consumed) {
                moved.push(*start);
            }
            next.insert(*start, consumed);
        }
        self.consumed = next;
        moved
    }
}

/// Hosts whose offset exceeds the threshold beyond its error bound: `(host, offset_ms, rtt_ms)`.
pub fn skewed_hosts(
    hosts: &[(String, HostReport)],
    threshold_ms: u64,
    now_ms: i64,
) -> Vec<(String, f64, f64)> {
    hosts
        .iter()
        .filter(|(_, r)| now_ms.saturating_sub(r.seen_ms).saturating_abs() <= HOST_FRESH_MS)
        .filter(|(_, r)| r.offset_ms.abs() - r.rtt_ms / 2.0 > threshold_ms as f64)
        .map(|(h, r)| (h.clone(), r.offset_ms, r.rtt_ms))
        .collect()
}

/// Whether a host report read back from Redis is plausible: finite numbers, a round trip
/// within a minute, an offset within a day, and a `seen_ms` that is a Unix time in ms.
pub fn plausible(r: &HostReport) -> bool {
    r.offset_ms.is_finite()
        && r.offset_ms.abs() <= 86_400_000.0
        && r.rtt_ms.is_finite()
        && (0.0..=60_000.0).contains(&r.rtt_ms)
        && (0..=100_000_000_000_000).contains(&r.seen_ms)
}

/// `NS:hosts` as read: the plausible reports, and the ids of entries to prune — not seen for
/// [`HOST_RETENTION_MS`] (by the leader's clock, corrected by the host's reported offset), or
/// unreadable.
#[derive(Debug, Default)]
pub struct HostsRead {
    /// Plausible reports.
    pub reports: Vec<(String, HostReport)>,
    /// Entries to prune.
    pub stale: Vec<String>,
}

/// Splits the raw entries of `NS:hosts` (pure).
///
/// ```
/// use sluice_manager::skew::{split_hosts, HOST_RETENTION_MS};
/// let now = 10_000_000;
/// let entry = |seen: i64| format!(r#"{{"offset_ms": 0, "rtt_ms": 1, "seen_ms": {seen}, "sdk": "x"}}"#);
/// let r = split_hosts(vec![
///     ("fresh".into(), entry(now - 5_000)),
///     ("gone".into(), entry(now - HOST_RETENTION_MS - 1)),
///     ("garbage".into(), "{".into()),
/// ], now);
/// assert_eq!(r.reports.len(), 2); // a stale report is still shown until it is pruned
/// assert_eq!(r.stale, ["gone", "garbage"]);
/// ```
pub fn split_hosts(raw: Vec<(String, String)>, now_ms: i64) -> HostsRead {
    let mut out = HostsRead::default();
    for (h, v) in raw {
        match serde_json::from_str::<HostReport>(&v) {
            Ok(r) if plausible(&r) => {
                let seen_leader_clock = r.seen_ms - r.offset_ms as i64;
                if now_ms.saturating_sub(seen_leader_clock) > HOST_RETENTION_MS {
                    out.stale.push(h.clone());
                }
                out.reports.push((h, r));
            }
            _ => out.stale.push(h),
        }
    }
    out
}

async fn read_hosts(redis: &Redis, keys: &Keys) -> Option<HostsRead> {
    let mut c = redis.conn().await.ok()?;
    let all: Vec<(String, String)> = tokio::time::timeout(
        Duration::from_secs(2),
        redis::cmd("HGETALL").arg(keys.hosts()).query_async(&mut c),
    )
    .await
    .ok()?
    .ok()?;
    Some(split_hosts(all, unix_ms()))
}

/// Prunes `stale` entries of `NS:hosts` (the script re-checks each by Redis time, so a host
/// that reported since it was read survives). Harmless when done by a deposed leader.
async fn prune_hosts(redis: &Redis, keys: &Keys, stale: &[String], metrics: &Metrics) {
    let Ok(mut c) = redis.conn().await else {
        return;
    };
    let call = scripts::prune_hosts(&mut c, keys, HOST_RETENTION_MS as u64, stale);
    match tokio::time::timeout(Duration::from_secs(2), call).await {
        Ok(Ok(n)) if n > 0 => {
            metrics.hosts_pruned.inc_by(n);
            info!(n, "pruned host entries not seen for 10 minutes");
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => debug!(%e, "pruning hosts failed; retrying later"),
        Err(_) => debug!("pruning hosts timed out; retrying later"),
    }
}

async fn read_slices(
    redis: &Redis,
    keys: &Keys,
    task: &str,
    slice_ms: u64,
    now_ms: i64,
) -> Option<Vec<Reading>> {
    let len = slice_ms as i64;
    let current = slice::start(now_ms, slice_ms);
    let starts: Vec<i64> = (-BEHIND..=AHEAD).map(|i| current + i * len).collect();
    let mut c = redis.conn().await.ok()?;
    let rows = tokio::time::timeout(
        Duration::from_secs(1),
        scripts::read_slices(&mut c, keys, task, &starts),
    )
    .await
    .ok()?
    .ok()?;
    Some(starts.into_iter().zip(rows).collect())
}

/// How long until a task is polled again: half a slice (at most 500 ms) while its
/// slices move, one slice (at most 1 s) once nothing has moved for [`IDLE_AFTER_MS`], and
/// [`DORMANT_POLL_MS`] once no slice read has moved or been consumed for [`DORMANT_AFTER_MS`].
/// The allowance of [`allowed_moving`] follows the time actually covered, so the slower polls
/// of an idle task stay correct; they only make detection coarser until traffic resumes.
pub fn poll_period_ms(slice_ms: u64, idle_for_ms: i64, dormant_for_ms: i64) -> i64 {
    if dormant_for_ms >= DORMANT_AFTER_MS {
        DORMANT_POLL_MS
    } else if idle_for_ms >= IDLE_AFTER_MS {
        (slice_ms as i64).clamp(50, 1_000)
    } else {
        // Half a slice: polls that far apart span at most two slices, the seed's allowance,
        // as a quarter did (issue 27: the readings were most of an active task's round trips).
        (slice_ms as i64 / 2).clamp(50, 500)
    }
}

/// The detector's leader loop: sends what it finds to the alert loop as [`Signal::Seen`].
/// Tasks the roller left lazy (`activity`) are not read until they wake.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    ctx: LeaderContext,
    keys: Keys,
    redis: Arc<Redis>,
    store: TaskStore,
    metrics: Arc<Metrics>,
    settings: watch::Receiver<Settings>,
    alerts: AlertTx,
    activity: crate::history::Activity,
) {
    let mut watches: HashMap<String, TaskWatch> = HashMap::new();
    // When each task is polled next, and the same as a queue ordered by that time (an entry
    // whose time is not the task's `next_poll` is stale and skipped).
    let mut next_poll: HashMap<String, i64> = HashMap::new();
    let mut queue: std::collections::BinaryHeap<std::cmp::Reverse<(i64, String)>> =
        std::collections::BinaryHeap::new();
    let mut seen: Option<Arc<crate::tasks::TaskSnapshot>> = None;
    // Lazy tasks found due: not polled (their `next_poll` is `i64::MAX`, no queue entry) until
    // the roller's lazy set changes and they are no longer in it (issue 27: re-queueing 100,000
    // lazy tasks every 5 s was a tenth of the detector's CPU).
    let mut parked: HashSet<String> = HashSet::new();
    let mut lazy_generation = activity.lazy_generation();
    let mut unparked_ms = i64::MIN;
    // When each condition was last reported: a condition not reported within the quiet
    // period starts a new episode, for which suspects are named from fresh host reports.
    let mut reported: HashMap<String, i64> = HashMap::new();
    let mut last_hosts_ms = 0;
    let mut hosts: Vec<(String, HostReport)> = Vec::new();
    let mut interval = tokio::time::interval(Duration::from_millis(50));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        tokio::select! {
            _ = ctx.token().cancelled() => return,
            _ = interval.tick() => {}
        }
        let now = unix_ms();
        let cfg = settings.borrow().clone();
        let quiet = cfg.alert_quiet_ms as i64;
        reported.retain(|_, t| now.saturating_sub(*t) < quiet);
        let mut found: Vec<Condition> = Vec::new();

        // Hosts, every few seconds (the SDK reports every 10 s); every second while a host
        // alert is open, so its episode does not go quiet between two reads.
        let host_open = reported.keys().any(|k| k.starts_with("host:"));
        let period = if host_open { 1_000 } else { HOSTS_READ_MS };
        if now - last_hosts_ms >= period {
            last_hosts_ms = now;
            if let Some(h) = read_hosts(&redis, &keys).await {
                hosts = h.reports;
                if !h.stale.is_empty() && ctx.is_valid() {
                    prune_hosts(&redis, &keys, &h.stale, &metrics).await;
                }
            }
            let max = hosts
                .iter()
                .filter(|(_, r)| now.saturating_sub(r.seen_ms).saturating_abs() <= HOST_FRESH_MS)
                .map(|(_, r)| r.offset_ms.abs())
                .fold(0.0, f64::max);
            metrics.max_clock_offset_seconds.set(max / 1000.0);
            for (host, offset, rtt) in skewed_hosts(&hosts, cfg.skew_threshold_ms, now) {
                let mut c = Condition::new(
                    format!("host:{host}"),
                    "clock_skew",
                    format!(
                        "host {host} clock is {offset:+.0} ms off Redis time (±{:.0} ms), above the {} ms threshold",
                        rtt / 2.0,
                        cfg.skew_threshold_ms
                    ),
                );
                c.host = Some(host);
                c.details = json!({"offset_ms": offset, "rtt_ms": rtt});
                found.push(c);
            }
        }

        // Key movement, per task at ≤ slice/2. The tasks due are popped from a queue ordered
        // by due time; the task list is walked only when the snapshot changes (issue 27: a
        // walk of every task every 50 ms was most of an idle leader's CPU at 10,000 tasks).
        let snap = store.snapshot();
        if seen.as_ref().is_none_or(|s| !Arc::ptr_eq(s, &snap)) {
            watches.retain(|t, _| snap.tasks.contains_key(t));
            next_poll.retain(|t, _| snap.tasks.contains_key(t));
            parked.retain(|t| snap.tasks.contains_key(t));
            for name in snap.tasks.keys() {
                if !next_poll.contains_key(name) {
                    next_poll.insert(name.clone(), now);
                    queue.push(std::cmp::Reverse((now, name.clone())));
                }
            }
            seen = Some(snap.clone());
        }
        // Parked tasks the roller woke are polled now: looked for when the lazy set changed,
        // at most once a second (tasks waking all the time must not make this a walk of every
        // parked task every 50 ms).
        let generation = activity.lazy_generation();
        if generation != lazy_generation
            && !parked.is_empty()
            && (now.saturating_sub(unparked_ms) >= UNPARK_EVERY_MS || now < unparked_ms)
        {
            lazy_generation = generation;
            unparked_ms = now;
            let woken: Vec<String> = activity.with_lazy_set(|lazy| {
                parked
                    .iter()
                    .filter(|n| !lazy.contains(*n))
                    .cloned()
                    .collect()
            });
            for name in woken {
                parked.remove(&name);
                next_poll.insert(name.clone(), now);
                queue.push(std::cmp::Reverse((now, name)));
            }
        } else if parked.is_empty() {
            lazy_generation = generation;
        }
        let mut due: Vec<(String, u64)> = Vec::new();
        while let Some(std::cmp::Reverse((at, _))) = queue.peek() {
            if *at > now {
                break;
            }
            let Some(std::cmp::Reverse((at, name))) = queue.pop() else {
                break;
            };
            // A stale entry (the task was polled at another time since, or is gone).
            if next_poll.get(&name) != Some(&at) {
                continue;
            }
            // A lazy task has no slices but what workers make, and the roller wakes it when
            // they do: looked at again later, without a read (issue 27). It is in the snapshot:
            // `next_poll` is pruned to it whenever it changes (no lookup of 100,000 names in
            // the snapshot's map every 5 s).
            if activity.is_lazy(&name) {
                next_poll.insert(name.clone(), i64::MAX);
                parked.insert(name);
                continue;
            }
            match snap.tasks.get(&name) {
                Some(e) => due.push((name, e.spec.slice_ms)),
                None => {
                    next_poll.remove(&name);
                }
            }
        }
        for (name, slice_ms) in &due {
            let (idle_for, dormant_for) = watches
                .get(name)
                .map_or((0, 0), |w| (w.idle_for(now), w.dormant_for(now)));
            let at = now + poll_period_ms(*slice_ms, idle_for, dormant_for);
            next_poll.insert(name.clone(), at);
            queue.push(std::cmp::Reverse((at, name.clone())));
        }
        let readings: Vec<(String, u64, Option<Vec<Reading>>, i64)> = futures::stream::iter(due)
            .map(|(name, slice_ms)| {
                let redis = &redis;
                let keys = &keys;
                async move {
                    let r = read_slices(redis, keys, &name, slice_ms, now).await;
                    (name, slice_ms, r, unix_ms())
                }
            })
            .buffer_unordered(64)
            .collect()
            .await;
        metrics.skew_polls.inc_by(readings.len() as u64);
        for (task, slice_ms, r, finished) in readings {
            let Some(r) = r else { continue };
            let movement = watches
                .entry(task.clone())
                .or_default()
                .observe(&r, now, finished, slice_ms);
            if !movement.is_skew() {
                continue;
            }
            let moved = movement.moved;
            let key = format!("task:{task}");
            if !reported.contains_key(&key)
                && let Some(h) = read_hosts(&redis, &keys).await
            {
                // A new episode: name suspects from the freshest host reports.
                hosts = h.reports;
            }
            let len = slice_ms.max(1) as i64;
            let current = slice::start(now, slice_ms);
            let distances: Vec<i64> = moved.iter().map(|s| (s - current) / len).collect();
            let suspects: Vec<String> = skewed_hosts(&hosts, cfg.skew_threshold_ms, now)
                .into_iter()
                .filter(|(h, _, _)| {
                    hosts.iter().any(|(n, rep)| {
                        n == h && (rep.tasks.is_empty() || rep.tasks.contains_key(&task))
                    })
                })
                .map(|(h, o, _)| format!("{h} ({o:+.0} ms)"))
                .collect();
            let mut c = Condition::new(
                key,
                "clock_skew",
                format!(
                    "task {task}: {} slices moved at once (distance from the leader's slice: {distances:?}); {}",
                    moved.len(),
                    if suspects.is_empty() {
                        "no host reports a large offset".to_string()
                    } else {
                        format!("suspected hosts: {}", suspects.join(", "))
                    }
                ),
            );
            c.task = Some(task);
            c.details =
                json!({"moved_slices": moved, "distances": distances, "suspects": suspects});
            found.push(c);
        }

        for c in found {
            reported.insert(c.key.clone(), now);
            alerts.send(Signal::Seen(c));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rd(v: &[(i64, i64, i64)]) -> Vec<Reading> {
        v.iter().map(|(s, c, r)| (*s, Some((*c, *r)))).collect()
    }

    #[test]
    fn agreeing_hosts_move_at_most_two_slices() {
        let mut w = TaskWatch::default();
        w.observe(
            &rd(&[(0, 100, 100), (1000, 100, 100), (2000, 100, 100)]),
            900,
            901,
            1000,
        );
        let m = w.observe(
            &rd(&[(0, 100, 60), (1000, 100, 95), (2000, 100, 100)]),
            1150,
            1152,
            1000,
        );
        assert_eq!(m.moved, [0, 1000]);
        assert!(!m.is_skew());
    }

    #[test]
    fn a_host_ahead_makes_three_move() {
        let mut w = TaskWatch::default();
        let base = rd(&[
            (0, 100, 100),
            (1000, 100, 100),
            (2000, 100, 100),
            (3000, 100, 100),
        ]);
        w.observe(&base, 900, 901, 1000);
        let m = w.observe(
            &rd(&[
                (0, 100, 90),
                (1000, 100, 90),
                (2000, 100, 100),
                (3000, 100, 80),
            ]),
            1150,
            1151,
            1000,
        );
        assert_eq!(m.moved.len(), 3);
        assert!(m.is_skew());
    }

    #[test]
    fn short_slices_and_late_polls_allow_what_the_elapsed_time_covers() {
        // 100 ms slices; the poll came 160 ms after the previous one started: slices 0, 100
        // and 200 may all have moved with agreeing clocks.
        let mut w = TaskWatch::default();
        w.observe(
            &rd(&[(0, 10, 10), (100, 10, 10), (200, 10, 10), (300, 10, 10)]),
            50,
            52,
            100,
        );
        let m = w.observe(
            &rd(&[(0, 10, 9), (100, 10, 5), (200, 10, 8), (300, 10, 10)]),
            205,
            210,
            100,
        );
        assert_eq!(m.moved.len(), 3);
        assert_eq!(m.allowed, 3);
        assert!(!m.is_skew());
        // The slice after that as well: a host ahead.
        let m = w.observe(
            &rd(&[(0, 10, 9), (100, 10, 4), (200, 10, 7), (300, 10, 9)]),
            260,
            262,
            100,
        );
        assert!(m.is_skew(), "{m:?}");
    }

    #[test]
    fn idle_tasks_are_polled_once_a_slice() {
        let mut w = TaskWatch::default();
        let r = rd(&[(0, 10, 10), (1000, 10, 10)]);
        w.observe(&r, 0, 1, 1000);
        let period =
            |w: &TaskWatch, slice, now| poll_period_ms(slice, w.idle_for(now), w.dormant_for(now));
        assert_eq!(period(&w, 1000, 500), 500);
        w.observe(&r, 500, 501, 1000);
        assert_eq!(period(&w, 1000, 2_500), 1_000);
        assert_eq!(period(&w, 100, 2_500), 100);
        // Movement brings the fast polls back.
        w.observe(&rd(&[(0, 10, 9), (1000, 10, 10)]), 2_500, 2_501, 1000);
        assert_eq!(period(&w, 1000, 2_600), 500);
    }

    #[test]
    fn dormant_tasks_are_polled_every_few_seconds_until_a_slice_is_consumed() {
        let mut w = TaskWatch::default();
        let idle = |t: i64| rd(&[(t, 10, 10), (t + 1000, 10, 10)]);
        w.observe(&idle(0), 0, 1, 1000);
        let period = |w: &TaskWatch, now| poll_period_ms(1000, w.idle_for(now), w.dormant_for(now));
        // Nothing moved or consumed for a minute: dormant.
        w.observe(&idle(59_000), 59_000, 59_001, 1000);
        assert_eq!(period(&w, 59_500), 1_000);
        w.observe(&idle(60_000), 60_000, 60_002, 1000);
        assert_eq!(period(&w, 60_100), DORMANT_POLL_MS);
        // A slice consumed (nothing of it read before, so no movement yet): awake again, and
        // the next poll judges movement.
        let m = w.observe(
            &rd(&[(65_000, 10, 7), (66_000, 10, 10)]),
            65_000,
            65_001,
            1000,
        );
        assert!(m.moved.is_empty());
        assert_eq!(period(&w, 65_100), 1_000);
        let m = w.observe(
            &rd(&[(65_000, 10, 5), (66_000, 10, 10)]),
            66_100,
            66_101,
            1000,
        );
        assert_eq!(m.moved, [65_000]);
        assert_eq!(period(&w, 66_200), 500);
    }

    #[test]
    fn new_and_missing_slices_are_not_movement() {
        let mut w = TaskWatch::default();
        w.observe(&[(0, None), (1000, Some((10, 10)))], 0, 1, 1000);
        let m = w.observe(
            &[(0, Some((10, 5))), (1000, None), (2000, Some((10, 1)))],
            250,
            251,
            1000,
        );
        assert!(m.moved.is_empty());
    }

    #[test]
    fn host_offsets_beyond_their_error_bound_are_flagged() {
        let r = |o: f64, rtt: f64, seen: i64| HostReport {
            offset_ms: o,
            rtt_ms: rtt,
            seen_ms: seen,
            sdk: "x".into(),
            proto: None,
            tasks: Default::default(),
            permits: Default::default(),
        };
        let hosts = vec![
            ("ok".to_string(), r(20.0, 2.0, 1_000)),
            ("ahead".to_string(), r(1500.0, 2.0, 1_000)),
            ("behind".to_string(), r(-300.0, 2.0, 1_000)),
            ("noisy".to_string(), r(120.0, 60.0, 1_000)),
            ("stale".to_string(), r(5000.0, 1.0, -100_000)),
        ];
        let s: Vec<String> = skewed_hosts(&hosts, 100, 1_000)
            .into_iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(s, ["ahead", "behind"]);
    }
}
