//! The simulated Redis held to a real one (`SLUICE_TEST_REDIS`, required).
//!
//! A seeded random sequence of the protocol's own calls (`sluice_protocol::scripts::*`, the lease
//! and lock functions, and raw commands that corrupt or delete what they read) runs against the
//! real server through a recording connection. Every command is sent on its own (a pipeline's
//! commands one by one) and, after each, the real server's keys of this run are read back.
//! The simulation then runs the same command at a time the real one may have run it (between
//! two `TIME` readings around it) and must answer the same reply and hold the same keys,
//! values and expiry times — nothing is compared loosely except the text after an error's code.
//!
//! Seed: `SLUICE_SIM_SEED` (else random, printed); steps: `SLUICE_SIM_STEPS` (default 400).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, RedisFuture, Value};
use sluice_protocol::lease;
use sluice_protocol::scripts::{
    self, Fence, KeyPullBatch, KeyWant, LazyWindow, PullRequest, RingWrites, RollRequest,
    SliceCounters, SliceWrite,
};
use sluice_protocol::{Fallback, Keys, Mode, OnFailure, Pacing, TaskMeta};
use sluice_sim::redis::{Entry, Keyspace, ManualClock, SimRedis, Val, sha1_hex};
use sluice_sim::rng::Rng;

/// One key as both servers are compared: type, content (sorted where Redis does not order),
/// absolute expiry.
type Dump = BTreeMap<Vec<u8>, (String, Vec<Vec<u8>>, Option<i64>)>;

fn redis_url() -> String {
    std::env::var("SLUICE_TEST_REDIS")
        .expect("SLUICE_TEST_REDIS must name a Redis to compare the simulation with (scripts/test.sh starts one)")
}

async fn time_us(c: &mut MultiplexedConnection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(c).await.expect("TIME");
    s * 1_000_000 + us
}

/// Every key of the run on the real server.
async fn real_dump(c: &mut MultiplexedConnection, prefix: &str) -> Dump {
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await
            .expect("SCAN");
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    keys.sort();
    keys.dedup();
    let mut out = Dump::new();
    for k in keys {
        let (ty, at): (String, i64) = redis::pipe()
            .cmd("TYPE")
            .arg(&k)
            .cmd("PEXPIRETIME")
            .arg(&k)
            .query_async(c)
            .await
            .expect("TYPE");
        let content: Vec<Vec<u8>> = match ty.as_str() {
            "none" => continue,
            "string" => vec![redis::cmd("GET").arg(&k).query_async(c).await.expect("GET")],
            "hash" => {
                let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
                    .arg(&k)
                    .query_async(c)
                    .await
                    .expect("HGETALL");
                pairs.sort();
                pairs.into_iter().flat_map(|(f, v)| [f, v]).collect()
            }
            "list" => redis::cmd("LRANGE")
                .arg(&k)
                .arg(0)
                .arg(-1)
                .query_async(c)
                .await
                .expect("LRANGE"),
            "set" => {
                let mut m: Vec<Vec<u8>> = redis::cmd("SMEMBERS")
                    .arg(&k)
                    .query_async(c)
                    .await
                    .expect("SMEMBERS");
                m.sort();
                m
            }
            "zset" => redis::cmd("ZRANGE")
                .arg(&k)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query_async(c)
                .await
                .expect("ZRANGE"),
            other => panic!("a key of type {other} in the run's namespace"),
        };
        out.insert(k, (ty, content, (at >= 0).then_some(at)));
    }
    out
}

fn sim_dump(ks: &Keyspace, now_ms: i64, prefix: &str) -> Dump {
    let mut out = Dump::new();
    for (k, e) in ks.iter(now_ms) {
        if !k.starts_with(prefix.as_bytes()) {
            continue;
        }
        let (ty, content) = match &e.val {
            Val::Str(s) => ("string", vec![s.clone()]),
            Val::Hash(h) => {
                let mut pairs: Vec<_> = h.iter().map(|(f, v)| (f.clone(), v.clone())).collect();
                pairs.sort();
                (
                    "hash",
                    pairs.into_iter().flat_map(|(f, v)| [f, v]).collect(),
                )
            }
            Val::List(l) => ("list", l.iter().cloned().collect()),
            Val::Set(s) => {
                let mut m: Vec<_> = s.iter().cloned().collect();
                m.sort();
                ("set", m)
            }
            Val::ZSet(z) => (
                "zset",
                z.iter()
                    .flat_map(|(s, m)| {
                        [
                            m.clone(),
                            sluice_sim::redis::reply::fmt_g17(*s).into_bytes(),
                        ]
                    })
                    .collect(),
            ),
        };
        out.insert(k.clone(), (ty.to_string(), content, e.expire_at_ms));
    }
    out
}

