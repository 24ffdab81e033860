//! A simulated Redis that runs Sluice's real Lua scripts.
//!
//! One [`SimRedis`] is one server: a keyspace ([`store`]), the scripts loaded into its Lua 5.1
//! ([`lua`]), a `run_id`, and the simulation's clock. [`SimConn`] is a client connection: it
//! implements the `redis` crate's [`redis::aio::ConnectionLike`], so the protocol's functions
//! (`sluice_protocol::scripts::roll`, `pull`, `key_pull_batch`, the lease scripts, …) run
//! against it unchanged — the same Rust, the same script text, the same argument encoding.
//!
//! Faults: a connection may lose a request (not applied) or its reply (applied, the client
//! sees an I/O error), or wait before either ([`Fault`], chosen per command by a
//! [`FaultPlan`]); the server may restart empty or from an older snapshot (its script cache
//! gone), fail over to a lagging replica (a snapshot; scripts kept; a new `run_id`), stop,
//! or sleep (`DEBUG SLEEP`: every command waits until it wakes).
//!
//! Time is the simulation's: [`Clock`]. Key expiry and `TIME` (in and out of scripts) read it.

pub mod lua;
pub mod reply;
pub mod store;

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::{Cmd, RedisError, RedisFuture, Value};

pub use self::lua::sha1_hex;
pub use self::reply::Reply;
pub use self::store::{Entry, Keyspace, Val};

/// The simulation's time, in Unix microseconds.
pub trait Clock: Send + Sync + 'static {
    /// Now.
    fn now_us(&self) -> i64;
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock reading `now_us`.
    pub fn new(now_us: i64) -> Arc<Self> {
        Arc::new(Self(AtomicI64::new(now_us)))
    }

    /// Sets the time.
    pub fn set(&self, now_us: i64) {
        self.0.store(now_us, Ordering::SeqCst);
    }

    /// Moves the time forward by `us`.
    pub fn advance(&self, us: i64) {
        self.0.fetch_add(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// Tokio's clock (paused in a simulation, so it moves only when every task waits) from a
/// starting Unix time: `TIME`, expiry and sleeps all read the same time.
#[derive(Debug)]
pub struct TokioClock {
    base_us: i64,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock reading `base_us` now. Call it inside the runtime.
    pub fn new(base_us: i64) -> Arc<Self> {
        Arc::new(Self {
            base_us,
            start: tokio::time::Instant::now(),
        })
    }
}

impl Clock for TokioClock {
    fn now_us(&self) -> i64 {
        self.base_us + self.start.elapsed().as_micros() as i64
    }
}

/// One command as the server ran it, shown to an [`Observer`] while the server is locked: the
/// checker of a simulation reads the reply and the keys right after the command.
#[derive(Debug)]
pub struct Event<'a> {
    /// The server's time (Unix µs).
    pub now_us: i64,
    /// Restarts and failovers so far: data of one generation is one history.
    pub generation: u64,
    /// The command (`args[0]` is its name).
    pub args: &'a [Vec<u8>],
    /// What it answered (also when the client never sees it: a lost reply).
    pub reply: &'a Reply,
    /// The keys after the command.
    pub keyspace: &'a Keyspace,
}

/// Sees every command a server runs, in order.
pub trait Observer: Send {
    /// Called after each command, under the server's lock.
    fn on_command(&mut self, event: &Event<'_>);
}

/// What happens to one command sent over a [`SimConn`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Applied and answered.
    Deliver,
    /// Lost on the way: not applied; the client sees an I/O error.
    DropRequest,
    /// Applied, but the reply is lost: the client sees an I/O error.
    LoseReply,
    /// Waits this long (simulated, through `tokio::time::sleep`), then applied and answered.
    DelayRequest(Duration),
    /// Applied at once; the reply waits this long.
    DelayReply(Duration),
    /// Never applied, never answered: the caller waits for ever (its process crashed while
    /// this command was on its way; the world drops the caller's future).
    Hang,
    /// Applied, never answered (the process crashed while the reply was on its way).
    HangAfterApply,
}

/// Chooses each command's [`Fault`] (a seeded plan in a simulation).
pub trait FaultPlan: Send {
    /// The fate of the command `args` (`args[0]` is its name).
    fn on_command(&mut self, args: &[Vec<u8>]) -> Fault;
}

impl<F: FnMut(&[Vec<u8>]) -> Fault + Send> FaultPlan for F {
    fn on_command(&mut self, args: &[Vec<u8>]) -> Fault {
        self(args)
    }
}

/// The server's data at one moment: what a restart from disk or a lagging replica comes back
/// with.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The keys.
    pub keyspace: Keyspace,
    /// The texts of the loaded scripts.
    pub scripts: Vec<String>,
}

