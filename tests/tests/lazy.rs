//! `--lazy-after` (protocol 5, issue 27): a task without traffic keeps no slices ahead; its
//! meta vouches for them instead and the first decision makes its slice (PULL, TAKE, SLIDE);
//! the leader then rolls it ahead again. End to end, with real managers, Redis and the SDK.

use std::time::Duration;

use sluice::{Client, Config, Decision};
use sluice_tests::*;

fn redis_ms(conn: &mut redis::Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    s * 1_000 + us / 1_000
}

fn meta_i64(conn: &mut redis::Connection, ns: &str, task: &str, field: &str) -> Option<i64> {
    let keys = sluice_protocol::Keys::new(ns).unwrap();
    redis::cmd("HGET")
        .arg(keys.meta(task))
        .arg(field)
        .query::<Option<i64>>(conn)
        .unwrap()
}

/// How many of the task's slices from the current one to `n` slices on exist.
fn slices_ahead(conn: &mut redis::Connection, ns: &str, task: &str, slice_ms: i64, n: i64) -> i64 {
    let keys = sluice_protocol::Keys::new(ns).unwrap();
    let current = sluice_protocol::slice::start(redis_ms(conn), slice_ms as u64);
    (0..n)
        .map(|i| keys.slice(task, current + i * slice_ms))
        .map(|k| redis::cmd("EXISTS").arg(k).query::<i64>(conn).unwrap())
        .sum()
}

/// Waits until the leader left `task` lazy and the slices it had written ahead have passed.
async fn wait_lazy(conn: &mut redis::Connection, ns: &str, task: &str, cap: i64) {
    let what = format!("{task} lazy, its window written ahead passed");
    wait_until(
        &what,
        Duration::from_secs(40),
        Duration::from_millis(200),
        || {
            let now = redis_ms(conn);
            let lazy = meta_i64(conn, ns, task, "lz_cap") == Some(cap)
                && meta_i64(conn, ns, task, "lz_until").is_some_and(|u| u >= now + 6_000);
            let passed = meta_i64(conn, ns, task, "rolled_to").is_some_and(|r| r < now - 1_000);
            async move { (lazy && passed).then_some(()) }
        },
    )
    .await;
}

/// The flags of these tests' managers: lazy after 2 s, short horizon and retention.
const LAZY: [&str; 6] = [
    "--lazy-after",
    "2s",
    "--horizon",
    "6s",
    "--retention",
    "10s",
];

/// As [`LAZY`], with a horizon that outlasts a leader change.
const LAZY_REPLICAS: [&str; 6] = [
    "--lazy-after",
    "2s",
    "--horizon",
    "8s",
    "--retention",
    "10s",
];

/// One manager (`m1`) with [`LAZY`].
async fn lazy_manager(etcd: &str, redis: &str, ns: &str) -> Manager {
    let mut opts = ManagerOpts::new(etcd, redis, ns, "m1");
    opts.extra = LAZY.map(String::from).to_vec();
    Manager::start(opts).await
}

/// One manager with a 60 s horizon (a lazy task's refresh period is then 30 s) and `tasks` of
/// 40 per 1 s slice, each left lazy.
async fn lazy_tasks_of_40(etcd: &str, redis: &str, ns: &str, tasks: &[&str]) -> Manager {
    let mut opts = ManagerOpts::new(etcd, redis, ns, "m1");
    opts.extra = [
        "--lazy-after",
        "2s",
        "--horizon",
        "60s",
        "--retention",
        "10s",
    ]
    .map(String::from)
    .to_vec();
    let m = Manager::start(opts).await;
    for t in tasks {
        let (status, b) = m
            .put(
                &format!("/api/v1/tasks/{t}"),
                r#"{"threshold": 40, "slice_ms": 1000}"#,
            )
            .await;
        assert_eq!(status, 201, "{b}");
    }
    let mut conn = redis_conn(redis);
    for t in tasks {
        wait_lazy(&mut conn, ns, t, 40).await;
    }
    m
}

