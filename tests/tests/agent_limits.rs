//! The agent's bounds and first-sight rules end to end (real etcd, Redis, `sluice-manager`,
//! `sluice-agent`; docs/agent.md, "Bounds"):
//!
//! * a task name the agent has never verified in Redis never claims a slot of the host
//!   segment: random names sent while Redis is paused (SIGSTOP) get 503 naming `task`, and an
//!   SDK process of the host can still claim its own task's slot afterwards;
//! * the agent's share of the host segment's task slots (`--max-agent-tasks`) is bounded.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_tests::*;

async fn task(m: &Manager, name: &str, body: &str) {
    let (status, resp) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
    assert!(status == 200 || status == 201, "{status} {resp}");
    m.wait_rolled(name).await;
}

/// The names of the segment's slots in use.
fn segment_tasks(path: &std::path::Path) -> Vec<String> {
    let (seg, _) = sluice::shm::Segment::open(path, 1).expect("open the host segment");
    seg.tasks().into_iter().map(|(_, n)| n).collect()
}

/// Resumes a SIGSTOPped process when dropped (also when the test fails).
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGCONT) };
    }
}

/// Issue 23 item 13: while Redis does not answer, names the agent has never verified are not
/// given slots of the host segment, so an SDK process of the host can still claim its task's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_names_while_redis_is_paused_claim_no_slot() {
    let etcd = shared_etcd();
    let r = RedisServer::start();
    let redis = r.url();
    let ns = unique_ns("aslots");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    task(&m, "real", r#"{"threshold":1000,"slice_ms":1000}"#).await;
    task(&m, "seen", r#"{"threshold":1000,"slice_ms":1000}"#).await;
    let a = Agent::start(&redis, &ns, "h1", &["--max-tasks", "8"]).await;
    a.wait_ready().await;
    // A task the agent has verified keeps being decided while Redis is paused.
    let (s, v) = a.decide(&json!({"task": "seen"})).await;
    assert_eq!((s, &v["decision"]), (200, &json!("allowed")), "{v}");
    let seg_path = sluice::shm::Segment::path_for(&a.segment_dir, &ns, "h1");

    signal(r.pid(), libc::SIGSTOP);
    let _resume = Resume(r.pid());
    let t0 = Instant::now();
    let answers: Vec<(u16, Value)> = futures_join_all(
        (0..24)
            .map(|i| {
                let a = &a;
                async move { a.decide(&json!({"task": format!("rnd-{i}-x9")})).await }
            })
            .collect(),
    )
    .await;
    for (s, v) in &answers {
        assert_eq!(*s, 503, "a never-verified name while Redis is paused: {v}");
        assert_eq!(v["field"], "task", "{v}");
        assert!(
            v["error"]
                .as_str()
                .unwrap_or("")
                .contains("could not be verified"),
            "{v}"
        );
    }
    eprintln!("24 random names answered in {:?}", t0.elapsed());
    let (s, v) = a.decide(&json!({"task": "seen"})).await;
    assert_eq!(s, 200, "a verified task is still decided: {v}");

    let names = segment_tasks(&seg_path);
    assert!(
        names.iter().all(|n| !n.starts_with("rnd-")),
        "random names hold slots of the host segment: {names:?}"
    );
    // An SDK process of the host (same host id and segment directory) claims its task.
    let mut cfg = sdk_config(&redis, &ns, "h1");
    cfg.shm_dir = a.segment_dir.clone();
    cfg.max_tasks = 8;
    let client = sluice::Client::new(cfg).expect("SDK client");
    let t = client.task("real");
    assert!(t.is_ok(), "the SDK process cannot claim its slot: {t:?}");
    drop(_resume);

    // Redis back: the random names are unknown (404), still without a slot.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, v) = a.decide(&json!({"task": "rnd-0-x9"})).await;
        if s == 404 {
            break;
        }
        assert!(Instant::now() < deadline, "still {s} {v} with Redis back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let names = segment_tasks(&seg_path);
    assert!(names.iter().all(|n| !n.starts_with("rnd-")), "{names:?}");
}

/// Runs every future concurrently (on this task) and returns their outputs in order.
async fn futures_join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.expect("ready")).collect()
}
