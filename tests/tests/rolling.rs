//! Rolling end to end: healing lost Redis data, threshold changes by difference, schedules,
//! deletion.

use std::time::{Duration, Instant};

use serde_json::json;
use sluice_protocol::conn::{ConnOptions, Redis, RedisTarget};
use sluice_protocol::scripts::PullReply;
use sluice_protocol::{Keys, meta_field, slice, slice_field};
use sluice_tests::*;

const TICK: Duration = Duration::from_millis(500);

fn all_present(conn: &mut redis::Connection, ns: &str, task: &str) -> bool {
    let now = now_ms();
    slice_caps(conn, ns, task, 1000, now, now + 59_000)
        .iter()
        .all(|(_, c)| c.is_some())
}

/// Polls every 10 ms until every slice of the next 59 s exists.
async fn wait_all_present(
    conn: &mut redis::Connection,
    ns: &str,
    task: &str,
    what: &str,
    timeout: Duration,
) {
    wait_until(what, timeout, Duration::from_millis(10), || {
        let ok = all_present(conn, ns, task);
        async move { ok.then_some(()) }
    })
    .await
}

/// Polls every 20 ms until the meta of `task` holds `rolled_to` (written, or written again).
async fn wait_meta(
    conn: &mut redis::Connection,
    keys: &Keys,
    task: &str,
    what: &str,
    timeout: Duration,
) {
    wait_until(what, timeout, Duration::from_millis(20), || {
        let t: Option<String> = redis::cmd("HGET")
            .arg(keys.meta(task))
            .arg(meta_field::ROLLED_TO)
            .query(conn)
            .unwrap_or(None);
        async move { t.map(|_| ()) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushall_and_redis_restart_are_healed_within_one_tick() {
    let ns = unique_ns("heal");
    let mut redis_srv = RedisServer::start();
    let m = Manager::start(ManagerOpts::new(
        &shared_etcd(),
        &redis_srv.url(),
        &ns,
        "n0",
    ))
    .await;
    m.wait_leader().await;
    let _ = m.put("/api/v1/tasks/h", r#"{"threshold": 10}"#).await;
    let mut conn = redis_conn(&redis_srv.url());
    wait_all_present(&mut conn, &ns, "h", "slices", Duration::from_secs(5)).await;

    let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    let t0 = Instant::now();
    wait_all_present(&mut conn, &ns, "h", "healed after FLUSHALL", TICK * 3).await;
    let took = t0.elapsed();
    eprintln!("FLUSHALL healed in {took:?}");
    // One tick, plus the tick's own work.
    assert!(
        took <= TICK + Duration::from_millis(500),
        "healing took {took:?}"
    );

    // A restarted Redis (no persistence) is empty too.
    redis_srv.kill();
    redis_srv.restart();
    let t0 = Instant::now();
    let mut conn = redis_conn(&redis_srv.url());
    wait_all_present(
        &mut conn,
        &ns,
        "h",
        "healed after restart",
        Duration::from_secs(10),
    )
    .await;
    eprintln!("Redis restart healed in {:?}", t0.elapsed());
    assert!(
        m.says_leader().await,
        "a Redis outage is not a reason to step down"
    );
}

/// A Redis that restarts with its data (AOF here; RDB the same) keeps the task registry, so
/// the leader would find a meta missing from it only at the task's next roll call — its fence
/// refresh, 150 s apart with `--fence-stale-after 10m`, or its window's step (one-hour
/// slices). The server's new `run_id` makes the next tick probe every task instead, and heal
/// what is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restarted_with_its_data_has_every_task_probed() {
    let ns = unique_ns("runid");
    let keys = Keys::new(&ns).unwrap();
    let mut redis_srv =
        RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let mut opts = ManagerOpts::new(&shared_etcd(), &redis_srv.url(), &ns, "n0");
    opts.extra = ["--fence-stale-after", "10m"].map(String::from).to_vec();
    let m = Manager::start(opts).await;
    m.wait_leader().await;
    let (s, v) = m
        .put(
            "/api/v1/tasks/r",
            r#"{"threshold": 10, "slice_ms": 3600000}"#,
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let mut conn = redis_conn(&redis_srv.url());
    wait_meta(
        &mut conn,
        &keys,
        "r",
        "the meta written",
        Duration::from_secs(10),
    )
    .await;
    tokio::time::sleep(TICK * 3).await;
    let probes = m.metric("sluice_roll_probes_total").await.unwrap_or(0.0);
    // The meta goes (kept so by the AOF), then the server restarts with the rest.
    let _: () = redis::cmd("DEL")
        .arg(keys.meta("r"))
        .query(&mut conn)
        .unwrap();
    redis_srv.kill();
    redis_srv.restart();
    let mut conn = redis_conn(&redis_srv.url());
    let registry: bool = redis::cmd("EXISTS")
        .arg(keys.task_registry())
        .query(&mut conn)
        .unwrap();
    assert!(registry, "the registry survived the restart");
    wait_meta(
        &mut conn,
        &keys,
        "r",
        "the meta healed after the restart",
        Duration::from_secs(10),
    )
    .await;
    let after = m.metric("sluice_roll_probes_total").await.unwrap_or(0.0);
    assert!(
        after > probes,
        "no probe after the restart: {probes} -> {after}"
    );
}

/// Found by the deterministic simulation (docs/simulation.md, seed 105 of its first worlds): a
/// Redis restarted from a dump taken before a task was deleted holds the task's live meta
/// again. The leader, seeing a new `run_id`, walks the task registry again, as a new
/// leadership does, and retires it again — before, the deleted task was served on (a
/// concurrency task's leases granted on its old threshold) until a new leader was elected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_deleted_then_restored_from_an_older_dump_is_retired_again() {
    let ns = unique_ns("redump");
    let keys = Keys::new(&ns).unwrap();
    let mut redis_srv = RedisServer::start();
    let m = Manager::start(ManagerOpts::new(
        &shared_etcd(),
        &redis_srv.url(),
        &ns,
        "n0",
    ))
    .await;
    m.wait_leader().await;
    // Another task stays (the leader still rolls; with no task left: the next test).
    for name in ["gone", "kept"] {
        let (s, v) = m
            .put(&format!("/api/v1/tasks/{name}"), r#"{"threshold": 10}"#)
            .await;
        assert_eq!(s, 201, "{v}");
    }
    let mut conn = redis_conn(&redis_srv.url());
    wait_meta(
        &mut conn,
        &keys,
        "gone",
        "the meta written",
        Duration::from_secs(10),
    )
    .await;
    wait_meta(
        &mut conn,
        &keys,
        "kept",
        "the meta written",
        Duration::from_secs(10),
    )
    .await;
    // The dump a restart will come back with: the task alive.
    let _: () = redis::cmd("SAVE").query(&mut conn).unwrap();
    assert_eq!(m.delete("/api/v1/tasks/gone").await, 204);
    wait_retired(&mut conn, &keys, "gone", Duration::from_secs(10)).await;
    // The API tombstones the meta itself; the leader's roller forgets the task at its next
    // tick (its own retire): wait until it has, or the restart below would meet a roller
    // that still remembers the task (and retires it without walking the registry).
    wait_for_log(&m.proc, ROLLER_RETIRED, Duration::from_secs(10)).await;
    redis_srv.kill();
    redis_srv.restart();
    let mut conn = redis_conn(&redis_srv.url());
    // The restart came back with the dump's live meta; the leader walks the registry again and
    // finds it (this line is logged only for a live meta of its own epoch).
    wait_for_log(&m.proc, WALK_RETIRES, Duration::from_secs(15)).await;
    wait_retired(&mut conn, &keys, "gone", Duration::from_secs(15)).await;
}

/// The roller's line for a task it retired.
const ROLLER_RETIRED: &str = "task deleted: meta retired";
/// The registry walk's line for a live meta of a task etcd does not have.
const WALK_RETIRES: &str =
    "task in Redis but not in etcd (deleted while no leader ran): retiring it";

/// Waits until `task`'s meta is a tombstone.
async fn wait_retired(conn: &mut redis::Connection, keys: &Keys, task: &str, timeout: Duration) {
    let meta = keys.meta(task);
    wait_until(
        &format!("{task}'s meta retired"),
        timeout,
        Duration::from_millis(50),
        || {
            let r: Option<String> = redis::cmd("HGET")
                .arg(&meta)
                .arg(meta_field::RETIRED)
                .query(conn)
                .unwrap();
            async move { r.map(|_| ()) }
        },
    )
    .await
}

/// The same with no task left at all: the leader, rolling nothing, still watches which Redis
/// process answers, and walks the registry again after a restart from an older dump. Before, a
/// leader with no task asked nothing of Redis, never saw the new `run_id`, and the restored
/// task stayed live (the deterministic simulation found it: seed 2048, docs/simulation.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_with_no_task_retires_a_task_restored_from_an_older_dump() {
    let ns = unique_ns("redump0");
    let keys = Keys::new(&ns).unwrap();
    let mut redis_srv = RedisServer::start();
    let m = Manager::start(ManagerOpts::new(
        &shared_etcd(),
        &redis_srv.url(),
        &ns,
        "n0",
    ))
    .await;
    m.wait_leader().await;
    let (s, v) = m.put("/api/v1/tasks/gone", r#"{"threshold": 10}"#).await;
    assert_eq!(s, 201, "{v}");
    let mut conn = redis_conn(&redis_srv.url());
    wait_meta(
        &mut conn,
        &keys,
        "gone",
        "the meta written",
        Duration::from_secs(10),
    )
    .await;
    let _: () = redis::cmd("SAVE").query(&mut conn).unwrap();
    assert_eq!(m.delete("/api/v1/tasks/gone").await, 204);
    // The roller forgets the task at its own retire (then it rolls nothing at all).
    wait_for_log(&m.proc, ROLLER_RETIRED, Duration::from_secs(10)).await;
    wait_retired(&mut conn, &keys, "gone", Duration::from_secs(1)).await;
    redis_srv.kill();
    redis_srv.restart();
    let mut conn = redis_conn(&redis_srv.url());
    // A leader with no task walks the registry again and retires what the dump brought back.
    wait_retired(&mut conn, &keys, "gone", Duration::from_secs(15)).await;
    wait_for_log(&m.proc, WALK_RETIRES, Duration::from_secs(1)).await;
}

/// A task the roller stops remembering while it is still in etcd — here because Redis holds a
/// newer spec version than the leader's snapshot (`StaleSpec`) — and then deleted behind the
/// API's back (so the API's own retire does not run) is retired all the same. Before, it was in
/// no list the roller retires from and stayed live until the next leadership. (The
/// deterministic simulation found the same hole through a refusal, docs/simulation.md.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_forgotten_by_the_roller_and_deleted_in_etcd_is_retired() {
    let ns = unique_ns("forgotten");
    let keys = Keys::new(&ns).unwrap();
    let redis_srv = RedisServer::start();
    let m = Manager::start(ManagerOpts::new(
        &shared_etcd(),
        &redis_srv.url(),
        &ns,
        "n0",
    ))
    .await;
    m.wait_leader().await;
    // `other` moves etcd's revision past `held`'s version.
    for name in ["held", "other"] {
        let (s, v) = m
            .put(&format!("/api/v1/tasks/{name}"), r#"{"threshold": 10}"#)
            .await;
        assert_eq!(s, 201, "{v}");
    }
    let mut conn = redis_conn(&redis_srv.url());
    for name in ["held", "other"] {
        wait_meta(
            &mut conn,
            &keys,
            name,
            "the meta written",
            Duration::from_secs(10),
        )
        .await;
    }
    let v: i64 = redis::cmd("HGET")
        .arg(keys.meta("held"))
        .arg(meta_field::VERSION)
        .query(&mut conn)
        .unwrap();
    // Redis says a newer spec of `held` was written (one etcd holds: `other`'s create is above
    // it): the leader's snapshot lags, it skips the task and forgets it.
    let _: () = redis::cmd("HSET")
        .arg(keys.meta("held"))
        .arg(meta_field::VERSION)
        .arg(v + 1)
        .query(&mut conn)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.metric("sluice_stale_specs_total").await.unwrap_or(0.0) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the leader never met the newer spec"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Deleted behind the API's back (an operator's etcdctl): only the leader retires it.
    let mut etcd = etcd_client::Client::connect([shared_etcd()], None)
        .await
        .expect("etcd");
    let deleted = etcd
        .delete(keys.etcd_task("held"), None)
        .await
        .expect("etcd delete");
    assert_eq!(deleted.deleted(), 1);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let retired: Option<String> = redis::cmd("HGET")
            .arg(keys.meta("held"))
            .arg(meta_field::RETIRED)
            .query(&mut conn)
            .unwrap();
        if retired.is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the forgotten task deleted in etcd was never retired; manager log:\n{}",
            m.proc.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The documented manager ACL (deploy/redis-acl.conf) grants `INFO server`, which the leader
/// reads for the server's `run_id`; an older ACL without it is logged once (a restart that
/// keeps its data is then found task by task) and rolling goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_acl_without_info_is_logged_once_and_rolling_goes_on() {
    let redis_srv = RedisServer::start();
    let mut admin = redis_conn(&redis_srv.url());
    let doc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/redis-acl.conf");
    let text = std::fs::read_to_string(&doc).expect("deploy/redis-acl.conf");
    let line = text
        .lines()
        .find(|l| l.starts_with("user sluice-manager "))
        .expect("the manager's user");
    assert!(line.contains(" +info|server "), "{line}");
    for (user, ns, with_info) in [
        ("documented", "aclinfo", true),
        ("older", "aclnoinfo", false),
    ] {
        let ns = unique_ns(ns);
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg(user);
        for w in line
            .replace("sluice:", &format!("{ns}:"))
            .split_whitespace()
            .skip(2)
        {
            match w {
                ">CHANGE-ME" => {
                    cmd.arg(">pw-acl-info");
                }
                "+info|server" if !with_info => {}
                w => {
                    cmd.arg(w);
                }
            }
        }
        let () = cmd.query(&mut admin).expect("ACL SETUSER");
        let url = redis_srv
            .url()
            .replacen("redis://", &format!("redis://{user}:pw-acl-info@"), 1);
        let m = Manager::start(ManagerOpts::new(&shared_etcd(), &url, &ns, "n0")).await;
        m.wait_leader().await;
        let (s, v) = m.put("/api/v1/tasks/a", r#"{"threshold": 10}"#).await;
        assert_eq!(s, 201, "{v}");
        let mut conn = redis_conn(&redis_srv.url());
        wait_all_present(&mut conn, &ns, "a", "rolled", Duration::from_secs(10)).await;
        // Several ticks, each of which would ask.
        tokio::time::sleep(TICK * 6).await;
        let refused = m.log_count("refuses INFO server");
        assert_eq!(
            refused,
            usize::from(!with_info),
            "{user}: logged {refused} times"
        );
        assert_eq!(m.log_count("roll failed"), 0, "{user}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_threshold_change_applies_by_difference_and_keeps_consumption() {
    let ns = unique_ns("diff");
    let redis_url = shared_redis();
    let keys = Keys::new(&ns).unwrap();
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "n0")).await;
    m.wait_leader().await;
    // Long slices so the current one outlives the test.
    let (s, _) = m
        .put(
            "/api/v1/tasks/d",
            r#"{"threshold": 1000, "slice_ms": 60000}"#,
        )
        .await;
    assert_eq!(s, 201);
    let redis = Redis::new(
        RedisTarget::parse(&redis_url).unwrap(),
        ConnOptions::default(),
    );
    let mut c = redis.conn().await.unwrap();
    let current = slice::start(now_ms(), 60_000);
    if slice::end(current, 60_000) - now_ms() < 15_000 {
        // Too close to the boundary for a stable test: wait for the next slice.
        tokio::time::sleep(Duration::from_millis(
            (slice::end(current, 60_000) - now_ms() + 100) as u64,
        ))
        .await;
    }
    let current = slice::start(now_ms(), 60_000);
    let granted = wait_until(
        "slice exists",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let mut c = c.clone();
            let keys = keys.clone();
            async move {
                match pull_once(&mut c, &keys, "d", current, 60_000, 300)
                    .await
                    .ok()?
                {
                    PullReply::Granted { granted, .. } => Some(granted),
                    _ => None,
                }
            }
        },
    )
    .await;
    assert_eq!(granted, 300);

    let (s, v) = m
        .put(
            "/api/v1/tasks/d",
            r#"{"threshold": 1500, "slice_ms": 60000}"#,
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let cap_rem = || {
        let mut c = c.clone();
        let key = keys.slice("d", current);
        async move {
            redis::cmd("HMGET")
                .arg(&key)
                .arg(slice_field::CAP)
                .arg(slice_field::REM)
                .query_async::<(i64, i64)>(&mut c)
                .await
                .ok()
        }
    };
    let rem = wait_until(
        "cap raised",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async {
            let (cap, rem) = cap_rem().await?;
            (cap == 1500).then_some(rem)
        },
    )
    .await;
    assert_eq!(rem, 1500 - 300, "consumption is kept across the change");

    // Lowering below what was consumed leaves nothing to grant.
    let (s, _) = m
        .put(
            "/api/v1/tasks/d",
            r#"{"threshold": 200, "slice_ms": 60000}"#,
        )
        .await;
    assert_eq!(s, 200);
    wait_until(
        "cap lowered",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async {
            let (cap, rem) = cap_rem().await?;
            (cap == 200 && rem == -100).then_some(())
        },
    )
    .await;
    match pull_once(&mut c, &keys, "d", current, 60_000, 10)
        .await
        .unwrap()
    {
        PullReply::Granted {
            granted,
            remaining,
            cap,
            ..
        } => {
            assert_eq!((granted, remaining, cap), (0, -100, 200));
        }
        other => panic!("{other:?}"),
    }
    // The status endpoint reports it.
    let v = m.get_json("/api/v1/tasks/d").await.unwrap();
    assert_eq!(v["status"]["effective_threshold"], 200);
    assert_eq!(v["status"]["remaining"], -100);
    assert_eq!(v["status"]["current_slice_ms"], current);
    assert!(v["status"]["horizon_until_ms"].as_i64().unwrap() >= now_ms() + 59_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_schedules_set_the_threshold_of_matching_slices() {
    let ns = unique_ns("cron");
    let redis_url = shared_redis();
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "n0")).await;
    m.wait_leader().await;
    // Even seconds get 20, seconds divisible by 10 get 30 (later entries win), others 10.
    let (s, v) = m
        .put(
            "/api/v1/tasks/c",
            r#"{"threshold": 10, "schedules": [
                {"cron": "*/2 * * * * *", "threshold": 20},
                {"cron": "*/10 * * * * *", "threshold": 30}]}"#,
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let mut conn = redis_conn(&redis_url);
    let caps = wait_until(
        "scheduled slices",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let now = now_ms();
            let caps = slice_caps(&mut conn, &ns, "c", 1000, now, now + 30_000);
            async move { caps.iter().all(|(_, c)| c.is_some()).then_some(caps) }
        },
    )
    .await;
    for (start, cap) in caps {
        let sec = (start / 1000) % 60;
        let want = if sec % 10 == 0 {
            30
        } else if sec % 2 == 0 {
            20
        } else {
            10
        };
        assert_eq!(cap, Some(want), "slice {start} (second {sec})");
    }
}

/// A schedule entry in a time zone: its window is read on that zone's wall clock. Asia/Kathmandu
/// is UTC+05:45 all year (no DST since 1986), so the test computes the local hour by hand,
/// independently of the manager's tz database, and the same cron read in UTC would not match.
/// A bad zone is a 400 naming the field that changes nothing; a GET answer PUT back keeps the
/// zone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zoned_schedule_sets_the_threshold_on_that_zones_clock() {
    const OFFSET_MS: i64 = (5 * 60 + 45) * 60_000;
    let ns = unique_ns("tz");
    let redis_url = shared_redis();
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "n0")).await;
    m.wait_leader().await;
    // The current local hour and the next: the window lasts at least an hour from now.
    let hour = (now_ms() + OFFSET_MS).rem_euclid(86_400_000) / 3_600_000;
    let next = (hour + 1) % 24;
    let cron = format!("* * {hour},{next} * * *");
    let utc_hour = now_ms().rem_euclid(86_400_000) / 3_600_000;
    assert!(
        utc_hour != hour && utc_hour != next,
        "read in UTC the window would not match"
    );
    eprintln!("Asia/Kathmandu hours {hour},{next}; UTC hour {utc_hour}");
    let body = json!({"threshold": 10, "schedules": [
        {"cron": cron, "threshold": 20, "timezone": "Asia/Kathmandu"},
        {"cron": cron, "threshold": 30}]})
    .to_string();
    let (s, v) = m.put("/api/v1/tasks/z", &body).await;
    assert_eq!(s, 201, "{v}");
    let mut conn = redis_conn(&redis_url);
    let all_at = |conn: &mut redis::Connection, cap: u64| {
        let now = now_ms();
        let caps = slice_caps(conn, &ns, "z", 1000, now, now + 30_000);
        caps.iter().all(|(_, c)| *c == Some(cap)).then_some(caps)
    };
    let caps = wait_until(
        "zoned slices at 20",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let r = all_at(&mut conn, 20);
            async move { r }
        },
    )
    .await;
    assert!(caps.len() >= 30, "{caps:?}");
    let got = m.get_json("/api/v1/tasks/z").await.unwrap();
    assert_eq!(got["schedules"][0]["timezone"], "Asia/Kathmandu");
    assert!(
        got["schedules"][1].get("timezone").is_none(),
        "UTC is not returned: {got}"
    );
    let version = got["version"].as_i64().unwrap();

    // A bad zone: 400 naming the field, the spec and the slices unchanged.
    let bad = json!({"threshold": 10, "version": version, "schedules": [
        {"cron": cron, "threshold": 20, "timezone": "Asia/Kathmandu"},
        {"cron": "* * * * * *", "threshold": 40, "timezone": "Europe/Berln"}]})
    .to_string();
    let (s, v) = m.put("/api/v1/tasks/z", &bad).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["field"], "schedules[1].timezone", "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains(r#"unknown IANA time zone "Europe/Berln""#),
        "{v}"
    );
    let after = m.get_json("/api/v1/tasks/z").await.unwrap();
    assert_eq!(after["version"], version);
    assert_eq!(after["schedules"], got["schedules"]);
    // The leader has rolled since (a slice past the last one written at the 400 exists) and
    // still writes 20.
    let last_written = |conn: &mut redis::Connection| {
        let now = now_ms();
        slice_caps(conn, &ns, "z", 1000, now, now + 600_000)
            .iter()
            .filter(|(_, c)| c.is_some())
            .map(|(start, _)| *start)
            .max()
            .unwrap()
    };
    let at_400 = last_written(&mut conn);
    wait_until(
        "the leader to roll past the refused PUT",
        // The window grows in steps of 10 s (issue 27): the next one comes within a step.
        Duration::from_secs(15),
        Duration::from_millis(50),
        || {
            let r = (last_written(&mut conn) > at_400).then_some(());
            async move { r }
        },
    )
    .await;
    assert!(
        all_at(&mut conn, 20).is_some(),
        "slices changed after a 400"
    );

    // The GET answer PUT back as it is: accepted, the zone kept, the slices unchanged.
    let (s, v) = m.put("/api/v1/tasks/z", &got.to_string()).await;
    assert_eq!(s, 200, "{v}");
    let again = m.get_json("/api/v1/tasks/z").await.unwrap();
    assert_eq!(again["schedules"], got["schedules"]);
    assert!(all_at(&mut conn, 20).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_task_retires_its_meta_but_keeps_the_fence() {
    let ns = unique_ns("del");
    let redis_url = shared_redis();
    let keys = Keys::new(&ns).unwrap();
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "n0")).await;
    m.wait_leader().await;
    let term = m.metric("sluice_term").await.unwrap() as i64;
    let _ = m.put("/api/v1/tasks/x", r#"{"threshold": 10}"#).await;
    let mut conn = redis_conn(&redis_url);
    wait_until(
        "meta",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let t: Option<String> = redis::cmd("HGET")
                .arg(keys.meta("x"))
                .arg(meta_field::THRESHOLD)
                .query(&mut conn)
                .unwrap();
            async move { t.map(|_| ()) }
        },
    )
    .await;
    assert_eq!(m.delete("/api/v1/tasks/x").await, 204);
    assert_eq!(m.delete("/api/v1/tasks/x").await, 404);
    assert!(m.get_json("/api/v1/tasks/x").await.is_none());
    let meta: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.meta("x"))
        .query(&mut conn)
        .unwrap();
    let retired_at: i64 = meta
        .get("retired")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    assert!(
        retired_at > 0,
        "the tombstone records the deletion revision: {meta:?}"
    );
    assert_eq!(meta.get("term"), Some(&term.to_string()));
    assert!(!meta.contains_key("threshold"));
    let ttl: i64 = redis::cmd("PTTL")
        .arg(keys.meta("x"))
        .query(&mut conn)
        .unwrap();
    assert!(ttl > 0, "the tombstone expires");
    // Re-creating the task brings it back.
    let (s, _) = m.put("/api/v1/tasks/x", r#"{"threshold": 11}"#).await;
    assert_eq!(s, 201);
    wait_until(
        "meta back",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let t: Option<String> = redis::cmd("HGET")
                .arg(keys.meta("x"))
                .arg(meta_field::THRESHOLD)
                .query(&mut conn)
                .unwrap();
            async move { (t.as_deref() == Some("11")).then_some(()) }
        },
    )
    .await;
}

