//! The Lua scripts of the protocol and typed calls to them.
//!
//! Every script touches the keys of one task only (one hash tag, one Cluster slot) and is
//! atomic in Redis. The manager uses [`roll`], [`retire`], [`adjust`], [`record_history`],
//! [`read_slices`] and [`prune_hosts`]; workers use [`pull`] and [`flush`], and for the exact
//! modes [`take`] (`exact_fixed`) and [`slide`] (`exact_sliding`).
//!
//! # Retries
//!
//! [`pull`], [`take`] and [`slide`] (by request id) and [`flush`] (by sequence number) are
//! idempotent, so a caller may send them again after a lost or late answer.
//!
//! # Fencing
//!
//! A leader writes with a [`Fence`]: its election term and its **epoch**, the cluster id of the
//! etcd that elected it. Every leader script starts with the same preamble ([`FENCE_LUA`]),
//! which compares the writer's fence with the one stored in the task's meta hash (`term`,
//! `epoch`, and `fenced_ms`, the Redis time of the last fenced write):
//!
//! ```text
//!   stored epoch equal (or absent: legacy)
//!       stored term ≤ term ............................ write (versions are comparable)
//!       stored term > term, fenced_ms fresh ........... refused: Newer (a newer leader)
//!       stored term > term, fenced_ms ≥ stale_after ... take over (etcd restored: terms went back)
//!   stored epoch different (another etcd, another manager cluster)
//!       fenced_ms fresh ............................... refused: Foreign
//!       fenced_ms ≥ stale_after ....................... take over
//! ```
//!
//! A live leader refreshes `fenced_ms` whenever it advances `rolled_to` and at least every
//! quarter of `stale_after`, so its fence never goes stale while it runs. Once a new leader has
//! touched a task, a deposed leader (paused, partitioned) can no longer change it; the only
//! write that can still land is one delayed in flight for longer than `stale_after` while no
//! leader wrote the task at all, and the next leadership's full first tick repairs it.
//! A takeover is always a full write (meta and the whole window), and spec versions and
//! deletion revisions of another epoch are never compared with the writer's.
//!
//! # Script files
//!
//! The Lua text lives once, in the crate's `scripts/` folder, and the constants are built from
//! it with `include_str!`. A script without shared parts is one file (`kpull.lua`,
//! `flush.lua`, …); a composed one is the concatenation of a shared fragment and its body:
//! every leader script is [`FENCE_LUA`] (`fence.lua`) followed by its body (`roll.lua`, …), and
//! [`PULL_LUA`] is [`PACE_LUA`] (`pace.lua`) followed by `pull.lua`. `scripts/SHA1SUMS` lists
//! the SHA-1 of each script as sent (composed).

use std::sync::LazyLock;

use redis::{RedisResult, Script, Value};

use super::{Keys, TaskMeta};

/// The pacing rule of paced slices (`scripts/parts/pace.lua`), the first part of [`PULL_LUA`].
///
/// Defines `paced_allowance(h, rem, cap, now, start, len)` → `avail, forfeit`: `h` holds the
/// slice's `pace` and `burst` fields (as `HMGET` returns them). For an unpaced slice it returns
/// `rem, 0`. For a paced one, with `granted = cap − rem` (a threshold change moves `cap` and
/// `rem` together, so consumption is kept):
///
/// ```text
///   paced(t) = clamp(floor(cap · (t − start) / len), 0, cap)
///   ahead    = min(floor(len / 40), 1000)                  (25 ms of a 1 s slice)
///   forfeit  = max(0, paced(now) − granted)                released, never pulled: lost
///   avail    = min(rem − forfeit, min(cap, paced(now + ahead) + burst) − granted − forfeit)
/// ```
///
/// So what the pace released while nobody pulled is not saved up (a slice idle for 700 ms does
/// not hand out 700 permits at once): at any pull at most `burst` plus `ahead`'s worth of the
/// pace is available beyond the pace itself. The caller lowers `rem` by `forfeit` (when it
/// grants) and by the grant. `ahead` lets a host hold a little stock, which it spends no
/// faster than the pace (see `docs/sdk.md`), so its decisions do not wait for a pull at every
/// permit.
pub const PACE_LUA: &str = include_str!("../scripts/parts/pace.lua");

/// The lazy slice (protocol 5), shared by PULL, TAKE and SLIDE: defines
/// `lazy_slice(slice, start, len, time)`, which makes a missing task slice from the task's
/// meta (named from the slice's key: `NS:{T}:s:<start>` → `NS:{T}:meta`, read only) when the
/// leader left the task **lazy** (idle: no slices written ahead, issue 27). It returns 1 when
/// it made the slice, -2 when the meta vouches for the slice but Redis time is outside the
/// caller's window (PULL and TAKE answer -2, as for an existing slice), 0 otherwise. The meta
/// vouches with `lz_cap` (the cap of every slice of length `slice_ms` lying within
/// [`lz_from`, `lz_until`): the leader writes them only while that cap is the same for every
/// such slice), `lz_exp` (the slice is kept that long after its end) and `lz_fence` (`<term>
/// <epoch>` of the writer: the window counts only while the meta's fence is still that).
/// A slice is made only when the four numbers are whole and non-negative, the fence matches,
/// the task is not retired, `len` is the meta's `slice_ms`, `start` is on its grid, the slice
/// lies within the window, and Redis time is within the caller's window of the slice (PULL's:
/// from one slice before its start to `end + grace`). It gets `cap`, `rem = cap`, `term` (the
/// meta's), `len`, the pacing ROLL would give it, and expires at `end + lz_exp`. Nothing else
/// is written (the worker ACL reads the meta only): the leader, probing the slices past what
/// it wrote, sees the slice and rolls the task ahead again.
pub const LAZY_LUA: &str = include_str!("../scripts/parts/lazy.lua");

/// The fence shared by every leader script (`scripts/parts/fence.lua`, the first part of each; see
/// the module docs). `ARGV[1..3]`: term, epoch (the etcd cluster id, a decimal string: it does
/// not fit a Lua number), stale_after (ms). Defines `now` (Redis `TIME`, ms), `fence(meta)` and
/// `claim(meta)`.
pub const FENCE_LUA: &str = include_str!("../scripts/parts/fence.lua");