/// Counters of a server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Commands received (a script counts once).
    pub commands: u64,
    /// Script calls (`EVAL`, `EVALSHA`).
    pub scripts: u64,
    /// Commands called from inside scripts.
    pub script_commands: u64,
    /// Restarts and failovers.
    pub restarts: u64,
}

struct Server {
    ks: Keyspace,
    engine: lua::Engine,
    run_id: String,
    run_seq: u64,
    generation: u64,
    up: bool,
    sleep_until_us: i64,
    stats: Stats,
    /// Restarts and failovers so far.
    data_generation: u64,
    observer: Option<Box<dyn Observer>>,
}

/// One simulated Redis server. Cloning it gives another handle to the same server.
#[derive(Clone)]
pub struct SimRedis {
    server: Arc<Mutex<Server>>,
    clock: Arc<dyn Clock>,
    name: Arc<str>,
}

impl fmt::Debug for SimRedis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimRedis")
            .field("name", &self.name)
            .finish()
    }
}

fn run_id(name: &str, seq: u64) -> String {
    // 40 hex characters, like Redis's, different for every start of every server.
    let text = format!("{name}/{seq}");
    lua::sha1_hex(&text)
}

impl SimRedis {
    /// A server named `name` (it seeds its `run_id`s), reading `clock`.
    pub fn new(name: &str, clock: Arc<dyn Clock>) -> Self {
        Self {
            server: Arc::new(Mutex::new(Server {
                ks: Keyspace::default(),
                engine: lua::Engine::new(),
                run_id: run_id(name, 0),
                run_seq: 0,
                generation: 0,
                up: true,
                sleep_until_us: i64::MIN,
                stats: Stats::default(),
                data_generation: 0,
                observer: None,
            })),
            clock,
            name: name.into(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Server> {
        // A panic while the lock was held is a bug of the simulation that already failed the
        // run; the data is still the data.
        self.server.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new client connection.
    pub fn conn(&self) -> SimConn {
        SimConn {
            generation: Arc::new(std::sync::atomic::AtomicU64::new(self.lock().generation)),
            redis: self.clone(),
            faults: None,
            reconnect: false,
        }
    }

    /// Shows every command from now on to `observer`.
    pub fn set_observer(&self, observer: impl Observer + 'static) {
        self.lock().observer = Some(Box::new(observer));
    }

    /// The current time of this server's clock (Unix µs).
    pub fn now_us(&self) -> i64 {
        self.clock.now_us()
    }

    /// Runs one command now, as a client with no faults would (`args[0]` is its name).
    pub fn exec(&self, args: &[Vec<u8>]) -> Reply {
        let now_us = self.clock.now_us();
        let mut s = self.lock();
        if !s.up {
            return Reply::err("SIM server is down");
        }
        s.exec(args, now_us)
    }

    /// Runs one command as if at `now_us` (the differential test replays a real server's
    /// commands at the times they ran there).
    pub fn exec_at(&self, args: &[Vec<u8>], now_us: i64) -> Reply {
        self.lock().exec(args, now_us)
    }

    /// Replaces the keys (nothing else changes: no restart, same scripts and `run_id`).
    pub fn set_keyspace(&self, ks: Keyspace) {
        self.lock().ks = ks;
    }

    /// Whether the script `sha` is loaded.
    pub fn has_script(&self, sha: &str) -> bool {
        self.lock().engine.has(sha)
    }

    /// `SCRIPT FLUSH`.
    pub fn flush_scripts(&self) {
        self.lock().engine.flush();
    }

    /// [`Self::exec`] of string arguments.
    pub fn exec_str(&self, args: &[&str]) -> Reply {
        let args: Vec<Vec<u8>> = args.iter().map(|a| a.as_bytes().to_vec()).collect();
        self.exec(&args)
    }

    /// Drops every expired key now (Redis's active expiry; nothing a client sees changes).
    pub fn purge_expired(&self) {
        let now_ms = self.clock.now_us().div_euclid(1000);
        self.lock().ks.purge_expired(now_ms);
    }

    /// The data now (a copy).
    pub fn snapshot(&self) -> Snapshot {
        let s = self.lock();
        Snapshot {
            keyspace: s.ks.clone(),
            scripts: s.engine.texts(),
        }
    }

    /// The live keys now (a copy).
    pub fn keyspace(&self) -> Keyspace {
        self.lock().ks.clone()
    }

    /// Reads the live keys now without copying them (and without running a command: no
    /// observer sees it, nothing in the trace changes).
    pub fn read<T>(&self, f: impl FnOnce(&Keyspace, i64) -> T) -> T {
        let now_ms = self.clock.now_us().div_euclid(1000);
        f(&self.lock().ks, now_ms)
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.lock().stats
    }

    /// The current `run_id` (`INFO server`).
    pub fn run_id(&self) -> String {
        self.lock().run_id.clone()
    }

    /// Restarts the server: with `from`, as if from an RDB/AOF file holding that snapshot's
    /// keys, else empty. The script cache is lost either way, every open connection breaks,
    /// and the `run_id` changes.
    pub fn restart(&self, from: Option<&Snapshot>) {
        let mut s = self.lock();
        s.ks = from.map(|f| f.keyspace.clone()).unwrap_or_default();
        s.engine.flush();
        s.new_run(&self.name);
    }

    /// Fails over to a replica that holds `replica` (a snapshot taken earlier: the replica's
    /// lag). Scripts loaded through `SCRIPT LOAD` reached the replica; open connections break
    /// and the `run_id` changes.
    pub fn failover(&self, replica: &Snapshot) {
        let mut s = self.lock();
        s.ks = replica.keyspace.clone();
        s.engine.flush();
        for text in &replica.scripts {
            let _ = s.engine.load(text);
        }
        s.new_run(&self.name);
    }

    /// Stops the server: every command fails with an I/O error until [`Self::start`].
    pub fn stop(&self) {
        let mut s = self.lock();
        s.up = false;
        s.generation += 1;
    }

    /// Starts a stopped server with its data (a restart is [`Self::restart`]).
    pub fn start(&self) {
        self.lock().up = true;
    }

    /// `DEBUG SLEEP`: the server answers nothing until `us` microseconds from now.
    pub fn sleep_for(&self, us: i64) {
        let until = self.clock.now_us() + us;
        let mut s = self.lock();
        s.sleep_until_us = s.sleep_until_us.max(until);
    }
}

impl Server {
    fn new_run(&mut self, name: &str) {
        self.data_generation += 1;
        self.run_seq += 1;
        self.run_id = run_id(name, self.run_seq);
        self.generation += 1;
        self.stats.restarts += 1;
        self.up = true;
    }

    fn exec(&mut self, args: &[Vec<u8>], now_us: i64) -> Reply {
        let reply = self.exec_inner(args, now_us);
        if let Some(obs) = &mut self.observer {
            obs.on_command(&Event {
                now_us,
                generation: self.data_generation,
                args,
                reply: &reply,
                keyspace: &self.ks,
            });
        }
        reply
    }

    fn exec_inner(&mut self, args: &[Vec<u8>], now_us: i64) -> Reply {
        self.stats.commands += 1;
        let Some(first) = args.first() else {
            return Reply::err("ERR empty command");
        };
        let name = String::from_utf8_lossy(first).to_ascii_uppercase();
        let now_ms = now_us.div_euclid(1000);
        match name.as_str() {
            "PING" => match args.len() {
                1 => Reply::Status("PONG".into()),
                2 => Reply::Bulk(args[1].clone()),
                _ => Reply::err("ERR wrong number of arguments for 'ping' command"),
            },
            "TIME" => lua::time_reply(now_us),
            "INFO" => Reply::Bulk(
                format!(
                    "# Server\r\nredis_version:7.0.0-sim\r\nredis_mode:standalone\r\nrun_id:{}\r\n",
                    self.run_id
                )
                .into_bytes(),
            ),
            "SCRIPT" => self.script_cmd(args),
            "EVAL" | "EVALSHA" => self.eval(&name, args, now_us),
            "SELECT" if args.len() == 2 && args[1] == b"0" => Reply::ok(),
            "CLIENT" | "HELLO" | "READONLY" => Reply::ok(),
            _ => self.ks.exec(args, now_ms).unwrap_or_else(|| {
                Reply::err(format!(
                    "ERR unknown command '{}', with args beginning with: ",
                    String::from_utf8_lossy(first)
                ))
            }),
        }
    }

    fn script_cmd(&mut self, args: &[Vec<u8>]) -> Reply {
        let sub = args
            .get(1)
            .map(|s| String::from_utf8_lossy(s).to_ascii_uppercase());
        match (sub.as_deref(), args.len()) {
            (Some("LOAD"), 3) => match std::str::from_utf8(&args[2]) {
                Ok(text) => match self.engine.load(text) {
                    Ok(sha) => Reply::text(sha),
                    Err(e) => e,
                },
                Err(_) => Reply::err("ERR script is not valid UTF-8 (the simulation needs text)"),
            },
            (Some("EXISTS"), n) if n >= 3 => Reply::Array(
                args[2..]
                    .iter()
                    .map(|sha| {
                        Reply::Int(i64::from(self.engine.has(&String::from_utf8_lossy(sha))))
                    })
                    .collect(),
            ),
            (Some("FLUSH"), _) => {
                self.engine.flush();
                Reply::ok()
            }
            _ => Reply::err("ERR unknown subcommand or wrong number of arguments for 'script'"),
        }
    }

    fn eval(&mut self, name: &str, args: &[Vec<u8>], now_us: i64) -> Reply {
        if args.len() < 3 {
            return Reply::err(format!(
                "ERR wrong number of arguments for '{}' command",
                name.to_ascii_lowercase()
            ));
        }
        let numkeys = match std::str::from_utf8(&args[2])
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
        {
            Some(n) if n < 0 => return Reply::err("ERR Number of keys can't be negative"),
            Some(n) if n as usize > args.len() - 3 => {
                return Reply::err("ERR Number of keys can't be greater than number of args");
            }
            Some(n) => n as usize,
            None => return Reply::not_integer(),
        };
        let sha = if name == "EVAL" {
            match std::str::from_utf8(&args[1]) {
                Ok(text) => match self.engine.load(text) {
                    Ok(sha) => sha,
                    Err(e) => return e,
                },
                Err(_) => {
                    return Reply::err("ERR script is not valid UTF-8 (the simulation needs text)");
                }
            }
        } else {
            String::from_utf8_lossy(&args[1]).into_owned()
        };
        let keys = &args[3..3 + numkeys];
        let argv = &args[3 + numkeys..];
        self.stats.scripts += 1;
        let (reply, calls) = self.engine.run(&sha, &mut self.ks, now_us, keys, argv);
        self.stats.script_commands += calls;
        reply
    }
}

/// A client connection to a [`SimRedis`]: a [`redis::aio::ConnectionLike`].
///
/// A connection opened before a restart, failover or stop is broken for good (every command
/// fails with an I/O error), as a TCP connection to the old process would be — unless it was
/// made [`SimConn::reconnecting`]: then, as the `redis` crate's `ConnectionManager`, the
/// command that finds it broken fails and the next one goes to the server as it is now.
/// Clones share the connection (its state and its faults).
#[derive(Clone)]
pub struct SimConn {
    redis: SimRedis,
    generation: Arc<std::sync::atomic::AtomicU64>,
    faults: Option<Arc<Mutex<Box<dyn FaultPlan>>>>,
    reconnect: bool,
}

impl fmt::Debug for SimConn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimConn")
            .field("redis", &self.redis)
            .field("generation", &self.generation)
            .field("reconnect", &self.reconnect)
            .finish()
    }
}

fn io_error(what: &str) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        format!("sim: {what}"),
    ))
}

