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
        v
    }

    /// The class of its mode.
    pub fn class(&self) -> Class {
        Class::of_mode(self.mode)
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
        cap == self.threshold
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
    }
}
