//! Alerts: one pipeline for every kind (today `clock_skew`).
//!
//! ```text
//!  detector ──emit──▶ XADD NS:alerts (capped) ──▶ log + sluice_alerts_total{kind}
//!                          │
//!                          └─ try_send ──▶ webhook sender ──POST (retries, backoff)──▶ URL
//!                                             │ delivered: ZADD NS:alerts:sent "<id> <url>"
//! ```
//!
//! The detector never waits for a webhook: deliveries go through a bounded queue to their own
//! tasks, each bounded in time. A delivery is recorded in Redis, so a new leader delivers what
//! its predecessor left pending (the last ten minutes) and never resends what was delivered.
//! Episodes (one firing and one resolved alert per incident) are tracked by the detectors in
//! `NS:alerts:state`, which also survives a failover.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sluice::protocol::Keys;
use sluice::protocol::conn::Redis;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::error::{Result, redis as redis_err};
use crate::metrics::Metrics;

/// Alerts kept in the stream (approximately).
pub const STREAM_CAP: usize = 10_000;
/// Webhook deliveries queued at most; more are dropped (and counted).
pub const QUEUE_CAP: usize = 1_000;
/// Attempts per delivery.
pub const ATTEMPTS: u32 = 5;
/// Deliveries in flight at once.
const IN_FLIGHT: usize = 8;
/// Bound on one POST.
const POST_TIMEOUT: Duration = Duration::from_secs(3);
/// How far back a new leader looks for undelivered alerts.
pub const REDELIVER_WINDOW_MS: i64 = 10 * 60 * 1000;

/// Firing or resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertState {
    /// The condition started.
    Firing,
    /// The condition has been quiet for the quiet period.
    Resolved,
}

/// One alert, as stored, served and POSTed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alert {
    /// Stream entry id (empty until recorded).
    #[serde(default)]
    pub id: String,
    /// `clock_skew`.
    pub kind: String,
    /// The task, for task alerts.
    pub task: Option<String>,
    /// The host, for host alerts.
    pub host: Option<String>,
    /// Human-readable summary.
    pub message: String,
    /// When (Unix ms, leader clock).
    pub at_ms: i64,
    /// Firing or resolved.
    pub state: AlertState,
    /// Episode id: the same for the firing and the resolved alert of one incident.
    pub episode: String,
    /// Kind-specific details (slices that moved, offsets, suspected hosts).
    #[serde(default)]
    pub details: Value,
}

impl Alert {
    /// A Slack-compatible one-line summary.
    pub fn text(&self) -> String {
        let icon = match self.state {
            AlertState::Firing => ":rotating_light:",
            AlertState::Resolved => ":white_check_mark:",
        };
        let state = match self.state {
            AlertState::Firing => "FIRING",
            AlertState::Resolved => "RESOLVED",
        };
        format!("{icon} [sluice {state}] {}: {}", self.kind, self.message)
    }

    /// The webhook body: the alert plus a Slack-compatible `text`.
    pub fn webhook_body(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        v["text"] = Value::from(self.text());
        v
    }
}

/// One POST to make.
#[derive(Debug, Clone)]
struct Delivery {
    alert: Alert,
    url: String,
}

/// The leader's alert sink.
#[derive(Clone)]
pub struct Alerts {
    keys: Keys,
    redis: Arc<Redis>,
    metrics: Arc<Metrics>,
    queue: mpsc::Sender<Delivery>,
}

impl Alerts {
    /// A sink and its webhook sender (runs until `stop`).
    pub fn start(
        keys: Keys,
        redis: Arc<Redis>,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) -> Self {
        let (tx, rx) = mpsc::channel(QUEUE_CAP);
        let me = Self {
            keys,
            redis,
            metrics,
            queue: tx,
        };
        tokio::spawn(me.clone().send_loop(rx, stop));
        me
    }

    /// Records an alert (stream, log, metric) and queues it for every webhook.
    pub async fn emit(&self, mut alert: Alert, webhooks: &[String]) -> Result<Alert> {
        let body = serde_json::to_string(&alert).unwrap_or_default();
        let mut c = self.redis.conn().await.map_err(redis_err("connect"))?;
        let id: String = redis::cmd("XADD")
            .arg(self.keys.alerts())
            .arg("MAXLEN")
            .arg("~")
            .arg(STREAM_CAP)
            .arg("*")
            .arg("alert")
            .arg(body)
            .query_async(&mut c)
            .await
            .map_err(redis_err("XADD alert"))?;
        alert.id = id;
        self.metrics.alert(&alert.kind);
        match alert.state {
            AlertState::Firing => warn!(
                kind = alert.kind,
                id = alert.id,
                episode = alert.episode,
                "ALERT {}",
                alert.message
            ),
            AlertState::Resolved => info!(
                kind = alert.kind,
                id = alert.id,
                episode = alert.episode,
                "resolved: {}",
                alert.message
            ),
        }
        for url in webhooks {
            self.enqueue(alert.clone(), url.clone());
        }
        Ok(alert)
    }

