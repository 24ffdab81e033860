//! # Sluice worker SDK
//!
//! One global rate limit for a service that runs on many hosts, decided locally in
//! nanoseconds. See `docs/sdk.md` for a tour.
//!
//! ```no_run
//! use sluice::{Client, Config, Outcome};
//! use std::time::Instant;
//!
//! let mut cfg = Config::new("redis://127.0.0.1:6379"); // or "redis://a:7000,redis://b:7001" (Cluster)
//! cfg.namespace = "sluice".into(); // host id defaults to the hostname
//! let client = Client::new(cfg)?; // opens /dev/shm/sluice.<ns>.<host>
//! let checkout = client.task("checkout")?; // a task created in the manager; Clone + Send + Sync
//! let started = Instant::now();
//! let d = checkout.try_acquire(1); // sync, no network, no allocation
//! if d.is_allowed() {
//!     // do the work, then say how it went (feeds dynamic limits and the dashboard)
//!     checkout.report(Outcome::Ok, started.elapsed());
//! } else {
//!     println!("limited, retry in {:?}", d.retry_after()); // Limited / FallbackDenied
//! }
//! # Ok::<(), sluice::Error>(())
//! ```
//!
//! # What is here
//!
//! * [`Client`] (one per process and Redis) and [`Task`]: decisions ([`Decision`]) for modes
//!   `pooled`, `local`, `exact_fixed`, `exact_sliding`; [`Config`] / [`Config::builder`].
//! * [`Permit`]: mode `concurrency`, permits in flight from a leased block.
//! * [`Key`]: keyed tasks, a limit per key from a host-shared key table.
//! * [`try_acquire_all`] / [`acquire_all`]: several limits per request, all or nothing.
//! * [`Client::lock`]: distributed locks with fencing tokens ([`LockGuard`]).
//! * [`layer`] (feature `tower`, on by default): a tower layer for HTTP and gRPC services —
//!   keys, costs, 429 / `RESOURCE_EXHAUSTED` with `Retry-After` and the IETF RateLimit fields.
//!   Feature `axum` adds axum's `ConnectInfo` to its key extractor.
//!
//! The wire protocol (Redis key names, Lua scripts, slice maths) is the crate
//! [`sluice_protocol`], shared with the manager and the agent.
//!
//! # Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `tower` | yes | [`layer`]: the tower layer (`tower`, `http`) |
//! | `axum` | no | the layer's key extractor also reads axum's `ConnectInfo<SocketAddr>` |
//! | `tls` | yes | `rediss://` URLs: TLS to Redis with rustls (ring provider), client certificates |
//! | `cluster` | yes | Redis Cluster: a comma-separated list of seed nodes in [`Config::redis`] |
//!
//! # Stability
//!
//! The items at the crate root and in [`layer`] are the API. The hidden modules (`shm`,
//! `keyed`, `concurrency`, `state`, `pull`, `limiter`, `clock`) are public only for Sluice's
//! own tests, benchmarks and agent: they change without notice.
#![warn(missing_docs, unnameable_types)]

mod background;
mod client;
mod config;
mod ctx;
mod decide;
mod decision;
mod error;
mod health;
mod keytable;
mod lock;
mod multi;
mod plumbing;
mod refill;

#[cfg(feature = "tower")]
pub mod layer;

#[doc(hidden)]
pub mod clock;
#[doc(hidden)]
pub mod concurrency;
#[doc(hidden)]
pub mod keyed;
#[doc(hidden)]
pub mod limiter;
#[doc(hidden)]
pub mod pull;
#[doc(hidden)]
pub mod shm;
#[doc(hidden)]
pub mod state;

/// The wire protocol, a crate of its own ([`sluice_protocol`]); re-exported (hidden) so that
/// paths of 0.1 (`sluice::protocol::…`) keep compiling.
#[doc(hidden)]
pub use sluice_protocol as protocol;

pub use client::{Client, RedisCalls, Task};
pub use concurrency::PermitStats;
pub use config::{ClockSource, Config, ConfigBuilder};
pub use decision::Decision;
pub use error::Error;
pub use shm::SegmentError;
// Protocol types in the SDK's signatures (`Client::check_redis`, `Task::meta`, `Config`).
pub use sluice_protocol::conn::{CheckError, RedisSecurity, SecurityError};
pub use sluice_protocol::{Fallback, FallbackAlgorithm, Mode, NameError, OnFailure, TaskMeta};

/// Task slots of a host segment by default ([`Config::max_tasks`]).
pub const DEFAULT_MAX_TASKS: u32 = shm::DEFAULT_SLOTS;
/// The most task slots a host segment can have ([`Config::max_tasks`]).
pub const MAX_TASKS: u32 = shm::MAX_SLOTS;
/// Entries of the host's key table by default ([`Config::key_slots`]).
pub const DEFAULT_KEY_SLOTS: u32 = keyed::DEFAULT_KEY_SLOTS;
/// The most entries the host's key table can have ([`Config::key_slots`]).
pub const MAX_KEY_SLOTS: u32 = keyed::MAX_KEY_SLOTS;
pub use concurrency::{Permit, PermitError};
pub use health::Outcome;
pub use keyed::Key;
pub use lock::{LockError, LockGuard, MAX_LOCK_TTL, MIN_LOCK_TTL};
pub use multi::{
    AllDecision, Limit, PartTrace, acquire_all, acquire_all_blocking, acquire_all_traced,
    try_acquire_all,
};
pub use state::HostState;

/// The crate README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
