//! The SDK's "ten lines" — the quick example at the top of docs/sdk.md, of the crate docs and
//! of the crate README — as a program that compiles with the crate (`cargo build --examples`) and runs:
//!
//! ```text
//! cargo run -p sluice-sdk --example quickstart
//! ```
//!
//! It expects Redis at 127.0.0.1:6379 and a task `checkout` created through a manager of
//! namespace `sluice`; without them it still runs (a task this host has not seen yet is
//! admitted by default, `Config::allow_unknown`; an unreachable Redis leaves it unknown) and
//! prints the decision.
//!
//! The lines between the `quickstart:begin` and `quickstart:end` markers are the text the docs
//! show: `tests/tests/docs_quickstart.rs` fails when docs/sdk.md, `src/lib.rs` or README.md
//! differ from them. Change them here, then paste them there.

fn main() -> Result<(), sluice::Error> {
    // quickstart:begin
    use sluice::{Client, Config, Outcome};
    use std::time::Instant;

    let mut cfg = Config::new("redis://127.0.0.1:6379"); // or "redis://a:7000,redis://b:7001" (Cluster)
    cfg.namespace = "sluice".into(); // host id defaults to the hostname
    let client = Client::new(cfg)?; // opens /dev/shm/sluice.<ns>.<host>
    let checkout = client.task("checkout")?; // a task created in the manager; Clone + Send + Sync
    let started = Instant::now();
    let d = checkout.try_acquire(1); // sync, no network, no allocation
    if d.is_allowed() {
        // do the work, then say how it went (feeds dynamic limits and the dashboard)
        checkout.report(Outcome::Ok, started.elapsed());
    } else {
        println!("limited, retry in {:?}", d.retry_after()); // Limited / FallbackDenied
    }
    // quickstart:end
    println!("decision: {d:?}");
    Ok(())
}
