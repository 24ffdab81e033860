//! The segment file: open, check, build and replace it; the participant claim; claiming and
//! reclaiming slots.

use super::*;

/// Why a segment could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("shared memory segment {path}: {source}")]
pub struct SegmentError {
    /// The file.
    pub path: PathBuf,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// A slot of a task, as resolved at one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef {
    /// Slot index.
    pub index: usize,
    /// Its generation when resolved.
    pub generation: u16,
}

/// Settings of [`Segment::claim`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimOptions {
    /// Host time (Unix ms).
    pub now_ms: i64,
    /// Bound on waiting for the alloc lock (twice this) and its lock timeout.
    pub lock_timeout_ms: u64,
    /// A slot no process has used for this long may be reclaimed for another task.
    pub reclaim_idle_ms: u64,
}

/// A mapped segment, and this process's participant slot in it.
#[derive(Debug)]
pub struct Segment {
    map: MmapMut,
    path: PathBuf,
    slots: usize,
    /// The open file: its OFD lock on byte `me.participant` is the participant claim.
    file: File,
    pub(super) me: Holder,
}

// The mapping is only ever accessed through atomics.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

/// What [`Segment::open`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// A valid segment was there.
    Existing,
    /// There was none; a fresh one was created.
    Created,
    /// An incompatible, corrupt or too small one was replaced; the reason.
    Replaced(String),
}

/// A file-name component for `s` that is **injective** (two different strings never give the
/// same component): `[A-Za-z0-9_.-]` stay as they are, every other byte of the UTF-8 becomes
/// `%XX` (uppercase hex; `%` itself is never kept, so an escape cannot be forged). A
/// component that would be longer than 120 bytes is its first 80 bytes, `~` and the
/// 32-hex-digit [`crate::protocol::key_digest`] of the whole string (`~` never appears
/// otherwise), so a path stays within the 255 bytes a file name may have.
///
/// ```
/// use sluice::shm::escape_name;
/// assert_eq!(escape_name("web-1.eu_west"), "web-1.eu_west"); // unchanged, as before
/// assert_eq!(escape_name("web/1"), "web%2F1");
/// assert_eq!(escape_name("web:1"), "web%3A1");
/// assert_ne!(escape_name("web%2F1"), escape_name("web/1"));
/// assert!(escape_name(&"ü".repeat(200)).len() <= 120);
/// ```
pub fn escape_name(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.len() > 120 {
        let mut cut = 80;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('~');
        out.push_str(&crate::protocol::key_digest(s));
    }
    out
}

