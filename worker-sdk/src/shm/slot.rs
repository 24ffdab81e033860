//! What a slot holds and the atomic steps on it: identity, meta, quota words, the counter
//! ring, demand and accounting.

use super::*;

impl Slot {
    /// The slot's generation.
    #[inline]
    pub fn generation(&self) -> u16 {
        self.ident.generation.load(Ordering::Acquire) as u16
    }

    /// The task name, if the slot is in use.
    pub fn name(&self) -> Option<String> {
        if self.ident.state.load(Ordering::Acquire) != READY {
            return None;
        }
        let len = (self.ident.name_len.load(Ordering::Relaxed) as usize).min(MAX_TASK_NAME_LEN);
        let mut bytes = Vec::with_capacity(MAX_TASK_NAME_LEN);
        for w in &self.ident.name {
            bytes.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        bytes.truncate(len);
        String::from_utf8(bytes).ok()
    }

    /// The slot's generation if it is in use by task `name` (a read racing with a reclaim
    /// answers `None`).
    pub(super) fn holds(&self, name: &str) -> Option<u16> {
        let gen_before = self.generation();
        if self.ident.state.load(Ordering::Acquire) != READY
            || self.ident.name_len.load(Ordering::Relaxed) != name.len() as u64
        {
            return None;
        }
        let mut buf = [0u8; MAX_TASK_NAME_LEN];
        buf[..name.len()].copy_from_slice(name.as_bytes());
        let same = self.ident.name.iter().enumerate().all(|(i, w)| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&buf[i * 8..i * 8 + 8]);
            w.load(Ordering::Relaxed) == u64::from_le_bytes(word)
        });
        let stable =
            self.ident.state.load(Ordering::Acquire) == READY && self.generation() == gen_before;
        (same && stable).then_some(gen_before)
    }

    /// Records that a process holds a live handle for the slot now.
    pub fn touch(&self, now_ms: i64) {
        self.ident.used_ms.store(now_ms, Ordering::Relaxed);
    }

    /// The last known meta, if any.
    pub fn meta(&self) -> Option<TaskMeta> {
        let fast = FastMeta::decode(self.meta.fast.load(Ordering::Acquire))?;
        Some(TaskMeta {
            slice_ms: fast.slice_ms,
            threshold: self.meta.threshold.load(Ordering::Relaxed),
            pull: self.meta.pull.load(Ordering::Relaxed),
            local_limit: self.meta.local_limit.load(Ordering::Relaxed),
            on_failure: fast.on_failure,
            mode: fast.mode,
            fallback: Fallback {
                algorithm: fast.algorithm,
                burst: self.meta.burst.load(Ordering::Relaxed),
            },
            version: self.meta.version.load(Ordering::Relaxed),
            lease_ms: self.conc.lease_ms.load(Ordering::Relaxed),
            keyed: fast.keyed,
            key_overrides: Default::default(),
            shadow: fast.shadow,
            pacing: if fast.paced {
                Pacing::Smooth
            } else {
                Pacing::None
            },
            pace_burst: self.ctl.pace_burst.load(Ordering::Relaxed),
        })
    }

    /// Stores `meta` as the last known meta of the slot's task of generation `generation`: the
    /// slow fields first, then the fast word by compare-and-swap, then the version. Writes
    /// nothing (and returns false) when the slot has been reclaimed since (its generation
    /// changed). A reader that loads the version before the fast word never pairs a version
    /// with an older fast word (KPULL makes key quotas only from a caller whose slice length
    /// is the version's).
    pub fn store_meta(&self, meta: &TaskMeta, generation: u16) -> bool {
        if self.generation() != generation {
            return false;
        }
        let m = &self.meta;
        m.threshold.store(meta.threshold, Ordering::Relaxed);
        m.pull.store(meta.pull, Ordering::Relaxed);
        m.local_limit.store(meta.local_limit, Ordering::Relaxed);
        m.burst.store(meta.fallback.burst, Ordering::Relaxed);
        self.ctl
            .pace_burst
            .store(meta.pace_burst, Ordering::Relaxed);
        if meta.lease_ms > 0 {
            self.conc.lease_ms.store(meta.lease_ms, Ordering::Relaxed);
        }
        let next = FastMeta {
            slice_ms: meta.slice_ms,
            mode: meta.mode,
            on_failure: meta.on_failure,
            algorithm: meta.fallback.algorithm,
            generation,
            keyed: meta.keyed,
            shadow: meta.shadow,
            paced: meta.pacing == Pacing::Smooth && meta.mode == Mode::Pooled,
        }
        .encode();
        let mut cur = m.fast.load(Ordering::Acquire);
        loop {
            if word_generation(cur) != generation {
                return false;
            }
            match m
                .fast
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    m.version.store(meta.version, Ordering::Release);
                    return true;
                }
                Err(x) => cur = x,
            }
        }
    }

    /// Forgets the meta (the task was deleted), unless the slot was reclaimed meanwhile.
    pub fn clear_meta(&self, generation: u16) {
        let cur = self.meta.fast.load(Ordering::Acquire);
        if word_generation(cur) == generation {
            let _ = self.meta.fast.compare_exchange(
                cur,
                unknown_word(generation),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// The quota entry of the slice starting at `start_ms` on a grid of `slice_ms`.
    #[inline]
    pub fn entry(&self, start_ms: i64, slice_ms: u64) -> &QuotaEntry {
        &self.quota[parity(start_ms, slice_ms)]
    }

    /// Adds `granted` permits of the slice starting at `start_ms` (grid `slice_ms`) to the
    /// local quota (call under the pull lock). `now_us` must be read after the pull returned.
    ///
    /// * The entry already holds that slice: the grant is added.
    /// * The slice has already ended at `now_us`: the grant is dropped (nobody can spend it).
    /// * The entry holds another slice: it is replaced. That slice is closed first: its
    ///   admitted count (`granted − accounted − count left`) goes to the counter ring. On one
    ///   grid the other slice of the same parity has always ended by then; after a change of
    ///   the slice length it may be a slice of the old grid, which no decision spends any more.
    ///
    /// `exhausted` marks that Redis has nothing left for the slice. Returns false when the
    /// grant was dropped.
    pub fn deposit(
        &self,
        start_ms: i64,
        slice_ms: u64,
        granted: u64,
        exhausted: bool,
        now_us: i64,
    ) -> bool {
        if start_ms.saturating_add(slice_ms as i64) <= now_us.div_euclid(1_000) {
            return false;
        }
        let tag = tag_of(start_ms);
        let e = self.entry(start_ms, slice_ms);
        let add = granted.min(MAX_COUNT as u64) as u32;
        let mut cur = e.word.load(Ordering::Acquire);
        loop {
            let (t, ex, c) = unpack_quota(cur);
            let next = if t == tag && cur != 0 {
                pack_quota(tag, ex || exhausted, c.saturating_add(add))
            } else {
                pack_quota(tag, exhausted, add)
            };
            match e
                .word
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if t == tag && cur != 0 {
                        e.granted.fetch_add(add as u64, Ordering::Relaxed);
                    } else {
                        if cur != 0 {
                            self.close_entry(e, untag(t, start_ms), c);
                        }
                        e.granted.store(add as u64, Ordering::Relaxed);
                        e.accounted.store(0, Ordering::Relaxed);
                        e.first_grant_us.store(now_us, Ordering::Relaxed);
                        e.slice_ms.store(slice_ms, Ordering::Relaxed);
                    }
                    return true;
                }
                Err(x) => cur = x,
            }
        }
    }

    /// Moves the admitted count of an entry that held the slice starting at `old_start` (with
    /// `left` permits unspent) into the counter ring.
    fn close_entry(&self, e: &QuotaEntry, old_start: i64, left: u32) {
        let granted = e.granted.load(Ordering::Relaxed);
        let accounted = e.accounted.load(Ordering::Relaxed);
        if granted == 0 {
            return;
        }
        let admitted = granted
            .saturating_sub(accounted)
            .saturating_sub(left as u64);
        let old_len = e.slice_ms.load(Ordering::Relaxed);
        self.count(old_start, old_len, field::ADMITTED, admitted);
        let rej = self.ring_value(old_start, old_len, field::REJECTED);
        self.ctl
            .demand_prev
            .store(granted.saturating_sub(left as u64) + rej, Ordering::Relaxed);
    }

    /// Moves what was admitted so far from every quota entry into the counter ring (call
    /// under the pull lock). `now_ms` locates the entries' slices (within ±24 days).
    pub fn account(&self, now_ms: i64) {
        for e in &self.quota {
            let w = e.word.load(Ordering::Acquire);
            if w == 0 {
                continue;
            }
            let (t, _, c) = unpack_quota(w);
            let granted = e.granted.load(Ordering::Relaxed);
            let accounted = e.accounted.load(Ordering::Relaxed);
            let delta = granted.saturating_sub(accounted).saturating_sub(c as u64);
            if delta > 0 {
                e.accounted.fetch_add(delta, Ordering::Relaxed);
                let len = e.slice_ms.load(Ordering::Relaxed);
                self.count(untag(t, now_ms), len, field::ADMITTED, delta);
            }
        }
    }

    /// Admitted so far (this host) in the slice starting at `start_ms`, from the quota
    /// accounting.
    pub fn consumed(&self, start_ms: i64, slice_ms: u64) -> u64 {
        let e = self.entry(start_ms, slice_ms);
        let w = e.word.load(Ordering::Acquire);
        let (t, _, c) = unpack_quota(w);
        if w == 0 || t != tag_of(start_ms) {
            return 0;
        }
        e.granted.load(Ordering::Relaxed).saturating_sub(c as u64)
    }

    /// Adds `v` to counter `field` (index into [`slice_field::COUNTERS`]) of the slice starting
    /// at `start_ms` on a grid of `slice_ms`.
    ///
    /// The entry is taken over when it holds an older slice, or another slice whose counts
    /// were all flushed (zero): its tag is set to a busy marker, its values are zeroed, then the
    /// new tag is published, so no concurrent add for the new slice can be wiped. An older
    /// slice's unflushed counts are dropped: the flusher runs far more often than the ring
    /// wraps, so this only happens while Redis is unreachable for longer than [`RING`] slices.
    /// A count for a slice older than the entry's unflushed one is dropped.
    #[inline]
    pub fn count(&self, start_ms: i64, slice_ms: u64, field: usize, v: u64) {
        let index = start_ms.max(1) as u64 / slice_ms.max(1);
        self.count_at(index, start_ms, field, v);
    }

    /// [`Slot::count`] for a caller that knows the slice's index (`start_ms / slice_ms` on the
    /// slice's grid): the decision path, which saves the division.
    #[inline]
    pub fn count_at(&self, index: u64, start_ms: i64, field: usize, v: u64) {
        if v == 0 {
            return;
        }
        let start = start_ms.max(1) as u64;
        let e = &self.ring[(index % RING as u64) as usize];
        let mut spins = 0u32;
        loop {
            let t = e.tag.load(Ordering::Acquire);
            if t == start {
                break;
            }
            if t == RING_BUSY {
                spins += 1;
                // A process died between marking and publishing: take the entry over.
                if spins > 100_000
                    && e.tag
                        .compare_exchange(RING_BUSY, start, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    break;
                }
                std::hint::spin_loop();
                continue;
            }
            let unused = t == EMPTY_TAG || t == 0;
            let drained = || e.values.iter().all(|x| x.load(Ordering::Relaxed) == 0);
            if !unused && t > start && !drained() {
                return;
            }
            if e.tag
                .compare_exchange(t, RING_BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                for x in &e.values {
                    x.store(0, Ordering::Relaxed);
                }
                e.tag.store(start, Ordering::Release);
                break;
            }
        }
        if let Some(x) = e.values.get(field) {
            x.fetch_add(v, Ordering::Relaxed);
        }
    }

    fn ring_value(&self, start_ms: i64, slice_ms: u64, field: usize) -> u64 {
        let start = start_ms.max(1) as u64;
        let e = &self.ring[((start / slice_ms.max(1)) % RING as u64) as usize];
        if e.tag.load(Ordering::Acquire) != start {
            return 0;
        }
        e.values[field].load(Ordering::Relaxed)
    }

    /// Takes (and zeroes) every non-zero counter entry: `(slice start in Unix ms, counters)`.
    pub fn drain_counters(&self) -> Vec<(i64, [u64; 7])> {
        let mut out = Vec::new();
        for e in &self.ring {
            let start = e.tag.load(Ordering::Acquire);
            if start == EMPTY_TAG || start == 0 || start == RING_BUSY {
                continue;
            }
            let mut vals = [0u64; 7];
            for (v, x) in vals.iter_mut().zip(&e.values) {
                *v = x.swap(0, Ordering::AcqRel);
            }
            if vals.iter().any(|v| *v != 0) {
                out.push((start as i64, vals));
            }
        }
        out
    }

    /// Resets everything but the identity, for a new owner of generation `generation`.
    pub(super) fn reset(&self, generation: u16) {
        self.meta
            .fast
            .store(unknown_word(generation), Ordering::Release);
        for w in [
            &self.meta.version,
            &self.meta.refreshed_ms,
            &self.meta.missing_since_ms,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for w in [
            &self.meta.threshold,
            &self.meta.pull,
            &self.meta.local_limit,
            &self.meta.burst,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        let c = &self.ctl;
        for w in [
            &c.state,
            &c.pull_lock,
            &c.want,
            &c.demand_prev,
            &c.rtt_us,
            &c.max_n,
            &c.cap,
            &c.flush_lock,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for w in [
            &c.next_probe_ms,
            &c.flushed_ms,
            &c.remaining,
            &c.early_start,
            &c.early_until_ms,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for e in &self.quota {
            e.word.store(0, Ordering::Relaxed);
            e.granted.store(0, Ordering::Relaxed);
            e.accounted.store(0, Ordering::Relaxed);
            e.low_water.store(0, Ordering::Relaxed);
            e.first_grant_us.store(0, Ordering::Relaxed);
            e.slice_ms.store(0, Ordering::Relaxed);
        }
        for e in &self.ring {
            e.tag.store(EMPTY_TAG, Ordering::Relaxed);
            for v in &e.values {
                v.store(0, Ordering::Relaxed);
            }
        }
        self.limiter.lock.store(0, Ordering::Relaxed);
        for c in &self.limiter.cells {
            c.store(0, Ordering::Relaxed);
        }
        for l in &self.log {
            l.store(0, Ordering::Relaxed);
        }
        let k = &self.conc;
        for w in [
            &k.permits,
            &k.regime,
            &k.lease_lock,
            &k.seq,
            &k.waiting,
            &k.denied,
            &k.lease_ms,
            &k.cap,
            &k.others,
            &k.lapses,
            &k.granted,
            &k.reclaimed,
            &k.denied_seen,
            &k.others_unmet,
            &k.bound,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for w in [
            &k.valid_until_ms,
            &k.sent_ok_ms,
            &k.grow_after_ms,
            &k.scanned_ms,
            &k.failing_since_ms,
            &k.next_try_ms,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for h in &k.holders {
            h.store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn write_name(&self, name: &str) {
        let mut buf = [0u8; MAX_TASK_NAME_LEN];
        let n = name.len().min(MAX_TASK_NAME_LEN);
        buf[..n].copy_from_slice(&name.as_bytes()[..n]);
        for (k, w) in self.ident.name.iter().enumerate() {
            let mut word = [0u8; 8];
            word.copy_from_slice(&buf[k * 8..k * 8 + 8]);
            w.store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        self.ident.name_len.store(n as u64, Ordering::Relaxed);
    }
}

/// Index of `slice_field` names in [`Slot::count`].
pub mod field {
    /// Admitted.
    pub const ADMITTED: usize = 0;
    /// Rejected.
    pub const REJECTED: usize = 1;
    /// OK outcomes.
    pub const OK: usize = 2;
    /// Failed outcomes.
    pub const ERR: usize = 3;
    /// Latency sum (µs).
    pub const LAT_SUM_US: usize = 4;
    /// Latency count.
    pub const LAT_N: usize = 5;
    /// Shadow mode: rejections that were admitted (`wrej`).
    pub const WOULD_REJECT: usize = 6;
    const _: () = assert!(super::slice_field::COUNTERS.len() == 6);
    const _: () = assert!(super::slice_field::WIRE_COUNTERS.len() == 7);
}
