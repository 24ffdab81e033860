//! The randomized lifecycle + fault soak (see `docs/soak.md`; the program is
//! `sluice_tests::soak`). Usually run through `scripts/soak.sh`, which builds what it needs.
//!
//! ```text
//! soak [--seed S] (--minutes N | --seconds N) [--tasks N] [--hosts N] [--weights k=w,…]
//!      [--fixed-slices] [--logs DIR] [--keep-going] [--keep-logs] [--lazy-after D|off]
//! ```
//!
//! Exit status: 0 every invariant held, 1 a violation, 2 bad usage.

use std::path::PathBuf;
use std::time::Duration;

use sluice_tests::soak::agents::AgentApi;
use sluice_tests::soak::plan::{DEFAULT_WEIGHTS, Weights};
use sluice_tests::soak::run::{Options, run};

const USAGE: &str = "usage: soak [--seed S] (--minutes N | --seconds N) [--tasks N] [--hosts N] \
[--weights name=w,…] [--fixed-slices] [--logs DIR] [--keep-going] [--keep-logs] \
[--agents rls,http|none] [--lazy-after D|off]";

fn parse() -> Result<Options, String> {
    let mut seed = None;
    let mut secs = None;
    let mut tasks = 3;
    let mut hosts = 3;
    let mut weights = Weights::default();
    let mut logs = None;
    let mut keep_going = false;
    let mut keep_logs = false;
    let mut fixed_slices = false;
    let mut agents = None;
    let mut lazy_after: Option<Option<String>> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        let num = |v: String, name: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: {v:?} is not a number"))
        };
        match a.as_str() {
            "--seed" => seed = Some(num(value("--seed")?, "--seed")?),
            "--minutes" => secs = Some(60 * num(value("--minutes")?, "--minutes")?),
            "--seconds" => secs = Some(num(value("--seconds")?, "--seconds")?),
            "--tasks" => tasks = num(value("--tasks")?, "--tasks")? as usize,
            "--hosts" => hosts = num(value("--hosts")?, "--hosts")? as usize,
            "--weights" => weights = Weights::parse(&value("--weights")?)?,
            "--logs" => logs = Some(PathBuf::from(value("--logs")?)),
            "--keep-going" => keep_going = true,
            "--keep-logs" => keep_logs = true,
            "--fixed-slices" => fixed_slices = true,
            "--agents" => agents = Some(AgentApi::parse_list(&value("--agents")?)?),
            "--lazy-after" => {
                let v = value("--lazy-after")?;
                lazy_after = Some((v != "off").then_some(v));
            }
            "-h" | "--help" => {
                let kinds: Vec<String> = DEFAULT_WEIGHTS
                    .iter()
                    .map(|(k, w)| format!("{k}={w}"))
                    .collect();
                return Err(format!(
                    "{USAGE}\nstep kinds and default weights: {}",
                    kinds.join(",")
                ));
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let secs = secs.ok_or(format!("--minutes or --seconds is required\n{USAGE}"))?;
    if !(1..=20).contains(&tasks) {
        return Err("--tasks must be 1..=20".into());
    }
    if !(3..=8).contains(&hosts) {
        return Err("--hosts must be 3..=8".into());
    }
    // A seed from the clock and the pid when none is given (it is printed first).
    let seed = seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        (t ^ u64::from(std::process::id()).rotate_left(32)) % 1_000_000_000
    });
    let logs = logs.unwrap_or_else(|| {
        // target/soak-logs/…, next to (not inside) the profile directory holding this binary.
        let target = sluice_tests::target_dir();
        target
            .parent()
            .unwrap_or(&target)
            .join("soak-logs")
            .join(format!("seed-{seed}-{}", std::process::id()))
    });
    Ok(Options {
        seed,
        duration: Duration::from_secs(secs),
        logs,
        weights,
        tasks,
        hosts,
        keep_going,
        keep_logs,
        fixed_slices,
        agents: agents.unwrap_or_else(|| AgentApi::default_for(seed)),
        // Every other seed runs the managers with lazy idle tasks (protocol 5).
        lazy_after: lazy_after.unwrap_or_else(|| (seed % 2 == 0).then(|| "3s".to_string())),
    })
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let ok = rt.block_on(run(o));
    std::process::exit(if ok { 0 } else { 1 });
}
