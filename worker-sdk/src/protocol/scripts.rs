//! The Lua scripts of the protocol and typed calls to them.
//!
//! Every script touches the keys of one task only (one hash tag, one Cluster slot) and is
//! atomic in Redis. The manager uses [`roll`] and [`retire`]; workers use [`pull`] and
//! [`flush`], and for the exact modes [`take`] (`exact_fixed`) and [`slide`] (`exact_sliding`).
//!
//! # Retries
//!
//! [`pull`] (by request id) and [`flush`] (by sequence number) are idempotent, so a caller may
//! send them again after a lost or late answer. [`take`] and [`slide`] are not: a caller
//! retries them only when the first attempt surely never reached Redis.
//!
//! # Fencing
//!
//! A leader writes with its election term. [`ROLL_LUA`] and [`RETIRE_LUA`] refuse a term lower
//! than the `term` stored in the task's meta hash and raise the stored term to theirs, so once
//! a new leader has touched a task, a deposed leader (paused, partitioned) can no longer change
//! it. The refused leader learns it from [`RollOutcome::Fenced`] and steps down.

use std::sync::LazyLock;

use redis::{RedisResult, Script, Value};

use super::{Keys, TaskMeta};

/// Writes meta and slices of one task, fenced by term.
///
/// `KEYS[1]` meta, `KEYS[2..]` slices. `ARGV`: term, full (0/1), expected `rolled_to`, new
/// `rolled_to`, spec version, number of meta pairs `n`, `2n` meta field/values, then per slice:
/// cap, expire-at (Unix ms).
///
/// Returns `{1, written}`, `{0, current_term}` (fenced), `{2, 0}`: the meta hash is missing,
/// retired or behind the leader's expectation (Redis restarted or flushed), so the caller must
/// resend the whole window with `full = 1`; or `{3, retired_rev}`: the task was deleted at etcd
/// revision `retired_rev`, which is not older than the spec version being written — the writer
/// has not seen the deletion yet and must not resurrect the task.
///
/// A slice that exists with another cap gets `rem += new_cap - old_cap` (consumption is kept);
/// one with the same cap is left alone, so replays are harmless.
pub const ROLL_LUA: &str = r#"
local term = tonumber(ARGV[1])
local m = redis.call('HMGET', KEYS[1], 'term', 'rolled_to', 'retired')
local cur = tonumber(m[1])
if cur and cur > term then return {0, cur} end
local full = ARGV[2] == '1'
if not full then
  if (not cur) or m[3] then return {2, 0} end
  if tonumber(m[2] or '0') < tonumber(ARGV[3]) then return {2, 0} end
elseif m[3] and tonumber(m[3]) >= tonumber(ARGV[5]) then
  return {3, tonumber(m[3])}
end
local n = tonumber(ARGV[6])
local i = 7
if n > 0 then
  local kv = {}
  for j = 0, 2 * n - 1 do kv[#kv + 1] = ARGV[i + j] end
  redis.call('HSET', KEYS[1], unpack(kv))
  i = i + 2 * n
end
if full then redis.call('HDEL', KEYS[1], 'retired') end
local new_rolled = tonumber(ARGV[4])
if full or new_rolled > tonumber(m[2] or '0') then
  redis.call('HSET', KEYS[1], 'term', term, 'rolled_to', new_rolled)
elseif cur ~= term then
  redis.call('HSET', KEYS[1], 'term', term)
end
local written = 0
for k = 2, #KEYS do
  local cap = tonumber(ARGV[i])
  local exp = ARGV[i + 1]
  i = i + 2
  local old = redis.call('HGET', KEYS[k], 'cap')
  if not old then
    redis.call('HSET', KEYS[k], 'cap', cap, 'rem', cap, 'term', term)
    redis.call('PEXPIREAT', KEYS[k], exp)
    written = written + 1
  elseif tonumber(old) ~= cap then
    redis.call('HINCRBY', KEYS[k], 'rem', cap - tonumber(old))
    redis.call('HSET', KEYS[k], 'cap', cap, 'term', term)
    written = written + 1
  end
end
return {1, written}
"#;

/// Marks a deleted task: the meta hash is replaced by a tombstone that keeps only the fence
/// (`term`) and the etcd revision of the deletion (`retired`), and expires after `ARGV[2]` ms.
/// Slices are left to expire.
///
/// `KEYS[1]` meta. `ARGV`: term, tombstone ttl (ms), deletion revision.
/// Returns `{1, 0}` or `{0, current_term}`.
pub const RETIRE_LUA: &str = r#"
local term = tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[1], 'term'))
if cur and cur > term then return {0, cur} end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'term', math.max(term, cur or 0), 'retired', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, 0}
"#;

