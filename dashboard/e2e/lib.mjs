// Helpers for the browser tests and the screenshot script: real sluice-manager processes on
// free loopback ports, Debian's chromium driven by playwright-core, polling with deadlines.
//
// Servers: SLUICE_TEST_ETCD and SLUICE_TEST_REDIS (scripts/test.sh starts them); each test uses
// its own namespace. Binaries: SLUICE_MANAGER_BIN and SLUICE_LOADGEN_BIN (default: the debug
// builds in ../target). Every process started here is killed by PID when the test ends or the
// runner exits.

import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const here = dirname(fileURLToPath(import.meta.url));
export const repo = resolve(here, '..', '..');

/** Chromium flags for this machine: no sandbox (root), no network chatter, no GPU. */
export const CHROMIUM_ARGS = [
  '--headless',
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
];

export const CHROMIUM = process.env.SLUICE_CHROMIUM ?? '/usr/bin/chromium';

const started = new Set();

function killAll() {
  for (const p of started) {
    try {
      process.kill(p.pid, 'SIGKILL');
    } catch {
      // already gone
    }
  }
  started.clear();
}
process.on('exit', killAll);
for (const sig of ['SIGINT', 'SIGTERM']) {
  process.on(sig, () => {
    killAll();
    process.exit(130);
  });
}

export function need(name) {
  const v = process.env[name];
  if (!v) {
    throw new Error(
      `${name} is not set: the browser tests need real servers. Run them with scripts/test.sh, ` +
        'which starts etcd and Redis and sets SLUICE_TEST_ETCD / SLUICE_TEST_REDIS.',
    );
  }
  return v;
}

export function bin(envName, fallback) {
  const p = process.env[envName] ?? join(repo, fallback);
  if (!existsSync(p)) {
    throw new Error(`${p} is missing (${envName}); build it first: cargo build --workspace --bins --examples`);
  }
  return p;
}

let nsCounter = 0;
/** A namespace no other test uses. */
export function uniqueNs(prefix = 'ui') {
  return `${prefix}${process.pid}x${nsCounter++}x${Date.now() % 100000}`;
}

/** A free TCP port on 127.0.0.1. */
export function freePort() {
  return new Promise((res, rej) => {
    const s = createServer();
    s.unref();
    s.on('error', rej);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => res(port));
    });
  });
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Polls `probe` every `every` ms until it returns a truthy value; throws after `timeout` ms. */
export async function waitFor(what, probe, { timeout = 20000, every = 100 } = {}) {
  const deadline = Date.now() + timeout;
  let last;
  for (;;) {
    try {
      const v = await probe();
      if (v) return v;
      last = v;
    } catch (e) {
      last = e;
    }
    if (Date.now() >= deadline) {
      throw new Error(`timed out after ${timeout} ms waiting for ${what} (last: ${last instanceof Error ? last.message : JSON.stringify(last)})`);
    }
    await sleep(every);
  }
}

/** Starts a child process with its output in `log`; it is killed when the runner exits. */
export function startProcess(name, cmd, args, { env = {}, log } = {}) {
  const fd = openSync(log, 'a');
  const child = spawn(cmd, args, {
    stdio: ['ignore', fd, fd],
    env: { ...process.env, ...env },
    detached: false,
  });
  const p = {
    name,
    child,
    pid: child.pid,
    log,
    exited: false,
    exitCode: null,
    kill(sig = 'SIGKILL') {
      if (p.exited) return;
      try {
        process.kill(p.pid, sig);
      } catch {
        // gone
      }
    },
    /** Signals and waits (bounded) for the exit. */
    async stop(sig = 'SIGTERM', timeout = 8000) {
      if (p.exited) return;
      p.kill(sig);
      try {
        await waitFor(`${name} to exit`, () => p.exited, { timeout, every: 50 });
      } catch {
        p.kill('SIGKILL');
        await waitFor(`${name} to exit after SIGKILL`, () => p.exited, { timeout: 5000, every: 50 });
      }
    },
    output() {
      try {
        return readFileSync(log, 'utf8');
      } catch {
        return '';
      }
    },
  };
  child.on('exit', (code) => {
    p.exited = true;
    p.exitCode = code;
    started.delete(p);
  });
  started.add(p);
  return p;
}

const tmpDirs = [];
export function tempDir(prefix = 'sluice-ui-') {
  const d = mkdtempSync(join(tmpdir(), prefix));
  tmpDirs.push(d);
  return d;
}
process.on('exit', () => {
  if (process.env.SLUICE_KEEP_TMP) return;
  for (const d of tmpDirs) rmSync(d, { recursive: true, force: true });
});

// Host segments the load generators created (/dev/shm/sluice.<ns>.<host>, as the SDK names
// them), removed when the runner exits so runs leave nothing behind.
const segments = new Set();
/** Remembers the segment of `ns` + `hostId` for removal at exit. */
export function segmentUsed(ns, hostId) {
  segments.add(`/dev/shm/sluice.${ns}.${hostId}`);
}
process.on('exit', () => {
  for (const s of segments) {
    rmSync(s, { force: true });
    rmSync(`${s}.lock`, { force: true });
  }
});