/// Writes meta and slices of one task, fenced (see [`FENCE_LUA`]).
///
/// `KEYS[1]` meta, `KEYS[2..]` slices. `ARGV`: the fence (3), full (0/1), expected `rolled_to`,
/// new `rolled_to`, spec version, force (0/1), refresh (0/1), number of meta pairs `n`, `2n`
/// meta field/values, then per slice: cap, expire-at (Unix ms), then optionally the lazy
/// window (protocol 5): `lz_cap`, `lz_from`, `lz_until`, `lz_exp` (see [`LAZY_LUA`]), written
/// into the meta, and the fence's lifetime `fence_ttl` (ms, 0 = none; see
/// [`LazyWindow::fence_ttl_ms`]); without them the meta's `lz_*` fields and `fence_ttl` are
/// deleted (a task rolled ahead is not lazy). A call that changes `fence_ttl` claims the fence. When `n > 0`, every existing
/// key override field (`ko:*`) is deleted before the pairs are written (overrides are always
/// sent whole with the meta).
///
/// Returns
/// * `{1, written}`;
/// * `{0, term, age_ms}` / `{4, term, age_ms, epoch}`: refused by the fence (nothing written);
/// * `{2, 0}`: the meta hash is missing, retired or behind the leader's expectation (Redis
///   restarted or flushed), or a fence is being taken over: resend the whole window with
///   `full = 1`;
/// * `{3, retired_rev}`: the task was deleted at etcd revision `retired_rev`, not older than the
///   spec version being written — the writer has not seen the deletion and must not resurrect
///   the task;
/// * `{5, stored_version}`: the stored spec version is newer than the writer's (a lagging
///   snapshot): nothing written.
/// * `{6, 0}`: a full write with a lazy window and no slices over a meta that is not a live
///   lazy meta of this version written under its own fence (nor absent): nothing written
///   (slices already there may hold other caps: write the window ahead).
///
/// The version and deletion checks apply only within one epoch and without a takeover, and
/// `force = 1` skips them (the writer found the stored numbers to come from another etcd
/// history). `refresh = 1` rewrites `fenced_ms` even when `rolled_to` does not move.
///
/// Every slice written or passed gets the task's pacing from the meta hash (after this call's
/// meta pairs): `pace = 1` and `burst` when `pacing` is `smooth` and `mode` is `pooled`, else
/// no `pace`/`burst` fields (see [`PACE_LUA`]); and its length, `len` = the meta's `slice_ms`,
/// so the traffic history knows how long a slice was after the task's `slice_ms` changed (a
/// key of the old grid whose start lies on the new one and that is written again gets the new
/// length; one that has ended keeps the old).
///
/// A slice that exists with another cap gets `rem += new_cap - old_cap` (consumption is kept);
/// one with the same cap is left alone, so replays are harmless. An existing slice whose key
/// expires before the requested expiry is extended (a longer `slice_ms` reuses keys of the old
/// grid whose start coincides), never shortened.
pub const ROLL_LUA: &str = concat!(
    include_str!("../scripts/parts/fence.lua"),
    include_str!("../scripts/parts/roll.lua"),
);

/// Marks a deleted task, fenced (see [`FENCE_LUA`]): the meta hash is replaced by a tombstone
/// that keeps only the fence (`term`, `epoch`, `fenced_ms`) and the etcd revision of the
/// deletion (`retired`), expiring after the tombstone ttl; every other key of the task's state
/// given in `KEYS[2..]` (dynamic state, adjustments, health reports, sliding log, history
/// rings) is deleted, so a task re-created under the same name starts clean. Slices are left
/// to expire (workers holding quota keep serving until the slice ends).
///
/// `KEYS[1]` meta, `KEYS[2..]` keys to delete. `ARGV`: the fence (3), tombstone ttl (ms),
/// deletion revision, force (0/1). Returns `{1, 0}`, a fence refusal (`{0, term, age}` /
/// `{4, term, age, epoch}`), or `{5, stored_version}`: the stored spec is newer than the
/// deletion (the task was re-created since; same epoch only, skipped with `force = 1`).
pub const RETIRE_LUA: &str = concat!(
    include_str!("../scripts/parts/fence.lua"),
    include_str!("../scripts/parts/retire.lua"),
);

/// Pulls up to `ARGV[1]` permits from one slice; optionally adds counters to it.
///
/// `KEYS[1]` slice (protocol 5: a missing slice of a lazy task is made from the task's meta,
/// named from it, [`LAZY_LUA`]). `ARGV`: want, slice start (Unix ms), slice length (ms), host
/// id, request id, then optionally six counter deltas (adm, rej, ok, err, lat_sum_us, lat_n) added to this slice.
///
/// Returns `{granted, remaining, cap, time_s, time_us, replayed}` with Redis `TIME`:
///
/// * `granted = -1`: the slice does not exist and the meta does not vouch for it (see
///   [`LAZY_LUA`]);
/// * `granted = -2`: **outside the window**: Redis time is before `start − slice_ms` (the
///   slice has not started, beyond the one-slice prefetch allowance) or after
///   `end + grace` with `grace = min(slice_ms / 4, 250 ms)` (the slice is over); nothing is
///   granted or counted;
/// * otherwise `min(want, rem)` (0 when `rem ≤ 0`) is granted and `rem` lowered; on a paced
///   slice (`pace = 1`) at most what the pace has released so far ([`PACE_LUA`]), so a grant
///   of 0 with `remaining > 0` means "wait for the pace", not "exhausted".
///
/// The optional counters (since protocol 3: six or seven, the seventh being `wrej`) are added
/// to this slice (a grant retry never adds them twice: it returns before).
///
/// **Idempotent by request id**: the host's last pull of the slice is recorded in the slice
/// hash as `p:<host id> = <request id>:<granted>`; a pull with the same request id (a retry)
/// returns that grant again with `replayed = 1` and changes nothing. A host's pulls are
/// exclusive (its pull lock), so the last one is the only one a retry can repeat.
pub const PULL_LUA: &str = concat!(
    include_str!("../scripts/parts/pace.lua"),
    include_str!("../scripts/parts/lazy.lua"),
    include_str!("../scripts/parts/pull.lua"),
);

