//! A corrupt or old host segment is replaced (atomically, by rename) and logged, never read:
//! a real `loadgen` process is started on a host whose segment file holds garbage, then on one
//! with an older layout version.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Duration;

use sluice::shm::{LAYOUT_VERSION, MAGIC, Segment};
use sluice_tests::*;

fn header_words(path: &Path) -> (u64, u64) {
    let bytes = std::fs::read(path).expect("segment");
    let w = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    (w(0), w(1))
}

async fn run_loadgen(redis: &str, ns: &str, host: &str) -> (serde_json::Value, String) {
    let mut lg = Loadgen::spawn(&loadgen_args(
        redis,
        ns,
        "seg",
        host,
        1,
        300,
        &["--rate", "1000"],
    ));
    let json = lg.wait_json(Duration::from_secs(60)).await;
    (json, lg.proc.log())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_and_old_segments_are_replaced_and_logged() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("sdkseg");
    let host = format!("{ns}-h");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    let (status, body) = m
        .put(
            "/api/v1/tasks/seg",
            r#"{"threshold":100000,"slice_ms":1000,"local_limit":10,"on_failure":"deny"}"#,
        )
        .await;
    assert!(status == 200 || status == 201, "{status} {body}");
    let path = Segment::path_for(Path::new("/dev/shm"), &ns, &host);

    // 1. Garbage (right size for nothing, READY-looking bytes everywhere).
    std::fs::write(&path, vec![0x01u8; 64 * 1024]).unwrap();
    let (json, log) = run_loadgen(&redis, &ns, &host).await;
    assert!(
        log.contains("incompatible or corrupt") && log.contains("bad magic"),
        "replacement not logged:\n{log}"
    );
    assert_eq!(header_words(&path), (MAGIC, LAYOUT_VERSION));
    assert!(json["admitted"].as_u64().unwrap() > 0, "{json}");
    assert_eq!(json["fallback_admitted"].as_u64(), Some(0), "{json}");

    // 2. A valid segment of an older layout version.
    {
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(8)).unwrap();
        f.write_all(&(LAYOUT_VERSION - 1).to_le_bytes()).unwrap();
    }
    let inode_before = std::fs::metadata(&path)
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    let (json, log) = run_loadgen(&redis, &ns, &host).await;
    assert!(
        log.contains("incompatible or corrupt") && log.contains("layout version"),
        "replacement not logged:\n{log}"
    );
    let inode_after = std::fs::metadata(&path)
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    assert_ne!(
        inode_before, inode_after,
        "the file must be replaced, not rewritten in place"
    );
    assert_eq!(header_words(&path), (MAGIC, LAYOUT_VERSION));
    assert!(json["admitted"].as_u64().unwrap() > 0, "{json}");

    // 3. A valid current segment is joined, not replaced.
    let (_, log) = run_loadgen(&redis, &ns, &host).await;
    assert!(!log.contains("incompatible or corrupt"), "{log}");
    let inode_again = std::fs::metadata(&path)
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    assert_eq!(inode_after, inode_again);
    remove_segment(&ns, &host);
}
