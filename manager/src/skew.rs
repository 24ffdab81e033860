//! Clock-skew detection (leader only).
//!
//! Hosts pick the slice to pull from by their own clock. When clocks agree, at any moment all
//! hosts consume from the current slice — around a boundary, from the current and the previous
//! one. A host whose clock is off by more than a fraction of a slice consumes from a slice the
//! others are not in, and steals quota from the future (or spends the past).
//!
//! **Key movement (the seed's rule).** Every poll (≤ slice/4, 250 ms for 1 s slices) the leader
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
//! Both kinds go through [`crate::alerts::Episodes`]: one firing alert per episode and one
//! resolved alert after a quiet period; open episodes live in Redis, so a new leader continues
//! them instead of alerting twice.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use sluice::protocol::conn::Redis;
use sluice::protocol::{HostReport, Keys, scripts, slice, unix_ms};
use tracing::{debug, warn};

use crate::alerts::{self, AlertState, Alerts, Episodes, Transition};
use crate::election::LeaderContext;
use crate::metrics::Metrics;
use crate::settings::{self, Settings};
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
/// Host reports older than this are ignored.
pub const HOST_FRESH_MS: i64 = 60_000;

/// One poll's reading of a slice: `(start, cap, rem)`, `None` when it does not exist.
pub type Reading = (i64, Option<(i64, i64)>);

/// How many slices hosts with agreeing clocks can move between two polls: every slice that
/// overlaps the time from the start of the previous poll to the end of this one, and at least
/// [`MAX_MOVING`]. With 1 s slices and polls 250 ms apart that is the seed's two; with 100 ms
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
        Movement { moved, allowed }
    }

    /// How long no slice of the task has moved, as of `now_ms`.
    pub fn idle_for(&self, now_ms: i64) -> i64 {
        self.last_moved_ms.map_or(0, |t| now_ms - t)
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
        .filter(|(_, r)| (now_ms - r.seen_ms).abs() <= HOST_FRESH_MS)
        .filter(|(_, r)| r.offset_ms.abs() - r.rtt_ms / 2.0 > threshold_ms as f64)
        .map(|(h, r)| (h.clone(), r.offset_ms, r.rtt_ms))
        .collect()
}

async fn read_hosts(redis: &Redis, keys: &Keys) -> Option<Vec<(String, HostReport)>> {
    let mut c = redis.conn().await.ok()?;
    let all: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.hosts())
        .query_async(&mut c)
        .await
        .ok()?;
    Some(
        all.into_iter()
            .filter_map(|(h, v)| serde_json::from_str::<HostReport>(&v).ok().map(|r| (h, r)))
            .collect(),
    )
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

/// How long until a task is polled again: a quarter of a slice (at most 250 ms) while its
/// slices move, one slice (at most 1 s) once nothing has moved for [`IDLE_AFTER_MS`]. The
/// allowance of [`allowed_moving`] follows the time actually covered, so the slower polls of
/// an idle task stay correct; they only make detection coarser until traffic resumes.
pub fn poll_period_ms(slice_ms: u64, idle_for_ms: i64) -> i64 {
    if idle_for_ms >= IDLE_AFTER_MS {
        (slice_ms as i64).clamp(50, 1_000)
    } else {
        (slice_ms as i64 / 4).clamp(50, 250)
    }
}

