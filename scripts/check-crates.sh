#!/usr/bin/env bash
# Checks the crates as a user of crates.io gets them (docs/sdk.md, "Publishing"):
#   rustdoc with -D warnings for the workspace · every feature of the published crates alone
#   (--no-default-features + one feature, clippy -D warnings), the protocol's unit tests without
#   features · the MSRV build: `cargo check`
#   of the published crates and the manager with the toolchain named by `rust-version` in
#   Cargo.toml (installed with rustup when missing; its own target dir, target/msrv) ·
#   `cargo package` of every published crate, verified (each tarball built on its own against
#   the others' tarballs, as crates.io would see them).
# Environment: SLUICE_SKIP_MSRV=1 skips the MSRV build, SLUICE_SKIP_PACKAGE=1 the package
# verification (both print that they were skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

PUBLISHED=(sluice-protocol sluice-sdk sluice-agent)
pkgs=()
for p in "${PUBLISHED[@]}"; do pkgs+=(-p "$p"); done

log "crates: cargo doc --workspace --no-deps (RUSTDOCFLAGS=-D warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

# Each optional part alone, so a feature never silently depends on another.
log "crates: features one at a time (clippy -D warnings)"
for spec in "sluice-protocol:" "sluice-protocol:tls" "sluice-protocol:cluster" "sluice-protocol:flags" "sluice-protocol:sim" \
            "sluice-sdk:" "sluice-sdk:tower" "sluice-sdk:axum" "sluice-sdk:tls" "sluice-sdk:cluster"; do
  crate=${spec%%:*} feature=${spec#*:}
  log "  $crate --no-default-features ${feature:+--features $feature}"
  cargo clippy --quiet -p "$crate" --no-default-features ${feature:+--features "$feature"} -- -D warnings
done

# The protocol's unit tests without its features: URLs that need a missing feature are refused
# by name (the SDK's tests need Redis and the segment; they run with the defaults).
log "crates: sluice-protocol's unit tests with --no-default-features"
cargo test --quiet -p sluice-protocol --no-default-features --lib

msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml)
[ -n "$msrv" ] || die "no rust-version in Cargo.toml's [workspace.package]"
# rust-version "1.88" means 1.88.0; rustup's toolchain "1.88" would be a second copy of it.
case $msrv in *.*.*) toolchain=$msrv ;; *) toolchain=$msrv.0 ;; esac
if [ -n "${SLUICE_SKIP_MSRV:-}" ]; then
  log "crates: MSRV build SKIPPED (SLUICE_SKIP_MSRV)"
else
  command -v rustup >/dev/null || die "rustup is needed for the MSRV build (rust-version $msrv)"
  if ! rustup run "$toolchain" rustc --version >/dev/null 2>&1; then
    log "crates: installing Rust $toolchain (rustup, minimal profile)"
    rustup toolchain install "$toolchain" --profile minimal --no-self-update
  fi
  log "crates: MSRV build with $(rustup run "$toolchain" rustc --version) (target/msrv)"
  CARGO_TARGET_DIR=target/msrv cargo "+$toolchain" check --locked --quiet "${pkgs[@]}" -p sluice-manager
fi

if [ -n "${SLUICE_SKIP_PACKAGE:-}" ]; then
  log "crates: cargo package SKIPPED (SLUICE_SKIP_PACKAGE)"
else
  log "crates: cargo package ${PUBLISHED[*]} (verified)"
  # Same versions every run: cargo verifies each crate against the others' tarballs through a
  # local registry, and takes a registry crate it built before as current (registry sources
  # are never rechecked) — so a second run would build against the first run's crates. The
  # verification gets its own target dir (target/package-check, dependencies kept), our
  # crates' builds and extracted sources (CARGO_HOME registry/src/-<hash>/) go first.
  rm -rf target/package target/package-check/debug/.fingerprint/sluice-*
  for p in "${PUBLISHED[@]}"; do
    rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/"$p"-* \
      "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/-*/"$p"-*
  done
  CARGO_TARGET_DIR=target/package-check cargo package --locked --quiet --allow-dirty "${pkgs[@]}"
  mkdir -p target/package && cp target/package-check/package/*.crate target/package/
  for p in "${PUBLISHED[@]}"; do
    f=$(ls target/package/"$p"-*.crate)
    log "  $f ($(du -h "$f" | cut -f1))"
  done
fi
