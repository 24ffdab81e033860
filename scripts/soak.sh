#!/usr/bin/env bash
# The randomized lifecycle + fault soak (docs/soak.md): builds the manager, the load generator
# and the soak program (debug), then runs the soak, which starts its own etcd, Redis, three
# managers and simulated hosts on free loopback ports, applies a seeded random sequence of task
# changes and faults, checks its invariants after every step, and stops everything it started.
#
#   scripts/soak.sh --minutes N [--seed S]      a long run (prints its seed first)
#   scripts/soak.sh --seconds N [--seed S]      a short one (the CI slice in scripts/test.sh)
#   scripts/soak.sh --help                      every flag (weights, tasks, hosts, logs, …)
#
# Exit status: 0 every invariant held, 1 a violation (the logs directory is kept and printed,
# with the command that replays the run), 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT

ensure_base_packages
log "building sluice-manager, the loadgen example and the soak (debug)"
cargo build --workspace --bins --examples
# In the background and waited for, so a SIGTERM to this script reaches the soak at once (bash
# runs traps only between foreground commands); the soak stops everything it started and exits.
target/debug/soak "$@" &
soak=$!
trap 'kill -TERM "$soak" 2>/dev/null || true' INT TERM
status=0
wait "$soak" || status=$?
# A trapped signal ends `wait` early: wait for the soak's own shutdown to finish.
while kill -0 "$soak" 2>/dev/null; do wait "$soak" || status=$?; done
exit "$status"