/// Whether both servers hold the same keys, values and expiry times (within `tol_ms`). A key
/// that either side has expiring by `t_ms` (the end of the real read-back) plus the tolerance
/// is left out: the real server may or may not have removed it yet.
fn same_keys(want: &Dump, got: &Dump, t_ms: i64, tol_ms: i64) -> bool {
    let near = |d: &Dump, k: &Vec<u8>| {
        d.get(k)
            .and_then(|(_, _, at)| *at)
            .is_some_and(|at| at <= t_ms + tol_ms + 1)
    };
    want.keys().chain(got.keys()).all(|k| {
        if near(want, k) || near(got, k) {
            return true;
        }
        match (want.get(k), got.get(k)) {
            (Some((ta, ca, ea)), Some((tb, cb, eb))) => {
                ta == tb
                    && ca == cb
                    && match (ea, eb) {
                        (None, None) => true,
                        (Some(a), Some(b)) => (a - b).abs() <= tol_ms,
                        _ => false,
                    }
            }
            _ => false,
        }
    })
}

/// The simulation's keys rebuilt from a dump of the real server's.
fn keyspace_of(dump: &Dump) -> Keyspace {
    let mut ks = Keyspace::default();
    for (k, (ty, content, at)) in dump {
        let val = match ty.as_str() {
            "string" => Val::Str(content[0].clone()),
            "hash" => Val::Hash(
                content
                    .chunks(2)
                    .map(|p| (p[0].clone(), p[1].clone()))
                    .collect(),
            ),
            "list" => Val::List(content.iter().cloned().collect()),
            "set" => Val::Set(content.iter().cloned().collect()),
            _ => Val::ZSet(
                content
                    .chunks(2)
                    .map(|p| {
                        (
                            String::from_utf8_lossy(&p[1]).parse().expect("a score"),
                            p[0].clone(),
                        )
                    })
                    .collect(),
            ),
        };
        ks.insert(
            k.clone(),
            Entry {
                val,
                expire_at_ms: *at,
            },
        );
    }
    ks
}

/// A reply as compared: an error by its code only (the rest of a script error's text names
/// lines and SHA1s the simulation words differently).
fn canon(v: &Value) -> String {
    match v {
        Value::ServerError(e) => format!("error:{}", e.code()),
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(canon).collect::<Vec<_>>().join(",")
        ),
        Value::BulkString(b) => format!("bulk:{}", String::from_utf8_lossy(b)),
        other => format!("{other:?}"),
    }
}

/// Integers in a reply that could be the script's `TIME` in µs (the window's bounds).
fn times_in(v: &Value, t0: i64, t1: i64, out: &mut Vec<i64>) {
    match v {
        Value::Int(n) if (t0..=t1).contains(n) => out.push(*n),
        Value::BulkString(b) => {
            if let Some(n) = std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                && (t0..=t1).contains(&n)
            {
                out.push(n);
            }
        }
        Value::Array(items) => items.iter().for_each(|i| times_in(i, t0, t1, out)),
        _ => {}
    }
    // A reply of (…, seconds, microseconds): the pair as one time.
    if let Value::Array(items) = v {
        for w in items.windows(2) {
            if let (Value::Int(s), Value::Int(us)) = (&w[0], &w[1])
                && (0..1_000_000).contains(us)
            {
                let t = s.saturating_mul(1_000_000).saturating_add(*us);
                if (t0..=t1).contains(&t) {
                    out.push(t);
                }
            }
        }
    }
}