/** The pinned load generator arguments. */
function loadgenArgs({ ns, task, hostId, procs, durationMs, rate, extra = [] }) {
  segmentUsed(ns, hostId);
  return [
    ...extra,
    '--redis',
    need('SLUICE_TEST_REDIS'),
    '--namespace',
    ns,
    '--task',
    task,
    '--host-id',
    hostId,
    '--procs',
    String(procs),
    '--duration-ms',
    String(durationMs),
    '--rate',
    String(rate),
  ];
}

/** GET/PUT/DELETE the API of `base`; returns { status, body }. Bounded by a timeout. */
export async function call(base, method, path, body, headers = {}) {
  const ctl = new AbortController();
  const t = setTimeout(() => ctl.abort(), 5000);
  try {
    const r = await fetch(base + path, {
      method,
      headers: { 'content-type': 'application/json', ...headers },
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: ctl.signal,
    });
    const text = await r.text();
    let json = null;
    try {
      json = text ? JSON.parse(text) : null;
    } catch {
      json = text;
    }
    return { status: r.status, body: json };
  } finally {
    clearTimeout(t);
  }
}

/**
 * Starts a sluice-manager on a free port and waits until /healthz answers.
 * opts: { ns, nodeId, etcd, redis, extra: [] }
 */
export async function startManager({ ns, nodeId, etcd, redis, extra = [], dir }) {
  const port = await freePort();
  const addr = `127.0.0.1:${port}`;
  const d = dir ?? tempDir();
  const args = [
    '--etcd',
    etcd ?? need('SLUICE_TEST_ETCD'),
    '--redis',
    redis ?? need('SLUICE_TEST_REDIS'),
    '--listen',
    addr,
    '--namespace',
    ns,
    '--node-id',
    nodeId,
    ...extra,
  ];
  if (!extra.includes('--lease-ttl')) args.push('--lease-ttl', '2s');
  const p = startProcess(`sluice-manager ${nodeId}`, bin('SLUICE_MANAGER_BIN', 'target/debug/sluice-manager'), args, {
    env: { RUST_LOG: process.env.SLUICE_TEST_LOG ?? 'info' },
    log: join(d, `manager-${nodeId}.log`),
  });
  const url = `http://${addr}`;
  await waitFor(`${nodeId} /healthz`, async () => {
    if (p.exited) throw new Error(`${nodeId} exited at start-up:\n${p.output()}`);
    const r = await call(url, 'GET', '/healthz');
    return r.status === 200;
  }, { timeout: 20000, every: 50 });
  return { ...p, proc: p, nodeId, url, addr, ns };
}

/** The id of the leader as the API of `base` sees it (null while there is none). */
export async function leaderOf(base) {
  const r = await call(base, 'GET', '/api/v1/cluster');
  return r.status === 200 ? (r.body.leader?.node_id ?? null) : null;
}

/** Launches Debian's chromium headless (playwright-core; a fresh temporary profile). */
export async function launchBrowser() {
  if (!existsSync(CHROMIUM)) {
    throw new Error(`${CHROMIUM} is missing: apt-get install chromium (scripts/test.sh does)`);
  }
  return chromium.launch({ executablePath: CHROMIUM, args: CHROMIUM_ARGS, headless: true, timeout: 30000 });
}

/** Runs the load generator to completion (bounded); returns its JSON summary line. */
export async function runLoadgen({ ns, task, hostId, procs = 2, durationMs = 5000, rate = 0, dir }) {
  const d = dir ?? tempDir();
  const args = loadgenArgs({ ns, task, hostId, procs, durationMs, rate });
  const log = join(d, `loadgen-${hostId}.log`);
  const p = startProcess(`loadgen ${hostId}`, bin('SLUICE_LOADGEN_BIN', 'target/debug/examples/loadgen'), args, { log });
  await waitFor(`loadgen ${hostId} to finish`, () => p.exited, { timeout: durationMs + 30000, every: 100 });
  const out = p.output();
  if (p.exitCode !== 0) throw new Error(`loadgen exited with ${p.exitCode}:\n${out}`);
  const line = out
    .split('\n')
    .reverse()
    .find((l) => l.trim().startsWith('{'));
  return line ? JSON.parse(line) : null;
}

/** Starts the load generator without waiting for it. */
export function startLoadgen({ ns, task, hostId, procs = 2, durationMs = 5000, rate = 0, dir, extra = [] }) {
  const d = dir ?? tempDir();
  const args = loadgenArgs({ ns, task, hostId, procs, durationMs, rate, extra });
  return startProcess(`loadgen ${hostId}`, bin('SLUICE_LOADGEN_BIN', 'target/debug/examples/loadgen'), args, {
    log: join(d, `loadgen-${hostId}.log`),
  });
}

/** The pids of the live children of `pid` (from /proc; zombies excluded). */
export function childPids(pid) {
  const out = [];
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    let stat;
    try {
      stat = readFileSync(`/proc/${d}/stat`, 'utf8');
    } catch {
      continue;
    }
    // pid (comm) state ppid …: comm may hold spaces and parentheses, so split after the last ')'.
    const [state, ppid] = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    if (Number(ppid) === pid && state !== 'Z') out.push(Number(d));
  }
  return out;
}

/** redis-cli against the shared Redis (for test fixtures such as host reports). */
export function redisCli(url, ...args) {
  const r = spawnSync('redis-cli', ['-u', url, ...args], { encoding: 'utf8', timeout: 5000 });
  if (r.status !== 0) throw new Error(`redis-cli ${args.join(' ')}: ${r.stderr || r.error}`);
  return r.stdout.trim();
}