/// Pulls permits for one or more **keys** of a keyed task in one call (one slice, one task:
/// one hash tag). Every key's quota of the slice is a field of one hash per task and slice,
/// `NS:{T}:k:<start>` ([`crate::Keys::key_slices`]), which the slice's first key pull creates
/// from the task's state (the leader never pre-rolls keys): a call costs `TIME`, one `HMGET`
/// and at most one `HSET` however many keys it carries (plus, when it creates the hash or a key
/// of a task with overrides is new in the slice, one `HMGET` of the meta; the hash's creation
/// also reads the task slice's `cap` and sets the expiry).
///
/// `KEYS[1]` the key quota hash `k:<start>`, `KEYS[2]` the task's slice `s:<start>` (rolled by
/// the leader: its `cap` is the per-key threshold of that slice, schedules and dynamic
/// limiting included; only read). `ARGV`: slice start (Unix ms), slice length (ms), host id,
/// request id, the caller's meta version, all-or-nothing (0/1), the name of the task's meta
/// hash `NS:{T}:meta`, then per key: want, digest (at most 1,000 keys: more is an error).
///
/// The meta hash is only read, and is named in `ARGV`, not declared in `KEYS`: Redis's ACLs
/// treat every key an `EVALSHA` declares as written, and workers may only read meta (the
/// fence). It shares the task's hash tag, so it is in the same Cluster slot as the declared
/// keys and the script stays single-slot.
///
/// Returns `{status, time_s, time_us, stored_version, then per key: granted, remaining, cap,
/// replayed}`:
///
/// * status `1`: the per-key fields are valid;
/// * `-2`: Redis time is outside the slice's window (as [`PULL_LUA`]); nothing done;
/// * `-1`: the key quota hash or a key had to be made but cannot be: the meta is missing,
///   retired or not keyed (`keyed` ≠ `1`), or the task slice does not exist; nothing done;
/// * `-3`: the caller's meta version is older than the stored one (`stored_version`) where it
///   matters: the hash or a key with possible overrides had to be made (a host that has not
///   seen a spec change never makes a key's quota from it), or the hash was made for another
///   slice length by a spec the caller has not moved past; nothing done.
///
/// The hash's creation records the slice's `cap`, the meta's `threshold` (`base`) and
/// `version` (`v`), whether the task has overrides (`ko`: `0` when the meta's `ko_n` is `0`),
/// and `len`, and sets its expiry to `start + 2·len + 5 s`. A key new in the slice gets
/// `cap`, or for an override `ko:<digest> = o` `floor(o · cap / base)` (`o` itself when `base`
/// is 0): overrides follow schedules and dynamic limiting in proportion, and a spec change
/// reaches every key from the next slice. The field holds `<rem>`, or `<rem>:<cap>` for a key
/// whose cap is not the hash's. Then, per key, `min(want, rem)` is granted (with
/// all-or-nothing: `want` if `rem ≥ want`, else 0). **Idempotent by request id per host**: a
/// call that grants anything records `q:<host> = <request id>|<its per-key answers>`, and a
/// resend with the same request id (while no later call of the host granted) is answered with
/// it (`replayed = 1`); an older resend runs again, and what it takes is stranded, never
/// admitted twice.
pub const KPULL_LUA: &str = include_str!("../scripts/kpull.lua");

/// Adds counters to slices that still exist (a missing slice is skipped, never created).
///
/// `KEYS` slices; `ARGV`: host id, flush sequence number, then six or seven deltas per key
/// (adm, rej, ok, err, lat_sum_us, lat_n, and since protocol 3 optionally wrej; the count per
/// key is `(#ARGV − 2) / #KEYS`, which is unambiguous, so a protocol-2 caller's six still
/// work). Returns how many of the slices exist.
///
/// **Idempotent by sequence number**: each slice records the host's last applied flush as
/// `f:<host id> = <seq>`, and a flush whose `seq` is not above it is skipped for that slice.
/// A host's flushes are exclusive (its flush lock) and numbered in increasing order, so a
/// retry (same `seq`) never counts twice, nor does a late duplicate of an older flush.
///
/// **All or nothing**: every delta and every counter it adds to is checked first; a delta or
/// stored value that is not a plain decimal integer as HINCRBY reads one (no leading zeros,
/// at most 20 characters), a delta beyond ±9.2 × 10^18, or a sum that would leave ±9.2 × 10^18
/// (HINCRBY's i64, with room for the doubles Lua compares in), refuses the whole flush with an
/// error naming the slice and field, before any write. Except `rej` and `wrej`, which
/// **saturate** at 9.2 × 10^18: a refused request counts its cost at face value (up to
/// `MAX_COUNT`), so a long slice under hostile costs can reach the limit, and a statistic
/// pinned at its ceiling is better than dropping the slice's `adm` with it. The deltas go to HINCRBY as the strings
/// they came as (a Lua number would be written back as `1e+17`, which HINCRBY refuses). (A
/// script is not rolled back on error: before, the counters added ahead of a failing HINCRBY
/// stayed, without the sequence number, so a resend added them twice.)
pub const FLUSH_LUA: &str = include_str!("../scripts/flush.lua");

/// Records a dynamic-limiting decision, fenced (see [`FENCE_LUA`]): the controller state and
/// the adjustment log of a task can only be written by the current leader, and only while the
/// task exists (a delayed write after a deletion never brings its state back).
///
/// `KEYS[1]` meta, `KEYS[2]` `NS:{T}:dyn` (hash), `KEYS[3]` `NS:{T}:adj` (list, newest first).
/// `ARGV`: the fence (3), keep (log length), adjustment JSON ('' = none), clear (0/1: delete
/// the state first), then state field/value pairs.
/// Returns `{1, 0}`, a fence refusal, or `{2, 0}`: the task's meta is missing or retired.
pub const ADJUST_LUA: &str = concat!(
    include_str!("../scripts/parts/fence.lua"),
    include_str!("../scripts/parts/adjust.lua"),
);

/// `exact_fixed`: takes exactly `n` permits from one slice, or none.
///
/// `KEYS[1]` slice (a missing slice of a lazy task is made from the meta, as PULL's). `ARGV`:
/// n, slice start (Unix ms), slice length (ms), request id (may be empty). Counts the decision in the slice (`adm` or `rej`), so exact decisions need no
/// flush. Returns `{status, remaining, cap, time_s, time_us, 0}` with status 1 = taken, 0 =
/// refused (fewer than `n` left), -1 = the slice does not exist (and the meta does not vouch
/// for it), -2 = outside
/// the slice's window (the same window as [`PULL_LUA`]; nothing taken or counted).
///
/// **Idempotent by request id**: an admission records `r:<request id> = n` in the slice hash
/// (which expires with the slice); a call whose request id is recorded there is answered
/// "taken" again and changes nothing, even after the window closed. One field per admitted
/// decision: the exact modes are for low rates. A refusal records nothing (a retry is decided
/// afresh, and counted in `rej` again).
pub const TAKE_LUA: &str = concat!(
    include_str!("../scripts/parts/lazy.lua"),
    include_str!("../scripts/parts/take.lua"),
);

/// `exact_sliding`: admits `n` when fewer than the current slice's `cap` minus `n` admissions
/// lie in the window (one slice long) ending at Redis `TIME`, and the current slice still has
/// `n` left (`rem`, which the admission lowers); a sorted set of admissions (`NS:{T}:log`,
/// scores in µs) is the log. Within one slice the window rule is the tighter one; the slice's
/// `rem` binds after a mode change: what the slice admitted as `pooled` or `exact_fixed` counts
/// here too, and what is admitted here counts for them (no 2× across a switch).
///
/// `KEYS[1]` the log, `KEYS[2]` the current slice (its `cap` is the limit, effective
/// threshold included; the decision is counted there), `KEYS[3]` the log's sequence
/// (`NS:{T}:log:seq`). `ARGV`: n (≤ 1,000), window (ms), the caller's nonce (random per
/// client), the slice's start (Unix ms; a refusal by `rem` retries at the slice's end), request
/// id (may be empty); a missing slice of a lazy task is made from the meta, as PULL's. Members are `<nonce>:<seq>:<i>` with `seq` from `INCR` of `KEYS[3]`, so
/// they are unique by construction (across clients, processes and restarts); the sequence
/// expires with the log. Returns `{status, remaining, cap, time_s, time_us, retry_after_us}`
/// with status 1 = admitted, 0 = refused, -1 = the slice does not exist.
///
/// **Idempotent by request id**, as [`TAKE_LUA`]: an admission records `r:<request id> = n` in
/// the slice hash; a call whose request id is recorded is answered "admitted" again and adds
/// nothing to the log or the slice.
pub const SLIDE_LUA: &str = concat!(
    include_str!("../scripts/parts/lazy.lua"),
    include_str!("../scripts/parts/slide.lua"),
);

