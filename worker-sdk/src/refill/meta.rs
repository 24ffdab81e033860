//! Refreshing a task's meta from Redis into the slot (one process per host, claimed by CAS
//! on the slot's timestamp), and noticing a task deleted or a protocol newer than this build.

use std::sync::atomic::Ordering;

use crate::ctx::{Shared, TaskInner};
use crate::plumbing::{Retry, apply_health, call};
use crate::protocol::{TaskMeta, meta_field};
use crate::shm::{FastMeta, Slot};
use crate::state::{Health, PullOutcome};

/// Meta re-read period while the meta is unknown.
const UNKNOWN_META_RETRY_MS: i64 = 200;

pub(crate) async fn refresh_meta(
    sh: &Shared,
    t: &TaskInner,
    slot: &Slot,
    generation: u16,
    now_ms: i64,
) {
    let cells = &slot.meta;
    let last = cells.refreshed_ms.load(Ordering::Acquire);
    let known = FastMeta::decode(cells.fast.load(Ordering::Acquire)).is_some();
    let period = if known {
        sh.cfg.meta_refresh.as_millis() as i64
    } else {
        UNKNOWN_META_RETRY_MS
    };
    if now_ms - last < period && now_ms >= last {
        return;
    }
    if cells
        .refreshed_ms
        .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    let key = sh.keys.meta(&t.name);
    let res = call(sh, Retry::Idempotent, |mut c| {
        let key = key.clone();
        async move {
            redis::cmd("HGETALL")
                .arg(&key)
                .query_async::<Vec<(String, String)>>(&mut c)
                .await
        }
    })
    .await;
    let outcome = match res {
        Err(_) => PullOutcome::Timeout,
        Ok(Err(e)) => {
            tracing::debug!(task = %t.name, error = %e, "meta read failed");
            PullOutcome::Error
        }
        Ok(Ok(pairs)) => {
            if pairs.iter().any(|(k, _)| k == meta_field::RETIRED) {
                if known {
                    tracing::info!(task = %t.name, "task was deleted; forgetting its meta");
                    slot.clear_meta(generation);
                }
            } else {
                match TaskMeta::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
                    Ok(mut meta) => {
                        // Key overrides are read by the KPULL script, not kept in the segment.
                        meta.key_overrides.clear();
                        cells.missing_since_ms.store(0, Ordering::Relaxed);
                        if slot.meta().as_ref() != Some(&meta) {
                            tracing::info!(task = %t.name, version = meta.version,
                                mode = %meta.mode, slice_ms = meta.slice_ms, "task meta loaded");
                            warn_if_newer_protocol(&t.name, &pairs);
                            slot.store_meta(&meta, generation);
                        }
                    }
                    Err(crate::protocol::MetaError::Missing) => {
                        // Empty: Redis lost it (or the task never existed). Keep what we know;
                        // the manager rewrites it within a tick.
                        let _ = cells.missing_since_ms.compare_exchange(
                            0,
                            now_ms,
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        );
                    }
                    Err(e) => {
                        tracing::warn!(task = %t.name, error = %e, "unreadable task meta");
                        warn_if_newer_protocol(&t.name, &pairs);
                    }
                }
            }
            return;
        }
    };
    // Redis is not usable: a NORMAL task goes FAILED now rather than at its next pull.
    let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
    if known && health == Health::Normal {
        let tr = sh.machine.after_pull(health, outcome, now_ms);
        apply_health(t, slot, health, tr.health, tr.next_probe_ms);
    }
}

/// The protocol version a task's meta hash was written with (`proto`), when it is newer than
/// this build's: the managers were upgraded past this worker. Nothing refuses the mix
/// (docs/deploy.md, "Version-skew policy"); this says so where an operator looks.
fn newer_protocol(pairs: &[(String, String)]) -> Option<u32> {
    let (_, v) = pairs.iter().find(|(k, _)| k == meta_field::PROTO)?;
    let v: u32 = v.parse().ok()?;
    (v > crate::protocol::PROTOCOL_VERSION).then_some(v)
}

fn warn_if_newer_protocol(task: &str, pairs: &[(String, String)]) {
    if let Some(v) = newer_protocol(pairs) {
        tracing::warn!(
            task = %task,
            meta_protocol = v,
            sdk_protocol = crate::protocol::PROTOCOL_VERSION,
            "task meta was written by managers of a newer protocol than this SDK speaks; \
             upgrade this host's workers (docs/deploy.md, version-skew policy)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(proto: &str) -> Vec<(String, String)> {
        vec![
            ("mode".into(), "pooled".into()),
            (meta_field::PROTO.into(), proto.into()),
        ]
    }

    #[test]
    fn only_a_newer_protocol_in_the_meta_is_reported() {
        let mine = crate::protocol::PROTOCOL_VERSION;
        assert_eq!(
            newer_protocol(&pairs(&(mine + 1).to_string())),
            Some(mine + 1)
        );
        assert_eq!(newer_protocol(&pairs(&mine.to_string())), None);
        assert_eq!(newer_protocol(&pairs("1")), None);
        assert_eq!(newer_protocol(&pairs("x")), None);
        assert_eq!(newer_protocol(&[]), None);
    }
}
