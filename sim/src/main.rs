//! `sluice-sim`: runs seeded worlds (see `sluice_sim::world`) and reports.
//!
//! ```text
//! sluice-sim --seed S [--minutes M] [--verbose]     one world; its trace hash
//! sluice-sim --seeds N [--from S0] [--minutes M] [--jobs J]
//!                                                   N worlds (S0, S0+1, …; random S0 if absent),
//!                                                   J at a time (default: the cores)
//! sluice-sim --determinism S                        runs S twice, compares the trace hashes
//!   --only-faults 3,17   apply only these faults (the numbers a shrunk failure prints)
//!   --no-shrink          on a failure, do not look for the fewest faults that still fail
//! ```
//! Exit status 1 when a world breaks an invariant (its seed, what broke, the fewest faults
//! that still break it and the command that replays that are printed), 2 on bad flags.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Instant;

use sluice_sim::world::{self, Config, Outcome};

struct Args {
    seed: Option<u64>,
    seeds: Option<u64>,
    from: Option<u64>,
    minutes: f64,
    determinism: Option<u64>,
    verbose: bool,
    no_faults: bool,
    jobs: usize,
    only_faults: Option<std::collections::BTreeSet<u64>>,
    shrink: bool,
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("sluice-sim: {msg}");
    eprintln!(
        "usage: sluice-sim (--seed S | --seeds N [--from S0] [--jobs J] | --determinism S) [--minutes M] [--no-faults] [--verbose]"
    );
    ExitCode::from(2)
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seed: None,
        seeds: None,
        from: None,
        minutes: 5.0,
        determinism: None,
        verbose: false,
        no_faults: false,
        jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
        only_faults: None,
        shrink: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let num = |name: &str, v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: {v:?} is not an unsigned integer"))
        };
        match flag.as_str() {
            "--seed" => a.seed = Some(num("--seed", value("--seed")?)?),
            "--seeds" => a.seeds = Some(num("--seeds", value("--seeds")?)?),
            "--from" => a.from = Some(num("--from", value("--from")?)?),
            "--determinism" => a.determinism = Some(num("--determinism", value("--determinism")?)?),
            "--minutes" => {
                let v = value("--minutes")?;
                a.minutes = v
                    .parse::<f64>()
                    .ok()
                    .filter(|m| *m > 0.0 && *m <= 1440.0)
                    .ok_or_else(|| {
                        format!("--minutes: {v:?} is not a number of minutes in (0, 1440]")
                    })?;
            }
            "--jobs" => {
                let v = value("--jobs")?;
                a.jobs = v
                    .parse::<usize>()
                    .ok()
                    .filter(|j| (1..=256).contains(j))
                    .ok_or_else(|| format!("--jobs: {v:?} is not a number in 1..=256"))?;
            }
            "--only-faults" => {
                let v = value("--only-faults")?;
                let set = v
                    .split(',')
                    .filter(|x| !x.trim().is_empty())
                    .map(|x| {
                        x.trim()
                            .parse::<u64>()
                            .map_err(|_| format!("--only-faults: {x:?} is not a fault number"))
                    })
                    .collect::<Result<_, _>>()?;
                a.only_faults = Some(set);
            }
            "--no-shrink" => a.shrink = false,
            "--verbose" => a.verbose = true,
            "--no-faults" => a.no_faults = true,
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    let modes = [a.seed.is_some(), a.seeds.is_some(), a.determinism.is_some()];
    if modes.iter().filter(|m| **m).count() != 1 {
        return Err("give exactly one of --seed, --seeds, --determinism".into());
    }
    if a.from.is_some() && a.seeds.is_none() {
        return Err("--from goes with --seeds".into());
    }
    Ok(a)
}

fn config(a: &Args, seed: u64) -> Config {
    let mut c = Config::new(seed);
    c.duration_ms = (a.minutes * 60_000.0) as u64;
    c.verbose = a.verbose;
    c.faults = !a.no_faults;
    c.only_faults = a.only_faults.clone();
    c
}

