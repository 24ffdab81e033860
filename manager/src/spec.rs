//! Task specs: the JSON users write, its validation, and what the SDK gets from it.
//!
//! This module is the only place a spec is validated. Parsing goes through
//! [`serde_json::Value`] by hand rather than `#[derive(Deserialize)]`: every error names the
//! exact field (`schedules[1].cron`, `dynamic.min`), which the API returns as
//! `{"error": ..., "field": ...}` with status 400, and says what the field takes in the
//! user's words (`must be a whole number from 0 to 1000000000000`, not serde's `expected
//! u64`). `serde_path_to_error` would give the path (the health report and the agent's bodies
//! use it: [`from_json`]), but most of a spec's rules are not types: ranges, defaults taken
//! from other fields (`local_limit` = `threshold`, `dynamic.max`), `null` as absent, fields
//! allowed by `mode` only, `key_overrides["<key>"]` paths with the key validated, and the same
//! rules applied to documents read back from etcd ([`parse_stored`]). A derive would hold the
//! structure and leave all of that here, with messages for type errors that say less.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sluice_protocol::{
    Fallback, FallbackAlgorithm, MAX_KEY_OVERRIDES, MAX_SLICE_MS, MIN_SLICE_MS, Mode, OnFailure,
    Pacing, TaskMeta,
};

use crate::schedule::{DEFAULT_TIMEZONE, parse_cron, parse_timezone};

/// Largest threshold (permits per slice) and other counts (the protocol's, shared by every door).
pub use sluice_protocol::MAX_COUNT;
/// Most schedule entries per task.
pub const MAX_SCHEDULES: usize = 64;
/// Longest description, in characters.
pub const MAX_DESCRIPTION: usize = 1024;

/// One cron schedule entry: slices whose start matches `cron` get `threshold`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleEntry {
    /// Cron expression with a seconds field, evaluated on the wall clock of `timezone`.
    pub cron: String,
    /// Threshold for matching slices.
    pub threshold: u64,
    /// IANA time zone of `cron` (`"Europe/Berlin"`), [`DEFAULT_TIMEZONE`] unless given. The
    /// default is neither stored nor returned, so specs written before zones existed and
    /// clients that do not know the field round-trip unchanged.
    #[serde(
        default = "default_timezone",
        skip_serializing_if = "is_default_timezone"
    )]
    pub timezone: String,
}

fn default_timezone() -> String {
    DEFAULT_TIMEZONE.to_string()
}

fn is_default_timezone(tz: &str) -> bool {
    tz == DEFAULT_TIMEZONE
}

/// Dynamic limiting settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DynamicSpec {
    /// Whether the controller adjusts this task.
    pub enabled: bool,
    /// Lowest threshold the controller may set.
    pub min: u64,
    /// Highest threshold the controller may set.
    pub max: u64,
    /// Error rate above which the service is unhealthy.
    pub target_error_rate: f64,
    /// Mean latency (ms) above which the service is unhealthy.
    pub target_latency_ms: f64,
    /// Additive increase per control period; 0 = automatic: (max − min) / 100, at least 1.
    #[serde(default)]
    pub increase_step: u64,
    /// Multiplicative decrease factor, in (0, 1).
    #[serde(default = "default_decrease_factor")]
    pub decrease_factor: f64,
}

fn default_decrease_factor() -> f64 {
    0.8
}

impl DynamicSpec {
    /// The additive increase per control period.
    pub fn step(&self) -> u64 {
        if self.increase_step > 0 {
            self.increase_step
        } else {
            (self.max.saturating_sub(self.min) / 100).max(1)
        }
    }
}

/// A validated task spec, as stored in etcd (all defaults filled in).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    /// Permits per slice.
    pub threshold: u64,
    /// Slice length in ms.
    pub slice_ms: u64,
    /// Pull chunk size; 0 = automatic.
    pub pull: u64,
    /// Per-host permits per slice while FAILED (and in mode `local`).
    pub local_limit: u64,
    /// FAILED behaviour.
    pub on_failure: OnFailure,
    /// Limiting mode.
    pub mode: Mode,
    /// Local limiter.
    pub fallback: Fallback,
    /// Cron schedules, later entries win.
    pub schedules: Vec<ScheduleEntry>,
    /// Dynamic limiting, if configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic: Option<DynamicSpec>,
    /// Free text.
    pub description: String,
    /// Mode `concurrency`: the lease TTL in ms (how long a dead host's permits stay taken);
    /// [`DEFAULT_LEASE_MS`] unless given; stored only for that mode.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lease_ms: u64,
    /// Every distinct key has its own limit of `threshold` permits per slice (mode `pooled`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub keyed: bool,
    /// Keyed tasks: keys with a threshold of their own (at most [`MAX_KEY_OVERRIDES`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub key_overrides: BTreeMap<String, u64>,
    /// Keyed tasks: store and show keys in clear (top keys, key slices). Default false: they
    /// are stored as keyed digests ([`sluice_protocol::key_label`]).
    #[serde(default, skip_serializing_if = "is_false")]
    pub clear_keys: bool,
    /// Shadow mode: decisions are counted as if enforced (`would_reject`) but always admit.
    #[serde(default)]
    pub shadow: bool,
    /// Mode `pooled`: how a slice releases its quota (`none` = all at once, `smooth` = evenly
    /// over the slice, plus `burst`).
    #[serde(default = "default_pacing")]
    pub pacing: Pacing,
    /// Paced slices: permits released at a slice's start on top of the pace (≤ `threshold`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub burst: u64,
}