/// Pulls up to `ARGV[1]` permits from one slice; optionally adds counters to it.
///
/// `KEYS[1]` slice. `ARGV`: want, slice start (Unix ms), slice length (ms), host id, request id,
/// then optionally six counter deltas (adm, rej, ok, err, lat_sum_us, lat_n) added to this slice.
///
/// Returns `{granted, remaining, cap, time_s, time_us, replayed}` with Redis `TIME`:
///
/// * `granted = -1`: the slice does not exist (a worker never creates one);
/// * `granted = -2`: **outside the window**: Redis time is before `start − slice_ms` (the
///   slice has not started, beyond the one-slice prefetch allowance) or after
///   `end + grace` with `grace = min(slice_ms / 4, 250 ms)` (the slice is over); nothing is
///   granted or counted;
/// * otherwise `min(want, rem)` (0 when `rem ≤ 0`) is granted and `rem` lowered.
///
/// **Idempotent by request id**: the host's last pull of the slice is recorded in the slice
/// hash as `p:<host id> = <request id>:<granted>`; a pull with the same request id (a retry)
/// returns that grant again with `replayed = 1` and changes nothing. A host's pulls are
/// exclusive (its pull lock), so the last one is the only one a retry can repeat.
pub const PULL_LUA: &str = r#"
local t = redis.call('TIME')
local pf = 'p:' .. ARGV[4]
local h = redis.call('HMGET', KEYS[1], 'rem', 'cap', pf)
if not h[1] then return {-1, 0, 0, tonumber(t[1]), tonumber(t[2]), 0} end
local rem = tonumber(h[1])
local cap = tonumber(h[2])
if h[3] then
  local id, g = string.match(h[3], '^(.*):(%-?%d+)$')
  if id == ARGV[5] then return {tonumber(g), rem, cap, tonumber(t[1]), tonumber(t[2]), 1} end
end
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = tonumber(ARGV[2])
local len = tonumber(ARGV[3])
local grace = math.min(math.floor(len / 4), 250)
if now < start - len or now > start + len + grace then
  return {-2, rem, cap, tonumber(t[1]), tonumber(t[2]), 0}
end
local want = tonumber(ARGV[1])
local grant = 0
if rem > 0 and want > 0 then
  grant = math.min(want, rem)
  rem = redis.call('HINCRBY', KEYS[1], 'rem', -grant)
end
redis.call('HSET', KEYS[1], pf, ARGV[5] .. ':' .. grant)
if #ARGV >= 11 then
  local f = {'adm', 'rej', 'ok', 'err', 'lat_sum_us', 'lat_n'}
  for j = 1, 6 do
    local d = tonumber(ARGV[j + 5])
    if d and d ~= 0 then redis.call('HINCRBY', KEYS[1], f[j], d) end
  end
end
return {grant, rem, cap, tonumber(t[1]), tonumber(t[2]), 0}
"#;

