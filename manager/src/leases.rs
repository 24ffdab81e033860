//! Mode `concurrency` as the manager sees it: the lease hash `NS:{T}:lease` read back,
//! validated and summed (for `GET /api/v1/tasks/{name}` and the leader's metrics).
//!
//! ```text
//!  NS:{T}:lease  hash  host id -> "<permits>:<expires_ms>:<seq>:<unmet>"   (sluice_protocol::lease)
//!                      expires_ms is Redis TIME: "now" here is Redis TIME too, never ours
//! ```
//!
//! The hash is written by hosts (the LEASE script), so every entry is validated: one that
//! does not parse is skipped and counted ([`LeaseView::malformed`]), never trusted and never a
//! panic. A live entry (`expires_ms > now`) holds its permits; an expired one holds none.
//!
//! **Expiries.** An entry that expired while holding permits (`permits > 0`) is a lease that
//! lapsed: its host died, stopped or lost Redis for longer than the TTL. The leader counts each
//! such lease once ([`ExpiryTracker`], keyed by host and `expires_ms`): a host that drops its
//! block (`want = 0`) leaves an entry of 0 permits, which is no expiry.

use std::collections::{HashMap, HashSet};

use redis::AsyncCommands;
use sluice_protocol::Keys;
use sluice_protocol::conn::RedisConn;

/// One host's entry of the lease hash, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseEntry {
    /// Permits in the block.
    pub permits: u64,
    /// When the lease ends (Redis time, Unix ms).
    pub expires_ms: i64,
    /// The host's last call's sequence number.
    pub seq: u64,
    /// Permits the host wanted beyond what it got at its last call (it has work waiting).
    pub unmet: u64,
}

/// Parses `"<permits>:<expires_ms>:<seq>:<unmet>"` (the `:<unmet>` part may be absent, as the
/// LEASE script accepts). `None` for anything else.
///
/// ```
/// use sluice_manager::leases::{LeaseEntry, parse_entry};
/// assert_eq!(
///     parse_entry("3:1700000000000:7:2"),
///     Some(LeaseEntry { permits: 3, expires_ms: 1_700_000_000_000, seq: 7, unmet: 2 })
/// );
/// assert_eq!(parse_entry("3:1700000000000:7").map(|e| e.unmet), Some(0));
/// assert_eq!(parse_entry("3:1.7e+12:7:0"), None);
/// assert_eq!(parse_entry("-1:5:7:0"), None);
/// ```
pub fn parse_entry(s: &str) -> Option<LeaseEntry> {
    fn digits(p: &str) -> Option<u64> {
        if p.is_empty() || p.len() > 19 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        p.parse().ok()
    }
    let mut parts = s.split(':');
    let permits = digits(parts.next()?)?;
    let expires_ms = i64::try_from(digits(parts.next()?)?).ok()?;
    let seq = digits(parts.next()?)?;
    let unmet = match parts.next() {
        None | Some("") => 0,
        Some(u) => digits(u)?,
    };
    if parts.next().is_some() {
        return None;
    }
    Some(LeaseEntry {
        permits,
        expires_ms,
        seq,
        unmet,
    })
}

/// One host in a [`LeaseView`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLease {
    /// Host id (the hash field).
    pub host: String,
    /// Permits the host holds now (0 when its lease expired).
    pub held: u64,
    /// Ms until the lease ends (negative: ended that long ago).
    pub expires_in_ms: i64,
    /// Permits the host is waiting for (unmet demand of its last call; 0 when expired).
    pub waiting: u64,
    /// The entry expired while holding permits (a lapsed lease).
    pub expired: bool,
    /// The entry as read.
    pub entry: LeaseEntry,
}

/// The lease hash of one task at one instant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseView {
    /// Redis time of the read (Unix ms).
    pub now_ms: i64,
    /// Every well-formed entry, by host id.
    pub hosts: Vec<HostLease>,
    /// Entries skipped because they do not parse (or the host id is not UTF-8).
    pub malformed: u64,
}

