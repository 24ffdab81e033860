//! The decision cores: pure functions of a slot's (or entry's) shared cells, the task's meta,
//! the time and the cost, returning what to do. They make no Redis call, start no thread and
//! read no clock of their own (the time is passed in), so the reference models and the
//! property tests drive them directly and the benchmarks point at them. They must not import
//! `ctx`, `plumbing`, `refill`, `background` or a front (`client`, `keyed`, `concurrency`).

pub(crate) mod exact;
pub(crate) mod fallback;
pub(crate) mod keyed;
pub(crate) mod permits;
pub(crate) mod pooled;
