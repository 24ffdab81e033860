//! Alerts: one pipeline for every kind (`clock_skew`, `fence_conflict`, `invalid_spec`,
//! `invalid_settings`).
//!
//! ```text
//!  detectors ──Signal──▶ alert loop (episodes) ──emit──▶ XADD NS:alerts (capped)
//!  (skew, roller,          │ NS:alerts:state              ──▶ log + sluice_alerts_total{kind}
//!   settings)              │                              └─ try_send ──▶ webhook sender
//!                          ▼                              ──POST (retries, backoff)──▶ URL
//!                    firing / resolved               delivered: ZADD NS:alerts:sent "<id> <fp>"
//! ```
//!
//! Detectors never talk to Redis or webhooks for alerts: they send [`Signal`]s — momentary
//! observations ([`Signal::Seen`], resolved after a quiet period) or the full set of a level
//! condition ([`Signal::State`], resolved as soon as it is no longer reported) — and the
//! [`run`] loop owns the episodes.
//!
//! The detector never waits for a webhook: deliveries go through a bounded queue to their own
//! tasks, each bounded in time. A delivery is recorded in Redis, so a new leader delivers what
//! its predecessor left pending (the last ten minutes) and never resends what was delivered.
//! Episodes (one firing and one resolved alert per incident) are tracked by the detectors in
//! `NS:alerts:state`, which also survives a failover.
//!
//! Deliveries go through [`crate::webhook`]'s client (trusted roots, destination checks, no
//! redirects, timeouts). A webhook URL is a secret: logs show it redacted (`scheme://host/…`)
//! and `NS:alerts:sent` records a fingerprint of it (`<fp>`), never the URL. Retries back off
//! exponentially with jitter; an answer that retrying cannot fix (a 3xx — redirects are not
//! followed — or a 4xx other than 408/429, or a refused destination) ends the delivery at once.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sluice_protocol::conn::Redis;
use sluice_protocol::{Keys, unix_ms};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::election::LeaderContext;
use crate::error::{Result, redis as redis_err};
use crate::metrics::Metrics;
use crate::settings::Settings;
use crate::webhook::{self, Webhooks};

/// Alerts kept in the stream (approximately).
pub const STREAM_CAP: usize = 10_000;
/// Webhook deliveries queued at most; more are dropped (and counted).
pub const QUEUE_CAP: usize = 1_000;
/// Attempts per delivery.
pub const ATTEMPTS: u32 = 5;
/// Deliveries in flight at once.
const IN_FLIGHT: usize = 8;
/// First pause between attempts (doubled each time, ±50 % jitter).
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
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
    /// `clock_skew`, `fence_conflict`, `invalid_spec`, `invalid_settings`.
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
    webhooks: Webhooks,
}

