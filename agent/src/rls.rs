//! Envoy's rate-limit service, v3 (`envoy.service.ratelimit.v3.RateLimitService`).
//!
//! Mapping (docs/agent.md):
//! * `domain` + each descriptor → a Sluice task (and, for a keyed task, a key), through the
//!   domain's imported configuration ([`crate::routes`]) or the direct form
//!   `sluice_task = T [, sluice_key = K]`;
//! * `hits_addend` → the permits (0 counts as 1, as in Envoy); a descriptor's own
//!   `hits_addend` wins for that descriptor; a cost above [`MAX_HITS`] (more than any slice
//!   can admit) is `OVER_LIMIT` at once, and the request's other descriptors are not decided:
//!   nothing is taken or counted (`decisions_total{decision="cost_above_max"}`);
//! * a descriptor's `hits_addend: 0` is check-only (Envoy's pattern): `OVER_LIMIT` when
//!   nothing is left of the slice cluster-wide, counting nothing (see `exhausted`);
//! * `quota_mode` descriptors: decided with the plain ones, the first that admits (in request
//!   order) charged; the request is over when a plain one is or every quota one is;
//! * all descriptors of one request are decided **all or nothing**: when one is over its
//!   limit, the permits the others took are given back (envoyproxy/ratelimit counts them all);
//! * `overall_code` is `OVER_LIMIT` when a descriptor is; each status carries
//!   `current_limit` (the imported limit, or the task's threshold per slice),
//!   `limit_remaining` (the cluster-wide estimate: what this host holds of the slice plus the
//!   slice's `rem` in Redis, read at most every 250 ms) and
//!   `duration_until_reset` (the end of the slice, or the FAILED fallback's retry time);
//! * a descriptor that matches nothing, an `unlimited` one, one replaced by another's
//!   `replaces`, and one naming a task that does not exist are `OK` without a limit (an
//!   `unlimited` one with `limit_remaining` = `u32::MAX`, as upstream);
//! * while Redis is unusable (FAILED) the task's `on_failure` decides, as in the SDK;
//! * `shadow_mode` (the task's `shadow`): the would-be rejection answers `OK`, counted as a
//!   would-reject in the task's history;
//! * a descriptor `limit` override (`RateLimitOverride`) that states the limit the descriptor
//!   resolves to is honoured (it changes nothing); any other is refused, `INVALID_ARGUMENT`
//!   naming `descriptors[i].limit`, nothing decided (`request_errors_total{reason=
//!   "override_refused"}`): limits are tasks, made by the manager, not by a request.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use sluice::{Decision, HostState, Key, Mode, OnFailure, Task};
use sluice_protocol::Keys;
use tonic::{Request, Response, Status};

use crate::AppState;
use crate::decide::{DecideError, Part, decision_name, until_slice_end};
use crate::routes::{LimitSpec, Target, Unit};

/// Most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 64;

/// The service.
pub struct Rls {
    state: Arc<AppState>,
    /// The slices' `rem` in Redis, for `limit_remaining` ([`Rls::cluster_remaining`]).
    rems: Mutex<HashMap<RemId, Rem>>,
    /// Reads of `rem` in flight (at most [`MAX_REM_READS`]; beyond, answers go without).
    rem_reads: tokio::sync::Semaphore,
    /// One read of a task's (or key's) `rem` at a time: the others wait for its answer.
    reading: Mutex<HashMap<RemId, Arc<tokio::sync::Mutex<()>>>>,
}

/// A task's name, and the key for a keyed task's key slices.
type RemId = (String, Option<String>);

/// Why a slice's `rem` is not known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RemMiss {
    /// Every read slot was taken until the deadline: Redis was not asked.
    Busy,
    /// Redis did not answer by the deadline.
    Failed,
}

/// What Redis last said of a slice's `rem`.
#[derive(Clone, Copy)]
struct Rem {
    start_ms: i64,
    /// `None`: the slice does not exist (a key's slice is made, full, at its first pull).
    rem: Option<i64>,
    /// When the read was sent.
    asked: Instant,
    at: Instant,
}

