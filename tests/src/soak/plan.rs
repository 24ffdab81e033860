//! Steps, their weights, and the planner.
//!
//! The planner is a pure function of the seed: it never looks at what the system did, so one
//! seed always yields the same sequence of steps whatever the timing (which replica leads, how
//! long a restart takes, whether an API call was refused are decided at run time, by the
//! executor). It keeps its own model of each task's spec (assuming every change it asks for
//! is made) only to derive the next edit from the last one.
//!
//! Thresholds are derived from the demand: every task has a fixed offered rate per host, and
//! a threshold is set so that demand per slice is 1.5–3 × the threshold.

use std::collections::BTreeMap;
use std::fmt;

use super::modes::{self, Focus};
use super::rng::Rng;
use super::spec::{Dynamic, Modes, Spec};

/// Cron expressions the soak puts into schedules (UTC, with seconds).
pub const CRONS: [&str; 4] = [
    "*/2 * * * * *",
    "*/3 * * * * *",
    "0-29 * * * * *",
    "* */2 * * * *",
];

/// The kinds of random steps, by the name used in `--weights` and in the step log, with their
/// default weights.
pub const DEFAULT_WEIGHTS: [(&str, u32); 25] = [
    ("put.threshold", 10),
    ("put.slice", 6),
    ("put.mode", 5),
    ("put.failure", 3),
    ("put.schedule", 3),
    ("put.dynamic", 3),
    ("put.replace", 3),
    ("delete", 3),
    ("recreate", 4),
    ("leader.kill", 5),
    ("leader.stop", 5),
    ("leader.term", 4),
    ("redis.restart", 3),
    ("redis.flushall", 3),
    ("redis.sleep", 4),
    ("etcd.restart", 3),
    ("host.kill", 5),
    ("clock.shift", 3),
    ("pause", 6),
    ("envoy.import", 3),
    ("envoy.delete", 1),
    ("cluster2", 1),
    ("lock.kill", 3),
    ("lock.stop", 3),
    ("lock.redis", 2),
];

/// Step weights: the defaults, overridden by `name=weight,…`.
#[derive(Debug, Clone)]
pub struct Weights(pub Vec<(&'static str, u32)>);

impl Default for Weights {
    fn default() -> Self {
        Self(DEFAULT_WEIGHTS.to_vec())
    }
}

impl Weights {
    /// Parses `name=weight,…` over the defaults; a name may end in `*` to set every kind
    /// with that prefix (`put.*=0`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut w = Self::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, n) = part
                .split_once('=')
                .ok_or_else(|| format!("weight {part:?}: expected name=number"))?;
            let n: u32 = n
                .parse()
                .map_err(|_| format!("weight {part:?}: not a number"))?;
            let mut hit = false;
            for (k, v) in &mut w.0 {
                let matches = match name.strip_suffix('*') {
                    Some(prefix) => k.starts_with(prefix),
                    None => *k == name,
                };
                if matches {
                    *v = n;
                    hit = true;
                }
            }
            if !hit {
                let names: Vec<&str> = DEFAULT_WEIGHTS.iter().map(|(k, _)| *k).collect();
                return Err(format!(
                    "unknown step kind {name:?}; kinds: {}",
                    names.join(", ")
                ));
            }
        }
        if w.0.iter().all(|(_, v)| *v == 0) {
            return Err("every weight is 0".into());
        }
        Ok(w)
    }
}

