//! Mode `concurrency` and locks (issue 13) against real servers: the lease and lock scripts,
//! the SDK's permits, and the end-to-end bounds with loadgens on several simulated hosts.

use std::time::Duration;

use sluice_protocol::conn::RedisConn;
use sluice_protocol::lease::{self, LeaseReply, LockReply};
use sluice_protocol::scripts::{self, Fence};
use sluice_protocol::{Keys, Mode};
use sluice_tests::*;

async fn conn() -> RedisConn {
    protocol_conn(&shared_redis()).await
}

fn held(r: LeaseReply) -> (u64, u64, u64) {
    match r {
        LeaseReply::Held {
            holding,
            cap,
            others,
            ..
        } => (holding, cap, others),
        other => panic!("expected a lease, got {other:?}"),
    }
}

#[tokio::test]
async fn lease_script_grants_within_the_cap_and_orders_calls() {
    let ns = unique_ns("leasescript");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    // Unknown task: nothing granted, nothing written.
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "a", 5, 1).await.unwrap(),
        LeaseReply::Unknown
    );
    write_meta(&mut c, &keys, "t", &conc_meta(10, 60_000, 1)).await;
    // Host a takes 6, host b wants 6 and gets the 4 left, host c gets nothing.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 6, 1).await.unwrap()),
        (6, 10, 0)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 6, 1).await.unwrap()),
        (4, 10, 6)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 3, 1).await.unwrap()),
        (0, 10, 10)
    );
    // A retry (same seq) is idempotent; growth beyond the free room keeps what is held.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 6, 1).await.unwrap()),
        (4, 10, 6)
    );
    // a gives 4 back (shrink is always allowed); c can now take them.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 2, 2).await.unwrap()),
        (2, 10, 4)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 8, 2).await.unwrap()),
        (4, 10, 6)
    );
    // A late duplicate of a's older call (seq 1, want 6) is refused and changes nothing.
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "a", 6, 1).await.unwrap(),
        LeaseReply::Stale { holding: 2 }
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 8, 3).await.unwrap()),
        (4, 10, 6)
    );
    // Threshold decrease to 5: nobody grows while in flight is above it; holdings only fall.
    write_meta(&mut c, &keys, "t", &conc_meta(5, 60_000, 2)).await;
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 5, 3).await.unwrap()),
        (2, 5, 8)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 1, 4).await.unwrap()),
        (1, 5, 6)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 0, 2).await.unwrap()),
        (0, 5, 3)
    );
    // In flight is 3 ≤ 5 now: a may grow into the 2 free.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 9, 4).await.unwrap()),
        (4, 5, 1)
    );
    // Sequence numbers from a µs clock (16 digits) are stored exactly and still order calls.
    let us = 1_796_135_305_814_301u64;
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 4, us).await.unwrap()),
        (4, 5, 1)
    );
    assert_eq!(
        held(
            lease::lease(&mut c, &keys, "t", "c", 5, us + 1)
                .await
                .unwrap()
        ),
        (1, 5, 4)
    );
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "a", 4, us - 1)
            .await
            .unwrap(),
        LeaseReply::Stale { holding: 4 }
    );
    let mut sc = redis_conn(&shared_redis());
    let entry: String = redis::cmd("HGET")
        .arg(keys.lease("t"))
        .arg("a")
        .query(&mut sc)
        .unwrap();
    let f: Vec<&str> = entry.split(':').collect();
    assert_eq!(
        (f[0], f[2], f[3]),
        ("4", us.to_string().as_str(), "0"),
        "{entry}"
    );
    // c asked for 5 and got 1: a learns that others wait for 4 (and gives idle ones back).
    match lease::lease(&mut c, &keys, "t", "a", 4, us + 2)
        .await
        .unwrap()
    {
        LeaseReply::Held { others_unmet, .. } => assert_eq!(others_unmet, 4),
        other => panic!("{other:?}"),
    }
    // A task of another mode is unknown to LEASE.
    let mut pooled = conc_meta(5, 0, 3);
    pooled.mode = Mode::Pooled;
    write_meta(&mut c, &keys, "t", &pooled).await;
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "a", 1, 5).await.unwrap(),
        LeaseReply::Unknown
    );
}