fn client(redis: &str, ns: &str) -> Client {
    let mut cfg = Config::new(redis.to_string());
    cfg.namespace = ns.to_string();
    cfg.host_id = format!("{ns}-h");
    Client::new(cfg).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_task_is_lazy_and_its_first_decision_makes_its_slice() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lazy");
    let m = lazy_manager(&etcd, &redis, &ns).await;
    for (name, body) in [
        ("p", r#"{"threshold": 50, "slice_ms": 1000}"#),
        (
            "fx",
            r#"{"threshold": 5, "slice_ms": 1000, "mode": "exact_fixed", "local_limit": 1, "on_failure": "deny"}"#,
        ),
        (
            "sl",
            r#"{"threshold": 5, "slice_ms": 1000, "mode": "exact_sliding", "local_limit": 1, "on_failure": "deny"}"#,
        ),
        // Keyed tasks are never lazy (KPULL does not make task slices).
        ("k", r#"{"threshold": 5, "slice_ms": 1000, "keyed": true}"#),
    ] {
        let (status, b) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
        assert_eq!(status, 201, "{b}");
    }
    let mut conn = redis_conn(&redis);
    // New tasks start lazy: their first write is meta, fence and window, no slices ahead.
    wait_until(
        "the new task's lazy window",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let lazy = meta_i64(&mut conn, &ns, "p", "lz_cap") == Some(50);
            async move { lazy.then_some(()) }
        },
    )
    .await;
    assert_eq!(slices_ahead(&mut conn, &ns, "p", 1_000, 6), 0);
    wait_lazy(&mut conn, &ns, "p", 50).await;
    wait_lazy(&mut conn, &ns, "fx", 5).await;
    wait_lazy(&mut conn, &ns, "sl", 5).await;
    assert_eq!(
        slices_ahead(&mut conn, &ns, "p", 1_000, 6),
        0,
        "a lazy task has no slices ahead"
    );
    assert_eq!(
        meta_i64(&mut conn, &ns, "k", "lz_cap"),
        None,
        "keyed: rolled ahead"
    );
    assert!(slices_ahead(&mut conn, &ns, "k", 1_000, 6) >= 5);

    // The API shows what a decision would get.
    let t = m.get_json("/api/v1/tasks/p").await.expect("task");
    assert_eq!(t["status"]["lazy"], true, "{t}");
    assert_eq!(t["status"]["effective_threshold"], 50, "{t}");

    // The first decisions make the slices, from the meta, fenced by the leader's term.
    let c = client(&redis, &ns);
    let (p, fx, sl) = (
        c.task("p").unwrap(),
        c.task("fx").unwrap(),
        c.task("sl").unwrap(),
    );
    assert!(p.wait_ready(Duration::from_secs(10)));
    assert!(fx.wait_ready(Duration::from_secs(10)) && sl.wait_ready(Duration::from_secs(10)));
    assert_eq!(p.acquire(1).await, Decision::Allowed);
    // Early in a slice, so the exact decision and the reads below share it.
    let wait = 1_000 - redis_ms(&mut conn).rem_euclid(1_000) + 50;
    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    let current = sluice_protocol::slice::start(redis_ms(&mut conn), 1_000);
    assert_eq!(fx.acquire(2).await, Decision::Allowed);
    assert_eq!(sl.acquire(1).await, Decision::Allowed);
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let term = meta_i64(&mut conn, &ns, "p", "term").expect("term");
    let same = sluice_protocol::slice::start(redis_ms(&mut conn), 1_000) == current;
    let made: Vec<Option<i64>> = redis::cmd("HMGET")
        .arg(keys.slice("fx", current))
        .arg("cap")
        .arg("term")
        .arg("len")
        .query(&mut conn)
        .unwrap();
    // The slice of the decision (or, at a boundary, the one after it: the leader rolls ahead).
    if same {
        assert_eq!(made, [Some(5), Some(term), Some(1_000)]);
    }

    // The leader sees it and rolls the tasks ahead again, dropping the lazy window.
    for task in ["p", "fx", "sl"] {
        let what = format!("{task} rolled ahead again");
        wait_until(
            &what,
            Duration::from_secs(10),
            Duration::from_millis(100),
            || {
                let now = redis_ms(&mut conn);
                let ahead =
                    meta_i64(&mut conn, &ns, task, "rolled_to").is_some_and(|r| r >= now + 6_000);
                // Its window is kept only before the slices written ahead (a worker whose
                // clock is behind still makes those).
                let cut =
                    meta_i64(&mut conn, &ns, task, "lz_until").is_none_or(|u| u <= now + 1_000);
                async move { (ahead && cut).then_some(()) }
            },
        )
        .await;
        assert!(slices_ahead(&mut conn, &ns, task, 1_000, 6) >= 5, "{task}");
    }
    // The exact slice kept what it admitted through the switch.
    let adm: Option<i64> = redis::cmd("HGET")
        .arg(keys.slice("fx", current))
        .arg("adm")
        .query(&mut conn)
        .unwrap();
    if same {
        assert_eq!(adm, Some(2));
    }
    drop(c);
}

/// A lazy task stays decidable while no leader runs: its meta vouches up to the window the
/// dead leader wrote, as slices written ahead would. The next leader rolls it ahead and,
/// once it is idle again, leaves it lazy under its own term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_task_is_decidable_across_a_leader_change() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lazyl");
    let mut ms = start_replicas(&etcd, &redis, &ns, 2, &LAZY_REPLICAS).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let (status, b) = ms[leader]
        .put("/api/v1/tasks/p", r#"{"threshold": 40, "slice_ms": 1000}"#)
        .await;
    assert_eq!(status, 201, "{b}");
    let mut conn = redis_conn(&redis);
    wait_lazy(&mut conn, &ns, "p", 40).await;
    let old_term = meta_i64(&mut conn, &ns, "p", "term").expect("term");

    ms[leader].proc.kill();
    let c = client(&redis, &ns);
    let p = c.task("p").unwrap();
    assert!(p.wait_ready(Duration::from_secs(10)));
    // Decisions while no leader runs (the lease outlives the kill by up to its TTL).
    for _ in 0..3 {
        assert_eq!(p.acquire(1).await, Decision::Allowed);
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let other = 1 - leader;
    ms[other].wait_leader().await;
    wait_until(
        "the new leader's lazy window",
        Duration::from_secs(40),
        Duration::from_millis(200),
        || {
            let term = meta_i64(&mut conn, &ns, "p", "term");
            let lazy = meta_i64(&mut conn, &ns, "p", "lz_cap") == Some(40);
            async move { (lazy && term.is_some_and(|t| t > old_term)).then_some(()) }
        },
    )
    .await;
    assert_eq!(p.acquire(1).await, Decision::Allowed);
    drop(c);
}

/// A new leadership keeps the tasks the previous one left lazy lazy: its first write of each
/// is its meta, fence and lazy window, not its whole window of slices (at 100,000 idle tasks
/// that would be millions of slices in one tick).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_keeps_idle_tasks_lazy() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lazyt");
    let mut ms = start_replicas(&etcd, &redis, &ns, 2, &LAZY_REPLICAS).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    for t in ["a", "b", "c"] {
        let (status, b) = ms[leader]
            .put(
                &format!("/api/v1/tasks/{t}"),
                r#"{"threshold": 30, "slice_ms": 1000}"#,
            )
            .await;
        assert_eq!(status, 201, "{b}");
    }
    let mut conn = redis_conn(&redis);
    for t in ["a", "b", "c"] {
        wait_lazy(&mut conn, &ns, t, 30).await;
    }
    let old_term = meta_i64(&mut conn, &ns, "a", "term").expect("term");
    ms[leader].proc.kill();
    let other = 1 - leader;
    ms[other].wait_leader().await;
    for t in ["a", "b", "c"] {
        let what = format!("{t} claimed by the new leader, lazy");
        wait_until(
            &what,
            Duration::from_secs(30),
            Duration::from_millis(100),
            || {
                let term = meta_i64(&mut conn, &ns, t, "term");
                let lazy = meta_i64(&mut conn, &ns, t, "lz_cap") == Some(30);
                async move { (lazy && term.is_some_and(|x| x > old_term)).then_some(()) }
            },
        )
        .await;
    }
    // Never rolled ahead: no slice past the current one, rolled_to not ahead of now.
    for _ in 0..10 {
        let now = redis_ms(&mut conn);
        for t in ["a", "b", "c"] {
            assert_eq!(slices_ahead(&mut conn, &ns, t, 1_000, 6), 0, "{t}");
            let rolled = meta_i64(&mut conn, &ns, t, "rolled_to").expect("rolled_to");
            assert!(rolled <= now + 1_000, "{t}: rolled to {rolled}, now {now}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let m = ms[other].metrics().await.expect("metrics");
    assert!(m.contains("sluice_lazy_tasks 3"), "{m}");
}

/// A fresh host whose workers speak a protocol before 5 (no `proto` in its `NS:hosts` entry)
/// cannot make a lazy task's slices: while it reports, the tasks it uses are rolled ahead (the
/// others stay lazy); once it is gone (upgraded), they are left lazy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_workers_hold_their_tasks_rolled_ahead() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lazyo");
    let m = lazy_manager(&etcd, &redis, &ns).await;
    for t in ["p", "q"] {
        let (status, b) = m
            .put(
                &format!("/api/v1/tasks/{t}"),
                r#"{"threshold": 20, "slice_ms": 1000}"#,
            )
            .await;
        assert_eq!(status, 201, "{b}");
    }
    let mut conn = redis_conn(&redis);
    wait_lazy(&mut conn, &ns, "p", 20).await;
    wait_lazy(&mut conn, &ns, "q", 20).await;

    // A protocol-4 host: its entry as that SDK wrote it (no `proto`).
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let old = serde_json::json!({"offset_ms": 0.0, "rtt_ms": 1.0, "seen_ms": sluice_tests::now_ms(),
        "sdk": "0.0.4", "tasks": {"p": "failed"}});
    let _: () = redis::cmd("HSET")
        .arg(keys.hosts())
        .arg("old-host")
        .arg(old.to_string())
        .query(&mut conn)
        .unwrap();
    wait_until(
        "rolled ahead while an old host reports",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let now = redis_ms(&mut conn);
            let ahead =
                meta_i64(&mut conn, &ns, "p", "rolled_to").is_some_and(|r| r >= now + 6_000);
            let lazy = meta_i64(&mut conn, &ns, "p", "lz_cap").is_some();
            async move { (ahead && !lazy).then_some(()) }
        },
    )
    .await;
    let metrics = m.metrics().await.expect("metrics");
    assert!(
        metrics.contains("sluice_lazy_held_back_hosts 1"),
        "{metrics}"
    );
    // Still not lazy well past --lazy-after; the task the old host does not use stays lazy.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(meta_i64(&mut conn, &ns, "p", "lz_cap"), None);
    assert_eq!(meta_i64(&mut conn, &ns, "q", "lz_cap"), Some(20));
    assert_eq!(slices_ahead(&mut conn, &ns, "q", 1_000, 6), 0);

    // Upgraded (its entry gone): lazy again.
    let _: () = redis::cmd("HDEL")
        .arg(keys.hosts())
        .arg("old-host")
        .query(&mut conn)
        .unwrap();
    wait_lazy(&mut conn, &ns, "p", 20).await;
}

/// A task deleted and created again with a lower threshold while slices of its first
/// incarnation live: the new incarnation's first write may not be lazy (Redis refuses a lazy
/// full write over the tombstone), so it is written ahead and every live slice gets the new
/// cap at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_task_is_written_ahead_over_its_old_slices() {
    use sluice_protocol::conn::{ConnOptions, Redis, RedisTarget};
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lazyr");
    let m = lazy_manager(&etcd, &redis, &ns).await;
    let (status, b) = m
        .put(
            "/api/v1/tasks/r",
            r#"{"threshold": 100000, "slice_ms": 1000}"#,
        )
        .await;
    assert_eq!(status, 201, "{b}");
    let mut conn = redis_conn(&redis);
    wait_lazy(&mut conn, &ns, "r", 100_000).await;
    let probes = m.metric("sluice_roll_probes_total").await;
    // Traffic: a pull makes the current slice, the leader rolls the task ahead at 100,000 —
    // seen by its fence refresh, which watches the slices a worker may have made in the same
    // round trip (no host reports it, so no probe of its own: issue 27).
    let r = Redis::new(RedisTarget::parse(&redis).unwrap(), ConnOptions::default());
    let mut c = r.conn().await.unwrap();
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let cur = sluice_protocol::slice::start(redis_ms(&mut conn), 1_000);
    pull_once(&mut c, &keys, "r", cur, 1_000, 5).await.unwrap();
    wait_until(
        "r rolled ahead at 100,000",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let n = slices_ahead(&mut conn, &ns, "r", 1_000, 6);
            async move { (n >= 5).then_some(()) }
        },
    )
    .await;
    let woken = m.metric("sluice_lazy_woken_total").await;
    assert_eq!(woken, Some(1.0), "the pull woke it");
    assert_eq!(
        m.metric("sluice_roll_probes_total").await,
        probes,
        "woken by its refresh, not probed"
    );
    assert_eq!(m.delete("/api/v1/tasks/r").await, 204);
    let (status, b) = m
        .put("/api/v1/tasks/r", r#"{"threshold": 10, "slice_ms": 1000}"#)
        .await;
    assert_eq!(status, 201, "{b}");
    let cap = |conn: &mut redis::Connection, start: i64| -> Option<i64> {
        redis::cmd("HGET")
            .arg(keys.slice("r", start))
            .arg("cap")
            .query(conn)
            .unwrap()
    };
    wait_until(
        "every live slice of r at the new cap",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let cur = sluice_protocol::slice::start(redis_ms(&mut conn), 1_000);
            let caps: Vec<Option<i64>> = (0..6).map(|i| cap(&mut conn, cur + i * 1_000)).collect();
            let done = caps.iter().all(|c| c.is_none_or(|c| c == 10)) && caps[0] == Some(10);
            async move { done.then_some(()) }
        },
    )
    .await;
    // Written ahead at once, not left lazy over the old slices and woken by them a tick later.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(m.metric("sluice_lazy_woken_total").await, woken);
    // A pull now gets at most the new cap.
    let cur = sluice_protocol::slice::start(redis_ms(&mut conn), 1_000);
    if let sluice_protocol::scripts::PullReply::Granted { granted, cap, .. } =
        pull_once(&mut c, &keys, "r", cur, 1_000, 5_000)
            .await
            .unwrap()
    {
        assert!(granted <= 10 && cap == 10, "granted {granted} of cap {cap}");
    }
}

