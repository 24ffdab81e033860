//! The randomized lifecycle + fault soak (issue 9): real etcd, Redis, three `sluice-manager`
//! replicas and simulated hosts running the `loadgen` example, driven through a seeded random
//! sequence of task changes and faults, with invariants checked after every step and
//! continuously. The program is `tests/src/bin/soak.rs` (run it with `scripts/soak.sh`); the
//! design, weights and bounds are in `docs/soak.md`.
//!
//! # Layout
//!
//! * [`rng`] — the seeded generator (SplitMix64): one seed, one sequence of steps.
//! * [`spec`] — the soak's model of a task spec: the JSON it sends, the caps it allows.
//! * [`plan`] — the steps, their weights, and the planner (a pure function of the seed).
//! * [`ledger`] — what happened: spec versions, observed meta, disturbances, bucket counts.
//! * [`check`] — the invariants, pure functions of the ledger (unit-tested without servers).
//! * [`modes`] — paced, shadow, keyed and concurrency tasks: the seed's focus, their loadgen
//!   arguments and their invariants.
//! * [`world`] — the processes (servers, replicas, hosts and their loadgen runs) and the
//!   actions of each step.
//! * [`run`] — the main loop: plan, apply, monitor, check, report.
//! * [`agents`] — agent hosts: a `sluice-agent` per host, asked over RLS or HTTP.
//! * [`envoy`] — an envoyproxy/ratelimit domain imported, re-imported and deleted.
//! * [`locks`] — the lock track: holders of one lock, a fenced resource, the lock's Redis
//!   restarted from its dump; its invariants.

pub mod agents;
pub mod check;
pub mod envoy;
pub mod ledger;
pub mod locks;
pub mod modes;
pub mod plan;
pub use sluice_testkit::rng;
pub mod run;
pub mod spec;
pub mod world;