/// One step of the soak.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// `PUT` a spec (create, or one kind of edit: `kind` is the weight name).
    Put {
        /// Task index.
        task: usize,
        /// What the edit changes (`put.slice`, …; `create` for a task the planner deleted).
        kind: &'static str,
        /// The whole spec sent.
        spec: Spec,
    },
    /// `DELETE` a task.
    Delete {
        /// Task index.
        task: usize,
    },
    /// `DELETE`, wait, `PUT` other values.
    Recreate {
        /// Task index.
        task: usize,
        /// Pause between the two calls, ms.
        pause_ms: u64,
        /// The new spec.
        spec: Spec,
    },
    /// SIGKILL the leader; restart it `restart_after` steps later.
    LeaderKill {
        /// Steps until the restart.
        restart_after: u32,
    },
    /// SIGSTOP the leader, SIGCONT it after `pause_ms` (the lease is 2 s).
    LeaderStop {
        /// How long it stays stopped, ms.
        pause_ms: u64,
    },
    /// SIGTERM the leader (it resigns); restart it `restart_after` steps later.
    LeaderTerm {
        /// Steps until the restart.
        restart_after: u32,
    },
    /// Restart every replica that is down (the repair of kills and terms).
    RestartReplicas,
    /// SIGKILL Redis (no persistence: data lost), restart it after `down_ms`.
    RedisRestart {
        /// Downtime, ms.
        down_ms: u64,
    },
    /// `FLUSHALL`.
    RedisFlush,
    /// `DEBUG SLEEP` (Redis answers nothing meanwhile).
    RedisSleep {
        /// Sleep, ms.
        ms: u64,
    },
    /// SIGKILL etcd, start it again on the same data after `down_ms`.
    EtcdRestart {
        /// Downtime, ms.
        down_ms: u64,
    },
    /// SIGKILL every loadgen of a host; restart them after `down_ms`.
    HostKill {
        /// Host index.
        host: usize,
        /// Downtime, ms.
        down_ms: u64,
    },
    /// Restart the faketime host's loadgens with a new clock offset.
    ClockShift {
        /// The new offset, ms (a multiple of 100).
        offset_ms: i64,
    },
    /// No disturbance.
    Pause {
        /// How long, ms.
        ms: u64,
    },
    /// Repair everything, let it settle, and check liveness.
    Quiet,
    /// Import (or re-import) the Envoy domain `soakenv` ([`super::envoy`]).
    EnvoyImport {
        /// `requests_per_unit` per descriptor (`None`: left out).
        limits: Vec<Option<u64>>,
    },
    /// Delete the Envoy domain.
    EnvoyDelete,
    /// A second manager cluster (own etcd, same Redis and namespace) for `run_ms`.
    SecondCluster {
        /// How long it runs once it leads, ms.
        run_ms: u64,
    },
    /// SIGKILL the lock's current holder (the lock track, `locks.rs`).
    LockKill,
    /// SIGSTOP the lock's current holder for `ms` (past the TTL), then SIGCONT.
    LockStop {
        /// How long it stays stopped, ms.
        ms: u64,
    },
    /// `SAVE` the lock's Redis, SIGKILL it `more_ms` later (tokens handed out meanwhile are
    /// not in the dump), restart it from the dump `down_ms` after that.
    LockRedisRestart {
        /// Time between the `SAVE` and the kill, ms.
        more_ms: u64,
        /// Downtime, ms.
        down_ms: u64,
    },
}

/// A step and the time to let pass after it (monitoring and checking meanwhile).
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// The step.
    pub step: Step,
    /// Time after it, ms.
    pub gap_ms: u64,
}

