// Browser end-to-end tests of the dashboard: real managers (etcd + Redis from scripts/test.sh),
// Debian's chromium headless through playwright-core. Run with `npm run test:e2e`.
//
// Every wait has a deadline; every process started is killed by PID at the end of its test.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import {
  call,
  childPids,
  launchBrowser,
  leaderOf,
  need,
  redisCli,
  startLoadgen,
  startManager,
  uniqueNs,
  waitFor,
} from './lib.mjs';

const T = { timeout: 120000 };

let browser;
const running = [];

before(async () => {
  need('SLUICE_TEST_ETCD');
  need('SLUICE_TEST_REDIS');
  browser = await launchBrowser();
});

after(async () => {
  for (const p of running) p.kill('SIGKILL');
  await browser?.close();
});

async function manager(opts) {
  const m = await startManager(opts);
  running.push(m);
  return m;
}

async function page(viewport = { width: 1280, height: 800 }) {
  const ctx = await browser.newContext({ viewport });
  const p = await ctx.newPage();
  p.setDefaultTimeout(15000);
  const errors = [];
  p.on('pageerror', (e) => errors.push(e));
  p.errors = errors;
  return p;
}

/** Stops what a test started, keeping the log of a failed manager visible. */
async function cleanup(ms, pages) {
  for (const p of pages) await p.context().close().catch(() => {});
  for (const m of ms) await m.stop('SIGTERM', 8000).catch(() => m.kill('SIGKILL'));
}

