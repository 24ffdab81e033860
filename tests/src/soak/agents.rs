//! Agent hosts: simulated hosts that decide through a `sluice-agent` process instead of the
//! SDK in-process — over Envoy RLS v3 (`ShouldRateLimit`, direct-form descriptors
//! `sluice_task = T`) or HTTP (`POST /v1/decide`). Each runs one agent (its own `--host-id`,
//! so its own host segment in `/dev/shm`) on fixed loopback ports, and one `agent_host` driver
//! run per task (tests/src/bin/agent_host.rs) in place of a `loadgen` run: the same rotation,
//! the same progress lines, the same ledger columns — so `safety.slice`, `safety.window`,
//! `safety.redis_adm` and liveness cover the agent's decisions like any host's.
//!
//! `host.kill` of an agent host SIGKILLs the agent and restarts it on the same ports and
//! segment after the step's downtime (its drivers keep asking; answers that do not come are
//! errors, counted nowhere). At the end the agent must exit 0 on SIGTERM, and no agent log may
//! hold "panicked" (`crash.agent_*`).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{Proc, free_port, http_get_blocking, workspace_bin};

/// An agent host offers this share of a host's rate per task (a debug-built agent on the
/// shared 2-core machine answered 150–400 decisions/s per task at p50 ≈ 200 ms; at a quarter
/// of the rate it keeps up).
pub const AGENT_RATE_SHARE: f64 = 0.25;

/// How an agent host's drivers ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentApi {
    /// Envoy RLS v3 over gRPC.
    Rls,
    /// `POST /v1/decide`.
    Http,
}

impl AgentApi {
    /// `rls` / `http`.
    pub fn name(self) -> &'static str {
        match self {
            AgentApi::Rls => "rls",
            AgentApi::Http => "http",
        }
    }

    /// The default: one agent host, RLS for odd seeds and HTTP for even ones.
    pub fn default_for(seed: u64) -> Vec<AgentApi> {
        vec![if seed % 2 == 1 {
            AgentApi::Rls
        } else {
            AgentApi::Http
        }]
    }

    /// Parses a `--agents` list: `rls,http`, `none` or empty for none.
    pub fn parse_list(text: &str) -> Result<Vec<AgentApi>, String> {
        let mut v = Vec::new();
        for p in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match p {
                "rls" => v.push(AgentApi::Rls),
                "http" => v.push(AgentApi::Http),
                "none" => {}
                other => return Err(format!("--agents: {other:?} is not rls, http or none")),
            }
        }
        if v.len() > 4 {
            return Err("--agents: at most 4 agent hosts".into());
        }
        Ok(v)
    }
}

/// One agent host's `sluice-agent` process.
pub struct AgentProc {
    /// The API its drivers use.
    pub api: AgentApi,
    /// `--host-id`.
    pub host_id: String,
    /// gRPC listener.
    pub grpc: String,
    /// HTTP listener.
    pub http: String,
    redis_url: String,
    ns: String,
    logs: PathBuf,
    /// Restarts so far (the log file's number).
    pub generation: u32,
    proc: Option<Proc>,
}

impl AgentProc {
    /// An agent for `host_id` (not started).
    pub fn new(api: AgentApi, host_id: &str, redis_url: &str, ns: &str, logs: PathBuf) -> Self {
        Self {
            api,
            host_id: host_id.to_string(),
            grpc: format!("127.0.0.1:{}", free_port()),
            http: format!("127.0.0.1:{}", free_port()),
            redis_url: redis_url.to_string(),
            ns: ns.to_string(),
            logs,
            generation: 0,
            proc: None,
        }
    }

    fn log_path(&self) -> PathBuf {
        self.logs
            .join(format!("agent-{}-{}.log", self.host_id, self.generation))
    }

