#!/usr/bin/env node
// Sluice side-by-side benchmark peer (issue 14): rate-limiter-flexible's RateLimiterRedis on
// ioredis. One decision in flight at a time; the orchestrator runs P processes for P
// "processes". Contract (shared with the Python and Rust peers): scripts/bench/peers/README.md.
'use strict';

const Redis = require('ioredis');
const { RateLimiterRedis, RateLimiterRes } = require('rate-limiter-flexible');
const RLF_VERSION = require('rate-limiter-flexible/package.json').version;

const PEER = 'rate-limiter-flexible';
const USAGE =
  'usage: peer.js --redis URL --key K --limit L --window-ms W --duration-ms D --start-at-ms T ' +
  '[--rate R] [--bucket-ms B] [--proc I]';

function die(msg) {
  process.stderr.write(`${PEER} peer: ${msg}\n`);
  process.exit(2);
}

// Error messages may carry the Redis URL: never print its credentials.
function scrub(msg) {
  return String(msg).replace(/(rediss?:\/\/)[^@\s/]*@/g, '$1***@');
}

function parseArgs(argv) {
  const spec = {
    '--redis': 'str', '--key': 'str', '--limit': 'int+', '--window-ms': 'int+',
    '--duration-ms': 'int0', '--start-at-ms': 'int0', '--rate': 'num0', '--bucket-ms': 'int+',
    '--proc': 'int0',
  };
  const v = {};
  for (let i = 0; i < argv.length; i++) {
    let flag = argv[i];
    let val;
    const eq = flag.indexOf('=');
    if (flag.startsWith('--') && eq > 0) {
      val = flag.slice(eq + 1);
      flag = flag.slice(0, eq);
    }
    if (flag === '--help' || flag === '-h') {
      process.stdout.write(USAGE + '\n');
      process.exit(0);
    }
    const kind = spec[flag];
    if (!kind) die(`unknown flag ${flag}\n${USAGE}`);
    if (val === undefined) {
      if (i + 1 >= argv.length) die(`flag ${flag} needs a value`);
      val = argv[++i];
    }
    if (kind === 'str') {
      if (val === '') die(`flag ${flag} must not be empty`);
      v[flag] = val;
    } else if (kind === 'num0') {
      if (!/^\d+(\.\d+)?$/.test(val)) die(`flag ${flag}: "${val}" is not a number >= 0`);
      v[flag] = Number(val);
    } else {
      if (!/^\d+$/.test(val)) die(`flag ${flag}: "${val}" is not an integer >= 0`);
      const n = Number(val);
      if (!Number.isSafeInteger(n)) die(`flag ${flag}: "${val}" is too large`);
      if (kind === 'int+' && n === 0) die(`flag ${flag} must be > 0`);
      v[flag] = n;
    }
  }
  for (const f of ['--redis', '--key', '--limit', '--window-ms', '--duration-ms', '--start-at-ms']) {
    if (v[f] === undefined) die(`missing required flag ${f}\n${USAGE}`);
  }
  if (!/^rediss?:\/\//.test(v['--redis'])) die('flag --redis must be a redis:// URL');
  if (v['--window-ms'] % 1000 !== 0) {
    die(`flag --window-ms: ${v['--window-ms']} is not a multiple of 1000 ` +
      '(rate-limiter-flexible takes whole seconds)');
  }
  return {
    redis: v['--redis'], key: v['--key'], limit: v['--limit'], windowMs: v['--window-ms'],
    durationMs: v['--duration-ms'], startAtMs: v['--start-at-ms'], rate: v['--rate'] || 0,
    bucketMs: v['--bucket-ms'] || 100, proc: v['--proc'] || 0,
  };
}

const sleep = (ms) => new Promise((r) => setTimeout(r, Math.max(0, ms)));

// Latency histogram: bucket b = floor(log2(ns) * 16); quantiles at the bucket midpoint.
function quantileUs(hist, total, q) {
  if (total === 0) return null;
  const want = Math.max(1, Math.ceil(q * total));
  const keys = [...hist.keys()].sort((a, b) => a - b);
  let seen = 0;
  for (const b of keys) {
    seen += hist.get(b);
    if (seen >= want) return Math.pow(2, (b + 0.5) / 16) / 1000;
  }
  return null;
}

async function main() {
  const o = parseArgs(process.argv.slice(2));
  let stop = false;
  const onSignal = () => { stop = true; };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);

  const redis = new Redis(o.redis, {
    connectTimeout: 2000,
    commandTimeout: 2000, // a stuck Redis becomes an error, not a hang
    maxRetriesPerRequest: 1,
    retryStrategy: (times) => Math.min(times * 50, 500),
  });
  redis.on('error', () => {}); // connection errors surface as rejected commands
  const limiter = new RateLimiterRedis({
    storeClient: redis,
    keyPrefix: '', // the Redis key is exactly K (and K:warmup)
    points: o.limit,
    duration: o.windowMs / 1000,
  });

  try {
    await limiter.consume(`${o.key}:warmup`, 1);
  } catch (e) {
    if (!(e instanceof RateLimiterRes)) {
      redis.disconnect();
      die(`warm-up decision failed: ${scrub(e && e.message ? e.message : e)}`);
    }
  }

  const waitMs = o.startAtMs - Date.now();
  // Sleep in short steps so a signal during the wait is honoured promptly.
  while (!stop && o.startAtMs - Date.now() > 0) await sleep(Math.min(50, o.startAtMs - Date.now()));

  const hist = new Map();
  const buckets = new Map();
  let ok = 0; let over = 0; let errors = 0; let firstError = null;
  const wall0 = Date.now();
  const t0 = process.hrtime.bigint();
  // The run is [T, T + D) on the monotonic clock (so every process stops at the same moment) and
  // decision i is due at T + i/R; if T was already past at start-up, the run starts now.
  const anchorNs = waitMs > 0 ? t0 - BigInt(Math.max(0, wall0 - o.startAtMs)) * 1000000n : t0;
  const endNs = anchorNs + BigInt(o.durationMs) * 1000000n;
  const periodNs = o.rate > 0 ? 1e9 / o.rate : 0;
  let i = 0;
  while (!stop) {
    let now = process.hrtime.bigint();
    if (now >= endNs) break;
    if (periodNs > 0) {
      const due = anchorNs + BigInt(Math.round(i * periodNs));
      if (due >= endNs) {
        // No decision is due before the end: the run still lasts until T + D.
        while (!stop && process.hrtime.bigint() < endNs) {
          await sleep(Math.min(50, Number(endNs - process.hrtime.bigint()) / 1e6));
        }
        break;
      }
      if (due > now) {
        await sleep(Number(due - now) / 1e6);
        if (stop) break;
        // setTimeout has ms granularity and may wake a little early: spin the rest out.
        while (process.hrtime.bigint() < due) { /* bounded: at most ~1 ms */ }
      }
    }
    i++;
    let outcome;
    const s = process.hrtime.bigint();
    try {
      await limiter.consume(o.key, 1);
      outcome = 0;
    } catch (e) {
      if (e instanceof RateLimiterRes) {
        outcome = 1;
      } else {
        outcome = 2;
        if (firstError === null) firstError = scrub(e && e.message ? e.message : e);
      }
    }
    now = process.hrtime.bigint();
    const ns = Number(now - s);
    const b = Math.floor(Math.log2(Math.max(1, ns)) * 16);
    hist.set(b, (hist.get(b) || 0) + 1);
    if (outcome === 2) {
      errors++;
      continue;
    }
    const start = Math.floor(Date.now() / o.bucketMs) * o.bucketMs;
    let cell = buckets.get(start);
    if (!cell) { cell = [0, 0]; buckets.set(start, cell); }
    cell[outcome]++;
    if (outcome === 0) ok++; else over++;
  }
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  redis.disconnect();

  const decisions = ok + over + errors;
  const latHist = {};
  for (const b of [...hist.keys()].sort((a, c) => a - c)) latHist[String(b)] = hist.get(b);
  const outBuckets = {};
  for (const k of [...buckets.keys()].sort((a, c) => a - c)) outBuckets[String(k)] = buckets.get(k);
  const out = {
    peer: PEER, version: RLF_VERSION, proc: o.proc, decisions, ok, over_limit: over, errors,
    first_error: firstError, seconds, decisions_per_s: seconds > 0 ? decisions / seconds : 0,
    lat_hist: latHist, p50_us: quantileUs(hist, decisions, 0.5),
    p99_us: quantileUs(hist, decisions, 0.99), bucket_ms: o.bucketMs, buckets: outBuckets,
  };
  process.stdout.write(JSON.stringify(out) + '\n');
  process.exitCode = 0;
}

main().catch((e) => die(`unexpected failure: ${scrub(e && e.stack ? e.stack : e)}`));