fn default_pacing() -> Pacing {
    Pacing::None
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Lease TTL of a `concurrency` task unless the spec says otherwise.
pub const DEFAULT_LEASE_MS: u64 = 10_000;
/// Shortest lease TTL: renewals run every third of it and the host stops handing out permits
/// a safety margin before it ends, so a shorter one costs many Redis calls.
pub const MIN_LEASE_MS: u64 = 500;
/// Longest lease TTL (10 minutes): a dead host's permits stay taken this long.
pub const MAX_LEASE_MS: u64 = 600_000;

/// A validation error: what is wrong and which field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {error}")]
pub struct FieldError {
    /// Human-readable message.
    pub error: String,
    /// JSON path of the field (`threshold`, `schedules[0].cron`), or `""` for the whole body.
    pub field: String,
}

/// Deserializes a JSON body with serde (`#[serde(deny_unknown_fields)]` types), or says which
/// field is wrong: its JSON path (`serde_path_to_error`: `a.b`, `list[2].c`; `""` for the whole
/// body) and serde's words, after `hint(path)` when it has one (what the field takes, with its
/// range: serde names the type it expected, not the range). serde reports a missing field at
/// the object that lacks it: the field's own name is added to the path then.
///
/// ```
/// use sluice_manager::spec::from_json;
/// #[derive(Debug, serde::Deserialize)]
/// #[serde(deny_unknown_fields)]
/// struct B { rate: f64 }
/// let e = from_json::<B>(&serde_json::json!({"rate": "x"}), |_| Some("a number".into())).unwrap_err();
/// assert_eq!((e.field.as_str(), e.error.as_str()),
///            ("rate", "a number (invalid type: string \"x\", expected f64)"));
/// let e = from_json::<B>(&serde_json::json!({}), |_| None).unwrap_err();
/// assert_eq!((e.field.as_str(), e.error.as_str()), ("rate", "missing field `rate`"));
/// let e = from_json::<B>(&serde_json::json!({"rate": 1, "x": 2}), |_| None).unwrap_err();
/// assert_eq!(e.field, "x");
/// ```
pub fn from_json<T: serde::de::DeserializeOwned>(
    v: &Value,
    hint: impl Fn(&str) -> Option<String>,
) -> Result<T, FieldError> {
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        let mut field = e.path().to_string();
        if field == "." {
            field.clear();
        }
        let words = e.inner().to_string();
        if let Some(name) = words
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
        {
            field = join(&field, name);
        }
        let error = match hint(&field) {
            Some(h) => format!("{h} ({words})"),
            None => words,
        };
        FieldError { error, field }
    })
}

fn fe(field: impl Into<String>, error: impl Into<String>) -> FieldError {
    FieldError {
        error: error.into(),
        field: field.into(),
    }
}

/// A request body parsed into a spec, plus the optional optimistic-concurrency `version`.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecRequest {
    /// The spec.
    pub spec: TaskSpec,
    /// `version` the client read (etcd mod revision; 0 = "must not exist yet").
    pub version: Option<i64>,
}

const TOP_FIELDS: &[&str] = &[
    "threshold",
    "slice_ms",
    "pull",
    "local_limit",
    "on_failure",
    "mode",
    "fallback",
    "schedules",
    "dynamic",
    "description",
    "lease_ms",
    "keyed",
    "key_overrides",
    "clear_keys",
    "shadow",
    "pacing",
    "burst",
    "name",
    "version",
    // Read-only (the live status `GET /tasks/{name}` adds): accepted and ignored, so a
    // GET → edit → PUT round trip works.
    "status",
];