/// Names of the soak's tasks.
pub fn task_name(i: usize) -> String {
    format!("t{i}")
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Put { task, kind, spec } => {
                write!(f, "{kind} {}: {}", task_name(*task), spec.describe())
            }
            Step::Delete { task } => write!(f, "delete {}", task_name(*task)),
            Step::Recreate {
                task,
                pause_ms,
                spec,
            } => write!(
                f,
                "recreate {} after {pause_ms} ms: {}",
                task_name(*task),
                spec.describe()
            ),
            Step::LeaderKill { restart_after } => {
                write!(f, "leader.kill (restart in {restart_after} steps)")
            }
            Step::LeaderStop { pause_ms } => write!(f, "leader.stop for {pause_ms} ms"),
            Step::LeaderTerm { restart_after } => {
                write!(f, "leader.term (restart in {restart_after} steps)")
            }
            Step::RestartReplicas => write!(f, "restart replicas that are down"),
            Step::RedisRestart { down_ms } => write!(f, "redis.restart, down {down_ms} ms"),
            Step::RedisFlush => write!(f, "redis.flushall"),
            Step::RedisSleep { ms } => write!(f, "redis.sleep {ms} ms"),
            Step::EtcdRestart { down_ms } => write!(f, "etcd.restart, down {down_ms} ms"),
            Step::HostKill { host, down_ms } => {
                write!(f, "host.kill h{host}, down {down_ms} ms")
            }
            Step::ClockShift { offset_ms } => write!(f, "clock.shift to {offset_ms:+} ms"),
            Step::Pause { ms } => write!(f, "pause {ms} ms"),
            Step::Quiet => write!(f, "quiet period + liveness check"),
            Step::EnvoyImport { limits } => {
                let l: Vec<String> = (limits.iter().zip(super::envoy::DESCRIPTORS))
                    .map(|(l, d)| match l {
                        Some(n) => format!("path={d}: {n}/s"),
                        None => format!("path={d}: left out"),
                    })
                    .collect();
                write!(f, "envoy.import {}: {}", super::envoy::DOMAIN, l.join(", "))
            }
            Step::EnvoyDelete => write!(f, "envoy.delete {}", super::envoy::DOMAIN),
            Step::SecondCluster { run_ms } => write!(
                f,
                "cluster2: a second manager cluster on the namespace for {run_ms} ms"
            ),
            Step::LockKill => write!(f, "lock.kill"),
            Step::LockStop { ms } => write!(f, "lock.stop for {ms} ms"),
            Step::LockRedisRestart { more_ms, down_ms } => write!(
                f,
                "lock.redis: SAVE, kill {more_ms} ms later, down {down_ms} ms"
            ),
        }
    }
}

/// The fixed shape of a run the planner needs: tasks, hosts, offered rates.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Offered decisions per second per host, per task.
    pub host_rate: Vec<u64>,
    /// Number of simulated hosts (the last one runs under faketime).
    pub hosts: usize,
    /// How many of `hosts` are agent hosts (the last ones), each offering
    /// [`super::agents::AGENT_RATE_SHARE`] of a host's rate.
    pub agents: usize,
}

impl Shape {
    /// Demand of a task per slice of `slice_ms`, all hosts.
    pub fn demand(&self, task: usize, slice_ms: u64) -> f64 {
        let hosts = (self.hosts - self.agents) as f64
            + self.agents as f64 * super::agents::AGENT_RATE_SHARE;
        self.host_rate[task] as f64 * hosts * slice_ms as f64 / 1_000.0
    }
}

/// The planner: the seed's sequence of steps.
#[derive(Debug, Clone)]
pub struct Planner {
    rng: Rng,
    weights: Weights,
    /// The shape of the run.
    pub shape: Shape,
    specs: Vec<Option<Spec>>,
    /// Restart due (step index) of every replica the planner took down.
    down: Vec<u64>,
    index: u64,
    next_quiet: u64,
    /// Every spec of a task keeps the slice length of its first one.
    fixed_slices: Option<Vec<u64>>,
    /// The Envoy domain's limits as last imported (None: not imported).
    envoy: Option<Vec<Option<u64>>>,
    /// The modes this seed favours (`put.mode`, new specs; the first task starts in it).
    pub focus: Focus,
    forced: Option<&'static str>,
}

impl Planner {
    /// A planner for `tasks` tasks on `hosts` hosts; the shape (offered rates) and the initial
    /// specs come from the seed too.
    pub fn new(seed: u64, weights: Weights, tasks: usize, hosts: usize) -> Self {
        let mut rng = Rng::new(seed);
        let host_rate = (0..tasks).map(|_| rng.range(15, 50) * 10).collect();
        let mut p = Self {
            rng,
            weights,
            shape: Shape {
                host_rate,
                hosts,
                agents: 0,
            },
            specs: vec![None; tasks],
            down: Vec::new(),
            index: 0,
            next_quiet: 0,
            fixed_slices: None,
            envoy: None,
            focus: Focus::of_seed(seed),
            forced: None,
        };
        p.next_quiet = p.rng.range(4, 7);
        p
    }