#[tokio::test]
async fn a_dead_hosts_lease_expires_after_its_ttl_and_retire_deletes_leases() {
    let ns = unique_ns("leaseexp");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    write_meta(&mut c, &keys, "t", &conc_meta(4, 500, 1)).await;
    let t0 = std::time::Instant::now();
    assert_eq!(
        held(
            lease::lease(&mut c, &keys, "t", "dead", 4, 1)
                .await
                .unwrap()
        )
        .0,
        4
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 4, 1).await.unwrap()).0,
        0
    );
    // b keeps asking; it gets the permits once the dead host's lease has expired, not before.
    let mut seq = 2;
    let got_at = loop {
        let (h, _, _) = held(lease::lease(&mut c, &keys, "t", "b", 4, seq).await.unwrap());
        seq += 1;
        if h == 4 {
            break t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        got_at >= Duration::from_millis(450) && got_at < Duration::from_millis(1_000),
        "{got_at:?}"
    );
    // RETIRE (DELETE of the task) deletes the lease hash.
    let f = Fence {
        term: 10,
        epoch: 1,
        stale_after_ms: 10_000,
    };
    scripts::retire(&mut c, &keys, "t", &f, 60_000, 99, false)
        .await
        .unwrap();
    let mut sc = redis_conn(&shared_redis());
    let n: i64 = redis::cmd("EXISTS")
        .arg(keys.lease("t"))
        .query(&mut sc)
        .unwrap();
    assert_eq!(n, 0);
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "b", 1, seq).await.unwrap(),
        LeaseReply::Unknown
    );
}

#[tokio::test]
async fn lock_scripts_hand_out_increasing_tokens_and_check_them() {
    let ns = unique_ns("lockscript");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let a = lease::lock_acquire(&mut c, &keys, "l", "owner-a", 60_000)
        .await
        .unwrap();
    let LockReply::Acquired { token: ta } = a else {
        panic!("{a:?}")
    };
    // Retry of the same attempt: the same token.
    assert_eq!(
        lease::lock_acquire(&mut c, &keys, "l", "owner-a", 60_000)
            .await
            .unwrap(),
        LockReply::Acquired { token: ta }
    );
    match lease::lock_acquire(&mut c, &keys, "l", "owner-b", 60_000)
        .await
        .unwrap()
    {
        LockReply::Busy { token, pttl_ms } => {
            assert_eq!(token, ta);
            assert!(pttl_ms > 50_000, "{pttl_ms}");
        }
        other => panic!("{other:?}"),
    }
    // Wrong tokens neither renew nor release.
    assert!(
        !lease::lock_renew(&mut c, &keys, "l", ta + 1, 1_000)
            .await
            .unwrap()
    );
    assert!(
        !lease::lock_release(&mut c, &keys, "l", ta + 1)
            .await
            .unwrap()
    );
    // Renew to a short TTL; it expires; b gets a higher token; a's release is refused.
    assert!(
        lease::lock_renew(&mut c, &keys, "l", ta, 200)
            .await
            .unwrap()
    );
    let tb = wait_until(
        "the lock to expire",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let keys = keys.clone();
            async move {
                let mut c = conn().await;
                match lease::lock_acquire(&mut c, &keys, "l", "owner-b", 60_000)
                    .await
                    .unwrap()
                {
                    LockReply::Acquired { token } => Some(token),
                    LockReply::Busy { .. } => None,
                }
            }
        },
    )
    .await;
    assert!(tb > ta);
    assert!(!lease::lock_release(&mut c, &keys, "l", ta).await.unwrap());
    assert!(lease::lock_release(&mut c, &keys, "l", tb).await.unwrap());
    let LockReply::Acquired { token: tc } = lease::lock_acquire(&mut c, &keys, "l", "c", 1_000)
        .await
        .unwrap()
    else {
        panic!("free lock not acquired")
    };
    assert!(tc > tb);
}