struct Obj<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    fn new(path: &str, v: &'a Value, allowed: &[&str]) -> Result<Self, FieldError> {
        let map = v
            .as_object()
            .ok_or_else(|| fe(path, "must be a JSON object"))?;
        for k in map.keys() {
            if !allowed.contains(&k.as_str()) {
                return Err(fe(
                    join(path, k),
                    format!("unknown field; expected one of: {}", allowed.join(", ")),
                ));
            }
        }
        Ok(Self {
            path: path.to_string(),
            map,
        })
    }

    fn field(&self, k: &str) -> String {
        join(&self.path, k)
    }

    fn get(&self, k: &str) -> Option<&'a Value> {
        self.map.get(k).filter(|v| !v.is_null())
    }

    fn count(&self, k: &str, default: Option<u64>, min: u64, max: u64) -> Result<u64, FieldError> {
        let f = self.field(k);
        let Some(v) = self.get(k) else {
            return default.ok_or_else(|| fe(&f, "is required"));
        };
        let n = v
            .as_u64()
            .ok_or_else(|| fe(&f, format!("must be a whole number from {min} to {max}")))?;
        if n < min || n > max {
            return Err(fe(&f, format!("must be from {min} to {max}, got {n}")));
        }
        Ok(n)
    }

    fn float(&self, k: &str, default: f64, min_excl: f64, max: f64) -> Result<f64, FieldError> {
        let f = self.field(k);
        let Some(v) = self.get(k) else {
            return Ok(default);
        };
        let x = v.as_f64().ok_or_else(|| fe(&f, "must be a number"))?;
        if !(x > min_excl && x <= max) {
            return Err(fe(
                &f,
                format!("must be greater than {min_excl} and at most {max}, got {x}"),
            ));
        }
        Ok(x)
    }

    fn string(&self, k: &str) -> Result<Option<&'a str>, FieldError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| fe(self.field(k), "must be a string")),
        }
    }

    fn choice<T: std::str::FromStr<Err = String>>(
        &self,
        k: &str,
        default: T,
    ) -> Result<T, FieldError> {
        match self.string(k)? {
            None => Ok(default),
            Some(s) => s.parse().map_err(|e: String| fe(self.field(k), e)),
        }
    }
}

fn join(path: &str, k: &str) -> String {
    if path.is_empty() {
        k.to_string()
    } else {
        format!("{path}.{k}")
    }
}

