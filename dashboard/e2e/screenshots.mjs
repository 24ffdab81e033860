// Takes the screenshots in docs/screenshots/ against real managers with demo data.
//
//   npm run screenshots            (after `cargo build --workspace --bins --examples`)
//
// Uses SLUICE_TEST_ETCD / SLUICE_TEST_REDIS when set, else starts a private etcd and Redis on
// free ports. Starts three manager replicas, creates demo tasks, drives traffic with the load
// generator (one host with a clock 2 s ahead, under faketime, for the clock-skew alert), then
// photographs every page at 1280×800 and the main ones at 390×844. Everything started is
// stopped by PID at the end.

import { spawnSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import {
  bin,
  call,
  freePort,
  launchBrowser,
  leaderOf,
  repo,
  segmentUsed,
  sleep,
  startManager,
  startProcess,
  tempDir,
  waitFor,
} from './lib.mjs';

const out = join(repo, 'docs', 'screenshots');
mkdirSync(out, { recursive: true });
const dir = tempDir('sluice-shots-');
const procs = [];

async function servers() {
  if (process.env.SLUICE_TEST_ETCD && process.env.SLUICE_TEST_REDIS) {
    return { etcd: process.env.SLUICE_TEST_ETCD, redis: process.env.SLUICE_TEST_REDIS };
  }
  const [cport, pport, rport] = [await freePort(), await freePort(), await freePort()];
  const etcd = `http://127.0.0.1:${cport}`;
  const peer = `http://127.0.0.1:${pport}`;
  procs.push(
    startProcess('etcd', 'etcd', [
      '--name', 'shots', '--data-dir', join(dir, 'etcd'),
      '--listen-client-urls', etcd, '--advertise-client-urls', etcd,
      '--listen-peer-urls', peer, '--initial-advertise-peer-urls', peer,
      '--initial-cluster', `shots=${peer}`, '--log-level', 'warn',
    ], { log: join(dir, 'etcd.log') }),
  );
  procs.push(
    startProcess('redis', 'redis-server', ['--port', String(rport), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', dir], {
      log: join(dir, 'redis.log'),
    }),
  );
  await waitFor('etcd', async () => (await call(etcd, 'GET', '/health')).status === 200, { timeout: 30000 });
  await waitFor('redis', () => spawnSync('redis-cli', ['-p', String(rport), 'ping'], { encoding: 'utf8' }).stdout.includes('PONG'), {
    timeout: 30000,
  });
  return { etcd, redis: `redis://127.0.0.1:${rport}` };
}

function loadgen(redis, ns, task, hostId, procsN, rate, extra = [], wrap = null) {
  segmentUsed(ns, hostId);
  const args = ['--redis', redis, '--namespace', ns, '--task', task, '--host-id', hostId, '--procs', String(procsN),
    '--duration-ms', '90000', '--rate', String(rate), ...extra];
  const lg = bin('SLUICE_LOADGEN_BIN', 'target/debug/examples/loadgen');
  const [cmd, cargs] = wrap ? [wrap[0], [...wrap.slice(1), lg, ...args]] : [lg, args];
  const p = startProcess(`loadgen ${hostId}/${task}`, cmd, cargs, { log: join(dir, `loadgen-${hostId}-${task}.log`) });
  procs.push(p);
  return p;
}

const TASKS = {
  'checkout-api': {
    threshold: 400,
    description: 'checkout API',
    schedules: [{ cron: '0 0 9-17 * * Mon-Fri', threshold: 800 }],
    dynamic: { enabled: true, min: 200, max: 800, target_error_rate: 0.05, target_latency_ms: 200 },
  },
  search: { threshold: 150, slice_ms: 100, description: 'search suggestions (100 ms slices)' },
  payments: { threshold: 60, on_failure: 'deny', description: 'payment provider: hard limit' },
  'reports-export': { threshold: 2, slice_ms: 60000, mode: 'exact_fixed', description: 'nightly exports' },
  emails: { threshold: 100, mode: 'local', local_limit: 50, description: 'transactional e-mail, per host' },
};

async function main() {
  const { etcd, redis } = await servers();
  const ns = `demo${process.pid}`;
  const ms = [];
  for (const id of ['replica-0', 'replica-1', 'replica-2']) {
    const m = await startManager({ ns, nodeId: id, etcd, redis, dir });
    ms.push(m);
    procs.push(m);
  }
  const leader = await waitFor('a leader', () => leaderOf(ms[0].url), { timeout: 30000 });
  const base = ms.find((m) => m.nodeId !== leader).url;
  for (const [name, spec] of Object.entries(TASKS)) {
    const r = await call(base, 'PUT', `/api/v1/tasks/${name}`, spec);
    if (r.status >= 300) throw new Error(`PUT ${name}: ${r.status} ${JSON.stringify(r.body)}`);
  }
  const settings = await call(base, 'GET', '/api/v1/settings');
  if (settings.status === 200) {
    await call(base, 'PUT', '/api/v1/settings', {
      ...settings.body,
      webhooks: ['https://hooks.example.com/sluice', 'https://chat.example.com/api/alerts'],
      skew_threshold_ms: 100,
    });
  }
  await waitFor('slices rolled', async () => (await call(base, 'GET', '/api/v1/tasks/checkout-api')).body?.status?.effective_threshold > 0, {
    timeout: 20000,
  });

  // Traffic: checkout over its threshold from two hosts, search below, payments over.
  loadgen(redis, ns, 'checkout-api', 'web-1', 2, 130, ['--backend-capacity', '350']);
  loadgen(redis, ns, 'checkout-api', 'web-2', 2, 110, ['--backend-capacity', '350']);
  loadgen(redis, ns, 'search', 'web-1', 1, 1200);
  loadgen(redis, ns, 'payments', 'pay-1', 1, 75);
  const faketime = spawnSync('sh', ['-c', 'command -v faketime'], { encoding: 'utf8' }).stdout.trim();
  if (faketime) loadgen(redis, ns, 'payments', 'pay-2', 1, 10, [], [faketime, '-f', '+2s']);
  else console.warn('faketime not found: no clock-skew demo');

  console.log('waiting 40 s for the charts to fill…');
  await sleep(40000);

  const browser = await launchBrowser();
  try {
    const shot = async (path, file, { width = 1280, height = 800, full = false, before } = {}) => {
      const ctx = await browser.newContext({ viewport: { width, height }, deviceScaleFactor: 1, colorScheme: 'light' });
      const p = await ctx.newPage();
      await p.goto(base + path);
      await p.locator('h1').first().waitFor();
      await sleep(2500);
      if (before) await before(p);
      await p.screenshot({ path: join(out, file), fullPage: full });
      await ctx.close();
      console.log(`docs/screenshots/${file}`);
    };
    await shot('/', 'tasks.png');
    await shot('/tasks/checkout-api', 'task.png');
    await shot('/tasks/checkout-api', 'task-full.png', { full: true });
    await shot('/tasks/checkout-api', 'task-history-1h.png', {
      before: async (p) => {
        await p.getByRole('tab', { name: '1 h' }).click();
        await p.locator('#history').scrollIntoViewIfNeeded();
        await sleep(1500);
      },
    });
    await shot('/tasks/checkout-api', 'task-form-error.png', {
      before: async (p) => {
        const f = p.getByLabel('Slice length (ms)');
        await f.fill('50');
        await f.press('Enter');
        await p.locator('[data-testid="field-error"]').waitFor();
        await p.locator('#settings').scrollIntoViewIfNeeded();
        await sleep(300);
      },
    });
    await shot('/new', 'new-task.png');
    await shot('/cluster', 'cluster.png');
    await shot('/alerts', 'alerts.png');
    await shot('/', 'tasks-narrow.png', { width: 390, height: 844 });
    await shot('/tasks/checkout-api', 'task-narrow.png', { width: 390, height: 844 });
  } finally {
    await browser.close();
  }
}

try {
  await main();
} finally {
  for (const p of procs.reverse()) await p.stop('SIGTERM', 5000).catch(() => p.kill('SIGKILL'));
}