/// A slice's `rem` read from Redis is used this long for `limit_remaining`.
const REM_FRESH: Duration = Duration::from_millis(250);
/// Longest wait for Redis's answer about a slice's `rem` when answering `limit_remaining`.
const REM_TIMEOUT: Duration = Duration::from_millis(100);
/// Most (task, key) pairs whose `rem` is remembered (the map is emptied when full).
const MAX_REMS: usize = 10_000;
/// Most reads of `rem` in flight at once; an answer that finds none free states this host's
/// holdings only (so a flood of new keys costs Redis at most this many reads at a time).
const MAX_REM_READS: usize = 32;

/// The tonic server of the service.
pub fn service(state: Arc<AppState>) -> RateLimitServiceServer<Rls> {
    RateLimitServiceServer::new(Rls {
        state,
        rems: Mutex::new(HashMap::new()),
        rem_reads: tokio::sync::Semaphore::new(MAX_REM_READS),
        reading: Mutex::new(HashMap::new()),
    })
}

/// The `rem` field of the current slice of `task` (or of its `key`'s slice) in Redis:
/// `Ok(None)` when the slice does not exist, `Err` when Redis did not answer by `deadline`.
async fn slice_rem(
    s: &AppState,
    task: &Task,
    key: Option<&Key>,
    start_ms: i64,
    deadline: Instant,
) -> Result<Option<i64>, ()> {
    let timeout = deadline.saturating_duration_since(Instant::now());
    if timeout.is_zero() {
        return Err(());
    }
    let keys = Keys::new(&s.cfg.namespace).map_err(|_| ())?;
    let (hash, field) = match key {
        Some(k) => (
            keys.key_slices(task.name(), start_ms),
            sluice_protocol::key_field(&sluice_protocol::key_digest(k.key())),
        ),
        None => (
            keys.slice(task.name(), start_ms),
            sluice_protocol::slice_field::REM.to_string(),
        ),
    };
    let q = async {
        let mut c = s.decider.redis().conn().await.ok()?;
        let v = redis::cmd("HGET")
            .arg(&hash)
            .arg(&field)
            .query_async::<Option<String>>(&mut c)
            .await
            .ok()?;
        // A key's field is `<rem>` or `<rem>:<cap>`; one that does not parse counts as absent.
        Some(v.and_then(|v| sluice_protocol::parse_key_quota(&v).map(|(rem, _)| rem)))
    };
    match tokio::time::timeout(timeout, q).await {
        Ok(Some(v)) => Ok(v),
        _ => Err(()),
    }
}

