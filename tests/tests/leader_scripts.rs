//! The leader scripts against a real Redis: the fence rule (epochs, stale fences, legacy
//! meta), stale specs, expiry extension, RETIRE deleting a task's state, the scripts that
//! refuse a deleted task, and pruning `NS:hosts`.

use std::time::Duration;

use sluice_protocol::conn::{ConnOptions, Redis, RedisConn, RedisTarget};
use sluice_protocol::scripts::{
    self, AdjustOutcome, Fence, FenceRefusal, RecordOutcome, RetireOutcome, RingWrites,
    RollOutcome, RollRequest, SliceWrite,
};
use sluice_protocol::{Fallback, Keys, Mode, OnFailure, TaskMeta, meta_field};
use sluice_tests::*;

async fn conn() -> RedisConn {
    let target = RedisTarget::parse(&shared_redis()).expect("redis url");
    Redis::new(target, ConnOptions::default())
        .conn()
        .await
        .expect("connect to the shared Redis")
}

fn meta(version: i64) -> TaskMeta {
    TaskMeta {
        slice_ms: 1000,
        threshold: 10,
        pull: 0,
        local_limit: 10,
        on_failure: OnFailure::Local,
        mode: Mode::Pooled,
        fallback: Fallback::default(),
        version,
        lease_ms: 0,
        keyed: false,
        key_overrides: Default::default(),
        shadow: false,
        pacing: sluice_protocol::Pacing::None,
        pace_burst: 0,
    }
}

fn fence(term: i64, epoch: u64, stale_after_ms: u64) -> Fence {
    Fence {
        term,
        epoch,
        stale_after_ms,
    }
}

/// Slices from `start`, one second each, all at `cap`, expiring `expire_after` their end.
fn slices(start: i64, n: i64, cap: u64, expire_after: i64) -> Vec<SliceWrite> {
    (0..n)
        .map(|i| SliceWrite {
            start_ms: start + i * 1000,
            cap,
            expire_at_ms: start + (i + 1) * 1000 + expire_after,
        })
        .collect()
}

/// A full roll of `task` with spec version `version` and slices at `cap`.
async fn roll(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    f: &Fence,
    version: i64,
    cap: u64,
    force: bool,
) -> RollOutcome {
    let start = now_ms() / 1000 * 1000;
    let s = slices(start, 5, cap, 60_000);
    let m = meta(version);
    let req = RollRequest {
        task,
        fence: f,
        full: true,
        expect_rolled_to: 0,
        spec_version: version,
        new_rolled_to: start + 5_000,
        force,
        refresh: true,
        meta: Some(&m),
        meta_extra: &[],
        slices: &s,
        lazy: None,
    };
    scripts::roll(c, keys, &req).await.expect("roll")
}

fn caps(ns: &str, task: &str) -> Vec<Option<u64>> {
    let mut c = redis_conn(&shared_redis());
    let now = now_ms();
    slice_caps(&mut c, ns, task, 1000, now, now + 4_000)
        .into_iter()
        .map(|(_, c)| c)
        .collect()
}

#[tokio::test]
async fn the_fence_refuses_a_live_foreign_epoch_and_takes_over_a_stale_one() {
    let ns = unique_ns("fencescript");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let a = fence(5_000, 111, 400);
    assert_eq!(
        roll(&mut c, &keys, "t", &a, 10, 100, false).await,
        RollOutcome::Written(5)
    );
    // Another epoch with a lower term: refused as foreign while A's fence is fresh …
    let b = fence(7, 222, 400);
    match roll(&mut c, &keys, "t", &b, 3, 200, false).await {
        RollOutcome::Refused(FenceRefusal::Foreign {
            epoch,
            term,
            age_ms,
        }) => {
            assert_eq!((epoch.as_str(), term), ("111", 5_000));
            assert!((0..400).contains(&age_ms), "{age_ms}");
        }
        other => panic!("{other:?}"),
    }
    // … and with a higher term too: terms of different epochs are not compared.
    let b_high = fence(9_999, 222, 400);
    assert!(matches!(
        roll(&mut c, &keys, "t", &b_high, 3, 200, false).await,
        RollOutcome::Refused(FenceRefusal::Foreign { .. })
    ));
    assert!(caps(&ns, "t").iter().all(|c| *c == Some(100)));
    // A newer term of A's epoch: the classic fence.
    let a_old = fence(4_000, 111, 400);
    assert!(matches!(
        roll(&mut c, &keys, "t", &a_old, 10, 300, false).await,
        RollOutcome::Refused(FenceRefusal::Newer { term: 5_000, .. })
    ));
    // Once A stopped writing for the stale period, B takes over — even with an older spec
    // version (versions of another epoch are not comparable).
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(
        roll(&mut c, &keys, "t", &b, 3, 200, false).await,
        RollOutcome::Written(5)
    );
    assert!(caps(&ns, "t").iter().all(|c| *c == Some(200)));
    let mut sync = redis_conn(&shared_redis());
    let m = meta_fields(&mut sync, &ns, "t");
    assert_eq!(m[meta_field::EPOCH], "222");
    assert_eq!(m[meta_field::TERM], "7");
    assert_eq!(m[meta_field::VERSION], "3");
    // And now A is the foreign one.
    assert!(matches!(
        roll(&mut c, &keys, "t", &a, 10, 100, false).await,
        RollOutcome::Refused(FenceRefusal::Foreign { .. })
    ));
}