describe('dashboard', () => {
  test('creates a task through the form, from the keyboard', T, async () => {
    const ns = uniqueNs('uicreate');
    const m = await manager({ ns, nodeId: 'c1' });
    const p = await page();
    try {
      await p.goto(`${m.url}/`);
      await p.getByRole('heading', { name: 'Tasks' }).waitFor();
      await p.getByText('No tasks yet').waitFor();
      await p.getByRole('link', { name: 'New task' }).first().click();
      await p.getByRole('heading', { name: 'New task' }).waitFor();

      // Keyboard only: type, Tab to the next field, Enter submits.
      await p.getByLabel('Name').focus();
      await p.keyboard.type('checkout');
      await p.keyboard.press('Tab');
      await p.keyboard.type('250');
      await p.getByLabel('Description').fill('checkout API');
      await p.getByLabel('Description').press('Enter');

      await p.waitForURL(`${m.url}/tasks/checkout`);
      await p.getByRole('heading', { name: 'checkout' }).waitFor();
      const r = await call(m.url, 'GET', '/api/v1/tasks/checkout');
      assert.equal(r.status, 200);
      assert.equal(r.body.threshold, 250);
      assert.equal(r.body.description, 'checkout API');

      // The leader rolls the slices: the page shows the threshold now.
      await waitFor('threshold now on the task page', async () =>
        (await p.getByTestId('threshold-now').textContent()).includes('250'),
      );

      // The list shows it, and the search filters it.
      await p.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Tasks' }).click();
      const row = p.locator('tr[data-task="checkout"]');
      await row.waitFor();
      await p.getByLabel('Search tasks').fill('nomatch');
      await p.getByText('No task matches').waitFor();
      await p.getByLabel('Search tasks').fill('check');
      await row.waitFor();
      assert.deepEqual(p.errors, []);
    } finally {
      await cleanup([m], [p]);
    }
  });

  test('the task list loads pages, searches by name prefix and filters by mode and keyed', T, async () => {
    const ns = uniqueNs('uipages');
    const m = await manager({ ns, nodeId: 'p1' });
    const p = await page();
    // Every list and traffic request the page makes: none may ask for every task.
    const asked = [];
    p.on('request', (r) => {
      const u = new URL(r.url());
      if (u.pathname === '/api/v1/tasks' || u.pathname === '/api/v1/traffic') asked.push(u);
    });
    try {
      // 205 concurrency tasks (the leader writes no slices for them), 3 pooled, 1 local.
      const specs = [];
      for (let i = 0; i < 205; i++) specs.push([`bulk-${String(i).padStart(3, '0')}`, { threshold: 5, mode: 'concurrency' }]);
      specs.push(['pay-1', { threshold: 5 }], ['pay-2', { threshold: 5 }], ['pay-keyed', { threshold: 5, keyed: true }]);
      specs.push(['zz-local', { threshold: 5, mode: 'local' }]);
      for (let i = 0; i < specs.length; i += 8) {
        const batch = specs.slice(i, i + 8).map(([name, spec]) => call(m.url, 'PUT', `/api/v1/tasks/${name}`, spec));
        for (const r of await Promise.all(batch)) assert.equal(r.status, 201, JSON.stringify(r.body));
      }
      const rows = p.locator('[data-testid="tasks-table"] tbody tr');
      const names = async () => rows.evaluateAll((trs) => trs.map((tr) => tr.dataset.task));
      const count = p.getByTestId('tasks-count');

      // A page of 100, in name order; "Load 100 more" twice shows the rest.
      await p.goto(`${m.url}/`);
      await waitFor('the first page', async () => (await rows.count()) === 100);
      const first = await names();
      assert.equal(first[0], 'bulk-000');
      assert.equal(first[99], 'bulk-099');
      assert.match(await count.textContent(), /100 tasks shown, more to load/);
      await p.getByRole('button', { name: 'Load 100 more' }).click();
      await waitFor('the second page', async () => (await rows.count()) === 200);
      await p.getByRole('button', { name: 'Load 100 more' }).click();
      await waitFor('the last page', async () => (await rows.count()) === 209);
      const all = await names();
      assert.deepEqual(all, [...all].sort());
      assert.equal(new Set(all).size, 209);
      assert.equal(all[208], 'zz-local');
      assert.equal(await p.getByRole('button', { name: /Load .* more/ }).count(), 0);
      assert.match(await count.textContent(), /^209 tasks$/);

      // The search is a name prefix, asked of the API; it starts again from the first page.
      await p.getByLabel('Search tasks').fill('pay');
      await waitFor('the pay tasks', async () => JSON.stringify(await names()) === '["pay-1","pay-2","pay-keyed"]');
      assert.match(p.url(), /[?&]q=pay/);
      await p.getByLabel('Keyed', { exact: true }).selectOption('true');
      await waitFor('the keyed one', async () => JSON.stringify(await names()) === '["pay-keyed"]');
      await p.getByLabel('Keyed', { exact: true }).selectOption('false');
      await waitFor('the others', async () => JSON.stringify(await names()) === '["pay-1","pay-2"]');
      await p.getByLabel('Mode', { exact: true }).selectOption('local');
      await p.getByText('No task matches').waitFor();
      await p.getByLabel('Search tasks').fill('');
      await waitFor('the local task', async () => JSON.stringify(await names()) === '["zz-local"]');
      await p.getByLabel('Keyed', { exact: true }).selectOption('');
      await p.getByLabel('Mode', { exact: true }).selectOption('concurrency');
      await p.getByLabel('Search tasks').fill('bulk-2');
      await waitFor('bulk-200 to bulk-204', async () => (await names()).join() === 'bulk-200,bulk-201,bulk-202,bulk-203,bulk-204');
      // Not a name's start: said at once, nothing asked.
      await p.getByLabel('Search tasks').fill('a b');
      await p.getByText('names use only').waitFor();
      // The filters are in the URL: a reload keeps them.
      await p.goto(`${m.url}/?q=pay&keyed=true`);
      await waitFor('the keyed one after a reload', async () => JSON.stringify(await names()) === '["pay-keyed"]');
      assert.equal(await p.getByLabel('Search tasks').inputValue(), 'pay');

      // The cluster page reads the horizon of a bounded page of tasks.
      await p.goto(`${m.url}/cluster`);
      await p.getByTestId('horizon').waitFor();
      await waitFor('the horizon table', async () => (await p.locator('[data-testid="horizons"] tbody tr').count()) > 0);

      assert.ok(asked.length > 0);
      for (const u of asked) {
        const limit = Number(u.searchParams.get('limit'));
        assert.ok(limit >= 1 && limit <= 1000, `${u.pathname}${u.search} asks for every task`);
        assert.ok(!u.searchParams.get('prefix')?.includes(' '), `${u.search}: a bad prefix was sent`);
      }
      assert.deepEqual(p.errors, []);
    } finally {
      await cleanup([m], [p]);
    }
  });

  test('a bad value shows the field error and writes nothing', T, async () => {
    const ns = uniqueNs('uibad');
    const m = await manager({ ns, nodeId: 'b1' });
    const p = await page();
    try {
      await p.goto(`${m.url}/new`);
      await p.getByLabel('Name').fill('bad-task');
      await p.getByLabel('Threshold (permits per slice)').fill('100');
      await p.getByLabel('Slice length (ms)').fill('50');
      await p.getByLabel('Slice length (ms)').press('Enter');
      const err = p.locator('[data-testid="field-error"][data-field="slice_ms"]');
      await err.waitFor();
      assert.match(await err.textContent(), /100/);
      // The message sits with its field, which is marked invalid and focused.
      assert.equal(await p.getByLabel('Slice length (ms)').getAttribute('aria-invalid'), 'true');
      assert.equal(await p.evaluate(() => document.activeElement?.id), 'f-slice_ms');
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/bad-task')).status, 404);

      // A bad cron in a schedule row: the error is on that row's cron field.
      await p.getByLabel('Slice length (ms)').fill('1000');
      await p.getByRole('button', { name: 'Add schedule' }).click();
      await p.getByLabel('Schedule 1 cron').fill('every tuesday');
      await p.getByLabel('Schedule 1 threshold').fill('10');
      await p.getByRole('button', { name: 'Create task' }).click();
      const cronErr = p.locator('[data-testid="field-error"][data-field="schedules[0].cron"]');
      await cronErr.waitFor();
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/bad-task')).status, 404);

      // A misspelt time zone: the error is on that row's zone field, which offers the zone
      // names; nothing is written.
      const tz = p.getByLabel('Schedule 1 time zone');
      assert.equal(await tz.inputValue(), 'UTC', 'a new row starts in UTC');
      assert.equal(await tz.getAttribute('list'), 'tz-names');
      assert.equal(await p.locator('datalist#tz-names option[value="Europe/Berlin"]').count(), 1);
      await p.getByLabel('Schedule 1 cron').fill('* * 9-17 * * Mon-Fri');
      await tz.fill('Europe/Berln');
      await p.getByRole('button', { name: 'Create task' }).click();
      const tzErr = p.locator('[data-testid="field-error"][data-field="schedules[0].timezone"]');
      await tzErr.waitFor();
      assert.match(await tzErr.textContent(), /unknown IANA time zone "Europe\/Berln"/);
      assert.equal(await tz.getAttribute('aria-invalid'), 'true');
      assert.equal(await p.evaluate(() => document.activeElement?.id), 'f-schedules-0-timezone');
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/bad-task')).status, 404);

      // Editing: a bad value leaves the stored spec (and its version) untouched.
      const created = await call(m.url, 'PUT', '/api/v1/tasks/good', {
        threshold: 40,
        schedules: [
          { cron: '* * 9-17 * * Mon-Fri', threshold: 80, timezone: 'America/New_York' },
          { cron: '* * 0-5 * * *', threshold: 20 },
        ],
      });
      assert.equal(created.status, 201);
      await p.goto(`${m.url}/tasks/good`);
      const thr = p.getByLabel('Threshold (permits per slice)');
      await waitFor('the form to load', async () => (await thr.inputValue()) === '40');
      // Each schedule row shows its zone; one stored without a zone shows UTC.
      assert.equal(await p.getByLabel('Schedule 1 time zone').inputValue(), 'America/New_York');
      assert.equal(await p.getByLabel('Schedule 2 time zone').inputValue(), 'UTC');
      await thr.fill('-3');
      await thr.press('Enter');
      await p.locator('[data-testid="field-error"][data-field="threshold"]').waitFor();
      const after = await call(m.url, 'GET', '/api/v1/tasks/good');
      assert.equal(after.body.threshold, 40);
      assert.equal(after.body.version, created.body.version);

      // Fixing it saves.
      await thr.fill('45');
      await thr.press('Enter');
      await p.getByTestId('form-status').getByText('Saved').waitFor();
      const saved = (await call(m.url, 'GET', '/api/v1/tasks/good')).body;
      assert.equal(saved.threshold, 45);
      // Saving through the form kept the zones (UTC still not stored).
      assert.deepEqual(saved.schedules, created.body.schedules);

      // A zone changed in the form is saved.
      await p.getByLabel('Schedule 1 time zone').fill('Europe/Berlin');
      await p.getByRole('button', { name: /^Save/ }).click();
      await waitFor('the zone to be saved', async () => {
        const r = await call(m.url, 'GET', '/api/v1/tasks/good');
        return r.body.schedules?.[0]?.timezone === 'Europe/Berlin';
      });
      const zoned = (await call(m.url, 'GET', '/api/v1/tasks/good')).body;
      assert.equal(zoned.schedules[1].timezone, undefined);
      assert.deepEqual(p.errors, []);
    } finally {
      await cleanup([m], [p]);
    }
  });

  test('asks for the API token on 401 and says when the API is unreachable', T, async () => {
    const ns = uniqueNs('uitoken');
    const m = await manager({ ns, nodeId: 'k1', extra: ['--api-token', 's3cret'] });
    const p = await page();
    try {
      await p.goto(`${m.url}/new`);
      await p.getByLabel('Name').fill('guarded');
      await p.getByLabel('Threshold (permits per slice)').fill('10');
      await p.getByLabel('Threshold (permits per slice)').press('Enter');
      const dialog = p.getByRole('dialog');
      await dialog.waitFor();
      await p.getByLabel('API token', { exact: true }).fill('s3cret');
      await p.getByLabel('API token', { exact: true }).press('Enter');
      await p.waitForURL(`${m.url}/tasks/guarded`);
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/guarded')).body.threshold, 10);

      // The settings need the token to be read: a browser without it is asked, then sees them.
      assert.equal((await call(m.url, 'GET', '/api/v1/settings')).status, 401);
      const fresh = await page();
      try {
        await fresh.goto(`${m.url}/alerts`);
        await fresh.getByRole('dialog').waitFor();
        await fresh.getByLabel('API token', { exact: true }).fill('s3cret');
        await fresh.getByLabel('API token', { exact: true }).press('Enter');
        await fresh.getByLabel('Clock skew threshold (ms)').waitFor();
        await fresh.getByLabel('Clock skew threshold (ms)').fill('150');
        await fresh.getByRole('button', { name: 'Save settings' }).click();
        await fresh.getByText('Settings saved.').waitFor();
        const auth = { authorization: 'Bearer s3cret' };
        assert.equal((await call(m.url, 'GET', '/api/v1/settings', undefined, auth)).body.skew_threshold_ms, 150);
        assert.deepEqual(fresh.errors, []);
      } finally {
        await fresh.context().close();
      }

      // The manager goes away: the page says so instead of showing stale numbers silently.
      await m.stop('SIGKILL');
      await p.getByTestId('api-unreachable').waitFor({ timeout: 20000 });
      assert.match(await p.getByTestId('api-unreachable').textContent(), /cannot be reached/);
    } finally {
      await cleanup([m], [p]);
    }
  });

  test('narrow screens: no sideways scrolling, the task table still readable', T, async () => {
    const ns = uniqueNs('uinarrow');
    const m = await manager({ ns, nodeId: 'n1' });
    const p = await page({ width: 390, height: 844 });
    try {
      for (const name of ['a-rather-long-task-name-for-phones', 'b']) {
        assert.equal((await call(m.url, 'PUT', `/api/v1/tasks/${name}`, { threshold: 5, description: 'narrow' })).status, 201);
      }
      for (const path of ['/', '/tasks/b', '/cluster', '/alerts', '/new']) {
        await p.goto(`${m.url}${path}`);
        await p.locator('h1').first().waitFor();
        await p.waitForTimeout(300);
        const overflow = await p.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
        assert.ok(overflow <= 1, `${path} scrolls sideways by ${overflow}px at 390px`);
      }
    } finally {
      await cleanup([m], [p]);
    }
  });

  test('the cluster page shows the leader, and the new one after the leader is killed', T, async () => {
    const ns = uniqueNs('uicluster');
    const ms = [];
    for (const id of ['m1', 'm2', 'm3']) ms.push(await manager({ ns, nodeId: id }));
    const p = await page();
    try {
      const first = await waitFor('a leader', () => leaderOf(ms[0].url));
      const termOf = async () => (await call(ms[0].url, 'GET', '/api/v1/cluster')).body.leader?.term;
      const term1 = await termOf();
      // Watch from a replica that will survive.
      const viewer = ms.find((m) => m.nodeId !== first);
      await p.goto(`${viewer.url}/cluster`);
      const leader = p.getByTestId('leader');
      await waitFor('the leader on the page', async () => (await leader.textContent()).includes(first));
      await p.locator(`tr[data-node="${first}"]`).getByText('leader').waitFor();
      await waitFor('three replicas listed', async () => (await p.locator('[data-testid="members"] tbody tr').count()) === 3);

      ms.find((m) => m.nodeId === first).kill('SIGKILL');
      const second = await waitFor(
        'a new leader on the page',
        async () => {
          const text = await leader.textContent();
          const id = ['m1', 'm2', 'm3'].find((n) => n !== first && text.includes(n));
          return id ?? null;
        },
        { timeout: 30000, every: 200 },
      );
      assert.notEqual(second, first);
      assert.equal(await leaderOf(viewer.url), second);
      const term2 = Number((await p.getByTestId('term').textContent()).match(/\d+/)[0]);
      assert.ok(term2 > term1, `term ${term2} after ${term1}`);
      // The dead replica's lease runs out: it leaves the member list.
      await waitFor('the dead replica to leave', async () => (await p.locator('[data-testid="members"] tbody tr').count()) === 2, {
        timeout: 30000,
      });
    } finally {
      await cleanup(ms, [p]);
    }
  });

  test('the live chart shows traffic from a loadgen', T, async () => {
    const ns = uniqueNs('uilive');
    const m = await manager({ ns, nodeId: 'l1' });
    const p = await page();
    let lg;
    try {
      assert.equal((await call(m.url, 'PUT', '/api/v1/tasks/live', { threshold: 50, slice_ms: 1000 })).status, 201);
      await waitFor('slices rolled', async () => (await call(m.url, 'GET', '/api/v1/tasks/live')).body.status?.effective_threshold === 50);
      await p.goto(`${m.url}/tasks/live`);
      const chart = p.getByTestId('live-chart');
      await chart.waitFor();
      assert.equal(await chart.getAttribute('data-admitted-total'), '0');

      // 2 processes × 100/s against 50 per 1 s slice: admitted and rejected both show.
      // Long enough for the SDK's second host report (every 10 s; the first may precede the
      // task's first use).
      lg = startLoadgen({ ns, task: 'live', hostId: 'lg-1', procs: 2, durationMs: 25000, rate: 100 });
      await waitFor(
        'admitted and rejected traffic in the live chart',
        async () =>
          Number(await chart.getAttribute('data-admitted-total')) > 0 &&
          Number(await chart.getAttribute('data-rejected-total')) > 0,
        { timeout: 30000, every: 250 },
      );
      // The host shows up with its state and clock offset.
      await p.locator('[data-testid="hosts"]').getByText('lg-1').waitFor({ timeout: 30000 });
      // The task list shows the rate.
      await p.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Tasks' }).click();
      await waitFor('admitted/s on the task list', async () => {
        const t = await p.locator('tr[data-task="live"] td[data-col="admitted"]').textContent();
        return Number(t.replace(/,/g, '')) > 0;
      }, { timeout: 15000, every: 250 });
    } finally {
      lg?.kill('SIGKILL');
      await cleanup([m], [p]);
    }
  });

  test('history keeps the rate of slices from before a slice-length change', T, async () => {
    // Issue 23 item 17: 5,000 admitted per 1 s slice, then slice_ms 2,000 with 10,000 per 2 s
    // slice: 5,000/s throughout. Drawn at today's 2 s length, the old seconds showed 2,500/s.
    const ns = uniqueNs('uilen');
    const redis = need('SLUICE_TEST_REDIS');
    const m = await manager({ ns, nodeId: 'len1', extra: ['--retention', '8s'] });
    const p = await page();
    const threshold = async () => (await call(m.url, 'GET', '/api/v1/tasks/len')).body.status?.effective_threshold;
    // Counts as workers flush them (FLUSH adds adm to the slice hash).
    const flush = (start, n) => redisCli(redis, 'HINCRBY', `${ns}:{len}:s:${start}`, 'adm', String(n));
    const minuteTotal = async () => {
      const r = await call(m.url, 'GET', '/api/v1/tasks/len/history?seconds=1200&resolution=1m');
      return (r.body.slices ?? []).reduce((a, e) => a + e.admitted, 0);
    };
    try {
      assert.equal((await call(m.url, 'PUT', '/api/v1/tasks/len', { threshold: 5000, slice_ms: 1000 })).status, 201);
      await waitFor('1 s slices rolled', async () => (await threshold()) === 5000);
      const s0 = Math.floor(Date.now() / 1000) * 1000;
      for (const s of [s0, s0 + 1000, s0 + 2000]) flush(s, 5000);
      await waitFor('the 1 s slices harvested', async () => (await minuteTotal()) === 15000, { timeout: 30000, every: 250 });

      assert.equal((await call(m.url, 'PUT', '/api/v1/tasks/len', { threshold: 10000, slice_ms: 2000 })).status, 200);
      await waitFor('2 s slices rolled', async () => (await threshold()) === 10000);
      const s1 = Math.floor(Date.now() / 2000) * 2000 + 2000;
      await waitFor('the next 2 s slice written', async () => redisCli(redis, 'EXISTS', `${ns}:{len}:s:${s1}`) === '1');
      flush(s1, 10000);
      await waitFor('the 2 s slice harvested', async () => (await minuteTotal()) === 25000, { timeout: 30000, every: 250 });

      await p.goto(`${m.url}/tasks/len`);
      const chart = p.getByTestId('history-chart');
      await chart.waitFor();
      await waitFor('every point drawn', async () => (await chart.getAttribute('data-admitted-total')) === '25000', {
        timeout: 30000,
        every: 250,
      });
      // Each point with traffic is 5,000/s at its own slice length: none above, none below.
      assert.equal(await chart.getAttribute('data-peak-admitted-per-s'), '5000');
      assert.equal(await chart.getAttribute('data-low-admitted-per-s'), '5000', 'the 1 s seconds drawn at the 2 s length');
      const h = (await call(m.url, 'GET', '/api/v1/tasks/len/history?seconds=300')).body;
      const rates = h.slices.filter((e) => e.admitted > 0).map((e) => e.admitted_per_s);
      assert.deepEqual(rates, [5000, 5000, 5000, 5000], JSON.stringify(h.slices));
      assert.deepEqual(p.errors, []);
    } finally {
      await cleanup([m], [p]);
    }
  });

  test('shadow mode and pacing through the form; would-rejects on the task page', T, async () => {
    const ns = uniqueNs('uishadow');
    const m = await manager({ ns, nodeId: 's1' });
    const p = await page();
    let lg;
    try {
      // Pacing shows its burst; a burst above the threshold is the API's 400 next to it.
      await p.goto(`${m.url}/new`);
      await p.getByLabel('Name').fill('rollout');
      await p.getByLabel('Threshold (permits per slice)').fill('50');
      assert.equal(await p.getByLabel('Burst (permits)').count(), 0);
      await p.getByLabel('Pacing', { exact: true }).selectOption('smooth');
      await p.getByLabel('Burst (permits)').fill('60');
      await p.getByRole('checkbox', { name: /^Shadow/ }).check();
      await p.getByRole('button', { name: 'Create task' }).click();
      const err = p.locator('[data-testid="field-error"][data-field="burst"]');
      await err.waitFor();
      assert.match(await err.textContent(), /at most threshold/);
      assert.equal(await p.getByLabel('Burst (permits)').getAttribute('aria-invalid'), 'true');
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/rollout')).status, 404);
      await p.getByLabel('Burst (permits)').fill('10');
      await p.getByLabel('Burst (permits)').press('Enter');
      await p.waitForURL(`${m.url}/tasks/rollout`);
      let spec = (await call(m.url, 'GET', '/api/v1/tasks/rollout')).body;
      assert.equal(spec.shadow, true);
      assert.equal(spec.pacing, 'smooth');
      assert.equal(spec.burst, 10);

      // 2 processes × 100/s against 50 per slice: nothing is rejected, the would-rejects show
      // in the live chart and the shadow stat.
      await waitFor('slices rolled', async () => (await call(m.url, 'GET', '/api/v1/tasks/rollout')).body.status?.effective_threshold === 50);
      lg = startLoadgen({ ns, task: 'rollout', hostId: 'sh-1', procs: 2, durationMs: 20000, rate: 100 });
      const chart = p.getByTestId('live-chart');
      await waitFor(
        'would-rejects in the live chart',
        async () => Number(await chart.getAttribute('data-would-reject-total')) > 0,
        { timeout: 30000, every: 250 },
      );
      const stat = p.getByTestId('would-reject').locator('.stat-value');
      await waitFor('would-rejects in this slice', async () => Number((await stat.textContent()).replace(/,/g, '')) > 0, {
        timeout: 15000,
        every: 200,
      });

      // Shadow off, pacing off, from the edit form.
      await p.getByRole('checkbox', { name: /^Shadow/ }).uncheck();
      await p.getByLabel('Pacing', { exact: true }).selectOption('none');
      assert.equal(await p.getByLabel('Burst (permits)').count(), 0);
      await p.getByRole('button', { name: 'Save changes' }).click();
      await p.getByTestId('form-status').getByText(/Saved/).waitFor();
      spec = (await call(m.url, 'GET', '/api/v1/tasks/rollout')).body;
      assert.equal(spec.shadow, false);
      assert.equal(spec.pacing, 'none');
      assert.equal(spec.burst, undefined);
      // The page follows within its 2 s poll: no shadow stat any more.
      await waitFor('the shadow stat gone', async () => (await p.getByTestId('would-reject').count()) === 0);
      assert.deepEqual(p.errors, []);
    } finally {
      lg?.kill('SIGKILL');
      await cleanup([m], [p]);
    }
  });

  test('a concurrency task: created through the form, in flight and per-host permits from a loadgen, a killed host expires', T, async () => {
    const ns = uniqueNs('uiconc');
    const m = await manager({ ns, nodeId: 'q1' });
    const p = await page();
    let lg;
    try {
      // The form: mode concurrency shows the lease field; a bad lease is the API's 400 next to
      // it, and nothing is written.
      await p.goto(`${m.url}/new`);
      await p.getByLabel('Name').fill('exports');
      await p.getByLabel('Mode').selectOption('concurrency');
      await p.getByLabel('Threshold (permits in flight)').fill('3');
      await p.getByLabel('Lease TTL (ms)').fill('100');
      await p.getByRole('button', { name: 'Create task' }).click();
      const err = p.locator('[data-testid="field-error"][data-field="lease_ms"]');
      await err.waitFor();
      assert.match(await err.textContent(), /500/);
      assert.equal(await p.getByLabel('Lease TTL (ms)').getAttribute('aria-invalid'), 'true');
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/exports')).status, 404);
      await p.getByLabel('Lease TTL (ms)').fill('2000');
      await p.getByLabel('Lease TTL (ms)').press('Enter');
      await p.waitForURL(`${m.url}/tasks/exports`);
      const spec = (await call(m.url, 'GET', '/api/v1/tasks/exports')).body;
      assert.equal(spec.mode, 'concurrency');
      assert.equal(spec.lease_ms, 2000);
      assert.equal(spec.threshold, 3);
      const inFlight = p.getByTestId('in-flight').locator('.stat-value');
      await waitFor('the threshold on the page', async () => /\/\s*3/.test(await inFlight.textContent()));

      // One host, 6 workers holding each permit 50 ms against 3 permits: in flight 3 of 3,
      // the host waits for more.
      lg = startLoadgen({ ns, task: 'exports', hostId: 'conc-1', procs: 1, durationMs: 60000, extra: ['--hold-ms', '50', '--workers', '6'] });
      const row = p.locator('[data-testid="leases"] tr[data-host="conc-1"]');
      await waitFor('permits held by conc-1', async () => {
        if (!(await row.count())) return false;
        const held = Number(await row.locator('td[data-col="held"]').textContent());
        return held > 0 && held <= 3;
      }, { timeout: 30000, every: 200 });
      await waitFor('in flight on the page', async () => {
        const n = Number((await inFlight.textContent()).split('/')[0].trim());
        return n > 0 && n <= 3;
      });
      assert.match(await row.locator('td[data-col="expires"]').textContent(), /\d+(\.\d+)? (s|ms)$/);
      // In use comes from the host's report (the first one within ~2 s of its start).
      await waitFor('in use from the host report', async () => /^\d+ of \d+$/.test(await row.locator('td[data-col="in-use"]').textContent()), { timeout: 30000, every: 250 });
      // 6 workers want more than the 3 permits: callers wait on the host (its report).
      await waitFor('callers waiting on the host', async () => Number(await row.locator('td[data-col="waiting"]').textContent()) > 0, { timeout: 30000, every: 250 });
      assert.match(await row.locator('td[data-col="unmet"]').textContent(), /^\d+$/);
      // The fields mode concurrency does not use are not shown.
      assert.equal(await p.getByLabel('Slice length (ms)').count(), 0);

      // The task list: mode and in flight.
      await p.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Tasks' }).click();
      const tr = p.locator('tr[data-task="exports"]');
      await tr.waitFor();
      assert.match(await tr.locator('td[data-col="mode"]').textContent(), /concurrency/);
      await waitFor('in flight on the task list', async () => {
        const n = Number((await tr.locator('[data-col="in-flight"]').textContent()).split(' ')[0]);
        return n > 0 && n <= 3;
      }, { timeout: 15000, every: 250 });

      // SIGKILL the host (parent and worker): its lease expires within its TTL and shows so.
      await tr.getByRole('link', { name: 'exports' }).click();
      const pids = [lg.pid, ...childPids(lg.pid)];
      assert.equal(pids.length, 2, `loadgen parent and child: ${pids}`);
      for (const pid of pids) process.kill(pid, 'SIGKILL');
      await waitFor('the lease of conc-1 to expire', async () => /expired/.test(await row.locator('td[data-col="expires"]').textContent()), { timeout: 15000, every: 200 });
      assert.equal(await row.locator('td[data-col="held"]').textContent(), '0');
      await waitFor('the expired lease counted', async () => (await p.getByTestId('expired-leases').locator('.stat-value').textContent()).trim() === '1');
      await waitFor('in flight back to 0', async () => (await inFlight.textContent()).trim().startsWith('0'));
      assert.deepEqual(p.errors, []);
    } finally {
      lg?.kill('SIGKILL');
      await cleanup([m], [p]);
    }
  });

  test('alert settings: a bad webhook shows its error, a good one is saved', T, async (t) => {
    const ns = uniqueNs('uisettings');
    // The webhook below is on loopback: allowed only with --webhook-allow-private.
    const m = await manager({ ns, nodeId: 'w1', extra: ['--webhook-allow-private'] });
    const p = await page();
    try {
      if ((await call(m.url, 'GET', '/api/v1/settings')).status === 404) {
        t.skip('PENDING: GET /api/v1/settings is not implemented by this manager yet');
        return;
      }
      await p.goto(`${m.url}/alerts`);
      await p.getByRole('button', { name: 'Add webhook' }).click();
      const hook = p.getByRole('textbox', { name: 'Webhook 1' });
      await hook.fill('ftp://example.com/x');
      await hook.press('Enter');
      const err = p.locator('#f-webhooks-0-error');
      await err.waitFor();
      assert.match(await err.textContent(), /http/);
      assert.deepEqual((await call(m.url, 'GET', '/api/v1/settings')).body.webhooks, []);
      await hook.fill('http://127.0.0.1:9/sluice');
      await p.getByLabel('Clock skew threshold (ms)').fill('250');
      await p.getByRole('button', { name: 'Save settings' }).click();
      await p.getByText('Settings saved.').waitFor();
      const saved = (await call(m.url, 'GET', '/api/v1/settings')).body;
      // Shown redacted (the path is the secret), in the API and in the form.
      assert.deepEqual(saved.webhooks, ['http://127.0.0.1:9/…']);
      assert.equal(saved.skew_threshold_ms, 250);
      assert.equal(await hook.inputValue(), 'http://127.0.0.1:9/…');
      // A second save carries the new version (no spurious conflict).
      await p.getByLabel('Clock skew threshold (ms)').fill('300');
      await p.getByLabel('Clock skew threshold (ms)').press('Enter');
      await waitFor('the second save', async () => (await call(m.url, 'GET', '/api/v1/settings')).body.skew_threshold_ms === 300);
      // The redacted entry sent back kept the stored webhook.
      assert.deepEqual((await call(m.url, 'GET', '/api/v1/settings')).body.webhooks, ['http://127.0.0.1:9/…']);
      assert.deepEqual(p.errors, []);
    } finally {
      await cleanup([m], [p]);
    }
  });

  test('a skew alert appears in the feed', T, async (t) => {
    const ns = uniqueNs('uiskew');
    const m = await manager({ ns, nodeId: 's1' });
    const p = await page();
    try {
      const probe = await call(m.url, 'GET', '/api/v1/alerts');
      if (probe.status === 404) {
        t.skip('PENDING: GET /api/v1/alerts is not implemented by this manager yet');
        return;
      }
      await waitFor('a leader', () => leaderOf(m.url));
      assert.equal((await call(m.url, 'PUT', '/api/v1/tasks/skewed', { threshold: 10 })).status, 201);
      await p.goto(`${m.url}/alerts`);
      await p.getByRole('heading', { name: 'Live feed' }).waitFor();
      // A host reports a clock 5 s ahead of Redis (what the SDK writes into NS:hosts).
      const redis = need('SLUICE_TEST_REDIS');
      const report = () =>
        redisCli(
          redis,
          'HSET',
          `${ns}:hosts`,
          'skewed-host',
          JSON.stringify({ offset_ms: 5000, rtt_ms: 0.5, seen_ms: Date.now() + 5000, sdk: 'test', tasks: { skewed: 'normal' } }),
        );
      await waitFor(
        'a clock_skew alert in the feed',
        async () => {
          report();
          const item = p.locator('[data-testid="alert-feed"] li[data-kind="clock_skew"]');
          return (await item.count()) > 0 && (await item.first().textContent()).includes('skewed-host');
        },
        { timeout: 45000, every: 1000 },
      );
    } finally {
      await cleanup([m], [p]);
    }
  });
});

