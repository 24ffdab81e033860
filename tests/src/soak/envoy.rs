//! Envoy configs in the soak: an envoyproxy/ratelimit domain imported through the manager
//! (`POST /api/v1/import/envoy-ratelimit`), edited and re-imported, and deleted
//! (`DELETE /api/v1/import/envoy-ratelimit/soakenv`), while the RLS agent host asks for its
//! descriptors (one `agent_host` driver per descriptor, `--domain soakenv --descriptor
//! path=<d>`, at [`ENVOY_RATE`] decisions/s each, for the whole run).
//!
//! The domain has up to [`DESCRIPTORS`] descriptors `path=a`, `path=b`, each `unit: second`
//! with its own `requests_per_unit` (demand 1.5–3 × it). Every import is recorded per
//! descriptor as a spec version of the task it makes (`soakenv.path_<d>`: pooled, 1 s slices,
//! threshold = `requests_per_unit`, the import's defaults) in a ledger of its own; a descriptor
//! left out of a re-import, or the domain's deletion, is recorded as a deletion. Invariants:
//!
//! * **`safety.slice` / `safety.cap`** on that ledger, with the soak's own derivation
//!   ([`super::check::check_safety`]: per slice, what RLS admitted by the global quota ≤ the
//!   largest imported limit live around the slice; 0 once a deletion is applied);
//! * **`envoy.limit`**: once an import is surely applied (its [`applied_by`] + the agent's
//!   routes refresh (1 s) + the driver's request timeout (2 s), with no later change written),
//!   every RLS answer for a descriptor it holds states the imported limit (`current_limit.
//!   requests_per_unit`) and none answers without a limit;
//! * **`envoy.deleted`**: once a deletion (of the domain, or of a descriptor by a re-import)
//!   is surely applied, every answer for it is `OK` without a limit (docs/agent.md: no match →
//!   OK, no `current_limit`) — nothing is rejected or counted;
//! * **`api.rejected`**: the soak's imports are valid: no 4xx but 503 (etcd down).
//!
//! Both answer checks skip buckets within 8 s after (and 0.5 s before) a Redis, leader or
//! etcd disturbance or a kill of the RLS agent host: `NS:envoy` is lost with Redis's data until
//! a leader writes it again and the agent re-reads it.

use std::collections::BTreeMap;

use super::check::{Timing, Violation, applied_by};
use super::ledger::{ApiVersion, BUCKET_MS, Disturb, Ledger};
use super::rng::Rng;
use super::spec::Spec;

/// The imported domain.
pub const DOMAIN: &str = "soakenv";
/// Its descriptors' values (`path=<d>`).
pub const DESCRIPTORS: [&str; 2] = ["a", "b"];
/// Decisions per second the RLS agent host asks per descriptor.
pub const ENVOY_RATE: f64 = 40.0;
/// The agent re-reads `NS:envoy` this often (`--routes-refresh`).
pub const ROUTES_REFRESH_MS: i64 = 1_000;
/// The driver's request timeout (an answer arrives at most this long after its request).
pub const REQUEST_TIMEOUT_MS: i64 = 2_000;
/// Answer checks skip this long after a disturbance ends.
pub const DISTURB_SKIP_MS: i64 = 8_000;

/// The task an import makes of descriptor `i`.
pub fn task_of(i: usize) -> String {
    format!("{DOMAIN}.path_{}", DESCRIPTORS[i])
}

/// The spec the import gives descriptor `rpu` per second (pooled, 1 s, the defaults).
pub fn spec_of(rpu: u64) -> Spec {
    Spec {
        threshold: rpu,
        slice_ms: 1_000,
        local_limit: rpu,
        on_failure: "local",
        mode: "pooled",
        fallback: None,
        schedules: Vec::new(),
        dynamic: None,
        modes: Default::default(),
    }
}

/// The YAML of a config holding the descriptors with a limit (`None`: left out).
pub fn yaml(limits: &[Option<u64>]) -> String {
    let mut y = format!("domain: {DOMAIN}\ndescriptors:\n");
    for (i, l) in limits.iter().enumerate() {
        if let Some(rpu) = l {
            y += &format!(
                "  - key: path\n    value: {}\n    rate_limit:\n      unit: second\n      requests_per_unit: {rpu}\n",
                DESCRIPTORS[i]
            );
        }
    }
    y
}

