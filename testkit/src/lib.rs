//! Test helpers shared by Sluice's crates, its soak and its simulation (never published).
//!
//! # Seeds and budgets of the property tests
//!
//! Every randomized property test takes its configuration from [`prop_config`]:
//!
//! * `SLUICE_PROP_SEED` unset or `random`: a fresh seed per run; a number: that seed (replay);
//! * `SLUICE_PROP_CASES`: cases per property (else the test's own budget, sized so that
//!   `scripts/test.sh` stays within its time).
//!
//! The seed is printed to stderr (`cargo test` shows it when the test fails, next to
//! proptest's minimal failing input), so any failure replays exactly with
//! `SLUICE_PROP_SEED=<seed> cargo test -p <crate> <test>`. Failure persistence files are off:
//! a counterexample worth keeping is committed as a named regression test.

pub mod rng;

use proptest::test_runner::{Config, RngSeed};

/// The configuration of the property `name` with `default_cases` cases unless
/// `SLUICE_PROP_CASES` says otherwise; prints the seed and how to replay it.
pub fn prop_config(name: &str, default_cases: u32) -> Config {
    let seed = match std::env::var("SLUICE_PROP_SEED").as_deref() {
        Err(_) | Ok("") | Ok("random") => random_seed(),
        Ok(v) => v
            .parse()
            .expect("SLUICE_PROP_SEED must be unset, \"random\" or an unsigned integer"),
    };
    let cases = match std::env::var("SLUICE_PROP_CASES") {
        Ok(v) if !v.is_empty() => v
            .parse()
            .expect("SLUICE_PROP_CASES must be an unsigned integer"),
        _ => default_cases,
    };
    eprintln!(
        "property {name}: SLUICE_PROP_SEED={seed} SLUICE_PROP_CASES={cases} (replay with these)"
    );
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    }
}

/// A seed from the OS's randomness (the hasher of `std` is seeded from it).
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_given_seed_is_kept() {
        // SAFETY: the only test of this crate that touches the environment.
        unsafe { std::env::set_var("SLUICE_PROP_SEED", "42") };
        let c = super::prop_config("t", 7);
        assert_eq!(c.rng_seed, proptest::test_runner::RngSeed::Fixed(42));
        unsafe { std::env::remove_var("SLUICE_PROP_SEED") };
    }
}