#[tokio::test]
async fn a_stale_fence_of_the_same_epoch_is_taken_over_and_legacy_meta_is_comparable() {
    let ns = unique_ns("fencestale");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    // etcd restored: the same epoch, terms went back.
    let before = fence(20_000, 1, 300);
    assert!(matches!(
        roll(&mut c, &keys, "t", &before, 19_000, 100, false).await,
        RollOutcome::Written(_)
    ));
    let after = fence(40, 1, 300);
    assert!(matches!(
        roll(&mut c, &keys, "t", &after, 30, 200, false).await,
        RollOutcome::Refused(FenceRefusal::Newer { term: 20_000, .. })
    ));
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(matches!(
        roll(&mut c, &keys, "t", &after, 30, 200, false).await,
        RollOutcome::Written(_)
    ));
    assert!(caps(&ns, "t").iter().all(|c| *c == Some(200)));

    // Meta written before epochs existed (term only): same-epoch rules, and a fence nobody
    // ever refreshed counts as stale.
    let mut sync = redis_conn(&shared_redis());
    let _: () = redis::cmd("HSET")
        .arg(keys.meta("legacy"))
        .arg("term")
        .arg(50)
        .arg("rolled_to")
        .arg(0)
        .arg("slice_ms")
        .arg(1000)
        .query(&mut sync)
        .unwrap();
    let f = fence(60, 1, 10_000);
    assert!(matches!(
        roll(&mut c, &keys, "legacy", &f, 5, 100, false).await,
        RollOutcome::Written(_)
    ));
    let m = meta_fields(&mut sync, &ns, "legacy");
    assert_eq!((m["term"].as_str(), m["epoch"].as_str()), ("60", "1"));
    assert!(m["fenced_ms"].parse::<i64>().unwrap() > 0);
}

#[tokio::test]
async fn an_older_spec_version_is_refused_within_one_epoch() {
    let ns = unique_ns("stalespec");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let f = fence(100, 1, 10_000);
    assert!(matches!(
        roll(&mut c, &keys, "t", &f, 10, 100, false).await,
        RollOutcome::Written(_)
    ));
    // A newer leader with a lagging snapshot (version 9) writes nothing.
    let newer = fence(101, 1, 10_000);
    assert_eq!(
        roll(&mut c, &keys, "t", &newer, 9, 50, false).await,
        RollOutcome::StaleSpec { stored_version: 10 }
    );
    assert!(caps(&ns, "t").iter().all(|c| *c == Some(100)));
    let mut sync = redis_conn(&shared_redis());
    let m = meta_fields(&mut sync, &ns, "t");
    assert_eq!((m["version"].as_str(), m["term"].as_str()), ("10", "100"));
    // The same version is fine (a replay), and so is a forced write (numbers of another etcd
    // history).
    assert!(matches!(
        roll(&mut c, &keys, "t", &newer, 10, 100, false).await,
        RollOutcome::Written(_)
    ));
    assert!(matches!(
        roll(&mut c, &keys, "t", &newer, 9, 50, true).await,
        RollOutcome::Written(_)
    ));
    assert!(caps(&ns, "t").iter().all(|c| *c == Some(50)));
}