/// A limit whose demand ([`ENVOY_RATE`] per second) is 1.5–3 × it.
fn rpu(rng: &mut Rng) -> u64 {
    ((ENVOY_RATE / rng.uniform(1.5, 3.0)).round() as u64).max(1)
}

/// The planner's next config: a fresh one (every descriptor, each left out 20 % of the time,
/// at least one kept) when none is imported, else one edit: a new limit for one descriptor,
/// or one descriptor added or removed (never the last one).
pub fn next_limits(rng: &mut Rng, cur: Option<&[Option<u64>]>) -> Vec<Option<u64>> {
    let n = DESCRIPTORS.len();
    match cur {
        None => {
            let mut v: Vec<Option<u64>> = (0..n)
                .map(|_| (!rng.chance(0.2)).then(|| rpu(rng)))
                .collect();
            if v.iter().all(Option::is_none) {
                v[0] = Some(rpu(rng));
            }
            v
        }
        Some(cur) => {
            let mut v = cur.to_vec();
            let i = rng.below(n as u64) as usize;
            let present = v.iter().filter(|l| l.is_some()).count();
            if rng.chance(0.6) && v[i].is_some() {
                v[i] = Some(rpu(rng));
            } else if v[i].is_some() && present > 1 {
                v[i] = None;
            } else {
                v[i] = Some(rpu(rng));
            }
            v
        }
    }
}

/// What the RLS answers for one descriptor said in one bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Answers {
    /// Admitted (limit or not).
    pub adm: u64,
    /// `OVER_LIMIT`.
    pub rej: u64,
    /// `OK` without a limit.
    pub nolim: u64,
    /// Smallest and largest `requests_per_unit` stated (None: no answer stated one).
    pub lim: Option<(u64, u64)>,
}

impl Answers {
    /// Adds one progress line's fields.
    pub fn add(&mut self, adm: u64, rej: u64, nolim: u64, lmin: i64, lmax: i64) {
        self.adm += adm;
        self.rej += rej;
        self.nolim += nolim;
        if lmin >= 0 && lmax >= lmin {
            let (a, b) = (lmin as u64, lmax as u64);
            self.lim = Some(match self.lim {
                Some((x, y)) => (x.min(a), y.max(b)),
                None => (a, b),
            });
        }
    }
}

/// Whether answers in bucket `b` are checked: no Redis, leader or etcd disturbance, and no
/// kill of the agent host `agent_host`, within `[b − DISTURB_SKIP_MS, b + 500]`.
fn disturbed(ledger: &Ledger, b: i64, agent_host: usize) -> bool {
    ledger.disturbances.iter().any(|d| {
        let relevant = match d.kind {
            Disturb::Redis { .. } | Disturb::Leader | Disturb::Etcd => true,
            Disturb::Host(h) => h == agent_host,
            Disturb::Clock => false,
        };
        relevant
            && d.from_ms <= b + BUCKET_MS + 500
            && d.to_ms.is_none_or(|to| to + DISTURB_SKIP_MS >= b)
    })
}

/// The state of descriptor `i` surely in force at bucket `b`: the newest version whose effect
/// is surely visible in answers arriving then, with no later change written before them.
/// `None`: not surely known (a change in flight, or an outcome unknown).
fn in_force<'a>(
    api: &'a [ApiVersion],
    ledger: &Ledger,
    b: i64,
    t: &Timing,
) -> Option<&'a ApiVersion> {
    // Requests answered in [b, b + BUCKET) were sent after b − REQUEST_TIMEOUT.
    let sent_from = b - REQUEST_TIMEOUT_MS;
    let idx = api.iter().rposition(|v| v.at_ms <= b + BUCKET_MS)?;
    let v = &api[idx];
    if !v.confirmed {
        return None;
    }
    let ready = applied_by(ledger, v.at_ms, t) + ROUTES_REFRESH_MS;
    (ready <= sent_from).then_some(v)
}