/// Reads `cap` and `rem` of several slices of one task in one call (the leader's clock-skew
/// detector). `KEYS` slices. Returns `cap, rem` per key, `-1, 0` for a missing slice.
pub const READ_SLICES_LUA: &str = include_str!("../scripts/read_slices.lua");

static ROLL: LazyLock<Script> = LazyLock::new(|| Script::new(ROLL_LUA));
static READ_SLICES: LazyLock<Script> = LazyLock::new(|| Script::new(READ_SLICES_LUA));
static ADJUST: LazyLock<Script> = LazyLock::new(|| Script::new(ADJUST_LUA));
static RETIRE: LazyLock<Script> = LazyLock::new(|| Script::new(RETIRE_LUA));
static PULL: LazyLock<Script> = LazyLock::new(|| Script::new(PULL_LUA));
static KPULL: LazyLock<Script> = LazyLock::new(|| Script::new(KPULL_LUA));
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

/// The fence a leader writes with (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// Election term (the leader key's creation revision).
    pub term: i64,
    /// The etcd cluster id of the election: terms of different epochs are not comparable.
    pub epoch: u64,
    /// A stored fence not refreshed for this long may be taken over (ms).
    pub stale_after_ms: u64,
}

impl Fence {
    /// The fence's three script arguments, in [`FENCE_LUA`]'s order.
    fn args(&self) -> (i64, String, u64) {
        (
            self.term,
            self.epoch.to_string(),
            self.stale_after_ms.max(1),
        )
    }

    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        let (term, epoch, stale) = self.args();
        inv.arg(term).arg(epoch).arg(stale);
    }
}

/// Why the fence refused a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceRefusal {
    /// A newer term of the same epoch holds the task.
    Newer {
        /// The stored term.
        term: i64,
        /// Time since the stored fence was last written (Redis time, ms).
        age_ms: i64,
    },
    /// Another epoch (another etcd, another manager cluster) holds the task and wrote it less
    /// than `stale_after` ago.
    Foreign {
        /// The stored epoch (etcd cluster id, decimal).
        epoch: String,
        /// The stored term (of that epoch).
        term: i64,
        /// Time since the stored fence was last written (Redis time, ms).
        age_ms: i64,
    },
}

impl FenceRefusal {
    /// The stored term.
    pub fn term(&self) -> i64 {
        match self {
            Self::Newer { term, .. } | Self::Foreign { term, .. } => *term,
        }
    }

    /// Time since the stored fence was last written (ms).
    pub fn age_ms(&self) -> i64 {
        match self {
            Self::Newer { age_ms, .. } | Self::Foreign { age_ms, .. } => *age_ms,
        }
    }
}

/// A leader script's reply: a status and the integers (or strings) after it.
struct Reply(Vec<Value>);

impl Reply {
    fn parse(v: Value) -> RedisResult<Self> {
        Ok(Self(redis::from_redis_value(v)?))
    }

    fn int(&self, i: usize) -> RedisResult<i64> {
        match self.0.get(i) {
            Some(v) => Ok(redis::from_redis_value_ref(v)?),
            None => Ok(0),
        }
    }

    fn status(&self) -> RedisResult<i64> {
        self.int(0)
    }

    /// The refusal of statuses 0 and 4.
    fn refusal(&self) -> RedisResult<Option<FenceRefusal>> {
        Ok(match self.status()? {
            0 => Some(FenceRefusal::Newer {
                term: self.int(1)?,
                age_ms: self.int(2)?,
            }),
            4 => Some(FenceRefusal::Foreign {
                term: self.int(1)?,
                age_ms: self.int(2)?,
                epoch: match self.0.get(3) {
                    Some(v) => redis::from_redis_value_ref(v)?,
                    None => String::new(),
                },
            }),
            _ => None,
        })
    }
}

/// A fenced write of one task's meta and slices.
#[derive(Debug, Clone)]
pub struct RollRequest<'a> {
    /// The task.
    pub task: &'a str,
    /// The writer's fence.
    pub fence: &'a Fence,
    /// Rewrite everything: meta fields and the whole window, regardless of the meta state.
    pub full: bool,
    /// The `rolled_to` the writer believes is stored (ignored when `full`).
    pub expect_rolled_to: i64,
    /// The spec version (etcd mod revision) being written.
    pub spec_version: i64,
    /// The new `rolled_to` (end of the last slice written).
    pub new_rolled_to: i64,
    /// Skip the spec-version and deletion checks: the stored numbers come from another etcd
    /// history (see [`RollOutcome::StaleSpec`]).
    pub force: bool,
    /// Rewrite `fenced_ms` even if `rolled_to` does not advance.
    pub refresh: bool,
    /// Meta fields to (re)write, if any.
    pub meta: Option<&'a TaskMeta>,
    /// More meta fields written with `meta` (ignored without it): a keyed task's
    /// [`crate::meta_field::CLEAR_KEYS`] and [`crate::meta_field::KEY_SECRET`].
    pub meta_extra: &'a [(&'static str, String)],
    /// Slices to create or change.
    pub slices: &'a [SliceWrite],
    /// The task is lazy (protocol 5): the window workers may make slices in; `None` deletes
    /// the meta's lazy fields.
    pub lazy: Option<&'a LazyWindow>,
}

/// What the meta of a lazy task vouches for (see [`LAZY_LUA`]): workers make any missing
/// slice lying within [`from_ms`, `until_ms`) with cap `cap`, kept `expire_after_ms` after
/// its end.
///
/// [`from_ms`]: LazyWindow::from_ms
/// [`until_ms`]: LazyWindow::until_ms
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LazyWindow {
    /// The cap of every slice in the window.
    pub cap: u64,
    /// Start of the first slice (Unix ms).
    pub from_ms: i64,
    /// End of the last slice (Unix ms).
    pub until_ms: i64,
    /// How long a slice is kept after its end (ms): the leader's retention.
    pub expire_after_ms: u64,
    /// How long the fence this write claims holds (ms, the meta's `fence_ttl`): a lazy task's
    /// fence is refreshed less often than `stale_after / 4`, so it says so, and a writer of
    /// another term or epoch takes it over only past the longer of this and its own
    /// `stale_after` (counted up to 10 minutes). 0: none (the callers' `stale_after`).
    pub fence_ttl_ms: u64,
}

/// What [`roll`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollOutcome {
    /// Done; this many slices were created or changed.
    Written(u64),
    /// Refused by the fence; nothing written.
    Refused(FenceRefusal),
    /// The meta hash is missing, retired or behind, or a fence is being taken over: resend
    /// with `full = true`.
    NeedFull,
    /// A full write leaving the task lazy (no slices, a lazy window) was refused: the stored
    /// meta is not a live lazy meta of this spec version (a tombstone, another version, a
    /// window of another fence), so slices there may hold other caps: nothing written; write
    /// the window ahead instead.
    NotLazy,
    /// The task was deleted (at this etcd revision) after the spec being written: skip it.
    Retired {
        /// Revision of the deletion.
        revision: i64,
    },
    /// The stored spec version is newer than the one being written: skip the task.
    StaleSpec {
        /// The stored version.
        stored_version: i64,
    },
}