/// A manager with concurrency task `c` (`body`) and a namespace of its own.
async fn manager_with(prefix: &str, body: &str) -> (Manager, String) {
    let etcd = shared_etcd();
    let ns = unique_ns(prefix);
    let m = Manager::start(ManagerOpts::new(&etcd, &shared_redis(), &ns, "m1")).await;
    let (s, v) = m.put("/api/v1/tasks/c", body).await;
    assert!(s == 200 || s == 201, "{s} {v}");
    let keys = Keys::new(&ns).unwrap();
    let meta = keys.meta("c");
    wait_until(
        "the leader to write the meta",
        Duration::from_secs(15),
        Duration::from_millis(50),
        || {
            let meta = meta.clone();
            async move {
                let mut c = redis_conn(&shared_redis());
                let mode: Option<String> = redis::cmd("HGET")
                    .arg(&meta)
                    .arg("mode")
                    .query(&mut c)
                    .ok()?;
                (mode.as_deref() == Some("concurrency")).then_some(())
            }
        },
    )
    .await;
    (m, ns)
}

#[tokio::test]
async fn permits_are_bounded_per_host_released_on_drop_and_counted() {
    let (_m, ns) = manager_with(
        "permits",
        r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 2000, "on_failure": "deny"}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&shared_redis(), &ns, &host);
    cfg.host_report_interval = Duration::from_millis(200);
    let client = sluice::Client::new(cfg).unwrap();
    let task = client.task("c").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    // try_acquire is not the API of a concurrency task.
    assert_eq!(task.try_acquire(1), sluice::Decision::WouldBlock);
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(
            task.permit_timeout(Duration::from_secs(5))
                .await
                .expect("permit"),
        );
    }
    assert_eq!(
        task.try_permit().unwrap_err(),
        sluice::PermitError::Full,
        "a sixth permit"
    );
    assert_eq!(
        task.permit_timeout(Duration::from_millis(100))
            .await
            .unwrap_err(),
        sluice::PermitError::Timeout
    );
    let st = task.permit_stats().unwrap();
    assert_eq!((st.in_use, st.limit, st.cap), (5, 5, 5), "{st:?}");
    assert!(st.leased);
    // Redis agrees: this host holds 5.
    let mut c = redis_conn(&shared_redis());
    let entry: String = redis::cmd("HGET")
        .arg(Keys::new(&ns).unwrap().lease("c"))
        .arg(&host)
        .query(&mut c)
        .unwrap();
    assert!(entry.starts_with("5:"), "{entry}");
    // The host's permits reach the API through its NS:hosts entry.
    let url = "/api/v1/hosts?task=c".to_string();
    let hosts = wait_until(
        "the host report with permits",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let (m, url, host) = (&_m, url.clone(), host.clone());
            async move {
                let v = m.get_json(&url).await?;
                let h = v["hosts"]
                    .as_array()?
                    .iter()
                    .find(|h| h["host_id"] == host)?;
                (h["permits"]["c"]["in_use"] == 5).then(|| h.clone())
            }
        },
    )
    .await;
    assert_eq!(hosts["permits"]["c"]["limit"], 5, "{hosts}");
    assert_eq!(hosts["tasks"]["c"], "normal", "{hosts}");
    held.pop();
    held.pop().unwrap().release();
    assert_eq!(task.permit_stats().unwrap().in_use, 3);
    let p = task.try_permit().expect("a released permit is free again");
    assert!(!p.is_fallback());
    drop(p);
    drop(held);
    assert_eq!(task.permit_stats().unwrap().in_use, 0);
    // Idle permits go back to Redis at the next renewal (a quarter of the TTL).
    wait_until(
        "idle permits to be given back",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let ns = ns.clone();
            let host = host.clone();
            async move {
                let mut c = redis_conn(&shared_redis());
                let entry: String = redis::cmd("HGET")
                    .arg(Keys::new(&ns).unwrap().lease("c"))
                    .arg(&host)
                    .query(&mut c)
                    .ok()?;
                entry.starts_with("0:").then_some(())
            }
        },
    )
    .await;
}

/// `start_us end_us` lines of one or more interval files.
fn read_intervals(paths: &[std::path::PathBuf]) -> Vec<(i64, i64)> {
    let mut v = Vec::new();
    for p in paths {
        let text = std::fs::read_to_string(p).unwrap_or_default();
        for line in text.lines() {
            let mut it = line.split_whitespace().map(|x| x.parse::<i64>());
            match (it.next(), it.next()) {
                (Some(Ok(a)), Some(Ok(b))) => {
                    assert!(b >= a, "interval ends before it starts: {line}");
                    v.push((a, b));
                }
                _ => panic!("bad interval line {line:?} in {}", p.display()),
            }
        }
    }
    v
}