fn ofd_lock(file: &File, byte: u64, cmd: libc::c_int) -> std::io::Result<libc::flock> {
    // SAFETY: a zeroed flock is a valid value; the fields we need are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl.l_pid = 0;
    loop {
        // SAFETY: fcntl with an OFD lock command on an open descriptor and a valid flock.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
        if rc == 0 {
            return Ok(fl);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl Segment {
    /// `dir/sluice.<namespace>.<host id>`, both escaped with [`escape_name`] so that two
    /// different host ids never share a segment (before issue 23 every other character became
    /// `_`: `web/1` and `web:1` shared one, and so did ids equal in their first 128 bytes).
    /// Ids of `[A-Za-z0-9_.-]` only (hostnames) keep the name they always had.
    ///
    /// ```
    /// let p = sluice::shm::Segment::path_for("/dev/shm".as_ref(), "sluice", "web-1");
    /// assert_eq!(p.to_str(), Some("/dev/shm/sluice.sluice.web-1"));
    /// let p = sluice::shm::Segment::path_for("/dev/shm".as_ref(), "sluice", "web/1");
    /// assert_eq!(p.to_str(), Some("/dev/shm/sluice.sluice.web%2F1"));
    /// ```
    pub fn path_for(dir: &Path, namespace: &str, host_id: &str) -> PathBuf {
        dir.join(format!(
            "sluice.{}.{}",
            escape_name(namespace),
            escape_name(host_id)
        ))
    }

    /// Opens (creating or replacing as needed) the segment at `path` with at least `slots`
    /// slots, and claims a participant slot in it. An existing valid file with at least
    /// `slots` slots keeps its own slot count; one with fewer is replaced by a larger one.
    pub fn open(path: &Path, slots: u32) -> Result<(Segment, Opened), SegmentError> {
        let err = |source| SegmentError {
            path: path.to_path_buf(),
            source,
        };
        let slots = slots.clamp(1, MAX_SLOTS);
        let lock_path = sibling(path, ".lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o660)
            .open(&lock_path)
            .map_err(err)?;
        let _guard = Flock::lock(&lock).map_err(err)?;
        remove_stale_tmp(path);
        let mut opened = Opened::Existing;
        if path.exists() {
            match Self::map_existing(path) {
                Ok(seg) if seg.slots >= slots as usize => return Ok((seg, opened)),
                Ok(seg) => {
                    let reason = format!("grown from {} to {slots} slots", seg.slots);
                    tracing::warn!(path = %path.display(), %reason,
                        "shared memory segment has fewer slots than configured; replacing it");
                    opened = Opened::Replaced(reason);
                }
                Err(reason) => {
                    tracing::warn!(path = %path.display(), %reason,
                        "shared memory segment is incompatible or corrupt; replacing it");
                    opened = Opened::Replaced(reason);
                }
            }
        } else {
            opened = Opened::Created;
        }
        Self::create_fresh(path, slots).map_err(err)?;
        let seg = Self::map_existing(path).map_err(|reason| err(std::io::Error::other(reason)))?;
        Ok((seg, opened))
    }

    fn map_existing(path: &Path) -> Result<Segment, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("cannot open: {e}"))?;
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        if len < SLOTS_OFFSET as u64 {
            return Err(format!("file is {len} bytes, shorter than the header"));
        }
        // SAFETY: the file is a regular file we keep open; every access goes through atomics,
        // so concurrent writers (other processes) cannot cause undefined behaviour.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| format!("mmap: {e}"))?;
        // SAFETY: at least SLOTS_OFFSET bytes, page aligned, atomics only.
        let h = unsafe { &*(map.as_ptr() as *const Header) };
        let magic = h.magic.load(Ordering::Acquire);
        let version = h.version.load(Ordering::Acquire);
        let slots = h.slots.load(Ordering::Acquire);
        let size = h.size.load(Ordering::Acquire);
        let slot_size = h.slot_size.load(Ordering::Acquire);
        let participants = h.participants.load(Ordering::Acquire);
        let sum = h.checksum.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(format!("bad magic {magic:#x}"));
        }
        if version != LAYOUT_VERSION {
            return Err(format!(
                "layout version {version}, this SDK uses {LAYOUT_VERSION}"
            ));
        }
        if sum != checksum([magic, version, slots, size, slot_size, participants]) {
            return Err("header checksum mismatch".into());
        }
        if slot_size != SLOT_SIZE as u64 || participants != PARTICIPANTS as u64 {
            return Err(format!(
                "slot size {slot_size} / {participants} participants, this SDK uses \
                 {SLOT_SIZE} / {PARTICIPANTS}"
            ));
        }
        if slots == 0
            || slots > MAX_SLOTS as u64
            || size != segment_size(slots as u32)
            || size != len
        {
            return Err(format!(
                "size {size} / file {len} does not match {slots} slots"
            ));
        }
        let mut seg = Segment {
            map,
            path: path.to_path_buf(),
            slots: slots as usize,
            file,
            me: Holder {
                participant: 0,
                generation: 0,
            },
        };
        seg.me = seg.claim_participant()?;
        // Under the open lock: a file of this layout made by a build without segment ids.
        let _ = seg.header().segment_id.compare_exchange(
            0,
            random_id(),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        Ok(seg)
    }

    /// This file's own id (see [`Header::segment_id`]).
    pub fn id(&self) -> u64 {
        self.header().segment_id.load(Ordering::Acquire)
    }

    /// Takes an OFD lock on the first free participant byte and bumps its generation.
    fn claim_participant(&self) -> Result<Holder, String> {
        for p in 0..PARTICIPANTS {
            match ofd_lock(&self.file, p as u64, libc::F_OFD_SETLK) {
                Ok(_) => {
                    let part = self.participant(p);
                    let generation = part
                        .generation
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| {
                            let next = (g as u16).wrapping_add(1);
                            Some(if next == 0 { 1 } else { next } as u64)
                        })
                        .map(|g| {
                            let next = (g as u16).wrapping_add(1);
                            if next == 0 { 1 } else { next }
                        })
                        .unwrap_or(1);
                    part.pid.store(std::process::id() as u64, Ordering::Relaxed);
                    return Ok(Holder {
                        participant: p as u16,
                        generation,
                    });
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                    continue;
                }
                Err(e) => return Err(format!("participant lock: {e}")),
            }
        }
        Err(format!(
            "all {PARTICIPANTS} participant slots are taken by live processes"
        ))
    }

    fn participant(&self, p: usize) -> &Participant {
        let p = p.min(PARTICIPANTS - 1);
        // SAFETY: the table lies between the header and the slots (size checked on open),
        // 8-byte aligned, atomics only.
        unsafe {
            &*(self
                .map
                .as_ptr()
                .add(HEADER_SIZE + p * std::mem::size_of::<Participant>())
                as *const Participant)
        }
    }

    /// This process's (this open's) participant identity.
    pub fn me(&self) -> Holder {
        self.me
    }

    /// The pid a participant recorded when it claimed its slot (as seen in its own PID
    /// namespace: for logs only).
    pub fn participant_pid(&self, participant: u16) -> u32 {
        self.participant(participant as usize)
            .pid
            .load(Ordering::Relaxed) as u32
    }

    /// Is `h` a live participant: its byte is locked by some open file description and its
    /// generation still matches? An error of `F_OFD_GETLK` counts as alive (the lock timeout
    /// is the backstop).
    pub fn alive(&self, h: Holder) -> bool {
        if h.generation == 0 || h.participant as usize >= PARTICIPANTS {
            return false;
        }
        if h.participant == self.me.participant {
            // Our own byte: it is us iff the generation is ours (an earlier owner of this
            // participant slot had to be gone for us to lock the byte).
            return h.generation == self.me.generation;
        }
        let current = self
            .participant(h.participant as usize)
            .generation
            .load(Ordering::Acquire) as u16;
        if current != h.generation {
            return false;
        }
        match ofd_lock(&self.file, h.participant as u64, libc::F_OFD_GETLK) {
            Ok(fl) => fl.l_type != libc::F_UNLCK as libc::c_short,
            Err(_) => true,
        }
    }

    /// A lock stored in `word` (a word of this segment).
    pub fn lock<'a>(&'a self, word: &'a AtomicU64) -> ShmLock<'a> {
        ShmLock { word, seg: self }
    }

    /// The pull lock of slot `i`.
    pub fn pull_lock(&self, i: usize) -> Option<ShmLock<'_>> {
        Some(self.lock(&self.slot(i)?.ctl.pull_lock))
    }

    fn create_fresh(path: &Path, slots: u32) -> std::io::Result<()> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = sibling(path, &format!("{TMP_MARK}{}.{nanos}", std::process::id()));
        let result = (|| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o660)
                .open(&tmp)?;
            let size = segment_size(slots);
            file.set_len(size)?;
            // SAFETY: a file only this process knows about yet.
            let map = unsafe { MmapMut::map_mut(&file)? };
            // SAFETY: the file is `size` bytes, page aligned; atomics only.
            let h = unsafe { &*(map.as_ptr() as *const Header) };
            h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
            h.slots.store(slots as u64, Ordering::Relaxed);
            h.size.store(size, Ordering::Relaxed);
            h.slot_size.store(SLOT_SIZE as u64, Ordering::Relaxed);
            h.participants.store(PARTICIPANTS as u64, Ordering::Relaxed);
            h.segment_id.store(random_id(), Ordering::Relaxed);
            h.checksum.store(
                checksum([
                    MAGIC,
                    LAYOUT_VERSION,
                    slots as u64,
                    size,
                    SLOT_SIZE as u64,
                    PARTICIPANTS as u64,
                ]),
                Ordering::Relaxed,
            );
            for i in 0..slots as usize {
                // SAFETY: in bounds of the file just sized; 64-byte aligned; atomics only.
                let s =
                    unsafe { &*(map.as_ptr().add(SLOTS_OFFSET + i * SLOT_SIZE) as *const Slot) };
                for e in &s.ring {
                    e.tag.store(EMPTY_TAG, Ordering::Relaxed);
                }
            }
            h.magic.store(MAGIC, Ordering::Release);
            map.flush()?;
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The header.
    pub fn header(&self) -> &Header {
        // SAFETY: the map is at least SLOTS_OFFSET bytes (checked on open), page aligned, and
        // Header consists of atomics only.
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    /// Slot `i`.
    #[inline]
    pub fn slot(&self, i: usize) -> Option<&Slot> {
        if i >= self.slots {
            return None;
        }
        // SAFETY: in bounds (size checked on open), 64-byte aligned (SLOTS_OFFSET and Slot are
        // multiples of 64), atomics only.
        Some(unsafe { &*(self.map.as_ptr().add(SLOTS_OFFSET + i * SLOT_SIZE) as *const Slot) })
    }

    /// The slot of task `name` and its generation, if one exists.
    pub fn resolve(&self, name: &str) -> Option<SlotRef> {
        (0..self.slots).find_map(|i| {
            let generation = self.slot(i)?.holds(name)?;
            Some(SlotRef {
                index: i,
                generation,
            })
        })
    }

    /// The slot of task `name`, if one exists.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.resolve(name).map(|r| r.index)
    }

    /// The slot of task `name`, claiming a free one if needed (without reclaiming); `None`
    /// when the segment is full.
    pub fn find_or_claim(&self, name: &str, lock_timeout_ms: u64) -> Option<usize> {
        self.claim(
            name,
            ClaimOptions {
                now_ms: crate::clock::host_ms(),
                lock_timeout_ms,
                reclaim_idle_ms: u64::MAX,
            },
        )
        .map(|r| r.index)
    }

    /// The slot of task `name`, claiming one if needed: a free one, else the one idle longest
    /// if it has been idle at least `opts.reclaim_idle_ms` (its generation is bumped, so stale
    /// handles notice). `None` when the segment is full (or the alloc lock stays busy).
    pub fn claim(&self, name: &str, opts: ClaimOptions) -> Option<SlotRef> {
        if let Some(r) = self.resolve(name) {
            if let Some(s) = self.slot(r.index) {
                s.touch(opts.now_ms);
            }
            return Some(r);
        }
        let lock = self.lock(&self.header().alloc_lock);
        let deadline = std::time::Instant::now()
            + std::time::Duration::from_millis(opts.lock_timeout_ms.saturating_mul(2));
        let token = loop {
            match lock.try_lock(crate::clock::host_ms(), opts.lock_timeout_ms) {
                LockAttempt::Acquired { token, .. } => break token,
                LockAttempt::Busy { .. } if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_micros(200))
                }
                LockAttempt::Busy { .. } => return None,
            }
        };
        let result = self.resolve(name).or_else(|| {
            let free = (0..self.slots).find(|i| {
                self.slot(*i)
                    .is_some_and(|s| s.ident.state.load(Ordering::Acquire) != READY)
            });
            let i = match free {
                Some(i) => i,
                None => {
                    let (i, used) = (0..self.slots)
                        .filter_map(|i| {
                            Some((i, self.slot(i)?.ident.used_ms.load(Ordering::Relaxed)))
                        })
                        .min_by_key(|(_, used)| *used)?;
                    let idle = opts.now_ms.saturating_sub(used).max(0) as u64;
                    if idle < opts.reclaim_idle_ms {
                        return None;
                    }
                    let s = self.slot(i)?;
                    tracing::info!(slot = i, old = ?s.name(), new = name, idle_ms = idle,
                        "reclaiming an idle segment slot");
                    i
                }
            };
            let s = self.slot(i)?;
            // Invalidate first: stale handles see another generation from here on.
            s.ident.state.store(0, Ordering::Release);
            let generation = (s.ident.generation.load(Ordering::Acquire) as u16).wrapping_add(1);
            s.ident
                .generation
                .store(generation as u64, Ordering::Release);
            s.reset(generation);
            s.write_name(name);
            s.touch(opts.now_ms);
            s.ident.state.store(READY, Ordering::Release);
            Some(SlotRef {
                index: i,
                generation,
            })
        });
        lock.unlock(token);
        result
    }

    /// Names and indexes of every slot in use.
    pub fn tasks(&self) -> Vec<(usize, String)> {
        (0..self.slots)
            .filter_map(|i| Some((i, self.slot(i)?.name()?)))
            .collect()
    }
}

