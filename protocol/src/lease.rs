//! Mode `concurrency` and locks: the Lua scripts of leases and fencing-token locks, with typed
//! calls. `docs/concurrency.md` states their contract for other languages.
//!
//! # Leases (mode `concurrency`)
//!
//! ```text
//!  NS:{T}:meta   hash  written by the leader (fenced, like every task): mode = concurrency,
//!                      threshold = permits in flight cluster-wide, lease_ms = lease TTL
//!  NS:{T}:lease  hash  host id -> "<permits>:<expires_ms>:<seq>:<unmet>"
//!                      (expires_ms: Redis TIME; unmet: want − permits of its last call)
//! ```
//!
//! A host holds a block of permits under a lease and hands them out locally. [`LEASE_LUA`] is
//! the one call for everything a host does with its block: take one, grow it, renew it
//! (every call renews: `expires = now + lease_ms`), shrink it (give idle permits back) and drop
//! it (`want = 0`). `want` is the *absolute* number the host wants to hold, so the call is
//! idempotent; a per-host sequence number orders calls (a late duplicate of an older call is
//! refused, never applied over a newer one).
//!
//! The grant rule, with `cur` the host's unexpired holding and `others` the sum of the other
//! hosts' unexpired holdings:
//!
//! ```text
//!  want ≤ cur:  holding = want                          (shrink or renew: always allowed)
//!  want > cur:  holding = max(cur, min(want, cap − others))   (grow into free room only)
//! ```
//!
//! The cap is read from the meta at every call, so a threshold change applies at once to
//! every grant. A **threshold decrease** never revokes permits already held (they may be in
//! use): Σ holdings may exceed the new cap until hosts give permits back; no host can grow
//! while `others + cur ≥ cap`; a host hands out no permit while its in use is at or above
//! `cap − others` of its last reply, and shrinks its holding to what it has in use at its next
//! call (the SDK does both), so in flight falls to the new cap by attrition, and no new permit
//! is handed out anywhere until it has (from each host's next renewal on: at most a quarter
//! TTL after the change).
//!
//! Expired entries count 0 and are deleted `10 × lease_ms` after they expired (kept that long
//! so their sequence number still refuses a late duplicate); the hash itself expires
//! `10 × lease_ms` after the last call.
//!
//! # Locks
//!
//! ```text
//!  NS:{L}:lock        hash    token, owner; PEXPIRE = the lock's TTL (renewed)
//!  NS:{L}:lock:token  string  the last fencing token handed out (never expires)
//! ```
//!
//! [`LOCK_ACQUIRE_LUA`] takes a free lock and, in the same call, draws its fencing token:
//! `max(counter + 1, Redis TIME in µs)`, so tokens are strictly increasing per lock across
//! holders, crashes and expiries, and across a Redis that comes back with an older counter
//! (a restart from a dump, a failover to a lagging replica).
//! Renewal and release check the token (never touch another holder's lock).

use std::sync::LazyLock;

use redis::{RedisResult, Script};

use super::Keys;

/// Takes, grows, renews, shrinks or drops a host's block of permits (see the module docs).
///
/// `KEYS[1]` meta, `KEYS[2]` lease hash. `ARGV`: host id, want (absolute), seq (strictly
/// increasing per host, below 2^53 (Lua numbers are doubles); a retry resends the same seq).
/// Entries are written with `%d`, never `tostring` (which prints 1.7e+15 for a µs clock).
///
/// Each entry also records the host's **unmet** demand (`want − holding` of its last call), so
/// a host learns whether others wait (`others_unmet`) and gives its idle permits back.
///
/// Returns `{status, holding, cap, others, lease_ms, version, time_s, time_us,
/// others_unmet}`:
///
/// * `status = 1`: the host now holds `holding` permits until Redis time + `lease_ms`;
/// * `status = -1`: the task is unknown: no meta, a tombstone, or not in mode `concurrency`
///   (nothing is written);
/// * `status = -3`: `seq` is below the host's last one (a late duplicate): nothing changed;
///   `holding` is what the host holds.
///
/// `others` is the sum of the other hosts' unexpired holdings, `cap` the meta's threshold.
pub const LEASE_LUA: &str = include_str!("../scripts/lease.lua");

/// Takes lock `L` if it is free, drawing its fencing token in the same call.
///
/// `KEYS[1]` `NS:{L}:lock`, `KEYS[2]` `NS:{L}:lock:token`. `ARGV`: owner (unique per
/// acquisition — the SDK keeps one for every attempt of one `lock()` wait — so a retry, or an
/// attempt after one whose answer was lost, gets the same token back), ttl (ms).
///
/// Returns `{1, token, ttl_ms}` (acquired; or this owner's token again on a retry) or `{0,
/// holder_token, pttl_ms}` (held by another).
///
/// **The token rule**: `token = max(counter + 1, TIME in µs)`, stored back as the counter. The
/// counter alone makes tokens strictly increasing while Redis keeps its data; the floor from
/// Redis `TIME` keeps them increasing when Redis goes back to an older counter (a restart from
/// an RDB snapshot or an AOF `everysec` file, a failover to a replica that lagged) or loses it:
/// every token handed out before was at most the `TIME` of its call (tokens of one lock are
/// drawn far less often than once per µs), and `TIME` has moved on since. What it assumes:
/// Redis' clock (of whichever node answers) is not behind, by more than the time the restart or
/// failover took, the clock of the node that handed out the lost tokens (a backward step of
/// the clock *while the counter survives* is harmless: `counter + 1` decides). Numbers stay
/// below 2^53 (Lua numbers are doubles): a counter that is not a decimal integer below 2^53 is
/// refused with an error and nothing is written.
pub const LOCK_ACQUIRE_LUA: &str = include_str!("../scripts/lock_acquire.lua");