/// Most intervals open at one instant (an end at the same µs as a start closes first).
fn max_in_flight(iv: &[(i64, i64)]) -> (usize, i64) {
    let mut ev: Vec<(i64, i32)> = iv.iter().flat_map(|&(a, b)| [(a, 1), (b, -1)]).collect();
    ev.sort();
    let (mut cur, mut max, mut at) = (0i64, 0i64, 0);
    for (t, d) in ev {
        cur += d as i64;
        if cur > max {
            max = cur;
            at = t;
        }
    }
    (max as usize, at)
}

/// Mean number of intervals open over `[from, to)` (µs).
fn mean_in_flight(iv: &[(i64, i64)], from: i64, to: i64) -> f64 {
    let covered: i64 = iv
        .iter()
        .map(|&(a, b)| (b.min(to) - a.max(from)).max(0))
        .sum();
    covered as f64 / (to - from) as f64
}

#[tokio::test]
async fn three_hosts_never_exceed_the_threshold_and_keep_it_busy() {
    let (_m, ns) = manager_with(
        "conc3",
        r#"{"threshold": 20, "mode": "concurrency", "lease_ms": 2000, "on_failure": "deny"}"#,
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let hosts: Vec<String> = (0..3).map(|i| format!("{ns}-h{i}")).collect();
    let _segments = SegmentGuard(hosts.iter().map(|h| (ns.clone(), h.clone())).collect());
    let files: Vec<_> = (0..3).map(|i| dir.path().join(format!("iv{i}"))).collect();
    let duration_ms = 5_000;
    let mut gens: Vec<Loadgen> = hosts
        .iter()
        .zip(&files)
        .map(|(h, f)| {
            let fs = f.display().to_string();
            Loadgen::spawn(&loadgen_args(
                &shared_redis(),
                &ns,
                "c",
                h,
                2,
                duration_ms,
                &["--hold-ms", "50", "--workers", "8", "--intervals", &fs],
            ))
        })
        .collect();
    let mut reports = Vec::new();
    for g in &mut gens {
        reports.push(g.wait_json(Duration::from_secs(60)).await);
    }
    let iv = read_intervals(&files);
    let admitted: u64 = reports
        .iter()
        .map(|r| r["admitted"].as_u64().unwrap())
        .sum();
    let calls: u64 = reports
        .iter()
        .map(|r| r["redis_calls"].as_u64().unwrap())
        .sum();
    assert_eq!(
        iv.len() as u64,
        admitted,
        "one interval per admitted permit"
    );
    let (max, at) = max_in_flight(&iv);
    // While demand lasts: from the first start + 0.5 s to the last end − 0.5 s.
    let first = iv.iter().map(|x| x.0).min().unwrap();
    let last = iv.iter().map(|x| x.1).max().unwrap();
    let mean = mean_in_flight(&iv, first + 500_000, last - 500_000);
    let per_permit = calls as f64 / admitted as f64;
    eprintln!(
        "3 hosts x 2 procs, threshold 20, hold 50 ms: {admitted} permits, max in flight {max} \
         (at {at}), mean {mean:.2}, {calls} Redis calls = {per_permit:.4} per permit"
    );
    assert!(max <= 20, "in flight reached {max} at {at}");
    assert!(mean >= 18.0, "mean in flight {mean:.2} < 18");
    assert!(per_permit <= 0.1, "{per_permit} Redis calls per permit");
}

/// The `holder` example (worker-sdk/examples/holder.rs) with piped stdin/stdout; resumed
/// (SIGCONT), killed and reaped when dropped.
struct Holder {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stdin: Option<std::process::ChildStdin>,
}

impl Holder {
    fn spawn(ns: &str, host: &str, what: &[&str]) -> Self {
        use std::process::{Command, Stdio};
        let mut child = Command::new(workspace_bin("examples/holder"))
            .args([
                "--redis",
                &shared_redis(),
                "--namespace",
                ns,
                "--host-id",
                host,
            ])
            .args(what)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the holder example (cargo build -p sluice-sdk --examples)");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Self {
            child,
            lines,
            stdin,
        }
    }

    fn line(&self, timeout: Duration) -> String {
        self.lines
            .recv_timeout(timeout)
            .unwrap_or_else(|e| panic!("no line from the holder within {timeout:?}: {e}"))
    }

    fn send(&mut self, line: &str) {
        use std::io::Write;
        let s = self.stdin.as_mut().expect("stdin");
        writeln!(s, "{line}").unwrap();
        s.flush().unwrap();
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own unreaped child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `try_permit` every millisecond until it succeeds; how long that took.
fn time_until_permit(task: &sluice::Task, timeout: Duration) -> (Duration, sluice::Permit) {
    let t0 = std::time::Instant::now();
    loop {
        if let Ok(p) = task.try_permit() {
            return (t0.elapsed(), p);
        }
        assert!(t0.elapsed() < timeout, "no permit within {timeout:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[tokio::test]
async fn a_killed_process_gives_its_permits_back_at_once_a_killed_host_within_the_ttl() {
    let (_m, ns) = manager_with(
        "conckill",
        r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 2000, "on_failure": "deny"}"#,
    )
    .await;
    let ha = format!("{ns}-a");
    let hb = format!("{ns}-b");
    let _segments = SegmentGuard(vec![(ns.clone(), ha.clone()), (ns.clone(), hb.clone())]);
    // Host a: this test's client and a holder process with all 5 permits.
    let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, &ha)).unwrap();
    let task = client.task("c").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let holder = Holder::spawn(&ns, &ha, &["permits", "--task", "c", "--count", "5"]);
    assert_eq!(holder.line(Duration::from_secs(15)), "held 5");
    assert_eq!(task.try_permit().unwrap_err(), sluice::PermitError::Full);
    signal(holder.pid(), libc::SIGKILL);
    let (back, p) = time_until_permit(&task, Duration::from_secs(2));
    eprintln!("SIGKILLed process: its permits back on the host after {back:?}");
    assert!(back <= Duration::from_millis(100), "{back:?}");
    drop(p);
    let st = task.permit_stats().unwrap();
    assert_eq!(st.in_use, 0, "{st:?}");
    assert!(st.reclaimed >= 5, "{st:?}");
    drop(holder);

    // Host b: a holder takes all 5; then the whole host dies (its only process, SIGKILL).
    let hold_b = Holder::spawn(&ns, &hb, &["permits", "--task", "c", "--count", "5"]);
    // a renews and gives its idle permits back (others wait): b gets all 5 eventually.
    assert_eq!(hold_b.line(Duration::from_secs(15)), "held 5");
    signal(hold_b.pid(), libc::SIGKILL);
    let (back, _p) = time_until_permit(&task, Duration::from_secs(6));
    eprintln!("SIGKILLed host (lease 2000 ms): its permits back on another host after {back:?}");
    // Within the lease TTL of its last renewal (before the kill), plus host a's pause between
    // two growth attempts (200 ms).
    assert!(back <= Duration::from_millis(2_000 + 250), "{back:?}");
    drop(hold_b);
}

#[tokio::test]
async fn a_stopped_host_past_its_ttl_hands_out_nothing_until_it_holds_a_new_lease() {
    let (_m, ns) = manager_with(
        "concstop",
        r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 1000, "on_failure": "deny"}"#,
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (hs, hb) = (format!("{ns}-s"), format!("{ns}-b"));
    let _segments = SegmentGuard(vec![(ns.clone(), hs.clone()), (ns.clone(), hb.clone())]);
    let (fs, fb) = (dir.path().join("s"), dir.path().join("b"));
    // Host s starts first and takes every permit; host b starts after and waits.
    let mut gs = Loadgen::spawn(&loadgen_args(
        &shared_redis(),
        &ns,
        "c",
        &hs,
        1,
        9_000,
        &[
            "--hold-ms",
            "50",
            "--workers",
            "8",
            "--intervals",
            &fs.display().to_string(),
        ],
    ));
    // Host b starts once s holds permits (its first released permit is in its intervals
    // file): started together, either could lease the whole cap first.
    wait_until(
        "host s to hold permits",
        Duration::from_secs(20),
        Duration::from_millis(20),
        || async {
            std::fs::read_to_string(&fs)
                .is_ok_and(|t| t.lines().next().is_some())
                .then_some(())
        },
    )
    .await;
    let mut gb = Loadgen::spawn(&loadgen_args(
        &shared_redis(),
        &ns,
        "c",
        &hb,
        1,
        5_000,
        &[
            "--hold-ms",
            "50",
            "--workers",
            "8",
            "--intervals",
            &fb.display().to_string(),
        ],
    ));
    // Let both run, then stop host s (parent and child) for 2.5 lease TTLs.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let pids: Vec<u32> = std::iter::once(gs.proc.pid())
        .chain(child_pids(gs.proc.pid()))
        .collect();
    assert_eq!(pids.len(), 2, "{pids:?}");
    for p in &pids {
        signal(*p, libc::SIGSTOP);
    }
    let stopped_us = sluice::clock::host_us();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    for p in &pids {
        signal(*p, libc::SIGCONT);
    }
    let cont_us = sluice::clock::host_us();
    let rb = gb.wait_json(Duration::from_secs(60)).await;
    let rs = gs.wait_json(Duration::from_secs(60)).await;
    let s_iv = read_intervals(std::slice::from_ref(&fs));
    let b_iv = read_intervals(std::slice::from_ref(&fb));
    let b_end = b_iv.iter().map(|x| x.1).max().unwrap();
    let s_before = s_iv.iter().filter(|x| x.0 < stopped_us).count();
    let s_between = s_iv
        .iter()
        .filter(|x| x.0 >= cont_us && x.0 < b_end)
        .count();
    let s_after = s_iv.iter().filter(|x| x.0 >= b_end).count();
    let b_during = b_iv
        .iter()
        .filter(|x| x.0 >= stopped_us && x.0 < cont_us)
        .count();
    eprintln!(
        "stopped host: {s_before} permits before SIGSTOP, {s_between} after SIGCONT while the \
         other host held the permits, {s_after} after it ended; the other host: {b_during} \
         during the stop; reports {rs} {rb}"
    );
    assert!(s_before > 0 && b_during > 0);
    // After SIGCONT host s hands out nothing while host b holds every permit (its lease of
    // before the stop expired in Redis and b took the permits) …
    assert_eq!(s_between, 0);
    // … and works again once it holds a new lease (b's expires after b stopped).
    assert!(s_after > 0);
    // Permits started after SIGCONT never exceed the threshold together.
    let late: Vec<(i64, i64)> = s_iv
        .iter()
        .chain(&b_iv)
        .copied()
        .filter(|x| x.0 >= cont_us)
        .collect();
    assert!(max_in_flight(&late).0 <= 5);
}

#[tokio::test]
async fn a_thousand_lock_acquisitions_across_three_hosts_have_increasing_tokens_and_one_holder() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let ns = unique_ns("locks");
    let hosts: Vec<String> = (0..3).map(|i| format!("{ns}-h{i}")).collect();
    let _segments = SegmentGuard(hosts.iter().map(|h| (ns.clone(), h.clone())).collect());
    let held = Arc::new(AtomicBool::new(false));
    let last = Arc::new(std::sync::Mutex::new(0u64));
    let count = Arc::new(AtomicU64::new(0));
    let t0 = std::time::Instant::now();
    let mut joins = Vec::new();
    for h in &hosts {
        let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, h)).unwrap();
        let (held, last, count) = (held.clone(), last.clone(), count.clone());
        joins.push(tokio::spawn(async move {
            let mut mine = 0u64;
            // Bounded: 1,000 acquisitions in all, or 120 s.
            while count.load(Ordering::Acquire) < 1_000 && t0.elapsed() < Duration::from_secs(120) {
                let g = client
                    .lock_timeout("job", Duration::from_secs(5), Duration::from_secs(10))
                    .await
                    .expect("lock");
                assert!(!held.swap(true, Ordering::AcqRel), "two holders at once");
                {
                    let mut l = last.lock().unwrap();
                    assert!(g.token() > *l, "token {} after {}", g.token(), *l);
                    *l = g.token();
                }
                count.fetch_add(1, Ordering::AcqRel);
                mine += 1;
                held.store(false, Ordering::Release);
                assert!(
                    g.release().await.expect("release"),
                    "released by its holder"
                );
            }
            mine
        }));
    }
    let mut per_host = Vec::new();
    for j in joins {
        per_host.push(j.await.unwrap());
    }
    let n = count.load(Ordering::Acquire);
    eprintln!(
        "locks: {n} acquisitions in {:?}, per host {per_host:?}, last token {}",
        t0.elapsed(),
        *last.lock().unwrap()
    );
    assert!(n >= 1_000, "{n}");
    assert!(per_host.iter().all(|&k| k > 0), "{per_host:?}");
}