fn show(args: &[Vec<u8>]) -> String {
    args.iter()
        .map(|a| {
            let s = String::from_utf8_lossy(a);
            if s.len() > 60 {
                format!("{}…({} bytes)", &s[..40], s.len())
            } else {
                s.into_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

struct Shared {
    sim: SimRedis,
    prefix: String,
    scripts: HashMap<String, String>,
    commands: u64,
    /// Replies seen, by command (a script by its file) and reply shape: what was covered.
    seen: BTreeMap<String, u64>,
    failures: Vec<String>,
    step: usize,
}

/// Sends each command to the real server, reads its keys back, and replays the command on the
/// simulation.
struct Recorder {
    real: MultiplexedConnection,
    probe: MultiplexedConnection,
    shared: Arc<Mutex<Shared>>,
}

impl Recorder {
    async fn one(&mut self, cmd: &Cmd) -> redis::RedisResult<Value> {
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => b"0".to_vec(),
            })
            .collect();
        let t0 = time_us(&mut self.probe).await;
        let real = self.real.req_packed_command(cmd).await?;
        let t1 = time_us(&mut self.probe).await;
        let prefix = self.shared.lock().unwrap().prefix.clone();
        let dump = real_dump(&mut self.probe, &prefix).await;
        let t2 = time_us(&mut self.probe).await;
        self.replay(&args, &real, t0, t1, &dump, t2);
        Ok(real)
    }

    fn replay(&self, args: &[Vec<u8>], real: &Value, t0: i64, t1: i64, dump: &Dump, t2: i64) {
        let mut sh = self.shared.lock().unwrap();
        sh.commands += 1;
        let name = String::from_utf8_lossy(&args[0]).to_ascii_uppercase();
        // The scripts' cache: the real server may hold scripts from before this run (or lose
        // them to another test's SCRIPT FLUSH); the simulation follows it.
        if name == "EVALSHA" {
            let sha = String::from_utf8_lossy(&args[1]).to_ascii_lowercase();
            let real_noscript = matches!(real, Value::ServerError(e) if e.code() == "NOSCRIPT");
            if real_noscript {
                sh.sim.flush_scripts();
            } else if !sh.sim.has_script(&sha) {
                match sh.scripts.get(&sha).cloned() {
                    Some(text) => {
                        sh.sim
                            .exec(&[b"SCRIPT".to_vec(), b"LOAD".to_vec(), text.into_bytes()]);
                    }
                    None => panic!("EVALSHA of a script this test does not know: {sha}"),
                }
            }
        }
        let label = if name == "EVALSHA" || name == "EVAL" {
            let sha = String::from_utf8_lossy(&args[1]).to_ascii_lowercase();
            sh.scripts
                .get(&sha)
                .map_or("script?".to_string(), |t| script_name(t))
        } else {
            name.clone()
        };
        let shape: String = match real {
            Value::ServerError(e) => format!("error {}", e.details().unwrap_or_default())
                .chars()
                .take(70)
                .collect(),
            _ => canon(real).chars().take(24).collect(),
        };
        *sh.seen.entry(format!("{label} → {shape}")).or_default() += 1;
        let mut cands = Vec::new();
        times_in(real, t0, t1, &mut cands);
        for ms in t0.div_euclid(1000)..=t1.div_euclid(1000) {
            cands.push((ms * 1000).max(t0));
        }
        let base = sh.sim.keyspace();
        let want_reply = canon(real);
        let t2_ms = t2.div_euclid(1000);
        // Redis's clock runs while a script runs (a PEXPIRE late in a script counts from a later
        // millisecond than its TIME at the start), the simulation's does not: expiry times may
        // differ by the time the command took.
        let tol_ms = (t1 - t0) / 1000 + 1;
        let mut tried = Vec::new();
        for &t in &cands {
            sh.sim.set_keyspace(base.clone());
            let r = sh.sim.exec_at(args, t);
            let got_reply = canon(&r.to_value());
            let got_keys = sim_dump(&sh.sim.keyspace(), t2_ms, &sh.prefix);
            if got_reply == want_reply && same_keys(dump, &got_keys, t2_ms, tol_ms) {
                // The real server's expiry times from here on (they may differ by `tol_ms`),
                // so the two never drift apart.
                let mut ks = sh.sim.keyspace();
                for (k, (_, _, at)) in dump {
                    ks.set_expire_at(k, *at);
                }
                sh.sim.set_keyspace(ks);
                return;
            }
            tried.push((t, got_reply, got_keys));
        }
        // No time in the window explains what the real server did.
        let (t, got_reply, got_keys) = tried.into_iter().next().expect("a candidate");
        let mut diff = Vec::new();
        for k in dump.keys().chain(got_keys.keys()) {
            let (a, b) = (dump.get(k), got_keys.get(k));
            if a != b
                && !diff
                    .iter()
                    .any(|d: &String| d.starts_with(&*String::from_utf8_lossy(k)))
            {
                diff.push(format!(
                    "{}: real {:?} · sim {:?}",
                    String::from_utf8_lossy(k),
                    a.map(|x| (
                        &x.0,
                        x.1.iter()
                            .map(|b| String::from_utf8_lossy(b).into_owned())
                            .collect::<Vec<_>>(),
                        x.2
                    )),
                    b.map(|x| (
                        &x.0,
                        x.1.iter()
                            .map(|b| String::from_utf8_lossy(b).into_owned())
                            .collect::<Vec<_>>(),
                        x.2
                    ))
                ));
            }
        }
        let step = sh.step;
        sh.failures.push(format!(
            "step {step}: `{}` (window {t0}..{t1} µs, sim at {t})\n  real reply: {want_reply}\n  sim reply:  {got_reply}\n  keys that differ: {}",
            show(args),
            if diff.is_empty() { "none".into() } else { diff.join("\n    ") }
        ));
        // Go on from the real server's state, so one difference is reported once.
        sh.sim.set_keyspace(keyspace_of(dump));
    }
}

impl ConnectionLike for Recorder {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.one(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            assert!(!pipeline.is_transaction(), "the protocol sends no MULTI");
            let mut out = Vec::new();
            for cmd in pipeline.cmd_iter() {
                out.push(self.one(cmd).await?);
            }
            Ok(out.into_iter().skip(offset).take(count).collect())
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// A script's name for the coverage summary: the first distinctive line of its text.
fn script_name(text: &str) -> String {
    let names = [
        (scripts::ROLL_LUA, "roll"),
        (scripts::RETIRE_LUA, "retire"),
        (scripts::PULL_LUA, "pull"),
        (scripts::KPULL_LUA, "kpull"),
        (scripts::FLUSH_LUA, "flush"),
        (scripts::ADJUST_LUA, "adjust"),
        (scripts::TAKE_LUA, "take"),
        (scripts::SLIDE_LUA, "slide"),
        (scripts::READ_SLICES_LUA, "read_slices"),
        (scripts::RECORD_HISTORY_LUA, "record_history"),
        (scripts::PRUNE_HOSTS_LUA, "prune_hosts"),
        (lease::LEASE_LUA, "lease"),
        (lease::LOCK_ACQUIRE_LUA, "lock_acquire"),
        (lease::LOCK_RENEW_LUA, "lock_renew"),
        (lease::LOCK_RELEASE_LUA, "lock_release"),
    ];
    names
        .iter()
        .find(|(t, _)| *t == text)
        .map_or("script?", |(_, n)| n)
        .to_string()
}

fn known_scripts() -> HashMap<String, String> {
    [
        scripts::ROLL_LUA,
        scripts::RETIRE_LUA,
        scripts::PULL_LUA,
        scripts::KPULL_LUA,
        scripts::FLUSH_LUA,
        scripts::ADJUST_LUA,
        scripts::TAKE_LUA,
        scripts::SLIDE_LUA,
        scripts::READ_SLICES_LUA,
        scripts::RECORD_HISTORY_LUA,
        scripts::PRUNE_HOSTS_LUA,
        lease::LEASE_LUA,
        lease::LOCK_ACQUIRE_LUA,
        lease::LOCK_RENEW_LUA,
        lease::LOCK_RELEASE_LUA,
    ]
    .iter()
    .map(|t| (sha1_hex(t), t.to_string()))
    .collect()
}

/// The database the comparison runs in.
const DB: i64 = 9;

const TASKS: &[&str] = &["a", "b", "c"];
const HOSTS: &[&str] = &["h1", "h2"];
const SLICES: &[u64] = &[100, 250, 1000];

/// What the test's "leader" believes of a task: most steps act as a coherent leader and
/// workers would, so the scripts' deep paths (grants, key grants, leases, lazy slices) are
/// reached; some act as a deposed leader, another epoch, or a confused worker.
struct TaskState {
    name: &'static str,
    slice_ms: u64,
    meta: TaskMeta,
    rolled_to: i64,
}

struct World {
    tasks: Vec<TaskState>,
    term: i64,
    epoch: u64,
    stale_after_ms: u64,
}

impl World {
    fn new(rng: &mut Rng) -> Self {
        let tasks = TASKS
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let slice_ms = *rng.pick(SLICES);
                let mut meta = meta(rng, slice_ms, 1);
                if i == 2 && rng.chance(0.7) {
                    meta.mode = Mode::Concurrency;
                    meta.lease_ms = rng.range_i(200, 2000) as u64;
                    meta.keyed = false;
                    meta.key_overrides.clear();
                }
                if i == 0 {
                    meta.mode = Mode::Pooled;
                    meta.keyed = true;
                    meta.pacing = Pacing::None;
                }
                TaskState {
                    name,
                    slice_ms,
                    meta,
                    rolled_to: 0,
                }
            })
            .collect();
        Self {
            tasks,
            term: 1,
            epoch: 1,
            stale_after_ms: rng.range_i(300, 3000) as u64,
        }
    }
}

fn meta(rng: &mut Rng, slice_ms: u64, version: i64) -> TaskMeta {
    let mode = *rng.pick(&[
        Mode::Pooled,
        Mode::Pooled,
        Mode::ExactFixed,
        Mode::ExactSliding,
        Mode::Concurrency,
    ]);
    let keyed = mode == Mode::Pooled && rng.chance(0.4);
    let mut key_overrides = BTreeMap::new();
    if keyed && rng.chance(0.5) {
        key_overrides.insert(format!("d{}", rng.below(4)), rng.below(6));
    }
    TaskMeta {
        slice_ms,
        threshold: rng.below(30),
        pull: rng.below(5),
        local_limit: rng.below(10),
        on_failure: OnFailure::Local,
        mode,
        fallback: Fallback::default(),
        version,
        lease_ms: if mode == Mode::Concurrency {
            rng.range_i(100, 2000) as u64
        } else {
            0
        },
        keyed,
        key_overrides,
        shadow: rng.chance(0.1),
        pacing: if mode == Mode::Pooled && !keyed && rng.chance(0.3) {
            Pacing::Smooth
        } else {
            Pacing::None
        },
        pace_burst: rng.below(3),
    }
}

fn counters(rng: &mut Rng) -> SliceCounters {
    SliceCounters {
        admitted: rng.below(5),
        rejected: rng.below(3),
        ok: rng.below(3),
        err: rng.below(2),
        lat_sum_us: rng.below(1000),
        lat_n: rng.below(3),
        would_reject: rng.below(2),
    }
}

/// One random step; errors of the protocol functions are fine (the comparison is per command).
async fn step(rng: &mut Rng, c: &mut Recorder, keys: &Keys, now_ms: i64, w: &mut World) {
    // The world changes now and then: a new spec version, a new leader, another epoch.
    if rng.chance(0.03) {
        w.term += 1;
    }
    if rng.chance(0.005) {
        w.epoch += 1;
    }
    let op = rng.below(20);
    // Key pulls mostly at a keyed task, leases at a concurrency task (when there is one).
    let wanted = match op {
        11 | 12 => w.tasks.iter().position(|t| t.meta.keyed),
        17 => w
            .tasks
            .iter()
            .position(|t| t.meta.mode == Mode::Concurrency),
        _ => None,
    };
    let ti = match wanted {
        Some(i) if rng.chance(0.8) => i,
        _ => rng.below(w.tasks.len() as u64) as usize,
    };
    if rng.chance(0.02) {
        let t = &mut w.tasks[ti];
        let keep_mode = t.meta.mode;
        let keyed = t.meta.keyed;
        let v = t.meta.version + 1;
        t.meta = meta(rng, t.slice_ms, v);
        if rng.chance(0.8) {
            t.meta.mode = keep_mode;
            t.meta.keyed = keyed && keep_mode == Mode::Pooled;
            if t.meta.mode == Mode::Concurrency && t.meta.lease_ms == 0 {
                t.meta.lease_ms = 500;
            }
        }
    }
    let leader = Fence {
        term: w.term,
        epoch: w.epoch,
        stale_after_ms: w.stale_after_ms,
    };
    let fence = if rng.chance(0.85) {
        leader.clone()
    } else {
        Fence {
            term: rng.range_i(1, w.term + 1),
            epoch: rng.range_i(1, w.epoch as i64 + 1) as u64,
            stale_after_ms: rng.range_i(200, 3000) as u64,
        }
    };
    let t = &mut w.tasks[ti];
    let task = t.name;
    let slice_ms = if rng.chance(0.95) {
        t.slice_ms
    } else {
        *rng.pick(SLICES)
    };
    let base = now_ms - now_ms.rem_euclid(slice_ms as i64);
    let start = base + *rng.pick(&[-1i64, 0, 0, 0, 1, 2]) * slice_ms as i64;
    let host = *rng.pick(HOSTS);
    let rid = format!("r{}", rng.below(6));
    let version = t.meta.version;
    match op {
        0..=4 => {
            let full = rng.chance(0.3) || t.rolled_to < base;
            let first = if full { base } else { t.rolled_to.max(base) };
            let n = rng.range_i(if full { 1 } else { 0 }, 4);
            let cap = if rng.chance(0.8) {
                t.meta.threshold
            } else {
                rng.below(25)
            };
            let slices: Vec<SliceWrite> = (0..n)
                .map(|i| {
                    let s = first + i * slice_ms as i64;
                    SliceWrite {
                        start_ms: s,
                        cap,
                        expire_at_ms: s + slice_ms as i64 + rng.range_i(200, 3000),
                    }
                })
                .collect();
            let new_rolled_to = slices
                .last()
                .map_or(first, |s| s.start_ms + slice_ms as i64);
            let lazy = rng.chance(0.2).then(|| LazyWindow {
                cap,
                from_ms: base,
                until_ms: base + rng.range_i(1, 6) * slice_ms as i64,
                expire_after_ms: rng.range_i(100, 3000) as u64,
                fence_ttl_ms: *rng.pick(&[0u64, 500, 5000]),
            });
            let extra: Vec<(&'static str, String)> = Vec::new();
            let req = RollRequest {
                task,
                fence: &fence,
                full,
                expect_rolled_to: if rng.chance(0.9) {
                    t.rolled_to
                } else {
                    rng.range_i(0, 5)
                },
                spec_version: if rng.chance(0.9) {
                    version
                } else {
                    rng.range_i(1, version + 1)
                },
                new_rolled_to,
                force: rng.chance(0.05),
                refresh: rng.chance(0.3),
                meta: (full || rng.chance(0.3)).then_some(&t.meta),
                meta_extra: &extra,
                slices: if lazy.is_some() && rng.chance(0.7) {
                    &[]
                } else {
                    &slices
                },
                lazy: lazy.as_ref(),
            };
            let r = if rng.chance(0.3) {
                let made: Vec<i64> = (0..rng.below(3))
                    .map(|i| base + i as i64 * slice_ms as i64)
                    .collect();
                scripts::roll_watching(c, keys, &req, &made)
                    .await
                    .map(|(o, _)| o)
            } else {
                scripts::roll(c, keys, &req).await
            };
            if matches!(r, Ok(scripts::RollOutcome::Written(_))) {
                t.rolled_to = new_rolled_to;
            }
        }
        5 => {
            let made = [start];
            let _ = scripts::roll_probe(
                c,
                keys,
                task,
                &fence,
                t.rolled_to,
                version,
                rng.chance(0.5).then_some(start),
                &made,
            )
            .await;
        }
        6 => {
            if rng.chance(0.3) {
                let _ = scripts::retire(
                    c,
                    keys,
                    task,
                    &fence,
                    rng.range_i(100, 5000) as u64,
                    version + rng.range_i(-1, 1),
                    rng.chance(0.2),
                )
                .await;
                t.rolled_to = 0;
            }
        }
        7..=9 => {
            let cs = counters(rng);
            let req = PullRequest {
                task,
                start_ms: start,
                slice_ms,
                want: rng.below(8),
                host_id: host,
                request_id: &rid,
                counters: rng.chance(0.3).then_some(&cs),
            };
            let _ = scripts::pull(c, keys, &req).await;
        }
        10 => {
            let batch: Vec<(i64, SliceCounters)> = (0..rng.range_i(1, 3))
                .map(|i| (start - i * slice_ms as i64, counters(rng)))
                .collect();
            let _ = scripts::flush(c, keys, task, host, rng.below(4), &batch).await;
        }
        11 | 12 => {
            let digests: Vec<String> = (0..rng.range_i(1, 3))
                .map(|_| format!("d{}", rng.below(4)))
                .collect();
            let wants: Vec<KeyWant<'_>> = digests
                .iter()
                .map(|d| KeyWant {
                    digest: d,
                    want: rng.below(6),
                })
                .collect();
            let mv = if rng.chance(0.9) {
                version
            } else {
                rng.range_i(0, version + 1)
            };
            let req = KeyPullBatch {
                task,
                start_ms: start,
                slice_ms,
                host_id: host,
                request_id: &rid,
                meta_version: mv,
                all_or_nothing: rng.chance(0.3),
                keys: &wants,
            };
            let _ = scripts::key_pull_batch(c, keys, &req).await;
        }
        13 => {
            let _ = scripts::take(c, keys, task, start, slice_ms, rng.below(4), &rid).await;
        }
        14 => {
            let _ = scripts::slide(c, keys, task, start, slice_ms, rng.below(4), "n1", &rid).await;
        }
        15 => {
            let state = [("x", rng.below(9).to_string())];
            let _ = scripts::adjust(
                c,
                keys,
                task,
                &fence,
                rng.chance(0.3),
                &state,
                rng.chance(0.5).then_some("{\"a\":1}"),
                rng.range_i(1, 3) as usize,
            )
            .await;
        }
        16 => {
            let starts: Vec<i64> = (0..rng.range_i(1, 3))
                .map(|i| start + i * slice_ms as i64)
                .collect();
            let _ = scripts::read_slices(c, keys, task, &starts).await;
            let writes = vec![(rng.range_i(0, 8), vec![b'x'; 3])];
            let sec = keys.history(task, "s");
            let min = keys.history(task, "m");
            let _ = scripts::record_history(
                c,
                keys,
                task,
                &fence,
                RingWrites {
                    key: &sec,
                    ttl_ms: 2000,
                    writes: &writes,
                },
                RingWrites {
                    key: &min,
                    ttl_ms: 5000,
                    writes: &[],
                },
            )
            .await;
        }
        17 => match rng.below(5) {
            0 | 1 => {
                let _ = lease::lease(c, keys, task, host, rng.below(5), rng.below(4)).await;
            }
            2 => {
                let _ =
                    lease::lock_acquire(c, keys, task, host, rng.range_i(50, 2000) as u64).await;
            }
            3 => {
                let _ =
                    lease::lock_renew(c, keys, task, rng.below(4), rng.range_i(50, 2000) as u64)
                        .await;
            }
            _ => {
                let _ = lease::lock_release(c, keys, task, rng.below(4)).await;
            }
        },
        18 => {
            // Hosts seen at various times, then pruned.
            let seen = now_ms - rng.range_i(0, 5000);
            let doc = if rng.chance(0.8) {
                format!(
                    "{{\"seen_ms\":{seen},\"offset_ms\":{}}}",
                    rng.range_i(-50, 50)
                )
            } else {
                "not json".into()
            };
            let _: redis::RedisResult<Value> = redis::cmd("HSET")
                .arg(keys.hosts())
                .arg(host)
                .arg(doc)
                .query_async(c)
                .await;
            let hosts: Vec<String> = HOSTS.iter().map(|h| h.to_string()).collect();
            let _ = scripts::prune_hosts(c, keys, rng.range_i(500, 4000) as u64, &hosts).await;
        }
        _ => {
            // Damage, now and then: what a worker must survive reading (a field changed by
            // hand, a key lost or expiring).
            if rng.chance(0.3) {
                let k = match rng.below(5) {
                    0 | 1 => keys.meta(task),
                    2 => keys.key_slices(task, start),
                    3 => keys.lease(task),
                    _ => keys.slice(task, start),
                };
                let v: redis::RedisResult<Value> = match rng.below(3) {
                    0 => redis::cmd("DEL").arg(&k).query_async(c).await,
                    1 => {
                        redis::cmd("HSET")
                            .arg(&k)
                            .arg(*rng.pick(&[
                                "cap",
                                "rem",
                                "term",
                                "epoch",
                                "fenced_ms",
                                "fence_ttl",
                                "rolled_to",
                                "version",
                                "lz_cap",
                                "lz_from",
                                "lz_until",
                                "lz_exp",
                                "slice_ms",
                                "mode",
                                "retired",
                            ]))
                            .arg(*rng.pick(&[
                                "0",
                                "-1",
                                "x",
                                "99999999999999999999",
                                "7",
                                "9007199254740993",
                                "1e3",
                                "",
                            ]))
                            .query_async(c)
                            .await
                    }
                    _ => {
                        redis::cmd("PEXPIRE")
                            .arg(&k)
                            .arg(rng.range_i(1, 300))
                            .query_async(c)
                            .await
                    }
                };
                let _ = v;
            }
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_simulated_redis_answers_every_protocol_call_as_redis_does() {
    let seed: u64 = std::env::var("SLUICE_SIM_SEED")
        .ok()
        .map(|s| {
            s.parse()
                .expect("SLUICE_SIM_SEED must be an unsigned integer")
        })
        .unwrap_or_else(sluice_testkit::random_seed);
    let steps: usize = std::env::var("SLUICE_SIM_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    eprintln!("differential: SLUICE_SIM_SEED={seed} SLUICE_SIM_STEPS={steps} (replay with these)");
    // Database 9 of the shared server: the read-back SCANs only this run's database, never the
    // keys other tests hold in database 0.
    let info = redis::IntoConnectionInfo::into_connection_info(redis_url().as_str())
        .expect("SLUICE_TEST_REDIS");
    let settings = info.redis_settings().clone().set_db(DB);
    let client = redis::Client::open(info.set_redis_settings(settings)).expect("SLUICE_TEST_REDIS");
    let mut real = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to SLUICE_TEST_REDIS");
    let mut probe = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let ns = format!("simdiff{}x{}", seed % 1_000_000_007, std::process::id());
    let keys = Keys::new(&ns).expect("a valid namespace");
    let prefix = format!("{ns}:");
    let start_us = time_us(&mut probe).await;
    let sim = SimRedis::new("differential", ManualClock::new(start_us));
    let shared = Arc::new(Mutex::new(Shared {
        sim,
        prefix: prefix.clone(),
        scripts: known_scripts(),
        commands: 0,
        seen: BTreeMap::new(),
        failures: Vec::new(),
        step: 0,
    }));
    let _ = &mut real;
    let mut rec = Recorder {
        real,
        probe,
        shared: shared.clone(),
    };
    let mut rng = Rng::new(seed);
    let mut world = World::new(&mut rng);
    for t in &world.tasks {
        eprintln!(
            "differential: task {} {:?} keyed={} slices of {} ms",
            t.name, t.meta.mode, t.meta.keyed, t.slice_ms
        );
    }
    for i in 0..steps {
        shared.lock().unwrap().step = i;
        let now_ms = time_us(&mut rec.probe).await / 1000;
        step(&mut rng, &mut rec, &keys, now_ms, &mut world).await;
        if rng.chance(0.05) {
            tokio::time::sleep(std::time::Duration::from_millis(rng.range_i(1, 120) as u64)).await;
        }
        if shared.lock().unwrap().failures.len() >= 5 {
            break;
        }
    }
    // Leave nothing behind on the shared server.
    let left: Vec<Vec<u8>> = real_dump(&mut rec.probe, &prefix)
        .await
        .into_keys()
        .collect();
    if !left.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(left)
            .query_async(&mut rec.probe)
            .await
            .expect("DEL");
    }
    let sh = shared.lock().unwrap();
    if std::env::var_os("SLUICE_SIM_COVERAGE").is_some() {
        for (k, n) in &sh.seen {
            eprintln!("  {n:5}  {k}");
        }
    }
    eprintln!(
        "differential: {} commands compared, {} differences (seed {seed})",
        sh.commands,
        sh.failures.len()
    );
    assert!(
        sh.failures.is_empty(),
        "the simulation differs from Redis (SLUICE_SIM_SEED={seed}):\n{}",
        sh.failures.join("\n")
    );
}
