//! The keyspace and the commands Sluice sends (from scripts and directly).
//!
//! Semantics follow Redis 7.0 for the arguments Sluice uses, down to the error codes; what is
//! not implemented answers `ERR unknown command` (or `ERR syntax error` for an unknown option),
//! so a gap shows up as a failure, never as a silent difference. The differential test
//! (`tests/differential.rs`) holds this file to a real Redis.

use std::collections::{BTreeMap, VecDeque};

use indexmap::{IndexMap, IndexSet};

use super::reply::{Reply, fmt_g17};

/// A stored value.
#[derive(Debug, Clone, PartialEq)]
pub enum Val {
    /// A string.
    Str(Vec<u8>),
    /// A hash (fields in insertion order, as a small Redis hash keeps them).
    Hash(IndexMap<Vec<u8>, Vec<u8>>),
    /// A list.
    List(VecDeque<Vec<u8>>),
    /// A set.
    Set(IndexSet<Vec<u8>>),
    /// A sorted set: (score, member), sorted.
    ZSet(Vec<(f64, Vec<u8>)>),
}

impl Val {
    fn type_name(&self) -> &'static str {
        match self {
            Self::Str(_) => "string",
            Self::Hash(_) => "hash",
            Self::List(_) => "list",
            Self::Set(_) => "set",
            Self::ZSet(_) => "zset",
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Self::Str(_) => false,
            Self::Hash(h) => h.is_empty(),
            Self::List(l) => l.is_empty(),
            Self::Set(s) => s.is_empty(),
            Self::ZSet(z) => z.is_empty(),
        }
    }
}

/// A key's value and expiry.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The value.
    pub val: Val,
    /// When the key expires (Unix ms), if it does.
    pub expire_at_ms: Option<i64>,
}

/// The whole keyspace (database 0). Cloning it is a snapshot.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Keyspace {
    keys: BTreeMap<Vec<u8>, Entry>,
}

type Args<'a> = &'a [Vec<u8>];
type Hash = IndexMap<Vec<u8>, Vec<u8>>;
type ZSet = Vec<(f64, Vec<u8>)>;

fn int(a: &[u8]) -> Result<i64, Reply> {
    std::str::from_utf8(a)
        .ok()
        .filter(|s| !(s.is_empty() || s.starts_with('+') || s.len() > 1 && s.starts_with('0')))
        .filter(|s| !s.starts_with("-0"))
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(Reply::not_integer)
}

fn float(a: &[u8]) -> Result<f64, Reply> {
    let s = std::str::from_utf8(a).map_err(|_| float_err())?;
    match s.to_ascii_lowercase().as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => return Ok(f64::INFINITY),
        "-inf" | "-infinity" => return Ok(f64::NEG_INFINITY),
        _ => {}
    }
    if s.is_empty() || s.starts_with(char::is_whitespace) || s.ends_with(char::is_whitespace) {
        return Err(float_err());
    }
    match s.parse::<f64>() {
        Ok(x) if !x.is_nan() => Ok(x),
        _ => Err(float_err()),
    }
}

fn float_err() -> Reply {
    Reply::err("ERR value is not a valid float")
}

/// A score bound of ZCOUNT / ZRANGE BYSCORE / ZREMRANGEBYSCORE: `(x` is exclusive.
fn bound(a: &[u8]) -> Result<(f64, bool), Reply> {
    let bad = || Reply::err("ERR min or max is not a float");
    match a.strip_prefix(b"(") {
        Some(rest) => float(rest).map(|x| (x, true)).map_err(|_| bad()),
        None => float(a).map(|x| (x, false)).map_err(|_| bad()),
    }
}

fn above(x: f64, (min, excl): (f64, bool)) -> bool {
    if excl { x > min } else { x >= min }
}

fn below(x: f64, (max, excl): (f64, bool)) -> bool {
    if excl { x < max } else { x <= max }
}

fn arity(name: &str) -> Reply {
    Reply::err(format!(
        "ERR wrong number of arguments for '{}' command",
        name.to_ascii_lowercase()
    ))
}

fn bulk_or_nil(v: Option<&Vec<u8>>) -> Reply {
    v.map_or(Reply::Nil, |b| Reply::Bulk(b.clone()))
}

/// Redis's range of indexes `start..=stop` (negatives from the end) over `len` items.
fn index_range(start: i64, stop: i64, len: usize) -> Option<(usize, usize)> {
    let len = len as i64;
    let mut s = if start < 0 { len + start } else { start };
    let mut e = if stop < 0 { len + stop } else { stop };
    if s < 0 {
        s = 0;
    }
    if s > e || s >= len {
        return None;
    }
    if e >= len {
        e = len - 1;
    }
    Some((s as usize, e as usize))
}

