//! The load generator itself (`worker-sdk/examples/loadgen.rs`), against a real manager and
//! Redis: signals stop its child processes (a SIGTERM'd run still reports; a SIGKILLed parent
//! leaves no child), `--backend-capacity` is one budget for the whole host, and exact tasks are
//! decided through `acquire_blocking` (never by the fallback), following a mode changed at run
//! time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_protocol::{Keys, slice, slice_field};
use sluice_tests::*;

/// A manager on the shared servers with `task` created from `spec` and rolled.
async fn manager_with_task(ns: &str, task: &str, spec: &str) -> Manager {
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), ns, "m1")).await;
    let (status, body) = m.put(&format!("/api/v1/tasks/{task}"), spec).await;
    assert!(status == 200 || status == 201, "{status} {body}");
    m.wait_rolled(task).await;
    m
}

/// A run deciding on a fresh task: its manager, segment guard, progress dir, the run, and
/// its children's pids once they have closed at least one bucket (past start-up).
struct Deciding {
    _m: Manager,
    _seg: SegmentGuard,
    _dir: tempfile::TempDir,
    lg: Loadgen,
    kids: Vec<u32>,
}

async fn deciding_run(prefix: &str, procs: u32, rate: &str) -> Deciding {
    let ns = unique_ns(prefix);
    let m = manager_with_task(&ns, "t", r#"{"threshold":500,"slice_ms":1000}"#).await;
    let seg = SegmentGuard(vec![(ns.clone(), format!("{ns}-h"))]);
    let dir = tempfile::tempdir().unwrap();
    let progress = dir.path().join("progress.jsonl");
    let lg = Loadgen::spawn(&loadgen_args(
        &shared_redis(),
        &ns,
        "t",
        &format!("{ns}-h"),
        procs,
        60_000,
        &[
            "--rate",
            rate,
            "--bucket-ms",
            "100",
            "--progress",
            progress.to_str().unwrap(),
        ],
    ));
    let pid = lg.proc.pid();
    let kids = wait_until(
        "loadgen children deciding",
        Duration::from_secs(15),
        Duration::from_millis(20),
        || {
            let kids = child_pids(pid);
            let lines = std::fs::read_to_string(&progress)
                .map(|t| t.lines().count())
                .unwrap_or(0);
            let n = procs as usize;
            async move { (kids.len() == n && lines >= n).then_some(kids) }
        },
    )
    .await;
    Deciding {
        _m: m,
        _seg: seg,
        _dir: dir,
        lg,
        kids,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_children_and_still_reports() {
    let mut d = deciding_run("lgterm", 2, "300").await;
    let t0 = Instant::now();
    signal(d.lg.proc.pid(), libc::SIGTERM);
    let json = d.lg.wait_json(Duration::from_secs(2)).await;
    let took = t0.elapsed();
    eprintln!("SIGTERM → exit with a report in {took:?}: {json}");
    assert!(
        json["admitted"].as_u64().unwrap() > 0,
        "the children's counts must be in the report: {json}"
    );
    assert_eq!(json["procs"], 2);
    let gone = wait_gone(&d.kids, Duration::from_millis(100));
    assert!(gone.is_ok(), "children left running: {gone:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_parent_leaves_no_child() {
    let mut d = deciding_run("lgkill", 3, "200").await;
    d.lg.proc.kill();
    let gone = wait_gone(&d.kids, Duration::from_secs(1));
    eprintln!("children after the parent's SIGKILL: {gone:?}");
    assert!(
        gone.is_ok(),
        "children outlived their SIGKILLed parent: {gone:?}"
    );
}

/// Reads `ok`/`err` of the 1 s slices of `task` starting in `[from, until)`.
fn outcomes(ns: &str, task: &str, from: i64, until: i64) -> Vec<(i64, u64, u64)> {
    let keys = Keys::new(ns).unwrap();
    let mut conn = redis_conn(&shared_redis());
    let starts: Vec<i64> = slice::starts(from, until, 1_000).collect();
    let mut pipe = redis::pipe();
    for s in &starts {
        pipe.cmd("HMGET")
            .arg(keys.slice(task, *s))
            .arg(slice_field::OK)
            .arg(slice_field::ERR);
    }
    let rows: Vec<(Option<u64>, Option<u64>)> = pipe.query(&mut conn).unwrap();
    starts
        .into_iter()
        .zip(rows)
        .map(|(s, (ok, err))| (s, ok.unwrap_or(0), err.unwrap_or(0)))
        .collect()
}

/// Two loadgen runs on ONE host id (900/s and 300/s) share a backend of 1,000/s: the host's
/// backend serves at most 1,000 per second and fails the excess (~200/s). With a budget per
/// process (the bug), each process had the whole 1,000 for itself and nothing ever failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_capacity_is_one_budget_for_the_host() {
    const CAPACITY: u64 = 1_000;
    let ns = unique_ns("lgcap");
    let _m = manager_with_task(&ns, "t", r#"{"threshold":100000,"slice_ms":1000}"#).await;
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let from = now_ms();
    let mut runs: Vec<Loadgen> = ["900", "300"]
        .iter()
        .map(|rate| {
            Loadgen::spawn(&loadgen_args(
                &shared_redis(),
                &ns,
                "t",
                &host,
                1,
                6_000,
                &["--rate", rate, "--backend-capacity", &CAPACITY.to_string()],
            ))
        })
        .collect();
    for r in &mut runs {
        let json = r.wait_json(Duration::from_secs(60)).await;
        assert_eq!(json["fallback_admitted"], 0, "{json}");
    }
    let until = now_ms();
    // The counter file is removed by the last run to finish.
    let counter = format!(
        "{}.t.backend",
        sluice::shm::Segment::path_for(std::path::Path::new("/dev/shm"), &ns, &host).display()
    );
    assert!(
        !std::path::Path::new(&counter).exists(),
        "{counter} was left behind"
    );
    // Counters are flushed about once a second after the runs end.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let rows = outcomes(&ns, "t", from, until);
    eprintln!("slices (start, ok, err): {rows:?}");
    // Full seconds: both runs at full rate (they start within ~1.1 s and last 6 s).
    let full: Vec<&(i64, u64, u64)> = rows.iter().filter(|r| r.1 + r.2 >= 1_150).collect();
    assert!(full.len() >= 3, "expected ≥ 3 full seconds: {rows:?}");
    for (s, ok, err) in &full {
        assert!(
            *ok <= CAPACITY,
            "slice {s}: the host served {ok} > {CAPACITY}"
        );
        assert!(
            *err >= 100,
            "slice {s}: {ok} served, only {err} failed: the capacity is not shared by the host"
        );
    }
}

fn bucket_map(report: &Value, field: &str) -> BTreeMap<i64, u64> {
    report[field]
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| {
                    let n = v.as_u64().or_else(|| v[0].as_u64()).unwrap_or(0);
                    (k.parse().unwrap(), n)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A task switched from pooled to `exact_fixed` while the loadgen runs: the loadgen follows
/// the mode and decides exact slices with `acquire_blocking`, so nothing is admitted by the
/// fallback and no slice holds more than its threshold. (Deciding an exact task with
/// `try_acquire_at` answered by the fallback: hundreds of fallback admissions per slice.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_tasks_are_decided_exactly_also_after_a_mode_change() {
    const CAP: u64 = 40;
    let ns = unique_ns("lgexact");
    let m = manager_with_task(
        &ns,
        "t",
        r#"{"threshold":40,"slice_ms":1000,"local_limit":1000,"on_failure":"local"}"#,
    )
    .await;
    let hosts: Vec<String> = (0..2).map(|i| format!("{ns}-h{i}")).collect();
    let _seg = SegmentGuard(hosts.iter().map(|h| (ns.clone(), h.clone())).collect());
    let mut runs: Vec<Loadgen> = hosts
        .iter()
        .map(|h| {
            Loadgen::spawn(&loadgen_args(
                &shared_redis(),
                &ns,
                "t",
                h,
                2,
                9_000,
                &["--rate", "50", "--bucket-ms", "1000"],
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (status, body) = m
        .put(
            "/api/v1/tasks/t",
            r#"{"threshold":40,"slice_ms":1000,"local_limit":1000,"on_failure":"local","mode":"exact_fixed"}"#,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let switched = now_ms();
    let mut total: BTreeMap<i64, u64> = BTreeMap::new();
    let mut fallback = 0;
    for r in &mut runs {
        let json = r.wait_json(Duration::from_secs(60)).await;
        fallback += json["fallback_admitted"].as_u64().unwrap();
        for (b, n) in bucket_map(&json, "buckets") {
            *total.entry(b).or_default() += n;
        }
    }
    eprintln!("admitted per slice: {total:?}; fallback-admitted {fallback}");
    assert_eq!(fallback, 0, "exact decisions must not fall back");
    for (b, n) in &total {
        assert!(*n <= CAP, "slice {b}: {n} admitted > {CAP}");
    }
    // The exact slices were really decided by TAKE: the slice hashes count them.
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&shared_redis());
    let exact: Vec<i64> = total
        .keys()
        .copied()
        .filter(|b| *b >= switched + 2_000)
        .collect();
    assert!(!exact.is_empty(), "no slice after the switch: {total:?}");
    for b in exact {
        let adm: Option<u64> = redis::cmd("HGET")
            .arg(keys.slice("t", b))
            .arg(slice_field::ADMITTED)
            .query(&mut conn)
            .unwrap();
        assert_eq!(adm, Some(total[&b]), "slice {b}: TAKE's count differs");
    }
}