/// Parses and validates a PUT body for task `name`.
///
/// `name` and `version` may appear in the body (as `GET` returns them); a `name` must equal
/// the one in the path. `status` (read-only, from `GET`) is ignored.
pub fn parse_request(name: &str, body: &[u8]) -> Result<SpecRequest, FieldError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| fe("", format!("malformed JSON: {e}")))?;
    let o = Obj::new("", &v, TOP_FIELDS)?;

    if let Some(n) = o.string("name")?
        && n != name
    {
        return Err(fe(
            "name",
            format!("{n:?} does not match the task in the path ({name:?})"),
        ));
    }
    let version = match o.get("version") {
        None => None,
        Some(v) => Some(
            v.as_i64()
                .filter(|n| *n >= 0)
                .ok_or_else(|| fe("version", "must be a whole number ≥ 0 (as returned by GET)"))?,
        ),
    };

    let threshold = o.count("threshold", None, 0, MAX_COUNT)?;
    let slice_ms = o.count("slice_ms", Some(1000), MIN_SLICE_MS, MAX_SLICE_MS)?;
    let pull = o.count("pull", Some(0), 0, MAX_COUNT)?;
    let local_limit = o.count("local_limit", Some(threshold), 0, MAX_COUNT)?;
    let on_failure: OnFailure = o.choice("on_failure", OnFailure::Local)?;
    let mode: Mode = o.choice("mode", Mode::Pooled)?;

    let fallback = match o.get("fallback") {
        None => Fallback::default(),
        Some(v) => {
            let fo = Obj::new("fallback", v, &["algorithm", "burst"])?;
            Fallback {
                algorithm: fo.choice("algorithm", FallbackAlgorithm::TokenBucket)?,
                burst: fo.count("burst", Some(0), 0, MAX_COUNT)?,
            }
        }
    };

    let mut schedules = Vec::new();
    if let Some(v) = o.get("schedules") {
        let arr = v
            .as_array()
            .ok_or_else(|| fe("schedules", "must be a list"))?;
        if arr.len() > MAX_SCHEDULES {
            return Err(fe("schedules", format!("at most {MAX_SCHEDULES} entries")));
        }
        for (i, e) in arr.iter().enumerate() {
            let path = format!("schedules[{i}]");
            let so = Obj::new(&path, e, &["cron", "threshold", "timezone"])?;
            let cron = so
                .string("cron")?
                .ok_or_else(|| fe(so.field("cron"), "is required"))?;
            parse_cron(cron).map_err(|e| fe(so.field("cron"), e))?;
            let threshold = so.count("threshold", None, 0, MAX_COUNT)?;
            let timezone = match so.string("timezone")? {
                None => default_timezone(),
                Some(tz) => {
                    parse_timezone(tz).map_err(|e| fe(so.field("timezone"), e))?;
                    tz.trim().to_string()
                }
            };
            schedules.push(ScheduleEntry {
                cron: cron.trim().to_string(),
                threshold,
                timezone,
            });
        }
    }

    let dynamic = match o.get("dynamic") {
        None => None,
        Some(v) => {
            let d = Obj::new(
                "dynamic",
                v,
                &[
                    "enabled",
                    "min",
                    "max",
                    "target_error_rate",
                    "target_latency_ms",
                    "increase_step",
                    "decrease_factor",
                ],
            )?;
            let enabled = match d.get("enabled") {
                None => false,
                Some(b) => b
                    .as_bool()
                    .ok_or_else(|| fe("dynamic.enabled", "must be true or false"))?,
            };
            let min = d.count("min", Some(1.min(threshold)), 0, MAX_COUNT)?;
            let max = d.count("max", Some(threshold.max(min)), 0, MAX_COUNT)?;
            if min > max {
                return Err(fe(
                    "dynamic.min",
                    format!("{min} is above dynamic.max ({max})"),
                ));
            }
            Some(DynamicSpec {
                enabled,
                min,
                max,
                target_error_rate: d.float("target_error_rate", 0.05, 0.0, 1.0)?,
                target_latency_ms: d.float("target_latency_ms", 1000.0, 0.0, 3_600_000.0)?,
                increase_step: d.count("increase_step", Some(0), 0, MAX_COUNT)?,
                decrease_factor: {
                    let f = d.float("decrease_factor", default_decrease_factor(), 0.0, 1.0)?;
                    if f >= 1.0 {
                        return Err(fe("dynamic.decrease_factor", "must be below 1"));
                    }
                    f
                },
            })
        }
    };

    let lease_ms = if mode == Mode::Concurrency {
        // threshold = permits in flight; slices are not used (slice_ms is kept but ignored).
        if !schedules.is_empty() {
            return Err(fe(
                "schedules",
                "not supported in mode concurrency (the threshold is permits in flight)",
            ));
        }
        if dynamic.as_ref().is_some_and(|d| d.enabled) {
            return Err(fe("dynamic", "not supported in mode concurrency"));
        }
        if threshold > u32::MAX as u64 / 2 {
            return Err(fe(
                "threshold",
                format!("at most {} permits in flight", u32::MAX / 2),
            ));
        }
        o.count(
            "lease_ms",
            Some(DEFAULT_LEASE_MS),
            MIN_LEASE_MS,
            MAX_LEASE_MS,
        )?
    } else {
        if o.get("lease_ms").is_some() {
            return Err(fe("lease_ms", "only for mode concurrency"));
        }
        0
    };

    let keyed = match o.get("keyed") {
        None => false,
        Some(b) => b
            .as_bool()
            .ok_or_else(|| fe("keyed", "must be true or false"))?,
    };
    if keyed && mode != Mode::Pooled {
        return Err(fe(
            "keyed",
            format!("keyed limits need mode pooled (got mode {mode})"),
        ));
    }
    let mut key_overrides = BTreeMap::new();
    if let Some(v) = o.get("key_overrides") {
        let map = v
            .as_object()
            .ok_or_else(|| fe("key_overrides", "must be an object {\"<key>\": threshold}"))?;
        if !keyed && !map.is_empty() {
            return Err(fe(
                "key_overrides",
                "only for keyed tasks (\"keyed\": true)",
            ));
        }
        if map.len() > MAX_KEY_OVERRIDES {
            return Err(fe(
                "key_overrides",
                format!("at most {MAX_KEY_OVERRIDES} entries, got {}", map.len()),
            ));
        }
        for (k, t) in map {
            let f = format!("key_overrides[{}]", serde_json::Value::from(k.as_str()));
            sluice_protocol::validate_key(k).map_err(|e| fe(&f, e.why))?;
            let n = t
                .as_u64()
                .filter(|n| *n <= MAX_COUNT)
                .ok_or_else(|| fe(&f, format!("must be a whole number from 0 to {MAX_COUNT}")))?;
            key_overrides.insert(k.clone(), n);
        }
    }

    let clear_keys = match o.get("clear_keys") {
        None => false,
        Some(b) => b
            .as_bool()
            .ok_or_else(|| fe("clear_keys", "must be true or false"))?,
    };
    if clear_keys && !keyed {
        return Err(fe("clear_keys", "only for keyed tasks (\"keyed\": true)"));
    }

    let shadow = match o.get("shadow") {
        None => false,
        Some(b) => b
            .as_bool()
            .ok_or_else(|| fe("shadow", "must be true or false"))?,
    };
    if shadow && mode == Mode::Concurrency {
        // Permits are not decisions the shadow wrapper sees (a held permit is not undone).
        return Err(fe("shadow", "not supported in mode concurrency"));
    }
    let pacing: Pacing = o.choice("pacing", Pacing::None)?;
    if pacing != Pacing::None && mode != Mode::Pooled {
        return Err(fe(
            "pacing",
            format!(
                "only for mode pooled (mode is {mode}): the other modes have no slices to pace"
            ),
        ));
    }
    if pacing != Pacing::None && keyed {
        return Err(fe(
            "pacing",
            "not supported for keyed tasks yet (a key's slice is not paced)",
        ));
    }
    let burst = o.count("burst", Some(0), 0, MAX_COUNT)?;
    if burst > 0 && pacing == Pacing::None {
        return Err(fe("burst", "only with \"pacing\": \"smooth\""));
    }
    if burst > threshold {
        return Err(fe(
            "burst",
            format!("must be at most threshold ({threshold}), got {burst}"),
        ));
    }

    let description = o.string("description")?.unwrap_or_default().to_string();
    if description.chars().count() > MAX_DESCRIPTION {
        return Err(fe(
            "description",
            format!("at most {MAX_DESCRIPTION} characters"),
        ));
    }

    Ok(SpecRequest {
        spec: TaskSpec {
            threshold,
            slice_ms,
            pull,
            local_limit,
            on_failure,
            mode,
            fallback,
            schedules,
            dynamic,
            description,
            lease_ms,
            keyed,
            key_overrides,
            clear_keys,
            shadow,
            pacing,
            burst,
        },
        version,
    })
}

