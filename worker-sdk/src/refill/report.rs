//! The host report: every `host_report_interval` (host-wide), this host's clock offset and
//! its tasks' states written to `NS:hosts`.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::ctx::Shared;
use crate::plumbing::{Retry, call};
use crate::protocol::{HostReport, Mode};
use crate::shm::{FastMeta, tag_of};
use crate::state::{Health, view};

pub(crate) async fn report_host(sh: &Shared) {
    let h = sh.seg.header();
    let now_us = sh.now_us();
    let now_ms = crate::clock::host_ms();
    // The first report waits for a clock measurement (a pull), or two seconds.
    if h.clock_rtt_us.load(Ordering::Relaxed) <= 0 && sh.started.elapsed() < Duration::from_secs(2)
    {
        return;
    }
    let last = h.host_report_ms.load(Ordering::Acquire);
    let period = sh.cfg.host_report_interval.as_millis() as i64;
    if now_ms - last < period && now_ms >= last {
        return;
    }
    if h.host_report_ms
        .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    let mut tasks = std::collections::BTreeMap::new();
    let mut permits = std::collections::BTreeMap::new();
    for (i, name) in sh.seg.tasks() {
        let Some(slot) = sh.seg.slot(i) else { continue };
        let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
            continue;
        };
        if m.mode == Mode::Concurrency {
            let (state, report) = crate::refill::permits::host_report(&slot.conc);
            tasks.insert(name.clone(), state.as_str().to_string());
            permits.insert(name, report);
            continue;
        }
        let start = slice_start(now_us, m.slice_ms);
        let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
        let w = slot.entry(start, m.slice_ms).word.load(Ordering::Acquire);
        let state = view(health, w, tag_of(start));
        tasks.insert(name, state.as_str().to_string());
    }
    let report = HostReport {
        offset_ms: h.clock_offset_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        rtt_ms: h.clock_rtt_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        seen_ms: now_ms,
        sdk: env!("CARGO_PKG_VERSION").to_string(),
        proto: Some(crate::protocol::PROTOCOL_VERSION),
        tasks,
        permits,
    };
    let Ok(json) = serde_json::to_string(&report) else {
        return;
    };
    let key = sh.keys.hosts();
    let _ = call(sh, Retry::Idempotent, |mut c| {
        let (key, json) = (&key, &json);
        async move {
            redis::cmd("HSET")
                .arg(key)
                .arg(&sh.cfg.host_id)
                .arg(json)
                .query_async::<i64>(&mut c)
                .await
        }
    })
    .await;
}

/// Start (Unix ms) of the slice of length `slice_ms` containing `now_us`.
fn slice_start(now_us: i64, slice_ms: u64) -> i64 {
    crate::protocol::slice::start(now_us.div_euclid(1_000), slice_ms)
}
