//! KPULL (protocol 4, issue 26) against a real Redis, with the meta and the task slice written
//! by hand as the leader writes them: a reference model of what it must grant, held by a
//! randomized property test (seed printed; `SLUICE_KPULL_SEED=<seed>` replays it), and the
//! edges the adversarial review of issue 26 found (duplicates, replays of multi-key calls,
//! caps near `MAX_COUNT`, fractional wants, fields that do not parse, slice-length changes,
//! `ko_n` from older managers, too many keys).

use std::collections::HashMap;

use sluice_protocol::Keys;
use sluice_protocol::scripts::{
    KeyGrant, KeyPullBatch, KeyPullBatchReply, KeyWant, key_pull_batch,
};
use sluice_tests::*;

const SLICE: u64 = 60_000;

/// A call as sent (wants, all or nothing, request id) and what it answered.
type Sent = (Vec<(String, u64)>, bool, String, Vec<KeyGrant>);

struct Fixture {
    ns: String,
    keys: Keys,
    conn: redis::aio::MultiplexedConnection,
    sync: redis::Connection,
    start: i64,
}

/// A keyed task `t` with a meta of `version` 5 (threshold 50, `ko_n` 0, protocol 4, 60 s
/// slices) and the current slice rolled with `cap`.
async fn fixture(prefix: &str, cap: u64) -> Fixture {
    let redis = shared_redis();
    let ns = unique_ns(prefix);
    let keys = Keys::new(&ns).unwrap();
    let mut sync = redis_conn(&redis);
    let start = sluice_protocol::slice::start(now_ms(), SLICE);
    let _: () = redis::cmd("HSET")
        .arg(keys.meta("t"))
        .arg(&[
            ("version", "5"),
            ("keyed", "1"),
            ("threshold", "50"),
            ("ko_n", "0"),
            ("proto", "4"),
            ("slice_ms", "60000"),
        ])
        .query(&mut sync)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(keys.slice("t", start))
        .arg("cap")
        .arg(cap)
        .arg("rem")
        .arg(cap)
        .query(&mut sync)
        .unwrap();
    let client = redis::Client::open(redis.as_str()).unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    Fixture {
        ns,
        keys,
        conn,
        sync,
        start,
    }
}

impl Fixture {
    async fn pull_with(
        &mut self,
        wants: &[(&str, u64)],
        rid: &str,
        version: i64,
        slice_ms: u64,
        aon: bool,
    ) -> KeyPullBatchReply {
        let digests: Vec<String> = wants
            .iter()
            .map(|(k, _)| sluice_protocol::key_digest(k))
            .collect();
        let wants: Vec<u64> = wants.iter().map(|(_, w)| *w).collect();
        self.batch(&digests, &wants, rid, version, slice_ms, aon)
            .await
            .unwrap()
    }

    /// One KPULL of keys by digest, as sent (an error is Redis's answer).
    async fn batch(
        &mut self,
        digests: &[String],
        wants: &[u64],
        rid: &str,
        version: i64,
        slice_ms: u64,
        aon: bool,
    ) -> redis::RedisResult<KeyPullBatchReply> {
        let ks: Vec<KeyWant<'_>> = digests
            .iter()
            .zip(wants)
            .map(|(d, w)| KeyWant {
                digest: d,
                want: *w,
            })
            .collect();
        let req = KeyPullBatch {
            task: "t",
            start_ms: self.start,
            slice_ms,
            host_id: "h",
            request_id: rid,
            meta_version: version,
            all_or_nothing: aon,
            keys: &ks,
        };
        key_pull_batch(&mut self.conn, &self.keys, &req).await
    }

    async fn pull(&mut self, wants: &[(&str, u64)], rid: &str) -> Vec<KeyGrant> {
        match self.pull_with(wants, rid, 5, SLICE, false).await {
            KeyPullBatchReply::Granted { grants, .. } => grants,
            r => panic!("{r:?}"),
        }
    }

    fn hash(&self) -> String {
        self.keys.key_slices("t", self.start)
    }

    fn hset(&mut self, key: &str, field: &str, value: &str) {
        let _: () = redis::cmd("HSET")
            .arg(key)
            .arg(field)
            .arg(value)
            .query(&mut self.sync)
            .unwrap();
    }
}

