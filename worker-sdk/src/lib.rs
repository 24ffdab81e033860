//! # Sluice worker SDK
//!
//! One global rate limit for a service that runs on many hosts, decided locally in
//! nanoseconds. See `docs/sdk.md` for a tour.
//!
//! ```no_run
//! let client = sluice::Client::new(sluice::Config::new("redis://127.0.0.1:6379"))?;
//! let task = client.task("checkout")?;
//! if task.try_acquire(1).is_allowed() {
//!     // do the work, then say how it went
//!     task.report(sluice::Outcome::Ok, std::time::Duration::from_millis(3));
//! }
//! # Ok::<(), sluice::Error>(())
//! ```
//!
//! # Layout
//!
//! * [`protocol`]: the wire contract with the manager: key names, Lua scripts, slice maths and
//!   the Redis connection type. Nothing else builds a key.
//! * [`shm`]: the host-shared memory segment: layout, the packed quota word, participants and
//!   their locks, slot reclamation.
//! * [`client`]: the public API ([`Client`], [`Task`], [`Decision`]).
//! * [`concurrency`]: mode `concurrency`: permits in flight ([`Permit`]) from a leased block.
//! * [`keyed`]: keyed tasks: a limit per key ([`Key`]) from a host-shared key table.
//! * [`multi`]: several limits per request, all or nothing ([`try_acquire_all`]).
//! * [`lock`]: distributed locks with fencing tokens ([`Client::lock`]).
//! * [`state`]: the NORMAL / LIMITED / FAILED state machine (pure).
//! * [`pull`]: pull sizing and prefetch policy (pure).
//! * [`limiter`]: local limiters for FAILED and mode `local` (pure algorithms).
//! * [`health`]: outcome reporting.
//! * [`layer`]: a tower layer: keys, costs, 429 / gRPC `RESOURCE_EXHAUSTED` with `Retry-After`
//!   and the IETF RateLimit fields.
//! * `background` (private): the client's thread that talks to Redis.
//! * [`clock`]: the host clock read on the decision path.
#![warn(missing_docs)]

mod background;
pub mod client;
pub mod clock;
pub mod concurrency;
pub mod health;
pub mod keyed;
pub mod layer;
pub mod limiter;
pub mod lock;
pub mod multi;
/// The wire protocol, a crate of its own ([`sluice_protocol`]); re-exported so that paths of
/// 0.1 (`sluice::protocol::…`) keep compiling.
#[doc(hidden)]
pub use sluice_protocol as protocol;
pub mod pull;
pub mod shm;
pub mod state;

pub use client::{Client, ClockSource, Config, Decision, Error, Task};
pub use concurrency::{Permit, PermitError};
pub use health::Outcome;
pub use keyed::Key;
pub use lock::{LockError, LockGuard};
pub use multi::{AllDecision, Limit, acquire_all, acquire_all_blocking, try_acquire_all};
pub use state::HostState;
