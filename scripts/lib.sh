# Shared helpers for scripts/*.sh: system packages, local etcd/Redis on free loopback ports,
# and cleanup of everything started, by PID. Source it; do not run it.

SLUICE_PIDS=()

log() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31merror:\033[0m %s\n' "$*" >&2; exit 1; }

# ensure_packages CMD:PACKAGE ... — installs the Debian packages whose command is missing.
# As root it runs apt-get; otherwise it prints the exact command and fails.
ensure_packages() {
  local missing=() pair
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair##*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local cmd="apt-get install -y ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    die "missing system packages; run: sudo apt-get update && sudo $cmd"
  fi
  log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $cmd -qq >/dev/null
}

# The packages every script needs.
ensure_base_packages() {
  ensure_packages protoc:protobuf-compiler etcd:etcd-server redis-server:redis-server \
    redis-cli:redis-tools faketime:faketime curl:curl promtool:prometheus openssl:openssl
}

# ensure_venv DIR PACKAGE==VERSION ... — a Python venv at DIR holding exactly these pinned
# packages: made (python3-venv installed as root when missing) or remade when the list changed;
# a no-op when it is current. The list is kept in DIR/.packages.
ensure_venv() {
  local venv=$1; shift
  if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    # Debian ships venv's ensurepip in its own package (whose command is not on PATH).
    [ "$(id -u)" -eq 0 ] || die "python3-venv missing; run: sudo apt-get update && sudo apt-get install -y python3-venv"
    log "installing python3-venv"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi
  if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.packages" 2>/dev/null)" != "$*" ]; then
    log "installing $* into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
    echo "$*" >"$venv/.packages"
  fi
}

# free_port — prints a free TCP port on 127.0.0.1.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# The temp dir of this run (removed by cleanup), created when lib.sh is sourced.
SLUICE_TMP=$(mktemp -d "${TMPDIR:-/tmp}/sluice.XXXXXX")
sluice_tmp() { echo "$SLUICE_TMP"; }

# cleanup — stops every process this script started (by PID), then removes the temp dir.
cleanup() {
  local pid
  for pid in "${SLUICE_PIDS[@]}"; do
    # Children first (a loop started in a subshell keeps its current child otherwise).
    pkill -TERM -P "$pid" 2>/dev/null || true
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${SLUICE_PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  SLUICE_PIDS=()
  if [ -n "$SLUICE_TMP" ] && [ -z "${SLUICE_KEEP_TMP:-}" ]; then rm -rf "$SLUICE_TMP"; fi
}

# wait_for DESCRIPTION SECONDS COMMAND... — polls COMMAND every 0.1 s until it succeeds.
wait_for() {
  local what=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "$what did not come up within ${secs}s"
    sleep 0.1
  done
}

# start_etcd — starts etcd on free ports; sets ETCD_ENDPOINT.
start_etcd() {
  local dir; dir="$(sluice_tmp)/etcd"; mkdir -p "$dir"
  local cport pport; cport=$(free_port); pport=$(free_port)
  ETCD_ENDPOINT="http://127.0.0.1:$cport"
  etcd --name sluice --data-dir "$dir/data" \
    --listen-client-urls "$ETCD_ENDPOINT" --advertise-client-urls "$ETCD_ENDPOINT" \
    --listen-peer-urls "http://127.0.0.1:$pport" --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
    --initial-cluster "sluice=http://127.0.0.1:$pport" --log-level warn >"$dir/etcd.log" 2>&1 &
  SLUICE_PIDS+=($!)
  wait_for "etcd" 30 curl -sf "$ETCD_ENDPOINT/health"
  log "etcd on $ETCD_ENDPOINT (pid $!, log $dir/etcd.log)"
}

# start_redis — starts redis-server on a free port; sets REDIS_URL.
start_redis() {
  local dir; dir="$(sluice_tmp)/redis"; mkdir -p "$dir"
  local port; port=$(free_port)
  REDIS_URL="redis://127.0.0.1:$port"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
    >"$dir/redis.log" 2>&1 &
  SLUICE_PIDS+=($!)
  wait_for "redis" 30 redis-cli -p "$port" ping
  log "redis on $REDIS_URL (pid $!, log $dir/redis.log)"
}