    /// The specs every task is created with before the first step. With `fixed_slices`, every
    /// later spec of a task keeps the slice length of its first one (no `put.slice` steps, no
    /// grid change on re-creation): a way to run past defects of grid changes.
    pub fn initial_specs(&mut self, fixed_slices: bool) -> Vec<Spec> {
        let specs: Vec<Spec> = (0..self.specs.len())
            .map(|t| {
                if t == 0 {
                    self.forced = Some(self.focus.first_variant(&mut self.rng));
                }
                self.random_spec(t)
            })
            .collect();
        self.specs = specs.iter().cloned().map(Some).collect();
        if fixed_slices {
            self.fixed_slices = Some(specs.iter().map(|s| s.slice_ms).collect());
            for (k, w) in &mut self.weights.0 {
                if *k == "put.slice" {
                    *w = 0;
                }
            }
        }
        specs
    }

    /// The next step.
    pub fn next_step(&mut self) -> Planned {
        self.index += 1;
        let i = self.index;
        if self.down.iter().any(|d| *d <= i) {
            self.down.retain(|d| *d > i);
            return Planned {
                step: Step::RestartReplicas,
                gap_ms: self.rng.range(500, 2_000),
            };
        }
        if i >= self.next_quiet {
            self.next_quiet = i + self.rng.range(4, 8);
            self.down.clear();
            return Planned {
                step: Step::Quiet,
                gap_ms: 0,
            };
        }
        let step = loop {
            let kind = *self.rng.weighted(&self.weights.0);
            if let Some(s) = self.step_of(kind) {
                break s;
            }
        };
        let gap_ms = self.rng.range(500, 4_000);
        Planned { step, gap_ms }
    }

    /// A step of `kind`, or None when it does not apply now (e.g. a third replica down).
    fn step_of(&mut self, kind: &'static str) -> Option<Step> {
        let i = self.index;
        let tasks = self.specs.len() as u64;
        Some(match kind {
            "delete" => {
                let task = self.rng.below(tasks) as usize;
                self.specs[task].as_ref()?;
                self.specs[task] = None;
                Step::Delete { task }
            }
            "recreate" => {
                let task = self.rng.below(tasks) as usize;
                let pause_ms = self.rng.range(0, 2_000);
                let spec = self.random_spec(task);
                self.specs[task] = Some(spec.clone());
                Step::Recreate {
                    task,
                    pause_ms,
                    spec,
                }
            }
            k if k.starts_with("put.") => {
                let task = self.rng.below(tasks) as usize;
                let (kind, spec) = match self.specs[task].clone() {
                    None => ("create", self.random_spec(task)),
                    Some(cur) => (k, self.edit(task, &cur, k)),
                };
                self.specs[task] = Some(spec.clone());
                Step::Put { task, kind, spec }
            }
            "leader.kill" | "leader.term" => {
                if self.down.len() >= 2 {
                    return None;
                }
                let restart_after = self.rng.range(1, 3) as u32;
                self.down.push(i + u64::from(restart_after));
                if kind == "leader.kill" {
                    Step::LeaderKill { restart_after }
                } else {
                    Step::LeaderTerm { restart_after }
                }
            }
            "leader.stop" => Step::LeaderStop {
                pause_ms: if self.rng.chance(0.5) {
                    self.rng.range(300, 1_500)
                } else {
                    self.rng.range(2_500, 6_000)
                },
            },
            "redis.restart" => Step::RedisRestart {
                down_ms: self.rng.range(0, 2_000),
            },
            "redis.flushall" => Step::RedisFlush,
            "redis.sleep" => Step::RedisSleep {
                ms: self.rng.range(200, 2_000),
            },
            "etcd.restart" => Step::EtcdRestart {
                down_ms: self.rng.range(500, 8_000),
            },
            "host.kill" => Step::HostKill {
                host: self.rng.below(self.shape.hosts as u64) as usize,
                down_ms: self.rng.range(0, 3_000),
            },
            "clock.shift" => {
                let size = if self.rng.chance(0.5) {
                    self.rng.range(1, 3)
                } else {
                    self.rng.range(4, 15)
                } as i64;
                let sign = if self.rng.chance(0.5) { 1 } else { -1 };
                Step::ClockShift {
                    offset_ms: sign * size * 100,
                }
            }
            "pause" => Step::Pause {
                ms: self.rng.range(1_000, 5_000),
            },
            "envoy.import" => {
                let limits = super::envoy::next_limits(&mut self.rng, self.envoy.as_deref());
                self.envoy = Some(limits.clone());
                Step::EnvoyImport { limits }
            }
            "envoy.delete" => {
                self.envoy.take()?;
                Step::EnvoyDelete
            }
            // While the Envoy domain is imported: its mirror is what the second could delete.
            "cluster2" => {
                self.envoy.as_ref()?;
                Step::SecondCluster {
                    run_ms: self.rng.range(5_000, 15_000),
                }
            }
            "lock.kill" => Step::LockKill,
            "lock.stop" => Step::LockStop {
                ms: self.rng.range(1_500, 4_000),
            },
            "lock.redis" => Step::LockRedisRestart {
                more_ms: self.rng.range(300, 2_500),
                down_ms: self.rng.range(0, 1_500),
            },
            other => unreachable!("step kind {other} has no generator"),
        })
    }

