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
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(400)
        .arg("WRITE")
        .query(&mut admin)
        .unwrap();
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
