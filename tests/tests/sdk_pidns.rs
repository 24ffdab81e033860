//! The host's locks across PID namespaces (issue 9 item 8): containers or pods that share
//! `/dev/shm` see each other's processes under other pids (or not at all), so liveness by
//! `kill(pid, 0)` is wrong there. A lock holder runs inside one PID namespace (as pid 2: the
//! namespace's init is a shell), a contender inside another (as pid 1), both on one segment in
//! `/dev/shm`:
//!
//! * while the holder lives, the contender must see the lock busy (with pid liveness it found
//!   "pid 2" dead in its own namespace and took the lock from a live holder);
//! * when the holder is SIGKILLed, the contender takes the lock over within ~100 ms (with pid
//!   liveness, a holder that was pid 1 looked alive for ever, as the contender's own pid 1).
//!
//! Both sides are this test binary re-executed under `unshare --pid --fork --mount-proc`.

use std::process::Command;
use std::time::{Duration, Instant};

use sluice::shm::{LockAttempt, Segment};
use sluice_tests::*;

const SEG_ENV: &str = "SLUICE_TEST_PIDNS_SEGMENT";

fn open_slot() -> (Segment, usize) {
    let path = std::env::var(SEG_ENV).expect("segment path");
    let (seg, _) = Segment::open(path.as_ref(), 4).expect("open segment");
    let i = seg.find_or_claim("ns", 1_000).expect("slot");
    (seg, i)
}

fn unix_us() -> i64 {
    sluice::clock::host_us()
}

#[test]
#[ignore = "helper process of locks_work_across_pid_namespaces"]
fn pidns_holder_helper() {
    if std::env::var(SEG_ENV).is_err() {
        return;
    }
    let (seg, i) = open_slot();
    let pid = std::process::id();
    match seg
        .pull_lock(i)
        .unwrap()
        .try_lock(sluice::clock::host_ms(), 600_000)
    {
        LockAttempt::Acquired { .. } => println!("LOCKED as pid {pid}"),
        other => panic!("holder could not lock: {other:?}"),
    }
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
#[ignore = "helper process of locks_work_across_pid_namespaces"]
fn pidns_contender_helper() {
    if std::env::var(SEG_ENV).is_err() {
        return;
    }
    let (seg, i) = open_slot();
    let lock = seg.pull_lock(i).unwrap();
    let pid = std::process::id();
    println!("CONTENDER as pid {pid}");
    let deadline = Instant::now() + Duration::from_secs(25);
    let mut busy = false;
    while Instant::now() < deadline {
        match lock.try_lock(sluice::clock::host_ms(), 600_000) {
            LockAttempt::Acquired { .. } => {
                println!("ACQUIRED at {}", unix_us());
                return;
            }
            LockAttempt::Busy { .. } => {
                if !busy {
                    println!("BUSY");
                    busy = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("GAVE UP");
}

fn in_namespace(
    helper: &str,
    via_shell: bool,
    seg: &std::path::Path,
    log: std::path::PathBuf,
) -> Proc {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc"]);
    let run = format!("{} --exact {helper} --ignored --nocapture", exe.display());
    if via_shell {
        // The shell is the namespace's pid 1; the helper runs as pid 2.
        cmd.args(["sh", "-c", &format!("{run}; true")]);
    } else {
        cmd.arg(exe)
            .args(["--exact", helper, "--ignored", "--nocapture"]);
    }
    cmd.env(SEG_ENV, seg);
    Proc::spawn(helper, cmd, log)
}

/// Host pids of the direct children of `pid`.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_work_across_pid_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    let host = unique_ns("h");
    let _segments = SegmentGuard(vec![("pidns".into(), host.clone())]);
    let seg_path = Segment::path_for(std::path::Path::new("/dev/shm"), "pidns", &host);
    let holder = in_namespace(
        "pidns_holder_helper",
        true,
        &seg_path,
        dir.path().join("holder.log"),
    );
    wait_for_log(&holder, "LOCKED", Duration::from_secs(20)).await;
    eprintln!("holder: {}", holder.log().trim());
    let contender = in_namespace(
        "pidns_contender_helper",
        false,
        &seg_path,
        dir.path().join("contender.log"),
    );
    wait_for_log(&contender, "CONTENDER", Duration::from_secs(20)).await;
    // The holder lives: the contender must keep seeing the lock busy.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = contender.log();
    eprintln!("contender while the holder lives: {}", log.trim());
    assert!(
        log.contains("BUSY") && !log.contains("ACQUIRED"),
        "the contender took the lock of a live holder in another PID namespace:\n{log}"
    );
    // SIGKILL the holder's namespace (its init, the shell: the kernel kills the rest).
    let init = children(holder.pid());
    assert_eq!(init.len(), 1, "the holder namespace's init: {init:?}");
    signal(init[0], libc::SIGKILL);
    let killed_us = unix_us();
    let line = wait_until(
        "the contender to take the lock over",
        Duration::from_secs(10),
        Duration::from_millis(5),
        || {
            let log = contender.log();
            let line = log
                .lines()
                .find(|l| l.starts_with("ACQUIRED") || l.starts_with("GAVE UP"))
                .map(str::to_string);
            async move { line }
        },
    )
    .await;
    let at: i64 = line
        .strip_prefix("ACQUIRED at ")
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("contender: {line}"));
    let took_ms = (at - killed_us) as f64 / 1_000.0;
    eprintln!("taken over {took_ms:.1} ms after the holder was killed");
    assert!(took_ms <= 100.0, "takeover took {took_ms} ms");
    drop(holder);
    drop(contender);
}
