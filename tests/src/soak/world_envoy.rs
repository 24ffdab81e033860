//! The world's Envoy part (see [`super::super::envoy`]): the imports and deletions through the
//! manager's API, the RLS agent host's drivers for the domain's descriptors, and the checks.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use serde_json::Value;
use sluice_protocol::{Keys, meta_field};

use super::super::agents::AgentApi;
use super::super::check::{self, SliceRead, Slices};
use super::super::envoy::{
    Answers, DESCRIPTORS, DOMAIN, ENVOY_RATE, check_answers, spec_of, task_of, yaml,
};
use super::super::ledger::{ApiVersion, Ledger, MetaState};
use super::super::spec::Class;
use super::{World, count_field, signal, tail, with_conn};
use crate::{http, now_ms};

/// One long-running driver of a descriptor.
struct Driver {
    child: Option<Child>,
    progress: PathBuf,
    out: PathBuf,
    err: PathBuf,
    pos: u64,
    partial: String,
}

/// The Envoy state of a world.
pub(super) struct EnvoyWorld {
    /// Spec versions of the descriptors' tasks (hosts: the RLS agent host only).
    ledger: Ledger,
    answers: Vec<BTreeMap<i64, Answers>>,
    safety_until: Vec<i64>,
    answers_until: Vec<i64>,
    drivers: Vec<Option<Driver>>,
    seq: u64,
    /// Imports made (for the summary).
    pub(super) imports: u64,
    /// The end: no driver is started again.
    stopped: bool,
}

impl Default for EnvoyWorld {
    fn default() -> Self {
        let n = DESCRIPTORS.len();
        let t0 = now_ms();
        Self {
            ledger: Ledger::new(n, 1),
            answers: vec![BTreeMap::new(); n],
            safety_until: vec![t0; n],
            answers_until: vec![t0; n],
            drivers: (0..n).map(|_| None).collect(),
            seq: 0,
            imports: 0,
            stopped: false,
        }
    }
}

/// Slice hashes of the descriptors' tasks.
struct EnvSlices<'a> {
    conn: &'a mut Option<redis::Connection>,
    url: &'a str,
    keys: &'a Keys,
}

impl Slices for EnvSlices<'_> {
    fn read(&mut self, task: usize, starts: &[i64]) -> Option<Vec<Option<SliceRead>>> {
        super::read_slices(self.conn, self.url, self.keys, &task_of(task), starts)
    }
}

impl World {
    /// The RLS agent host, if any.
    fn rls_host(&self) -> Option<usize> {
        self.hosts
            .iter()
            .position(|h| h.agent.as_ref().is_some_and(|a| a.api == AgentApi::Rls))
    }

    /// Records a version of descriptor `i`.
    fn envoy_record(&mut self, i: usize, at: i64, rpu: Option<u64>, confirmed: bool) {
        self.envoy.ledger.api[i].push(ApiVersion {
            at_ms: at,
            spec: rpu.map(spec_of),
            confirmed,
        });
    }

    /// The recorded versions of descriptor `i`.
    pub(super) fn envoy_versions(&self, i: usize) -> &[ApiVersion] {
        &self.envoy.ledger.api[i]
    }

    /// Whether descriptor `i`'s newest recorded version is a live limit.
    fn envoy_live(&self, i: usize) -> bool {
        self.envoy.ledger.api[i]
            .last()
            .is_some_and(|v| v.spec.is_some())
    }

    /// `POST /api/v1/import/envoy-ratelimit` with the config of `limits`.
    pub(super) async fn envoy_import(&mut self, limits: &[Option<u64>]) -> String {
        let Some(addr) = self.api_target() else {
            return "no replica to ask".into();
        };
        let body = yaml(limits);
        let at = now_ms();
        let r = http()
            .post(format!("http://{addr}/api/v1/import/envoy-ratelimit"))
            .header("content-type", "application/yaml")
            .body(body.clone())
            .send()
            .await;
        let confirmed = match r {
            Ok(r) if r.status().is_success() => {
                let v: Value = r.json().await.unwrap_or(Value::Null);
                self.envoy.imports += 1;
                let note = format!(
                    "200 via {addr}: created {}, updated {}, deleted {}",
                    v["created"], v["updated"], v["deleted"]
                );
                Some((true, note))
            }
            Ok(r) if r.status().as_u16() == 503 => {
                return format!("503 via {addr} (not written)");
            }
            Ok(r) => {
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                self.violate(
                    "api.rejected",
                    Some(DOMAIN.into()),
                    format!("import of\n{body}answered {status}: {text}"),
                );
                return format!("{status}");
            }
            Err(e) => Some((false, format!("no answer from {addr} ({e}): maybe written"))),
        };
        let (ok, note) = confirmed.unwrap_or((false, String::new()));
        for (i, l) in limits.iter().enumerate() {
            if l.is_some() || self.envoy_live(i) {
                self.envoy_record(i, at, *l, ok);
            }
        }
        note
    }