#[tokio::test]
async fn a_holder_paused_past_its_ttl_loses_the_lock_and_its_late_write_is_refused() {
    let ns = unique_ns("lockpause");
    let (ha, hb) = (format!("{ns}-a"), format!("{ns}-b"));
    let _segments = SegmentGuard(vec![(ns.clone(), ha.clone()), (ns.clone(), hb.clone())]);
    let resource = format!("{ns}-resource");
    let mut a = Holder::spawn(
        &ns,
        &ha,
        &[
            "lock",
            "--name",
            "job",
            "--ttl-ms",
            "1000",
            "--resource",
            &resource,
        ],
    );
    let line = a.line(Duration::from_secs(15));
    let ta: u64 = line
        .strip_prefix("token ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    a.send("write from-a-1");
    assert_eq!(a.line(Duration::from_secs(5)), "written");
    // A is paused (GC, SIGSTOP, a stalled VM) while holding the lock.
    signal(a.pid(), libc::SIGSTOP);
    let paused = std::time::Instant::now();
    let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, &hb)).unwrap();
    let g = client
        .lock_timeout("job", Duration::from_secs(5), Duration::from_secs(10))
        .await
        .expect("the lock of a paused holder expires");
    let took = paused.elapsed();
    assert!(g.token() > ta, "{} vs {ta}", g.token());
    // B writes with its token, through the same fenced write as A (the holder example's).
    let mut c = redis_conn(&shared_redis());
    let (ok, _): (i64, i64) =
        redis::Script::new(include_str!("../../worker-sdk/examples/fenced_write.lua"))
            .key(&resource)
            .arg(g.token())
            .arg("from-b")
            .invoke(&mut c)
            .unwrap();
    assert_eq!(ok, 1);
    // A wakes up and writes late, as if it still held the lock: refused by the resource.
    signal(a.pid(), libc::SIGCONT);
    a.send("write from-a-2");
    assert_eq!(
        a.line(Duration::from_secs(5)),
        format!("refused {}", g.token())
    );
    let value: String = redis::cmd("HGET")
        .arg(&resource)
        .arg("value")
        .query(&mut c)
        .unwrap();
    assert_eq!(value, "from-b");
    // A's guard finds out it lost the lock.
    let mut seen = String::new();
    for _ in 0..50 {
        a.send("held");
        seen = a.line(Duration::from_secs(5));
        if seen == "held false" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen, "held false");
    eprintln!(
        "paused holder: token {ta}, the next holder got {} after {took:?}; late write refused",
        g.token()
    );
    // A's release (token-checked) does not free B's lock.
    drop(a);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(g.is_held());
    assert!(g.release().await.unwrap());
    let _: () = redis::cmd("DEL").arg(&resource).query(&mut c).unwrap();
}