impl Rls {
    /// The `rem` of slice `start` of `task` (or its `key`'s) in Redis, as [`slice_rem`], read
    /// at most every [`REM_FRESH`] per task or key, by one read at a time per task or key (the
    /// others wait for its answer) and by at most [`MAX_REM_READS`] reads at once: beyond them
    /// `wait` waits until `deadline`, else answers `Err` at once.
    /// What this process's own pull of the key answered within [`REM_FRESH`]
    /// ([`sluice::Key::pulled_rem`]) counts as such a read (with both, the smaller `rem`).
    /// With `wait` (a check-only descriptor) a remembered `rem` is reused only when it says
    /// the slice is spent: a positive one may have been spent by another host since, while a
    /// spent one grows again only when the slice's cap is raised (ROLL adds the difference),
    /// so a check-only descriptor may answer OVER_LIMIT up to [`REM_FRESH`] after a raise.
    async fn rem_of(
        &self,
        task: &Task,
        key: Option<&Key>,
        start: i64,
        deadline: Instant,
        wait: bool,
    ) -> Result<Option<i64>, RemMiss> {
        let id = (task.name().to_string(), key.map(|k| k.key().to_string()));
        let arrived = Instant::now();
        // A check-only descriptor takes a remembered `rem` that says "spent", or any `rem`
        // read after it arrived (as fresh as a read of its own).
        let cached = || {
            self.rems
                .lock()
                .ok()
                .and_then(|g| g.get(&id).copied())
                .filter(|r| r.start_ms == start && r.at.elapsed() < REM_FRESH)
                .filter(|r| !wait || r.rem.is_some_and(|v| v <= 0) || r.asked >= arrived)
        };
        // This process's own pull of the key answered its `rem` (a decision that pulled it
        // just now): as good as a read, and no round trip. A check-only descriptor takes it
        // only when it says "spent" (as a remembered read: the pull may predate the check).
        // With a remembered read of the same slice too, the smaller: a key's `rem` never rises
        // within a slice (only pulls write it), so the smaller is the later reading.
        let pulled = key
            .and_then(|k| k.pulled_rem())
            .filter(|&(s0, rem, at)| s0 == start && at.elapsed() < REM_FRESH && (!wait || rem <= 0))
            .map(|(_, rem, _)| rem);
        match (cached(), pulled) {
            (Some(r), Some(p)) => return Ok(Some(r.rem.map_or(p, |c| c.min(p)))),
            (Some(r), None) => return Ok(r.rem),
            (None, Some(p)) => return Ok(Some(p)),
            (None, None) => {}
        }
        // One read per task (or key) at a time; the others wait for it and take its answer
        // from the cache (a burst of checks of one spent slice reads it once).
        let one = {
            let Ok(mut g) = self.reading.lock() else {
                return Err(RemMiss::Busy);
            };
            if g.len() >= MAX_REMS && !g.contains_key(&id) {
                g.retain(|_, m| Arc::strong_count(m) > 1);
            }
            g.entry(id.clone()).or_default().clone()
        };
        let _one = if wait {
            // Waiting for another check's read of this slice that has not answered by this
            // check's deadline: Redis is slow, not the agent busy — `on_failure` decides, as
            // for a read of its own (the review of issue 23: answering Busy let a check of a
            // `deny` task pass while Redis hung).
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, one.lock_owned()).await {
                Ok(g) => g,
                Err(_) => return Err(RemMiss::Failed),
            }
        } else {
            one.try_lock_owned().map_err(|_| RemMiss::Busy)?
        };
        if let Some(r) = cached() {
            return Ok(r.rem);
        }
        let _permit = if wait {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rem_reads.acquire()).await {
                Ok(Ok(p)) => p,
                _ => return Err(RemMiss::Busy),
            }
        } else {
            self.rem_reads.try_acquire().map_err(|_| RemMiss::Busy)?
        };

        let asked = Instant::now();
        let rem = slice_rem(&self.state, task, key, start, deadline)
            .await
            .map_err(|()| RemMiss::Failed)?;
        if let Ok(mut g) = self.rems.lock() {
            if g.len() >= MAX_REMS && !g.contains_key(&id) {
                g.clear();
            }
            g.insert(
                id,
                Rem {
                    start_ms: start,
                    rem,
                    asked,
                    at: Instant::now(),
                },
            );
        }
        Ok(rem)
    }

    /// `limit_remaining` of an admitted descriptor: the cluster-wide estimate — what this host
    /// holds of the slice plus what Redis has not handed out yet (the slice's `rem`: what this
    /// agent's own pull of the key answered within [`REM_FRESH`], else read at
    /// most every [`REM_FRESH`] per task or key, waited for at most [`REM_TIMEOUT`] and never
    /// past `deadline` (the answer's budget for these reads, [`REM_TIMEOUT`]); a key's
    /// slice not made yet counts as its whole cap). Other hosts' holdings are not known: the
    /// estimate is short by what other hosts hold, and as of a reading up to [`REM_FRESH`] old
    /// (above what is left by what others took since).
    /// Modes other than `pooled`, FAILED and a silent Redis: what this host holds.
    async fn cluster_remaining(&self, task: &Task, key: Option<&Key>, deadline: Instant) -> u64 {
        let Some(info) = task.limit_info("", None, true, key) else {
            return 0;
        };
        let Some(m) = task.meta() else {
            return info.remaining;
        };
        let key = key.filter(|_| m.keyed);
        if m.mode != Mode::Pooled || task.state() == HostState::Failed {
            return info.remaining;
        }
        let start = sluice_protocol::slice::start(task.now_us().div_euclid(1_000), m.slice_ms);
        let deadline = deadline.min(Instant::now() + REM_TIMEOUT);
        let Ok(rem) = self.rem_of(task, key, start, deadline, false).await else {
            return info.remaining;
        };
        let redis_left = match rem {
            Some(r) => r.max(0) as u64,
            None if key.is_some() => info.limit,
            None => 0,
        };
        info.remaining.saturating_add(redis_left)
    }
}