impl Alerts {
    /// A sink and its webhook sender (runs until `stop`).
    pub fn start(
        keys: Keys,
        redis: Arc<Redis>,
        metrics: Arc<Metrics>,
        webhooks: Webhooks,
        stop: CancellationToken,
    ) -> Self {
        let (tx, rx) = mpsc::channel(QUEUE_CAP);
        let me = Self {
            keys,
            redis,
            metrics,
            queue: tx,
            webhooks,
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
                    .arg(sent_member(&a.id, url))
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
        let http = self.webhooks.http.clone();
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
        let shown = webhook::redact(&d.url);
        let id = d.alert.id.as_str();
        let url = match webhook::check_syntax(&d.url)
            .and_then(|u| webhook::check_literal(&u, self.webhooks.allow_private).map(|()| u))
        {
            Ok(u) => u,
            Err(e) => {
                self.metrics.webhook_failures.inc();
                warn!(
                    url = shown,
                    id,
                    error = e,
                    "webhook destination refused; not delivered"
                );
                return;
            }
        };
        let mut backoff = FIRST_BACKOFF;
        for attempt in 1..=ATTEMPTS {
            let (why, retry) = match http.post(url.clone()).json(&body).send().await {
                Ok(resp) if resp.status().is_success() => {
                    self.metrics.webhook_deliveries.inc();
                    debug!(url = shown, id, attempt, "webhook delivered");
                    self.record_sent(&d).await;
                    return;
                }
                Ok(resp) => {
                    let st = resp.status();
                    let retry = st.is_server_error() || st.as_u16() == 408 || st.as_u16() == 429;
                    let why = if st.is_redirection() {
                        format!("answered {st} (redirects are not followed)")
                    } else {
                        format!("answered {st}")
                    };
                    (why, retry)
                }
                Err(e) => (webhook::error_text(e), true),
            };
            self.metrics.webhook_failures.inc();
            if !retry || attempt == ATTEMPTS {
                warn!(
                    url = shown,
                    id,
                    attempt,
                    error = why,
                    "webhook delivery failed; giving up"
                );
                return;
            }
            let pause = jitter(backoff);
            warn!(url = shown, id, attempt, error = why, retry_in = ?pause, "webhook delivery failed");
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            backoff *= 2;
        }
    }

    async fn record_sent(&self, d: &Delivery) {
        if let Ok(mut c) = self.redis.conn().await {
            let _: redis::RedisResult<()> = redis::pipe()
                .cmd("ZADD")
                .arg(self.keys.alerts_sent())
                .arg(d.alert.at_ms)
                .arg(sent_member(&d.alert.id, &d.url))
                .ignore()
                .cmd("ZREMRANGEBYSCORE")
                .arg(self.keys.alerts_sent())
                .arg("-inf")
                .arg(d.alert.at_ms - 24 * 3_600_000)
                .ignore()
                .query_async(&mut c)
                .await;
        }
    }
}

/// The `NS:alerts:sent` member of a delivery: alert id and the URL's fingerprint.
fn sent_member(id: &str, url: &str) -> String {
    format!("{id} {}", webhook::fingerprint(url))
}

/// `d` ± 50 %, so deliveries failing together do not retry together.
fn jitter(d: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    d.mul_f64(0.5 + (r % 1_000) as f64 / 1_000.0)
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
    /// What the episode is about: `task:<T>`, `host:<H>`, `spec:<T>`, `fence:<epoch>`, ….
    pub key: String,
    /// Episode id.
    pub id: String,
    /// When it started.
    pub since_ms: i64,
    /// Last time its condition was seen.
    pub last_ms: i64,
    /// Alert kind.
    #[serde(default = "default_kind")]
    pub kind: String,
    /// The task, for task alerts.
    #[serde(default)]
    pub task: Option<String>,
    /// The host, for host alerts.
    #[serde(default)]
    pub host: Option<String>,
    /// A level condition: resolved when its detector no longer reports it (see
    /// [`Signal::State`]), not after a quiet period.
    #[serde(default)]
    pub level: bool,
}

fn default_kind() -> String {
    "clock_skew".into()
}

/// What an [`Episodes`] update decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// A new episode starts: send a firing alert.
    Fire(Episode),
    /// The episode is over: send a resolved alert.
    Resolve(Episode),
}

/// Hysteresis over conditions keyed like [`Episode::key`]: one firing alert when a condition
/// starts, one resolved alert when it ends — after `quiet_ms` without it for momentary
/// conditions, as soon as its detector stops reporting it for level ones (pure; the caller
/// persists).
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

    /// The condition `c` was seen at `now` (`level`: see [`Episode::level`]).
    ///
    /// ```
    /// use sluice_manager::alerts::{Condition, Episodes, Transition};
    /// let mut e = Episodes::default();
    /// let c = Condition::new("task:a", "clock_skew", "skew");
    /// assert!(matches!(e.seen(&c, false, 1_000), Some(Transition::Fire(_))));
    /// assert_eq!(e.seen(&c, false, 1_500), None);          // same episode
    /// assert_eq!(e.quiet_check(5_000, 10_000), vec![]);   // not quiet long enough
    /// assert!(matches!(e.quiet_check(11_600, 10_000)[..], [Transition::Resolve(_)]));
    /// ```
    pub fn seen(&mut self, c: &Condition, level: bool, now_ms: i64) -> Option<Transition> {
        match self.open.get_mut(&c.key) {
            Some(e) => {
                e.last_ms = now_ms;
                None
            }
            None => {
                let e = Episode {
                    key: c.key.clone(),
                    id: format!("{}@{now_ms}", c.key),
                    since_ms: now_ms,
                    last_ms: now_ms,
                    kind: c.kind.to_string(),
                    task: c.task.clone(),
                    host: c.host.clone(),
                    level,
                };
                self.open.insert(c.key.clone(), e.clone());
                Some(Transition::Fire(e))
            }
        }
    }

    /// Resolves every momentary episode not seen for `quiet_ms`.
    pub fn quiet_check(&mut self, now_ms: i64, quiet_ms: u64) -> Vec<Transition> {
        let done: Vec<String> = self
            .open
            .iter()
            .filter(|(_, e)| !e.level && now_ms.saturating_sub(e.last_ms) >= quiet_ms as i64)
            .map(|(k, _)| k.clone())
            .collect();
        self.take(done)
    }

    /// Resolves the level episodes of `kind` whose key starts with `scope` and is not in
    /// `present`.
    ///
    /// ```
    /// use sluice_manager::alerts::{Condition, Episodes, Transition};
    /// let mut e = Episodes::default();
    /// let c = Condition::new("spec:a", "invalid_spec", "bad");
    /// e.seen(&c, true, 1_000);
    /// assert_eq!(e.quiet_check(99_000, 10_000), vec![]); // level: no quiet resolution
    /// assert_eq!(e.resolve_absent("invalid_spec", "", &["spec:a"]), vec![]);
    /// assert_eq!(e.resolve_absent("invalid_spec", "spec:b", &[]), vec![]); // another scope
    /// assert!(matches!(e.resolve_absent("invalid_spec", "", &[])[..], [Transition::Resolve(_)]));
    /// ```
    pub fn resolve_absent(&mut self, kind: &str, scope: &str, present: &[&str]) -> Vec<Transition> {
        let done: Vec<String> = self
            .open
            .iter()
            .filter(|(k, e)| {
                e.level && e.kind == kind && k.starts_with(scope) && !present.contains(&k.as_str())
            })
            .map(|(k, _)| k.clone())
            .collect();
        self.take(done)
    }

    fn take(&mut self, keys: Vec<String>) -> Vec<Transition> {
        keys.into_iter()
            .filter_map(|k| self.open.remove(&k))
            .map(Transition::Resolve)
            .collect()
    }

    /// Ids of open episodes.
    pub fn ids(&self) -> Vec<String> {
        self.open.values().map(|e| e.id.clone()).collect()
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

/// Loads open episodes from `NS:alerts:state`; entries that do not parse, or whose times are
/// not plausible Unix milliseconds (`0..=now + 1 day`), are dropped.
pub async fn load_episodes(redis: &Redis, keys: &Keys, now_ms: i64) -> Result<Episodes> {
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let all: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.alert_state())
        .query_async(&mut c)
        .await
        .map_err(redis_err("alert state"))?;
    let plausible = |t: i64| (0..=now_ms + 86_400_000).contains(&t);
    Ok(Episodes::restore(all.into_iter().filter_map(|(k, v)| {
        let e = serde_json::from_str::<Episode>(&v).ok();
        match e {
            Some(e) if e.key == k && plausible(e.since_ms) && plausible(e.last_ms) => Some((k, e)),
            _ => {
                warn!(key = k, "ignoring an unreadable open alert episode");
                None
            }
        }
    })))
}