/// Parses a spec as stored in etcd (`/NS/tasks/<T>`) through the same validation as a `PUT`
/// body: a document written into etcd by hand is held to the API's rules (the stored form
/// has every default filled in, so a valid one parses back to itself).
pub fn parse_stored(name: &str, value: &[u8]) -> Result<TaskSpec, FieldError> {
    let req = parse_request(name, value)?;
    if req.version.is_some() {
        return Err(fe("version", "is not part of a stored spec"));
    }
    Ok(req.spec)
}

impl TaskSpec {
    /// What the SDK needs, with the spec's version.
    pub fn meta(&self, version: i64) -> TaskMeta {
        TaskMeta {
            slice_ms: self.slice_ms,
            threshold: self.threshold,
            pull: self.pull,
            local_limit: self.local_limit,
            on_failure: self.on_failure,
            mode: self.mode,
            fallback: self.fallback,
            version,
            lease_ms: if self.mode == Mode::Concurrency {
                self.lease_ms
            } else {
                0
            },
            keyed: self.keyed,
            key_overrides: self
                .key_overrides
                .iter()
                .map(|(k, t)| (sluice_protocol::key_digest(k), *t))
                .collect(),
            shadow: self.shadow,
            pacing: self.pacing,
            pace_burst: self.burst,
        }
    }

    /// The spec as API JSON, with `name` and `version` added.
    pub fn to_api_json(&self, name: &str, version: i64) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Value::Object(m) = &mut v {
            m.insert("name".into(), Value::from(name));
            m.insert("version".into(), Value::from(version));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<SpecRequest, FieldError> {
        parse_request("t", body.as_bytes())
    }

    #[test]
    fn defaults_are_filled() {
        let r = parse(r#"{"threshold": 100}"#).unwrap();
        assert_eq!(r.spec.slice_ms, 1000);
        assert_eq!(r.spec.local_limit, 100);
        assert_eq!(r.spec.on_failure, OnFailure::Local);
        assert_eq!(r.spec.mode, Mode::Pooled);
        assert_eq!(r.version, None);
    }

    #[test]
    fn a_get_answer_with_its_status_can_be_put_back() {
        let r = parse(
            r#"{"threshold": 100, "name": "t", "version": 7,
                "status": {"effective_threshold": 100, "remaining": 3}}"#,
        )
        .unwrap();
        assert_eq!((r.spec.threshold, r.version), (100, Some(7)));
    }

    #[test]
    fn the_design_example_parses() {
        let r = parse(
            r#"{ "threshold": 5000, "slice_ms": 1000,
  "pull": 0, "local_limit": 500, "on_failure": "local",
  "schedules": [ { "cron": "0 0 9-17 * * Mon-Fri", "threshold": 20000 } ],
  "dynamic": { "enabled": true, "min": 1000, "max": 20000,
               "target_error_rate": 0.05, "target_latency_ms": 200 },
  "description": "checkout API" }"#,
        )
        .unwrap();
        assert_eq!(r.spec.schedules[0].threshold, 20000);
        assert_eq!(r.spec.dynamic.as_ref().unwrap().max, 20000);
        // Round trip through the stored form.
        let stored = serde_json::to_string(&r.spec).unwrap();
        let back: TaskSpec = serde_json::from_str(&stored).unwrap();
        assert_eq!(back, r.spec);
    }