/// The leader's cheap probe of a task it has nothing to write for: one `HMGET` of the meta
/// (`term`, `epoch`, `rolled_to`, `retired`, `version`, `lz_until`), and for a lazy task an
/// `EXISTS` of the slices in `made` in the same round trip; no script, nothing written.
///
/// [`RollProbe::vouch`] when [`roll`] with no slices, no meta and no refresh would answer
/// `Written(0)` without writing anything: the meta holds this fence's term and epoch (so no
/// other writer has claimed it since), is not retired, is rolled to at least
/// `expect_rolled_to` (Redis has not lost or rewound it), holds no spec version above
/// `spec_version` and, for a lazy task (`expect_lazy_until`), still holds its lazy window to
/// at least that. `false` for anything else, including a field that does not parse: the caller
/// then makes the real call, whose answer is authoritative. Issue 27: the probe every tick is
/// most of an idle task's cost, and a script call costs Redis several times this one command.
#[allow(clippy::too_many_arguments)]
pub async fn roll_probe<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    fence: &Fence,
    expect_rolled_to: i64,
    spec_version: i64,
    expect_lazy_until: Option<i64>,
    made: &[i64],
) -> RedisResult<RollProbe>
where
    C: redis::aio::ConnectionLike,
{
    let mut pipe = redis::pipe();
    pipe.cmd("HMGET")
        .arg(keys.meta(task))
        .arg(crate::meta_field::TERM)
        .arg(crate::meta_field::EPOCH)
        .arg(crate::meta_field::ROLLED_TO)
        .arg(crate::meta_field::RETIRED)
        .arg(crate::meta_field::VERSION)
        .arg(crate::meta_field::LZ_UNTIL);
    if !made.is_empty() {
        let exists = pipe.cmd("EXISTS");
        for s in made {
            exists.arg(keys.slice(task, *s));
        }
    }
    type Fields = [Option<String>; 6];
    let ([term, epoch, rolled_to, retired, version, lz_until], made): (Fields, i64) =
        if made.is_empty() {
            let (f,): (Fields,) = pipe.query_async(conn).await?;
            (f, 0)
        } else {
            pipe.query_async(conn).await?
        };
    let num = |v: &Option<String>| v.as_deref().and_then(|v| v.parse::<i64>().ok());
    let vouch = num(&term) == Some(fence.term)
        && epoch.as_deref() == Some(fence.epoch.to_string().as_str())
        && retired.is_none()
        && num(&rolled_to).is_some_and(|r| r >= expect_rolled_to)
        && match &version {
            None => true,
            Some(_) => num(&version).is_some_and(|v| v <= spec_version),
        }
        && expect_lazy_until.is_none_or(|u| num(&lz_until).is_some_and(|l| l >= u));
    Ok(RollProbe {
        vouch,
        made: made > 0,
    })
}

/// What [`roll_probe`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RollProbe {
    /// The roll script would write nothing: no call needed.
    pub vouch: bool,
    /// One of the slices asked about exists: a worker made it (the task has traffic).
    pub made: bool,
}

/// Outcome of [`retire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetireOutcome {
    /// The meta hash is now a tombstone; the task's other state is deleted.
    Retired,
    /// Refused by the fence; nothing written.
    Refused(FenceRefusal),
    /// The stored spec is newer than the deletion (the task was re-created): nothing written.
    Superseded {
        /// The stored version.
        stored_version: i64,
    },
}

/// Runs [`ROLL_LUA`].
pub async fn roll<C>(conn: &mut C, keys: &Keys, req: &RollRequest<'_>) -> RedisResult<RollOutcome>
where
    C: redis::aio::ConnectionLike,
{
    let cmd = roll_cmd(keys, req);
    let v = match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            ROLL.load_async(conn).await?;
            cmd.query_async(conn).await?
        }
        r => r?,
    };
    roll_outcome(v)
}

/// Runs [`ROLL_LUA`] and, in the same round trip just before it, asks whether any of the
/// task's slices starting at `made` exists (as [`roll_probe`] does: for a lazy task, a slice
/// only a worker can have made). Issue 27: a lazy task's fence refresh and its probe for
/// traffic were two round trips per refresh period; now they are one. With `made` empty this
/// is [`roll`].
pub async fn roll_watching<C>(
    conn: &mut C,
    keys: &Keys,
    req: &RollRequest<'_>,
    made: &[i64],
) -> RedisResult<(RollOutcome, bool)>
where
    C: redis::aio::ConnectionLike,
{
    if made.is_empty() {
        return Ok((roll(conn, keys, req).await?, false));
    }
    let mut pipe = redis::pipe();
    let exists = pipe.cmd("EXISTS");
    for s in made {
        exists.arg(keys.slice(req.task, *s));
    }
    pipe.add_command(roll_cmd(keys, req));
    let (found, v): (i64, Value) = match pipe.query_async(conn).await {
        // A Redis that lost its scripts (a restart): EXISTS is only a read, so the pipeline is
        // sent again as a whole once the script is loaded.
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            ROLL.load_async(conn).await?;
            pipe.query_async(conn).await?
        }
        r => r?,
    };
    Ok((roll_outcome(v)?, found > 0))
}

/// The `EVALSHA` of [`ROLL_LUA`] for `req` (callers load the script on `NOSCRIPT`).
fn roll_cmd(keys: &Keys, req: &RollRequest<'_>) -> redis::Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(ROLL.get_hash())
        .arg(1 + req.slices.len())
        .arg(keys.meta(req.task));
    for s in req.slices {
        c.arg(keys.slice(req.task, s.start_ms));
    }
    let (term, epoch, stale) = req.fence.args();
    c.arg(term).arg(epoch).arg(stale);
    c.arg(if req.full { 1 } else { 0 })
        .arg(req.expect_rolled_to)
        .arg(req.new_rolled_to)
        .arg(req.spec_version)
        .arg(if req.force { 1 } else { 0 })
        .arg(if req.refresh { 1 } else { 0 });
    match req.meta {
        Some(meta) => {
            let pairs = meta.to_pairs();
            let overrides = meta.override_pairs();
            c.arg(pairs.len() + req.meta_extra.len() + overrides.len());
            for (k, v) in pairs {
                c.arg(k).arg(v);
            }
            for (k, v) in req.meta_extra {
                c.arg(*k).arg(v);
            }
            for (k, v) in overrides {
                c.arg(k).arg(v);
            }
        }
        None => {
            c.arg(0);
        }
    }
    for s in req.slices {
        c.arg(s.cap).arg(s.expire_at_ms);
    }
    if let Some(l) = req.lazy {
        c.arg(l.cap)
            .arg(l.from_ms)
            .arg(l.until_ms)
            .arg(l.expire_after_ms)
            .arg(l.fence_ttl_ms);
    }
    c
}