/// Adds counters to slices that still exist (a missing slice is skipped, never created).
///
/// `KEYS` slices; `ARGV`: host id, flush sequence number, then six deltas per key (adm, rej,
/// ok, err, lat_sum_us, lat_n). Returns how many of the slices exist.
///
/// **Idempotent by sequence number**: each slice records the host's last applied flush as
/// `f:<host id> = <seq>`, and a flush whose `seq` is not above it is skipped for that slice.
/// A host's flushes are exclusive (its flush lock) and numbered in increasing order, so a
/// retry (same `seq`) never counts twice, nor does a late duplicate of an older flush.
pub const FLUSH_LUA: &str = r#"
local f = {'adm', 'rej', 'ok', 'err', 'lat_sum_us', 'lat_n'}
local ff = 'f:' .. ARGV[1]
local seq = tonumber(ARGV[2])
local n = 0
for k = 1, #KEYS do
  if redis.call('EXISTS', KEYS[k]) == 1 then
    local last = tonumber(redis.call('HGET', KEYS[k], ff) or '0') or 0
    if seq > last then
      for j = 1, 6 do
        local d = tonumber(ARGV[2 + (k - 1) * 6 + j])
        if d and d ~= 0 then redis.call('HINCRBY', KEYS[k], f[j], d) end
      end
      redis.call('HSET', KEYS[k], ff, ARGV[2])
    end
    n = n + 1
  end
end
return n
"#;

/// Records a dynamic-limiting decision, fenced like [`ROLL_LUA`]: the controller state and the
/// adjustment log of a task can only be written by the current leader.
///
/// `KEYS[1]` meta, `KEYS[2]` `NS:{T}:dyn` (hash), `KEYS[3]` `NS:{T}:adj` (list, newest first).
/// `ARGV`: term, keep (log length), adjustment JSON ('' = none), then state field/value pairs.
/// Returns `{1, 0}` or `{0, current_term}`.
pub const ADJUST_LUA: &str = r#"
local term = tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[1], 'term'))
if cur and cur > term then return {0, cur} end
if #ARGV > 3 then
  local kv = {}
  for j = 4, #ARGV do kv[#kv + 1] = ARGV[j] end
  redis.call('HSET', KEYS[2], unpack(kv))
end
if ARGV[3] ~= '' then
  redis.call('LPUSH', KEYS[3], ARGV[3])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[2]) - 1)
end
return {1, 0}
"#;

/// `exact_fixed`: takes exactly `n` permits from one slice, or none.
///
/// `KEYS[1]` slice. `ARGV`: n, slice start (Unix ms), slice length (ms). Counts the decision
/// in the slice (`adm` or `rej`), so exact decisions need no flush. Returns `{status,
/// remaining, cap, time_s, time_us, 0}` with status 1 = taken, 0 = refused (fewer than `n`
/// left), -1 = the slice does not exist (never created), -2 = outside the slice's window (the
/// same window as [`PULL_LUA`]; nothing taken or counted).
pub const TAKE_LUA: &str = r#"
local t = redis.call('TIME')
local h = redis.call('HMGET', KEYS[1], 'rem', 'cap')
if not h[1] then return {-1, 0, 0, tonumber(t[1]), tonumber(t[2]), 0} end
local rem = tonumber(h[1])
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start = tonumber(ARGV[2])
local len = tonumber(ARGV[3])
local grace = math.min(math.floor(len / 4), 250)
if now < start - len or now > start + len + grace then
  return {-2, rem, tonumber(h[2]), tonumber(t[1]), tonumber(t[2]), 0}
end
local n = tonumber(ARGV[1])
if rem >= n then
  rem = redis.call('HINCRBY', KEYS[1], 'rem', -n)
  redis.call('HINCRBY', KEYS[1], 'adm', n)
  return {1, rem, tonumber(h[2]), tonumber(t[1]), tonumber(t[2]), 0}
end
redis.call('HINCRBY', KEYS[1], 'rej', n)
return {0, rem, tonumber(h[2]), tonumber(t[1]), tonumber(t[2]), 0}
"#;