fn args_of(cmd: &Cmd) -> Vec<Vec<u8>> {
    cmd.args_iter()
        .map(|a| match a {
            redis::Arg::Simple(b) => b.to_vec(),
            // A cursor argument (SCAN's iterators): the simulation answers every scan in one page.
            _ => b"0".to_vec(),
        })
        .collect()
}

impl SimConn {
    /// This connection with `plan` choosing each command's fault.
    pub fn with_faults(mut self, plan: impl FaultPlan + 'static) -> Self {
        self.faults = Some(Arc::new(Mutex::new(Box::new(plan))));
        self
    }

    /// This connection, coming back by itself after the server broke it (see the type's docs).
    pub fn reconnecting(mut self) -> Self {
        self.reconnect = true;
        self
    }

    /// Runs one command through the connection's faults.
    async fn run(&mut self, args: Vec<Vec<u8>>) -> Result<Reply, RedisError> {
        let fault = match &self.faults {
            Some(plan) => plan
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .on_command(&args),
            None => Fault::Deliver,
        };
        if let Fault::DelayRequest(d) = fault {
            tokio::time::sleep(d).await;
        }
        if fault == Fault::Hang {
            std::future::pending::<()>().await;
        }
        // DEBUG SLEEP: wait (in simulated time) until the server is awake.
        loop {
            let until = self.redis.lock().sleep_until_us;
            let now = self.redis.now_us();
            if now >= until {
                break;
            }
            tokio::time::sleep(Duration::from_micros((until - now) as u64)).await;
        }
        let reply = {
            let now_us = self.redis.now_us();
            let mut s = self.redis.lock();
            let mine = self.generation.load(std::sync::atomic::Ordering::SeqCst);
            if !s.up || s.generation != mine {
                if self.reconnect && s.up {
                    self.generation
                        .store(s.generation, std::sync::atomic::Ordering::SeqCst);
                }
                return Err(io_error(
                    "connection broken (the server restarted or stopped)",
                ));
            }
            if fault == Fault::DropRequest {
                return Err(io_error("request lost"));
            }
            s.exec(&args, now_us)
        };
        match fault {
            Fault::LoseReply => Err(io_error("reply lost")),
            Fault::HangAfterApply => {
                std::future::pending::<()>().await;
                Err(io_error("never answered"))
            }
            Fault::DelayReply(d) => {
                tokio::time::sleep(d).await;
                Ok(reply)
            }
            _ => Ok(reply),
        }
    }
}

