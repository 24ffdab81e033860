//! Global settings (`/NS/settings` in etcd): alert webhooks and clock-skew thresholds.
//!
//! Validated here, once; read and written through `GET/PUT /api/v1/settings`. What is read back
//! from etcd goes through the same validation: a document written by hand that would not pass
//! `PUT` is refused with the field at fault. The leader re-reads them every couple of seconds
//! ([`poll`]), so a change takes effect without a restart; while the stored settings are
//! invalid it keeps the last valid ones and raises `invalid_settings`.

use std::time::Duration;

use etcd_client::Client;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sluice_protocol::Keys;
use tokio::sync::watch;
use tracing::warn;

use crate::alerts::{AlertTx, Condition, Signal};
use crate::election::{ETCD_TIMEOUT, LeaderContext};
use crate::error::{Error, Result, etcd};
use crate::spec::FieldError;
use crate::tasks::put_if_version;
use crate::webhook;

/// Most webhooks.
pub const MAX_WEBHOOKS: usize = 16;

/// The global settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// URLs that receive every alert as a JSON POST.
    pub webhooks: Vec<String>,
    /// A host whose |clock offset to Redis| exceeds this is flagged (ms).
    pub skew_threshold_ms: u64,
    /// An alert episode is resolved after this long without a new trigger (ms).
    pub alert_quiet_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            webhooks: Vec::new(),
            skew_threshold_ms: 100,
            alert_quiet_ms: 10_000,
        }
    }
}

fn fe(field: impl Into<String>, error: impl Into<String>) -> FieldError {
    FieldError {
        error: error.into(),
        field: field.into(),
    }
}

/// A settings write: the settings and the optional `version` the client read.
#[derive(Debug, Clone, PartialEq)]
pub struct SettingsRequest {
    /// The new settings.
    pub settings: Settings,
    /// Expected version (etcd mod revision; 0 = never written).
    pub version: Option<i64>,
}

/// A `PUT /api/v1/settings` body as serde reads it (types and structure; the ranges and the
/// URLs are checked in [`parse_request`]). `null` counts as absent.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsBody {
    #[serde(default)]
    webhooks: Option<Vec<String>>,
    #[serde(default)]
    skew_threshold_ms: Option<u64>,
    #[serde(default)]
    alert_quiet_ms: Option<u64>,
    #[serde(default)]
    version: Option<i64>,
}

/// Ranges of the counts: (field, min, max).
const SKEW_THRESHOLD_MS: (&str, u64, u64) = ("skew_threshold_ms", 1, 60_000);
const ALERT_QUIET_MS: (&str, u64, u64) = ("alert_quiet_ms", 1_000, 3_600_000);
const VERSION_HINT: &str = "must be a whole number ≥ 0 (as returned by GET)";

fn count_hint((_, min, max): (&str, u64, u64)) -> String {
    format!("must be a whole number from {min} to {max}")
}

/// Parses and validates a `PUT /api/v1/settings` body. Absent fields keep their defaults.
pub fn parse_request(body: &[u8]) -> std::result::Result<SettingsRequest, FieldError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| fe("", format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(fe("", "must be a JSON object"));
    }
    let b: SettingsBody = crate::spec::from_json(&v, |field| match field {
        "webhooks" => Some("must be a list of URLs".into()),
        f if f.starts_with("webhooks[") => Some("must be a string".into()),
        "skew_threshold_ms" => Some(count_hint(SKEW_THRESHOLD_MS)),
        "alert_quiet_ms" => Some(count_hint(ALERT_QUIET_MS)),
        "version" => Some(VERSION_HINT.into()),
        _ => None,
    })?;
    let mut s = Settings::default();
    if let Some(list) = b.webhooks {
        if list.len() > MAX_WEBHOOKS {
            return Err(fe("webhooks", format!("at most {MAX_WEBHOOKS} webhooks")));
        }
        for (i, u) in list.into_iter().enumerate() {
            webhook::check_syntax(&u).map_err(|e| fe(format!("webhooks[{i}]"), e))?;
            s.webhooks.push(u);
        }
    }
    let count = |(k, min, max): (&str, u64, u64), given: Option<u64>, default: u64| match given {
        None => Ok(default),
        Some(n) if (min..=max).contains(&n) => Ok(n),
        Some(n) => Err(fe(k, format!("{}, got {n}", count_hint((k, min, max))))),
    };
    s.skew_threshold_ms = count(SKEW_THRESHOLD_MS, b.skew_threshold_ms, s.skew_threshold_ms)?;
    s.alert_quiet_ms = count(ALERT_QUIET_MS, b.alert_quiet_ms, s.alert_quiet_ms)?;
    let version = match b.version {
        Some(n) if n < 0 => return Err(fe("version", format!("{VERSION_HINT}, got {n}"))),
        v => v,
    };
    Ok(SettingsRequest {
        settings: s,
        version,
    })
}

