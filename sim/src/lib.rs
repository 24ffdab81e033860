//! Sluice's deterministic simulation (issue 25): simulated servers in one process that run the
//! production code paths, so seeded fault schedules can be explored far faster than real time
//! and any failure replayed from its seed.
//!
//! What exists so far: [`redis`], a simulated Redis that runs the real Lua scripts of
//! `sluice-protocol` through an embedded Lua 5.1, reached through the `redis` crate's own
//! connection trait, with faults (lost requests and replies, delays, restarts empty or from a
//! snapshot, failover to a lagging replica, `DEBUG SLEEP`). It is held to a real Redis by a
//! differential test (`tests/differential.rs`). See docs/simulation.md.

pub mod redis;
pub mod rng;
pub mod world;
