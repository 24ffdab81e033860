//! The soak's model of a task spec: what it sends to the API (`PUT /api/v1/tasks/{name}`), and
//! which slice caps that spec allows — the ground truth the safety and fencing checks compare
//! Redis and the load generators against.

use serde_json::{Value, json};

/// How the safety bound of a mode is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// `pooled`, `exact_fixed`: admitted per slice (key) ≤ its cap. Both draw on the slice's
    /// `rem`, so hosts of either mode share one bound.
    Slice,
    /// `exact_sliding`: admitted in every window of one slice length ≤ the cap.
    Window,
    /// `local`: per-host limits only; no global bound.
    Local,
}

impl Class {
    /// The class of a mode's wire name (unknown names are treated as local: unchecked).
    pub fn of_mode(mode: &str) -> Self {
        match mode {
            "pooled" | "exact_fixed" => Class::Slice,
            "exact_sliding" => Class::Window,
            _ => Class::Local,
        }
    }
}

/// Dynamic limiting settings of a spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dynamic {
    /// The controller runs.
    pub enabled: bool,
    /// Lowest threshold it may set.
    pub min: u64,
    /// Highest threshold it may set.
    pub max: u64,
}

/// The newer decision modes of a spec (issue 23): pacing, shadow, keys, permits in flight.
/// The default is none of them. [`Spec::normalize`] keeps a combination the API accepts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Modes {
    /// `"pacing": "smooth"` with this `burst` (mode `pooled` only).
    pub paced_burst: Option<u64>,
    /// `"shadow": true` (every mode but `concurrency`).
    pub shadow: bool,
    /// `"keyed": true` with these overrides, `(i, threshold)` for the key `key-i` (mode
    /// `pooled` only).
    pub keyed: Option<Vec<(u64, u64)>>,
    /// `lease_ms` of mode `concurrency` (that mode only).
    pub lease_ms: Option<u64>,
}

/// A task spec as the soak writes it (the fields it varies; the rest keep their defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// Permits per slice.
    pub threshold: u64,
    /// Slice length, ms (a multiple of 100).
    pub slice_ms: u64,
    /// Per-host permits per slice while FAILED (and in mode `local`).
    pub local_limit: u64,
    /// `local`, `allow` or `deny`.
    pub on_failure: &'static str,
    /// `pooled`, `exact_fixed`, `exact_sliding` or `local`.
    pub mode: &'static str,
    /// Local limiter algorithm; None = the default.
    pub fallback: Option<&'static str>,
    /// `(cron, threshold)` entries.
    pub schedules: Vec<(&'static str, u64)>,
    /// Dynamic limiting, if present in the spec (enabled or not).
    pub dynamic: Option<Dynamic>,
    /// Pacing, shadow, keys, lease (see [`Modes`]).
    pub modes: Modes,
}