    /// Starts the agent (blocking: waits up to 10 s for `/healthz`); Err with its log's tail
    /// when it does not come up.
    pub fn start(&mut self, redis_url: &str) -> Result<(), String> {
        self.redis_url = redis_url.to_string();
        self.generation += 1;
        let mut cmd = Command::new(workspace_bin("sluice-agent"));
        cmd.args(["--redis", &self.redis_url])
            .args(["--namespace", &self.ns])
            .args(["--host-id", &self.host_id])
            .args(["--grpc-listen", &self.grpc])
            .args(["--http-listen", &self.http])
            .env("RUST_LOG", "sluice=info,sluice_agent=info");
        let mut p = Proc::spawn(
            &format!("sluice-agent {}", self.host_id),
            cmd,
            self.log_path(),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let url = format!("http://{}/healthz", self.http);
        loop {
            if http_get_blocking(&url).is_some_and(|(s, _)| s == 200) {
                self.proc = Some(p);
                return Ok(());
            }
            if !p.is_running() || Instant::now() >= deadline {
                let log = p.log();
                p.kill();
                let lines: Vec<&str> = log.lines().collect();
                return Err(format!(
                    "sluice-agent {} did not answer /healthz within 10 s:\n{}",
                    self.host_id,
                    lines[lines.len().saturating_sub(20)..].join("\n")
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL (the segment stays, as after a crash).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// True while the process runs (false when the soak stopped it).
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(|p| p.is_running())
    }

    /// True when it should run (started and not killed by the soak).
    pub fn should_run(&self) -> bool {
        self.proc.is_some()
    }

    /// The tail of its current log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.proc.as_ref().map(|p| p.log()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Forgets a process that exited on its own (after its crash was reported).
    pub fn forget(&mut self) {
        self.proc = None;
    }

    /// SIGTERM: Ok when it exits 0 within 10 s.
    pub fn stop(&mut self) -> Result<(), String> {
        let Some(mut p) = self.proc.take() else {
            return Ok(());
        };
        let pid = p.pid();
        crate::signal(pid, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.is_running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if p.is_running() {
            p.kill();
            return Err(format!(
                "sluice-agent {} still ran 10 s after SIGTERM",
                self.host_id
            ));
        }
        match p.exit_code() {
            Some(0) => Ok(()),
            other => Err(format!(
                "sluice-agent {} exited {other:?} after SIGTERM",
                self.host_id
            )),
        }
    }

    /// The driver of one run: `task` at `rate` decisions/s for `duration_ms`.
    pub fn driver(&self, task: &str, rate: f64, duration_ms: u64, progress: &str) -> Command {
        let mut cmd = Command::new(workspace_bin("agent_host"));
        cmd.args(["--api", self.api.name()])
            .args(["--grpc", &self.grpc])
            .args(["--http", &self.http])
            .args(["--host", &self.host_id])
            .args(["--task", task])
            .args(["--rate", &format!("{rate:.1}")])
            .args(["--duration-ms", &duration_ms.to_string()])
            .args(["--progress", progress]);
        cmd
    }

    /// Every log line of every generation holding "panicked".
    pub fn panics(&self) -> Vec<String> {
        (1..=self.generation)
            .filter_map(|g| {
                let p = self.logs.join(format!("agent-{}-{g}.log", self.host_id));
                let text = std::fs::read_to_string(&p).ok()?;
                let line = text.lines().find(|l| l.contains("panicked"))?;
                Some(format!("{}: {line}", p.display()))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::check::{Coverage, SliceRead, Slices, check_liveness};
    use super::super::ledger::{ApiVersion, Ledger};
    use super::super::spec::Spec;
    use super::*;

    struct Caps(u64);

    impl Slices for Caps {
        fn read(&mut self, _task: usize, starts: &[i64]) -> Option<Vec<Option<SliceRead>>> {
            Some(vec![
                Some(SliceRead {
                    cap: self.0,
                    adm: 0,
                    pace_burst: None,
                    len: 0,
                });
                starts.len()
            ])
        }
    }

    /// An agent host's admission whose answer arrived in a later slice may have been charged
    /// to the slice it was in flight during: liveness counts it there as possible (`reach`),
    /// so a slice the agent drained with late answers is no liveness violation; a slice where
    /// nobody admitted and nothing was in flight still is.
    #[test]
    fn liveness_counts_what_an_agent_had_in_flight() {
        let spec = Spec {
            threshold: 38,
            slice_ms: 100,
            local_limit: 38,
            on_failure: "local",
            mode: "pooled",
            fallback: None,
            schedules: Vec::new(),
            dynamic: None,
            modes: Default::default(),
        };
        let mut l = Ledger::new(1, 2);
        l.api[0].push(ApiVersion {
            at_ms: 0,
            spec: Some(spec),
            confirmed: true,
        });
        for b in (10_000..11_000).step_by(100) {
            l.count(0, 0, b, 18, 30, 0, 0); // the SDK host: 18 of 38, 30 refused
            l.count(0, 1, b, 0, 5, 0, 0); // the agent host: its answers arrive later
            l.count_reach(0, 1, b, 20); // … for 20 admissions in flight here
        }
        let mut cov = Coverage::default();
        let v = check_liveness(
            &l,
            0,
            10_000,
            11_000,
            &[true, true],
            Some(0),
            &mut Caps(38),
            &mut cov,
        );
        assert!(v.is_empty(), "{v:?}");
        let mut bare = Ledger::new(1, 2);
        bare.api = l.api.clone();
        for b in (10_000..11_000).step_by(100) {
            bare.count(0, 0, b, 18, 30, 0, 0);
            bare.count(0, 1, b, 0, 5, 0, 0);
        }
        let v = check_liveness(
            &bare,
            0,
            10_000,
            11_000,
            &[true, true],
            Some(0),
            &mut Caps(38),
            &mut cov,
        );
        assert!(v.iter().any(|v| v.invariant == "liveness.total"), "{v:?}");
        assert!(v.iter().any(|v| v.invariant == "liveness.host"), "{v:?}");
    }

    #[test]
    fn agent_lists_parse() {
        assert_eq!(
            AgentApi::parse_list("rls,http").unwrap(),
            vec![AgentApi::Rls, AgentApi::Http]
        );
        assert!(AgentApi::parse_list("none").unwrap().is_empty());
        assert!(AgentApi::parse_list("").unwrap().is_empty());
        assert!(AgentApi::parse_list("grpc").is_err());
    }
}
