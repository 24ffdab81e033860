//! The decision cores: pure functions of a slot's (or entry's) shared cells, the task's meta,
//! the time and the cost, returning what to do. They make no Redis call, start no thread and
//! read no clock of their own (the time is passed in). The benchmarks and the models' tests
//! reach them through the public calls (`permits` also directly, as `sluice::concurrency`).
//! They must not import `ctx`, `plumbing`, `refill`, `background` or a front (`client`,
//! `keyed`, `concurrency`): `scripts/sdk-imports.py` checks it.

pub(crate) mod exact;
pub(crate) mod fallback;
pub(crate) mod keyed;
pub(crate) mod permits;
pub(crate) mod pooled;