impl LeaseView {
    /// Builds the view of `raw` (hash field → value) at Redis time `now_ms`. Pure.
    ///
    /// ```
    /// use sluice_manager::leases::LeaseView;
    /// let raw = vec![
    ///     (b"a".to_vec(), b"3:2000:1:0".to_vec()),   // live: 3 held
    ///     (b"b".to_vec(), b"2:900:4:5".to_vec()),    // expired while holding 2
    ///     (b"c".to_vec(), b"0:2000:9:4".to_vec()),   // live, holds none, waits for 4
    ///     (b"d".to_vec(), b"junk".to_vec()),         // skipped
    /// ];
    /// let v = LeaseView::from_raw(1000, raw);
    /// assert_eq!((v.held(), v.hosts_holding(), v.hosts_waiting(), v.malformed), (3, 1, 1, 1));
    /// assert_eq!(v.hosts.iter().filter(|h| h.expired).count(), 1);
    /// ```
    pub fn from_raw(now_ms: i64, raw: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        let mut v = Self {
            now_ms,
            ..Self::default()
        };
        for (field, value) in raw {
            let parsed = String::from_utf8(field)
                .ok()
                .zip(std::str::from_utf8(&value).ok().and_then(parse_entry));
            let Some((host, e)) = parsed else {
                v.malformed += 1;
                continue;
            };
            let live = e.expires_ms > now_ms;
            v.hosts.push(HostLease {
                host,
                held: if live { e.permits } else { 0 },
                expires_in_ms: e.expires_ms.saturating_sub(now_ms),
                waiting: if live { e.unmet } else { 0 },
                expired: !live && e.permits > 0,
                entry: e,
            });
        }
        v.hosts.sort_by(|a, b| a.host.cmp(&b.host));
        v
    }

    /// Permits held cluster-wide now (sum of live entries).
    pub fn held(&self) -> u64 {
        self.hosts.iter().map(|h| h.held).sum()
    }

    /// Hosts holding at least one permit under a live lease.
    pub fn hosts_holding(&self) -> u64 {
        self.hosts.iter().filter(|h| h.held > 0).count() as u64
    }

    /// Hosts with a live lease and permits waiting (unmet > 0).
    pub fn hosts_waiting(&self) -> u64 {
        self.hosts.iter().filter(|h| h.waiting > 0).count() as u64
    }
}

/// Reads the lease hash of `task` with Redis' own clock (`TIME`, then `HGETALL`).
pub async fn read(conn: &mut RedisConn, keys: &Keys, task: &str) -> redis::RedisResult<LeaseView> {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    let now_ms = s * 1000 + us / 1000;
    let raw: Vec<(Vec<u8>, Vec<u8>)> = conn.hgetall(keys.lease(task)).await?;
    Ok(LeaseView::from_raw(now_ms, raw))
}

/// Counts lapsed leases once each, across reads (the leader keeps one per leadership).
#[derive(Debug, Default)]
pub struct ExpiryTracker {
    /// (task, host) → `expires_ms` of the lapsed lease already counted.
    seen: HashMap<(String, String), i64>,
}

impl ExpiryTracker {
    /// Lapsed leases in `view` not counted before. Forgets hosts no longer in the hash.
    ///
    /// ```
    /// use sluice_manager::leases::{ExpiryTracker, LeaseView};
    /// let mut t = ExpiryTracker::default();
    /// let raw = || vec![(b"a".to_vec(), b"2:900:4:0".to_vec())];
    /// assert_eq!(t.observe("q", &LeaseView::from_raw(1000, raw())), 1);
    /// assert_eq!(t.observe("q", &LeaseView::from_raw(1500, raw())), 0); // the same lease
    /// ```
    pub fn observe(&mut self, task: &str, view: &LeaseView) -> u64 {
        let mut new = 0;
        let present: HashSet<&str> = view.hosts.iter().map(|h| h.host.as_str()).collect();
        self.seen
            .retain(|(t, h), _| t != task || present.contains(h.as_str()));
        for h in view.hosts.iter().filter(|h| h.expired) {
            let key = (task.to_string(), h.host.clone());
            if self.seen.get(&key) != Some(&h.entry.expires_ms) {
                self.seen.insert(key, h.entry.expires_ms);
                new += 1;
            }
        }
        new
    }

    /// Forgets the tasks not in `keep`.
    pub fn retain_tasks(&mut self, keep: &HashSet<&str>) {
        self.seen.retain(|(t, _), _| keep.contains(t.as_str()));
    }
}