/// Redis's glob-style pattern (`*`, `?`, `[…]` with `^` and ranges, `\` escapes).
pub fn glob(pat: &[u8], s: &[u8]) -> bool {
    if pat.is_empty() {
        return s.is_empty();
    }
    match pat[0] {
        b'*' => (0..=s.len()).any(|i| glob(&pat[1..], &s[i..])),
        b'?' => !s.is_empty() && glob(&pat[1..], &s[1..]),
        b'[' => {
            let Some(&c) = s.first() else { return false };
            let mut i = 1;
            let not = pat.get(1) == Some(&b'^');
            if not {
                i += 1;
            }
            let mut hit = false;
            while i < pat.len() && pat[i] != b']' {
                if pat[i] == b'\\' && i + 1 < pat.len() {
                    hit |= pat[i + 1] == c;
                    i += 2;
                } else if i + 2 < pat.len() && pat[i + 1] == b'-' && pat[i + 2] != b']' {
                    let (lo, hi) = (pat[i].min(pat[i + 2]), pat[i].max(pat[i + 2]));
                    hit |= lo <= c && c <= hi;
                    i += 3;
                } else {
                    hit |= pat[i] == c;
                    i += 1;
                }
            }
            let rest = if i < pat.len() {
                &pat[i + 1..]
            } else {
                &pat[i..]
            };
            hit != not && glob(rest, &s[1..])
        }
        b'\\' if pat.len() > 1 => !s.is_empty() && s[0] == pat[1] && glob(&pat[2..], &s[1..]),
        c => !s.is_empty() && s[0] == c && glob(&pat[1..], &s[1..]),
    }
}

impl Keyspace {
    /// Number of keys not yet expired at `now_ms`.
    pub fn len(&self, now_ms: i64) -> usize {
        self.keys.values().filter(|e| !expired(e, now_ms)).count()
    }

    /// Whether no key is live at `now_ms`.
    pub fn is_empty(&self, now_ms: i64) -> bool {
        self.len(now_ms) == 0
    }

    /// Drops every key expired at `now_ms` (Redis's active expiry, all at once).
    pub fn purge_expired(&mut self, now_ms: i64) {
        self.keys.retain(|_, e| !expired(e, now_ms));
    }

    /// Every live key and its entry, in key order.
    pub fn iter(&self, now_ms: i64) -> impl Iterator<Item = (&Vec<u8>, &Entry)> {
        self.keys.iter().filter(move |(_, e)| !expired(e, now_ms))
    }

    /// The live entry of `key`.
    pub fn get(&self, key: &[u8], now_ms: i64) -> Option<&Entry> {
        self.keys.get(key).filter(|e| !expired(e, now_ms))
    }

    /// Sets `key` (a checker or a test building a state by hand).
    pub fn insert(&mut self, key: Vec<u8>, entry: Entry) {
        self.keys.insert(key, entry);
    }

    /// Sets the expiry of `key` if it exists.
    pub fn set_expire_at(&mut self, key: &[u8], expire_at_ms: Option<i64>) {
        if let Some(e) = self.keys.get_mut(key) {
            e.expire_at_ms = expire_at_ms;
        }
    }

    /// Removes every key.
    pub fn clear(&mut self) {
        self.keys.clear();
    }

    fn touch(&mut self, key: &[u8], now_ms: i64) {
        if self.keys.get(key).is_some_and(|e| expired(e, now_ms)) {
            self.keys.remove(key);
        }
    }

    fn entry_mut(&mut self, key: &[u8], now_ms: i64) -> Option<&mut Entry> {
        self.touch(key, now_ms);
        self.keys.get_mut(key)
    }

    /// Drops `key` if its collection became empty (as Redis does).
    fn drop_if_empty(&mut self, key: &[u8]) {
        if self.keys.get(key).is_some_and(|e| e.val.is_empty()) {
            self.keys.remove(key);
        }
    }

    fn hash(&mut self, key: &[u8], now_ms: i64) -> Result<Option<&mut Hash>, Reply> {
        match self.entry_mut(key, now_ms) {
            None => Ok(None),
            Some(Entry {
                val: Val::Hash(h), ..
            }) => Ok(Some(h)),
            Some(_) => Err(Reply::wrong_type()),
        }
    }

    fn hash_or_new(
        &mut self,
        key: &[u8],
        now_ms: i64,
    ) -> Result<&mut IndexMap<Vec<u8>, Vec<u8>>, Reply> {
        self.touch(key, now_ms);
        let e = self.keys.entry(key.to_vec()).or_insert_with(|| Entry {
            val: Val::Hash(IndexMap::new()),
            expire_at_ms: None,
        });
        match &mut e.val {
            Val::Hash(h) => Ok(h),
            _ => Err(Reply::wrong_type()),
        }
    }

    fn zset(&mut self, key: &[u8], now_ms: i64) -> Result<Option<&mut ZSet>, Reply> {
        match self.entry_mut(key, now_ms) {
            None => Ok(None),
            Some(Entry {
                val: Val::ZSet(z), ..
            }) => Ok(Some(z)),
            Some(_) => Err(Reply::wrong_type()),
        }
    }