/// A condition a detector reports to the alert loop ([`run`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    /// The episode key: one episode per key at a time.
    pub key: String,
    /// Alert kind (`clock_skew`, `fence_conflict`, `invalid_spec`, `invalid_settings`).
    pub kind: &'static str,
    /// The task, for task alerts.
    pub task: Option<String>,
    /// The host, for host alerts.
    pub host: Option<String>,
    /// Human-readable summary (of the firing alert).
    pub message: String,
    /// Kind-specific details.
    pub details: Value,
}

impl Condition {
    /// A condition without task, host or details.
    pub fn new(key: impl Into<String>, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            kind,
            task: None,
            host: None,
            message: message.into(),
            details: json!({}),
        }
    }
}

/// What detectors send to the alert loop.
#[derive(Debug, Clone, PartialEq)]
pub enum Signal {
    /// A momentary observation: fires an episode if none is open for its key; the episode
    /// resolves after `alert_quiet_ms` without another (clock skew).
    Seen(Condition),
    /// Every condition of `kind` present now (level-triggered, sent every round): new ones
    /// fire, open episodes of that kind (whose key starts with `scope`) missing from the list
    /// resolve. A new leader's first report therefore also resolves what its predecessor left
    /// open.
    State {
        /// The kind reported.
        kind: &'static str,
        /// Only episodes whose key starts with this are this reporter's to resolve (`""`: all).
        scope: String,
        /// The conditions present.
        present: Vec<Condition>,
    },
}

/// The detectors' end of the alert loop: never blocks (a full queue drops the signal and
/// counts it; level signals are repeated anyway).
#[derive(Clone)]
pub struct AlertTx {
    tx: mpsc::Sender<Signal>,
    metrics: Arc<Metrics>,
}

impl AlertTx {
    /// Sends a signal.
    pub fn send(&self, s: Signal) {
        if self.tx.try_send(s).is_err() {
            self.metrics.alert_signals_dropped.inc();
        }
    }
}

/// A channel from the detectors to [`run`].
pub fn channel(metrics: Arc<Metrics>) -> (AlertTx, mpsc::Receiver<Signal>) {
    let (tx, rx) = mpsc::channel(QUEUE_CAP);
    (AlertTx { tx, metrics }, rx)
}