fn pb_duration(d: Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// Largest cost of one descriptor: `sluice_protocol::MAX_COUNT`, the largest threshold a task
/// may have, so more than any slice can ever admit. A descriptor above it is OVER_LIMIT at
/// once, decided and counted nowhere (its cost would not fit the slice's counters).
pub const MAX_HITS: u64 = sluice_protocol::MAX_COUNT;

/// One descriptor of a request as resolved.
struct Slot {
    target: Target,
    hits: u64,
    part: Option<usize>,
    /// Refused at the door: its cost is above [`MAX_HITS`].
    too_costly: bool,
    /// A check-only descriptor (`hits_addend: 0`) found its limit exhausted.
    check_over: bool,
    /// A `quota_mode` descriptor refused with this decision.
    quota_over: Option<Decision>,
}

/// The limit to state for a task: the imported spec, else the task's threshold per slice.
fn current_limit(spec: Option<&LimitSpec>, task: &Task) -> Option<RateLimit> {
    if let Some(s) = spec {
        return Some(RateLimit {
            name: s.name.clone().unwrap_or_default(),
            requests_per_unit: s.requests_per_unit.min(u32::MAX as u64) as u32,
            unit: s.unit.proto(),
        });
    }
    let m = task.meta()?;
    let unit = Unit::of_slice_ms(m.slice_ms).map(Unit::proto).unwrap_or(0);
    Some(RateLimit {
        name: task.name().to_string(),
        requests_per_unit: m.threshold.min(u32::MAX as u64) as u32,
        unit,
    })
}

/// Decides `parts` — one on its own (its decision says more, e.g. a shadow task's would-be
/// rejection), several all or nothing: the decision and which part refused.
async fn decide_parts(s: &AppState, parts: &[Part]) -> Option<(Decision, Option<usize>)> {
    match parts.len() {
        0 => None,
        1 => {
            let d = s.decider.decide(&parts[0]).await;
            Some((d, (!d.is_allowed()).then_some(0)))
        }
        _ => {
            let a = s.decider.decide_all(parts).await;
            Some((a.decision, a.refused.filter(|_| !a.decision.is_allowed())))
        }
    }
}

/// The spelling of an Envoy rate-limit unit.
fn unit_name(unit: i32) -> &'static str {
    match unit {
        1 => "second",
        2 => "minute",
        3 => "hour",
        4 => "day",
        5 => "month",
        6 => "year",
        7 => "week",
        _ => "unknown unit",
    }
}