    fn list(&mut self, key: &[u8], now_ms: i64) -> Result<Option<&mut VecDeque<Vec<u8>>>, Reply> {
        match self.entry_mut(key, now_ms) {
            None => Ok(None),
            Some(Entry {
                val: Val::List(l), ..
            }) => Ok(Some(l)),
            Some(_) => Err(Reply::wrong_type()),
        }
    }

    fn set(&mut self, key: &[u8], now_ms: i64) -> Result<Option<&mut IndexSet<Vec<u8>>>, Reply> {
        match self.entry_mut(key, now_ms) {
            None => Ok(None),
            Some(Entry {
                val: Val::Set(s), ..
            }) => Ok(Some(s)),
            Some(_) => Err(Reply::wrong_type()),
        }
    }

    fn string(&mut self, key: &[u8], now_ms: i64) -> Result<Option<&mut Vec<u8>>, Reply> {
        match self.entry_mut(key, now_ms) {
            None => Ok(None),
            Some(Entry {
                val: Val::Str(s), ..
            }) => Ok(Some(s)),
            Some(_) => Err(Reply::wrong_type()),
        }
    }

    /// Runs one data command (`args[0]` is its name, upper case). `None`: not a data command.
    pub fn exec(&mut self, args: Args<'_>, now_ms: i64) -> Option<Reply> {
        let name = String::from_utf8_lossy(&args[0]).to_ascii_uppercase();
        let r = match name.as_str() {
            "GET" => self.get_cmd(args, now_ms),
            "SET" => self.set_cmd(args, now_ms),
            "INCR" | "INCRBY" => self.incr(&name, args, now_ms),
            "GETRANGE" => self.getrange(args, now_ms),
            "SETRANGE" => self.setrange(args, now_ms),
            "DEL" | "UNLINK" => self.del(&name, args, now_ms),
            "EXISTS" => self.exists(args, now_ms),
            "TYPE" => self.type_cmd(args, now_ms),
            "PEXPIRE" | "EXPIRE" | "PEXPIREAT" | "EXPIREAT" => self.expire(&name, args, now_ms),
            "PTTL" | "TTL" | "PEXPIRETIME" | "EXPIRETIME" => self.ttl(&name, args, now_ms),
            "PERSIST" => self.persist(args, now_ms),
            "HSET" | "HMSET" => self.hset(&name, args, now_ms),
            "HSETNX" => self.hsetnx(args, now_ms),
            "HGET" => self.hget(args, now_ms),
            "HMGET" => self.hmget(args, now_ms),
            "HDEL" => self.hdel(args, now_ms),
            "HINCRBY" => self.hincrby(args, now_ms),
            "HEXISTS" => self.hexists(args, now_ms),
            "HLEN" => self.hlen(args, now_ms),
            "HKEYS" | "HVALS" | "HGETALL" => self.hall(&name, args, now_ms),
            "ZADD" => self.zadd(args, now_ms),
            "ZREM" => self.zrem(args, now_ms),
            "ZCARD" => self.zcard(args, now_ms),
            "ZSCORE" => self.zscore(args, now_ms),
            "ZCOUNT" => self.zcount(args, now_ms),
            "ZRANGE" => self.zrange(args, now_ms),
            "ZREMRANGEBYSCORE" => self.zremrangebyscore(args, now_ms),
            "LPUSH" | "RPUSH" => self.push(&name, args, now_ms),
            "LTRIM" => self.ltrim(args, now_ms),
            "LRANGE" => self.lrange(args, now_ms),
            "LLEN" => self.llen(args, now_ms),
            "SADD" => self.sadd(args, now_ms),
            "SREM" => self.srem(args, now_ms),
            "SISMEMBER" => self.sismember(args, now_ms),
            "SMEMBERS" => self.smembers(args, now_ms),
            "SCARD" => self.scard(args, now_ms),
            "SSCAN" => self.sscan(args, now_ms),
            "SCAN" => self.scan(args, now_ms),
            "KEYS" => self.keys_cmd(args, now_ms),
            "DBSIZE" => Ok(Reply::Int(self.len(now_ms) as i64)),
            "FLUSHALL" | "FLUSHDB" => {
                self.keys.clear();
                Ok(Reply::ok())
            }
            _ => return None,
        };
        Some(r.unwrap_or_else(|e| e))
    }

