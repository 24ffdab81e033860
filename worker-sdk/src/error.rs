//! [`Error`]: why a client or a task could not be created.

use std::path::PathBuf;

use crate::protocol::NameError;
use crate::protocol::conn::SecurityError;
use crate::shm::SegmentError;

#[cfg(doc)]
use crate::Config;

/// Why a client or task could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting of [`Config`] is out of range ([`Config::validate`]).
    #[error("Config::{field}: {message}")]
    Config {
        /// The field of [`Config`].
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A bad task name or namespace.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The Redis address does not parse.
    #[error("Redis address: {0}")]
    Redis(String),
    /// A TLS or ACL setting of [`Config::redis_security`] cannot be used (the field is named,
    /// a secret never).
    #[error("{}", security_message(.0))]
    RedisSecurity(#[source] SecurityError),
    /// The shared segment could not be opened.
    #[error(transparent)]
    Segment(#[from] SegmentError),
    /// Every slot of the segment is taken.
    #[error("shared segment {path} has no free slot for task {task:?}")]
    SegmentFull {
        /// The segment.
        path: PathBuf,
        /// The task.
        task: String,
    },
    /// The background thread could not be started.
    #[error("cannot start the background thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The host's key table (keyed tasks) could not be opened.
    #[error("{0}")]
    KeyTable(String),
}

/// `Config::redis_security.<field>: …`, or `Config::redis: …` for the URL itself.
fn security_message(e: &SecurityError) -> String {
    match e.field {
        "redis" => format!("Config::redis: {}", e.message),
        f => format!("Config::redis_security.{f}: {}", e.message),
    }
}