    fn enqueue(&self, alert: Alert, url: String) {
        if self.queue.try_send(Delivery { alert, url }).is_err() {
            self.metrics.webhook_dropped.inc();
            warn!("webhook queue full; delivery dropped");
        }
    }

    /// Queues every alert of the last ten minutes that some webhook has not received (run by a
    /// new leader), or with `only_episodes`, just the alerts of those episodes (used when a
    /// webhook is added: it learns what is firing now).
    pub async fn redeliver_pending(
        &self,
        webhooks: &[String],
        now_ms: i64,
        only_episodes: Option<&[String]>,
    ) -> Result<usize> {
        if webhooks.is_empty() {
            return Ok(0);
        }
        let recent = recent(&self.redis, &self.keys, 200).await?;
        let mut c = self.redis.conn().await.map_err(redis_err("connect"))?;
        let mut n = 0;
        let wanted = |a: &Alert| only_episodes.is_none_or(|eps| eps.contains(&a.episode));
        for a in recent
            .into_iter()
            .filter(|a| a.at_ms >= now_ms - REDELIVER_WINDOW_MS && wanted(a))
        {
            for url in webhooks {
                let done: Option<f64> = redis::cmd("ZSCORE")
                    .arg(self.keys.alerts_sent())
                    .arg(format!("{} {url}", a.id))
                    .query_async(&mut c)
                    .await
                    .map_err(redis_err("ZSCORE"))?;
                if done.is_none() {
                    self.enqueue(a.clone(), url.clone());
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    async fn send_loop(self, mut rx: mpsc::Receiver<Delivery>, stop: CancellationToken) {
        let http = reqwest::Client::builder()
            .timeout(POST_TIMEOUT)
            .build()
            .unwrap_or_default();
        let slots = Arc::new(Semaphore::new(IN_FLIGHT));
        loop {
            let d = tokio::select! {
                _ = stop.cancelled() => return,
                d = rx.recv() => match d { Some(d) => d, None => return },
            };
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let me = self.clone();
            let http = http.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let _permit = permit;
                me.deliver(&http, d, stop).await;
            });
        }
    }

    async fn deliver(&self, http: &reqwest::Client, d: Delivery, stop: CancellationToken) {
        let body = d.alert.webhook_body();
        let mut backoff = Duration::from_millis(500);
        for attempt in 1..=ATTEMPTS {
            let r = http.post(&d.url).json(&body).send().await;
            match r {
                Ok(resp) if resp.status().is_success() => {
                    self.metrics.webhook_deliveries.inc();
                    debug!(url = d.url, id = d.alert.id, attempt, "webhook delivered");
                    if let Ok(mut c) = self.redis.conn().await {
                        let _: redis::RedisResult<()> = redis::pipe()
                            .cmd("ZADD")
                            .arg(self.keys.alerts_sent())
                            .arg(d.alert.at_ms)
                            .arg(format!("{} {}", d.alert.id, d.url))
                            .ignore()
                            .cmd("ZREMRANGEBYSCORE")
                            .arg(self.keys.alerts_sent())
                            .arg("-inf")
                            .arg(d.alert.at_ms - 24 * 3_600_000)
                            .ignore()
                            .query_async(&mut c)
                            .await;
                    }
                    return;
                }
                Ok(resp) => {
                    warn!(url = d.url, status = %resp.status(), attempt, "webhook refused the alert")
                }
                Err(e) => warn!(url = d.url, %e, attempt, "webhook unreachable"),
            }
            self.metrics.webhook_failures.inc();
            if attempt == ATTEMPTS {
                warn!(url = d.url, id = d.alert.id, "giving up on this delivery");
                return;
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff *= 2;
        }
    }
}

/// The newest `limit` alerts, newest first.
pub async fn recent(redis: &Redis, keys: &Keys, limit: usize) -> Result<Vec<Alert>> {
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
        .arg(keys.alerts())
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(limit)
        .query_async(&mut c)
        .await
        .map_err(redis_err("XREVRANGE alerts"))?;
    Ok(entries
        .into_iter()
        .filter_map(|(id, fields)| {
            let (_, body) = fields.into_iter().find(|(k, _)| k == "alert")?;
            let mut a: Alert = serde_json::from_str(&body).ok()?;
            a.id = id;
            Some(a)
        })
        .collect())
}

/// An open episode, as kept in `NS:alerts:state`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Episode {
    /// What the episode is about: `task:<T>` or `host:<H>`.
    pub key: String,
    /// Episode id.
    pub id: String,
    /// When it started.
    pub since_ms: i64,
    /// Last time its condition was seen.
    pub last_ms: i64,
}

/// What an [`Episodes`] update decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// A new episode starts: send a firing alert.
    Fire(Episode),
    /// The episode is over: send a resolved alert.
    Resolve(Episode),
}

/// Hysteresis over conditions keyed by `task:<T>` / `host:<H>`: one firing alert when a
/// condition starts, one resolved alert after `quiet_ms` without it (pure; the caller persists).
#[derive(Debug, Clone, Default)]
pub struct Episodes {
    open: std::collections::HashMap<String, Episode>,
}

impl Episodes {
    /// Episodes restored from `NS:alerts:state`.
    pub fn restore(open: impl IntoIterator<Item = (String, Episode)>) -> Self {
        Self {
            open: open.into_iter().collect(),
        }
    }