/// Longest wait for Redis's answer to a check-only descriptor.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether a check-only descriptor's limit is exhausted: nothing left of the current slice,
/// cluster-wide (a request of one permit would be refused). Nothing is taken or counted.
///
/// * the host holds some of the slice (the task's, or the key's): not exhausted;
/// * the host knows the slice is spent (state LIMITED), or the threshold is 0: exhausted;
/// * otherwise the slice's `rem` in Redis (one `HGET`, at most `MAX_REM_READS` at once,
///   shared with `limit_remaining`'s reads; a spent slice is remembered for `REM_FRESH`; with
///   every read slot taken until the deadline the check is skipped: not known to be spent):
///   0 = exhausted; a key's slice not created yet is not (it starts at the key's cap);
/// * FAILED, or Redis does not answer by `deadline` (the check-only descriptors of a request
///   share [`CHECK_TIMEOUT`]): the task's `on_failure` says
///   (`deny` = exhausted; `allow` and `local` = not: a local limiter cannot be asked without
///   deciding);
/// * shadow tasks, and modes other than `pooled` (no imported task is one): never exhausted.
async fn exhausted(rls: &Rls, p: &Part, deadline: Instant) -> bool {
    let Some(m) = p.task.meta() else {
        return false;
    };
    if m.shadow || m.mode != Mode::Pooled {
        return false;
    }
    let failed = || m.on_failure == OnFailure::Deny;
    if p.task.state() == HostState::Failed {
        return failed();
    }
    if m.threshold == 0 {
        return true;
    }
    let key = p.key.as_ref().filter(|_| m.keyed);
    if p.task
        .limit_info("", None, true, key)
        .is_some_and(|l| l.remaining > 0)
    {
        return false;
    }
    if key.is_none() && p.task.state() == HostState::Limited {
        return true;
    }
    let start = sluice_protocol::slice::start(p.task.now_us().div_euclid(1_000), m.slice_ms);
    // Shared with limit_remaining's reads: cached for REM_FRESH, at most MAX_REM_READS at once
    // (a flood of check-only descriptors costs Redis no more than that).
    match rls.rem_of(&p.task, key, start, deadline, true).await {
        Ok(Some(rem)) => rem <= 0,
        // A key's slice is made at its first pull, full; a task's missing slice means the
        // leader is gone past the horizon: the SDK goes FAILED there.
        Ok(None) => key.is_none() && failed(),
        // Not asked (every read slot taken until the deadline): not known to be spent. The
        // decision of a charged descriptor still holds the limit; only the check is skipped.
        Err(RemMiss::Busy) => false,
        Err(RemMiss::Failed) => failed(),
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let t0 = Instant::now();
        let s = &self.state;
        let req = request.into_inner();
        if req.domain.is_empty() {
            s.metrics.error("rls", "invalid");
            return Err(Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if req.descriptors.is_empty() {
            s.metrics.error("rls", "invalid");
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        if req.descriptors.len() > MAX_DESCRIPTORS {
            s.metrics.error("rls", "invalid");
            return Err(Status::invalid_argument(format!(
                "at most {MAX_DESCRIPTORS} descriptors per request"
            )));
        }
        let routes = s.routes.load();
        // Request `limit` overrides: (descriptor, requests_per_unit, unit).
        let mut overrides: Vec<(usize, u32, i32)> = Vec::new();
        let base_hits = u64::from(req.hits_addend.max(1));
        let mut slots: Vec<Slot> = Vec::with_capacity(req.descriptors.len());
        for (i, d) in req.descriptors.iter().enumerate() {
            if d.entries.is_empty() {
                s.metrics.error("rls", "invalid");
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}] has no entries"
                )));
            }
            if let Some(o) = &d.limit {
                overrides.push((i, o.requests_per_unit, o.unit));
            }
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            let hits = d.hits_addend.as_ref().map(|h| h.value).unwrap_or(base_hits);
            slots.push(Slot {
                target: routes.resolve(&req.domain, &entries),
                hits,
                part: None,
                too_costly: false,
                check_over: false,
                quota_over: None,
            });
        }
        // `replaces`: a matched limit named by another matched limit's `replaces` is not applied.
        let replaced: HashSet<String> = slots
            .iter()
            .filter_map(|sl| match &sl.target {
                Target::Limit { replaces, .. } => Some(replaces.iter().cloned()),
                _ => None,
            })
            .flatten()
            .collect();
        if !replaced.is_empty() {
            for sl in &mut slots {
                if let Target::Limit {
                    spec: Some(LimitSpec { name: Some(n), .. }),
                    ..
                } = &sl.target
                    && replaced.contains(n)
                {
                    sl.target = Target::None;
                }
            }
        }
        let mut parts: Vec<Part> = Vec::new();
        // Check-only descriptors (`hits_addend: 0`): slot index and part.
        let mut checks: Vec<(usize, Part)> = Vec::new();
        // `quota_mode` descriptors: slot index and part.
        let mut quota_parts: Vec<(usize, Part)> = Vec::new();
        let mut tasks: Vec<Option<Task>> = Vec::with_capacity(slots.len());
        for (i, sl) in slots.iter_mut().enumerate() {
            let Target::Limit { task, key, .. } = &sl.target else {
                tasks.push(None);
                s.metrics.decision(
                    "rls",
                    if sl.target == Target::Unlimited {
                        "unlimited"
                    } else {
                        "no_limit"
                    },
                );
                continue;
            };
            match s.decider.part(task, key.as_deref(), sl.hits).await {
                Ok(p) => {
                    tasks.push(Some(p.task.clone()));
                    if sl.hits > MAX_HITS {
                        // Not decided: nothing is taken or counted (not even as rejected).
                        sl.too_costly = true;
                        s.metrics.decision("rls", "cost_above_max");
                    } else if sl.hits > 0 && matches!(sl.target, Target::Limit { quota: true, .. })
                    {
                        quota_parts.push((i, p));
                    } else if sl.hits > 0 {
                        sl.part = Some(parts.len());
                        parts.push(p);
                    } else {
                        checks.push((i, p));
                    }
                }
                Err(DecideError::UnknownTask(_)) => {
                    s.metrics.decision("rls", "unknown_task");
                    tasks.push(None);
                }
                Err(e @ DecideError::Invalid { .. }) => {
                    s.metrics.error("rls", "invalid");
                    return Err(Status::invalid_argument(format!("descriptors[{i}]: {e}")));
                }
                Err(e @ DecideError::Concurrency(_)) => {
                    s.metrics.error("rls", "concurrency");
                    return Err(Status::failed_precondition(format!(
                        "descriptors[{i}]: {e}"
                    )));
                }
                Err(DecideError::Sdk(m)) => {
                    s.metrics.error("rls", "sdk");
                    return Err(Status::unavailable(m));
                }
            }
        }
        // A cost refused at the door refuses the request: the other parts are not decided
        // (all or nothing, as if they had been given back).
        // A `limit` override is honoured when it states the limit that applies (it changes
        // nothing); any other is refused before anything is decided: the agent cannot make a
        // limit of its own (limits are tasks, made by the manager).
        for &(i, rpu, unit) in &overrides {
            let applies = match (&slots[i].target, &tasks[i]) {
                (Target::Limit { spec, .. }, Some(task)) => current_limit(spec.as_ref(), task),
                _ => None,
            };
            if applies
                .as_ref()
                .is_some_and(|l| l.requests_per_unit == rpu && l.unit == unit)
            {
                continue;
            }
            s.metrics.error("rls", "override_refused");
            let configured = match applies {
                Some(l) => format!("{} per {}", l.requests_per_unit, unit_name(l.unit)),
                None => "none".to_string(),
            };
            return Err(Status::invalid_argument(format!(
                "descriptors[{i}].limit: request limit overrides are not supported unless they \
                 state the configured limit ({rpu} per {} asked, configured: {configured}): \
                 Sluice's limits are tasks made by the manager — import the limit into the \
                 domain's config, or drop the override from Envoy's rate limit actions",
                unit_name(unit)
            )));
        }
        let mut door_refused = slots.iter().any(|sl| sl.too_costly);
        // Check-only descriptors are checked first (they take nothing): one over its limit
        // refuses the request, and the others are then not decided (all or nothing).
        if !door_refused {
            let deadline = Instant::now() + CHECK_TIMEOUT;
            for (i, p) in &checks {
                if exhausted(self, p, deadline).await {
                    slots[*i].check_over = true;
                    door_refused = true;
                    s.metrics.decision("rls", "check_over_limit");
                } else {
                    s.metrics.decision("rls", "check_ok");
                }
            }
        }
        // (the decision, which part refused): one part is decided on its own (its decision
        // says more, e.g. a shadow task's would-be rejection); several all or nothing.
        // With `quota_mode` descriptors: the plain parts together with the first quota part
        // that admits, tried in order (all or nothing each time: a refused attempt gives its
        // permits back); the request is refused when a plain part refuses, or when every
        // quota part does (as upstream: over iff a plain descriptor is, or all quota ones are).
        let mut quota_all_refused = false;
        let all: Option<(Decision, Option<usize>)> = if door_refused {
            None
        } else if quota_parts.is_empty() {
            decide_parts(s, &parts).await
        } else {
            let mut out = None;
            for (slot, qp) in &quota_parts {
                // Each attempt may wait for a refill: attempts stop at the request timeout
                // (the quota parts not tried count as refused).
                if t0.elapsed() >= s.cfg.request_timeout {
                    break;
                }
                let mut with = parts.clone();
                with.push(qp.clone());
                match decide_parts(s, &with).await {
                    Some((d, Some(i))) if i == parts.len() => {
                        slots[*slot].quota_over = Some(d);
                        s.metrics.decision("rls", decision_name(&d));
                    }
                    Some((d, r)) => {
                        if r.is_none() {
                            s.metrics.decision("rls", decision_name(&d));
                        }
                        out = Some((d, r));
                        break;
                    }
                    None => break,
                }
            }
            if out.is_none() {
                quota_all_refused = true;
                // Every quota part refused: the plain parts were given back each time.
                for _ in &parts {
                    s.metrics.decision("rls", "given_back");
                }
            }
            out
        };
        let refused = all.and_then(|(_, r)| r);
        // All the reads of `rem` of one answer share REM_TIMEOUT.
        let rem_deadline = Instant::now() + REM_TIMEOUT;
        let mut statuses = Vec::with_capacity(slots.len());
        let mut over = false;
        // For the x-ratelimit-* headers: the tightest limit stated.
        let mut tightest: Option<(u32, RateLimit, Duration)> = None;
        for (sl, task) in slots.iter().zip(&tasks) {
            let (Target::Limit { spec, .. }, Some(task)) = (&sl.target, task) else {
                statuses.push(DescriptorStatus {
                    code: Code::Ok as i32,
                    // As envoyproxy/ratelimit: an unlimited descriptor has all of it left.
                    limit_remaining: if sl.target == Target::Unlimited {
                        u32::MAX
                    } else {
                        0
                    },
                    ..Default::default()
                });
                continue;
            };
            let is_refused = sl.too_costly
                || sl.check_over
                || sl.quota_over.is_some()
                || (sl.part.is_some() && sl.part == refused);
            let decision = match (is_refused, sl.quota_over, all) {
                (true, Some(d), _) => d,
                (true, None, Some((d, _))) => d,
                _ => Decision::Allowed,
            };
            if let (Some((d, r)), Some(_)) = (all, sl.part) {
                let name = if is_refused || r.is_none() {
                    decision_name(&d)
                } else {
                    "given_back"
                };
                s.metrics.decision("rls", name);
            }
            let reset = match decision {
                Decision::FallbackDenied { retry_after } => retry_after,
                _ => until_slice_end(task).unwrap_or_default(),
            };
            let key = sl.part.and_then(|i| parts[i].key.as_ref());
            let remaining = if is_refused {
                0
            } else {
                self.cluster_remaining(task, key, rem_deadline)
                    .await
                    .min(u32::MAX as u64) as u32
            };
            let limit = current_limit(spec.as_ref(), task);
            if let Some(l) = &limit
                && tightest.as_ref().is_none_or(|(r, _, _)| remaining < *r)
            {
                tightest = Some((remaining, l.clone(), reset));
            }
            over |= is_refused && sl.quota_over.is_none();
            statuses.push(DescriptorStatus {
                code: if is_refused {
                    Code::OverLimit as i32
                } else {
                    Code::Ok as i32
                },
                current_limit: limit,
                limit_remaining: remaining,
                duration_until_reset: Some(pb_duration(reset)),
                quota: None,
            });
        }
        over |= quota_all_refused;
        let mut headers = Vec::new();
        if s.cfg.response_headers
            && let Some((remaining, l, reset)) = tightest
        {
            let window = match l.unit {
                1 => 1,
                2 => 60,
                3 => 3_600,
                4 => 86_400,
                _ => 0,
            };
            let limit = if window > 0 {
                format!(
                    "{}, {};w={window}",
                    l.requests_per_unit, l.requests_per_unit
                )
            } else {
                l.requests_per_unit.to_string()
            };
            for (k, v) in [
                ("x-ratelimit-limit", limit),
                ("x-ratelimit-remaining", remaining.to_string()),
                (
                    "x-ratelimit-reset",
                    reset.as_micros().div_ceil(1_000_000).to_string(),
                ),
            ] {
                headers.push(HeaderValue {
                    key: k.to_string(),
                    value: v,
                    ..Default::default()
                });
            }
        }
        s.metrics.request("rls", t0.elapsed());
        Ok(Response::new(RateLimitResponse {
            overall_code: if over {
                Code::OverLimit as i32
            } else {
                Code::Ok as i32
            },
            statuses,
            response_headers_to_add: headers,
            ..Default::default()
        }))
    }
}
