#!/usr/bin/env bash
# Runs every check and test of Sluice against real servers:
#   system packages (installed when missing, as root) → etcd + Redis on free loopback ports →
#   cargo fmt --check → the SDK's import layers (sdk-imports.py) → dashboard build → clippy -D warnings → the deployment kit's validators
#   (check-deploy.sh) → the crates as published (check-crates.sh: rustdoc -D warnings, each
#   feature alone, the MSRV build, cargo package) → build → cargo test (unit, doc,
#   end-to-end; the simulated Redis against the real one) → schemathesis against a live manager
#   and agent (scripts/check-openapi.sh) → the deterministic simulation (scripts/sim.sh: 20
#   random seeds of 2 simulated minutes, one seed run twice for its trace hash) → a 60 s slice of the soak (random seed, printed; seed % 5 picks the modes it drives most:
#   pooled/exact, paced, shadow, keyed, concurrency) → the side-by-side benchmark's smoke test
#   (scripts/bench.sh --quick) → browser tests of the dashboard.
# Everything started here is stopped by PID on exit, failure or Ctrl-C.
#
# Environment: SLUICE_TEST_FILTER=<name> runs only matching Rust tests (and skips the soak and
# the browser tests); SLUICE_SKIP_BROWSER=1 skips the browser tests; SLUICE_SKIP_SOAK=1 skips
# the soak slice; SLUICE_SOAK_SECONDS sets its length (default 60); SLUICE_SKIP_BENCH=1 skips the
# benchmark smoke test; SLUICE_SKIP_OPENAPI=1 skips the OpenAPI fuzz test (also skipped with
# SLUICE_TEST_FILTER); SLUICE_SKIP_MSRV=1 / SLUICE_SKIP_PACKAGE=1 skip the MSRV build / the
# package verification.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT
trap 'exit 130' INT TERM

ensure_base_packages
if [ -f dashboard/package.json ]; then
  ensure_packages node:nodejs npm:npm chromium:chromium
fi

log "cargo fmt --check"
cargo fmt --all --check

log "the SDK's import layers (no circle, nothing runs back up)"
python3 scripts/sdk-imports.py --self-test
python3 scripts/sdk-imports.py

if [ -f dashboard/package.json ]; then
  log "building the dashboard"
  (cd dashboard && npm ci --no-audit --no-fund --loglevel=error && npm run build)
fi

log "clippy"
cargo clippy --workspace --all-targets -- -D warnings
scripts/check-deploy.sh
scripts/check-crates.sh

log "building binaries and examples"
cargo build --workspace --bins --examples

start_etcd
start_redis
export SLUICE_TEST_ETCD="$ETCD_ENDPOINT" SLUICE_TEST_REDIS="$REDIS_URL"

log "cargo test"
# End-to-end tests start several managers each; two at a time keeps a 2-core machine honest.
cargo test --workspace --no-fail-fast -- --test-threads="${SLUICE_TEST_THREADS:-2}" ${SLUICE_TEST_FILTER:-}

[ -n "${SLUICE_TEST_FILTER:-}${SLUICE_SKIP_OPENAPI:-}" ] || scripts/check-openapi.sh

if [ -z "${SLUICE_TEST_FILTER:-}" ]; then
  log "simulation: 20 random seeds of 2 simulated minutes and one seed's determinism (replay: scripts/sim.sh --seed S)"
  sim_bin=${CARGO_TARGET_DIR:-target}/debug/sluice-sim
  SLUICE_SIM_BIN=$sim_bin scripts/sim.sh --seeds 20 --minutes 2
  SLUICE_SIM_BIN=$sim_bin scripts/sim.sh --determinism "$(( RANDOM % 1000 ))" --minutes 1
fi

if [ -z "${SLUICE_TEST_FILTER:-}" ] && [ -z "${SLUICE_SKIP_SOAK:-}" ]; then
  log "soak: a ${SLUICE_SOAK_SECONDS:-60} s slice with a random seed, its mode focus seed % 5 (replay: scripts/soak.sh --seed S)"
  scripts/soak.sh --seconds "${SLUICE_SOAK_SECONDS:-60}"
fi

if [ -z "${SLUICE_TEST_FILTER:-}" ] && [ -z "${SLUICE_SKIP_BENCH:-}" ]; then
  log "benchmark smoke test: scripts/bench.sh --quick (checks the output parses, never the speed)"
  scripts/bench.sh --quick
fi

if [ -f dashboard/package.json ] && [ -z "${SLUICE_SKIP_BROWSER:-}" ] && [ -z "${SLUICE_TEST_FILTER:-}" ]; then
  log "browser tests"
  (cd dashboard && SLUICE_MANAGER_BIN="$PWD/../target/debug/sluice-manager" \
    SLUICE_LOADGEN_BIN="$PWD/../target/debug/examples/loadgen" npm run test:e2e)
fi
log "all tests passed"