impl sluice_protocol::conn::SharedConn for SimConn {
    fn clone_conn(&self) -> Box<dyn sluice_protocol::conn::SharedConn> {
        Box::new(self.clone())
    }
}

impl redis::aio::ConnectionLike for SimConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move { Ok(self.run(args_of(cmd)).await?.to_value()) })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut replies = Vec::new();
            if pipeline.is_transaction() {
                replies.push(Reply::ok());
                let mut queued = Vec::new();
                for cmd in pipeline.cmd_iter() {
                    replies.push(Reply::Status("QUEUED".into()));
                    queued.push(self.run(args_of(cmd)).await?);
                }
                replies.push(Reply::Array(queued));
            } else {
                for cmd in pipeline.cmd_iter() {
                    replies.push(self.run(args_of(cmd)).await?);
                }
            }
            Ok(replies
                .iter()
                .skip(offset)
                .take(count)
                .map(Reply::to_value)
                .collect())
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> (SimRedis, Arc<ManualClock>) {
        let clock = ManualClock::new(1_700_000_000_000_000);
        (SimRedis::new("t", clock.clone()), clock)
    }

    #[tokio::test]
    async fn the_crate_talks_to_it_as_to_redis() {
        let (r, clock) = server();
        let mut c = r.conn();
        let () = redis::cmd("SET")
            .arg("k")
            .arg("v")
            .arg("PX")
            .arg(1000)
            .query_async(&mut c)
            .await
            .unwrap();
        let v: Option<String> = redis::cmd("GET")
            .arg("k")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(v.as_deref(), Some("v"));
        clock.advance(1_001_000);
        let v: Option<String> = redis::cmd("GET")
            .arg("k")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(v, None);
        let e = redis::cmd("EVALSHA")
            .arg("0000000000000000000000000000000000000000")
            .arg(0)
            .query_async::<Value>(&mut c)
            .await
            .unwrap_err();
        assert_eq!(
            e.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
        let script = redis::Script::new("return redis.call('INCR', KEYS[1]) + tonumber(ARGV[1])");
        let n: i64 = script.key("n").arg(10).invoke_async(&mut c).await.unwrap();
        assert_eq!(n, 11);
        let (a, b): (i64, i64) = redis::pipe()
            .cmd("INCR")
            .arg("n")
            .cmd("INCR")
            .arg("n")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!((a, b), (2, 3));
    }

    #[tokio::test]
    async fn a_restart_breaks_connections_and_forgets_scripts() {
        let (r, _) = server();
        let mut c = r.conn();
        let script = redis::Script::new("return 7");
        let n: i64 = script.invoke_async(&mut c).await.unwrap();
        assert_eq!(n, 7);
        let before = r.run_id();
        r.restart(None);
        assert_ne!(r.run_id(), before);
        assert!(
            redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .unwrap_err()
                .is_io_error()
        );
        let mut c = r.conn();
        let e = redis::cmd("EVALSHA")
            .arg(script.get_hash())
            .arg(0)
            .query_async::<Value>(&mut c)
            .await
            .unwrap_err();
        assert_eq!(
            e.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
    }

    #[tokio::test]
    async fn a_lost_reply_was_applied_and_a_dropped_request_was_not() {
        let (r, _) = server();
        let mut n = 0;
        let mut c = r.conn().with_faults(move |_: &[Vec<u8>]| {
            n += 1;
            match n {
                1 => Fault::LoseReply,
                2 => Fault::DropRequest,
                _ => Fault::Deliver,
            }
        });
        assert!(
            redis::cmd("INCR")
                .arg("x")
                .query_async::<i64>(&mut c)
                .await
                .is_err()
        );
        assert!(
            redis::cmd("INCR")
                .arg("x")
                .query_async::<i64>(&mut c)
                .await
                .is_err()
        );
        let x: i64 = redis::cmd("INCR")
            .arg("x")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(x, 2);
    }
}