impl Spec {
    /// The request body.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "threshold": self.threshold,
            "slice_ms": self.slice_ms,
            "local_limit": self.local_limit,
            "on_failure": self.on_failure,
            "mode": self.mode,
            "description": "soak",
        });
        if let Some(a) = self.fallback {
            v["fallback"] = json!({ "algorithm": a });
        }
        if !self.schedules.is_empty() {
            v["schedules"] = self
                .schedules
                .iter()
                .map(|(c, t)| json!({ "cron": c, "threshold": t }))
                .collect();
        }
        if let Some(d) = &self.dynamic {
            v["dynamic"] = json!({ "enabled": d.enabled, "min": d.min, "max": d.max });
        }
        let m = &self.modes;
        if let Some(b) = m.paced_burst {
            v["pacing"] = json!("smooth");
            v["burst"] = json!(b);
        }
        if m.shadow {
            v["shadow"] = json!(true);
        }
        if let Some(o) = &m.keyed {
            v["keyed"] = json!(true);
            if !o.is_empty() {
                v["key_overrides"] = o
                    .iter()
                    .map(|(k, t)| (format!("key-{k}"), json!(t)))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
            }
        }
        if let Some(l) = m.lease_ms {
            v["lease_ms"] = json!(l);
        }
        v
    }

    /// The class of its mode (a keyed task is [`Class::Local`] for the task-wide checks: every
    /// key has its own limit, checked per key in `modes.rs`).
    pub fn class(&self) -> Class {
        if self.modes.keyed.is_some() {
            return Class::Local;
        }
        Class::of_mode(self.mode)
    }

    /// The variant name of the step log and the focus: `keyed` (shadow or not: what the
    /// threshold means), `shadow` (on any other mode), `paced`, `concurrency`, or the mode.
    pub fn variant(&self) -> &'static str {
        if self.modes.keyed.is_some() {
            "keyed"
        } else if self.modes.shadow {
            "shadow"
        } else if self.modes.paced_burst.is_some() {
            "paced"
        } else {
            self.mode
        }
    }

    /// Makes the combination one the API accepts (what an edit of another field may have
    /// broken): pacing and keys in mode `pooled` only, `burst` ≤ `threshold`; `lease_ms` in
    /// mode `concurrency` only, and there no shadow, schedules or dynamic limiting.
    pub fn normalize(&mut self) {
        let m = &mut self.modes;
        if self.mode != "pooled" {
            m.paced_burst = None;
            m.keyed = None;
        }
        if let Some(b) = &mut m.paced_burst {
            *b = (*b).min(self.threshold);
        }
        if self.mode == "concurrency" {
            m.shadow = false;
            m.lease_ms.get_or_insert(2_000);
            self.schedules.clear();
            self.dynamic = None;
        } else {
            m.lease_ms = None;
        }
    }

    /// The limit of the key `key-i` per slice under this spec: its override in proportion to
    /// the largest cap (`o · cap / threshold`, `o` when the threshold is 0; rounded up), else
    /// the largest cap. A spec that is not keyed decides a key's requests on the task's quota,
    /// so one key gets at most the task's cap. 0 for a concurrency spec (no slices).
    pub fn key_limit(&self, i: u64) -> u64 {
        if self.mode == "concurrency" {
            return 0;
        }
        let cap = self.max_cap();
        match self
            .modes
            .keyed
            .as_ref()
            .and_then(|o| o.iter().find(|(k, _)| *k == i))
        {
            Some((_, o)) if self.threshold == 0 => *o,
            Some((_, o)) => {
                (u128::from(*o) * u128::from(cap)).div_ceil(u128::from(self.threshold)) as u64
            }
            None => cap,
        }
    }

    /// Dynamic limiting runs.
    pub fn dynamic_enabled(&self) -> bool {
        self.dynamic.as_ref().is_some_and(|d| d.enabled)
    }

    /// The largest cap a slice may carry under this spec: the base, every schedule entry (the
    /// soak does not evaluate cron: any entry may match), and the dynamic maximum while the
    /// controller runs.
    pub fn max_cap(&self) -> u64 {
        let mut m = self.threshold;
        for (_, t) in &self.schedules {
            m = m.max(*t);
        }
        if let Some(d) = &self.dynamic
            && d.enabled
        {
            m = m.max(d.max);
        }
        m
    }

    /// Whether a slice may carry `cap` under this spec (base, a schedule entry, or — while the
    /// controller runs — anything in `[min, max]`).
    pub fn allows(&self, cap: u64) -> bool {
        // A concurrency task has no slices: whatever the future slices hold was written for
        // an earlier spec, and no leader writes more under this one.
        self.mode == "concurrency"
            || cap == self.threshold
            || self.schedules.iter().any(|(_, t)| *t == cap)
            || self
                .dynamic
                .as_ref()
                .is_some_and(|d| d.enabled && (d.min..=d.max).contains(&cap))
    }

    /// A one-line summary for the step log.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} {}/{}ms local_limit {} on_failure {}",
            self.mode, self.threshold, self.slice_ms, self.local_limit, self.on_failure
        );
        if let Some(a) = self.fallback {
            s += &format!(" fallback {a}");
        }
        for (c, t) in &self.schedules {
            s += &format!(" sched[{c}]={t}");
        }
        if let Some(d) = &self.dynamic {
            s += &format!(
                " dynamic {} [{}, {}]",
                if d.enabled { "on" } else { "off" },
                d.min,
                d.max
            );
        }
        let m = &self.modes;
        if let Some(b) = m.paced_burst {
            s += &format!(" paced burst {b}");
        }
        if m.shadow {
            s += " shadow";
        }
        if let Some(o) = &m.keyed {
            s += " keyed";
            for (k, t) in o {
                s += &format!(" key-{k}={t}");
            }
        }
        if let Some(l) = m.lease_ms {
            s += &format!(" lease {l}ms");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Spec {
        Spec {
            threshold: 100,
            slice_ms: 1000,
            local_limit: 50,
            on_failure: "local",
            mode: "pooled",
            fallback: None,
            schedules: vec![("*/2 * * * * *", 150)],
            dynamic: Some(Dynamic {
                enabled: true,
                min: 20,
                max: 120,
            }),
            modes: Modes::default(),
        }
    }

    #[test]
    fn caps_allowed_by_a_spec() {
        let s = spec();
        assert_eq!(s.max_cap(), 150);
        assert!(s.allows(100) && s.allows(150) && s.allows(20) && s.allows(120));
        assert!(!s.allows(121) && !s.allows(19));
        let mut off = s.clone();
        off.dynamic.as_mut().unwrap().enabled = false;
        assert!(
            !off.allows(60),
            "a disabled controller allows nothing of its own"
        );
        assert_eq!(off.max_cap(), 150);
    }

    #[test]
    fn json_carries_every_varied_field() {
        let v = spec().to_json();
        assert_eq!(v["threshold"], 100);
        assert_eq!(v["schedules"][0]["threshold"], 150);
        assert_eq!(v["dynamic"]["max"], 120);
        assert!(v.get("fallback").is_none());
        assert!(v.get("keyed").is_none() && v.get("pacing").is_none());
    }

    #[test]
    fn modes_in_json_normalized_and_key_limits() {
        let mut s = spec();
        s.modes.keyed = Some(vec![(3, 50), (4, 300)]);
        s.modes.paced_burst = Some(500);
        s.normalize();
        assert_eq!(s.modes.paced_burst, Some(100), "burst ≤ threshold");
        let v = s.to_json();
        assert_eq!(v["keyed"], true);
        assert_eq!(v["key_overrides"]["key-3"], 50);
        assert_eq!(v["pacing"], "smooth");
        // max cap 150 (schedule): key-3 at 50 · 150 / 100 = 75, key-4 at 450, others 150.
        assert_eq!(
            (s.key_limit(3), s.key_limit(4), s.key_limit(0)),
            (75, 450, 150)
        );
        s.mode = "concurrency";
        s.modes.shadow = true;
        s.normalize();
        assert!(s.modes.keyed.is_none() && s.modes.paced_burst.is_none() && !s.modes.shadow);
        assert!(s.schedules.is_empty() && s.dynamic.is_none());
        assert_eq!(s.to_json()["lease_ms"], 2_000);
        assert!(s.allows(12_345), "no slices under a concurrency spec");
        s.mode = "exact_fixed";
        s.modes.shadow = true;
        s.normalize();
        assert_eq!(s.modes.lease_ms, None);
        assert_eq!(
            (s.variant(), s.to_json()["shadow"].clone()),
            ("shadow", json!(true))
        );
    }
}
