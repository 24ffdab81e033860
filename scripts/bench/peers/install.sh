#!/usr/bin/env bash
# Installs the benchmark peers of issue 14 from their pinned lockfiles, into ignored dirs:
#   node/node_modules  (npm ci from node/package-lock.json)
#   python/.venv       (python3 -m venv + pip install -r python/requirements.txt)
# Idempotent and quiet: each dir keeps a stamp with the sha256 of its lockfile (and the
# interpreter version); a matching stamp means nothing to do. Output of a failed step is shown.
# On success prints two lines, shell- and shlex-parsable, with the commands that run the peers:
#   NODE_PEER='node .../node/peer.js'
#   PY_PEER='.../python/.venv/bin/python .../python/peer.py'
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODE_DIR=$HERE/node
PY_DIR=$HERE/python
VENV=$PY_DIR/.venv
STAMP_NAME=.sluice-install-stamp

die() { printf 'peers/install.sh: error: %s\n' "$*" >&2; exit 1; }

# run_quiet WHAT CMD... — runs CMD with its output kept aside; shows it only if CMD fails.
run_quiet() {
  local what=$1 out
  shift
  out=$(mktemp "${TMPDIR:-/tmp}/sluice-peers.XXXXXX")
  if ! "$@" >"$out" 2>&1; then
    cat "$out" >&2
    rm -f "$out"
    die "$what failed: $*"
  fi
  rm -f "$out"
}

stamp_of() { # stamp_of FILE INTERPRETER-VERSION
  printf '%s %s\n' "$(sha256sum "$1" | cut -d' ' -f1)" "$2"
}

# --- Node.js: rate-limiter-flexible + ioredis ---
command -v node >/dev/null 2>&1 || die "node is not installed (need Node.js >= 20; Debian: apt-get install nodejs npm)"
command -v npm >/dev/null 2>&1 || die "npm is not installed (Debian: apt-get install npm)"
node_major=$(node -p 'process.versions.node.split(".")[0]')
[ "$node_major" -ge 20 ] || die "Node.js $(node --version) is too old: ioredis 6 needs >= 20"
want=$(stamp_of "$NODE_DIR/package-lock.json" "node-$(node --version)")
if [ "$(cat "$NODE_DIR/node_modules/$STAMP_NAME" 2>/dev/null || true)" != "$want" ]; then
  (cd "$NODE_DIR" && run_quiet "npm ci" npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
  printf '%s\n' "$want" >"$NODE_DIR/node_modules/$STAMP_NAME"
fi

# --- Python: limits + redis in a venv ---
command -v python3 >/dev/null 2>&1 || die "python3 is not installed (Debian: apt-get install python3 python3-venv)"
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    run_quiet "apt-get update" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    run_quiet "apt-get install python3-venv" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq python3-venv
  else
    die "python3 has no venv/ensurepip module; install it first: sudo apt-get install python3-venv"
  fi
fi
want=$(stamp_of "$PY_DIR/requirements.txt" "$(python3 -c 'import sys; print(sys.version.split()[0], sys.executable)')")
if [ "$(cat "$VENV/$STAMP_NAME" 2>/dev/null || true)" != "$want" ]; then
  rm -rf "$VENV"
  run_quiet "python3 -m venv" python3 -m venv "$VENV"
  run_quiet "pip install" "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-input -r "$PY_DIR/requirements.txt"
  printf '%s\n' "$want" >"$VENV/$STAMP_NAME"
fi

printf "NODE_PEER='node %s'\n" "$NODE_DIR/peer.js"
printf "PY_PEER='%s %s'\n" "$VENV/bin/python" "$PY_DIR/peer.py"