describe('keyed tasks', () => {
  test('a keyed task with an override: created through the form, its top keys on the task page', T, async () => {
    const ns = uniqueNs('uikeyed');
    const m = await manager({ ns, nodeId: 'k1' });
    const p = await page();
    try {
      await p.goto(`${m.url}/new`);
      await p.getByLabel('Name').fill('tenants');
      await p.getByLabel('Threshold (permits per slice)').fill('50');
      // Keyed limits are offered for mode pooled only.
      await p.getByLabel('Mode').selectOption('local');
      assert.equal(await p.getByTestId('keys-fieldset').count(), 0, 'no keys for mode local');
      await p.getByLabel('Mode').selectOption('pooled');
      await p.getByLabel('A limit per key').check();
      await p.getByRole('button', { name: 'Add override' }).click();
      await p.getByLabel('Override 1 key').fill('vip');
      await p.getByLabel('Override 1 threshold').fill('lots');
      await p.getByRole('button', { name: 'Create task' }).click();
      // The API's error names the key (`key_overrides["vip"]`): shown on that row.
      const rowErr = p.locator('[data-testid="override-row"] [data-testid="field-error"]');
      await rowErr.waitFor();
      assert.equal(await rowErr.getAttribute('data-field'), 'key_overrides["vip"]');
      assert.match(await rowErr.textContent(), /whole number/);
      assert.equal(await p.getByTestId('form-error').count(), 0, 'the error is on its row, not the form');
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/tenants')).status, 404, 'nothing written');

      // Two rows with one key: refused on the row, nothing sent.
      await p.getByLabel('Override 1 threshold').fill('500');
      await p.getByRole('button', { name: 'Add override' }).click();
      await p.getByLabel('Override 2 key').fill('vip');
      await p.getByLabel('Override 2 threshold').fill('5');
      await p.getByRole('button', { name: 'Create task' }).click();
      await p.locator('[data-testid="override-row"] [data-testid="field-error"]').getByText('two rows have this key').waitFor();
      assert.equal((await call(m.url, 'GET', '/api/v1/tasks/tenants')).status, 404, 'nothing written');
      await p.getByRole('button', { name: 'Remove override 2' }).click();

      await p.getByRole('button', { name: 'Create task' }).click();
      await p.waitForURL(`${m.url}/tasks/tenants`);
      const r = await call(m.url, 'GET', '/api/v1/tasks/tenants');
      assert.equal(r.status, 200);
      assert.equal(r.body.keyed, true);
      assert.deepEqual(r.body.key_overrides, { vip: 500 });

      // The task page: the override, and no top keys yet.
      await p.getByRole('heading', { name: 'Top keys' }).waitFor();
      const ov = p.locator('[data-testid="key-overrides"] tr[data-key="vip"]');
      await ov.waitFor();
      assert.match(await ov.textContent(), /500/);
      await p.locator('[data-testid="top-admitted"]').getByText('None in this window.').waitFor();
      // The form edits it back: the checkbox is checked and the row is there.
      assert.equal(await p.getByLabel('A limit per key').isChecked(), true);
      assert.equal(await p.getByLabel('Override 1 key').inputValue(), 'vip');

      // Hosts report their busiest keys into NS:{T}:top:<minute> / topr:<minute>; written by
      // hand here. The page's poll brings them in without a reload.
      const redis = need('SLUICE_TEST_REDIS');
      const minute = Date.now() - (Date.now() % 60000);
      redisCli(redis, 'ZADD', `${ns}:{tenants}:top:${minute}`, '42', 'key-7', '12', 'vip', '3', 'key-1');
      redisCli(redis, 'ZADD', `${ns}:{tenants}:topr:${minute}`, '5', 'key-9');
      const top = p.locator('[data-testid="top-admitted"] tbody tr');
      await waitFor('top admitted keys on the task page', async () => (await top.count()) === 3);
      assert.deepEqual(await top.evaluateAll((rows) => rows.map((r) => r.getAttribute('data-key'))), ['key-7', 'vip', 'key-1']);
      assert.match(await top.nth(0).locator('[data-col="permits"]').textContent(), /^42$/);
      assert.match(await top.nth(1).textContent(), /override 500/);
      const rej = p.locator('[data-testid="top-rejected"] tr[data-key="key-9"]');
      await rej.waitFor();
      assert.match(await rej.locator('[data-col="permits"]').textContent(), /^5$/);
      assert.deepEqual(p.errors, []);
    } finally {
      await cleanup([m], [p]);
    }
  });
});