/// Redis losing everything (a restart without persistence; here the namespace's keys deleted,
/// `NS:hosts` and the task registry with them) is healed at once for lazy tasks too, though
/// the leader probes a lazy task no host reports using only once a refresh period (30 s with
/// this horizon): the missing task registry makes it probe every lazy task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_tasks_lost_by_redis_are_healed_within_seconds() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lazyh");
    let tasks = ["h0", "h1", "h2", "h3", "h4"];
    let _m = lazy_tasks_of_40(&etcd, &redis, &ns, &tasks).await;
    let mut conn = redis_conn(&redis);
    // Every key of the namespace, gone.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:*"))
        .query(&mut conn)
        .unwrap();
    assert!(keys.len() >= tasks.len(), "{keys:?}");
    let () = redis::cmd("DEL").arg(&keys).query(&mut conn).unwrap();
    wait_until(
        "every lazy task written again, lazy",
        Duration::from_secs(8),
        Duration::from_millis(100),
        || {
            let back = tasks
                .iter()
                .all(|t| meta_i64(&mut conn, &ns, t, "lz_cap") == Some(40));
            async move { back.then_some(()) }
        },
    )
    .await;
    for t in tasks {
        assert_eq!(
            slices_ahead(&mut conn, &ns, t, 1_000, 6),
            0,
            "{t}: healed lazy"
        );
    }
    let registered: Vec<String> = redis::cmd("SMEMBERS")
        .arg(sluice_protocol::Keys::new(&ns).unwrap().task_registry())
        .query(&mut conn)
        .unwrap();
    for t in tasks {
        assert!(
            registered.iter().any(|r| r == t),
            "{t} registered again: {registered:?}"
        );
    }
}

