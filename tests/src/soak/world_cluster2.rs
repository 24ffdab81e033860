//! A second manager cluster on the soak's namespace (issue 23 item 12): its own etcd (so its
//! own epoch: the etcd cluster id), the same Redis and namespace, one replica `x0`. It leads
//! its own etcd, imports a domain of its own (`soakenv2`) and creates a task of its own
//! (`x0t`), runs for the step's time, and is stopped (SIGTERM: exit 0).
//!
//! What docs/protocol.md promises (fences, "other epoch, age < stale_after → refused"): while
//! the first cluster's leader refreshes its fences (at least every `--fence-stale-after` / 4;
//! the step runs between other steps, so the first cluster has a leader within a lease), the
//! second writes nothing of the first's — no slice, meta, tombstone or `NS:envoy` field. So the
//! bound of every task stays what the first cluster's specs allow (the second has no spec of
//! those names), and:
//!
//! * **`cluster2.domain_lost`**: while the second runs, the first cluster's domain `soakenv`
//!   (when an import of it is surely applied and no Redis disturbance is near) stays in
//!   `NS:envoy` — before item 12's fix each leader deleted the other's domains every pass;
//! * the first cluster's tasks keep their slices and meta: `safety.*`, `fencing.*` and the
//!   next quiet period's `liveness.*` (a task the second retired, or rolled with its own
//!   caps, fails them);
//! * **`crash.manager_panic`** / **`crash.manager_sigterm`** / **`crash.manager_start`** for
//!   `x0`; **`api.rejected`** for its valid import and task.

use std::time::{Duration, Instant};

use serde_json::json;

use super::super::envoy::DOMAIN;
use super::super::ledger::Disturb;
use super::{CONTROL_PERIOD, LEASE_TTL, TICK, World, tail, with_conn};
use crate::{EtcdServer, Manager, ManagerOpts, http, now_ms};

/// The second cluster's domain.
pub const DOMAIN2: &str = "soakenv2";

impl World {
    /// Whether the first cluster's domain is surely in `NS:envoy` at `now`.
    fn domain_surely_mirrored(&self, now: i64) -> bool {
        let live = (0..super::super::envoy::DESCRIPTORS.len()).any(|i| {
            self.envoy_versions(i).last().is_some_and(|v| {
                v.confirmed
                    && v.spec.is_some()
                    && super::super::check::applied_by(&self.ledger, v.at_ms, &self.timing) + 1_000
                        <= now
            })
        });
        let quiet = !self.ledger.disturbances.iter().any(|d| {
            matches!(
                d.kind,
                Disturb::Redis { .. } | Disturb::Leader | Disturb::Etcd
            ) && d.to_ms.is_none_or(|to| to + 8_000 >= now)
        });
        live && quiet
    }

    /// The step: start, run `run_ms`, stop.
    pub(super) async fn second_cluster(&mut self, run_ms: u64) -> String {
        let etcd2 = tokio::task::block_in_place(EtcdServer::start);
        let mut o = ManagerOpts::new(&etcd2.endpoint(), &self.redis_url, &self.ns, "x0");
        o.lease_ttl = LEASE_TTL.into();
        o.extra = ["--tick", TICK, "--control-period", CONTROL_PERIOD]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut m = match tokio::spawn(Manager::start(o)).await {
            Ok(m) => m,
            Err(e) => {
                self.violate(
                    "crash.manager_start",
                    None,
                    format!("the second cluster's replica x0 did not start: {e}"),
                );
                return "x0 did not start".into();
            }
        };
        let t0 = Instant::now();
        let mut led = false;
        while t0.elapsed() < Duration::from_secs(20) {
            if m.says_leader().await {
                led = true;
                break;
            }
            self.idle(200).await;
        }
        let mut notes = vec![format!(
            "x0 on its own etcd {}",
            if led {
                format!("led after {} ms", t0.elapsed().as_millis())
            } else {
                "did not lead in 20 s".into()
            }
        )];
        // Its own domain and task (valid: any 4xx is a finding).
        let yaml = format!(
            "domain: {DOMAIN2}\ndescriptors:\n  - key: path\n    value: z\n    rate_limit:\n      unit: second\n      requests_per_unit: 7\n"
        );
        let r = http()
            .post(format!("http://{}/api/v1/import/envoy-ratelimit", m.addr))
            .header("content-type", "application/yaml")
            .body(yaml)
            .send()
            .await;
        let spec = json!({"threshold": 5, "slice_ms": 1000, "mode": "pooled", "description": "second cluster"});
        let r2 = http()
            .put(format!("http://{}/api/v1/tasks/x0t", m.addr))
            .header("content-type", "application/json")
            .body(spec.to_string())
            .send()
            .await;
        for (what, r) in [("import of soakenv2", r), ("PUT x0t", r2)] {
            match r {
                Ok(r) if r.status().is_success() => notes.push(format!("{what}: {}", r.status())),
                Ok(r) if r.status().as_u16() == 503 => notes.push(format!("{what}: 503")),
                Ok(r) => {
                    let status = r.status();
                    let body = r.text().await.unwrap_or_default();
                    self.violate(
                        "api.rejected",
                        None,
                        format!("second cluster: {what} answered {status}: {body}"),
                    );
                }
                Err(e) => notes.push(format!("{what}: no answer ({e})")),
            }
        }
        // Run, watching the first cluster's domain in NS:envoy.
        let until = Instant::now() + Duration::from_millis(run_ms);
        let mut polls = 0u64;
        let mut lost = None;
        let key = self.keys.envoy_routes();
        while Instant::now() < until {
            self.idle(250).await;
            let now = now_ms();
            if !self.domain_surely_mirrored(now) {
                continue;
            }
            let got: Option<Option<String>> = with_conn(&mut self.conn, &self.redis_url, |c| {
                redis::cmd("HGET").arg(&key).arg(DOMAIN).query(c)
            });
            if let Some(v) = got {
                polls += 1;
                if v.is_none() && lost.is_none() {
                    lost = Some(now);
                }
            }
        }
        if let Some(at) = lost {
            self.violate(
                "cluster2.domain_lost",
                Some(DOMAIN.into()),
                format!(
                    "the first cluster's domain {DOMAIN} was missing from NS:envoy at {at} while a second manager cluster ran on the namespace (its import surely applied, no Redis disturbance near)"
                ),
            );
        }
        notes.push(format!("{polls} NS:envoy checks of {DOMAIN}"));
        // Stop it: SIGTERM, exit 0; no panic in its log.
        let log_path = self.logs.join("manager-x0-second-cluster.log");
        let st = tokio::task::block_in_place(|| {
            m.proc
                .signal_and_wait(libc::SIGTERM, Duration::from_secs(10))
        });
        let log = m.proc.log();
        let _ = std::fs::write(&log_path, &log);
        if !st.is_some_and(|s| s.success()) {
            self.violate(
                "crash.manager_sigterm",
                None,
                format!(
                    "second cluster x0 after SIGTERM: {st:?}\n{}",
                    tail(&log, 20)
                ),
            );
            m.proc.kill();
        }
        if let Some(line) = log.lines().find(|l| l.contains("panicked")) {
            self.violate(
                "crash.manager_panic",
                None,
                format!("second cluster x0: {line}"),
            );
        }
        let foreign = log.matches("another leader").count();
        notes.push(format!("stopped ({st:?}); {foreign} fence refusals logged"));
        drop(m);
        tokio::task::block_in_place(|| drop(etcd2));
        notes.join("; ")
    }
}
