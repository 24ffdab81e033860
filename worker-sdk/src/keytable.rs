//! The host's key table (keyed tasks): a second shared file next to the host segment,
//! `<segment>.keys`, of entries grouped in buckets; each entry holds a key's identity, its two
//! quota words, counters and pull lock. Opening, checking and replacing the file, and claiming
//! and reclaiming entries; the decisions on an entry are `crate::decide::keyed`'s, the `Key`
//! front is `crate::keyed` (whose module docs describe the table).

use std::fs::{File, OpenOptions};
use std::hash::Hasher;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use memmap2::MmapMut;

/// Key table entries unless configured otherwise (6 MiB).
pub const DEFAULT_KEY_SLOTS: u32 = 16_384;
/// Most key table entries (1.5 GiB of shared memory at 384 bytes an entry; a host that needs
/// 1,000,000 active keys asks for about 1,500,000 so that its buckets of [`WAYS`] rarely fill).
pub const MAX_KEY_SLOTS: u32 = 4_194_304;
/// Entries per bucket.
pub const WAYS: usize = 8;
/// A key's pull is at most `cap / CHUNK_DIVISOR` (and at least what the decision needs)...
pub const CHUNK_DIVISOR: u64 = 16;
/// ... or `min(MIN_MAX_CHUNK, cap / 4)` where that is more (`crate::keyed::max_chunk`): a key of
/// a cap of 8 to 63 that is hot on a host gets chunks of 2 to 4 it can prefetch ahead of its
/// decisions (with chunks of one, every admitted decision of such a key waited for a pull);
/// below 8, chunks stay at one (no host takes more than a quarter of a small cap at once).
pub const MIN_MAX_CHUNK: u64 = 4;
/// Keys whose busiest are reported per task and host per report.
pub const TOP_KEYS: usize = 10;

const MAGIC: u64 = u64::from_le_bytes(*b"SLUKEYS\x01");
/// 2: entries carry the id of the segment that claimed them ([`KeyEntry::segment`]); the
/// report clock moved to the segment header. 3: a bitmap of touched buckets between the
/// header and the entries (the key report reads only the buckets decided in since the last).
const VERSION: u64 = 3;
pub(crate) const OWNED: u64 = 1 << 63;
/// An identity word being claimed: `0:1 | 1:1 | participant:10 | participant generation:16 |
/// segment id:36` (the claimer, see [`claiming`]).
const CLAIMING: u64 = 1 << 62;
const SEG_FRAG: u64 = (1 << 36) - 1;
/// A claim by a process of another segment (whose liveness cannot be read here) is taken to be
/// abandoned when the entry's `used_ms` is this old.
const FOREIGN_CLAIM_MS: i64 = 60_000;

#[repr(C, align(64))]
struct TableHeader {
    magic: AtomicU64,
    version: AtomicU64,
    pub(crate) entries: AtomicU64,
    entry_size: AtomicU64,
    checksum: AtomicU64,
    secret0: AtomicU64,
    secret1: AtomicU64,
}

/// One key's entry in the table.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct KeyEntry {
    /// 0 = free, `CLAIMING | claimer` = being claimed, else `1:1 | slot:15 | slot
    /// generation:16 | entry    /// generation:32`.
    pub(crate) ident: AtomicU64,
    h0: AtomicU64,
    h1: AtomicU64,
    /// Last decision (host Unix ms).
    pub(crate) used_ms: AtomicI64,
    /// Reclaimable after this long idle (two slices, ms).
    idle_ms: AtomicU64,
    /// [`crate::shm::ShmLock`] word: one pull per key per host.
    pub(crate) pull_lock: AtomicU64,
    /// `tag:32 | size:32`: the last pull's size and the slice it was for.
    pub(crate) grant: AtomicU64,
    /// The key's cap as last seen (0 = unknown).
    pub(crate) cap: AtomicU64,
    /// Packed quota words by slice parity.
    pub(crate) quota: [AtomicU64; 2],
    /// FAILED fallback: `tag:32 | count:32`, a fixed window of `local_limit` per slice.
    pub(crate) local: AtomicU64,
    /// Permits admitted since the last report.
    pub(crate) adm: AtomicU64,
    /// Permits rejected since the last report.
    pub(crate) rej: AtomicU64,
    key_len: AtomicU64,
    /// The id of the segment whose processes claimed the entry ([`crate::shm::Header::segment_id`]):
    /// the table outlives a replaced segment, whose slots have the same indexes and
    /// generations as the new one's.
    pub(crate) segment: AtomicU64,
    /// Claims of the entry so far: each draws its identity's entry generation from it.
    claims: AtomicU64,
    key: [AtomicU64; 32],
}

