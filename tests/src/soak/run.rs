//! The main loop: print the seed, start the world, create the tasks, start the hosts, check a
//! first quiet period (the baseline), then apply the planner's steps until the time is up,
//! end with a quiet period, shut everything down and check for leaks. On a violation: the
//! seed, the step, the steps so far, the invariant and its evidence, the logs directory kept,
//! and how to replay; exit non-zero.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::check::Violation;
use super::plan::{Planner, Step, Weights, count_kinds};
use super::world::{Settings, Stats, World};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The seed (printed first; the same seed gives the same steps).
    pub seed: u64,
    /// How long the steps run (the last quiet period and the shutdown come after).
    pub duration: Duration,
    /// Logs directory (kept on failure, removed on success unless `keep_logs`).
    pub logs: PathBuf,
    /// Step weights.
    pub weights: Weights,
    /// Tasks (names `t0`, `t1`, …).
    pub tasks: usize,
    /// Simulated hosts (the last runs under faketime), at least 3.
    pub hosts: usize,
    /// Record violations and go on instead of stopping at the first.
    pub keep_going: bool,
    /// Keep the logs directory after a successful run.
    pub keep_logs: bool,
    /// Every task keeps its first slice length (see [`Planner::initial_specs`]).
    pub fixed_slices: bool,
    /// Agent hosts (after the `hosts` SDK hosts), each asking its own `sluice-agent`.
    pub agents: Vec<super::agents::AgentApi>,
    /// The managers' `--lazy-after` (`None`: off).
    pub lazy_after: Option<String>,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// True once SIGINT or SIGTERM arrived: the soak stops stepping, shuts everything down (it
/// must not leave a process behind) and exits non-zero without judging the interrupted step.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Sets [`interrupted`] on SIGINT or SIGTERM.
fn watch_signals() {
    tokio::spawn(async {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        INTERRUPTED.store(true, Ordering::SeqCst);
        eprintln!("soak: interrupted; stopping everything it started");
    });
}

/// CPU seconds used by this process and its reaped children (every process the soak started
/// is reaped by the end; a loadgen's children are reaped by it).
fn cpu_seconds() -> f64 {
    let mut total = 0.0;
    for who in [libc::RUSAGE_SELF, libc::RUSAGE_CHILDREN] {
        // SAFETY: getrusage fills the struct we pass.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(who, &mut u) } == 0 {
            for tv in [u.ru_utime, u.ru_stime] {
                total += tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
            }
        }
    }
    total
}

fn report(v: &Violation) -> String {
    format!(
        "  invariant: {}\n  task:      {}\n  slice:     {}\n  evidence:  {}",
        v.invariant,
        v.task.as_deref().unwrap_or("-"),
        v.slice.map_or("-".to_string(), |s| s.to_string()),
        v.evidence
    )
}

/// The steps applied so far.
struct Log {
    t0: Instant,
    history: Vec<String>,
    steps: Vec<Step>,
    seen: usize,
}

impl Log {
    /// Applies step `i`, lets its gap pass, and reports new violations (true if any).
    async fn step(&mut self, w: &mut World, i: u64, step: Step, gap_ms: u64) -> bool {
        let line = format!("step {i} +{:.1}s: {step}", self.t0.elapsed().as_secs_f64());
        w.say(&line);
        let note = w.apply(&step).await;
        w.say(&format!("    → {note}"));
        self.history.push(format!("{line} → {note}"));
        self.steps.push(step);
        w.idle(gap_ms).await;
        if interrupted() {
            // What an interrupted step saw is not evidence.
            w.violations.truncate(self.seen);
            return false;
        }
        let new = &w.violations[self.seen..];
        for v in new.iter().take(3) {
            eprintln!("VIOLATION after step {i}:\n{}", report(v));
        }
        if new.len() > 3 {
            eprintln!("… and {} more violations after step {i}", new.len() - 3);
        }
        self.seen = w.violations.len();
        !new.is_empty()
    }
}

