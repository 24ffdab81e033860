//! The world's agent hosts (see [`super::super::agents`]): start, SIGKILL and restart, watch,
//! and stop their `sluice-agent` processes.

use super::World;
use crate::now_ms;

impl World {
    /// Starts the agent of every agent host.
    pub(super) fn start_agents(&mut self) {
        let url = self.redis_url.clone();
        let mut failed = Vec::new();
        for h in &mut self.hosts {
            if let Some(a) = h.agent.as_mut()
                && let Err(e) = a.start(&url)
            {
                failed.push(e);
            }
        }
        for e in failed {
            self.violate("crash.agent_start", None, e);
        }
    }

    /// `host.kill` of an agent host: SIGKILL its agent, restart it on the same ports and
    /// segment after `down_ms` (its drivers keep asking meanwhile). `d`: the disturbance.
    pub(super) async fn kill_agent(&mut self, host: usize, down_ms: u64, d: usize) -> String {
        let Some(a) = self.hosts[host].agent.as_mut() else {
            return "not an agent host".into();
        };
        a.kill();
        let id = a.host_id.clone();
        self.idle(down_ms).await;
        let url = self.redis_url.clone();
        let r = tokio::task::block_in_place(|| {
            self.hosts[host]
                .agent
                .as_mut()
                .map(|a| a.start(&url))
                .unwrap_or(Ok(()))
        });
        if let Err(e) = &r {
            self.violate("crash.agent_start", None, e.clone());
        }
        self.hosts[host].down = false;
        self.tend_runs();
        self.ledger.end(d, now_ms());
        format!(
            "SIGKILLed the agent of {id} (h{host}); restarted after {down_ms} ms: {}",
            if r.is_ok() { "up" } else { "did not start" }
        )
    }

    /// An agent that should run and exited is a crash.
    pub(super) fn check_agents(&mut self) {
        let mut found = Vec::new();
        for h in &mut self.hosts {
            if let Some(a) = h.agent.as_mut()
                && a.should_run()
                && !a.is_running()
            {
                found.push(format!(
                    "sluice-agent {} exited unexpectedly:\n{}",
                    a.host_id,
                    a.log_tail(30)
                ));
                a.forget();
            }
        }
        for e in found {
            self.violate("crash.agent", None, e);
        }
    }

    /// At the end: SIGTERM every agent (it must exit 0), then no agent log may hold a panic.
    pub(super) fn stop_agents(&mut self) {
        let mut found = Vec::new();
        for h in &mut self.hosts {
            if let Some(a) = h.agent.as_mut() {
                if let Err(e) = a.stop() {
                    found.push(("crash.agent_sigterm", e));
                }
                for p in a.panics() {
                    found.push(("crash.agent_panic", p));
                }
            }
        }
        for (inv, e) in found {
            self.violate(inv, None, e);
        }
    }
}