    fn get_cmd(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("get"));
        }
        Ok(bulk_or_nil(self.string(&a[1], now)?.map(|s| &*s)))
    }

    fn set_cmd(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity("set"));
        }
        let (mut nx, mut xx, mut get, mut keepttl) = (false, false, false, false);
        let mut expire_at = None;
        let mut i = 3;
        while i < a.len() {
            let opt = String::from_utf8_lossy(&a[i]).to_ascii_uppercase();
            match opt.as_str() {
                "NX" => nx = true,
                "XX" => xx = true,
                "GET" => get = true,
                "KEEPTTL" => keepttl = true,
                "PX" | "EX" | "PXAT" | "EXAT" if i + 1 < a.len() => {
                    let n = int(&a[i + 1])?;
                    if n <= 0 {
                        return Err(Reply::err("ERR invalid expire time in 'set' command"));
                    }
                    let at = match opt.as_str() {
                        "PX" => now.checked_add(n),
                        "EX" => n.checked_mul(1000).and_then(|ms| now.checked_add(ms)),
                        "PXAT" => Some(n),
                        _ => n.checked_mul(1000),
                    };
                    expire_at =
                        Some(at.ok_or_else(|| {
                            Reply::err("ERR invalid expire time in 'set' command")
                        })?);
                    i += 1;
                }
                _ => return Err(Reply::syntax()),
            }
            i += 1;
        }
        if nx && xx || keepttl && expire_at.is_some() {
            return Err(Reply::syntax());
        }
        self.touch(&a[1], now);
        let old = self.keys.get(&a[1]);
        let old_val = match old {
            Some(Entry {
                val: Val::Str(s), ..
            }) => Some(s.clone()),
            Some(_) if get => return Err(Reply::wrong_type()),
            _ => None,
        };
        let exists = old.is_some();
        let old_ttl = old.and_then(|e| e.expire_at_ms);
        let answer = |done: bool| {
            if get {
                bulk_or_nil(old_val.as_ref())
            } else if done {
                Reply::ok()
            } else {
                Reply::Nil
            }
        };
        if nx && exists || xx && !exists {
            return Ok(answer(false));
        }
        let expire_at_ms = if keepttl { old_ttl } else { expire_at };
        self.keys.insert(
            a[1].clone(),
            Entry {
                val: Val::Str(a[2].clone()),
                expire_at_ms,
            },
        );
        Ok(answer(true))
    }

    fn incr(&mut self, name: &str, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        let by = match (name, a.len()) {
            ("INCR", 2) => 1,
            ("INCRBY", 3) => int(&a[2])?,
            _ => return Err(arity(name)),
        };
        let cur = match self.string(&a[1], now)? {
            Some(s) => int(s)?,
            None => 0,
        };
        let new = cur
            .checked_add(by)
            .ok_or_else(|| Reply::err("ERR increment or decrement would overflow"))?;
        match self.string(&a[1], now)? {
            Some(s) => *s = new.to_string().into_bytes(),
            None => {
                self.keys.insert(
                    a[1].clone(),
                    Entry {
                        val: Val::Str(new.to_string().into_bytes()),
                        expire_at_ms: None,
                    },
                );
            }
        }
        Ok(Reply::Int(new))
    }

    fn getrange(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("getrange"));
        }
        let (start, end) = (int(&a[2])?, int(&a[3])?);
        let Some(s) = self.string(&a[1], now)? else {
            return Ok(Reply::Bulk(Vec::new()));
        };
        if start < 0 && end < 0 && start > end {
            return Ok(Reply::Bulk(Vec::new()));
        }
        Ok(Reply::Bulk(match index_range(start, end, s.len()) {
            Some((s0, e0)) => s[s0..=e0].to_vec(),
            None => Vec::new(),
        }))
    }

    fn setrange(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("setrange"));
        }
        let off = int(&a[2])?;
        if off < 0 {
            return Err(Reply::err("ERR offset is out of range"));
        }
        let off = off as usize;
        if off + a[3].len() > 512 * 1024 * 1024 {
            return Err(Reply::err(
                "ERR string exceeds maximum allowed size (proto-max-bulk-len)",
            ));
        }
        let exists = self.string(&a[1], now)?.is_some();
        if !exists {
            if a[3].is_empty() {
                return Ok(Reply::Int(0));
            }
            self.keys.insert(
                a[1].clone(),
                Entry {
                    val: Val::Str(Vec::new()),
                    expire_at_ms: None,
                },
            );
        }
        let s = self.string(&a[1], now)?.expect("just made");
        if !a[3].is_empty() {
            if s.len() < off + a[3].len() {
                s.resize(off + a[3].len(), 0);
            }
            s[off..off + a[3].len()].copy_from_slice(&a[3]);
        }
        Ok(Reply::Int(s.len() as i64))
    }

    fn del(&mut self, name: &str, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 2 {
            return Err(arity(name));
        }
        let mut n = 0;
        for k in &a[1..] {
            self.touch(k, now);
            n += i64::from(self.keys.remove(k).is_some());
        }
        Ok(Reply::Int(n))
    }

    fn exists(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 2 {
            return Err(arity("exists"));
        }
        let n = a[1..].iter().filter(|k| self.get(k, now).is_some()).count();
        Ok(Reply::Int(n as i64))
    }

    fn type_cmd(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("type"));
        }
        Ok(Reply::Status(
            self.get(&a[1], now)
                .map_or("none", |e| e.val.type_name())
                .into(),
        ))
    }

    fn expire(&mut self, name: &str, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity(name));
        }
        let n = int(&a[2])?;
        let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
        for o in &a[3..] {
            match String::from_utf8_lossy(o).to_ascii_uppercase().as_str() {
                "NX" => nx = true,
                "XX" => xx = true,
                "GT" => gt = true,
                "LT" => lt = true,
                other => {
                    return Err(Reply::err(format!("ERR Unsupported option {other}")));
                }
            }
        }
        let at = match name {
            "PEXPIRE" => now.checked_add(n),
            "EXPIRE" => n.checked_mul(1000).and_then(|ms| now.checked_add(ms)),
            "PEXPIREAT" => Some(n),
            _ => n.checked_mul(1000),
        }
        .ok_or_else(|| {
            Reply::err(format!(
                "ERR invalid expire time in '{}' command",
                name.to_ascii_lowercase()
            ))
        })?;
        let Some(e) = self.entry_mut(&a[1], now) else {
            return Ok(Reply::Int(0));
        };
        let cur = e.expire_at_ms;
        let skip = (nx && cur.is_some())
            || (xx && cur.is_none())
            || (gt && cur.is_none_or(|c| at <= c))
            || (lt && cur.is_some_and(|c| at >= c));
        if skip {
            return Ok(Reply::Int(0));
        }
        if at <= now {
            self.keys.remove(&a[1]);
        } else {
            e.expire_at_ms = Some(at);
        }
        Ok(Reply::Int(1))
    }

    fn ttl(&mut self, name: &str, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity(name));
        }
        let Some(e) = self.get(&a[1], now) else {
            return Ok(Reply::Int(-2));
        };
        let Some(at) = e.expire_at_ms else {
            return Ok(Reply::Int(-1));
        };
        Ok(Reply::Int(match name {
            "PTTL" => at - now,
            "TTL" => (at - now + 500) / 1000,
            "PEXPIRETIME" => at,
            _ => at / 1000,
        }))
    }

    fn persist(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("persist"));
        }
        Ok(Reply::Int(match self.entry_mut(&a[1], now) {
            Some(e) if e.expire_at_ms.is_some() => {
                e.expire_at_ms = None;
                1
            }
            _ => 0,
        }))
    }

    fn hset(&mut self, name: &str, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 4 || !a.len().is_multiple_of(2) {
            return Err(arity(name));
        }
        let h = self.hash_or_new(&a[1], now)?;
        let mut added = 0;
        for pair in a[2..].chunks(2) {
            added += i64::from(h.insert(pair[0].clone(), pair[1].clone()).is_none());
        }
        Ok(if name == "HMSET" {
            Reply::ok()
        } else {
            Reply::Int(added)
        })
    }

    fn hsetnx(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("hsetnx"));
        }
        let h = self.hash_or_new(&a[1], now)?;
        if h.contains_key(&a[2]) {
            return Ok(Reply::Int(0));
        }
        h.insert(a[2].clone(), a[3].clone());
        Ok(Reply::Int(1))
    }

    fn hget(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 3 {
            return Err(arity("hget"));
        }
        Ok(bulk_or_nil(
            self.hash(&a[1], now)?.and_then(|h| h.get(&a[2])),
        ))
    }

    fn hmget(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity("hmget"));
        }
        let h = self.hash(&a[1], now)?;
        Ok(Reply::Array(
            a[2..]
                .iter()
                .map(|f| bulk_or_nil(h.as_ref().and_then(|h| h.get(f))))
                .collect(),
        ))
    }

    fn hdel(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity("hdel"));
        }
        let Some(h) = self.hash(&a[1], now)? else {
            return Ok(Reply::Int(0));
        };
        let n = a[2..]
            .iter()
            .filter(|f| h.shift_remove(*f).is_some())
            .count();
        self.drop_if_empty(&a[1]);
        Ok(Reply::Int(n as i64))
    }

    fn hincrby(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("hincrby"));
        }
        let by = int(&a[3])?;
        let h = self.hash_or_new(&a[1], now)?;
        let cur = match h.get(&a[2]) {
            Some(v) => int(v).map_err(|_| Reply::err("ERR hash value is not an integer"))?,
            None => 0,
        };
        let new = cur
            .checked_add(by)
            .ok_or_else(|| Reply::err("ERR increment or decrement would overflow"))?;
        h.insert(a[2].clone(), new.to_string().into_bytes());
        Ok(Reply::Int(new))
    }

    fn hexists(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 3 {
            return Err(arity("hexists"));
        }
        let has = self
            .hash(&a[1], now)?
            .is_some_and(|h| h.contains_key(&a[2]));
        Ok(Reply::Int(i64::from(has)))
    }

    fn hlen(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("hlen"));
        }
        Ok(Reply::Int(
            self.hash(&a[1], now)?.map_or(0, |h| h.len()) as i64
        ))
    }

    fn hall(&mut self, name: &str, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity(name));
        }
        let Some(h) = self.hash(&a[1], now)? else {
            return Ok(Reply::Array(Vec::new()));
        };
        let mut out = Vec::new();
        for (f, v) in h.iter() {
            if name != "HVALS" {
                out.push(Reply::Bulk(f.clone()));
            }
            if name != "HKEYS" {
                out.push(Reply::Bulk(v.clone()));
            }
        }
        Ok(Reply::Array(out))
    }

    fn zadd(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 4 {
            return Err(arity("zadd"));
        }
        let (mut nx, mut xx, mut ch) = (false, false, false);
        let mut i = 2;
        while i < a.len() {
            match String::from_utf8_lossy(&a[i]).to_ascii_uppercase().as_str() {
                "NX" => nx = true,
                "XX" => xx = true,
                "CH" => ch = true,
                _ => break,
            }
            i += 1;
        }
        let rest = &a[i..];
        if rest.is_empty() || !rest.len().is_multiple_of(2) || nx && xx {
            return Err(Reply::syntax());
        }
        let mut pairs = Vec::new();
        for p in rest.chunks(2) {
            pairs.push((float(&p[0])?, p[1].clone()));
        }
        self.touch(&a[1], now);
        let e = self.keys.entry(a[1].clone()).or_insert_with(|| Entry {
            val: Val::ZSet(Vec::new()),
            expire_at_ms: None,
        });
        let Val::ZSet(z) = &mut e.val else {
            return Err(Reply::wrong_type());
        };
        let (mut added, mut changed) = (0, 0);
        for (score, member) in pairs {
            match z.iter().position(|(_, m)| *m == member) {
                Some(at) if !nx && z[at].0 != score => {
                    z.remove(at);
                    zinsert(z, score, member);
                    changed += 1;
                }
                Some(_) => {}
                None if !xx => {
                    zinsert(z, score, member);
                    added += 1;
                }
                None => {}
            }
        }
        self.drop_if_empty(&a[1]);
        Ok(Reply::Int(if ch { added + changed } else { added }))
    }

    fn zrem(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity("zrem"));
        }
        let Some(z) = self.zset(&a[1], now)? else {
            return Ok(Reply::Int(0));
        };
        let before = z.len();
        z.retain(|(_, m)| !a[2..].contains(m));
        let n = before - z.len();
        self.drop_if_empty(&a[1]);
        Ok(Reply::Int(n as i64))
    }

    fn zcard(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("zcard"));
        }
        Ok(Reply::Int(
            self.zset(&a[1], now)?.map_or(0, |z| z.len()) as i64
        ))
    }

    fn zscore(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 3 {
            return Err(arity("zscore"));
        }
        let s = self
            .zset(&a[1], now)?
            .and_then(|z| z.iter().find(|(_, m)| *m == a[2]).map(|(s, _)| *s));
        Ok(s.map_or(Reply::Nil, |s| Reply::text(fmt_g17(s))))
    }

    fn zcount(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("zcount"));
        }
        let (min, max) = (bound(&a[2])?, bound(&a[3])?);
        let n = self.zset(&a[1], now)?.map_or(0, |z| {
            z.iter()
                .filter(|(s, _)| above(*s, min) && below(*s, max))
                .count()
        });
        Ok(Reply::Int(n as i64))
    }

    fn zrange(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 4 {
            return Err(arity("zrange"));
        }
        let (mut byscore, mut rev, mut withscores) = (false, false, false);
        let mut limit = None;
        let mut i = 4;
        while i < a.len() {
            match String::from_utf8_lossy(&a[i]).to_ascii_uppercase().as_str() {
                "BYSCORE" => byscore = true,
                "REV" => rev = true,
                "WITHSCORES" => withscores = true,
                "LIMIT" if i + 2 < a.len() => {
                    limit = Some((int(&a[i + 1])?, int(&a[i + 2])?));
                    i += 2;
                }
                _ => return Err(Reply::syntax()),
            }
            i += 1;
        }
        if limit.is_some() && !byscore {
            return Err(Reply::err(
                "ERR syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX",
            ));
        }
        let z = self.zset(&a[1], now)?.cloned().unwrap_or_default();
        let mut picked: Vec<(f64, Vec<u8>)> = if byscore {
            let (lo, hi) = if rev {
                (bound(&a[3])?, bound(&a[2])?)
            } else {
                (bound(&a[2])?, bound(&a[3])?)
            };
            let mut v: Vec<_> = z
                .into_iter()
                .filter(|(s, _)| above(*s, lo) && below(*s, hi))
                .collect();
            if rev {
                v.reverse();
            }
            if let Some((off, count)) = limit {
                let off = off.max(0) as usize;
                v = v.into_iter().skip(off).collect();
                if count >= 0 {
                    v.truncate(count as usize);
                }
            }
            v
        } else {
            let (start, stop) = (int(&a[2])?, int(&a[3])?);
            let mut v = z;
            if rev {
                v.reverse();
            }
            match index_range(start, stop, v.len()) {
                Some((s, e)) => v[s..=e].to_vec(),
                None => Vec::new(),
            }
        };
        let mut out = Vec::new();
        for (s, m) in picked.drain(..) {
            out.push(Reply::Bulk(m));
            if withscores {
                out.push(Reply::text(fmt_g17(s)));
            }
        }
        Ok(Reply::Array(out))
    }

    fn zremrangebyscore(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("zremrangebyscore"));
        }
        let (min, max) = (bound(&a[2])?, bound(&a[3])?);
        let Some(z) = self.zset(&a[1], now)? else {
            return Ok(Reply::Int(0));
        };
        let before = z.len();
        z.retain(|(s, _)| !(above(*s, min) && below(*s, max)));
        let n = before - z.len();
        self.drop_if_empty(&a[1]);
        Ok(Reply::Int(n as i64))
    }

    fn push(&mut self, name: &str, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity(name));
        }
        self.touch(&a[1], now);
        let e = self.keys.entry(a[1].clone()).or_insert_with(|| Entry {
            val: Val::List(VecDeque::new()),
            expire_at_ms: None,
        });
        let Val::List(l) = &mut e.val else {
            return Err(Reply::wrong_type());
        };
        for v in &a[2..] {
            if name == "LPUSH" {
                l.push_front(v.clone());
            } else {
                l.push_back(v.clone());
            }
        }
        Ok(Reply::Int(l.len() as i64))
    }

    fn ltrim(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("ltrim"));
        }
        let (start, stop) = (int(&a[2])?, int(&a[3])?);
        if let Some(l) = self.list(&a[1], now)? {
            match index_range(start, stop, l.len()) {
                Some((s, e)) => {
                    l.truncate(e + 1);
                    l.drain(..s);
                }
                None => l.clear(),
            }
        }
        self.drop_if_empty(&a[1]);
        Ok(Reply::ok())
    }

    fn lrange(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 4 {
            return Err(arity("lrange"));
        }
        let (start, stop) = (int(&a[2])?, int(&a[3])?);
        let Some(l) = self.list(&a[1], now)? else {
            return Ok(Reply::Array(Vec::new()));
        };
        Ok(Reply::Array(match index_range(start, stop, l.len()) {
            Some((s, e)) => l.range(s..=e).map(|v| Reply::Bulk(v.clone())).collect(),
            None => Vec::new(),
        }))
    }

    fn llen(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("llen"));
        }
        Ok(Reply::Int(
            self.list(&a[1], now)?.map_or(0, |l| l.len()) as i64
        ))
    }

    fn sadd(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity("sadd"));
        }
        self.touch(&a[1], now);
        let e = self.keys.entry(a[1].clone()).or_insert_with(|| Entry {
            val: Val::Set(IndexSet::new()),
            expire_at_ms: None,
        });
        let Val::Set(s) = &mut e.val else {
            return Err(Reply::wrong_type());
        };
        let n = a[2..].iter().filter(|m| s.insert((*m).clone())).count();
        Ok(Reply::Int(n as i64))
    }

    fn srem(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity("srem"));
        }
        let Some(s) = self.set(&a[1], now)? else {
            return Ok(Reply::Int(0));
        };
        let n = a[2..].iter().filter(|m| s.shift_remove(*m)).count();
        self.drop_if_empty(&a[1]);
        Ok(Reply::Int(n as i64))
    }

    fn sismember(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 3 {
            return Err(arity("sismember"));
        }
        let has = self.set(&a[1], now)?.is_some_and(|s| s.contains(&a[2]));
        Ok(Reply::Int(i64::from(has)))
    }

    fn smembers(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("smembers"));
        }
        let s = self.set(&a[1], now)?;
        Ok(Reply::Array(s.map_or_else(Vec::new, |s| {
            s.iter().map(|m| Reply::Bulk(m.clone())).collect()
        })))
    }

    fn scard(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("scard"));
        }
        Ok(Reply::Int(
            self.set(&a[1], now)?.map_or(0, |s| s.len()) as i64
        ))
    }

    /// SSCAN key cursor [MATCH p] [COUNT n]: every member in one page (cursor 0), which Redis
    /// allows for a scan.
    fn sscan(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 3 {
            return Err(arity("sscan"));
        }
        let (pattern, _) = scan_options(&a[3..])?;
        let s = self.set(&a[1], now)?;
        let members = s.map_or_else(Vec::new, |s| {
            s.iter()
                .filter(|m| pattern.as_ref().is_none_or(|p| glob(p, m)))
                .map(|m| Reply::Bulk(m.clone()))
                .collect()
        });
        Ok(Reply::Array(vec![Reply::text("0"), Reply::Array(members)]))
    }

    /// SCAN cursor [MATCH p] [COUNT n] [TYPE t]: every key in one page.
    fn scan(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() < 2 {
            return Err(arity("scan"));
        }
        int(&a[1]).map_err(|_| Reply::err("ERR invalid cursor"))?;
        let (pattern, ty) = scan_options(&a[2..])?;
        let keys = self
            .iter(now)
            .filter(|(k, _)| pattern.as_ref().is_none_or(|p| glob(p, k)))
            .filter(|(_, e)| ty.as_ref().is_none_or(|t| t == e.val.type_name()))
            .map(|(k, _)| Reply::Bulk(k.clone()))
            .collect();
        Ok(Reply::Array(vec![Reply::text("0"), Reply::Array(keys)]))
    }

    fn keys_cmd(&mut self, a: Args<'_>, now: i64) -> Result<Reply, Reply> {
        if a.len() != 2 {
            return Err(arity("keys"));
        }
        Ok(Reply::Array(
            self.iter(now)
                .filter(|(k, _)| glob(&a[1], k))
                .map(|(k, _)| Reply::Bulk(k.clone()))
                .collect(),
        ))
    }
}

