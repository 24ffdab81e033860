//! The simulation's randomness: the soak's seeded generator (SplitMix64, in `sluice-testkit`),
//! so a seed replays a run.

pub use sluice_testkit::rng::Rng;