/// `exact_sliding`: admits `n` when fewer than the current slice's `cap` minus `n` admissions
/// lie in the window (one slice long) ending at Redis `TIME`; a sorted set of admissions
/// (`NS:{T}:log`, scores in µs) is the log.
///
/// `KEYS[1]` the log, `KEYS[2]` the current slice (its `cap` is the limit, effective
/// threshold included; the decision is counted there), `KEYS[3]` the log's sequence
/// (`NS:{T}:log:seq`). `ARGV`: n (≤ 1,000), window (ms), the caller's nonce (random per
/// client). Members are `<nonce>:<seq>:<i>` with `seq` from `INCR` of `KEYS[3]`, so they are
/// unique by construction (across clients, processes and restarts); the sequence expires with
/// the log. Returns `{status, remaining, cap, time_s, time_us, retry_after_us}` with status 1
/// = admitted, 0 = refused, -1 = the slice does not exist.
pub const SLIDE_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cap = redis.call('HGET', KEYS[2], 'cap')
if not cap then return {-1, 0, 0, tonumber(t[1]), tonumber(t[2]), 0} end
cap = tonumber(cap)
local n = tonumber(ARGV[1])
local window = tonumber(ARGV[2]) * 1000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
if count + n <= cap and n <= 1000 then
  local seq = redis.call('INCR', KEYS[3])
  for i = 1, n do redis.call('ZADD', KEYS[1], now, ARGV[3] .. ':' .. seq .. ':' .. i) end
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[2]) * 2)
  redis.call('HINCRBY', KEYS[2], 'adm', n)
  return {1, cap - count - n, cap, tonumber(t[1]), tonumber(t[2]), 0}
end
redis.call('HINCRBY', KEYS[2], 'rej', n)
local retry = window
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if oldest[2] then retry = tonumber(oldest[2]) + window - now end
return {0, cap - count, cap, tonumber(t[1]), tonumber(t[2]), retry}
"#;

/// Reads `cap` and `rem` of several slices of one task in one call (the leader's clock-skew
/// detector). `KEYS` slices. Returns `cap, rem` per key, `-1, 0` for a missing slice.
pub const READ_SLICES_LUA: &str = r#"
local out = {}
for k = 1, #KEYS do
  local h = redis.call('HMGET', KEYS[k], 'cap', 'rem')
  if h[1] then
    out[#out + 1] = tonumber(h[1])
    out[#out + 1] = tonumber(h[2])
  else
    out[#out + 1] = -1
    out[#out + 1] = 0
  end
end
return out
"#;

static ROLL: LazyLock<Script> = LazyLock::new(|| Script::new(ROLL_LUA));
static READ_SLICES: LazyLock<Script> = LazyLock::new(|| Script::new(READ_SLICES_LUA));
static ADJUST: LazyLock<Script> = LazyLock::new(|| Script::new(ADJUST_LUA));
static RETIRE: LazyLock<Script> = LazyLock::new(|| Script::new(RETIRE_LUA));
static PULL: LazyLock<Script> = LazyLock::new(|| Script::new(PULL_LUA));
static FLUSH: LazyLock<Script> = LazyLock::new(|| Script::new(FLUSH_LUA));
static TAKE: LazyLock<Script> = LazyLock::new(|| Script::new(TAKE_LUA));
static SLIDE: LazyLock<Script> = LazyLock::new(|| Script::new(SLIDE_LUA));

/// One slice to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceWrite {
    /// Slice start (Unix ms).
    pub start_ms: i64,
    /// Threshold of the slice.
    pub cap: u64,
    /// When the key expires (Unix ms): the slice's end plus the retention.
    pub expire_at_ms: i64,
}

/// A fenced write of one task's meta and slices.
#[derive(Debug, Clone)]
pub struct RollRequest<'a> {
    /// The task.
    pub task: &'a str,
    /// The writer's election term.
    pub term: i64,
    /// Rewrite everything: meta fields and the whole window, regardless of the meta state.
    pub full: bool,
    /// The `rolled_to` the writer believes is stored (ignored when `full`).
    pub expect_rolled_to: i64,
    /// The spec version (etcd mod revision) being written.
    pub spec_version: i64,
    /// The new `rolled_to` (end of the last slice written).
    pub new_rolled_to: i64,
    /// Meta fields to (re)write, if any.
    pub meta: Option<&'a TaskMeta>,
    /// Slices to create or change.
    pub slices: &'a [SliceWrite],
}

/// What [`roll`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollOutcome {
    /// Done; this many slices were created or changed.
    Written(u64),
    /// Refused: a newer leader (this term) has written the task.
    Fenced {
        /// The term stored in the meta hash.
        current_term: i64,
    },
    /// The meta hash is missing, retired or behind: resend with `full = true`.
    NeedFull,
    /// The task was deleted (at this etcd revision) after the spec being written: skip it.
    Retired {
        /// Revision of the deletion.
        revision: i64,
    },
}

/// Outcome of [`retire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetireOutcome {
    /// The meta hash is now a tombstone.
    Retired,
    /// Refused: a newer leader has written the task.
    Fenced {
        /// The term stored in the meta hash.
        current_term: i64,
    },
}