/// How often the leader reads the lease hashes for the metrics.
pub const METRICS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Leader loop: every [`METRICS_EVERY`], reads each concurrency task's lease hash and sets the
/// `sluice_concurrency_*` metrics (held, hosts holding and waiting, expiries, malformed
/// entries). The gauges are removed when the leadership ends or a task is gone.
pub async fn run(
    ctx: crate::election::LeaderContext,
    keys: Keys,
    redis: std::sync::Arc<sluice_protocol::conn::Redis>,
    store: crate::tasks::TaskStore,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
) {
    let mut tracker = ExpiryTracker::default();
    let mut interval = tokio::time::interval(METRICS_EVERY);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut shown: HashSet<String> = HashSet::new();
    loop {
        tokio::select! {
            _ = ctx.token().cancelled() => break,
            _ = interval.tick() => {}
        }
        let snap = store.snapshot();
        if !snap.loaded {
            continue;
        }
        let names: Vec<String> = snap
            .tasks
            .values()
            .filter(|t| t.spec.mode == sluice_protocol::Mode::Concurrency)
            .map(|t| t.name.clone())
            .collect();
        let keep: HashSet<&str> = names.iter().map(String::as_str).collect();
        tracker.retain_tasks(&keep);
        for gone in shown.iter().filter(|n| !keep.contains(n.as_str())) {
            metrics.remove_concurrency_task(gone);
        }
        shown.retain(|n| keep.contains(n.as_str()));
        let mut conn = match redis.conn().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(%e, "lease metrics: redis unavailable");
                continue;
            }
        };
        for name in &names {
            let r = tokio::time::timeout(METRICS_EVERY, read(&mut conn, &keys, name)).await;
            let view = match r {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => {
                    tracing::debug!(task = name, %e, "lease metrics: read failed");
                    continue;
                }
                Err(_) => continue,
            };
            if view.malformed > 0 {
                tracing::debug!(
                    task = name,
                    entries = view.malformed,
                    "lease hash: malformed entries skipped"
                );
            }
            let expired = tracker.observe(name, &view);
            metrics.set_concurrency(name, &view, expired);
            shown.insert(name.clone());
        }
    }
    for name in &shown {
        metrics.remove_concurrency_task(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_entries_are_skipped_and_counted() {
        let raw = vec![
            (b"ok".to_vec(), b"1:5000:1:0".to_vec()),
            (b"neg".to_vec(), b"-1:5000:1:0".to_vec()),
            (b"float".to_vec(), b"1.5:5000:1:0".to_vec()),
            (b"sci".to_vec(), b"1:1.7e+15:1:0".to_vec()),
            (b"extra".to_vec(), b"1:5000:1:0:9".to_vec()),
            (b"short".to_vec(), b"1:5000".to_vec()),
            (b"empty".to_vec(), b"".to_vec()),
            (b"huge".to_vec(), b"99999999999999999999:5000:1:0".to_vec()),
            (vec![0xff, 0xfe], b"1:5000:1:0".to_vec()),
            (b"bin".to_vec(), vec![0xff, b':', b'1']),
        ];
        let v = LeaseView::from_raw(1000, raw);
        assert_eq!(v.malformed, 9);
        assert_eq!(v.hosts.len(), 1);
        assert_eq!(v.held(), 1);
        assert_eq!(v.hosts[0].expires_in_ms, 4000);
    }

    #[test]
    fn expired_and_dropped_entries_hold_nothing() {
        let raw = vec![
            (b"dead".to_vec(), b"4:1000:1:3".to_vec()),
            (b"dropped".to_vec(), b"0:900:2:0".to_vec()),
        ];
        let v = LeaseView::from_raw(1000, raw);
        assert_eq!((v.held(), v.hosts_holding(), v.hosts_waiting()), (0, 0, 0));
        let dead = &v.hosts[0];
        assert!(dead.expired && dead.expires_in_ms == 0);
        assert!(!v.hosts[1].expired, "a dropped block is no expiry");
    }

    #[test]
    fn a_renewed_then_lapsed_lease_counts_again() {
        let mut t = ExpiryTracker::default();
        let at = |exp: &str, now| {
            LeaseView::from_raw(
                now,
                vec![(b"a".to_vec(), format!("2:{exp}:1:0").into_bytes())],
            )
        };
        assert_eq!(t.observe("q", &at("900", 1000)), 1);
        assert_eq!(t.observe("q", &at("5000", 2000)), 0); // renewed: live
        assert_eq!(t.observe("q", &at("5000", 6000)), 1); // lapsed again
        // The entry deleted (by a LEASE call 10 TTL later), then the host back and lapsed at
        // the same instant is not possible; a fresh entry after deletion counts.
        assert_eq!(t.observe("q", &LeaseView::from_raw(7000, vec![])), 0);
        assert_eq!(t.observe("q", &at("5000", 8000)), 1);
        assert_eq!(t.observe("other", &at("5000", 8000)), 1);
    }
}
