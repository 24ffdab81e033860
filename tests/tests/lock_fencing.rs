//! Locks and fencing tokens when Redis goes back in time (restart from an older dump, a
//! failover to a lagging replica) and when a caller cancels a waiting `lock()`; against real
//! Redis servers (private ones where the test kills, restarts or pauses Redis).

use std::time::{Duration, Instant};

use sluice_protocol::Keys;
use sluice_protocol::lease::{self, LockReply};
use sluice_tests::*;

fn client(redis: &str, ns: &str, host: &str) -> sluice::Client {
    sluice::Client::new(sdk_config(redis, ns, host)).expect("client")
}

async fn token_of(c: &sluice::Client, name: &str) -> u64 {
    let g = c
        .lock_timeout(name, Duration::from_secs(5), Duration::from_secs(15))
        .await
        .expect("lock");
    let t = g.token();
    assert!(
        g.release().await.expect("release"),
        "released by its holder"
    );
    t
}

/// Item 8 of issue 23: Redis with persistence restarts from a dump older than the last token
/// it handed out (as after `kill -9` with RDB snapshots, AOF `everysec`, or a failover to a
/// lagging replica): the restored counter is older, yet the next token must be larger than
/// every token handed out before.
#[tokio::test]
async fn fencing_tokens_keep_increasing_after_redis_restarts_from_an_older_dump() {
    let mut redis = RedisServer::start_with(&["--save", "3600 1"]);
    let ns = unique_ns("lockdump");
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let c = client(&redis.url(), &ns, &host);
    let t1 = token_of(&c, "job").await;
    let mut admin = redis.admin_conn();
    let _: () = redis::cmd("SAVE").query(&mut admin).expect("SAVE");
    let t2 = token_of(&c, "job").await;
    assert!(t2 > t1, "{t2} after {t1}");
    // kill -9: the counter's last value (t2) was never saved.
    redis.kill();
    redis.restart();
    let mut admin = redis.admin_conn();
    let counter: String = redis::cmd("GET")
        .arg(Keys::new(&ns).unwrap().lock_token("job"))
        .query(&mut admin)
        .expect("the counter was restored from the dump");
    assert_eq!(counter, t1.to_string(), "the dump holds the older counter");
    let t3 = token_of(&c, "job").await;
    eprintln!("tokens {t1}, {t2} (lost), after the restart {t3}");
    assert!(
        t3 > t2,
        "token {t3} after Redis came back, {t2} handed out before"
    );
    let t4 = token_of(&c, "job").await;
    assert!(t4 > t3, "{t4} after {t3}");
}

/// The same at the script level, for a counter set back by hand (a replica that lags by any
/// number of tokens), and a counter that is not a number: refused, nothing written.
#[tokio::test]
async fn a_counter_set_back_or_garbled_never_yields_a_repeated_token() {
    let ns = unique_ns("lockback");
    let keys = Keys::new(&ns).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    let mut sc = redis_conn(&shared_redis());
    let (mut last, mut set_back) = (0, 0);
    for (i, back) in [0u64, 1, 1_000, 1_000_000_000, 0].into_iter().enumerate() {
        let owner = format!("o{i}");
        let LockReply::Acquired { token } = lease::lock_acquire(&mut c, &keys, "l", &owner, 60_000)
            .await
            .unwrap()
        else {
            panic!("a free lock was not acquired")
        };
        assert!(
            token > last,
            "token {token} after {last} (the counter was set back by {set_back})"
        );
        last = token;
        // The token is stored as a decimal integer: renewal and release (string compare) work.
        assert!(
            lease::lock_renew(&mut c, &keys, "l", token, 60_000)
                .await
                .unwrap()
        );
        assert!(
            lease::lock_release(&mut c, &keys, "l", token)
                .await
                .unwrap()
        );
        let _: () = redis::cmd("SET")
            .arg(keys.lock_token("l"))
            .arg(token.saturating_sub(back))
            .query(&mut sc)
            .unwrap();
        set_back = back;
    }
    let _: () = redis::cmd("SET")
        .arg(keys.lock_token("l"))
        .arg("1.5e+15")
        .query(&mut sc)
        .unwrap();
    let err = lease::lock_acquire(&mut c, &keys, "l", "garbled", 60_000)
        .await
        .expect_err("a counter that is not an integer is refused");
    assert!(err.to_string().contains("counter"), "{err}");
    let held: i64 = redis::cmd("EXISTS")
        .arg(keys.lock("l"))
        .query(&mut sc)
        .unwrap();
    assert_eq!(held, 0, "nothing acquired");
}