#[tokio::test]
async fn an_existing_slice_key_gets_the_later_expiry_never_an_earlier_one() {
    let ns = unique_ns("expiry");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let f = fence(1, 1, 10_000);
    let start = now_ms() / 1000 * 1000 + 10_000;
    let m = meta(1);
    let write = |exp_after: i64| {
        vec![SliceWrite {
            start_ms: start,
            cap: 10,
            expire_at_ms: start + 2_000 + exp_after,
        }]
    };
    let pttl = |c: &mut redis::Connection| -> i64 {
        redis::cmd("PTTL")
            .arg(keys.slice("t", start))
            .query(c)
            .unwrap()
    };
    let mut sync = redis_conn(&shared_redis());
    for (i, exp_after) in [5_000, 60_000, 20_000].into_iter().enumerate() {
        let s = write(exp_after);
        let req = RollRequest {
            task: "t",
            fence: &f,
            full: true,
            expect_rolled_to: 0,
            spec_version: 1,
            new_rolled_to: start + 2_000,
            force: false,
            refresh: false,
            meta: Some(&m),
            meta_extra: &[],
            slices: &s,
            lazy: None,
        };
        let out = scripts::roll(&mut c, &keys, &req).await.unwrap();
        assert_eq!(out, RollOutcome::Written(u64::from(i == 0)));
        let ttl = pttl(&mut sync);
        let wanted = start + 2_000 + exp_after.max(if i == 2 { 60_000 } else { 0 }) - now_ms();
        assert!(
            (wanted - 1_000..=wanted + 50).contains(&ttl),
            "round {i}: pttl {ttl}, wanted ≈ {wanted}"
        );
    }
}

#[tokio::test]
async fn retire_deletes_the_task_state_and_respects_a_recreation() {
    let ns = unique_ns("retire");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let mut sync = redis_conn(&shared_redis());
    let f = fence(7, 1, 10_000);
    assert!(matches!(
        roll(&mut c, &keys, "t", &f, 20, 100, false).await,
        RollOutcome::Written(_)
    ));
    let state = scripts::task_state_keys(&keys, "t");
    for k in &state {
        let _: () = redis::cmd("SET").arg(k).arg("x").query(&mut sync).unwrap();
    }
    // A deletion older than the stored spec (the task was re-created since): refused.
    assert_eq!(
        scripts::retire(&mut c, &keys, "t", &f, 60_000, 19, false)
            .await
            .unwrap(),
        RetireOutcome::Superseded { stored_version: 20 }
    );
    assert!(!meta_fields(&mut sync, &ns, "t").contains_key(meta_field::RETIRED));
    assert_eq!(
        scripts::retire(&mut c, &keys, "t", &f, 60_000, 21, false)
            .await
            .unwrap(),
        RetireOutcome::Retired
    );
    let m = meta_fields(&mut sync, &ns, "t");
    assert_eq!(m[meta_field::RETIRED], "21");
    assert_eq!(m[meta_field::TERM], "7");
    assert_eq!(m[meta_field::EPOCH], "1");
    assert_eq!(m.len(), 4, "a tombstone keeps only the fence: {m:?}");
    for k in &state {
        let n: i64 = redis::cmd("EXISTS").arg(k).query(&mut sync).unwrap();
        assert_eq!(n, 0, "{k} survived RETIRE");
    }
    // Nothing brings the state back while the task is retired.
    let adj = scripts::adjust(
        &mut c,
        &keys,
        "t",
        &f,
        false,
        &[("current", "5".into())],
        Some("{}"),
        10,
    )
    .await
    .unwrap();
    assert_eq!(adj, AdjustOutcome::NoTask);
    let k1 = keys.history("t", "1s");
    let k2 = keys.history("t", "1m");
    let w = vec![(0_i64, vec![1_u8; 32])];
    let rec = scripts::record_history(
        &mut c,
        &keys,
        "t",
        &f,
        RingWrites {
            key: &k1,
            ttl_ms: 10_000,
            writes: &w,
        },
        RingWrites {
            key: &k2,
            ttl_ms: 10_000,
            writes: &[],
        },
    )
    .await
    .unwrap();
    assert_eq!(rec, RecordOutcome::NoTask);
    for k in [keys.dynamic_state("t"), keys.adjustments("t"), k1] {
        let n: i64 = redis::cmd("EXISTS").arg(&k).query(&mut sync).unwrap();
        assert_eq!(n, 0, "{k} came back");
    }
}