    #[test]
    fn concurrency_specs_get_a_lease_ttl_and_refuse_what_does_not_apply() {
        let r = parse(r#"{"threshold": 20, "mode": "concurrency"}"#).unwrap();
        assert_eq!(r.spec.lease_ms, DEFAULT_LEASE_MS);
        assert_eq!(r.spec.meta(3).lease_ms, DEFAULT_LEASE_MS);
        let r = parse(r#"{"threshold": 20, "mode": "concurrency", "lease_ms": 2000}"#).unwrap();
        assert_eq!(r.spec.lease_ms, 2_000);
        // Stored form round-trips (lease_ms kept), other modes store none.
        let json = serde_json::to_vec(&r.spec).unwrap();
        assert_eq!(parse_stored("t", &json).unwrap(), r.spec);
        let p = parse(r#"{"threshold": 20}"#).unwrap();
        assert!(!serde_json::to_string(&p.spec).unwrap().contains("lease_ms"));
        assert_eq!(p.spec.meta(1).lease_ms, 0);
        for (body, field) in [
            (
                r#"{"threshold": 20, "mode": "concurrency", "lease_ms": 499}"#,
                "lease_ms",
            ),
            (
                r#"{"threshold": 20, "mode": "concurrency", "lease_ms": 600001}"#,
                "lease_ms",
            ),
            (
                r#"{"threshold": 20, "mode": "concurrency", "lease_ms": "1s"}"#,
                "lease_ms",
            ),
            (r#"{"threshold": 20, "lease_ms": 1000}"#, "lease_ms"),
            (
                r#"{"threshold": 20, "mode": "concurrency",
                    "schedules": [{"cron": "* * * * * *", "threshold": 1}]}"#,
                "schedules",
            ),
            (
                r#"{"threshold": 20, "mode": "concurrency", "dynamic": {"enabled": true}}"#,
                "dynamic",
            ),
            (
                r#"{"threshold": 4294967295, "mode": "concurrency"}"#,
                "threshold",
            ),
        ] {
            assert_eq!(parse(body).unwrap_err().field, field, "{body}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("{", ""),
            ("[]", ""),
            (r#"{}"#, "threshold"),
            (r#"{"threshold": -1}"#, "threshold"),
            (r#"{"threshold": 1.5}"#, "threshold"),
            (r#"{"threshold": "10"}"#, "threshold"),
            (r#"{"threshold": 1e13}"#, "threshold"),
            (r#"{"threshold": 10, "slice_ms": 99}"#, "slice_ms"),
            (r#"{"threshold": 10, "slice_ms": 86400001}"#, "slice_ms"),
            (r#"{"threshold": 10, "on_failure": "panic"}"#, "on_failure"),
            (r#"{"threshold": 10, "mode": "x"}"#, "mode"),
            (r#"{"threshold": 10, "bogus": 1}"#, "bogus"),
            (
                r#"{"threshold": 10, "fallback": {"algorithm": "magic"}}"#,
                "fallback.algorithm",
            ),
            (
                r#"{"threshold": 10, "fallback": {"burts": 3}}"#,
                "fallback.burts",
            ),
            (r#"{"threshold": 10, "schedules": {}}"#, "schedules"),
            (
                r#"{"threshold": 10, "schedules": [{"cron": "bad", "threshold": 1}]}"#,
                "schedules[0].cron",
            ),
            (
                r#"{"threshold": 10, "schedules": [{"cron": "* * * * * *"}]}"#,
                "schedules[0].threshold",
            ),
            (
                r#"{"threshold": 10, "dynamic": {"min": 5, "max": 1}}"#,
                "dynamic.min",
            ),
            (
                r#"{"threshold": 10, "dynamic": {"target_error_rate": 2}}"#,
                "dynamic.target_error_rate",
            ),
            (
                r#"{"threshold": 10, "dynamic": {"enabled": "yes"}}"#,
                "dynamic.enabled",
            ),
            (r#"{"threshold": 10, "name": "other"}"#, "name"),
            (r#"{"threshold": 10, "version": -3}"#, "version"),
            (r#"{"threshold": 10, "description": 5}"#, "description"),
        ];
        for (body, field) in cases {
            let e = parse(body).expect_err(body);
            assert_eq!(e.field, field, "{body}: {e}");
            assert!(!e.error.is_empty());
        }
    }

    #[test]
    fn stored_specs_are_validated_like_requests() {
        // What the API stores parses back to itself.
        for body in [
            r#"{"threshold": 5}"#,
            r#"{"threshold": 5000, "slice_ms": 250, "pull": 7, "local_limit": 3,
                "on_failure": "deny", "mode": "exact_sliding",
                "fallback": {"algorithm": "leaky_bucket", "burst": 4},
                "schedules": [{"cron": "* * 9-17 * * Mon-Fri", "threshold": 9}],
                "dynamic": {"enabled": true, "min": 1, "max": 9000, "increase_step": 3,
                            "decrease_factor": 0.5, "target_error_rate": 0.1,
                            "target_latency_ms": 30},
                "description": "x"}"#,
        ] {
            let spec = parse(body).unwrap().spec;
            let stored = serde_json::to_vec(&spec).unwrap();
            assert_eq!(parse_stored("t", &stored).unwrap(), spec, "{body}");
        }
        // What serde alone would accept, and would panic the leader.
        for (stored, field) in [
            (r#"{"threshold": 10, "slice_ms": 0}"#, "slice_ms"),
            (
                r#"{"threshold": 10, "dynamic": {"enabled": true, "min": 10, "max": 5}}"#,
                "dynamic.min",
            ),
            (r#"{"threshold": 10, "version": 3}"#, "version"),
            (r#"{"threshold": 10, "name": "other"}"#, "name"),
            ("not json", ""),
        ] {
            let e = parse_stored("t", stored.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{stored}: {e}");
        }
    }

    #[test]
    fn schedule_time_zones_are_validated_and_utc_is_not_stored() {
        let r = parse(
            r#"{"threshold": 10, "schedules": [
                {"cron": "* * 9-17 * * *", "threshold": 1},
                {"cron": "* * 9-17 * * *", "threshold": 2, "timezone": "UTC"},
                {"cron": "* * 9-17 * * *", "threshold": 3, "timezone": "Europe/Berlin"}]}"#,
        )
        .unwrap();
        let zones: Vec<&str> = r
            .spec
            .schedules
            .iter()
            .map(|e| e.timezone.as_str())
            .collect();
        assert_eq!(zones, ["UTC", "UTC", "Europe/Berlin"]);
        // UTC (the default) is neither stored nor returned; a zone is, and round-trips.
        let stored = serde_json::to_value(&r.spec).unwrap();
        assert!(stored["schedules"][0].get("timezone").is_none());
        assert!(stored["schedules"][1].get("timezone").is_none());
        assert_eq!(stored["schedules"][2]["timezone"], "Europe/Berlin");
        let bytes = serde_json::to_vec(&r.spec).unwrap();
        assert_eq!(parse_stored("t", &bytes).unwrap(), r.spec);
        // A spec stored before zones existed reads as UTC.
        let old: TaskSpec = serde_json::from_str(
            r#"{"threshold": 10, "slice_ms": 1000, "pull": 0, "local_limit": 10,
                "on_failure": "local", "mode": "pooled",
                "fallback": {"algorithm": "token_bucket", "burst": 0},
                "schedules": [{"cron": "* * * * * *", "threshold": 1}], "description": ""}"#,
        )
        .unwrap();
        assert_eq!(old.schedules[0].timezone, "UTC");

        let e = parse(
            r#"{"threshold": 10, "schedules": [
                {"cron": "* * * * * *", "threshold": 1},
                {"cron": "* * * * * *", "threshold": 1, "timezone": "America/New_York"},
                {"cron": "* * * * * *", "threshold": 1, "timezone": "Europe/Berln"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "schedules[2].timezone");
        assert!(
            e.to_string()
                .starts_with(r#"schedules[2].timezone: unknown IANA time zone "Europe/Berln""#),
            "{e}"
        );
        for (tz, field) in [
            (r#""""#, "schedules[0].timezone"),
            ("5", "schedules[0].timezone"),
            (r#""+02:00""#, "schedules[0].timezone"),
        ] {
            let body = format!(
                r#"{{"threshold": 10, "schedules": [{{"cron": "* * * * * *", "threshold": 1, "timezone": {tz}}}]}}"#
            );
            assert_eq!(parse(&body).unwrap_err().field, field, "{body}");
        }
    }

    #[test]
    fn keyed_tasks_are_validated() {
        let r = parse(r#"{"threshold": 10, "keyed": true, "key_overrides": {"vip": 50, "": 1}}"#)
            .unwrap();
        assert!(r.spec.keyed);
        assert_eq!(r.spec.key_overrides.len(), 2);
        let m = r.spec.meta(3);
        assert!(m.keyed);
        assert_eq!(
            m.key_overrides.get(&sluice_protocol::key_digest("vip")),
            Some(&50)
        );
        let stored = serde_json::to_vec(&r.spec).unwrap();
        assert_eq!(parse_stored("t", &stored).unwrap(), r.spec);
        let long = "k".repeat(257);
        let many: String = (0..1_001)
            .map(|i| format!(r#""k{i}": 1"#))
            .collect::<Vec<_>>()
            .join(",");
        let c = parse(r#"{"threshold": 10, "keyed": true, "clear_keys": true}"#).unwrap();
        assert!(c.spec.clear_keys && !r.spec.clear_keys);
        let stored = serde_json::to_vec(&c.spec).unwrap();
        assert_eq!(parse_stored("t", &stored).unwrap(), c.spec);
        for (body, field) in [
            (r#"{"threshold": 10, "keyed": "yes"}"#.to_string(), "keyed"),
            (
                r#"{"threshold": 10, "clear_keys": true}"#.to_string(),
                "clear_keys",
            ),
            (
                r#"{"threshold": 10, "keyed": true, "clear_keys": 1}"#.to_string(),
                "clear_keys",
            ),
            (
                r#"{"threshold": 10, "keyed": true, "mode": "local"}"#.to_string(),
                "keyed",
            ),
            (
                r#"{"threshold": 10, "key_overrides": {"a": 1}}"#.to_string(),
                "key_overrides",
            ),
            (
                r#"{"threshold": 10, "keyed": true, "key_overrides": [1]}"#.to_string(),
                "key_overrides",
            ),
            (
                r#"{"threshold": 10, "keyed": true, "key_overrides": {"a": -1}}"#.to_string(),
                r#"key_overrides["a"]"#,
            ),
            (
                format!(r#"{{"threshold": 10, "keyed": true, "key_overrides": {{"{long}": 1}}}}"#),
                "",
            ),
            (
                format!(r#"{{"threshold": 10, "keyed": true, "key_overrides": {{{many}}}}}"#),
                "key_overrides",
            ),
            (
                r#"{"threshold": 10, "keyed": true, "pacing": "smooth"}"#.to_string(),
                "pacing",
            ),
        ] {
            let e = parse(&body).unwrap_err();
            if field.is_empty() {
                assert!(e.field.starts_with("key_overrides["), "{e}");
            } else {
                assert_eq!(e.field, field, "{body}: {e}");
            }
        }
    }

    #[test]
    fn shadow_and_pacing_are_validated() {
        let r = parse(r#"{"threshold": 1000, "shadow": true, "pacing": "smooth", "burst": 50}"#)
            .unwrap();
        assert!(r.spec.shadow);
        assert_eq!((r.spec.pacing, r.spec.burst), (Pacing::Smooth, 50));
        let m = r.spec.meta(4);
        assert_eq!(
            (m.shadow, m.pacing, m.pace_burst),
            (true, Pacing::Smooth, 50)
        );
        let stored = serde_json::to_vec(&r.spec).unwrap();
        assert_eq!(parse_stored("t", &stored).unwrap(), r.spec);
        // Defaults: not shadowed, not paced; an older stored spec (no fields) reads the same.
        let d = parse(r#"{"threshold": 10}"#).unwrap().spec;
        assert_eq!((d.shadow, d.pacing, d.burst), (false, Pacing::None, 0));
        let old: TaskSpec = serde_json::from_str(
            r#"{"threshold":10,"slice_ms":1000,"pull":0,"local_limit":10,"on_failure":"local",
                "mode":"pooled","fallback":{"algorithm":"token_bucket","burst":0},
                "schedules":[],"description":""}"#,
        )
        .unwrap();
        assert_eq!(old, d);
        // Shadow applies to every mode but concurrency.
        assert!(parse(r#"{"threshold": 5, "mode": "exact_fixed", "shadow": true}"#).is_ok());
        assert!(parse(r#"{"threshold": 5, "mode": "local", "shadow": true}"#).is_ok());
        for (body, field, says) in [
            (
                r#"{"threshold": 10, "shadow": "yes"}"#,
                "shadow",
                "true or false",
            ),
            (
                r#"{"threshold": 10, "mode": "concurrency", "shadow": true}"#,
                "shadow",
                "mode concurrency",
            ),
            (
                r#"{"threshold": 10, "pacing": "jerky"}"#,
                "pacing",
                "none, smooth",
            ),
            (
                r#"{"threshold": 10, "mode": "local", "pacing": "smooth"}"#,
                "pacing",
                "only for mode pooled",
            ),
            (
                r#"{"threshold": 10, "mode": "exact_fixed", "pacing": "smooth"}"#,
                "pacing",
                "only for mode pooled",
            ),
            (
                r#"{"threshold": 10, "pacing": "smooth", "burst": 11}"#,
                "burst",
                "at most threshold",
            ),
            (r#"{"threshold": 10, "burst": 3}"#, "burst", "only with"),
            (
                r#"{"threshold": 10, "pacing": "smooth", "burst": -1}"#,
                "burst",
                "",
            ),
        ] {
            let e = parse(body).unwrap_err();
            assert_eq!(e.field, field, "{body}");
            assert!(e.error.contains(says), "{body}: {}", e.error);
        }
    }

    #[test]
    fn name_and_version_are_accepted() {
        let r = parse(r#"{"threshold": 10, "name": "t", "version": 42}"#).unwrap();
        assert_eq!(r.version, Some(42));
    }
}