/// `envoy.limit` and `envoy.deleted` for descriptor `i` over the buckets `[from, upto)` of
/// `answers`; `ledger` is the Envoy ledger (its `api[i]`: the descriptor's versions; its
/// disturbances: the soak's). Returns the violations.
pub fn check_answers(
    ledger: &Ledger,
    i: usize,
    answers: &BTreeMap<i64, Answers>,
    from: i64,
    upto: i64,
    agent_host: usize,
    t: &Timing,
) -> Vec<Violation> {
    let mut out = Vec::new();
    for (b, a) in answers.range(from..upto) {
        if disturbed(ledger, *b, agent_host) {
            continue;
        }
        let Some(v) = in_force(&ledger.api[i], ledger, *b, t) else {
            continue;
        };
        match &v.spec {
            Some(spec) => {
                let wrong = a
                    .lim
                    .is_some_and(|(lo, hi)| lo != spec.threshold || hi != spec.threshold);
                if a.nolim > 0 || wrong {
                    out.push(Violation {
                        invariant: "envoy.limit",
                        task: Some(task_of(i)),
                        slice: Some(*b),
                        evidence: format!(
                            "bucket {b}: {} answers without a limit, limits stated {:?}, while the import of {} per second (written at {}) is surely applied",
                            a.nolim, a.lim, spec.threshold, v.at_ms
                        ),
                    });
                }
            }
            None => {
                if a.rej > 0 || a.nolim < a.adm || a.lim.is_some() {
                    out.push(Violation {
                        invariant: "envoy.deleted",
                        task: Some(task_of(i)),
                        slice: Some(*b),
                        evidence: format!(
                            "bucket {b}: {} admitted with a limit, {} over limit, limits stated {:?}, after its deletion (written at {}) is surely applied",
                            a.adm - a.nolim.min(a.adm),
                            a.rej,
                            a.lim,
                            v.at_ms
                        ),
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger_with(versions: &[(i64, Option<u64>)]) -> Ledger {
        let mut l = Ledger::new(DESCRIPTORS.len(), 1);
        for (at, rpu) in versions {
            l.api[0].push(ApiVersion {
                at_ms: *at,
                spec: rpu.map(spec_of),
                confirmed: true,
            });
        }
        l
    }

    fn answers(b: i64, a: Answers) -> BTreeMap<i64, Answers> {
        BTreeMap::from([(b, a)])
    }

    const T0: i64 = 1_800_000_000_000;

    #[test]
    fn answers_follow_an_applied_import_and_a_wrong_limit_is_found() {
        let t = Timing::default();
        let l = ledger_with(&[(T0, Some(20))]);
        let late = T0 + 10_000;
        let mut ok = Answers::default();
        ok.add(20, 5, 0, 20, 20);
        assert!(check_answers(&l, 0, &answers(late, ok), 0, i64::MAX, 9, &t).is_empty());
        // A stale limit, or no limit, after the import is surely applied.
        let mut stale = Answers::default();
        stale.add(20, 5, 0, 30, 30);
        let v = check_answers(&l, 0, &answers(late, stale), 0, i64::MAX, 9, &t);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].invariant, "envoy.limit");
        let mut none = Answers::default();
        none.add(20, 0, 20, -1, -1);
        assert_eq!(
            check_answers(&l, 0, &answers(late, none), 0, i64::MAX, 9, &t).len(),
            1
        );
        // Right after the import (not surely applied yet): not judged.
        assert!(check_answers(&l, 0, &answers(T0 + 1_000, stale), 0, i64::MAX, 9, &t).is_empty());
    }

    #[test]
    fn a_deleted_domain_answers_without_a_limit() {
        let t = Timing::default();
        let l = ledger_with(&[(T0, Some(20)), (T0 + 5_000, None)]);
        let late = T0 + 15_000;
        let mut free = Answers::default();
        free.add(40, 0, 40, -1, -1);
        assert!(check_answers(&l, 0, &answers(late, free), 0, i64::MAX, 9, &t).is_empty());
        let mut limited = Answers::default();
        limited.add(20, 20, 0, 20, 20);
        let v = check_answers(&l, 0, &answers(late, limited), 0, i64::MAX, 9, &t);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].invariant, "envoy.deleted");
    }

    #[test]
    fn disturbances_and_unknown_outcomes_are_not_judged() {
        let t = Timing::default();
        let mut l = ledger_with(&[(T0, Some(20))]);
        let late = T0 + 20_000;
        let mut bad = Answers::default();
        bad.add(20, 0, 20, -1, -1);
        let d = l.begin(Disturb::Redis { lost: true }, late - 3_000);
        l.end(d, late - 2_000);
        assert!(check_answers(&l, 0, &answers(late, bad), 0, i64::MAX, 9, &t).is_empty());
        let mut l = ledger_with(&[(T0, Some(20))]);
        l.api[0].push(ApiVersion {
            at_ms: T0 + 1_000,
            spec: Some(spec_of(30)),
            confirmed: false,
        });
        assert!(check_answers(&l, 0, &answers(late, bad), 0, i64::MAX, 9, &t).is_empty());
    }

    /// A slice reader that finds nothing (the bucket sums are what is judged).
    struct NoSlices;

    impl super::super::check::Slices for NoSlices {
        fn read(
            &mut self,
            _task: usize,
            starts: &[i64],
        ) -> Option<Vec<Option<super::super::check::SliceRead>>> {
            Some(vec![None; starts.len()])
        }
    }

    /// The imported limit is the per-slice bound of the RLS host's admissions (the soak's
    /// derivation, on the Envoy ledger); a deletion makes it 0; straddling admissions (the
    /// agent's slice unknown) count in liveness, not in the safety sum.
    #[test]
    fn imported_limits_bound_the_rls_hosts_slices() {
        use super::super::check::{Coverage, check_safety};
        use super::super::ledger::MetaState;
        let t = Timing::default();
        let mut l = ledger_with(&[(0, Some(20))]);
        let live = MetaState::Live {
            slice_ms: 1_000,
            class: super::super::spec::Class::Slice,
        };
        for i in 0..=240 {
            l.observe_meta(0, i * 250, live);
        }
        for b in (0..60_000).step_by(100) {
            l.count(0, 0, b, 2, 3, 0, 0); // 20 per slice: at the limit
        }
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut NoSlices, &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        // One admission over the imported limit in slice 10 000.
        l.count(0, 0, 10_300, 1, 0, 0, 0);
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut NoSlices, &t, &mut cov);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].invariant, v[0].slice), ("safety.slice", Some(10_000)));
        // A straddler: outside the safety sum, inside liveness.
        let mut l2 = l.clone();
        l2.count(0, 0, 20_300, 5, 0, 5, 0);
        l2.count_straddled(0, 0, 20_300, 5);
        let c = l2.sums(0, 20_000, 21_000)[0];
        assert_eq!((c.global(), c.quota()), (20, 25));
        // Deleted at 30 s: from its applied time on, the bound is 0.
        l.api[0].push(ApiVersion {
            at_ms: 30_000,
            spec: None,
            confirmed: true,
        });
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut NoSlices, &t, &mut cov);
        let bad: Vec<i64> = v.iter().filter_map(|v| v.slice).collect();
        assert!(bad.contains(&40_000) && !bad.contains(&20_000), "{bad:?}");
    }

    #[test]
    fn configs_are_valid_and_edits_keep_a_descriptor() {
        let mut rng = Rng::new(5);
        let mut cur: Option<Vec<Option<u64>>> = None;
        for _ in 0..500 {
            let next = next_limits(&mut rng, cur.as_deref());
            assert!(next.iter().any(Option::is_some));
            for l in next.iter().flatten() {
                let ratio = ENVOY_RATE / *l as f64;
                assert!((1.4..=3.2).contains(&ratio), "{l}");
            }
            let y = yaml(&next);
            assert!(y.starts_with("domain: soakenv\n"));
            assert_eq!(
                y.matches("requests_per_unit").count(),
                next.iter().flatten().count()
            );
            cur = if rng.chance(0.1) { None } else { Some(next) };
        }
    }
}