#[tokio::test]
async fn prune_hosts_deletes_only_entries_still_stale() {
    let ns = unique_ns("prunescript");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let mut sync = redis_conn(&shared_redis());
    let now = now_ms();
    let _: () = redis::cmd("HSET")
        .arg(keys.hosts())
        .arg("stale")
        .arg(host_report_json(now - 700_000, 0.0))
        .arg("fresh")
        .arg(host_report_json(now - 1_000, 0.0))
        // Its clock is 15 minutes behind: its own seen_ms looks old, but it reported just now.
        .arg("lagging-clock")
        .arg(host_report_json(now - 900_000, -900_000.0))
        .arg("garbage")
        .arg("{")
        .query(&mut sync)
        .unwrap();
    let all: Vec<String> = ["stale", "fresh", "lagging-clock", "garbage", "absent"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let n = scripts::prune_hosts(&mut c, &keys, 600_000, &all)
        .await
        .unwrap();
    assert_eq!(n, 2);
    let mut left: Vec<String> = redis::cmd("HKEYS")
        .arg(keys.hosts())
        .query(&mut sync)
        .unwrap();
    left.sort();
    assert_eq!(left, ["fresh", "lagging-clock"]);
}

/// The roller's probe call with no slices, meta or refresh: what the script answers.
async fn script_probe(
    c: &mut RedisConn,
    keys: &Keys,
    task: &str,
    f: &Fence,
    expect: i64,
    version: i64,
) -> RollOutcome {
    let req = RollRequest {
        task,
        fence: f,
        full: false,
        expect_rolled_to: expect,
        spec_version: version,
        new_rolled_to: expect,
        force: false,
        refresh: false,
        meta: None,
        meta_extra: &[],
        slices: &[],
        lazy: None,
    };
    scripts::roll(c, keys, &req)
        .await
        .expect("roll probe script")
}

/// `roll_probe` (one HMGET) says "nothing to do" only where the script's probe call would
/// answer `Written(0)` and write nothing; everything else (a lost, rewound, retired,
/// re-fenced, foreign or newer meta, a field that does not parse) goes to the script.
#[tokio::test]
async fn the_cheap_probe_answers_only_where_the_script_would_write_nothing() {
    let ns = unique_ns("probe");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let mut sync = redis_conn(&shared_redis());
    let f = fence(100, 7, 10_000);
    let start = now_ms() / 1000 * 1000;
    let rolled_to = start + 5_000;
    let setup = async |c: &mut RedisConn| {
        assert!(matches!(
            roll(c, &keys, "t", &f, 10, 100, true).await,
            RollOutcome::Written(_)
        ));
    };
    // (what, the meta field set after a full roll — `None` as the field: the meta deleted —,
    // the probe's term and epoch, its expected rolled_to less the written one, its spec
    // version, what the probe must say)
    type Case<'a> = (
        &'a str,
        Option<(Option<&'a str>, &'a str)>,
        i64,
        u64,
        i64,
        i64,
        bool,
    );
    let cases: Vec<Case> = vec![
        ("as written", None, 100, 7, 0, 10, true),
        ("an older spec version held", None, 100, 7, 0, 11, true),
        (
            "rolled further than expected",
            None,
            100,
            7,
            -1_000,
            10,
            true,
        ),
        (
            "rewound (an older snapshot)",
            None,
            100,
            7,
            1_000,
            10,
            false,
        ),
        ("a newer spec version stored", None, 100, 7, 0, 9, false),
        ("a new term of this epoch", None, 101, 7, 0, 10, false),
        ("another epoch", None, 100, 8, 0, 10, false),
        ("the meta lost", Some((None, "")), 100, 7, 0, 10, false),
        (
            "retired",
            Some((Some("retired"), "11")),
            100,
            7,
            0,
            10,
            false,
        ),
        (
            "rolled_to that does not parse",
            Some((Some("rolled_to"), "x")),
            100,
            7,
            0,
            10,
            false,
        ),
        (
            "a version that does not parse",
            Some((Some("version"), "1e3")),
            100,
            7,
            0,
            10,
            false,
        ),
    ];
    for (what, edit, term, epoch, delta, version, says) in cases {
        let (pf, expect) = (fence(term, epoch, 10_000), rolled_to + delta);
        setup(&mut c).await;
        // `expect` was computed against the window's end at the start; a second boundary may
        // have passed since (the review's flake): move it with what the roll wrote.
        let written: i64 = meta_fields(&mut sync, &ns, "t")["rolled_to"]
            .parse()
            .expect("rolled_to");
        let expect = expect + (written - rolled_to);
        let meta_key = keys.meta("t");
        match edit {
            None => {}
            Some((None, _)) => {
                let _: () = redis::cmd("DEL").arg(&meta_key).query(&mut sync).unwrap();
            }
            Some((Some(field), value)) => {
                let _: () = redis::cmd("HSET")
                    .arg(&meta_key)
                    .arg(field)
                    .arg(value)
                    .query(&mut sync)
                    .unwrap();
            }
        }
        let got = scripts::roll_probe(&mut c, &keys, "t", &pf, expect, version, None, &[])
            .await
            .expect("probe")
            .vouch;
        assert_eq!(got, says, "{what}");
        if got {
            // The script agrees: nothing written, nothing to do.
            let before = meta_fields(&mut sync, &ns, "t");
            let out = script_probe(&mut c, &keys, "t", &pf, expect, version).await;
            assert_eq!(out, RollOutcome::Written(0), "{what}");
            assert_eq!(
                meta_fields(&mut sync, &ns, "t"),
                before,
                "{what}: the script wrote"
            );
        }
    }
}