/// `path` with `suffix` appended to its file name.
/// What the temporary file a segment or key table is built in adds to its name:
/// `<file name>~tmp.<pid>.<n>`, renamed into place once written. No segment, key table or lock
/// file name contains `~tmp.` ([`escape_name`] escapes `~` in host ids and namespaces, and the
/// `~` it adds to a long name is followed by hex digits), so the mark names only such files.
pub(crate) const TMP_MARK: &str = "~tmp.";

/// Removes the temporary files of `path` that a process killed while building one left behind
/// (issue 23: a host SIGKILLed in its first second left `sluice.<ns>.<host>.tmp.<pid>.<n>` in
/// `/dev/shm` for good). Call it with `path`'s lock held: nobody else builds one then, so every
/// such file is a leftover. Best effort: an error leaves the file (the next open tries again).
pub(crate) fn remove_stale_tmp(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let prefix = format!("{}{TMP_MARK}", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix)
            && std::fs::remove_file(e.path()).is_ok()
        {
            tracing::warn!(file = %e.path().display(),
                "removed a temporary file left by a process killed while creating it");
        }
    }
}

pub(crate) fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

pub(crate) struct Flock<'a>(&'a File);

impl<'a> Flock<'a> {
    pub(crate) fn lock(f: &'a File) -> std::io::Result<Self> {
        loop {
            // SAFETY: flock on an open descriptor.
            let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(Self(f));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: unlocking our own lock.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}