/// What a [`ROLL_LUA`] reply says.
fn roll_outcome(v: Value) -> RedisResult<RollOutcome> {
    let r = Reply::parse(v)?;
    if let Some(refusal) = r.refusal()? {
        return Ok(RollOutcome::Refused(refusal));
    }
    Ok(match r.status()? {
        1 => RollOutcome::Written(r.int(1)?.max(0) as u64),
        3 => RollOutcome::Retired {
            revision: r.int(1)?,
        },
        5 => RollOutcome::StaleSpec {
            stored_version: r.int(1)?,
        },
        6 => RollOutcome::NotLazy,
        _ => RollOutcome::NeedFull,
    })
}

/// The keys [`retire`] deletes besides the meta hash: everything a task accumulates that must
/// not outlive it (all in the task's slot).
pub fn task_state_keys(keys: &Keys, task: &str) -> Vec<String> {
    vec![
        keys.dynamic_state(task),
        keys.adjustments(task),
        keys.health_reports(task),
        keys.sliding_log(task),
        keys.sliding_log_seq(task),
        keys.lease(task),
        keys.history(task, "1s"),
        keys.history(task, "1m"),
    ]
}

/// The top-key sets of a keyed task ([`Keys::top_keys`], [`Keys::top_rejected_keys`]) that
/// [`retire`] deletes at `now_ms`: those of the minute holding `now_ms`, the 11 before it and
/// the one after it. Hosts write the set of their clock's minute and each expires 10 minutes
/// after its last write, so this covers every live set (with a minute of margin each way for
/// host clocks and a minute boundary passed between the two), and a task re-created under
/// the same name never shows the old task's keys.
pub fn top_key_sets(keys: &Keys, task: &str, now_ms: i64) -> Vec<String> {
    let current = now_ms - now_ms.rem_euclid(60_000);
    (-1..=11i64)
        .map(|i| current - i * 60_000)
        .flat_map(|m| [keys.top_keys(task, m), keys.top_rejected_keys(task, m)])
        .collect()
}

/// Runs [`RETIRE_LUA`]: tombstones the meta of `task` (deleted at etcd revision
/// `deleted_at_revision`) and deletes its [`task_state_keys`] and [`top_key_sets`].
pub async fn retire<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    fence: &Fence,
    tombstone_ttl_ms: u64,
    deleted_at_revision: i64,
    force: bool,
) -> RedisResult<RetireOutcome>
where
    C: redis::aio::ConnectionLike,
{
    let mut inv = RETIRE.prepare_invoke();
    inv.key(keys.meta(task));
    for k in task_state_keys(keys, task) {
        inv.key(k);
    }
    for k in top_key_sets(keys, task, super::unix_ms()) {
        inv.key(k);
    }
    fence.push(&mut inv);
    inv.arg(tombstone_ttl_ms.max(1))
        .arg(deleted_at_revision)
        .arg(if force { 1 } else { 0 });
    let r = Reply::parse(inv.invoke_async(conn).await?)?;
    if let Some(refusal) = r.refusal()? {
        return Ok(RetireOutcome::Refused(refusal));
    }
    Ok(match r.status()? {
        5 => RetireOutcome::Superseded {
            stored_version: r.int(1)?,
        },
        _ => RetireOutcome::Retired,
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
    /// Shadow mode: rejections (counted in `rejected` too) that were admitted.
    pub would_reject: u64,
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

    /// The counters PULL and FLUSH send, in [`super::slice_field::WIRE_COUNTERS`] order.
    pub fn as_wire(&self) -> [u64; 7] {
        let a = self.as_array();
        [a[0], a[1], a[2], a[3], a[4], a[5], self.would_reject]
    }

    /// True when every counter is zero.
    pub fn is_zero(&self) -> bool {
        self.as_wire().iter().all(|v| *v == 0)
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
        for v in c.as_wire() {
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

/// One key of a [`KeyPullBatch`].
#[derive(Debug, Clone, Copy)]
pub struct KeyWant<'a> {
    /// The key's digest ([`super::key_digest`]).
    pub digest: &'a str,
    /// Permits asked for.
    pub want: u64,
}

/// One KPULL ([`KPULL_LUA`]): permits for keys of one keyed task in one slice.
#[derive(Debug, Clone)]
pub struct KeyPullBatch<'a> {
    /// The task.
    pub task: &'a str,
    /// Slice start (Unix ms).
    pub start_ms: i64,
    /// Slice length (ms).
    pub slice_ms: u64,
    /// This host.
    pub host_id: &'a str,
    /// Unique per call (a retry reuses it).
    pub request_id: &'a str,
    /// The meta version the caller decides under.
    pub meta_version: i64,
    /// Grant each key `want` or nothing.
    pub all_or_nothing: bool,
    /// The keys.
    pub keys: &'a [KeyWant<'a>],
}

/// One key's answer in a [`KeyPullBatchReply::Granted`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyGrant {
    /// Permits granted (0 = the key's slice is spent, or all-or-nothing could not be met).
    pub granted: u64,
    /// Left in the key's slice after the grant.
    pub remaining: i64,
    /// The key's cap for the slice.
    pub cap: u64,
    /// A retry answered with the first attempt's grant.
    pub replayed: bool,
}

/// What [`key_pull_batch`] answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPullBatchReply {
    /// One grant per key, in order.
    Granted {
        /// The grants.
        grants: Vec<KeyGrant>,
        /// Redis `TIME` (µs).
        redis_time_us: i64,
    },
    /// A key slice cannot be created: the task is missing, retired, not keyed, or its slice is
    /// not rolled. Nothing was done.
    Missing {
        /// Redis `TIME` (µs).
        redis_time_us: i64,
    },
    /// Redis time is outside the slice's window. Nothing was done.
    OutsideWindow {
        /// Redis `TIME` (µs).
        redis_time_us: i64,
    },
    /// The caller's meta is older than the stored one: re-read it. Nothing was done.
    StaleMeta {
        /// The stored version.
        stored_version: i64,
        /// Redis `TIME` (µs).
        redis_time_us: i64,
    },
}

/// How many resend records (`q:<host>:<r>`) a host keeps in a key quota hash.
pub const KEY_PULL_RECORDS: u64 = 64;

/// KPULL's third argument: which of the host's [`KEY_PULL_RECORDS`] resend records a call
/// uses, `<host>:<r>` with `r` = FNV-1a (64-bit) of the request id, modulo 64 — the same for a
/// resend, spread over the records for a host's concurrent pulls.
pub fn key_pull_record(host_id: &str, request_id: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in request_id.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{host_id}:{}", h % KEY_PULL_RECORDS)
}