/// A lazy task's refresh is its probe too (issue 27): `roll_watching` sends the `EXISTS` of
/// the watched slices and the roll in one round trip, the `EXISTS` first (a slice the roll
/// itself writes is not "made by a worker"), and recovers from a Redis that lost its scripts.
/// Its own Redis: `SCRIPT FLUSH` would disturb the other tests on the shared one.
#[tokio::test]
async fn a_roll_that_watches_sees_only_slices_that_were_there_before_it() {
    let server = RedisServer::start();
    let keys = Keys::new(&unique_ns("watch")).unwrap();
    let target = RedisTarget::parse(&server.url()).expect("redis url");
    let mut c = Redis::new(target, ConnOptions::default())
        .conn()
        .await
        .expect("connect");
    let mut admin = server.admin_conn();
    let f = fence(100, 7, 10_000);
    assert_eq!(
        roll(&mut c, &keys, "t", &f, 10, 100, false).await,
        RollOutcome::Written(5)
    );
    // What the roll stored (read back: a second boundary may pass between its clock and ours).
    let rolled_to: i64 = redis::cmd("HGET")
        .arg(keys.meta("t"))
        .arg(meta_field::ROLLED_TO)
        .query(&mut admin)
        .unwrap();
    let start = rolled_to - 5_000;
    let refresh = |new_rolled_to: i64, s: &'static [SliceWrite]| RollRequest {
        task: "t",
        fence: &f,
        full: false,
        expect_rolled_to: rolled_to,
        spec_version: 10,
        new_rolled_to,
        force: false,
        refresh: true,
        meta: None,
        meta_extra: &[],
        slices: s,
        lazy: None,
    };
    let watched = [start + 8_000, start + 9_000];
    let run = async |c: &mut RedisConn, req: &RollRequest<'_>, made: &[i64]| {
        scripts::roll_watching(c, &keys, req, made)
            .await
            .expect("roll_watching")
    };
    assert_eq!(
        run(&mut c, &refresh(rolled_to, &[]), &watched).await,
        (RollOutcome::Written(0), false),
        "nothing made"
    );
    // A worker made one of them.
    let _: () = redis::cmd("HSET")
        .arg(keys.slice("t", start + 9_000))
        .arg("cap")
        .arg(100)
        .arg("rem")
        .arg(99)
        .query(&mut admin)
        .unwrap();
    assert_eq!(
        run(&mut c, &refresh(rolled_to, &[]), &watched).await,
        (RollOutcome::Written(0), true)
    );
    // Redis lost its scripts: loaded again, the whole round trip resent.
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut admin).unwrap();
    assert_eq!(
        run(&mut c, &refresh(rolled_to, &[]), &watched).await,
        (RollOutcome::Written(0), true),
        "after SCRIPT FLUSH"
    );
    // A slice the roll itself writes is not one a worker made: the EXISTS goes first.
    let s = slices(rolled_to, 1, 100, 60_000);
    let writes = RollRequest {
        new_rolled_to: rolled_to + 1_000,
        slices: &s,
        ..refresh(rolled_to, &[])
    };
    assert_eq!(
        run(&mut c, &writes, &[rolled_to]).await,
        (RollOutcome::Written(1), false)
    );
    // Nothing watched: the plain roll (no EXISTS sent), refused as any roll would be.
    let rewound = RollRequest {
        expect_rolled_to: rolled_to + 2_000,
        ..refresh(rolled_to + 2_000, &[])
    };
    assert_eq!(
        run(&mut c, &rewound, &[]).await,
        (RollOutcome::NeedFull, false),
    );
}
