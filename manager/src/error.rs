//! The manager's error type: one enum, each variant with the context an operator needs.

use std::time::Duration;

/// Errors of the manager library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An etcd request failed.
    #[error("etcd {op}: {source}")]
    Etcd {
        /// What was being done.
        op: &'static str,
        /// The client error.
        #[source]
        source: etcd_client::Error,
    },
    /// A Redis request failed.
    #[error("redis {op}: {source}")]
    Redis {
        /// What was being done.
        op: &'static str,
        /// The client error.
        #[source]
        source: redis::RedisError,
    },
    /// A request took longer than its bound.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// The bound.
        after: Duration,
    },
    /// A newer leader has written this task: this replica must step down.
    #[error("fenced on task {task:?}: our term {term} < stored term {current}")]
    Fenced {
        /// The task.
        task: String,
        /// Our term.
        term: i64,
        /// The term found in Redis.
        current: i64,
    },
    /// Leadership ended (cancelled, or the lease can no longer be proven): stop writing.
    #[error("no longer the leader")]
    NotLeader,
    /// Stored data could not be decoded.
    #[error("corrupt {what}: {why}")]
    Corrupt {
        /// What was read.
        what: String,
        /// Why it is unusable.
        why: String,
    },
    /// A stored document (written into etcd by hand, or by another version) does not pass the
    /// API's validation.
    #[error("stored {what} (version {version}) is invalid: {error}")]
    Invalid {
        /// What was read.
        what: &'static str,
        /// Its version (etcd mod revision).
        version: i64,
        /// What is wrong, and where.
        error: crate::spec::FieldError,
    },
    /// Start-up failed (bind, configuration).
    #[error("{0}")]
    Startup(String),
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Runs an etcd call with a time bound, mapping errors.
pub async fn etcd<T, F>(op: &'static str, after: Duration, fut: F) -> Result<T>
where
    F: Future<Output = Result<T, etcd_client::Error>>,
{
    match tokio::time::timeout(after, fut).await {
        Ok(r) => r.map_err(|source| Error::Etcd { op, source }),
        Err(_) => Err(Error::Timeout { op, after }),
    }
}

/// Maps a Redis error.
pub fn redis(op: &'static str) -> impl FnOnce(redis::RedisError) -> Error {
    move |source| Error::Redis { op, source }
}