const ENTRY_SIZE: usize = std::mem::size_of::<KeyEntry>();
const HEADER_SIZE: usize = 128;
const _: () = assert!(ENTRY_SIZE == 384);
const _: () = assert!(std::mem::size_of::<TableHeader>() <= HEADER_SIZE);

impl KeyEntry {
    pub(crate) fn key_string(&self) -> Option<String> {
        let len = self.key_len.load(Ordering::Acquire) as usize;
        if len > crate::protocol::MAX_KEY_LEN {
            return None;
        }
        let mut b = Vec::with_capacity(len);
        for w in &self.key {
            b.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        b.truncate(len);
        String::from_utf8(b).ok()
    }
}

/// The host's key table (a shared file next to the segment).
pub struct KeyTable {
    map: MmapMut,
    pub(crate) entries: usize,
    secret: (u64, u64),
    pub(crate) path: PathBuf,
}

// The mapping is only ever accessed through atomics.
unsafe impl Send for KeyTable {}
unsafe impl Sync for KeyTable {}

impl std::fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyTable")
            .field("path", &self.path)
            .field("entries", &self.entries)
            .finish()
    }
}

fn checksum(entries: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in [MAGIC, VERSION, entries, ENTRY_SIZE as u64] {
        for b in w.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl KeyTable {
    /// Size in bytes of a table of `entries` entries.
    pub fn size(entries: u32) -> u64 {
        (Self::entries_at(entries as usize) + ENTRY_SIZE * entries as usize) as u64
    }

    /// Where the entries start: after the header and the touched-bucket bitmap (one bit per
    /// bucket, in whole 64-byte lines so the entries stay 64-byte aligned).
    fn entries_at(entries: usize) -> usize {
        let words = (entries / WAYS).div_ceil(64);
        HEADER_SIZE + (words * 8).div_ceil(64) * 64
    }

    /// Opens (creating or replacing when incompatible or smaller) the key table at `path` with
    /// at least `entries` entries (rounded up to whole buckets, within [`MAX_KEY_SLOTS`]).
    pub fn open(path: &Path, entries: u32) -> std::io::Result<Self> {
        let entries = entries
            .clamp(WAYS as u32, MAX_KEY_SLOTS)
            .div_ceil(WAYS as u32)
            * WAYS as u32;
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o660)
            .open(crate::shm::sibling(path, ".lock"))?;
        let _guard = crate::shm::Flock::lock(&lock)?;
        crate::shm::remove_stale_tmp(path);
        if path.exists() {
            match Self::map(path) {
                Ok(t) if t.entries >= entries as usize => return Ok(t),
                Ok(t) => tracing::warn!(path = %path.display(), from = t.entries, to = entries,
                    "key table smaller than configured; replacing it"),
                Err(why) => tracing::warn!(path = %path.display(), %why,
                    "key table incompatible or corrupt; replacing it"),
            }
        }
        Self::create(path, entries)?;
        Self::map(path).map_err(std::io::Error::other)
    }

    fn map(path: &Path) -> Result<Self, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| e.to_string())?;
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        if len < HEADER_SIZE as u64 {
            return Err(format!("{len} bytes, shorter than the header"));
        }
        // SAFETY: a regular file we keep mapped; every access goes through atomics.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| format!("mmap: {e}"))?;
        // SAFETY: at least HEADER_SIZE bytes, page aligned, atomics only.
        let h = unsafe { &*(map.as_ptr() as *const TableHeader) };
        let entries = h.entries.load(Ordering::Acquire);
        if h.magic.load(Ordering::Acquire) != MAGIC
            || h.version.load(Ordering::Acquire) != VERSION
            || h.entry_size.load(Ordering::Acquire) != ENTRY_SIZE as u64
            || h.checksum.load(Ordering::Acquire) != checksum(entries)
            || entries == 0
            || entries > MAX_KEY_SLOTS as u64
            || !(entries as usize).is_multiple_of(WAYS)
            || len < Self::size(entries as u32)
        {
            return Err("bad header".into());
        }
        let secret = (
            h.secret0.load(Ordering::Acquire),
            h.secret1.load(Ordering::Acquire),
        );
        drop(file);
        Ok(Self {
            map,
            entries: entries as usize,
            secret,
            path: path.to_path_buf(),
        })
    }

    fn create(path: &Path, entries: u32) -> std::io::Result<()> {
        let tmp = crate::shm::sibling(
            path,
            &format!(
                "{}{}.{}",
                crate::shm::TMP_MARK,
                std::process::id(),
                crate::clock::host_us()
            ),
        );
        let result = (|| {
            let file: File = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o660)
                .open(&tmp)?;
            file.set_len(Self::size(entries))?;
            // SAFETY: a file only this process knows about yet, sized above.
            let map = unsafe { MmapMut::map_mut(&file)? };
            // SAFETY: page aligned, atomics only.
            let h = unsafe { &*(map.as_ptr() as *const TableHeader) };
            h.version.store(VERSION, Ordering::Relaxed);
            h.entries.store(entries as u64, Ordering::Relaxed);
            h.entry_size.store(ENTRY_SIZE as u64, Ordering::Relaxed);
            h.checksum
                .store(checksum(entries as u64), Ordering::Relaxed);
            h.secret0
                .store(crate::clock::random_u64(), Ordering::Relaxed);
            h.secret1
                .store(crate::clock::random_u64(), Ordering::Relaxed);
            h.magic.store(MAGIC, Ordering::Release);
            map.flush()?;
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Number of entries.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Entry `i`.
    #[inline]
    pub fn entry(&self, i: usize) -> Option<&KeyEntry> {
        if i >= self.entries {
            return None;
        }
        // SAFETY: in bounds (size checked on open), 64-byte aligned (header and entries are
        // multiples of 64), atomics only.
        Some(unsafe {
            &*(self
                .map
                .as_ptr()
                .add(Self::entries_at(self.entries) + i * ENTRY_SIZE)
                as *const KeyEntry)
        })
    }

    /// Word `w` of the touched-bucket bitmap.
    #[inline]
    fn touched_word(&self, w: usize) -> Option<&AtomicU64> {
        if w >= (self.entries / WAYS).div_ceil(64) {
            return None;
        }
        // SAFETY: in bounds (the bitmap lies between the header and the entries, sized on
        // open), 8-byte aligned, atomics only.
        Some(unsafe { &*(self.map.as_ptr().add(HEADER_SIZE + w * 8) as *const AtomicU64) })
    }

    /// Marks entry `i`'s bucket as decided in since the last key report (after its counters
    /// moved: the report clears the mark before it reads them). One load when already marked.
    #[inline]
    pub(crate) fn touch(&self, i: usize) {
        let b = i / WAYS;
        if i >= self.entries {
            return;
        }
        if let Some(w) = self.touched_word(b / 64) {
            let bit = 1u64 << (b % 64);
            if w.load(Ordering::Relaxed) & bit == 0 {
                w.fetch_or(bit, Ordering::AcqRel);
            }
        }
    }

    /// The buckets marked since the last call (marks cleared), as first-entry indexes, in
    /// order: the key report's work list.
    pub(crate) fn take_touched(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let words = (self.entries / WAYS).div_ceil(64);
        for wi in 0..words {
            let Some(w) = self.touched_word(wi) else {
                break;
            };
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = wi * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                out.push(b * WAYS);
            }
        }
        out
    }

    /// The identity hash of `key` of the task in slot `slot`.
    pub fn hash(&self, slot: usize, key: &str) -> (u64, u64) {
        let mut s = siphasher::sip128::SipHasher13::new_with_keys(self.secret.0, self.secret.1);
        s.write_u64(slot as u64);
        s.write(key.as_bytes());
        let h = siphasher::sip128::Hasher128::finish128(&s);
        (h.h1, h.h2 | 1)
    }

    fn bucket(&self, h: (u64, u64)) -> usize {
        (h.0 as usize % (self.entries / WAYS)) * WAYS
    }

    /// The live entry of a key: its index and identity word.
    #[inline]
    pub(crate) fn lookup(&self, h: (u64, u64), owner: Owner) -> Option<(usize, u64)> {
        let b = self.bucket(h);
        for i in b..b + WAYS {
            let e = self.entry(i)?;
            let id = e.ident.load(Ordering::Acquire);
            if id & OWNED != 0
                && owner_of(id) == owner.bits
                && e.h0.load(Ordering::Acquire) == h.0
                && e.h1.load(Ordering::Acquire) == h.1
                && e.segment.load(Ordering::Acquire) == owner.segment
                && e.ident.load(Ordering::Acquire) == id
            {
                return Some((i, id));
            }
        }
        None
    }

    /// Claims an entry for a key: a free one of its bucket, else one idle for two of its
    /// slices or of a reclaimed task slot. `None`: the bucket is full.
    pub(crate) fn claim(
        &self,
        seg: &crate::shm::Segment,
        h: (u64, u64),
        owner: Owner,
        key: &str,
        slice_ms: u64,
        now_ms: i64,
    ) -> Option<(usize, u64)> {
        let b = self.bucket(h);
        for i in b..b + WAYS {
            let e = self.entry(i)?;
            let id = e.ident.load(Ordering::Acquire);
            let free = if id == 0 {
                true
            } else if id & OWNED == 0 {
                abandoned(seg, e, id, now_ms)
            } else {
                now_ms - e.used_ms.load(Ordering::Acquire)
                    >= e.idle_ms.load(Ordering::Relaxed) as i64
                    || !owner_alive(seg, e, id)
            };
            if !free {
                continue;
            }
            // Before the identity word says "claiming": whoever sees that word sees this time
            // (a claim of another segment is judged by it).
            e.used_ms.store(now_ms, Ordering::Relaxed);
            let mine = claiming(seg);
            if e.ident
                .compare_exchange(id, mine, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // A crash from here to the publication leaves the word `mine`: its participant is
            // dead, so the next claimer of the bucket takes the entry over (`abandoned`).
            e.h0.store(h.0, Ordering::Relaxed);
            e.h1.store(h.1, Ordering::Relaxed);
            e.segment.store(owner.segment, Ordering::Relaxed);
            // Two slices (at least 1 s). A pull still in flight for the old key when the entry
            // is reclaimed finds the identity changed and drops its grant.
            e.idle_ms
                .store(slice_ms.saturating_mul(2).max(1_000), Ordering::Relaxed);
            e.grant.store(0, Ordering::Relaxed);
            e.cap.store(0, Ordering::Relaxed);
            for q in &e.quota {
                q.store(0, Ordering::Relaxed);
            }
            e.local.store(0, Ordering::Relaxed);
            e.adm.store(0, Ordering::Relaxed);
            e.rej.store(0, Ordering::Relaxed);
            e.pull_lock.store(0, Ordering::Relaxed);
            let bytes = key.as_bytes();
            for (j, w) in e.key.iter().enumerate() {
                let mut b8 = [0u8; 8];
                let from = (j * 8).min(bytes.len());
                let to = (from + 8).min(bytes.len());
                b8[..to - from].copy_from_slice(&bytes[from..to]);
                w.store(u64::from_le_bytes(b8), Ordering::Relaxed);
            }
            e.key_len.store(bytes.len() as u64, Ordering::Relaxed);
            // Every claim draws a new entry generation, so no earlier identity word of the
            // entry (cached by a handle) comes back, whatever happened to the claims between.
            let generation = (e.claims.fetch_add(1, Ordering::AcqRel) + 1) & 0x7FFF_FFFF;
            let new = OWNED | owner.bits | generation.max(1);
            if e.ident
                .compare_exchange(mine, new, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // Taken over as abandoned (only a claim stalled for FOREIGN_CLAIM_MS can be):
                // the entry is another claimer's now.
                continue;
            }
            // Another process may have claimed the same key in another way of the bucket at
            // the same time: keep the first, give ours back (both would stay correct, as both
            // pull from the same Redis key; one keeps the host's quota in one place).
            if let Some((j, other)) = self.lookup(h, owner)
                && j != i
            {
                let _ = e
                    .ident
                    .compare_exchange(new, 0, Ordering::AcqRel, Ordering::Acquire);
                return Some((j, other));
            }
            return Some((i, new));
        }
        None
    }
}

/// The identity word of an entry this process is claiming (see [`CLAIMING`]).
fn claiming(seg: &crate::shm::Segment) -> u64 {
    let me = seg.me();
    CLAIMING
        | ((me.participant as u64 & 0x3FF) << 52)
        | ((me.generation as u64) << 36)
        | (seg.id() & SEG_FRAG)
}

/// Whether the claim recorded in identity word `id` (not owned, not free) was abandoned: its
/// claimer, a participant of this segment, is dead (the kernel released its byte lock; see
/// [`crate::shm`]), or — a claimer of another segment, whose liveness cannot be read from
/// here — the entry has not been used for [`FOREIGN_CLAIM_MS`]. A claim takes microseconds;
/// one abandoned by a crash at any instruction is taken over by the next claim of its
/// bucket, and until then the bucket has one way fewer.
fn abandoned(seg: &crate::shm::Segment, e: &KeyEntry, id: u64, now_ms: i64) -> bool {
    if id & SEG_FRAG == seg.id() & SEG_FRAG {
        !seg.alive(crate::shm::Holder {
            participant: ((id >> 52) & 0x3FF) as u16,
            generation: (id >> 36) as u16,
        })
    } else {
        now_ms - e.used_ms.load(Ordering::Acquire) >= FOREIGN_CLAIM_MS
    }
}

/// Whose an entry is: a task slot at one generation, of one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner {
    /// `slot:15 | slot generation:16` shifted into place (bits 32–62 of the identity word).
    pub(crate) bits: u64,
    /// The segment's id ([`KeyEntry::segment`]).
    pub(crate) segment: u64,
}