/// The fewest faults that still break `seed`'s world, and how to replay that.
fn shrink_and_report(a: &Args, seed: u64, failing: &Outcome) {
    let c = config(a, seed);
    eprintln!(
        "shrinking seed {seed}: {} faults applied; looking for the fewest that still fail (at most 200 runs)",
        failing.fault_events.len()
    );
    let (mask, o) = world::shrink(&c, failing, 200, |runs, left| {
        eprintln!("  {runs} runs: {left} faults still needed");
    });
    let list: Vec<String> = mask.iter().map(u64::to_string).collect();
    println!(
        "seed {seed} still fails with {} of its {} faults:",
        o.fault_events.len(),
        failing.fault_events.len()
    );
    for e in &o.fault_events {
        println!(
            "  #{} at +{:.3} s: {}",
            e.index,
            e.at_ms as f64 / 1000.0,
            e.what
        );
    }
    for v in &o.violations {
        println!("  ✘ {v}");
    }
    println!(
        "replay: scripts/sim.sh --seed {seed} --minutes {} --only-faults '{}' --verbose",
        a.minutes,
        list.join(",")
    );
}

fn report(o: &Outcome, wall_s: f64, sim_ms: u64) {
    use std::io::Write as _;
    let faults: Vec<String> = o.faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let mut out = std::io::stdout().lock();
    // A closed pipe (`| head`) ends the output, not the run.
    let _ = writeln!(
        out,
        "seed {} trace {:016x} · {} commands, {} permits granted, {} lock tokens, {} envoy mirror writes, {} terms · faults: {} · lost Redis data cost {} permits · {:.0} simulated s per wall s · {}",
        o.seed,
        o.trace_hash,
        o.commands,
        o.granted,
        o.tokens,
        o.mirror_writes,
        o.terms,
        if faults.is_empty() {
            "none".into()
        } else {
            faults.join(", ")
        },
        o.lost_data_overgrant,
        sim_ms as f64 / 1000.0 / wall_s.max(1e-9),
        if o.violations.is_empty() {
            "ok".to_string()
        } else {
            format!("{} VIOLATIONS", o.violations.len())
        }
    );
    for v in &o.violations {
        let _ = writeln!(out, "  ✘ {v}");
    }
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => return usage(&e),
    };
    if let Some(seed) = a.determinism {
        let c = config(&a, seed);
        let (x, y) = (world::run(&c), world::run(&c));
        println!(
            "determinism: seed {seed} trace {:016x} then {:016x}: {}",
            x.trace_hash,
            y.trace_hash,
            if x.trace_hash == y.trace_hash {
                "same"
            } else {
                "DIFFERENT"
            }
        );
        return if x.trace_hash == y.trace_hash && x.violations.is_empty() {
            ExitCode::SUCCESS
        } else {
            report(&x, 1.0, c.duration_ms);
            ExitCode::FAILURE
        };
    }
    let (first, n) = match (a.seed, a.seeds) {
        (Some(s), _) => (s, 1),
        (_, Some(n)) => (
            a.from.unwrap_or_else(|| {
                use std::hash::{BuildHasher, RandomState};
                RandomState::new().hash_one(std::time::SystemTime::now()) >> 16
            }),
            n,
        ),
        _ => unreachable!("parse() checked"),
    };
    let started = Instant::now();
    let next = std::sync::atomic::AtomicU64::new(first);
    let end = first.saturating_add(n);
    let failed = std::sync::Mutex::new(Vec::new());
    let jobs = if n == 1 { 1 } else { a.jobs };
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= end {
                        return;
                    }
                    let c = config(&a, seed);
                    let t = Instant::now();
                    let o = world::run(&c);
                    report(&o, t.elapsed().as_secs_f64(), c.duration_ms);
                    if !o.violations.is_empty() {
                        failed.lock().unwrap_or_else(|e| e.into_inner()).push(seed);
                    }
                }
            });
        }
    });
    let mut failed = failed.into_inner().unwrap_or_else(|e| e.into_inner());
    failed.sort_unstable();
    let sim_ms = n.saturating_mul(config(&a, first).duration_ms);
    let wall = started.elapsed().as_secs_f64();
    if let Some(&seed) = failed.first()
        && a.shrink
    {
        let o = world::run(&config(&a, seed));
        shrink_and_report(&a, seed, &o);
    }
    let _ = writeln!(
        std::io::stdout(),
        "{n} seeds from {first} in {wall:.1} s ({jobs} at a time): {:.0} simulated s per wall s, {:.1} seeds per minute; {} failed{}",
        sim_ms as f64 / 1000.0 / wall.max(1e-9),
        n as f64 / wall.max(1e-9) * 60.0,
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(
                " (replay: scripts/sim.sh --seed {} --minutes {})",
                failed[0], a.minutes
            )
        }
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