#[tokio::test]
async fn redis_lost_means_local_limit_in_flight_and_back_to_leases_without_double_grants() {
    let etcd = shared_etcd();
    let mut redis = RedisServer::start();
    let ns = unique_ns("concfail");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis.url(), &ns, "m1")).await;
    let (s, v) = m
        .put(
            "/api/v1/tasks/c",
            r#"{"threshold": 4, "mode": "concurrency", "lease_ms": 1000,
                "on_failure": "local", "local_limit": 2}"#,
        )
        .await;
    assert!(s == 200 || s == 201, "{s} {v}");
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&redis.url(), &ns, &host);
    cfg.pull_timeout = Duration::from_millis(300);
    let client = sluice::Client::new(cfg).unwrap();
    let task = client.task("c").unwrap();
    assert!(task.wait_ready(Duration::from_secs(15)));
    let mut held = Vec::new();
    for _ in 0..4 {
        let p = task.permit_timeout(Duration::from_secs(5)).await.unwrap();
        assert!(!p.is_fallback());
        held.push(p);
    }
    redis.kill();
    let t0 = std::time::Instant::now();
    wait_until(
        "FAILED after the lease lapses",
        Duration::from_secs(5),
        Duration::from_millis(10),
        || {
            let st = task.permit_stats().unwrap();
            async move { st.failed.then_some(()) }
        },
    )
    .await;
    let failed_after = t0.elapsed();
    // The 4 permits of the lease stay counted: local_limit 2 allows nothing more …
    assert_eq!(task.try_permit().unwrap_err(), sluice::PermitError::Failed);
    // … until fewer than 2 are in use: then fallback permits up to 2 in flight.
    held.truncate(1);
    let fb = task.try_permit().expect("a local permit");
    assert!(fb.is_fallback());
    held.push(fb);
    assert_eq!(task.try_permit().unwrap_err(), sluice::PermitError::Failed);
    // Redis comes back empty; the leader rewrites the meta; the host leases again and counts
    // its 2 permits in use: 2 more, not 4.
    redis.restart();
    let p = task
        .permit_timeout(Duration::from_secs(15))
        .await
        .expect("leases again");
    assert!(!p.is_fallback());
    held.push(p);
    held.push(task.try_permit().expect("the fourth"));
    assert_eq!(task.try_permit().unwrap_err(), sluice::PermitError::Full);
    let st = task.permit_stats().unwrap();
    assert_eq!((st.in_use, st.limit), (4, 4), "{st:?}");
    assert!(st.leased && !st.failed && st.lapses >= 1, "{st:?}");
    eprintln!("Redis lost: FAILED after {failed_after:?} (lease 1000 ms: valid 750 ms)");
    drop(held);
    drop(m);
}

