//! Decision-path benchmarks (no Redis: the quota is put into the host segment directly).
//!
//! * `decide/allowed`: `try_acquire(1)` admitted from the local quota: the fast path (the
//!   coarse clock, `Config::fast_clock`, the default).
//! * `decide/allowed_precise_clock`: the same on the precise clock (`try_acquire_precise`):
//!   what `decide/allowed` cost before the fast clock.
//! * `decide/limited`: the slice is exhausted (LIMITED): reject without Redis.
//! * `decide/local_token_bucket`: mode `local`, the shared token bucket (the FAILED path).
//! * `decide/keyed_allowed`: `key.try_acquire(1)` of a keyed task, admitted from the key
//!   table (a cached handle).
//! * `decide/keyed_new_handle`: `task.key(k)` then `try_acquire(1)`: what a layer that makes a
//!   handle per request pays (SipHash of the key + bucket lookup).
//! * `decide/keyed_limited`: the key's slice is exhausted.
//! * `decide/allowed_paced`: `decide/allowed` on a paced slice (`"pacing": "smooth"`): the CAS
//!   plus the local release check.
//! * `decide/limited_shadow`: `decide/limited` in shadow mode: the rejection is admitted as
//!   `ShadowLimited` and counted as a would-reject.
//! * `host/N`: N threads, each with its own client (its own mapping of the same segment, like
//!   N processes of one host), deciding against one shared quota: decisions/s of the host.
//!   `host/N_precise_clock`: the same with `try_acquire_precise`.
//!
//! `scripts/bench-sdk.sh` runs this and the whole-system load test, and `docs/benchmarks.md`
//! has the numbers.

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sluice::shm::{MAX_COUNT, Segment};
use sluice::{Client, Config, Task};
use sluice_protocol::{Fallback, FallbackAlgorithm, Mode, OnFailure, TaskMeta};

const DAY_MS: u64 = 86_400_000;

struct Host {
    _dir: tempfile::TempDir,
    seg: Segment,
    slot: usize,
    clients: Vec<(Client, Task)>,
}

fn host(mode: Mode, clients: usize) -> Host {
    host_with(mode, clients, false, false)
}

fn keyed_host() -> Host {
    host_opts(Mode::Pooled, 1, true, false, false)
}

fn host_with(mode: Mode, clients: usize, shadow: bool, paced: bool) -> Host {
    host_opts(mode, clients, false, shadow, paced)
}

fn host_opts(mode: Mode, clients: usize, keyed: bool, shadow: bool, paced: bool) -> Host {
    let dir = tempfile::tempdir().expect("tempdir");
    let mk = || {
        // Nothing listens on port 1: the background thread fails quietly, decisions go on.
        let mut cfg = Config::new("redis://127.0.0.1:1");
        cfg.namespace = "bench".into();
        cfg.host_id = "h".into();
        cfg.shm_dir = dir.path().to_path_buf();
        cfg.probe_interval = Duration::from_secs(3_600);
        cfg.meta_refresh = Duration::from_secs(3_600);
        let c = Client::new(cfg).expect("client");
        let t = c.task("bench").expect("task");
        (c, t)
    };
    let clients: Vec<_> = (0..clients).map(|_| mk()).collect();
    let (seg, _) = Segment::open(clients[0].0.segment_path(), 1).expect("segment");
    let slot = seg.find("bench").expect("slot");
    let sl = seg.slot(slot).unwrap();
    sl.store_meta(
        &TaskMeta {
            slice_ms: DAY_MS,
            threshold: u64::MAX / 2,
            pull: 0,
            local_limit: u64::MAX / 4,
            on_failure: OnFailure::Deny,
            mode,
            fallback: Fallback {
                algorithm: FallbackAlgorithm::TokenBucket,
                burst: 0,
            },
            version: 1,
            lease_ms: 0,
            keyed,
            key_overrides: Default::default(),
            shadow,
            pacing: if paced {
                sluice_protocol::Pacing::Smooth
            } else {
                sluice_protocol::Pacing::None
            },
            pace_burst: 0,
        },
        sl.generation(),
    );
    // Let the background threads fail their first meta read, then clear the FAILED state it
    // leaves (the meta is refreshed only hourly from here on).
    std::thread::sleep(Duration::from_millis(400));
    let sl = seg.slot(slot).unwrap();
    sl.ctl.state.store(0, std::sync::atomic::Ordering::Relaxed);
    sl.ctl
        .next_probe_ms
        .store(i64::MAX / 2, std::sync::atomic::Ordering::Relaxed);
    let h = Host {
        _dir: dir,
        seg,
        slot,
        clients,
    };
    h.refill(false);
    h
}