    /// `DELETE /api/v1/import/envoy-ratelimit/soakenv`.
    pub(super) async fn envoy_delete(&mut self) -> String {
        let Some(addr) = self.api_target() else {
            return "no replica to ask".into();
        };
        let at = now_ms();
        let r = http()
            .delete(format!(
                "http://{addr}/api/v1/import/envoy-ratelimit/{DOMAIN}"
            ))
            .send()
            .await;
        let (ok, note) = match r {
            Ok(r) if r.status().is_success() => {
                let v: Value = r.json().await.unwrap_or(Value::Null);
                (true, format!("200 via {addr}: deleted {}", v["deleted"]))
            }
            Ok(r) if r.status().as_u16() == 404 => return "404 (not there)".into(),
            Ok(r) if r.status().as_u16() == 503 => {
                return format!("503 via {addr} (not deleted)");
            }
            Ok(r) => {
                let status = r.status();
                self.violate(
                    "api.rejected",
                    Some(DOMAIN.into()),
                    format!("DELETE of domain {DOMAIN} answered {status}"),
                );
                return format!("{status}");
            }
            Err(e) => (false, format!("no answer from {addr} ({e}): maybe deleted")),
        };
        for i in 0..DESCRIPTORS.len() {
            if self.envoy_live(i) {
                self.envoy_record(i, at, None, ok);
            }
        }
        note
    }