    fn slice_ms(&mut self) -> u64 {
        if self.rng.chance(0.1) {
            return self.rng.range(3, 30) * 100;
        }
        *self.rng.weighted(&[
            (100, 10),
            (200, 8),
            (500, 12),
            (1_000, 25),
            (2_000, 12),
            (5_000, 5),
            (10_000, 3),
        ])
    }

    /// A threshold that puts the task's demand at 1.5–3 × it.
    fn threshold(&mut self, task: usize, slice_ms: u64) -> u64 {
        let d = self.shape.demand(task, slice_ms);
        ((d / self.rng.uniform(1.5, 3.0)).round() as u64).max(1)
    }

    fn mode(&mut self) -> &'static str {
        const MODES: [(&str, u32); 4] = [
            ("pooled", 11),
            ("exact_fixed", 3),
            ("exact_sliding", 3),
            ("local", 3),
        ];
        self.rng.weighted::<&'static str>(&MODES)
    }

    fn failure(&mut self, threshold: u64) -> (&'static str, u64, Option<&'static str>) {
        let on_failure = *self
            .rng
            .weighted(&[("local", 6), ("allow", 2), ("deny", 2)]);
        let local_limit = ((threshold as f64 * self.rng.uniform(0.2, 1.0)).round() as u64).max(1);
        let fallback = if self.rng.chance(0.2) {
            Some(*self.rng.pick(&[
                "token_bucket",
                "fixed_window",
                "sliding_window",
                "sliding_log",
                "leaky_bucket",
            ]))
        } else {
            None
        };
        (on_failure, local_limit, fallback)
    }

    fn schedules(
        &mut self,
        task: usize,
        slice_ms: u64,
        threshold: u64,
    ) -> Vec<(&'static str, u64)> {
        let d = self.shape.demand(task, slice_ms);
        (0..self.rng.range(1, 2))
            .map(|_| {
                let cron = *self.rng.pick(&CRONS);
                let t = (threshold as f64 * self.rng.uniform(0.6, 1.2)).min(d / 1.3);
                (cron, (t.round() as u64).max(1))
            })
            .collect()
    }

    fn dynamic(&mut self, threshold: u64) -> Dynamic {
        let min = (threshold / 4).max(1);
        let max = ((threshold as f64 * self.rng.uniform(1.0, 1.4)).round() as u64).max(min);
        Dynamic {
            enabled: self.rng.chance(0.8),
            min,
            max,
        }
    }

    fn random_spec(&mut self, task: usize) -> Spec {
        let drawn = self.slice_ms();
        let slice_ms = self.fixed_slices.as_ref().map_or(drawn, |f| f[task]);
        let threshold = self.threshold(task, slice_ms);
        let mode = self.mode();
        let (on_failure, local_limit, fallback) = self.failure(threshold);
        let schedules = if self.rng.chance(0.25) {
            self.schedules(task, slice_ms, threshold)
        } else {
            Vec::new()
        };
        let dynamic = self.rng.chance(0.2).then(|| self.dynamic(threshold));
        let mut s = Spec {
            threshold,
            slice_ms,
            local_limit,
            on_failure,
            mode,
            fallback,
            schedules,
            dynamic,
            modes: Modes::default(),
        };
        let v = match self.forced.take() {
            Some(v) => v,
            None => modes::draw(&mut self.rng, self.focus),
        };
        modes::apply(&mut self.rng, v, &self.shape, task, &mut s);
        s
    }

    /// `cur` changed the way `kind` says.
    fn edit(&mut self, task: usize, cur: &Spec, kind: &str) -> Spec {
        let mut s = cur.clone();
        match kind {
            "put.threshold" => {
                s.threshold = self.threshold(task, s.slice_ms);
            }
            "put.slice" => {
                let mut l = self.slice_ms();
                while l == s.slice_ms {
                    l = self.slice_ms();
                }
                let scale =
                    |n: u64| ((n as f64 * l as f64 / s.slice_ms as f64).round() as u64).max(1);
                s.threshold = scale(s.threshold);
                s.local_limit = scale(s.local_limit);
                for e in &mut s.schedules {
                    e.1 = scale(e.1);
                }
                if let Some(d) = &mut s.dynamic {
                    d.min = scale(d.min);
                    d.max = scale(d.max).max(d.min);
                }
                s.slice_ms = l;
            }
            "put.mode" => {
                let mut v = modes::draw(&mut self.rng, self.focus);
                while v == s.variant() {
                    v = modes::draw(&mut self.rng, self.focus);
                }
                modes::apply(&mut self.rng, v, &self.shape, task, &mut s);
            }
            "put.failure" => {
                (s.on_failure, s.local_limit, s.fallback) = self.failure(s.threshold);
            }
            "put.schedule" => {
                s.schedules = if s.schedules.is_empty() {
                    self.schedules(task, s.slice_ms, s.threshold)
                } else {
                    Vec::new()
                };
            }
            "put.dynamic" => {
                s.dynamic = match &s.dynamic {
                    None => Some(Dynamic {
                        enabled: true,
                        ..self.dynamic(s.threshold)
                    }),
                    Some(d) if d.enabled => Some(Dynamic {
                        enabled: false,
                        ..d.clone()
                    }),
                    Some(d) => {
                        if self.rng.chance(0.5) {
                            None
                        } else {
                            Some(Dynamic {
                                enabled: true,
                                ..d.clone()
                            })
                        }
                    }
                };
            }
            _ => s = self.random_spec(task),
        }
        modes::after_edit(&mut self.rng, &self.shape, task, cur, kind, &mut s);
        s
    }
}