/// Runs [`KPULL_LUA`] for the keys of `req`.
pub async fn key_pull_batch<C>(
    conn: &mut C,
    keys: &Keys,
    req: &KeyPullBatch<'_>,
) -> RedisResult<KeyPullBatchReply>
where
    C: redis::aio::ConnectionLike,
{
    let mut inv = KPULL.prepare_invoke();
    inv.key(keys.key_slices(req.task, req.start_ms))
        .key(keys.slice(req.task, req.start_ms));
    inv.arg(req.start_ms)
        .arg(req.slice_ms)
        .arg(key_pull_record(req.host_id, req.request_id))
        .arg(req.request_id)
        .arg(req.meta_version)
        .arg(u8::from(req.all_or_nothing))
        .arg(keys.meta(req.task));
    for k in req.keys {
        inv.arg(k.want).arg(k.digest);
    }
    let v: Vec<i64> = redis::from_redis_value(inv.invoke_async(conn).await?)?;
    let int = |i: usize| v.get(i).copied().unwrap_or(0);
    let redis_time_us = int(1) * 1_000_000 + int(2);
    Ok(match int(0) {
        1 => {
            if v.len() < 4 || !(v.len() - 4).is_multiple_of(4) {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "KPULL answered a malformed list of grants",
                )));
            }
            let grants: Vec<KeyGrant> = v[4..]
                .chunks_exact(4)
                .map(|c| KeyGrant {
                    granted: c[0].max(0) as u64,
                    remaining: c[1],
                    cap: c[2].max(0) as u64,
                    replayed: c[3] == 1,
                })
                .collect();
            if grants.len() != req.keys.len() {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "KPULL answered the wrong number of grants",
                )));
            }
            KeyPullBatchReply::Granted {
                grants,
                redis_time_us,
            }
        }
        -3 => KeyPullBatchReply::StaleMeta {
            stored_version: int(3),
            redis_time_us,
        },
        -2 => KeyPullBatchReply::OutsideWindow { redis_time_us },
        _ => KeyPullBatchReply::Missing { redis_time_us },
    })
}

/// One key's KPULL ([`KPULL_LUA`] with one key).
#[derive(Debug, Clone)]
pub struct KeyPullRequest<'a> {
    /// The task.
    pub task: &'a str,
    /// The key's digest ([`super::key_digest`]).
    pub digest: &'a str,
    /// Slice start (Unix ms).
    pub start_ms: i64,
    /// Slice length (ms).
    pub slice_ms: u64,
    /// Permits asked for.
    pub want: u64,
    /// This host.
    pub host_id: &'a str,
    /// Unique per call (a retry reuses it).
    pub request_id: &'a str,
    /// The meta version the caller decides under.
    pub meta_version: i64,
    /// Grant `want` or nothing.
    pub all_or_nothing: bool,
}

/// What [`key_pull`] answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPullReply {
    /// Granted this many (0 = the key's slice is spent, or all-or-nothing could not be met).
    Granted {
        /// Permits granted.
        granted: u64,
        /// Left in the key's slice after the grant.
        remaining: i64,
        /// The key's cap for the slice.
        cap: u64,
        /// Redis `TIME` (µs).
        redis_time_us: i64,
        /// A retry answered with the first attempt's grant.
        replayed: bool,
    },
    /// See [`KeyPullBatchReply::Missing`].
    Missing {
        /// Redis `TIME` (µs).
        redis_time_us: i64,
    },
    /// See [`KeyPullBatchReply::OutsideWindow`].
    OutsideWindow {
        /// Redis `TIME` (µs).
        redis_time_us: i64,
    },
    /// See [`KeyPullBatchReply::StaleMeta`].
    StaleMeta {
        /// The stored version.
        stored_version: i64,
        /// Redis `TIME` (µs).
        redis_time_us: i64,
    },
}

/// Runs [`KPULL_LUA`] for one key.
pub async fn key_pull<C>(
    conn: &mut C,
    keys: &Keys,
    req: &KeyPullRequest<'_>,
) -> RedisResult<KeyPullReply>
where
    C: redis::aio::ConnectionLike,
{
    let one = [KeyWant {
        digest: req.digest,
        want: req.want,
    }];
    let batch = KeyPullBatch {
        task: req.task,
        start_ms: req.start_ms,
        slice_ms: req.slice_ms,
        host_id: req.host_id,
        request_id: req.request_id,
        meta_version: req.meta_version,
        all_or_nothing: req.all_or_nothing,
        keys: &one,
    };
    Ok(match key_pull_batch(conn, keys, &batch).await? {
        KeyPullBatchReply::Granted {
            grants,
            redis_time_us,
        } => {
            let g = grants[0];
            KeyPullReply::Granted {
                granted: g.granted,
                remaining: g.remaining,
                cap: g.cap,
                redis_time_us,
                replayed: g.replayed,
            }
        }
        KeyPullBatchReply::Missing { redis_time_us } => KeyPullReply::Missing { redis_time_us },
        KeyPullBatchReply::OutsideWindow { redis_time_us } => {
            KeyPullReply::OutsideWindow { redis_time_us }
        }
        KeyPullBatchReply::StaleMeta {
            stored_version,
            redis_time_us,
        } => KeyPullReply::StaleMeta {
            stored_version,
            redis_time_us,
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
        for v in c.as_wire() {
            inv.arg(v);
        }
    }
    inv.invoke_async(conn).await
}

/// Outcome of [`adjust`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdjustOutcome {
    /// Recorded.
    Done,
    /// Refused by the fence; nothing written.
    Refused(FenceRefusal),
    /// The task's meta is missing or retired (deleted, or not rolled yet): nothing written.
    NoTask,
}

/// Runs [`ADJUST_LUA`]: stores controller `state` (field/value pairs; with `clear`, after
/// deleting the stored state) and, if given, appends one adjustment (JSON) to the task's log,
/// keeping the newest `keep`.
#[allow(clippy::too_many_arguments)]
pub async fn adjust<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    fence: &Fence,
    clear: bool,
    state: &[(&str, String)],
    adjustment: Option<&str>,
    keep: usize,
) -> RedisResult<AdjustOutcome>
where
    C: redis::aio::ConnectionLike,
{
    let mut inv = ADJUST.prepare_invoke();
    inv.key(keys.meta(task))
        .key(keys.dynamic_state(task))
        .key(keys.adjustments(task));
    fence.push(&mut inv);
    inv.arg(keep.max(1))
        .arg(adjustment.unwrap_or(""))
        .arg(if clear { 1 } else { 0 });
    for (k, v) in state {
        inv.arg(*k).arg(v);
    }
    let r = Reply::parse(inv.invoke_async(conn).await?)?;
    if let Some(refusal) = r.refusal()? {
        return Ok(AdjustOutcome::Refused(refusal));
    }
    Ok(match r.status()? {
        1 => AdjustOutcome::Done,
        _ => AdjustOutcome::NoTask,
    })
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

/// Longest request id of [`take`] and [`slide`], bytes.
pub const MAX_REQUEST_ID_LEN: usize = 64;

fn check_request_id(request_id: &str) -> RedisResult<()> {
    if request_id.len() > MAX_REQUEST_ID_LEN {
        return Err(redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "exact decision",
            format!("request id longer than {MAX_REQUEST_ID_LEN} bytes"),
        )));
    }
    Ok(())
}

