//! # Sluice worker SDK
//!
//! One global rate limit for a service that runs on many hosts, decided locally in
//! nanoseconds. See `docs/sdk.md` for a tour.
//!
//! # Layout
//!
//! * [`protocol`]: the wire contract with the manager: key names, Lua scripts, slice maths and
//!   the Redis connection type. Nothing else builds a key.
#![warn(missing_docs)]

pub mod protocol;