fn scan_options(a: Args<'_>) -> Result<(Option<Vec<u8>>, Option<String>), Reply> {
    let (mut pattern, mut ty) = (None, None);
    let mut i = 0;
    while i < a.len() {
        match String::from_utf8_lossy(&a[i]).to_ascii_uppercase().as_str() {
            "MATCH" if i + 1 < a.len() => pattern = Some(a[i + 1].clone()),
            "COUNT" if i + 1 < a.len() => {
                if int(&a[i + 1])? < 1 {
                    return Err(Reply::syntax());
                }
            }
            "TYPE" if i + 1 < a.len() => {
                ty = Some(String::from_utf8_lossy(&a[i + 1]).to_ascii_lowercase())
            }
            _ => return Err(Reply::syntax()),
        }
        i += 2;
    }
    Ok((pattern, ty))
}

/// Redis's rule (`keyIsExpired`): a key is gone once now is *past* its expiry time; at that
/// very millisecond it still answers (PTTL 0). The differential test found this one.
fn expired(e: &Entry, now_ms: i64) -> bool {
    e.expire_at_ms.is_some_and(|at| now_ms > at)
}

/// Inserts keeping Redis's order: by score, then by member bytes.
fn zinsert(z: &mut Vec<(f64, Vec<u8>)>, score: f64, member: Vec<u8>) {
    let at = z.partition_point(|(s, m)| (*s, m.as_slice()) < (score, member.as_slice()));
    z.insert(at, (score, member));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ks: &mut Keyspace, now: i64, args: &[&str]) -> Reply {
        let args: Vec<Vec<u8>> = args.iter().map(|a| a.as_bytes().to_vec()).collect();
        ks.exec(&args, now).expect("a data command")
    }

    #[test]
    fn keys_expire_at_their_time_and_not_before() {
        let mut ks = Keyspace::default();
        assert_eq!(
            run(&mut ks, 1000, &["SET", "k", "v", "PX", "500"]),
            Reply::ok()
        );
        assert_eq!(run(&mut ks, 1499, &["PTTL", "k"]), Reply::Int(1));
        assert_eq!(run(&mut ks, 1500, &["PTTL", "k"]), Reply::Int(0));
        assert_eq!(run(&mut ks, 1501, &["GET", "k"]), Reply::Nil);
        assert_eq!(run(&mut ks, 1501, &["PTTL", "k"]), Reply::Int(-2));
        run(&mut ks, 0, &["HSET", "h", "a", "1"]);
        assert_eq!(run(&mut ks, 0, &["PEXPIRE", "h", "0"]), Reply::Int(1));
        assert_eq!(run(&mut ks, 0, &["EXISTS", "h"]), Reply::Int(0));
    }

    #[test]
    fn emptied_collections_are_removed() {
        let mut ks = Keyspace::default();
        run(&mut ks, 0, &["HSET", "h", "a", "1", "b", "2"]);
        assert_eq!(
            run(&mut ks, 0, &["HDEL", "h", "a", "b", "c"]),
            Reply::Int(2)
        );
        assert_eq!(run(&mut ks, 0, &["EXISTS", "h"]), Reply::Int(0));
        run(&mut ks, 0, &["ZADD", "z", "1", "a", "2", "b"]);
        assert_eq!(
            run(&mut ks, 0, &["ZREMRANGEBYSCORE", "z", "-inf", "+inf"]),
            Reply::Int(2)
        );
        assert_eq!(
            run(&mut ks, 0, &["TYPE", "z"]),
            Reply::Status("none".into())
        );
    }

    #[test]
    fn glob_patterns_match_as_redis_does() {
        assert!(glob(b"sluice:{t}:*", b"sluice:{t}:meta"));
        assert!(!glob(b"sluice:{t}:*", b"sluice:{u}:meta"));
        assert!(glob(b"h?llo", b"hello"));
        assert!(glob(b"h[a-e]llo", b"hello"));
        assert!(!glob(b"h[^e]llo", b"hello"));
        assert!(glob(b"a\\*b", b"a*b"));
    }

    #[test]
    fn integers_are_parsed_strictly() {
        assert!(int(b"12").is_ok());
        assert!(int(b"-12").is_ok());
        for bad in [&b"012"[..], b"+1", b" 1", b"1.0", b"", b"-0"] {
            assert!(int(bad).is_err(), "{bad:?}");
        }
        assert!(int(b"0").is_ok());
    }
}