/// Renews lock `L` for its holder: `KEYS[1]` `NS:{L}:lock`; `ARGV`: token, ttl (ms). Returns
/// 1 when the token still holds the lock (its TTL is reset), else 0 (lost: expired, or taken).
pub const LOCK_RENEW_LUA: &str = include_str!("../scripts/lock_renew.lua");

/// Releases lock `L` if `token` holds it: `KEYS[1]` `NS:{L}:lock`; `ARGV`: token. Returns 1
/// when released, 0 when the token no longer held it (another holder's lock is never deleted).
pub const LOCK_RELEASE_LUA: &str = include_str!("../scripts/lock_release.lua");

static LEASE: LazyLock<Script> = LazyLock::new(|| Script::new(LEASE_LUA));
static LOCK_ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(LOCK_ACQUIRE_LUA));
static LOCK_RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(LOCK_RENEW_LUA));
static LOCK_RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(LOCK_RELEASE_LUA));

/// Reply of [`lease`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseReply {
    /// The host holds `holding` permits for `lease_ms` from Redis time `redis_time_us`.
    Held {
        /// Permits the host now holds.
        holding: u64,
        /// The task's threshold (meta).
        cap: u64,
        /// Unexpired permits of the other hosts.
        others: u64,
        /// Lease TTL (meta).
        lease_ms: u64,
        /// The meta's spec version.
        version: i64,
        /// What the other (live) hosts asked for and did not get.
        others_unmet: u64,
        /// Redis `TIME`, Unix µs.
        redis_time_us: i64,
    },
    /// The task is unknown (no meta, retired, or not mode `concurrency`).
    Unknown,
    /// The sequence number was below the host's last: nothing changed.
    Stale {
        /// What the host holds.
        holding: u64,
    },
}

/// Runs [`LEASE_LUA`]: host `host` of `task` wants to hold `want` permits; `seq` orders the
/// host's calls (resend the same `seq` on a retry).
pub async fn lease<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    host: &str,
    want: u64,
    seq: u64,
) -> RedisResult<LeaseReply>
where
    C: redis::aio::ConnectionLike,
{
    let v: Vec<i64> = LEASE
        .key(keys.meta(task))
        .key(keys.lease(task))
        .arg(host)
        .arg(want)
        .arg(seq)
        .invoke_async(conn)
        .await?;
    let g = |i: usize| v.get(i).copied().unwrap_or(0);
    Ok(match g(0) {
        1 => LeaseReply::Held {
            holding: g(1).max(0) as u64,
            cap: g(2).max(0) as u64,
            others: g(3).max(0) as u64,
            lease_ms: g(4).max(0) as u64,
            version: g(5),
            redis_time_us: g(6) * 1_000_000 + g(7),
            others_unmet: g(8).max(0) as u64,
        },
        -3 => LeaseReply::Stale {
            holding: g(1).max(0) as u64,
        },
        _ => LeaseReply::Unknown,
    })
}

/// Reply of [`lock_acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockReply {
    /// Acquired with this fencing token.
    Acquired {
        /// The fencing token (strictly increasing per lock).
        token: u64,
    },
    /// Held by another holder.
    Busy {
        /// The holder's token.
        token: u64,
        /// Its remaining TTL (ms; negative = none).
        pttl_ms: i64,
    },
}

/// Runs [`LOCK_ACQUIRE_LUA`] for lock `name` (a name like a task name).
pub async fn lock_acquire<C>(
    conn: &mut C,
    keys: &Keys,
    name: &str,
    owner: &str,
    ttl_ms: u64,
) -> RedisResult<LockReply>
where
    C: redis::aio::ConnectionLike,
{
    let (status, token, ttl): (i64, i64, i64) = LOCK_ACQUIRE
        .key(keys.lock(name))
        .key(keys.lock_token(name))
        .arg(owner)
        .arg(ttl_ms.max(1))
        .invoke_async(conn)
        .await?;
    Ok(if status == 1 {
        LockReply::Acquired {
            token: token.max(0) as u64,
        }
    } else {
        LockReply::Busy {
            token: token.max(0) as u64,
            pttl_ms: ttl,
        }
    })
}

/// Runs [`LOCK_RENEW_LUA`]: whether `token` still holds lock `name` (its TTL reset to `ttl_ms`).
pub async fn lock_renew<C>(
    conn: &mut C,
    keys: &Keys,
    name: &str,
    token: u64,
    ttl_ms: u64,
) -> RedisResult<bool>
where
    C: redis::aio::ConnectionLike,
{
    let r: i64 = LOCK_RENEW
        .key(keys.lock(name))
        .arg(token)
        .arg(ttl_ms.max(1))
        .invoke_async(conn)
        .await?;
    Ok(r == 1)
}

/// Runs [`LOCK_RELEASE_LUA`]: whether `token` held lock `name` and released it.
pub async fn lock_release<C>(conn: &mut C, keys: &Keys, name: &str, token: u64) -> RedisResult<bool>
where
    C: redis::aio::ConnectionLike,
{
    let r: i64 = LOCK_RELEASE
        .key(keys.lock(name))
        .arg(token)
        .invoke_async(conn)
        .await?;
    Ok(r == 1)
}