/// Whether lock `name` of namespace `ns` exists in Redis now.
fn lock_exists(redis: &str, ns: &str, name: &str) -> bool {
    let mut c = redis_conn(redis);
    let n: i64 = redis::cmd("EXISTS")
        .arg(Keys::new(ns).unwrap().lock(name))
        .query(&mut c)
        .unwrap();
    n == 1
}

/// Item 18 of issue 23 (lock part), waiting: a `lock()` dropped while it waits for a busy lock
/// (here by `tokio::time::timeout`) must stop trying: once the holder releases, nobody holds
/// the lock (the seed's SDK went on and took it for a TTL, with no guard to renew or release).
#[tokio::test]
async fn a_cancelled_lock_wait_leaves_nothing_held() {
    let ns = unique_ns("lockcancel");
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let c = client(&shared_redis(), &ns, &host);
    let holder = c.lock("l", Duration::from_secs(10)).await.expect("lock");
    let waited = tokio::time::timeout(
        Duration::from_millis(200),
        c.lock_timeout("l", Duration::from_secs(10), Duration::from_secs(30)),
    )
    .await;
    assert!(waited.is_err(), "the wait was cancelled");
    assert!(holder.release().await.unwrap());
    // A live acquisition loop retries within 20 ms: give it 50 times that.
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        assert!(
            !lock_exists(&shared_redis(), &ns, "l"),
            "the cancelled lock() took the lock after it was released"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // And the lock is free for the next caller at once.
    let g = c
        .try_lock("l", Duration::from_secs(10))
        .await
        .expect("free");
    assert!(g.release().await.unwrap());
}

/// Item 18, in flight: a `lock()` dropped while its acquiring call is on its way (Redis paused)
/// takes the lock when Redis runs the call; that late acquisition must be released, not left
/// held for its TTL.
#[tokio::test]
async fn a_lock_acquired_by_a_cancelled_call_is_released() {
    let redis = RedisServer::start();
    let ns = unique_ns("lockinflight");
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let c = client(&redis.url(), &ns, &host);
    // Warm up the connection (and load the script) so the next call is a single EVALSHA.
    let g = c.lock("warm", Duration::from_secs(10)).await.expect("lock");
    assert!(g.release().await.unwrap());
    let mut admin = redis.admin_conn();
    pause_writes(&mut admin, 400);
    let paused = Instant::now();
    let waited = tokio::time::timeout(
        Duration::from_millis(100),
        c.lock("l", Duration::from_secs(30)),
    )
    .await;
    assert!(waited.is_err(), "the call was still paused: cancelled");
    // Redis resumes and runs the acquisition; within a second of that the lock must be gone
    // again (its TTL is 30 s).
    let deadline = paused + Duration::from_millis(400) + Duration::from_secs(2);
    loop {
        let exists = lock_exists(&redis.url(), &ns, "l");
        if !exists && paused.elapsed() > Duration::from_millis(600) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lock taken by a cancelled lock() is still held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The paused call did run and take the lock (its token counter exists): it was released.
    let counter: Option<String> = redis::cmd("GET")
        .arg(Keys::new(&ns).unwrap().lock_token("l"))
        .query(&mut redis.admin_conn())
        .unwrap();
    assert!(counter.is_some(), "the paused acquisition never ran");
    let g = c
        .try_lock("l", Duration::from_secs(10))
        .await
        .expect("free");
    assert!(g.release().await.unwrap());
}

// ─── The reference model of locks and its property ───
//
// The model: one lock, two or three clients (hosts) taking it through the SDK (`try_lock`,
// guards that renew themselves, released explicitly or by drop) and raw holders that take it
// through the script and never renew (a holder paused past its TTL); Redis with persistence,
// snapshotted (`SAVE`) and killed with `kill -9` and restarted from the snapshot at any step.
// Properties:
// * tokens strictly increase across every acquisition of the case, restarts included;
// * at most one holder at a time by the model's clock: when an acquisition succeeds, no SDK
//   guard says `is_held()` and no raw holder is within three quarters of its TTL (the guard's
//   own margin) — unless Redis restarted since that holder acquired (a restart from an older
//   snapshot loses or rolls back the lock itself; documented: the token still fences);
// * liveness: an acquisition while the model has the lock free (nothing held, raw holders past
//   their TTL, no restart within the longest TTL) succeeds; a dropped guard's lock is gone
//   within a second; no panic.

use proptest::prelude::*;

#[derive(Debug, Clone)]
enum LockStep {
    /// Client `c` tries once, with a short (300 ms) or long (2 s) TTL.
    Try(usize, bool),
    /// A raw holder takes the lock through the script with this TTL (ms) and never renews.
    Raw(u64),
    Release(usize),
    Drop(usize),
    Save,
    Restart,
    Sleep(u64),
}

fn lock_step() -> impl Strategy<Value = LockStep> {
    prop_oneof![
        6 => (0..3usize, any::<bool>()).prop_map(|(c, s)| LockStep::Try(c, s)),
        1 => (100..400u64).prop_map(LockStep::Raw),
        5 => (0..3usize).prop_map(LockStep::Release),
        1 => (0..3usize).prop_map(LockStep::Drop),
        2 => Just(LockStep::Save),
        1 => Just(LockStep::Restart),
        2 => (0..500u64).prop_map(LockStep::Sleep),
    ]
}

const LONGEST_TTL: Duration = Duration::from_secs(2);

struct Held {
    guard: sluice::LockGuard,
    at: Instant,
}

struct LockWorld {
    redis: RedisServer,
    ns: String,
    clients: Vec<sluice::Client>,
    held: Vec<Option<Held>>,
    /// Raw holders: when sent, their TTL.
    raw: Vec<(Instant, Duration)>,
    last_token: u64,
    restarted: Option<Instant>,
    acquisitions: u64,
}

impl LockWorld {
    fn restarted_since(&self, t: Instant) -> bool {
        self.restarted.is_some_and(|r| r >= t)
    }

    /// The model's view: nothing holds the lock (no guard, raw holders past their TTL, no
    /// restart whose snapshot could hold an older lock).
    fn free(&self) -> bool {
        self.held.iter().all(Option::is_none)
            && self
                .raw
                .iter()
                .all(|(at, ttl)| at.elapsed() > *ttl + Duration::from_millis(50))
            && self
                .restarted
                .is_none_or(|r| r.elapsed() > LONGEST_TTL + Duration::from_millis(100))
    }

    /// Checks a new acquisition (token `token`, sent at `sent`).
    fn acquired(&mut self, token: u64, sent: Instant) {
        assert!(
            token > self.last_token,
            "token {token} after {} (restarted: {:?})",
            self.last_token,
            self.restarted.map(|r| r.elapsed())
        );
        self.last_token = token;
        self.acquisitions += 1;
        for (c, h) in self.held.iter().enumerate() {
            if let Some(h) = h
                && !self.restarted_since(h.at)
            {
                assert!(
                    !h.guard.is_held(),
                    "two holders: client {c} (token {}) still holds the lock while token \
                     {token} was handed out",
                    h.guard.token()
                );
            }
        }
        for (at, ttl) in &self.raw {
            if !self.restarted_since(*at) {
                assert!(
                    at.elapsed() >= *ttl * 3 / 4 || *at > sent,
                    "two holders: a raw holder of {ttl:?} from {:?} ago",
                    at.elapsed()
                );
            }
        }
    }

    async fn apply(&mut self, s: &LockStep) {
        let n = self.clients.len();
        match *s {
            LockStep::Try(c, short) => {
                let c = c % n;
                if self.held[c].is_some() {
                    return;
                }
                let ttl = if short {
                    Duration::from_millis(300)
                } else {
                    LONGEST_TTL
                };
                let free = self.free();
                let sent = Instant::now();
                match self.clients[c].try_lock("job", ttl).await {
                    Ok(g) => {
                        self.acquired(g.token(), sent);
                        self.held[c] = Some(Held { guard: g, at: sent });
                    }
                    Err(e) => assert!(
                        !free || matches!(e, sluice::LockError::Unreachable(_)),
                        "liveness: the lock is free in the model, yet {e}"
                    ),
                }
            }
            LockStep::Raw(ttl_ms) => {
                let keys = Keys::new(&self.ns).unwrap();
                let mut c = protocol_conn(&self.redis.url()).await;
                let sent = Instant::now();
                let owner = format!("raw{}", self.acquisitions);
                if let Ok(LockReply::Acquired { token }) =
                    lease::lock_acquire(&mut c, &keys, "job", &owner, ttl_ms).await
                {
                    self.acquired(token, sent);
                    self.raw.push((sent, Duration::from_millis(ttl_ms)));
                }
            }
            LockStep::Release(c) => {
                if let Some(h) = self.held[c % n].take() {
                    let was_held = h.guard.is_held();
                    match h.guard.release().await {
                        Ok(released) => assert!(
                            released || !was_held || self.restarted_since(h.at),
                            "a guard that held the lock could not release it"
                        ),
                        Err(e) => assert!(self.restarted.is_some(), "release: {e}"),
                    }
                }
            }
            LockStep::Drop(c) => {
                if let Some(h) = self.held[c % n].take() {
                    let token = h.guard.token();
                    drop(h);
                    // The lock of a dropped guard is released promptly (by token).
                    let keys = Keys::new(&self.ns).unwrap();
                    let deadline = Instant::now() + Duration::from_secs(1);
                    loop {
                        let mut rc = self.redis.admin_conn();
                        let t: Option<u64> = redis::cmd("HGET")
                            .arg(keys.lock("job"))
                            .arg("token")
                            .query(&mut rc)
                            .unwrap_or(None);
                        if t != Some(token) {
                            break;
                        }
                        assert!(
                            Instant::now() < deadline,
                            "a dropped guard's lock (token {token}) is still held"
                        );
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            LockStep::Save => {
                let _: () = redis::cmd("SAVE")
                    .query(&mut self.redis.admin_conn())
                    .unwrap();
            }
            LockStep::Restart => {
                self.redis.kill();
                self.redis.restart();
                self.restarted = Some(Instant::now());
            }
            LockStep::Sleep(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
    }
}

#[test]
fn lock_tokens_increase_and_one_holder_at_a_time_across_redis_restarts() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = sluice_testkit::prop_config("lock_model", 8);
    cfg.max_shrink_iters = 32;
    let mut runner = proptest::test_runner::TestRunner::new(cfg);
    let strategy = (2..=3usize, proptest::collection::vec(lock_step(), 5..25));
    let totals = std::cell::Cell::new((0u64, 0u32));
    runner
        .run(&strategy, |(n, steps)| {
            let a = rt.block_on(async {
                let ns = unique_ns("lmodel");
                let redis = RedisServer::start_with(&["--save", "3600 1"]);
                let hosts: Vec<String> = (0..n).map(|i| format!("{ns}-h{i}")).collect();
                let _segments =
                    SegmentGuard(hosts.iter().map(|h| (ns.clone(), h.clone())).collect());
                let mut w = LockWorld {
                    clients: hosts.iter().map(|h| client(&redis.url(), &ns, h)).collect(),
                    redis,
                    ns,
                    held: (0..n).map(|_| None).collect(),
                    raw: Vec::new(),
                    last_token: 0,
                    restarted: None,
                    acquisitions: 0,
                };
                for s in &steps {
                    w.apply(s).await;
                }
                for c in 0..n {
                    w.apply(&LockStep::Release(c)).await;
                }
                w.acquisitions
            });
            let (t, k) = totals.get();
            totals.set((t + a, k + 1));
            Ok(())
        })
        .unwrap();
    let (t, k) = totals.get();
    eprintln!("lock model: {k} cases, {t} acquisitions");
}

/// Review of issue 23 (finding 4): the replies of the call that takes a lock are lost (Redis
/// ran it; the answer never came back), on the open connection and on the fresh one the SDK
/// retries on, so the call fails and `lock()` tries again. That attempt must be answered with
/// the lock (one owner for the whole wait; the script is re-entrant for its owner): before,
/// each attempt drew a new owner, so it found the lock busy — held by nobody — and `lock()`
/// failed (or waited a whole TTL).
#[tokio::test]
async fn a_lock_whose_acquiring_reply_was_lost_is_held_by_its_caller() {
    let redis = shared_redis();
    let upstream = redis.trim_start_matches("redis://").trim_end_matches('/');
    let proxy = ReplyLoser::start(upstream);
    let ns = unique_ns("locklost");
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&proxy.url(), &ns, &host);
    cfg.pull_timeout = Duration::from_millis(400);
    cfg.acquire_timeout = Duration::from_secs(3);
    let c = sluice::Client::new(cfg).expect("client");
    // The connection is open and works.
    let warm = c.lock("warm", Duration::from_secs(10)).await.expect("warm");
    assert!(warm.release().await.unwrap());
    let before = proxy.connections();
    assert!(
        before >= 1,
        "the client's connection goes through the proxy"
    );
    proxy.lose_replies_of_open_connections();
    proxy.lose_replies_of_next_connections(1);
    let t0 = Instant::now();
    let g = c
        .lock("l", Duration::from_secs(30))
        .await
        .expect("the lock taken by the lost call is this caller's");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    eprintln!(
        "connections {before} → {}, took {:?}",
        proxy.connections(),
        t0.elapsed()
    );
    assert!(
        proxy.connections() >= before + 2,
        "the lost replies made the client reconnect twice"
    );
    // Redis holds it for this guard's token, and the guard releases it.
    let mut r = redis_conn(&redis);
    let stored: Option<u64> = redis::cmd("HGET")
        .arg(Keys::new(&ns).unwrap().lock("l"))
        .arg("token")
        .query(&mut r)
        .unwrap();
    assert_eq!(stored, Some(g.token()));
    assert!(
        g.release().await.expect("release"),
        "released by its holder"
    );
    assert!(!lock_exists(&redis, &ns, "l"), "nothing left held");
}