/// What the model grants a key with `left` of its cap for `want` (all or nothing: `want` or 0).
fn model_grant(left: u64, want: u64, aon: bool) -> u64 {
    match aon {
        true if left >= want => want,
        true => 0,
        false => want.min(left),
    }
}

/// The reference model: per key, what is left of its cap; a call grants `min(want, left)` (all
/// or nothing: `want` or 0) in order, the same key twice in one call seeing what the first
/// left; a resend of a call answers exactly what the call answered, taking nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpull_grants_what_the_model_allows_never_more() {
    let seed = std::env::var("SLUICE_KPULL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_ms() as u64 ^ 0x9E37_79B9_7F4A_7C15);
    eprintln!("kpull model: seed {seed} (replay: SLUICE_KPULL_SEED={seed})");
    let mut rng = seed | 1;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let cap = 40;
    let mut f = fixture("kpullmodel", cap).await;
    let names: Vec<String> = (0..12).map(|i| format!("key-{i}")).collect();
    let mut left: HashMap<String, u64> = HashMap::new();
    let mut sent: Vec<Sent> = Vec::new();
    for call in 0..300 {
        // A resend of one of the last calls (as the SDK's retry sends it), or a new call.
        if !sent.is_empty() && next(5) == 0 {
            let back = next(sent.len().min(4) as u64) as usize;
            let (wants, aon, rid, answer) = sent[sent.len() - 1 - back].clone();
            let w: Vec<(&str, u64)> = wants.iter().map(|(k, n)| (k.as_str(), *n)).collect();
            let r = match f.pull_with(&w, &rid, 5, SLICE, aon).await {
                KeyPullBatchReply::Granted { grants, .. } => grants,
                r => panic!("seed {seed} call {call}: {r:?}"),
            };
            if r.first().is_some_and(|g| g.replayed) {
                assert!(
                    r.iter().all(|g| g.replayed),
                    "seed {seed} call {call}: half replayed {r:?}"
                );
                assert_eq!(
                    r.iter()
                        .map(|g| (g.granted, g.remaining))
                        .collect::<Vec<_>>(),
                    answer
                        .iter()
                        .map(|g| (g.granted, g.remaining))
                        .collect::<Vec<_>>(),
                    "seed {seed} call {call}: a replay answered otherwise"
                );
            } else {
                // An older resend (its record was replaced) runs again: it takes again, from
                // what is left (stranded, never spent twice).
                for ((k, want), g) in wants.iter().zip(&r) {
                    let l = left.entry(k.clone()).or_insert(cap);
                    let expect = model_grant(*l, *want, aon);
                    assert_eq!(g.granted, expect, "seed {seed} call {call} (resend) {k}");
                    *l -= g.granted;
                }
            }
            continue;
        }
        let n = 1 + next(5) as usize;
        let aon = next(4) == 0;
        let wants: Vec<(String, u64)> = (0..n)
            .map(|_| (names[next(names.len() as u64) as usize].clone(), next(9)))
            .collect();
        let rid = format!("r{call}");
        let w: Vec<(&str, u64)> = wants.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        let r = match f.pull_with(&w, &rid, 5, SLICE, aon).await {
            KeyPullBatchReply::Granted { grants, .. } => grants,
            r => panic!("seed {seed} call {call}: {r:?}"),
        };
        assert_eq!(r.len(), n);
        for ((k, want), g) in wants.iter().zip(&r) {
            let l = left.entry(k.clone()).or_insert(cap);
            let expect = model_grant(*l, *want, aon);
            assert!(!g.replayed, "seed {seed} call {call}: a new call replayed");
            assert_eq!(
                g.granted, expect,
                "seed {seed} call {call}: {k} wanted {want} with {l} left (aon {aon})"
            );
            *l -= g.granted;
            assert_eq!(g.remaining, *l as i64, "seed {seed} call {call}: {k}");
            assert_eq!(g.cap, cap, "seed {seed} call {call}: {k}");
        }
        sent.push((wants, aon, rid, r));
    }
    // Safety in Redis itself: every key's field is its cap less what was granted.
    for (k, l) in &left {
        let field = sluice_protocol::key_field(&sluice_protocol::key_digest(k));
        let v: String = redis::cmd("HGET")
            .arg(f.hash())
            .arg(&field)
            .query(&mut f.sync)
            .unwrap();
        assert_eq!(
            sluice_protocol::parse_key_quota(&v),
            Some((*l as i64, None)),
            "seed {seed}: {k}"
        );
    }
    let _ = &f.ns;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpull_edges_found_by_review() {
    let mut f = fixture("kpulledge", 10).await;
    // The same key twice in one call: the second sees what the first left (was 10 + 10).
    let g = f.pull(&[("a", 10), ("a", 10)], "r1").await;
    assert_eq!((g[0].granted, g[1].granted), (10, 0), "{g:?}");
    // A multi-key call's resend answers the same, nothing taken.
    let g1 = f.pull(&[("b", 3), ("c", 4)], "r2").await;
    let g2 = f.pull(&[("b", 3), ("c", 4)], "r2").await;
    assert_eq!(
        g2.iter()
            .map(|g| (g.granted, g.replayed))
            .collect::<Vec<_>>(),
        vec![(3, true), (4, true)]
    );
    assert_eq!(g1[0].remaining, 7);
    // Another call of the host in between uses another record (by the request id's hash) as
    // a rule: 64 of them, so a resend after a few other calls is still answered.
    for i in 0..8 {
        f.pull(&[("d", 1)], &format!("other{i}")).await;
    }
    let g3 = f.pull(&[("b", 3), ("c", 4)], "r2").await;
    let replayed = g3.iter().all(|g| g.replayed);
    let b_left: String = redis::cmd("HGET")
        .arg(f.hash())
        .arg(sluice_protocol::key_field(&sluice_protocol::key_digest(
            "b",
        )))
        .query(&mut f.sync)
        .unwrap();
    assert!(
        replayed && b_left == "7" || !replayed && b_left == "4",
        "resend after other calls: {g3:?}, b left {b_left}"
    );
    // A field that does not parse grants nothing (never more than was there).
    f.pull(&[("e", 2)], "r3").await;
    let field = sluice_protocol::key_field(&sluice_protocol::key_digest("e"));
    let hash = f.hash();
    f.hset(&hash, &field, "garbage");
    let g = f.pull(&[("e", 1)], "r4").await;
    assert_eq!(g[0].granted, 0, "an unparsable field granted {g:?}");
    // Too many keys: an error, nothing done; 1,000 are fine.
    let many: Vec<String> = (0..1_001).map(|i| format!("m{i}")).collect();
    let digests: Vec<String> = many
        .iter()
        .map(|k| sluice_protocol::key_digest(k))
        .collect();
    let ones = vec![1u64; digests.len()];
    assert!(
        f.batch(&digests, &ones, "r5", 5, SLICE, false)
            .await
            .is_err()
    );
    match f
        .batch(&digests[..1_000], &ones[..1_000], "r6", 5, SLICE, false)
        .await
        .unwrap()
    {
        KeyPullBatchReply::Granted { grants, .. } => {
            assert_eq!(grants.len(), 1_000);
            assert!(grants.iter().all(|g| g.granted == 1));
        }
        r => panic!("{r:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpull_caps_near_max_count_stay_integers() {
    let mut f = fixture("kpullbig", 1_000_000).await;
    // Base 10, the slice's cap a million, an override of a billion: 10^14, clamped to
    // MAX_COUNT (10^12) — stored and answered as integers, and pulled again without error.
    let meta = f.keys.meta("t");
    f.hset(&meta, "threshold", "10");
    f.hset(&meta, "ko_n", "1");
    let d = sluice_protocol::key_digest("vip");
    f.hset(&meta, &format!("ko:{d}"), "1000000000");
    let g = f.pull(&[("vip", 5), ("plain", 5)], "r1").await;
    assert_eq!(g[0].cap, sluice_protocol::MAX_COUNT, "{g:?}");
    assert_eq!(g[0].remaining, sluice_protocol::MAX_COUNT as i64 - 5);
    assert_eq!(g[1].cap, 1_000_000);
    let v: String = redis::cmd("HGET")
        .arg(f.hash())
        .arg(sluice_protocol::key_field(&d))
        .query(&mut f.sync)
        .unwrap();
    assert_eq!(v, "999999999995:1000000000000");
    let g = f.pull(&[("vip", 5)], "r2").await;
    assert_eq!(g[0].granted, 5, "{g:?}");
    let g = f.pull(&[("vip", 5)], "r2").await;
    assert!(g[0].replayed && g[0].remaining == sluice_protocol::MAX_COUNT as i64 - 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpull_makes_quotas_only_from_the_current_spec() {
    let mut f = fixture("kpullspec", 10).await;
    // A caller whose slice length is not the meta's makes nothing (was: a hash of the wrong
    // length, then −3 for every up-to-date caller for the whole slice).
    let r = f.pull_with(&[("a", 1)], "r1", 5, 120_000, false).await;
    assert!(
        matches!(
            r,
            KeyPullBatchReply::StaleMeta {
                stored_version: 5,
                ..
            }
        ),
        "{r:?}"
    );
    let exists: bool = redis::cmd("EXISTS")
        .arg(f.hash())
        .query(&mut f.sync)
        .unwrap();
    assert!(!exists);
    // An older version makes nothing either.
    let r = f.pull_with(&[("a", 1)], "r2", 4, SLICE, false).await;
    assert!(matches!(r, KeyPullBatchReply::StaleMeta { .. }), "{r:?}");
    // The current one does; a later caller of the same version but another length is stale,
    // a newer one shares the hash and keeps it for its longer slice.
    assert_eq!(f.pull(&[("a", 1)], "r3").await[0].granted, 1);
    let r = f.pull_with(&[("a", 1)], "r4", 5, 90_000, false).await;
    assert!(matches!(r, KeyPullBatchReply::StaleMeta { .. }), "{r:?}");
    let meta = f.keys.meta("t");
    f.hset(&meta, "version", "6");
    let r = f.pull_with(&[("a", 1)], "r5", 6, 90_000, false).await;
    assert!(matches!(r, KeyPullBatchReply::Granted { .. }), "{r:?}");
    let at: i64 = redis::cmd("PEXPIRETIME")
        .arg(f.hash())
        .query(&mut f.sync)
        .unwrap();
    assert_eq!(at, f.start + 2 * 90_000 + 5_000);
    // No task slice to make the next slice's hash from: −1, nothing done.
    f.start += SLICE as i64;
    let r = f.pull_with(&[("a", 1)], "r6", 6, SLICE, false).await;
    assert!(matches!(r, KeyPullBatchReply::Missing { .. }), "{r:?}");
    // Once the slice is rolled, a meta whose version does not parse still makes nothing (−1,
    // never a Lua error); a good one does.
    let next = f.keys.slice("t", f.start);
    f.hset(&next, "cap", "10");
    f.hset(&meta, "version", "x");
    let r = f.pull_with(&[("a", 1)], "r7", 6, SLICE, false).await;
    assert!(matches!(r, KeyPullBatchReply::Missing { .. }), "{r:?}");
    f.hset(&meta, "version", "6");
    let r = f.pull_with(&[("a", 1)], "r8", 6, SLICE, false).await;
    assert!(matches!(r, KeyPullBatchReply::Granted { .. }), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpull_trusts_ko_n_only_from_protocol_4_managers() {
    for (proto, ko_n, honoured) in [
        ("4", Some("0"), false),
        ("3", Some("0"), true),
        ("4", None, true),
    ] {
        let mut f = fixture("kpullko", 10).await;
        let meta = f.keys.meta("t");
        f.hset(&meta, "proto", proto);
        match ko_n {
            Some(v) => f.hset(&meta, "ko_n", v),
            None => {
                let _: () = redis::cmd("HDEL")
                    .arg(&meta)
                    .arg("ko_n")
                    .query(&mut f.sync)
                    .unwrap();
            }
        }
        // The hash is made by a first key; an override added afterwards (by an older
        // manager, which does not count them) reaches a key new in the slice only when
        // `ko_n` could not be trusted.
        f.pull(&[("first", 1)], "r1").await;
        let d = sluice_protocol::key_digest("vip");
        f.hset(&meta, &format!("ko:{d}"), "100");
        let g = f.pull(&[("vip", 1)], "r2").await;
        let cap = if honoured { 20 } else { 10 };
        assert_eq!(g[0].cap, cap, "proto {proto} ko_n {ko_n:?}: {g:?}");
    }
}