/// Runs a soak; true when every invariant held.
pub async fn run(o: Options) -> bool {
    println!("soak seed {}", o.seed);
    watch_signals();
    let ns = format!("soak{}x{}", std::process::id(), o.seed % 1_000);
    let all_hosts = o.hosts + o.agents.len();
    let mut planner = Planner::new(o.seed, o.weights.clone(), o.tasks, all_hosts);
    planner.shape.agents = o.agents.len();
    let specs = planner.initial_specs(o.fixed_slices);
    let t0 = Instant::now();
    let cpu0 = cpu_seconds();
    let mut w = World::start(Settings {
        ns: ns.clone(),
        logs: o.logs.clone(),
        tasks: o.tasks,
        shape: planner.shape.clone(),
        seed: o.seed,
        agents: o.agents.clone(),
        lazy_after: o.lazy_after.clone(),
    })
    .await;
    w.say(&format!(
        "soak seed {}: {} tasks, {} hosts (h{} under faketime), namespace {ns}, steps for {} s, logs {}",
        o.seed,
        o.tasks,
        o.hosts,
        o.hosts - 1,
        o.duration.as_secs(),
        o.logs.display()
    ));
    w.locks = Some(super::locks::Track::start(&ns, &o.logs, o.seed));
    w.say(&format!(
        "offered decisions per second per host, by task: {:?}",
        planner.shape.host_rate
    ));
    if !o.agents.is_empty() {
        let a: Vec<String> = (o.agents.iter().enumerate())
            .map(|(i, a)| format!("h{} {}", o.hosts + i, a.name()))
            .collect();
        w.say(&format!(
            "agent hosts (a sluice-agent each): {}",
            a.join(", ")
        ));
    }
    w.say(&format!(
        "managers' --lazy-after: {} (by default every other seed: seed % 2 = 0)",
        o.lazy_after.as_deref().unwrap_or("off")
    ));
    w.say(&format!(
        "mode focus: {} (seed % 5 = {}; heavier in put.mode and new specs, t0 starts in it)",
        planner.focus,
        o.seed % 5
    ));
    let mut history: Vec<String> = Vec::new();
    for (t, s) in specs.iter().enumerate() {
        let note = w.put(t, s).await;
        let line = format!("step 0 create t{t}: {} → {note}", s.describe());
        w.say(&line);
        history.push(line);
    }
    w.start_hosts();

    let mut log = Log {
        t0,
        history,
        steps: Vec::new(),
        seen: 0,
    };
    // Step 0 is a baseline quiet period: the system must be live before it is disturbed.
    let mut failed = log.step(&mut w, 0, Step::Quiet, 0).await;
    let mut index = 0u64;
    while t0.elapsed() < o.duration && (o.keep_going || !failed) && !interrupted() {
        index += 1;
        let p = planner.next_step();
        failed |= log.step(&mut w, index, p.step, p.gap_ms).await;
    }
    if (o.keep_going || !failed) && log.steps.last() != Some(&Step::Quiet) && !interrupted() {
        index += 1;
        failed |= log.step(&mut w, index, Step::Quiet, 0).await;
    }
    let Log {
        history,
        steps,
        seen,
        ..
    } = log;
    let last_step = index;
    let (mut violations, stats) = w.shutdown().await;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let new_at_end = violations.len() > seen;
    if new_at_end {
        for v in violations[seen..].iter().take(5) {
            eprintln!("VIOLATION at shutdown:\n{}", report(v));
        }
    }
    violations.dedup();
    let kinds = count_kinds(&steps);
    let Stats {
        coverage,
        fence_observations,
        liveness_checks,
        logs,
    } = stats;
    let summary = format!(
        "seed {}, {} steps in {wall:.0} s ({kinds:?}); checked {} slices ({} paced on the pace \
         curve), {} sliding windows, {} keys around grid changes, {} liveness slices in {liveness_checks} task checks \
         ({} slices and {} per-host checks not judged: the machine stalled), \
         {fence_observations} fencing observations; \
         CPU {:.0} % of one core ({:.0} % of 2 cores)",
        o.seed,
        steps.len(),
        coverage.slices,
        coverage.paced_slices,
        coverage.windows,
        coverage.redis_keys,
        coverage.live_slices,
        coverage.stalled_slices,
        coverage.stalled_host_checks,
        100.0 * cpu / wall,
        50.0 * cpu / wall,
    );
    let _ = std::fs::write(logs.join("summary.txt"), format!("{summary}\n"));
    if interrupted() {
        eprintln!(
            "\nsoak interrupted: {summary}\nlogs kept in {}",
            logs.display()
        );
        return false;
    }
    if failed || !violations.is_empty() {
        eprintln!("\nSOAK FAILED: {summary}");
        eprintln!("steps so far:");
        for h in &history {
            eprintln!("  {h}");
        }
        // The first violation of each invariant and task, with how often it was seen.
        let mut groups: Vec<(&Violation, usize)> = Vec::new();
        for v in &violations {
            match groups
                .iter_mut()
                .find(|(g, _)| g.invariant == v.invariant && g.task == v.task)
            {
                Some(g) => g.1 += 1,
                None => groups.push((v, 1)),
            }
        }
        eprintln!(
            "violations: {} ({} kinds); the first of each:",
            violations.len(),
            groups.len()
        );
        for (v, n) in groups {
            eprintln!("{}\n  seen:      {n} time(s)", report(v));
        }
        eprintln!("logs kept in {}", logs.display());
        eprintln!(
            "replay: scripts/soak.sh --seed {} --seconds {} (the same steps; step {last_step} is the last)",
            o.seed,
            (wall.ceil() as u64).max(o.duration.as_secs())
        );
        return false;
    }
    println!("soak passed: {summary}");
    if o.keep_logs {
        println!("logs kept in {}", logs.display());
    } else {
        let _ = std::fs::remove_dir_all(&logs);
    }
    true
}
