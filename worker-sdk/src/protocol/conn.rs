//! One Redis connection type for a single server and for Redis Cluster.
//!
//! A [`RedisTarget`] is parsed from one URL (a single server) or a comma-separated list (the
//! seed nodes of a Redis Cluster). [`Redis`] connects lazily and reconnects by itself, so a
//! process can start while Redis is down; [`RedisConn`] is the cheap, cloneable, multiplexed
//! handle: concurrent commands on it are pipelined on the wire.

use std::fmt;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use tokio::sync::Mutex;

/// Where Redis is: one server, or the seed nodes of a cluster.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server URL (`redis://host:port[/db]`).
    Single(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for RedisTarget {
    /// Shows the URLs without passwords.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn redact(url: &str) -> String {
            match (url.find("://"), url.rfind('@')) {
                (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
                _ => url.to_string(),
            }
        }
        match self {
            Self::Single(u) => f.write_str(&redact(u)),
            Self::Cluster(us) => {
                let v: Vec<String> = us.iter().map(|u| redact(u)).collect();
                write!(f, "cluster[{}]", v.join(","))
            }
        }
    }
}

impl RedisTarget {
    /// Parses `redis://a:6379` (single) or `redis://a:7000,redis://b:7001` (cluster). Each URL
    /// is checked now, so a typo is an error at start-up, not at the first request.
    ///
    /// ```
    /// use sluice::protocol::conn::RedisTarget;
    /// assert!(matches!(RedisTarget::parse("redis://127.0.0.1:6379"), Ok(RedisTarget::Single(_))));
    /// assert!(matches!(
    ///     RedisTarget::parse("redis://127.0.0.1:7000, redis://127.0.0.1:7001"),
    ///     Ok(RedisTarget::Cluster(v)) if v.len() == 2
    /// ));
    /// assert!(RedisTarget::parse("http://x").is_err());
    /// assert!(RedisTarget::parse(" ").is_err());
    /// ```
    pub fn parse(spec: &str) -> Result<Self, String> {
        let urls: Vec<String> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if urls.is_empty() {
            return Err("no Redis URL given".into());
        }
        for u in &urls {
            redis::Client::open(u.as_str()).map_err(|e| format!("bad Redis URL {u:?}: {e}"))?;
        }
        Ok(if urls.len() == 1 {
            Self::Single(urls.into_iter().next().unwrap_or_default())
        } else {
            Self::Cluster(urls)
        })
    }
}

/// Timeouts of a [`Redis`] connection.
#[derive(Debug, Clone, Copy)]
pub struct ConnOptions {
    /// Bound on establishing a TCP connection.
    pub connect_timeout: Duration,
    /// Bound on one request's answer.
    pub response_timeout: Duration,
}

impl Default for ConnOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
        }
    }
}

/// A connected, multiplexed handle (cheap to clone).
#[derive(Clone)]
pub enum RedisConn {
    /// A single server, reconnected automatically.
    Single(ConnectionManager),
    /// A cluster, routed by slot.
    Cluster(ClusterConnection),
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// A lazily connected Redis: [`Redis::conn`] connects on first use (and after a failed first
/// connect, on the next use), then hands out clones of one multiplexed connection.
pub struct Redis {
    target: RedisTarget,
    options: ConnOptions,
    conn: Mutex<Option<RedisConn>>,
}

impl fmt::Debug for Redis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redis")
            .field("target", &self.target)
            .finish()
    }
}

impl Redis {
    /// A handle to `target`; nothing is connected yet.
    pub fn new(target: RedisTarget, options: ConnOptions) -> Self {
        Self {
            target,
            options,
            conn: Mutex::new(None),
        }
    }

    /// Where this handle connects.
    pub fn target(&self) -> &RedisTarget {
        &self.target
    }

    /// The connection, connecting first if needed (bounded by the connect timeout).
    pub async fn conn(&self) -> RedisResult<RedisConn> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = self.connect().await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Drops the cached connection: the next [`Redis::conn`] connects afresh. For a caller
    /// whose request went unanswered within its deadline (the connection may be stuck; a new
    /// one costs one round trip on a healthy server).
    pub async fn reset(&self) {
        *self.conn.lock().await = None;
    }

    async fn connect(&self) -> RedisResult<RedisConn> {
        let o = self.options;
        let connect = async {
            match &self.target {
                RedisTarget::Single(url) => {
                    let client = redis::Client::open(url.as_str())?;
                    let cfg = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(o.connect_timeout))
                        .set_response_timeout(Some(o.response_timeout))
                        .set_number_of_retries(1)
                        .set_max_delay(o.connect_timeout);
                    Ok(RedisConn::Single(
                        ConnectionManager::new_with_config(client, cfg).await?,
                    ))
                }
                RedisTarget::Cluster(urls) => {
                    let client = ClusterClient::builder(urls.iter().map(String::as_str))
                        .connection_timeout(o.connect_timeout)
                        .response_timeout(o.response_timeout)
                        .retries(1)
                        .build()?;
                    Ok(RedisConn::Cluster(client.get_async_connection().await?))
                }
            }
        };
        match tokio::time::timeout(o.connect_timeout * 3, connect).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connecting to Redis at {} timed out", self.target),
            ))),
        }
    }
}
