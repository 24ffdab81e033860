//! Each mode's refill step, driven by the background thread (`crate::background`): what to
//! pull, lease, flush or report, and applying Redis's answers to the shared cells through the
//! decision cores (`crate::decide`). Nothing here may import `background` or a front
//! (`client`, `keyed`, `concurrency`).

pub(crate) mod keys;
pub(crate) mod permits;