pub(crate) fn owner(seg: &crate::shm::Segment, slot: usize, generation: u16) -> Owner {
    Owner {
        bits: ((slot as u64 & 0x7FFF) << 48) | ((generation as u64) << 32),
        segment: seg.id(),
    }
}

pub(crate) fn owner_of(id: u64) -> u64 {
    id & 0x7FFF_FFFF_0000_0000
}

/// Whether the task slot that claimed entry `e` (identity `id`) still holds it. An entry of
/// another segment counts as alive: its slots cannot be read from here (it is reclaimed only
/// once idle).
pub(crate) fn owner_alive(seg: &crate::shm::Segment, e: &KeyEntry, id: u64) -> bool {
    if e.segment.load(Ordering::Acquire) != seg.id() {
        return true;
    }
    let slot = ((id >> 48) & 0x7FFF) as usize;
    let generation = ((id >> 32) & 0xFFFF) as u16;
    seg.slot(slot).is_some_and(|s| s.generation() == generation)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::Path;

    pub(crate) fn table(entries: u32) -> (tempfile::TempDir, KeyTable, crate::shm::Segment) {
        let d = tempfile::tempdir().unwrap();
        let t = KeyTable::open(&d.path().join("t.keys"), entries).unwrap();
        let (seg, _) = crate::shm::Segment::open(&d.path().join("seg"), 4).unwrap();
        (d, t, seg)
    }

    /// Issue 26: the key report reads only the buckets decided in since the last one (a
    /// table of millions of entries is not scanned every second); marks are per bucket,
    /// cleared by the reader, and entries stay 64-byte aligned after the bitmap.
    #[test]
    fn touched_buckets_are_listed_once_then_cleared() {
        let (_d, t, _seg) = table(8 * 200);
        assert!(t.take_touched().is_empty());
        for i in [0, 7, 8, 64 * 8 + 3, 199 * 8 + 7] {
            t.touch(i);
        }
        t.touch(7);
        assert_eq!(t.take_touched(), vec![0, 8, 64 * 8, 199 * 8]);
        assert!(t.take_touched().is_empty(), "cleared by the reader");
        t.touch(200 * 8);
        assert!(t.take_touched().is_empty(), "out of range: ignored");
        for i in 0..t.entries() {
            let e = t.entry(i).unwrap() as *const KeyEntry as usize;
            assert_eq!(e % 64, 0, "entry {i} misaligned");
        }
        assert_eq!(
            KeyTable::size(1_600),
            (HEADER_SIZE + 64 + 1_600 * ENTRY_SIZE) as u64,
            "200 buckets: one 64-byte line of bitmap"
        );
    }

    #[test]
    fn claims_lookups_and_reclaim_after_two_idle_slices() {
        let (_d, t, seg) = table(8);
        let r = seg
            .claim(
                "t",
                crate::shm::ClaimOptions {
                    now_ms: 0,
                    lock_timeout_ms: 1_000,
                    reclaim_idle_ms: 60_000,
                },
            )
            .unwrap();
        let own = owner(&seg, r.index, r.generation);
        let mut ids = Vec::new();
        for k in 0..WAYS {
            let key = format!("key-{k}");
            let h = t.hash(r.index, &key);
            let (i, id) = t.claim(&seg, h, own, &key, 1_000, 1_000).unwrap();
            assert_eq!(t.lookup(h, own), Some((i, id)));
            assert_eq!(
                t.entry(i).unwrap().key_string().as_deref(),
                Some(key.as_str())
            );
            ids.push(id);
        }
        // One bucket of 8, all busy: the table is full for a ninth key …
        let h9 = t.hash(r.index, "key-9");
        assert_eq!(t.claim(&seg, h9, own, "key-9", 1_000, 1_500), None);
        // … until one has been idle for two slices.
        let (i, id) = t.claim(&seg, h9, own, "key-9", 1_000, 3_000).unwrap();
        assert!(!ids.contains(&id), "a reclaimed entry gets a new identity");
        assert_eq!(t.lookup(h9, own), Some((i, id)));
        // Keys are told apart by task slot too.
        assert_ne!(t.hash(0, "a"), t.hash(1, "a"));
    }

    #[test]
    fn a_key_entry_belongs_to_the_segment_that_claimed_it() {
        let d = tempfile::tempdir().unwrap();
        let t = KeyTable::open(&d.path().join("seg.keys"), 8).unwrap();
        let opts = crate::shm::ClaimOptions {
            now_ms: 0,
            lock_timeout_ms: 1_000,
            reclaim_idle_ms: 60_000,
        };
        let (old, _) = crate::shm::Segment::open(&d.path().join("seg"), 4).unwrap();
        let ra = old.claim("a", opts).unwrap();
        // A process asking for more slots replaces the file; the old one stays mapped.
        let (new, opened) = crate::shm::Segment::open(&d.path().join("seg"), 8).unwrap();
        assert!(matches!(opened, crate::shm::Opened::Replaced(_)));
        assert_ne!(old.id(), new.id());
        assert!(old.id() != 0 && new.id() != 0);
        let rb = new.claim("b", opts).unwrap();
        assert_eq!((ra.index, ra.generation), (rb.index, rb.generation));
        let (oa, ob) = (
            owner(&old, ra.index, ra.generation),
            owner(&new, rb.index, rb.generation),
        );
        let h = t.hash(ra.index, "k");
        let (i, id) = t.claim(&old, h, oa, "k", 1_000, 1_000).unwrap();
        assert_eq!(
            t.lookup(h, ob),
            None,
            "the new segment's task b never finds a's entry"
        );
        // Nor reclaims it while it is in use (its slot cannot be read from the new segment).
        let (j, _) = t.claim(&new, h, ob, "k", 1_000, 1_100).unwrap();
        assert_ne!(i, j);
        assert_eq!(t.lookup(h, oa), Some((i, id)));
        assert_eq!(t.lookup(h, ob).map(|x| x.0), Some(j));
    }

    /// Child processes claiming entries of one bucket as fast as they can (every claim takes
    /// an idle entry over, so each goes through the claiming window), SIGKILLed and
    /// SIGSTOPped at random while the parent claims too. At the end every entry can be claimed
    /// again (none is left "being claimed" by a dead process) and every published entry's
    /// fields belong to its key.
    mod crashes {
        use std::process::{Child, Command};
        use std::time::{Duration, Instant};

        use super::*;

        const ENV: &str = "SLUICE_KEYS_CHILD";

        /// The child: claims until killed (does nothing unless started by the parent).
        #[test]
        fn child_claims() {
            let Ok(spec) = std::env::var(ENV) else {
                return;
            };
            let p: Vec<&str> = spec.split('|').collect();
            let (seg, _) = crate::shm::Segment::open(p[0].as_ref(), 2).unwrap();
            let t = KeyTable::open(p[1].as_ref(), 8).unwrap();
            let (slot, generation): (usize, u16) = (p[2].parse().unwrap(), p[3].parse().unwrap());
            let own = owner(&seg, slot, generation);
            let mut now = 1_000_000i64;
            let mut k = std::process::id() as u64;
            loop {
                now += 2_000;
                k = k.wrapping_mul(6364136223846793005).wrapping_add(1);
                let key = format!("key-{}", k % 64);
                let h = t.hash(slot, &key);
                if t.lookup(h, own).is_none() {
                    let _ = t.claim(&seg, h, own, &key, 1, now);
                }
            }
        }

        fn spawn(seg: &Path, table: &Path, slot: usize, generation: u16) -> Child {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "keytable::tests::crashes::child_claims",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(
                    ENV,
                    format!("{}|{}|{slot}|{generation}", seg.display(), table.display()),
                )
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        }

        fn signal(c: &Child, sig: i32) {
            // SAFETY: kill(2) on a child of ours that has not been reaped yet.
            unsafe { libc::kill(c.id() as i32, sig) };
        }

        #[test]
        fn claims_killed_at_any_instruction_leave_no_entry_stuck() {
            let dir = tempfile::tempdir().unwrap();
            let (sp, tp) = (dir.path().join("seg"), dir.path().join("seg.keys"));
            let (seg, _) = crate::shm::Segment::open(&sp, 2).unwrap();
            let t = KeyTable::open(&tp, 8).unwrap();
            let r = seg
                .claim(
                    "t",
                    crate::shm::ClaimOptions {
                        now_ms: 0,
                        lock_timeout_ms: 1_000,
                        reclaim_idle_ms: 60_000,
                    },
                )
                .unwrap();
            let own = owner(&seg, r.index, r.generation);
            let mut rng = crate::clock::host_us() as u64 | 1;
            let mut next = move |m: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % m
            };
            let mut children: Vec<(Child, bool)> = (0..4)
                .map(|_| (spawn(&sp, &tp, r.index, r.generation), false))
                .collect();
            let (mut kills, mut claimed, mut tries) = (0u64, 0u64, 0u64);
            let mut now = 1_000_000_000i64;
            // 2.5 s, and on a loaded machine until 50 kills (at most 30 s).
            let deadline = Instant::now() + Duration::from_millis(2_500);
            let hard = Instant::now() + Duration::from_secs(30);
            while (Instant::now() < deadline || kills < 50) && Instant::now() < hard {
                std::thread::sleep(Duration::from_millis(2 + next(15)));
                let v = next(children.len() as u64) as usize;
                if next(3) == 0 {
                    let stopped = children[v].1;
                    let sig = if stopped {
                        libc::SIGCONT
                    } else {
                        libc::SIGSTOP
                    };
                    signal(&children[v].0, sig);
                    children[v].1 = !stopped;
                } else {
                    signal(&children[v].0, libc::SIGKILL);
                    children[v].0.wait().unwrap();
                    kills += 1;
                    children[v] = (spawn(&sp, &tp, r.index, r.generation), false);
                }
                // The parent claims too, whoever is stopped or dead where: it never waits.
                for _ in 0..20 {
                    now += 2_000;
                    let key = format!("parent-{}", next(64));
                    let h = t.hash(r.index, &key);
                    tries += 1;
                    if t.lookup(h, own).is_some() || t.claim(&seg, h, own, &key, 1, now).is_some() {
                        claimed += 1;
                    }
                }
            }
            for (c, _) in &mut children {
                signal(c, libc::SIGKILL);
                c.wait().unwrap();
                kills += 1;
            }
            let busy = (0..8)
                .filter(|i| t.entry(*i).unwrap().ident.load(Ordering::Acquire) & OWNED == 0)
                .filter(|i| t.entry(*i).unwrap().ident.load(Ordering::Acquire) != 0)
                .count();
            eprintln!(
                "{kills} kills; the parent found or claimed an entry {claimed} of {tries} times; \
                 {busy} entries left being claimed by dead processes"
            );
            // Every published entry's fields are its key's.
            for i in 0..8 {
                let e = t.entry(i).unwrap();
                let id = e.ident.load(Ordering::Acquire);
                if id & OWNED != 0 {
                    let key = e.key_string().expect("a published entry's key");
                    let h = t.hash(r.index, &key);
                    assert_eq!(
                        (e.h0.load(Ordering::Relaxed), e.h1.load(Ordering::Relaxed)),
                        h,
                        "entry {i}: fields of another key"
                    );
                }
            }
            // Nothing is stuck: all 8 entries are claimed again by 8 fresh keys. Later than any
            // child's clock: a child's test clock starts at 10^6 and moves 2 s per claim, so
            // one that ran (or sat stopped, then ran) long enough passed the parent's, and its
            // entries looked used in the parent's future — not idle, so "stuck" (a flake on a
            // loaded machine, 2 of ~10 runs).
            now = now.max(1 << 50);
            let mut got = std::collections::BTreeSet::new();
            for k in 0..200 {
                let key = format!("after-{k}");
                let h = t.hash(r.index, &key);
                // At one time: an entry claimed here stays in use, the others are idle.
                if let Some((i, _)) = t.claim(&seg, h, own, &key, 1, now) {
                    got.insert(i);
                }
            }
            assert_eq!(got.len(), 8, "entries stuck: only {got:?} could be claimed");
            assert!(kills >= 50, "{kills} kills");
        }
    }

    /// An entry left "being claimed" by a process of another segment (whose liveness cannot
    /// be read from here) is taken over only once it has been unused for a minute; one of this
    /// segment's live participants (this process) is never taken over.
    #[test]
    fn claims_marked_by_another_segment_or_a_live_claimer() {
        let (_d, t, seg) = table(8);
        let r = seg
            .claim(
                "t",
                crate::shm::ClaimOptions {
                    now_ms: 0,
                    lock_timeout_ms: 1_000,
                    reclaim_idle_ms: 60_000,
                },
            )
            .unwrap();
        let own = owner(&seg, r.index, r.generation);
        let foreign = CLAIMING | (3 << 52) | (7 << 36) | ((seg.id() + 1) & SEG_FRAG);
        let live = claiming(&seg);
        for i in 0..8 {
            let e = t.entry(i).unwrap();
            e.used_ms.store(1_000_000, Ordering::Relaxed);
            e.ident
                .store(if i < 4 { foreign } else { live }, Ordering::Relaxed);
        }
        let h = t.hash(r.index, "k");
        assert_eq!(t.claim(&seg, h, own, "k", 1_000, 1_000_000 + 59_000), None);
        let (i, _) = t
            .claim(&seg, h, own, "k", 1_000, 1_000_000 + FOREIGN_CLAIM_MS)
            .expect("a foreign claim unused for a minute");
        assert!(i < 4, "never a live claimer's entry");
    }

    #[test]
    fn a_too_small_table_is_replaced_a_larger_one_kept() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.keys");
        let a = KeyTable::open(&p, 64).unwrap();
        assert_eq!(a.entries(), 64);
        let b = KeyTable::open(&p, 16).unwrap();
        assert_eq!(b.entries(), 64);
        assert_eq!(b.secret, a.secret, "same file, same secret");
        let c = KeyTable::open(&p, 128).unwrap();
        assert_eq!(c.entries(), 128);
        // Rounded up to whole buckets.
        let e = KeyTable::open(&d.path().join("u.keys"), 10).unwrap();
        assert_eq!(e.entries(), 16);
    }
}