/// A quiet lazy task sleeps in the leader's due-queue until its refresh or probe is due (a
/// refresh period: 30 s with this horizon), and is woken at once by what it cannot sleep
/// through: a new spec (a decision gets the new threshold within seconds, the other sleepers
/// stay lazy and untouched) and a host that starts using it (rolled ahead again within seconds
/// of the host's report being read, not at its next periodic probe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_lazy_task_wakes_on_a_spec_change_and_on_use() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lazyw");
    let tasks = ["s0", "s1", "s2", "s3"];
    let m = lazy_tasks_of_40(&etcd, &redis, &ns, &tasks).await;
    let mut conn = redis_conn(&redis);
    // Asleep now (the first quiet visit after its lazy write puts a task to sleep).
    tokio::time::sleep(Duration::from_secs(1)).await;

    let (status, b) = m
        .put("/api/v1/tasks/s1", r#"{"threshold": 70, "slice_ms": 1000}"#)
        .await;
    assert_eq!(status, 200, "{b}");
    let started = std::time::Instant::now();
    wait_until(
        "the changed task's new threshold in force",
        Duration::from_secs(8),
        Duration::from_millis(100),
        || async {
            let t = m.get_json("/api/v1/tasks/s1").await?;
            (t["status"]["effective_threshold"] == 70).then_some(())
        },
    )
    .await;
    eprintln!("new threshold in force after {:?}", started.elapsed());
    // The others were not touched by the change (still lazy, no slices written ahead).
    assert_eq!(meta_i64(&mut conn, &ns, "s0", "lz_cap"), Some(40));
    assert_eq!(slices_ahead(&mut conn, &ns, "s0", 1_000, 6), 0);

    // A host starts deciding on three of them: the leader rolls them ahead once it reads the
    // host's report. (Each one's periodic probe comes at its own phase of the 30 s period: a
    // leader that missed the report would still roll all three ahead within 15 s by chance
    // about one time in eight.)
    let c = client(&redis, &ns);
    let used = ["s0", "s2", "s3"];
    // All opened before the host's first report (it lists the tasks open then; the next one
    // comes 10 s later), and kept open.
    let open: Vec<_> = used.iter().map(|t| c.task(t).unwrap()).collect();
    for (t, h) in used.iter().zip(&open) {
        assert!(h.wait_ready(Duration::from_secs(10)));
        assert_eq!(h.acquire(1).await, Decision::Allowed, "{t}");
    }
    let started = std::time::Instant::now();
    wait_until(
        "the used tasks rolled ahead",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let now = redis_ms(&mut conn);
            let ahead = used.iter().all(|t| {
                meta_i64(&mut conn, &ns, t, "rolled_to").is_some_and(|r| r >= now + 30_000)
            });
            async move { ahead.then_some(()) }
        },
    )
    .await;
    eprintln!("used tasks rolled ahead after {:?}", started.elapsed());
    drop(open);
    drop(c);
}
