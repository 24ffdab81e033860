//! Holds permits of a concurrency task, or a lock, until told otherwise: the process the
//! concurrency tests kill, stop and resume (and an example of the two APIs).
//!
//! ```text
//! holder --redis URL --namespace NS --host-id H permits --task T --count N
//!     takes N permits (waiting up to 10 s), prints "held N", then holds them until stdin closes
//! holder --redis URL --namespace NS --host-id H lock --name L --ttl-ms T --resource KEY
//!        [--resource-redis URL2]
//!     takes lock L, prints "token <t>", then for each stdin line "write <value>" writes
//!     <value> to the fenced resource KEY (in the Redis at URL2, else at URL) with its token
//!     and prints "written" or "refused <highest token seen>"; prints "held true|false" for a
//!     line "held"; releases the lock and exits 0 when stdin closes
//! ```
//!
//! # The fenced resource
//!
//! A Redis hash `KEY` (`token`, `value`) stands for any storage that protects itself with
//! fencing tokens: a write carries the writer's lock token and is applied only if that token
//! is not lower than the highest token the resource has seen (one Lua call: check and write
//! are atomic on the resource's side). A holder that lost its lock while paused, and writes
//! late, is refused as soon as a newer holder has written.

use std::io::{BufRead, Write};
use std::time::Duration;

use clap::{Parser, Subcommand};
use sluice::{Client, Config};

#[derive(Debug, Parser)]
struct Args {
    #[arg(long)]
    redis: String,
    #[arg(long)]
    namespace: String,
    #[arg(long)]
    host_id: String,
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Hold permits of a concurrency task.
    Permits {
        #[arg(long)]
        task: String,
        #[arg(long)]
        count: u32,
    },
    /// Hold a lock and write to a fenced resource.
    Lock {
        #[arg(long)]
        name: String,
        #[arg(long)]
        ttl_ms: u64,
        #[arg(long)]
        resource: String,
        /// The Redis of the resource, when it is not the lock's (the soak keeps it apart, so
        /// a restart of the lock's Redis does not roll the resource back too).
        #[arg(long)]
        resource_redis: Option<String>,
    },
}

/// The resource's side of fencing: apply a write only with a token ≥ the highest seen.
const FENCED_WRITE: &str = include_str!("fenced_write.lua");

fn say(line: &str) {
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() -> Result<(), String> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "sluice=info".into()),
        )
        .init();
    let args = Args::parse();
    let mut cfg = Config::new(args.redis.clone());
    cfg.namespace = args.namespace.clone();
    cfg.host_id = args.host_id.clone();
    let client = Client::new(cfg).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    match args.what {
        What::Permits { task, count } => {
            let task = client.task(&task).map_err(|e| e.to_string())?;
            let mut held = Vec::new();
            for _ in 0..count {
                let p = task
                    .permit_blocking(Duration::from_secs(10))
                    .map_err(|e| format!("permit: {e}"))?;
                held.push(p);
            }
            say(&format!("held {}", held.len()));
            // Hold until stdin closes (or the process is killed).
            for line in std::io::stdin().lock().lines() {
                if line.is_err() {
                    break;
                }
            }
            drop(held);
        }
        What::Lock {
            name,
            ttl_ms,
            resource,
            resource_redis,
        } => {
            let guard = rt
                .block_on(client.lock_timeout(
                    &name,
                    Duration::from_millis(ttl_ms),
                    Duration::from_secs(10),
                ))
                .map_err(|e| e.to_string())?;
            say(&format!("token {}", guard.token()));
            let target = sluice_protocol::conn::RedisTarget::parse(
                resource_redis.as_deref().unwrap_or(&args.redis),
            )?;
            let redis = sluice_protocol::conn::Redis::new(target, Default::default());
            let script = redis::Script::new(FENCED_WRITE);
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if line.trim() == "held" {
                    say(&format!("held {}", guard.is_held()));
                    continue;
                }
                let Some(value) = line.strip_prefix("write ") else {
                    continue;
                };
                let r: Result<(i64, i64), String> = rt.block_on(async {
                    let mut c = redis.conn().await.map_err(|e| e.to_string())?;
                    script
                        .key(&resource)
                        .arg(guard.token())
                        .arg(value)
                        .invoke_async(&mut c)
                        .await
                        .map_err(|e| e.to_string())
                });
                match r {
                    Ok((1, _)) => say("written"),
                    Ok((_, seen)) => say(&format!("refused {seen}")),
                    Err(e) => say(&format!("error {e}")),
                }
            }
            let _ = rt.block_on(guard.release());
        }
    }
    Ok(())
}