impl Settings {
    /// The settings as every API answer shows them: webhook URLs [`webhook::redact`]ed.
    pub fn redacted(&self) -> Self {
        Self {
            webhooks: self.webhooks.iter().map(|u| webhook::redact(u)).collect(),
            ..self.clone()
        }
    }

    /// Does any webhook entry stand for a stored one (a redacted URL sent back)?
    pub fn has_redacted(&self) -> bool {
        self.webhooks.iter().any(|u| webhook::is_redacted(u))
    }
}

/// Replaces each redacted entry of `new` (`scheme://host/…`, as `GET` shows them) by the stored
/// webhook it stands for, so settings read, edited and written back keep their URLs. An entry
/// that matches no stored webhook, or that is ambiguous (several stored webhooks redact to it and
/// not all of them are sent back), is an error naming it.
///
/// ```
/// use sluice_manager::settings::keep_redacted;
/// let stored = vec!["https://a.example/s/1".to_string(), "https://a.example/s/2".into(),
///                   "https://b.example/s/3".into()];
/// let mut new = vec!["https://b.example/…".to_string(), "https://c.example/new".into()];
/// keep_redacted(&mut new, &stored).unwrap();
/// assert_eq!(new, ["https://b.example/s/3", "https://c.example/new"]);
/// let mut both = vec!["https://a.example/…".to_string(), "https://a.example/…".into()];
/// keep_redacted(&mut both, &stored).unwrap();
/// assert_eq!(both, ["https://a.example/s/1", "https://a.example/s/2"]);
/// let mut one = vec!["https://a.example/…".to_string()];
/// assert_eq!(keep_redacted(&mut one, &stored).unwrap_err().field, "webhooks[0]");
/// let mut gone = vec!["https://z.example/…".to_string()];
/// assert_eq!(keep_redacted(&mut gone, &stored).unwrap_err().field, "webhooks[0]");
/// ```
pub fn keep_redacted(new: &mut [String], stored: &[String]) -> std::result::Result<(), FieldError> {
    let mut used: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut sent_back: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for u in new.iter().filter(|u| webhook::is_redacted(u)) {
        *sent_back.entry(u.clone()).or_insert(0) += 1;
    }
    for (i, entry) in new.iter_mut().enumerate() {
        if !webhook::is_redacted(entry) {
            continue;
        }
        let shown = entry.clone();
        let candidates: Vec<&String> = stored
            .iter()
            .filter(|u| webhook::redact(u) == shown)
            .collect();
        let sent = sent_back.get(&shown).copied().unwrap_or(0);
        let field = format!("webhooks[{i}]");
        if candidates.is_empty() {
            return Err(fe(
                field,
                format!(
                    "{shown} is a redacted URL that matches no stored webhook; give the full URL"
                ),
            ));
        }
        if candidates.len() > 1 && sent != candidates.len() {
            return Err(fe(
                field,
                format!(
                    "{shown} is ambiguous: {} stored webhooks redact to it and {sent} are sent back; give the full URLs",
                    candidates.len()
                ),
            ));
        }
        let k = used.entry(shown).or_insert(0);
        *entry = candidates[*k].clone();
        *k += 1;
    }
    Ok(())
}

/// The `PUT` check of every webhook's destination ([`webhook::check_destination`]): the error
/// names the entry.
pub async fn check_destinations(
    settings: &Settings,
    allow_private: bool,
) -> std::result::Result<(), FieldError> {
    for (i, u) in settings.webhooks.iter().enumerate() {
        let field = format!("webhooks[{i}]");
        let url = webhook::check_syntax(u).map_err(|e| fe(&field, e))?;
        webhook::check_destination(&url, allow_private)
            .await
            .map_err(|e| fe(&field, format!("{}: {e}", webhook::redact(u))))?;
    }
    Ok(())
}

/// Reads the settings and their version (0 = never written: defaults); [`Error::Invalid`] when
/// the stored document does not validate.
pub async fn load(client: &Client, keys: &Keys) -> Result<(Settings, i64)> {
    let mut c = client.clone();
    let resp = etcd(
        "get settings",
        ETCD_TIMEOUT,
        c.get(keys.etcd_settings(), None),
    )
    .await?;
    match resp.kvs().first() {
        None => Ok((Settings::default(), 0)),
        Some(kv) => {
            let version = kv.mod_revision();
            let invalid = |error| Error::Invalid {
                what: "settings",
                version,
                error,
            };
            let req = parse_request(kv.value()).map_err(invalid)?;
            if req.version.is_some() {
                return Err(invalid(fe("version", "is not part of the stored settings")));
            }
            Ok((req.settings, version))
        }
    }
}