/// The detector's leader loop.
pub async fn run(
    ctx: LeaderContext,
    keys: Keys,
    redis: Arc<Redis>,
    etcd: etcd_client::Client,
    store: TaskStore,
    metrics: Arc<Metrics>,
) {
    let alerts = Alerts::start(
        keys.clone(),
        redis.clone(),
        metrics.clone(),
        ctx.token().clone(),
    );
    let mut episodes = match alerts::load_episodes(&redis, &keys).await {
        Ok(e) => e,
        Err(e) => {
            warn!(%e, "cannot load open alert episodes; starting fresh");
            Episodes::default()
        }
    };
    let mut cfg: Settings = settings::load(&etcd, &keys)
        .await
        .map(|(s, _)| s)
        .unwrap_or_default();
    match alerts
        .redeliver_pending(&cfg.webhooks, unix_ms(), None)
        .await
    {
        Ok(n) if n > 0 => debug!(n, "re-queued undelivered webhook alerts"),
        Ok(_) => {}
        Err(e) => warn!(%e, "cannot check undelivered alerts"),
    }
    let mut watches: HashMap<String, TaskWatch> = HashMap::new();
    let mut next_poll: HashMap<String, i64> = HashMap::new();
    let mut last_hosts_ms = 0;
    let mut last_settings_ms = unix_ms();
    let mut hosts: Vec<(String, HostReport)> = Vec::new();
    let mut interval = tokio::time::interval(Duration::from_millis(50));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        tokio::select! {
            _ = ctx.token().cancelled() => return,
            _ = interval.tick() => {}
        }
        let now = unix_ms();
        if now - last_settings_ms >= 2_000 {
            last_settings_ms = now;
            if let Ok((s, _)) = settings::load(&etcd, &keys).await {
                let added: Vec<String> = s
                    .webhooks
                    .iter()
                    .filter(|u| !cfg.webhooks.contains(u))
                    .cloned()
                    .collect();
                if !added.is_empty() {
                    // A new webhook learns what is firing now.
                    let open: Vec<String> = episodes
                        .keys()
                        .filter_map(|k| episodes.get(k))
                        .map(|e| e.id.clone())
                        .collect();
                    if let Err(e) = alerts.redeliver_pending(&added, now, Some(&open)).await {
                        warn!(%e, "cannot send open alerts to a new webhook");
                    }
                }
                cfg = s;
            }
        }
        let mut events: Vec<(
            String,
            Transition,
            Option<String>,
            serde_json::Value,
            String,
        )> = Vec::new();

        // Hosts, once a second.
        if now - last_hosts_ms >= 1_000 {
            last_hosts_ms = now;
            if let Some(h) = read_hosts(&redis, &keys).await {
                hosts = h;
            }
            let max = hosts
                .iter()
                .filter(|(_, r)| (now - r.seen_ms).abs() <= HOST_FRESH_MS)
                .map(|(_, r)| r.offset_ms.abs())
                .fold(0.0, f64::max);
            metrics.max_clock_offset_ms.set(max);
            for (host, offset, rtt) in skewed_hosts(&hosts, cfg.skew_threshold_ms, now) {
                let key = format!("host:{host}");
                if let Some(t) = episodes.seen(&key, now) {
                    let msg = format!(
                        "host {host} clock is {offset:+.0} ms off Redis time (±{:.0} ms), above the {} ms threshold",
                        rtt / 2.0,
                        cfg.skew_threshold_ms
                    );
                    events.push((
                        key,
                        t,
                        Some(host.clone()),
                        json!({"offset_ms": offset, "rtt_ms": rtt}),
                        msg,
                    ));
                }
            }
        }

        // Key movement, per task at ≤ slice/4.
        let snap = store.snapshot();
        watches.retain(|t, _| snap.tasks.contains_key(t));
        next_poll.retain(|t, _| snap.tasks.contains_key(t));
        let due: Vec<(String, u64)> = snap
            .tasks
            .values()
            .filter(|e| next_poll.get(&e.name).is_none_or(|t| *t <= now))
            .map(|e| (e.name.clone(), e.spec.slice_ms))
            .collect();
        for (name, slice_ms) in &due {
            let idle_for = watches.get(name).map_or(0, |w| w.idle_for(now));
            next_poll.insert(name.clone(), now + poll_period_ms(*slice_ms, idle_for));
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
            if episodes.get(&format!("task:{task}")).is_none()
                && let Some(h) = read_hosts(&redis, &keys).await
            {
                // A new episode: name suspects from the freshest host reports.
                hosts = h;
            }
            let current = slice::start(now, slice_ms);
            let distances: Vec<i64> = moved
                .iter()
                .map(|s| (s - current) / slice_ms as i64)
                .collect();
            let suspects: Vec<String> = skewed_hosts(&hosts, cfg.skew_threshold_ms, now)
                .into_iter()
                .filter(|(h, _, _)| {
                    hosts.iter().any(|(n, rep)| {
                        n == h && (rep.tasks.is_empty() || rep.tasks.contains_key(&task))
                    })
                })
                .map(|(h, o, _)| format!("{h} ({o:+.0} ms)"))
                .collect();
            let key = format!("task:{task}");
            if let Some(t) = episodes.seen(&key, now) {
                let msg = format!(
                    "task {task}: {} slices moved at once (distance from the leader's slice: {distances:?}); {}",
                    moved.len(),
                    if suspects.is_empty() {
                        "no host reports a large offset".to_string()
                    } else {
                        format!("suspected hosts: {}", suspects.join(", "))
                    }
                );
                let details =
                    json!({"moved_slices": moved, "distances": distances, "suspects": suspects});
                events.push((key, t, None, details, msg));
            }
        }

        // Quiet episodes resolve.
        for t in episodes.quiet_check(now, cfg.alert_quiet_ms) {
            if let Transition::Resolve(e) = &t {
                let key = e.key.clone();
                let host = key.strip_prefix("host:").map(str::to_string);
                let msg = format!(
                    "{key}: no clock skew seen for {} s",
                    cfg.alert_quiet_ms / 1000
                );
                events.push((key, t, host, json!({}), msg));
            }
        }

        for (key, t, host, details, msg) in events {
            if !ctx.is_valid() {
                return;
            }
            let task = key.strip_prefix("task:").map(str::to_string);
            let (state, episode) = match &t {
                Transition::Fire(e) => (AlertState::Firing, e.clone()),
                Transition::Resolve(e) => (AlertState::Resolved, e.clone()),
            };
            let persisted = match state {
                AlertState::Firing => {
                    alerts::persist_episode(&redis, &keys, &key, Some(&episode)).await
                }
                AlertState::Resolved => alerts::persist_episode(&redis, &keys, &key, None).await,
            };
            if let Err(e) = persisted {
                warn!(%e, "cannot persist alert episode");
            }
            let alert = alerts::skew_alert(
                task.as_deref(),
                host.as_deref(),
                state,
                &episode,
                msg,
                details,
                now,
            );
            if let Err(e) = alerts.emit(alert, &cfg.webhooks).await {
                warn!(%e, "cannot record alert");
            }
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
        assert_eq!(poll_period_ms(1000, w.idle_for(500)), 250);
        w.observe(&r, 250, 251, 1000);
        assert_eq!(poll_period_ms(1000, w.idle_for(2_500)), 1_000);
        assert_eq!(poll_period_ms(100, w.idle_for(2_500)), 100);
        // Movement brings the fast polls back.
        w.observe(&rd(&[(0, 10, 9), (1000, 10, 10)]), 2_500, 2_501, 1000);
        assert_eq!(poll_period_ms(1000, w.idle_for(2_600)), 250);
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
            tasks: Default::default(),
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