/// Runs [`TAKE_LUA`] (`exact_fixed`) on the slice of `task` starting at `slice_start_ms`
/// (slices of `slice_ms`). Idempotent by `request_id` (unique per decision, at most
/// [`MAX_REQUEST_ID_LEN`] bytes; empty: not idempotent): a retry with the same id and slice
/// never takes twice.
pub async fn take<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    slice_start_ms: i64,
    slice_ms: u64,
    n: u64,
    request_id: &str,
) -> RedisResult<ExactReply>
where
    C: redis::aio::ConnectionLike,
{
    check_request_id(request_id)?;
    exact_reply(
        TAKE.key(keys.slice(task, slice_start_ms))
            .arg(n)
            .arg(slice_start_ms)
            .arg(slice_ms)
            .arg(request_id)
            .invoke_async(conn)
            .await?,
    )
}

/// Runs [`SLIDE_LUA`] (`exact_sliding`) with the log of `task` and its slice starting at
/// `slice_start_ms`; `nonce` is random per client (members are made unique by a Redis-side
/// sequence under it). Idempotent by `request_id`, as [`take`].
#[allow(clippy::too_many_arguments)]
pub async fn slide<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    slice_start_ms: i64,
    window_ms: u64,
    n: u64,
    nonce: &str,
    request_id: &str,
) -> RedisResult<ExactReply>
where
    C: redis::aio::ConnectionLike,
{
    check_request_id(request_id)?;
    exact_reply(
        SLIDE
            .key(keys.sliding_log(task))
            .key(keys.slice(task, slice_start_ms))
            .key(keys.sliding_log_seq(task))
            .arg(n)
            .arg(window_ms)
            .arg(nonce)
            .arg(slice_start_ms)
            .arg(request_id)
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

/// Writes records into a task's history rings, fenced (see [`FENCE_LUA`]) and only while the
/// task exists, so neither a deposed leader nor a harvest racing a deletion can write (or bring
/// back) the rings of a task.
///
/// `KEYS[1]` meta, `KEYS[2]` `NS:{T}:hist:1s`, `KEYS[3]` `NS:{T}:hist:1m`. `ARGV`: the fence
/// (3), ttl of ring 1 (ms), ttl of ring 2 (ms), `n1`, then `(byte offset, bytes)` pairs: the
/// first `n1` for ring 1, the rest for ring 2 (`SETRANGE`). Returns `{1, pairs written}`, a
/// fence refusal, or `{2, 0}`: the task's meta is missing or retired.
pub const RECORD_HISTORY_LUA: &str = concat!(
    include_str!("../scripts/parts/fence.lua"),
    include_str!("../scripts/parts/record_history.lua"),
);

/// Deletes the given entries of `NS:hosts` that are still stale when the script runs: not seen
/// for longer than `ARGV[1]` ms by Redis `TIME` (the entry's `seen_ms` is the host's clock, so
/// it is corrected by the host's reported `offset_ms`), or unreadable. An entry the host
/// rewrote since the caller read it survives.
///
/// `KEYS[1]` `NS:hosts`. `ARGV`: retention (ms), then host ids. Returns how many were deleted.
pub const PRUNE_HOSTS_LUA: &str = include_str!("../scripts/prune_hosts.lua");

static RECORD_HISTORY: LazyLock<Script> = LazyLock::new(|| Script::new(RECORD_HISTORY_LUA));
static PRUNE_HOSTS: LazyLock<Script> = LazyLock::new(|| Script::new(PRUNE_HOSTS_LUA));

/// Writes into one history ring: `(byte offset, bytes)` pairs for `SETRANGE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingWrites<'a> {
    /// The ring's key.
    pub key: &'a str,
    /// Expiry set on the ring after the write (ms).
    pub ttl_ms: u64,
    /// The writes.
    pub writes: &'a [(i64, Vec<u8>)],
}

/// Outcome of [`record_history`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordOutcome {
    /// Written.
    Done,
    /// Refused by the fence; nothing written.
    Refused(FenceRefusal),
    /// The task's meta is missing or retired: nothing written.
    NoTask,
}

/// Runs [`RECORD_HISTORY_LUA`] for `task`: `seconds` and `minutes` are its two rings.
pub async fn record_history<C>(
    conn: &mut C,
    keys: &Keys,
    task: &str,
    fence: &Fence,
    seconds: RingWrites<'_>,
    minutes: RingWrites<'_>,
) -> RedisResult<RecordOutcome>
where
    C: redis::aio::ConnectionLike,
{
    let mut inv = RECORD_HISTORY.prepare_invoke();
    inv.key(keys.meta(task)).key(seconds.key).key(minutes.key);
    fence.push(&mut inv);
    inv.arg(seconds.ttl_ms.max(1))
        .arg(minutes.ttl_ms.max(1))
        .arg(seconds.writes.len());
    for (off, bytes) in seconds.writes.iter().chain(minutes.writes) {
        inv.arg(*off).arg(bytes.as_slice());
    }
    let r = Reply::parse(inv.invoke_async(conn).await?)?;
    if let Some(refusal) = r.refusal()? {
        return Ok(RecordOutcome::Refused(refusal));
    }
    Ok(match r.status()? {
        1 => RecordOutcome::Done,
        _ => RecordOutcome::NoTask,
    })
}

/// Runs [`PRUNE_HOSTS_LUA`]: deletes those of `hosts` not seen for `retention_ms` (by Redis
/// time) when the script runs. Returns how many were deleted.
pub async fn prune_hosts<C>(
    conn: &mut C,
    keys: &Keys,
    retention_ms: u64,
    hosts: &[String],
) -> RedisResult<u64>
where
    C: redis::aio::ConnectionLike,
{
    if hosts.is_empty() {
        return Ok(0);
    }
    let mut inv = PRUNE_HOSTS.prepare_invoke();
    inv.key(keys.hosts()).arg(retention_ms);
    for h in hosts {
        inv.arg(h);
    }
    inv.invoke_async(conn).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retire_deletes_the_top_key_sets_of_thirteen_minutes() {
        let keys = Keys::new("ns").unwrap();
        let now = 20 * 60_000 + 59_999;
        let sets = top_key_sets(&keys, "t", now);
        assert_eq!(sets.len(), 26, "13 minutes × admitted and rejected");
        assert!(
            sets.contains(&keys.top_keys("t", 21 * 60_000)),
            "a minute ahead"
        );
        assert!(sets.contains(&keys.top_rejected_keys("t", 20 * 60_000)));
        assert!(
            sets.contains(&keys.top_keys("t", 9 * 60_000)),
            "11 minutes back"
        );
        assert!(!sets.contains(&keys.top_keys("t", 8 * 60_000)));
        assert!(
            sets.iter().all(|k| k.starts_with("ns:{t}:")),
            "in the task's slot"
        );
    }
}

#[cfg(test)]
#[path = "shipped_scripts.rs"]
mod shipped_scripts;