/// Issue 27: an eager task with nothing new to write is not probed at all between its roll
/// calls (a step of its window, its fence refresh every `--fence-stale-after / 4`), and a task
/// whose window moves without slices (mode `concurrency`) is not mistaken for a lost one —
/// before an earlier review's fix its `rolled_to` was skipped by the probe and the task was
/// "healed" (rewritten whole) every slice. What a probe would have found (here: a meta
/// deleted behind the leader's back while the registry stays) is healed by the next roll call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_eager_tasks_are_not_probed_never_rewritten_and_healed_by_their_refresh() {
    let ns = unique_ns("probe");
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&shared_redis());
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    m.wait_leader().await;
    for (name, body) in [
        ("short", r#"{"threshold": 10, "slice_ms": 1000}"#),
        ("long", r#"{"threshold": 10, "slice_ms": 60000}"#),
        ("permits", r#"{"threshold": 10, "mode": "concurrency"}"#),
    ] {
        let (s, v) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
        assert_eq!(s, 201, "{name}: {v}");
    }
    // Written, and the tick that registered them (the registry was missing then) past.
    for name in ["short", "long", "permits"] {
        wait_meta(
            &mut conn,
            &keys,
            name,
            "the meta written",
            Duration::from_secs(10),
        )
        .await;
    }
    tokio::time::sleep(TICK * 3).await;
    let probes = m.metric("sluice_roll_probes_total").await.unwrap_or(0.0);
    // Several ticks (500 ms), slice boundaries of the 1 s grid, and at least two fence
    // refreshes (every 2.5 s), each of which moves the concurrency task's window.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        m.log_count("rewrote tasks that Redis had lost"),
        0,
        "a task with nothing lost was rewritten whole"
    );
    let after = m.metric("sluice_roll_probes_total").await.unwrap_or(0.0);
    assert_eq!(after, probes, "eager tasks were probed");

    // A meta lost while the registry stays: rewritten by the task's next roll call, within a
    // fence refresh period (2.5 s) and a tick.
    let t0 = Instant::now();
    let _: () = redis::cmd("DEL")
        .arg(keys.meta("long"))
        .query(&mut conn)
        .unwrap();
    // A fence refresh period, a tick and the tick's work, with room for a loaded machine.
    wait_meta(
        &mut conn,
        &keys,
        "long",
        "the lost meta rewritten",
        Duration::from_secs(6),
    )
    .await;
    eprintln!("a lost meta healed in {:?}", t0.elapsed());
    // Logged once the tick that healed it ends.
    wait_until(
        "the heal logged",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let n = m.log_count("rewrote tasks that Redis had lost");
            async move { (n >= 1).then_some(()) }
        },
    )
    .await;
}