/// Counts of the steps of a sequence by kind (for the summary).
pub fn count_kinds<'a>(steps: impl IntoIterator<Item = &'a Step>) -> BTreeMap<&'static str, u64> {
    let mut m = BTreeMap::new();
    for s in steps {
        let k = match s {
            Step::Put { kind, .. } => *kind,
            Step::Delete { .. } => "delete",
            Step::Recreate { .. } => "recreate",
            Step::LeaderKill { .. } => "leader.kill",
            Step::LeaderStop { .. } => "leader.stop",
            Step::LeaderTerm { .. } => "leader.term",
            Step::RestartReplicas => "restart",
            Step::RedisRestart { .. } => "redis.restart",
            Step::RedisFlush => "redis.flushall",
            Step::RedisSleep { .. } => "redis.sleep",
            Step::EtcdRestart { .. } => "etcd.restart",
            Step::HostKill { .. } => "host.kill",
            Step::ClockShift { .. } => "clock.shift",
            Step::Pause { .. } => "pause",
            Step::Quiet => "quiet",
            Step::EnvoyImport { .. } => "envoy.import",
            Step::EnvoyDelete => "envoy.delete",
            Step::SecondCluster { .. } => "cluster2",
            Step::LockKill => "lock.kill",
            Step::LockStop { .. } => "lock.stop",
            Step::LockRedisRestart { .. } => "lock.redis",
        };
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(seed: u64, n: usize) -> Vec<Planned> {
        let mut p = Planner::new(seed, Weights::default(), 3, 3);
        p.initial_specs(false);
        (0..n).map(|_| p.next_step()).collect()
    }

    #[test]
    fn one_seed_one_sequence() {
        assert_eq!(steps(99, 200), steps(99, 200));
        assert_ne!(steps(99, 50), steps(100, 50));
    }

    #[test]
    fn replicas_are_restarted_and_never_more_than_two_down() {
        let mut p = Planner::new(5, Weights::parse("leader.*=50").unwrap(), 3, 3);
        p.initial_specs(false);
        let mut down = 0i32;
        for _ in 0..500 {
            match p.next_step().step {
                Step::LeaderKill { .. } | Step::LeaderTerm { .. } => down += 1,
                Step::RestartReplicas | Step::Quiet => down = 0,
                _ => {}
            }
            assert!(down <= 2, "three replicas down");
        }
    }

    #[test]
    fn thresholds_keep_demand_above_them_and_specs_are_valid() {
        let mut p = Planner::new(11, Weights::default(), 3, 3);
        p.initial_specs(false);
        for _ in 0..2_000 {
            let (task, s) = match p.next_step().step {
                Step::Put { task, spec, .. } | Step::Recreate { task, spec, .. } => (task, spec),
                _ => continue,
            };
            assert!(s.slice_ms >= 100 && s.slice_ms <= 10_000 && s.slice_ms % 100 == 0);
            assert!(s.threshold >= 1);
            if matches!(s.variant(), "keyed" | "concurrency") {
                continue; // a per-key limit, permits in flight: modes.rs tests them
            }
            let ratio = p.shape.demand(task, s.slice_ms) / s.threshold as f64;
            assert!(
                (1.4..=3.2).contains(&ratio),
                "demand / threshold {ratio}: {s:?}"
            );
            if let Some(d) = &s.dynamic {
                assert!(d.min <= d.max, "{s:?}");
            }
        }
    }

    #[test]
    fn fixed_slices_keep_every_task_on_its_first_grid() {
        let mut p = Planner::new(3, Weights::default(), 3, 3);
        let first: Vec<u64> = p.initial_specs(true).iter().map(|s| s.slice_ms).collect();
        for _ in 0..1_000 {
            if let Step::Put { task, spec, .. } | Step::Recreate { task, spec, .. } =
                p.next_step().step
            {
                assert_eq!(spec.slice_ms, first[task]);
            }
        }
    }

    #[test]
    fn weights_parse_names_and_prefixes() {
        let w = Weights::parse("put.*=0, delete=7").unwrap();
        assert!(
            w.0.iter()
                .filter(|(k, _)| k.starts_with("put."))
                .all(|(_, v)| *v == 0)
        );
        assert!(w.0.contains(&("delete", 7)));
        assert!(Weights::parse("nope=1").is_err());
        assert!(Weights::parse("delete").is_err());
    }
}