    /// The open episode of `key`.
    pub fn get(&self, key: &str) -> Option<&Episode> {
        self.open.get(key)
    }

    /// The condition of `key` was seen at `now`.
    ///
    /// ```
    /// use sluice_manager::alerts::{Episodes, Transition};
    /// let mut e = Episodes::default();
    /// assert!(matches!(e.seen("task:a", 1_000), Some(Transition::Fire(_))));
    /// assert_eq!(e.seen("task:a", 1_500), None);          // same episode
    /// assert_eq!(e.quiet_check(5_000, 10_000), vec![]);   // not quiet long enough
    /// assert!(matches!(e.quiet_check(11_600, 10_000)[..], [Transition::Resolve(_)]));
    /// ```
    pub fn seen(&mut self, key: &str, now_ms: i64) -> Option<Transition> {
        match self.open.get_mut(key) {
            Some(e) => {
                e.last_ms = now_ms;
                None
            }
            None => {
                let e = Episode {
                    key: key.to_string(),
                    id: format!("{key}@{now_ms}"),
                    since_ms: now_ms,
                    last_ms: now_ms,
                };
                self.open.insert(key.to_string(), e.clone());
                Some(Transition::Fire(e))
            }
        }
    }

    /// Resolves every episode not seen for `quiet_ms`.
    pub fn quiet_check(&mut self, now_ms: i64, quiet_ms: u64) -> Vec<Transition> {
        let done: Vec<String> = self
            .open
            .iter()
            .filter(|(_, e)| now_ms - e.last_ms >= quiet_ms as i64)
            .map(|(k, _)| k.clone())
            .collect();
        done.into_iter()
            .filter_map(|k| self.open.remove(&k))
            .map(Transition::Resolve)
            .collect()
    }

    /// Keys of open episodes.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.open.keys()
    }
}

/// Persists an episode change in `NS:alerts:state`.
pub async fn persist_episode(
    redis: &Redis,
    keys: &Keys,
    key: &str,
    episode: Option<&Episode>,
) -> Result<()> {
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let cmd = match episode {
        Some(e) => {
            let mut cmd = redis::cmd("HSET");
            cmd.arg(keys.alert_state())
                .arg(key)
                .arg(serde_json::to_string(e).unwrap_or_default());
            cmd
        }
        None => {
            let mut cmd = redis::cmd("HDEL");
            cmd.arg(keys.alert_state()).arg(key);
            cmd
        }
    };
    let _: () = cmd
        .query_async(&mut c)
        .await
        .map_err(redis_err("alert state"))?;
    Ok(())
}

/// Loads open episodes from `NS:alerts:state`.
pub async fn load_episodes(redis: &Redis, keys: &Keys) -> Result<Episodes> {
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let all: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.alert_state())
        .query_async(&mut c)
        .await
        .map_err(redis_err("alert state"))?;
    Ok(Episodes::restore(all.into_iter().filter_map(|(k, v)| {
        serde_json::from_str::<Episode>(&v).ok().map(|e| (k, e))
    })))
}

/// A `clock_skew` alert.
pub fn skew_alert(
    task: Option<&str>,
    host: Option<&str>,
    state: AlertState,
    episode: &Episode,
    message: String,
    details: Value,
    now_ms: i64,
) -> Alert {
    Alert {
        id: String::new(),
        kind: "clock_skew".into(),
        task: task.map(str::to_string),
        host: host.map(str::to_string),
        message,
        at_ms: now_ms,
        state,
        episode: episode.id.clone(),
        details,
    }
}

/// `{"alerts": [...]}` for the API.
pub fn to_json(alerts: &[Alert]) -> Value {
    json!({ "alerts": alerts })
}