/// The leader's alert loop: owns the episodes (loaded from `NS:alerts:state`, so a new leader
/// continues them), turns [`Signal`]s into firing and resolved alerts, resolves quiet
/// episodes, and sends what a new webhook should know.
pub async fn run(
    ctx: LeaderContext,
    keys: Keys,
    redis: Arc<Redis>,
    metrics: Arc<Metrics>,
    webhooks: Webhooks,
    mut settings: watch::Receiver<Settings>,
    mut rx: mpsc::Receiver<Signal>,
) {
    let sink = Alerts::start(
        keys.clone(),
        redis.clone(),
        metrics.clone(),
        webhooks,
        ctx.token().clone(),
    );
    let mut episodes = match load_episodes(&redis, &keys, unix_ms()).await {
        Ok(e) => e,
        Err(e) => {
            warn!(%e, "cannot load open alert episodes; starting fresh");
            Episodes::default()
        }
    };
    let mut cfg = settings.borrow_and_update().clone();
    match sink.redeliver_pending(&cfg.webhooks, unix_ms(), None).await {
        Ok(n) if n > 0 => debug!(n, "re-queued undelivered webhook alerts"),
        Ok(_) => {}
        Err(e) => warn!(%e, "cannot check undelivered alerts"),
    }
    let mut interval = tokio::time::interval(Duration::from_millis(250));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut fired: Vec<(Transition, String, Value)> = Vec::new();
        tokio::select! {
            _ = ctx.token().cancelled() => return,
            r = settings.changed() => {
                if r.is_err() { return }
                let new = settings.borrow_and_update().clone();
                let added: Vec<String> = new
                    .webhooks
                    .iter()
                    .filter(|u| !cfg.webhooks.contains(u))
                    .cloned()
                    .collect();
                if !added.is_empty() {
                    // A new webhook learns what is firing now.
                    let open = episodes.ids();
                    if let Err(e) = sink.redeliver_pending(&added, unix_ms(), Some(&open)).await {
                        warn!(%e, "cannot send open alerts to a new webhook");
                    }
                }
                cfg = new;
            }
            s = rx.recv() => {
                let Some(s) = s else { return };
                let now = unix_ms();
                match s {
                    Signal::Seen(c) => {
                        if let Some(t) = episodes.seen(&c, false, now) {
                            fired.push((t, c.message, c.details));
                        }
                    }
                    Signal::State { kind, scope, present } => {
                        let keys_present: Vec<&str> = present.iter().map(|c| c.key.as_str()).collect();
                        for t in episodes.resolve_absent(kind, &scope, &keys_present) {
                            let msg = resolved_message(&t, cfg.alert_quiet_ms);
                            fired.push((t, msg, json!({})));
                        }
                        for c in present {
                            if let Some(t) = episodes.seen(&c, true, now) {
                                fired.push((t, c.message, c.details));
                            }
                        }
                    }
                }
            }
            _ = interval.tick() => {
                let quiet = cfg.alert_quiet_ms;
                for t in episodes.quiet_check(unix_ms(), quiet) {
                    let msg = resolved_message(&t, quiet);
                    fired.push((t, msg, json!({})));
                }
            }
        }
        for (t, message, details) in fired {
            if !ctx.is_valid() {
                return;
            }
            let (state, episode) = match t {
                Transition::Fire(e) => (AlertState::Firing, e),
                Transition::Resolve(e) => (AlertState::Resolved, e),
            };
            let kept = (state == AlertState::Firing).then_some(&episode);
            if let Err(e) = persist_episode(&redis, &keys, &episode.key, kept).await {
                warn!(%e, "cannot persist alert episode");
            }
            let alert = Alert {
                id: String::new(),
                kind: episode.kind.clone(),
                task: episode.task.clone(),
                host: episode.host.clone(),
                message,
                at_ms: unix_ms(),
                state,
                episode: episode.id.clone(),
                details,
            };
            if let Err(e) = sink.emit(alert, &cfg.webhooks).await {
                warn!(%e, "cannot record alert");
            }
        }
    }
}

/// The message of a resolved alert, by kind.
fn resolved_message(t: &Transition, quiet_ms: u64) -> String {
    let Transition::Resolve(e) = t else {
        return String::new();
    };
    let task = e.task.as_deref().unwrap_or("?");
    match e.kind.as_str() {
        "clock_skew" => format!("{}: no clock skew seen for {} s", e.key, quiet_ms / 1000),
        "invalid_spec" => format!("task {task}: the stored spec was fixed or deleted"),
        "invalid_settings" => "the stored settings are valid again".to_string(),
        "fence_conflict" => format!(
            "{}: no fence conflict any more (the other writer stopped and its fence was taken over, or it left)",
            e.key
        ),
        _ => format!("{}: resolved", e.key),
    }
}

/// `{"alerts": [...]}` for the API.
pub fn to_json(alerts: &[Alert]) -> Value {
    json!({ "alerts": alerts })
}