fn pair(v: Value) -> RedisResult<(i64, i64)> {
    let (a, b): (i64, i64) = redis::from_redis_value(v)?;
    Ok((a, b))
}

/// Runs [`ROLL_LUA`].
pub async fn roll<C>(conn: &mut C, keys: &Keys, req: &RollRequest<'_>) -> RedisResult<RollOutcome>
where
    C: redis::aio::ConnectionLike,
{
    let mut inv = ROLL.prepare_invoke();
    inv.key(keys.meta(req.task));
    for s in req.slices {
        inv.key(keys.slice(req.task, s.start_ms));
    }
    inv.arg(req.term)
        .arg(if req.full { 1 } else { 0 })
        .arg(req.expect_rolled_to)
        .arg(req.new_rolled_to)
        .arg(req.spec_version);
    match req.meta {
        Some(meta) => {
            let pairs = meta.to_pairs();
            inv.arg(pairs.len());
            for (k, v) in pairs {
                inv.arg(k).arg(v);
            }
        }
        None => {
            inv.arg(0);
        }
    }
    for s in req.slices {
        inv.arg(s.cap).arg(s.expire_at_ms);
    }
    let (status, value) = pair(inv.invoke_async(conn).await?)?;
    Ok(match status {
        1 => RollOutcome::Written(value.max(0) as u64),
        0 => RollOutcome::Fenced {
            current_term: value,
        },
        3 => RollOutcome::Retired { revision: value },
        _ => RollOutcome::NeedFull,
    })
}

/// Runs [`RETIRE_LUA`].
pub async fn retire<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    term: i64,
    tombstone_ttl_ms: u64,
    deleted_at_revision: i64,
) -> RedisResult<RetireOutcome>
where
    C: redis::aio::ConnectionLike,
{
    let (status, value) = pair(
        RETIRE
            .key(keys.meta(task))
            .arg(term)
            .arg(tombstone_ttl_ms.max(1))
            .arg(deleted_at_revision)
            .invoke_async(conn)
            .await?,
    )?;
    Ok(if status == 1 {
        RetireOutcome::Retired
    } else {
        RetireOutcome::Fenced {
            current_term: value,
        }
    })
}

/// Counters a host adds to a slice hash.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SliceCounters {
    /// Admitted decisions.
    pub admitted: u64,
    /// Rejected decisions.
    pub rejected: u64,
    /// Successful outcomes.
    pub ok: u64,
    /// Failed outcomes.
    pub err: u64,
    /// Sum of latencies (µs).
    pub lat_sum_us: u64,
    /// Number of latencies.
    pub lat_n: u64,
}

impl SliceCounters {
    /// The counters in [`super::slice_field::COUNTERS`] order.
    pub fn as_array(&self) -> [u64; 6] {
        [
            self.admitted,
            self.rejected,
            self.ok,
            self.err,
            self.lat_sum_us,
            self.lat_n,
        ]
    }

    /// True when every counter is zero.
    pub fn is_zero(&self) -> bool {
        self.as_array().iter().all(|v| *v == 0)
    }
}