/// Writes the settings; with `expected`, only if the stored version still matches. Returns the
/// new version, or `Err(current)` on a conflict.
pub async fn store(
    client: &Client,
    keys: &Keys,
    settings: &Settings,
    expected: Option<i64>,
) -> Result<std::result::Result<i64, i64>> {
    let key = keys.etcd_settings();
    let value = serde_json::to_vec(settings).map_err(|e| Error::Corrupt {
        what: "settings".into(),
        why: e.to_string(),
    })?;
    match expected {
        Some(v) => put_if_version(client, "put settings", &key, value, v).await,
        None => {
            let mut c = client.clone();
            let resp = etcd("put settings", ETCD_TIMEOUT, c.put(key, value, None)).await?;
            Ok(Ok(resp.header().map_or(0, |h| h.revision())))
        }
    }
}

/// How often the leader re-reads the settings.
pub const POLL: Duration = Duration::from_secs(2);

/// The leader's settings loop: re-reads `/NS/settings` every [`POLL`] and publishes valid
/// settings on `tx`; invalid ones are logged (once per version), reported as `invalid_settings`
/// and ignored (the last valid settings stay in force).
pub async fn poll(
    ctx: LeaderContext,
    etcd: Client,
    keys: Keys,
    tx: watch::Sender<Settings>,
    alerts: AlertTx,
) {
    let mut interval = tokio::time::interval(POLL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = 0;
    loop {
        tokio::select! {
            _ = ctx.token().cancelled() => return,
            _ = interval.tick() => {}
        }
        let present = match load(&etcd, &keys).await {
            Ok((s, _)) => {
                tx.send_if_modified(|cur| {
                    let changed = *cur != s;
                    *cur = s;
                    changed
                });
                Vec::new()
            }
            Err(Error::Invalid { version, error, .. }) => {
                if warned != version {
                    warned = version;
                    warn!(
                        version,
                        field = error.field,
                        error = error.error,
                        "stored settings are invalid; keeping the last valid ones"
                    );
                }
                let mut c = Condition::new(
                    "settings",
                    "invalid_settings",
                    format!(
                        "the stored settings (version {version}) are invalid: {}: {}; the last valid settings stay in force (fix them with PUT /api/v1/settings)",
                        error.field, error.error
                    ),
                );
                c.details = json!({"version": version, "field": error.field, "error": error.error});
                vec![c]
            }
            Err(_) => continue, // etcd unreachable: nothing to say about the settings
        };
        alerts.send(Signal::State {
            kind: "invalid_settings",
            scope: String::new(),
            present,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let r = parse_request(b"{}").unwrap();
        assert_eq!(r.settings, Settings::default());
        let r =
            parse_request(br#"{"webhooks": ["http://127.0.0.1:9/x"], "skew_threshold_ms": 50}"#)
                .unwrap();
        assert_eq!(r.settings.webhooks, ["http://127.0.0.1:9/x"]);
        assert_eq!(r.settings.skew_threshold_ms, 50);
        for (body, field) in [
            (&b"nope"[..], ""),
            (br#"{"webhooks": "http://x"}"#, "webhooks"),
            (br#"{"webhooks": ["ftp://x"]}"#, "webhooks[0]"),
            (br#"{"webhooks": ["not a url"]}"#, "webhooks[0]"),
            (br#"{"webhooks": [5]}"#, "webhooks[0]"),
            (br#"{"skew_threshold_ms": 0}"#, "skew_threshold_ms"),
            (br#"{"skew_threshold_ms": -1}"#, "skew_threshold_ms"),
            (br#"{"alert_quiet_ms": 10}"#, "alert_quiet_ms"),
            (br#"{"version": "x"}"#, "version"),
            (br#"{"webhook": []}"#, "webhook"),
        ] {
            let e = parse_request(body).unwrap_err();
            assert_eq!(e.field, field, "{}", String::from_utf8_lossy(body));
        }
        // The messages: what the field takes (serde's words after it for a wrong type).
        for (body, words) in [
            (
                &br#"{"webhooks": "http://x"}"#[..],
                "must be a list of URLs (invalid type: string",
            ),
            (
                br#"{"webhooks": [5]}"#,
                "must be a string (invalid type: integer `5`",
            ),
            (
                br#"{"skew_threshold_ms": 0}"#,
                "must be a whole number from 1 to 60000, got 0",
            ),
            (
                br#"{"skew_threshold_ms": -1}"#,
                "must be a whole number from 1 to 60000 (invalid value",
            ),
            (br#"{"version": -2}"#, "≥ 0 (as returned by GET), got -2"),
            (
                br#"{"webhook": []}"#,
                "unknown field `webhook`, expected one of `webhooks`",
            ),
            (br#"[]"#, "must be a JSON object"),
        ] {
            let e = parse_request(body).unwrap_err();
            assert!(
                e.error.contains(words),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.error
            );
        }
        let r = parse_request(br#"{"webhooks": null, "version": null, "alert_quiet_ms": null}"#)
            .unwrap();
        assert_eq!((r.settings, r.version), (Settings::default(), None));
    }
}
