#!/usr/bin/env bash
# Fuzzes the manager's and the agent's HTTP APIs against their own OpenAPI documents
# (GET /api/v1/openapi.json) with schemathesis (docs/api.md, "OpenAPI"):
#   real etcd + Redis on loopback → a manager (with an admin and a read-only token) and an
#   agent → `schemathesis run` on each, with the checks not_a_server_error (no 5xx),
#   status_code_conformance (every status answered is documented), content_type_conformance
#   and response_schema_conformance, a fixed seed and a fixed number of examples per operation
#   (reproducible; the seed is printed) → both servers must still be up afterwards, and must
#   not have logged a panic.
# Fails when a server does not come up or dies, or when schemathesis finds a problem.
#
# Runs inside a network namespace of its own holding only loopback when it can (root and
# `unshare`): the fuzzer sends webhook URLs to PUT /api/v1/settings, whose destinations the
# manager resolves, and nothing may leave this machine. Without one, a schemathesis hook
# (scripts/openapi_hooks.py) replaces every webhook that could be a URL by a string that is not.
#
# Installs schemathesis (pinned) into an ignored venv, target/openapi-venv (SLUICE_OPENAPI_VENV
# to move it). Environment: SLUICE_OPENAPI_SEED (default 20261202), SLUICE_OPENAPI_EXAMPLES
# (manager, per operation, default 100), SLUICE_OPENAPI_AGENT_EXAMPLES (default 300).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap cleanup EXIT
trap 'exit 130' INT TERM

PY_PACKAGES=(schemathesis==4.32.5)
VENV=$(realpath -m "${SLUICE_OPENAPI_VENV:-target/openapi-venv}")
SEED=${SLUICE_OPENAPI_SEED:-20261202}
EXAMPLES=${SLUICE_OPENAPI_EXAMPLES:-100}
AGENT_EXAMPLES=${SLUICE_OPENAPI_AGENT_EXAMPLES:-300}
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance
BIN=${CARGO_TARGET_DIR:-target}/debug

for v in SEED EXAMPLES AGENT_EXAMPLES; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "SLUICE_OPENAPI_$v must be a whole number, got '${!v}'"
done

if [ "${1:-}" != --in-netns ]; then
  ensure_base_packages
  ensure_venv "$VENV" "${PY_PACKAGES[@]}"
  log "building the binaries (nothing to do after scripts/test.sh's build)"
  cargo build --workspace --bins --examples
  if [ "$(id -u)" -eq 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
    && unshare --net true 2>/dev/null; then
    log "check-openapi: continuing in a network namespace with loopback only"
    rm -rf "$SLUICE_TMP"
    exec unshare --net -- "$0" --in-netns
  fi
  log "check-openapi: no network namespace here; webhook URLs are rewritten by scripts/openapi_hooks.py"
  export SCHEMATHESIS_HOOKS=openapi_hooks PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
else
  ip link set lo up
fi

for b in sluice-manager sluice-agent; do
  [ -x "$BIN/$b" ] || die "$BIN/$b is missing (cargo build --workspace --bins --examples)"
done

start_etcd
start_redis
dir=$(sluice_tmp)
admin=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
reader=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
printf '%s' "$admin" >"$dir/admin-token"
printf '%s' "$reader" >"$dir/read-token"

mport=$(free_port)
"$BIN/sluice-manager" --etcd "$ETCD_ENDPOINT" --redis "$REDIS_URL" --listen "127.0.0.1:$mport" \
  --node-id openapi-fuzz --api-token-file "$dir/admin-token" --api-read-token-file "$dir/read-token" \
  >"$dir/manager.log" 2>&1 &
manager=$!
SLUICE_PIDS+=("$manager")
MANAGER="http://127.0.0.1:$mport"
wait_for "the manager (log $dir/manager.log)" 30 curl -sf "$MANAGER/readyz"

gport=$(free_port)
aport=$(free_port)
mkdir -p "$dir/shm"
"$BIN/sluice-agent" --redis "$REDIS_URL" --host-id openapi-fuzz --segment-dir "$dir/shm" \
  --grpc-listen "127.0.0.1:$gport" --http-listen "127.0.0.1:$aport" >"$dir/agent.log" 2>&1 &
agent=$!
SLUICE_PIDS+=("$agent")
AGENT="http://127.0.0.1:$aport"
wait_for "the agent (log $dir/agent.log)" 30 curl -sf "$AGENT/readyz"

# A task, so that some requests reach past "no such task".
curl -sf -X PUT -H 'content-type: application/json' -H "Authorization: Bearer $admin" \
  "$MANAGER/api/v1/tasks/fuzz" -d '{"threshold": 100, "keyed": true}' >/dev/null \
  || die "could not create the task fuzz"

failed=()
# fuzz NAME URL EXAMPLES [schemathesis options...]
fuzz() {
  local name=$1 url=$2 n=$3 t0 rc=0; shift 3
  log "schemathesis on the $name: seed $SEED, $n examples per operation, checks $CHECKS"
  t0=$SECONDS
  # The token is passed as a header; schemathesis prints [Filtered] for Authorization.
  # From the run's temp dir: schemathesis keeps a cache (.schemathesis/, crashes it replays)
  # in its working directory; no example database either, so every run starts alike.
  (cd "$dir" && timeout 300 "$VENV/bin/schemathesis" run "$url/api/v1/openapi.json" --url "$url" \
    --checks "$CHECKS" --max-examples "$n" --seed "$SEED" --generation-database none \
    --request-timeout 10 --no-color --warnings off "$@") \
    >"$dir/$name-schemathesis.txt" 2>&1 || rc=$?
  sed -n '/^=* *SUMMARY/,$p' "$dir/$name-schemathesis.txt" >&2
  if [ $rc -ne 0 ]; then
    # The failures section names each failing case with a curl line to replay it.
    sed -n '/^=* *FAILURES/,/^=* *SUMMARY/p' "$dir/$name-schemathesis.txt" | head -200 >&2
    failed+=("schemathesis on the $name (exit $rc)")
  fi
  log "$name: $((SECONDS - t0)) s"
}

fuzz manager "$MANAGER" "$EXAMPLES" --header "Authorization: Bearer $admin"
fuzz agent "$AGENT" "$AGENT_EXAMPLES"

kill -0 "$manager" 2>/dev/null || failed+=("the manager died (log $dir/manager.log)")
kill -0 "$agent" 2>/dev/null || failed+=("the agent died (log $dir/agent.log)")
# A panic in a background task (the leader rolling a fuzzed spec) answers no request: look.
for l in manager agent; do
  if grep -n 'panicked' "$dir/$l.log" >&2; then failed+=("the $l panicked (log above)"); fi
done
if [ ${#failed[@]} -gt 0 ]; then
  tail -20 "$dir/manager.log" >&2 || true
  printf '\033[1;31mFAILED:\033[0m %s\n' "${failed[@]}" >&2
  printf 'replay: SLUICE_OPENAPI_SEED=%s scripts/check-openapi.sh\n' "$SEED" >&2
  exit 1
fi
log "check-openapi: manager and agent passed (seed $SEED)"