/// Reply of [`pull`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullReply {
    /// The slice key does not exist.
    Missing {
        /// Redis `TIME` in Unix µs.
        redis_time_us: i64,
    },
    /// Redis time is outside the slice's window (not started beyond the prefetch allowance,
    /// or over): nothing granted. Compare the slice with `redis_time_us` to tell which.
    OutsideWindow {
        /// Redis `TIME` in Unix µs.
        redis_time_us: i64,
    },
    /// The slice exists; `granted` may be 0 (exhausted).
    Granted {
        /// Permits granted (≤ want, ≤ what remained).
        granted: u64,
        /// What remains in the slice after this pull (may be negative).
        remaining: i64,
        /// The slice's threshold.
        cap: u64,
        /// Redis `TIME` in Unix µs.
        redis_time_us: i64,
        /// True when this was a retry of the host's last pull (same request id): the grant is
        /// that pull's, and nothing changed.
        replayed: bool,
    },
}

/// One PULL ([`PULL_LUA`]).
#[derive(Debug, Clone, Copy)]
pub struct PullRequest<'a> {
    /// The task.
    pub task: &'a str,
    /// Start of the slice (Unix ms).
    pub start_ms: i64,
    /// Length of the task's slices (ms): with `start_ms`, the slice's window.
    pub slice_ms: u64,
    /// Permits wanted (0 = only read the slice).
    pub want: u64,
    /// The pulling host (names the request-id field `p:<host>`).
    pub host_id: &'a str,
    /// Unique per logical pull; a retry of the same pull passes the same id.
    pub request_id: &'a str,
    /// Counters to add to the slice in the same call.
    pub counters: Option<&'a SliceCounters>,
}

/// Runs [`PULL_LUA`].
pub async fn pull<C>(conn: &mut C, keys: &Keys, req: &PullRequest<'_>) -> RedisResult<PullReply>
where
    C: redis::aio::ConnectionLike,
{
    let mut inv = PULL.prepare_invoke();
    inv.key(keys.slice(req.task, req.start_ms))
        .arg(req.want)
        .arg(req.start_ms)
        .arg(req.slice_ms)
        .arg(req.host_id)
        .arg(req.request_id);
    if let Some(c) = req.counters {
        for v in c.as_array() {
            inv.arg(v);
        }
    }
    let (granted, remaining, cap, secs, micros, replayed): (i64, i64, i64, i64, i64, i64) =
        redis::from_redis_value(inv.invoke_async(conn).await?)?;
    let redis_time_us = secs * 1_000_000 + micros;
    Ok(match granted {
        -1 => PullReply::Missing { redis_time_us },
        g if g < 0 => PullReply::OutsideWindow { redis_time_us },
        g => PullReply::Granted {
            granted: g as u64,
            remaining,
            cap: cap.max(0) as u64,
            redis_time_us,
            replayed: replayed == 1,
        },
    })
}

/// Runs [`FLUSH_LUA`]: adds counters to the slices of `task` that still exist, as flush `seq`
/// of `host_id` (a retry passes the same `seq`). Returns how many of the slices exist.
pub async fn flush<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    host_id: &str,
    seq: u64,
    batch: &[(i64, SliceCounters)],
) -> RedisResult<u64>
where
    C: redis::aio::ConnectionLike,
{
    if batch.is_empty() {
        return Ok(0);
    }
    let mut inv = FLUSH.prepare_invoke();
    inv.arg(host_id).arg(seq);
    for (start, c) in batch {
        inv.key(keys.slice(task, *start));
        for v in c.as_array() {
            inv.arg(v);
        }
    }
    inv.invoke_async(conn).await
}

/// Runs [`ADJUST_LUA`]: stores controller `state` (field/value pairs) and, if given, appends one
/// adjustment (JSON) to the task's log, keeping the newest `keep`. Returns `Err(current_term)`
/// when fenced.
pub async fn adjust<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    term: i64,
    state: &[(&str, String)],
    adjustment: Option<&str>,
    keep: usize,
) -> RedisResult<Result<(), i64>>
where
    C: redis::aio::ConnectionLike,
{
    let mut inv = ADJUST.prepare_invoke();
    inv.key(keys.meta(task))
        .key(keys.dynamic_state(task))
        .key(keys.adjustments(task))
        .arg(term)
        .arg(keep.max(1))
        .arg(adjustment.unwrap_or(""));
    for (k, v) in state {
        inv.arg(*k).arg(v);
    }
    let (status, value) = pair(inv.invoke_async(conn).await?)?;
    Ok(if status == 1 { Ok(()) } else { Err(value) })
}