    /// Starts the drivers of the descriptors on the RLS agent host (once: they run until the
    /// end; one that exits is a crash and is started again).
    fn envoy_tend(&mut self) {
        let Some(h) = self.rls_host() else { return };
        if self.hosts[h].down || self.envoy.stopped {
            return;
        }
        let mut crashed = Vec::new();
        for (i, value) in DESCRIPTORS.iter().enumerate() {
            if let Some(d) = self.envoy.drivers[i].as_mut()
                && let Some(c) = d.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                d.child = None;
                crashed.push(format!(
                    "the RLS driver of {} exited {st}:\n{}",
                    task_of(i),
                    tail(&std::fs::read_to_string(&d.err).unwrap_or_default(), 10)
                ));
            }
            if self.envoy.drivers[i]
                .as_ref()
                .is_some_and(|d| d.child.is_some())
            {
                continue;
            }
            self.envoy.seq += 1;
            let base = self
                .logs
                .join("runs")
                .join(format!("envoy-{:03}-path_{value}", self.envoy.seq));
            let progress = base.with_extension("progress");
            let out = base.with_extension("out");
            let err = base.with_extension("err");
            let Some(a) = self.hosts[h].agent.as_ref() else {
                return;
            };
            let mut cmd = a.driver(
                &task_of(i),
                ENVOY_RATE,
                100 * 86_400_000,
                &progress.display().to_string(),
            );
            cmd.args(["--domain", DOMAIN])
                .args(["--descriptor", &format!("path={value}")]);
            let child = cmd
                .stdin(Stdio::null())
                .stdout(File::create(&out).expect("create driver stdout"))
                .stderr(File::create(&err).expect("create driver stderr"))
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start agent_host: {e}"));
            self.envoy.drivers[i] = Some(Driver {
                child: Some(child),
                progress,
                out,
                err,
                pos: 0,
                partial: String::new(),
            });
        }
        for e in crashed {
            self.violate("crash.loadgen_exit", Some(DOMAIN.into()), e);
        }
    }

    /// Reads the drivers' new progress lines.
    fn envoy_read(&mut self) {
        let mut bad = Vec::new();
        for i in 0..DESCRIPTORS.len() {
            let Some(d) = self.envoy.drivers[i].as_mut() else {
                continue;
            };
            let complete = super::new_lines(&d.progress, &mut d.pos, &mut d.partial);
            for line in complete.lines() {
                let v: Option<Value> = serde_json::from_str(line).ok();
                let p = v.as_ref().and_then(|v| {
                    Some((
                        v["bucket"].as_i64()?,
                        v["adm"].as_u64()?,
                        v["rej"].as_u64()?,
                        v["fb"].as_u64()?,
                        // Absent on a driver's late `reach` lines.
                        v["nolim"].as_u64().unwrap_or(0),
                        v["lmin"].as_i64().unwrap_or(-1),
                        v["lmax"].as_i64().unwrap_or(-1),
                    ))
                });
                match p {
                    Some((b, adm, rej, fb, nolim, lmin, lmax)) if b % 100 == 0 && fb <= adm => {
                        self.envoy.ledger.count(i, 0, b, adm, rej, fb, 0);
                        self.envoy.answers[i]
                            .entry(b)
                            .or_default()
                            .add(adm, rej, nolim, lmin, lmax);
                    }
                    _ => bad.push(format!("bad progress line of {}: {line:?}", task_of(i))),
                }
            }
        }
        for e in bad {
            self.violate("loadgen.progress", Some(DOMAIN.into()), e);
        }
    }

    /// The descriptors' tasks' meta, as the hosts see it.
    fn envoy_poll_meta(&mut self) {
        let names: Vec<String> = (0..DESCRIPTORS.len()).map(task_of).collect();
        let keys = &self.keys;
        type Row = (Option<String>, Option<String>, Option<String>);
        let rows: Option<Vec<Row>> = with_conn(&mut self.conn, &self.redis_url, |c| {
            let mut pipe = redis::pipe();
            for n in &names {
                pipe.cmd("HMGET")
                    .arg(keys.meta(n))
                    .arg(meta_field::SLICE_MS)
                    .arg(meta_field::MODE)
                    .arg(meta_field::RETIRED);
            }
            pipe.query(c)
        });
        let Some(rows) = rows else { return };
        let at = now_ms();
        for (t, (slice_ms, mode, retired)) in rows.into_iter().enumerate() {
            let state = match (retired, count_field(slice_ms), mode) {
                (Some(_), _, _) => MetaState::Tombstone,
                (None, Some(l), Some(m)) if (100..=86_400_000).contains(&l) => MetaState::Live {
                    slice_ms: l,
                    class: Class::of_mode(&m),
                },
                _ => MetaState::Missing,
            };
            self.envoy.ledger.observe_meta(t, at, state);
        }
    }

    /// Once a second: drivers, progress, meta, and the checks.
    pub(super) fn envoy_monitor(&mut self, until_now: bool) {
        self.envoy_tend();
        self.envoy_read();
        self.envoy_poll_meta();
        self.envoy.ledger.disturbances = self.ledger.disturbances.clone();
        let Some(h) = self.rls_host() else { return };
        let now = now_ms();
        let lag = if until_now {
            0
        } else {
            self.timing.data_lag_ms
        };
        let mut found = Vec::new();
        for i in 0..DESCRIPTORS.len() {
            if self.envoy.ledger.api[i].is_empty() {
                self.envoy.safety_until[i] = now - lag;
                self.envoy.answers_until[i] = now - lag;
                continue;
            }
            let last_obs = self.envoy.ledger.meta[i].last().map_or(now, |r| r.last_ms);
            let upto = (now - lag).min(last_obs - 200);
            let mut reader = EnvSlices {
                conn: &mut self.conn,
                url: &self.redis_url,
                keys: &self.keys,
            };
            let (v, next) = check::check_safety(
                &self.envoy.ledger,
                i,
                self.envoy.safety_until[i],
                upto,
                &mut reader,
                &self.timing,
                &mut self.coverage,
            );
            self.envoy.safety_until[i] = next;
            found.extend(v.into_iter().map(|mut v| {
                v.evidence = format!("{} (RLS, domain {DOMAIN}): {}", task_of(i), v.evidence);
                v.task = Some(task_of(i));
                v
            }));
            // The drivers close a bucket up to 2 s after its end.
            let a_upto = now - lag - 2_000;
            if a_upto > self.envoy.answers_until[i] {
                found.extend(check_answers(
                    &self.envoy.ledger,
                    i,
                    &self.envoy.answers[i],
                    self.envoy.answers_until[i],
                    a_upto,
                    h,
                    &self.timing,
                ));
                self.envoy.answers_until[i] = a_upto;
            }
            let keep = self.envoy.answers_until[i] - 300_000;
            self.envoy.answers[i] = self.envoy.answers[i].split_off(&keep);
        }
        let oldest = self.envoy.safety_until.iter().copied().min().unwrap_or(now);
        self.envoy.ledger.prune(oldest - 300_000);
        self.violations.extend(found);
    }

    /// At the end: SIGTERM the drivers (each must exit 0 with its JSON line), read them out,
    /// check everything up to now.
    pub(super) fn envoy_shutdown(&mut self) {
        self.envoy.stopped = true;
        let mut found = Vec::new();
        for i in 0..DESCRIPTORS.len() {
            let Some(d) = self.envoy.drivers[i].as_mut() else {
                continue;
            };
            let Some(mut c) = d.child.take() else {
                continue;
            };
            signal(c.id(), libc::SIGTERM);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let st = loop {
                if let Ok(Some(st)) = c.try_wait() {
                    break Some(st);
                }
                if std::time::Instant::now() >= deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let out = std::fs::read_to_string(&d.out).unwrap_or_default();
            if !st.is_some_and(|s| s.success()) || out.lines().count() != 1 {
                found.push(format!(
                    "the RLS driver of {} after SIGTERM: {st:?}, stdout {out:?}",
                    task_of(i)
                ));
            }
        }
        for e in found {
            self.violate("loadgen.sigterm", Some(DOMAIN.into()), e);
        }
        self.envoy_read();
        self.envoy_monitor(true);
    }
}
