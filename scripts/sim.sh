#!/usr/bin/env bash
# The deterministic simulation (issue 25, docs/simulation.md): seeded worlds in one process, no
# servers, no network. Builds `sluice-sim` (release unless SLUICE_SIM_PROFILE=debug) and runs it;
# SLUICE_SIM_BIN=<path> runs a binary built already (scripts/test.sh: the workspace's debug one).
#
#   scripts/sim.sh --seed S [--minutes M] [--verbose]    one world, replayed bit for bit
#   scripts/sim.sh --seeds N [--from S0] [--minutes M]   N worlds (nightly: --seeds 10000)
#   scripts/sim.sh --determinism S                       runs S twice, compares trace hashes
#
# Exit status: 0 every world held its invariants · 1 a world broke one (its seed is printed,
# replay it with --seed) · 2 bad flags.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

if [ -n "${SLUICE_SIM_BIN:-}" ]; then
  [ -x "$SLUICE_SIM_BIN" ] || die "SLUICE_SIM_BIN=$SLUICE_SIM_BIN is not an executable"
  exec "$SLUICE_SIM_BIN" "$@"
fi
profile=${SLUICE_SIM_PROFILE:-release}
case $profile in
  release) cargo build --quiet --release -p sluice-sim; bin=target/release/sluice-sim ;;
  debug) cargo build --quiet -p sluice-sim; bin=target/debug/sluice-sim ;;
  *) die "SLUICE_SIM_PROFILE must be release or debug (got $profile)" ;;
esac
exec "$bin" "$@"