impl Host {
    fn refill(&self, exhausted: bool) {
        let now_us = self.clients[0].1.now_us();
        let start = (now_us as u64 / (DAY_MS * 1_000) * DAY_MS) as i64;
        let s = self.seg.slot(self.slot).unwrap();
        let e = s.entry(start, DAY_MS);
        e.word.store(0, std::sync::atomic::Ordering::Relaxed);
        let n = if exhausted { 0 } else { MAX_COUNT as u64 };
        // Paced tasks: the whole stock is released (the check runs, and passes).
        e.pace_cap
            .store(u64::MAX / 2, std::sync::atomic::Ordering::Relaxed);
        e.pace_granted
            .store(n, std::sync::atomic::Ordering::Relaxed);
        s.deposit(start, DAY_MS, n, exhausted, now_us);
    }
}

fn decide(c: &mut Criterion) {
    let mut g = c.benchmark_group("decide");
    g.throughput(Throughput::Elements(1));
    let h = host(Mode::Pooled, 1);
    let task = h.clients[0].1.clone();
    g.bench_function("allowed", |b| {
        b.iter_custom(|iters| {
            h.refill(false);
            let t0 = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(task.try_acquire(std::hint::black_box(1)));
            }
            t0.elapsed()
        })
    });
    g.bench_function("allowed_precise_clock", |b| {
        b.iter_custom(|iters| {
            h.refill(false);
            let t0 = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(task.try_acquire_precise(std::hint::black_box(1)));
            }
            t0.elapsed()
        })
    });
    h.refill(true);
    g.bench_function("limited", |b| {
        b.iter(|| std::hint::black_box(task.try_acquire(std::hint::black_box(1))))
    });
    let p = host_with(Mode::Pooled, 1, false, true);
    let ptask = p.clients[0].1.clone();
    g.bench_function("allowed_paced", |b| {
        b.iter_custom(|iters| {
            p.refill(false);
            let t0 = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(ptask.try_acquire(std::hint::black_box(1)));
            }
            t0.elapsed()
        })
    });
    let sh = host_with(Mode::Pooled, 1, true, false);
    sh.refill(true);
    let stask = sh.clients[0].1.clone();
    g.bench_function("limited_shadow", |b| {
        b.iter(|| std::hint::black_box(stask.try_acquire(std::hint::black_box(1))))
    });
    let l = host(Mode::Local, 1);
    let ltask = l.clients[0].1.clone();
    g.bench_function("local_token_bucket", |b| {
        b.iter(|| std::hint::black_box(ltask.try_acquire(std::hint::black_box(1))))
    });
    let k = keyed_host();
    let ktask = k.clients[0].1.clone();
    let key = ktask.key("tenant-42").expect("key");
    assert!(key.fill_local(MAX_COUNT as u64, false), "key entry");
    g.bench_function("keyed_allowed", |b| {
        b.iter_custom(|iters| {
            key.fill_local(MAX_COUNT as u64, false);
            let t0 = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(key.try_acquire(std::hint::black_box(1)));
            }
            t0.elapsed()
        })
    });
    g.bench_function("keyed_new_handle", |b| {
        b.iter_custom(|iters| {
            key.fill_local(MAX_COUNT as u64, false);
            let t0 = Instant::now();
            for _ in 0..iters {
                let h = ktask.key(std::hint::black_box("tenant-42")).expect("key");
                std::hint::black_box(h.try_acquire(1));
            }
            t0.elapsed()
        })
    });
    key.fill_local(0, true);
    g.bench_function("keyed_limited", |b| {
        b.iter(|| std::hint::black_box(key.try_acquire(std::hint::black_box(1))))
    });
    g.finish();
}

fn host_throughput(c: &mut Criterion) {
    let mut g = c.benchmark_group("host");
    for (n, precise) in [(1usize, false), (4, false), (4, true)] {
        let h = host(Mode::Pooled, n);
        g.throughput(Throughput::Elements(n as u64));
        let name = if precise {
            format!("{n}_precise_clock")
        } else {
            format!("{n}")
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                h.refill(false);
                let tasks: Vec<Task> = h.clients.iter().map(|(_, t)| t.clone()).collect();
                let t0 = Instant::now();
                std::thread::scope(|s| {
                    for t in &tasks {
                        s.spawn(move || {
                            for _ in 0..iters {
                                if precise {
                                    std::hint::black_box(t.try_acquire_precise(1));
                                } else {
                                    std::hint::black_box(t.try_acquire(1));
                                }
                            }
                        });
                    }
                });
                t0.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = decide, host_throughput
}
criterion_main!(benches);