/// Reply of [`take`] and [`slide`] (the exact modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExactReply {
    /// The slice key does not exist.
    Missing {
        /// Redis `TIME` in Unix µs.
        redis_time_us: i64,
    },
    /// Admitted.
    Admitted {
        /// What is left (fixed: in the slice; sliding: in the window).
        remaining: i64,
        /// The slice's threshold.
        cap: u64,
        /// Redis `TIME` in Unix µs.
        redis_time_us: i64,
    },
    /// Redis time is outside the slice's window (exact_fixed): nothing taken or counted.
    OutsideWindow {
        /// Redis `TIME` in Unix µs.
        redis_time_us: i64,
    },
    /// Refused.
    Refused {
        /// What is left.
        remaining: i64,
        /// The slice's threshold.
        cap: u64,
        /// Redis `TIME` in Unix µs.
        redis_time_us: i64,
        /// Sliding: µs until the oldest admission leaves the window (0 for fixed).
        retry_after_us: u64,
    },
}

fn exact_reply(v: Value) -> RedisResult<ExactReply> {
    let (status, remaining, cap, secs, micros, retry): (i64, i64, i64, i64, i64, i64) =
        redis::from_redis_value(v)?;
    let redis_time_us = secs * 1_000_000 + micros;
    let cap = cap.max(0) as u64;
    Ok(match status {
        1 => ExactReply::Admitted {
            remaining,
            cap,
            redis_time_us,
        },
        0 => ExactReply::Refused {
            remaining,
            cap,
            redis_time_us,
            retry_after_us: retry.max(0) as u64,
        },
        -2 => ExactReply::OutsideWindow { redis_time_us },
        _ => ExactReply::Missing { redis_time_us },
    })
}

/// Runs [`TAKE_LUA`] (`exact_fixed`) on the slice of `task` starting at `slice_start_ms`
/// (slices of `slice_ms`). Not idempotent: never retry it after it may have reached Redis.
pub async fn take<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    slice_start_ms: i64,
    slice_ms: u64,
    n: u64,
) -> RedisResult<ExactReply>
where
    C: redis::aio::ConnectionLike,
{
    exact_reply(
        TAKE.key(keys.slice(task, slice_start_ms))
            .arg(n)
            .arg(slice_start_ms)
            .arg(slice_ms)
            .invoke_async(conn)
            .await?,
    )
}

/// Runs [`SLIDE_LUA`] (`exact_sliding`) with the log of `task` and its slice starting at
/// `slice_start_ms`; `nonce` is random per client (members are made unique by a Redis-side
/// sequence under it). Not idempotent: never retry it after it may have reached Redis.
pub async fn slide<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    slice_start_ms: i64,
    window_ms: u64,
    n: u64,
    nonce: &str,
) -> RedisResult<ExactReply>
where
    C: redis::aio::ConnectionLike,
{
    exact_reply(
        SLIDE
            .key(keys.sliding_log(task))
            .key(keys.slice(task, slice_start_ms))
            .key(keys.sliding_log_seq(task))
            .arg(n)
            .arg(window_ms)
            .arg(nonce)
            .invoke_async(conn)
            .await?,
    )
}

/// Runs [`READ_SLICES_LUA`]: `(cap, rem)` of each slice of `task` starting at `starts`, `None`
/// for a slice that does not exist.
pub async fn read_slices<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    starts: &[i64],
) -> RedisResult<Vec<Option<(i64, i64)>>>
where
    C: redis::aio::ConnectionLike,
{
    if starts.is_empty() {
        return Ok(Vec::new());
    }
    let mut inv = READ_SLICES.prepare_invoke();
    for s in starts {
        inv.key(keys.slice(task, *s));
    }
    let flat: Vec<i64> = redis::from_redis_value(inv.invoke_async(conn).await?)?;
    Ok(flat
        .chunks(2)
        .map(|p| match p {
            [cap, rem] if *cap >= 0 => Some((*cap, *rem)),
            _ => None,
        })
        .collect())
}
