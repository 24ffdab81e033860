//! Faults end to end: Redis dies under load and comes back.
//!
//! Two hosts (2 `loadgen` processes each, 400 decisions/s per process, below the threshold so
//! both hosts pull continuously) use one task (threshold 2,000 per 1 s slice, `local_limit`
//! 300, `on_failure: local`) on a private Redis. The test SIGKILLs Redis and checks that
//! every host turns FAILED within one pull timeout, that each host then admits its
//! `local_limit` per slice (±10 %), that no decision errs or stalls, and that after Redis is
//! back (and the manager has rewritten the slices) every host is NORMAL within the probe
//! interval.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice::{Client, Config, HostState};
use sluice_tests::*;

const PULL_TIMEOUT_MS: u64 = 500;
const PROBE_MS: u64 = 1_000;
const LOCAL_LIMIT: u64 = 300;
const RATE: u64 = 400;
const PROCS: u64 = 2;
const DURATION_MS: u64 = 15_000;

fn buckets(report: &Value) -> BTreeMap<i64, u64> {
    report["buckets"]
        .as_object()
        .expect("buckets")
        .iter()
        .map(|(k, v)| (k.parse().unwrap(), v[0].as_u64().unwrap()))
        .collect()
}

async fn wait_states(tasks: &[sluice::Task], want: HostState, timeout: Duration) -> Duration {
    let t0 = Instant::now();
    wait_until(
        &format!("every host {want:?}"),
        timeout,
        Duration::from_millis(5),
        || {
            let ok = tasks.iter().all(|t| t.state() == want);
            async move { ok.then_some(()) }
        },
    )
    .await;
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_falls_back_to_the_local_limit_and_recovers() {
    let etcd = shared_etcd();
    let mut redis = RedisServer::start();
    let url = redis.url();
    let ns = unique_ns("sdkflt");
    let m = Manager::start(ManagerOpts::new(&etcd, &url, &ns, "m1")).await;
    let (status, body) = m
        .put(
            "/api/v1/tasks/flt",
            r#"{"threshold":2000,"slice_ms":1000,"local_limit":300,"on_failure":"local"}"#,
        )
        .await;
    assert!(status == 200 || status == 201, "{status} {body}");
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let slice_exists = |url: String, key_of: &dyn Fn(i64) -> String| {
        let key = key_of(sluice_protocol::slice::start(
            sluice_protocol::unix_ms(),
            1_000,
        ));
        redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| redis::cmd("EXISTS").arg(&key).query::<bool>(&mut c))
            .unwrap_or(false)
    };
    let key_of = |s: i64| keys.slice("flt", s);
    wait_until(
        "slices written",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let ok = slice_exists(url.clone(), &key_of);
            async move { ok.then_some(()) }
        },
    )
    .await;

    let hosts: Vec<String> = (0..2).map(|i| format!("{ns}-h{i}")).collect();
    let mut runs: Vec<Loadgen> = hosts
        .iter()
        .map(|h| {
            Loadgen::spawn(&loadgen_args(
                &url,
                &ns,
                "flt",
                h,
                PROCS as u32,
                DURATION_MS,
                &[
                    "--rate",
                    &RATE.to_string(),
                    "--probe-interval-ms",
                    &PROBE_MS.to_string(),
                    "--pull-timeout-ms",
                    &PULL_TIMEOUT_MS.to_string(),
                ],
            ))
        })
        .collect();

    // Observers: one more process per host (this test), reading the host's state from its
    // segment.
    let observers: Vec<(Client, sluice::Task)> = hosts
        .iter()
        .map(|h| {
            let mut cfg = Config::new(url.clone());
            cfg.namespace = ns.clone();
            cfg.host_id = h.clone();
            cfg.pull_timeout = Duration::from_millis(PULL_TIMEOUT_MS);
            cfg.probe_interval = Duration::from_millis(PROBE_MS);
            let c = Client::new(cfg).expect("observer client");
            let t = c.task("flt").expect("observer task");
            (c, t)
        })
        .collect();
    let tasks: Vec<sluice::Task> = observers.iter().map(|(_, t)| t.clone()).collect();

    // Let the load run NORMAL for a while.
    wait_states(&tasks, HostState::Normal, Duration::from_secs(15)).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    wait_states(&tasks, HostState::Normal, Duration::from_secs(1)).await;

    redis.kill();
    let killed_ms = sluice_protocol::unix_ms();
    let to_failed = wait_states(&tasks, HostState::Failed, Duration::from_secs(5)).await;
    let failed_ms = sluice_protocol::unix_ms();
    eprintln!("every host FAILED {to_failed:?} after Redis was killed");
    assert!(
        to_failed <= Duration::from_millis(PULL_TIMEOUT_MS),
        "hosts took {to_failed:?} to turn FAILED (pull timeout {PULL_TIMEOUT_MS} ms)"
    );

    // Six seconds of outage.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(tasks.iter().all(|t| t.state() == HostState::Failed));
    let restart_ms = sluice_protocol::unix_ms();
    redis.restart();
    // Redis comes back empty; the manager rewrites meta and slices within a tick.
    wait_until(
        "manager healed the slices",
        Duration::from_secs(10),
        Duration::from_millis(10),
        || {
            let ok = slice_exists(url.clone(), &key_of);
            async move { ok.then_some(()) }
        },
    )
    .await;
    let healed_ms = sluice_protocol::unix_ms();
    let to_normal = wait_states(&tasks, HostState::Normal, Duration::from_secs(10)).await;
    eprintln!(
        "Redis back {} ms after restart; every host NORMAL {to_normal:?} later",
        healed_ms - restart_ms
    );
    assert!(
        to_normal <= Duration::from_millis(PROBE_MS + 300),
        "hosts took {to_normal:?} to recover (probe interval {PROBE_MS} ms)"
    );

    let mut reports = Vec::new();
    for r in &mut runs {
        reports.push(r.wait_json(Duration::from_secs(60)).await);
    }
    drop(observers);
    for h in &hosts {
        remove_segment(&ns, h);
    }
    let _ = killed_ms;

    for r in &reports {
        let host = r["host_id"].as_str().unwrap();
        // Nobody stalled: every process made (nearly) all its paced decisions.
        let decisions = r["admitted"].as_u64().unwrap() + r["rejected"].as_u64().unwrap();
        let expected = RATE * PROCS * DURATION_MS / 1_000;
        assert!(
            decisions >= expected * 95 / 100,
            "{host}: {decisions} decisions, expected ~{expected}"
        );
        assert!(r["fallback_admitted"].as_u64().unwrap() > 0, "{host}: {r}");
        // Slices entirely inside the outage: the local limit, ±10 %. The token bucket starts
        // full when the host fails, and what the first (partial) FAILED slice leaves of that
        // burst may carry into the next slice, so the check starts one slice later.
        let b = buckets(r);
        let first_full = failed_ms - failed_ms.rem_euclid(1_000) + 2_000;
        let inside: Vec<(i64, u64)> = b
            .iter()
            .filter(|(k, _)| **k >= first_full && **k + 1_000 <= restart_ms)
            .map(|(k, v)| (*k, *v))
            .collect();
        eprintln!("{host}: slices inside the outage: {inside:?}");
        assert!(
            inside.len() >= 3,
            "{host}: too few outage slices {inside:?}"
        );
        for (k, a) in inside {
            assert!(
                (LOCAL_LIMIT * 9 / 10..=LOCAL_LIMIT * 11 / 10).contains(&a),
                "{host}: slice {k} admitted {a}, local limit {LOCAL_LIMIT}"
            );
        }
    }
}