#[tokio::test]
async fn a_threshold_decrease_hands_out_nothing_until_in_flight_is_below_the_new_cap() {
    let (m, ns) = manager_with(
        "concdown",
        r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 2000, "on_failure": "deny"}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, &host)).unwrap();
    let task = client.task("c").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(task.permit_timeout(Duration::from_secs(5)).await.unwrap());
    }
    let (s, v) = m
        .put(
            "/api/v1/tasks/c",
            r#"{"threshold": 2, "mode": "concurrency", "lease_ms": 2000, "on_failure": "deny"}"#,
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let t0 = std::time::Instant::now();
    // The next renewal (a quarter TTL) sees the new cap.
    wait_until(
        "the host to see the new cap",
        Duration::from_secs(5),
        Duration::from_millis(10),
        || {
            let st = task.permit_stats().unwrap();
            async move { (st.cap == 2).then_some(()) }
        },
    )
    .await;
    let seen_after = t0.elapsed();
    // 5 → 4 → 3 → 2 in use: nothing is handed out until fewer than 2 are.
    for _ in 0..3 {
        held.pop();
        assert_eq!(task.try_permit().unwrap_err(), sluice::PermitError::Full);
    }
    held.pop();
    held.push(task.try_permit().expect("1 in use < 2"));
    assert_eq!(task.try_permit().unwrap_err(), sluice::PermitError::Full);
    // The host gives the permits above the new cap back to Redis at its next renewal.
    let keys = Keys::new(&ns).unwrap();
    wait_until(
        "the holding to shrink to the new cap",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let (key, host) = (keys.lease("c"), host.clone());
            async move {
                let mut c = redis_conn(&shared_redis());
                let e: String = redis::cmd("HGET").arg(&key).arg(&host).query(&mut c).ok()?;
                e.starts_with("2:").then_some(())
            }
        },
    )
    .await;
    eprintln!("threshold 5 -> 2: seen by the host after {seen_after:?}");
    drop(held);
}

#[tokio::test]
async fn a_process_that_stops_gives_the_hosts_idle_permits_back_at_once() {
    let (_m, ns) = manager_with(
        "concbye",
        r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 20000}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, &host)).unwrap();
    let task = client.task("c").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let held: Vec<_> = (0..4)
        .map(|_| task.permit_blocking(Duration::from_secs(5)).unwrap())
        .collect();
    drop(held);
    drop(task);
    let t0 = std::time::Instant::now();
    drop(client);
    let key = Keys::new(&ns).unwrap().lease("c");
    let mut c = redis_conn(&shared_redis());
    let e: String = redis::cmd("HGET")
        .arg(&key)
        .arg(&host)
        .query(&mut c)
        .unwrap();
    // Renewal would be 5 s away and expiry 20 s: the stopping process gave them back.
    assert!(e.starts_with("0:"), "{e} after {:?}", t0.elapsed());
}
