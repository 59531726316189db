//! zmem's swap file: where the tier writes back pool entries that went cold
//! (decompressed first, as raw pages), as zswap writes back to the swap
//! device.
//!
//! - [`slot`]: the slot allocator (next fit, so batches are contiguous).
//! - Writes are batched: a batch of pages becomes one `pwritev` per run of
//!   neighbouring slots. Pages are staged in bounce pages from the mempool's
//!   bulk allocator, then checksummed and encrypted there.
//! - [`crypt`]: AES-256-XTS with a per-file random key that never touches
//!   disk; the tweak is the slot number (the dm-crypt role). Off with
//!   `encrypt: false`, for benchmarking.
//! - A CRC32 of every slot's plaintext is kept in memory and checked on every
//!   read, so a corrupt slot is an error, never wrong bytes.
//! - The file is created with `O_TMPFILE` (or unlinked right after creation)
//!   with mode 0600: it has no name, and it vanishes with the process.
//! - I/O is `O_DIRECT`: written-back pages leave RAM for good instead of
//!   staying in the page cache (which is also a copy the CPU pays for).
//!   Bounce pages are page-aligned, as direct I/O needs. A filesystem that
//!   refuses `O_DIRECT` (tmpfs) gets buffered I/O and one warning line;
//!   [`SwapStats::direct_io`] says which, and [`SwapFile::page_cache_bytes`]
//!   measures what the file holds in memory (`cachestat`).
//!
//! Two ways in:
//! - [`SwapFile::write_batch`]: raw pages, one per slot, as the kernel's
//!   swap does.
//! - [`SwapFile::write_packed`]: compressed objects packed into slots
//!   (zram's compressed writeback). Objects never straddle a slot; a slot
//!   counts the live objects in it and is freed when the last goes
//!   ([`SwapFile::free`] drops one). This cuts file I/O, encryption and
//!   checksumming by the compression ratio, and writeback needs no codec.
//!   The price is fragmentation: a slot stays in use while one of its
//!   objects lives. [`SwapStats::objects_written`] against
//!   [`SwapStats::pages_written`] gives the packing achieved.
#![deny(unsafe_code)]

mod ahead;
pub mod crypt;
pub mod fuzz;
pub mod slot;

use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use zmem_common::LockExt;

use thiserror::Error;
use zmem_common::PAGE_SIZE;
use zmem_zsmalloc::{Mempool, Page};

pub use crypt::Crypt;
pub use slot::{Slot, SlotMap};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SwapError {
    #[error("swap file in {dir}: {source}")]
    Create { dir: PathBuf, source: std::io::Error },
    #[error("swap file is full: {max_bytes} bytes in use")]
    NoSpace { max_bytes: u64 },
    #[error("swap file {op} at slot {slot}: {source}")]
    Io { op: &'static str, slot: Slot, source: std::io::Error },
    #[error("slot {slot} failed its checksum: the swap file is corrupt")]
    Corrupt { slot: Slot },
    #[error("slot {slot} is not in use")]
    NotInUse { slot: Slot },
    #[error("no bounce pages could be allocated for writeback")]
    BounceAlloc,
    #[error("random key: {0}")]
    Key(getrandom::Error),
    #[error("a page must be {PAGE_SIZE} bytes, got {len}")]
    BadPage { len: usize },
}

/// Settings of a swap file.
#[derive(Debug, Clone)]
pub struct SwapFileConfig {
    /// Directory to create the (nameless) file in.
    pub dir: PathBuf,
    /// AES-XTS encryption of every slot.
    pub encrypt: bool,
    /// The largest the file may grow.
    pub max_bytes: u64,
}

impl Default for SwapFileConfig {
    fn default() -> Self {
        SwapFileConfig { dir: std::env::temp_dir(), encrypt: true, max_bytes: 64 << 30 }
    }
}

/// Counters of the swap file.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SwapStats {
    pub slots_in_use: u64,
    pub file_bytes: u64,
    /// Slots written (4 KiB each).
    pub pages_written: u64,
    /// Objects written: pages for `write_batch`, compressed objects for
    /// `write_packed`.
    pub objects_written: u64,
    pub write_calls: u64,
    pub pages_read: u64,
    /// Read syscalls: one per `read`, one per run of a `read_batch`.
    pub read_calls: u64,
    pub checksum_failures: u64,
    /// Whether the file is read and written with `O_DIRECT`.
    pub direct_io: bool,
    /// Whether swap-in read-ahead is on (`O_DIRECT` and an io_uring).
    pub readahead: bool,
    /// Slots read ahead of a load (`SwapFile::prefetch`), and reads a
    /// block read ahead served.
    pub readahead_blocks: u64,
    pub readahead_hits: u64,
}

#[derive(Debug)]
struct Slots {
    map: SlotMap,
    /// CRC32 of each slot's plaintext, by slot number.
    sums: Vec<u32>,
    /// Live objects in each slot, by slot number (1 for a raw page).
    refs: Vec<u16>,
    /// `objects_written` when each slot was written (wrapping), by slot
    /// number: [`SwapFile::written_within`].
    written_at: Vec<u32>,
    /// Swap-in read-ahead's blocks (`ahead.rs`).
    ahead: ahead::Cache,
}

/// A swap file of 4 KiB slots.
#[derive(Debug)]
pub struct SwapFile {
    file: File,
    slots: Mutex<Slots>,
    crypt: Option<Crypt>,
    mempool: Arc<Mempool>,
    max_bytes: u64,
    pages_written: AtomicU64,
    objects_written: AtomicU64,
    write_calls: AtomicU64,
    pages_read: AtomicU64,
    read_calls: AtomicU64,
    checksum_failures: AtomicU64,
    direct_io: bool,
    /// Swap-in read-ahead (`ahead.rs`); `None` without io_uring, or with
    /// buffered I/O (the page cache reads ahead by itself).
    ahead: Option<ahead::Ring>,
    /// Blocks read ahead, and reads served from them.
    ahead_ready: AtomicU64,
    ahead_hits: AtomicU64,
    buffered: std::sync::OnceLock<File>,
    /// Fault injection: this many of the next writes fail, with EIO, or
    /// with ENOSPC when `inject_enospc`.
    inject_eio: std::sync::atomic::AtomicU32,
    inject_enospc: std::sync::atomic::AtomicBool,
}

fn libc_eio() -> i32 {
    rustix::io::Errno::IO.raw_os_error()
}

fn libc_enospc() -> i32 {
    rustix::io::Errno::NOSPC.raw_os_error()
}

/// The most slots one `preadv` of `read_batch` reads.
const MAX_READ_RUN: usize = 64;

/// Turns on `O_DIRECT` for `file`; false where the filesystem refuses it.
fn set_direct(file: &File) -> bool {
    use rustix::fs::OFlags;
    let Ok(fl) = rustix::fs::fcntl_getfl(file) else { return false };
    rustix::fs::fcntl_setfl(file, fl | OFlags::DIRECT).is_ok()
}

/// `cachestat(2)` (Linux 6.5): pages of `[0, len)` of `file` in the page cache.
#[allow(unsafe_code)]
fn cached_pages(file: &File, len: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    const SYS_CACHESTAT: i64 = 451;
    if len == 0 {
        return Some(0);
    }
    let mut range = Range { off: 0, len };
    let mut st = Stat::default();
    // SAFETY: 1. the fd is open for the call (borrowed from `file`); 2. the
    // kernel reads one struct cachestat_range from `range` and writes one
    // struct cachestat to `st`, both live, #[repr(C)] and of the uapi's
    // layout (two and five u64s); 3. it touches no other memory.
    let r =
        unsafe { libc_syscall(SYS_CACHESTAT, file.as_raw_fd() as i64, &raw mut range as i64, &raw mut st as i64, 0) };
    (r == 0).then_some(st.nr_cache)
}

#[allow(unsafe_code)]
unsafe fn libc_syscall(nr: i64, a: i64, b: i64, c: i64, d: i64) -> i64 {
    extern "C" {
        fn syscall(nr: i64, ...) -> i64;
    }
    // SAFETY: the caller's arguments are right for syscall `nr`.
    unsafe { syscall(nr, a, b, c, d) }
}

fn create_file(dir: &Path) -> std::io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    let mode = Mode::from_raw_mode(0o600);
    match rustix::fs::open(dir, OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC, mode) {
        Ok(fd) => Ok(File::from(fd)),
        // A filesystem without O_TMPFILE: create a unique name and unlink it.
        Err(e)
            if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::ISDIR || e == rustix::io::Errno::INVAL =>
        {
            let name = dir.join(format!(".zmem-swap-{}-{:x}", std::process::id(), rand_u64()));
            let fd = rustix::fs::open(&name, OFlags::CREATE | OFlags::EXCL | OFlags::RDWR | OFlags::CLOEXEC, mode)?;
            std::fs::remove_file(&name)?;
            Ok(File::from(fd))
        }
        Err(e) => Err(e.into()),
    }
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    let _ = getrandom::getrandom(&mut b);
    u64::from_le_bytes(b)
}

/// Places objects of `lens` in 4 KiB blocks, first fit in order: each
/// object's (block, offset), and how many blocks.
fn pack(lens: impl Iterator<Item = usize>) -> (Vec<(usize, u16)>, usize) {
    let mut place = Vec::new();
    let (mut block, mut used) = (0usize, 0usize);
    for len in lens {
        if used + len > PAGE_SIZE {
            block += 1;
            used = 0;
        }
        place.push((block, used as u16));
        used += len;
    }
    let n = if place.is_empty() { 0 } else { block + 1 };
    (place, n)
}

impl SwapError {
    /// The same error, about `slot` (one failed read fails each object of
    /// the slot).
    fn clone_for(&self, slot: Slot) -> SwapError {
        match self {
            SwapError::Io { op, source, .. } => {
                SwapError::Io { op, slot, source: std::io::Error::new(source.kind(), source.to_string()) }
            }
            SwapError::Corrupt { .. } => SwapError::Corrupt { slot },
            SwapError::NotInUse { .. } => SwapError::NotInUse { slot },
            SwapError::BadPage { len } => SwapError::BadPage { len: *len },
            SwapError::NoSpace { max_bytes } => SwapError::NoSpace { max_bytes: *max_bytes },
            _ => SwapError::BounceAlloc,
        }
    }
}

impl SwapFile {
    /// The file descriptors this swap file holds open (see
    /// `zmem_uffd::Pager::abandon_in_child`, which closes them in a forked
    /// child that will never use them).
    pub fn raw_fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let mut v = vec![self.file.as_raw_fd()];
        v.extend(self.buffered.get().map(AsRawFd::as_raw_fd));
        v.extend(self.ahead.as_ref().map(ahead::Ring::raw_fd));
        v
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        self.drain_ahead();
        zmem_common::host::fds::forget(std::os::fd::AsRawFd::as_raw_fd(&self.file));
    }
}

impl SwapFile {
    /// Creates a nameless swap file in `cfg.dir`.
    ///
    /// # Errors
    /// [`SwapError::Create`] if the directory does not take the file;
    /// [`SwapError::Key`] if no random key can be had.
    pub fn create(cfg: &SwapFileConfig, mempool: Arc<Mempool>) -> Result<SwapFile, SwapError> {
        let file = create_file(&cfg.dir).map_err(|source| SwapError::Create { dir: cfg.dir.clone(), source })?;
        // Kept from the program's `close` family (see `zmem_common::host::fds`).
        zmem_common::host::fds::keep(std::os::fd::AsRawFd::as_raw_fd(&file));
        let direct_io = set_direct(&file);
        if !direct_io {
            log::warn!("{} does not take O_DIRECT; the swap file goes through the page cache", cfg.dir.display());
        }
        let crypt = if cfg.encrypt { Some(Crypt::random().map_err(SwapError::Key)?) } else { None };
        let max_slots = (cfg.max_bytes / PAGE_SIZE as u64).min(u64::from(u32::MAX)) as u32;
        Ok(SwapFile {
            file,
            slots: Mutex::new(Slots {
                map: SlotMap::new(max_slots),
                sums: Vec::new(),
                refs: Vec::new(),
                written_at: Vec::new(),
                ahead: ahead::Cache::default(),
            }),
            crypt,
            mempool,
            max_bytes: cfg.max_bytes,
            pages_written: AtomicU64::new(0),
            objects_written: AtomicU64::new(0),
            write_calls: AtomicU64::new(0),
            pages_read: AtomicU64::new(0),
            read_calls: AtomicU64::new(0),
            checksum_failures: AtomicU64::new(0),
            direct_io,
            ahead: if direct_io { ahead::Ring::new() } else { None },
            ahead_ready: AtomicU64::new(0),
            ahead_hits: AtomicU64::new(0),
            buffered: std::sync::OnceLock::new(),
            inject_eio: std::sync::atomic::AtomicU32::new(0),
            inject_enospc: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn encrypted(&self) -> bool {
        self.crypt.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock_ok()
    }

    /// Writes `pages` to fresh slots and returns them, in order. All or
    /// nothing: on any error every slot of the batch is freed again.
    ///
    /// # Errors
    /// [`SwapError::NoSpace`] at `max_bytes`; [`SwapError::Io`] for a failed
    /// `pwritev` (ENOSPC, EIO: the caller keeps its pages);
    /// [`SwapError::BounceAlloc`]; [`SwapError::BadPage`].
    pub fn write_batch(&self, pages: &[&[u8]]) -> Result<Vec<Slot>, SwapError> {
        if let Some(p) = pages.iter().find(|p| p.len() != PAGE_SIZE) {
            return Err(SwapError::BadPage { len: p.len() });
        }
        let slots = self.write_blocks(pages, &vec![1; pages.len()])?;
        self.objects_written.fetch_add(pages.len() as u64, Ordering::Relaxed);
        Ok(slots)
    }

    /// Writes `objs` (each 1 to `PAGE_SIZE` bytes) packed into fresh slots,
    /// in order, first fit: an object goes after the previous one when it
    /// fits in the rest of the slot, else at the start of the next slot.
    /// Returns each object's slot and byte offset in it; read one back with
    /// [`read_objs`](Self::read_objs) and its length. All or nothing, as
    /// [`write_batch`](Self::write_batch).
    ///
    /// # Errors
    /// As [`write_batch`](Self::write_batch); [`SwapError::BadPage`] for an
    /// empty object or one over a page.
    pub fn write_packed(&self, objs: &[&[u8]]) -> Result<Vec<(Slot, u16)>, SwapError> {
        if let Some(o) = objs.iter().find(|o| o.is_empty() || o.len() > PAGE_SIZE) {
            return Err(SwapError::BadPage { len: o.len() });
        }
        let (place, nblocks) = pack(objs.iter().map(|o| o.len()));
        let mut blocks = vec![0u8; nblocks * PAGE_SIZE];
        let mut counts = vec![0u16; nblocks];
        for (o, &(b, off)) in objs.iter().zip(&place) {
            let at = b * PAGE_SIZE + off as usize;
            blocks[at..at + o.len()].copy_from_slice(o);
            counts[b] += 1;
        }
        let pages: Vec<&[u8]> = blocks.chunks_exact(PAGE_SIZE).collect();
        let slots = self.write_blocks(&pages, &counts)?;
        self.objects_written.fetch_add(objs.len() as u64, Ordering::Relaxed);
        Ok(place.iter().map(|&(b, off)| (slots[b], off)).collect())
    }

    /// Writes whole `pages` to fresh slots, slot `i` holding `refs[i]` objects.
    fn write_blocks(&self, pages: &[&[u8]], refs: &[u16]) -> Result<Vec<Slot>, SwapError> {
        // Free slots have no read-ahead state: `free` forgets it, and a
        // prefetch marks only slots in use.
        let slots = self.lock().map.alloc(pages.len());
        if slots.len() < pages.len() {
            self.free_all(&slots);
            return Err(SwapError::NoSpace { max_bytes: self.max_bytes });
        }
        match self.write_slots(pages, &slots) {
            Ok(sums) => {
                let now = self.objects_written.load(Ordering::Relaxed) as u32;
                let mut g = self.lock();
                for ((&s, sum), &n) in slots.iter().zip(sums).zip(refs) {
                    if g.sums.len() <= s as usize {
                        g.sums.resize(s as usize + 1, 0);
                        g.refs.resize(s as usize + 1, 0);
                        g.written_at.resize(s as usize + 1, 0);
                    }
                    g.sums[s as usize] = sum;
                    g.refs[s as usize] = n;
                    g.written_at[s as usize] = now;
                }
                Ok(slots)
            }
            Err(e) => {
                self.free_all(&slots);
                Err(e)
            }
        }
    }

    fn free_all(&self, slots: &[Slot]) {
        let mut free = Vec::new();
        let mut g = self.lock();
        for &s in slots {
            g.map.free(s);
            g.ahead.forget(s, &mut free);
        }
        drop(g);
        self.mempool.free_pages(free);
    }

    /// Stages, checksums, encrypts and writes `pages` to `slots`.
    fn write_slots(&self, pages: &[&[u8]], slots: &[Slot]) -> Result<Vec<u32>, SwapError> {
        let bulk = self.mempool.alloc_pages_bulk_array(pages.len());
        if bulk.pages.is_empty() {
            return Err(SwapError::BounceAlloc);
        }
        // With fewer bounce pages than asked (a partial bulk allocation),
        // the batch goes out in chunks of what we got.
        let mut bounce: Vec<Page> = bulk.pages;
        let mut sums = Vec::with_capacity(pages.len());
        let mut result = Ok(());
        for (chunk, chunk_slots) in pages.chunks(bounce.len()).zip(slots.chunks(bounce.len())) {
            for ((src, b), &slot) in chunk.iter().zip(bounce.iter_mut()).zip(chunk_slots) {
                let buf = b.as_mut_slice();
                buf.copy_from_slice(src);
                sums.push(crc32fast::hash(buf));
                if let Some(c) = &self.crypt {
                    c.encrypt(slot, buf);
                }
            }
            // One pwritev per run of consecutive slots.
            let mut i = 0;
            while i < chunk.len() {
                let mut j = i + 1;
                while j < chunk.len() && chunk_slots[j] == chunk_slots[j - 1] + 1 {
                    j += 1;
                }
                let iov: Vec<IoSlice<'_>> = bounce[i..j].iter().map(|p| IoSlice::new(p.as_slice())).collect();
                if let Err(e) = self.pwritev_all(iov, chunk_slots[i]) {
                    result = Err(e);
                    break;
                }
                i = j;
            }
            if result.is_err() {
                break;
            }
        }
        self.mempool.free_pages(bounce);
        result.map(|()| {
            self.pages_written.fetch_add(pages.len() as u64, Ordering::Relaxed);
            sums
        })
    }

    fn pwritev_all(&self, mut iov: Vec<IoSlice<'_>>, slot: Slot) -> Result<(), SwapError> {
        if self.inject_eio.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
            let errno = if self.inject_enospc.load(Ordering::Relaxed) { libc_enospc() } else { libc_eio() };
            let source = std::io::Error::from_raw_os_error(errno);
            return Err(SwapError::Io { op: "pwritev", slot, source });
        }
        let mut off = u64::from(slot) * PAGE_SIZE as u64;
        let mut bufs = &mut iov[..];
        while !bufs.is_empty() {
            self.write_calls.fetch_add(1, Ordering::Relaxed);
            match rustix::io::pwritev(&self.file, bufs, off) {
                Ok(0) => {
                    let source = std::io::Error::from(std::io::ErrorKind::WriteZero);
                    return Err(SwapError::Io { op: "pwritev", slot, source });
                }
                Ok(n) => {
                    off += n as u64;
                    IoSlice::advance_slices(&mut bufs, n);
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(SwapError::Io { op: "pwritev", slot, source: e.into() }),
            }
        }
        Ok(())
    }

    /// Reads slot `slot` into `dst` (one page), decrypting and checking it.
    ///
    /// # Errors
    /// [`SwapError::NotInUse`]; [`SwapError::Io`]; [`SwapError::Corrupt`]
    /// when the checksum fails (`dst` then holds garbage, never passed off
    /// as the page).
    pub fn read(&self, slot: Slot, dst: &mut [u8]) -> Result<(), SwapError> {
        if dst.len() != PAGE_SIZE {
            return Err(SwapError::BadPage { len: dst.len() });
        }
        let want = {
            let g = self.lock();
            if !g.map.in_use(slot) {
                return Err(SwapError::NotInUse { slot });
            }
            g.sums.get(slot as usize).copied().unwrap_or(0)
        };
        let off = u64::from(slot) * PAGE_SIZE as u64;
        let io = |source| SwapError::Io { op: "pread", slot, source };
        if self.direct_io && dst.as_ptr() as usize % PAGE_SIZE != 0 {
            // O_DIRECT needs an aligned buffer: read into a bounce page.
            let mut b = self.mempool.alloc_page().ok_or(SwapError::BounceAlloc)?;
            let r = self.file.read_exact_at(b.as_mut_slice(), off);
            dst.copy_from_slice(b.as_slice());
            self.mempool.free_pages([b]);
            r.map_err(io)?;
        } else {
            self.file.read_exact_at(dst, off).map_err(io)?;
        }
        if let Some(c) = &self.crypt {
            c.decrypt(slot, dst);
        }
        self.pages_read.fetch_add(1, Ordering::Relaxed);
        self.read_calls.fetch_add(1, Ordering::Relaxed);
        if crc32fast::hash(dst) != want {
            self.checksum_failures.fetch_add(1, Ordering::Relaxed);
            return Err(SwapError::Corrupt { slot });
        }
        Ok(())
    }

    /// Reads several slots, one `preadv` per run of neighbouring slots (a
    /// folio written back together usually sits in one run), each checked
    /// and decrypted as [`read`](Self::read) does. `out[i]` is the result
    /// for `reqs[i]`.
    pub fn read_batch(&self, reqs: &mut [(Slot, &mut [u8])]) -> Vec<Result<(), SwapError>> {
        let mut out: Vec<Result<(), SwapError>> = (0..reqs.len()).map(|_| Ok(())).collect();
        let mut order: Vec<usize> = Vec::with_capacity(reqs.len());
        let mut sums = vec![0u32; reqs.len()];
        // Blocks read ahead are here already, checked (`ahead.rs`).
        let served = self.take_ahead(reqs);
        {
            let g = self.lock();
            for (i, (slot, dst)) in reqs.iter().enumerate() {
                if served[i] {
                    self.pages_read.fetch_add(1, Ordering::Relaxed);
                } else if dst.len() != PAGE_SIZE {
                    out[i] = Err(SwapError::BadPage { len: dst.len() });
                } else if !g.map.in_use(*slot) {
                    out[i] = Err(SwapError::NotInUse { slot: *slot });
                } else {
                    sums[i] = g.sums.get(*slot as usize).copied().unwrap_or(0);
                    order.push(i);
                }
            }
        }
        order.sort_by_key(|&i| reqs[i].0);
        let mut k = 0;
        while k < order.len() {
            let mut end = k + 1;
            while end < order.len() && end - k < MAX_READ_RUN && reqs[order[end]].0 == reqs[order[end - 1]].0 + 1 {
                end += 1;
            }
            let run = &order[k..end];
            let first = reqs[run[0]].0;
            let mut bounce = self.mempool.alloc_pages_bulk_array(run.len()).pages;
            let r = if bounce.len() < run.len() {
                Err(SwapError::BounceAlloc)
            } else {
                self.preadv_all(&mut bounce, first)
            };
            for (j, &i) in run.iter().enumerate() {
                let slot = reqs[i].0;
                out[i] = match &r {
                    Err(e) => Err(match e {
                        SwapError::Io { op, source, .. } => {
                            SwapError::Io { op, slot, source: std::io::Error::new(source.kind(), source.to_string()) }
                        }
                        _ => SwapError::BounceAlloc,
                    }),
                    Ok(()) => {
                        let dst = &mut *reqs[i].1;
                        dst.copy_from_slice(bounce[j].as_slice());
                        if let Some(c) = &self.crypt {
                            c.decrypt(slot, dst);
                        }
                        self.pages_read.fetch_add(1, Ordering::Relaxed);
                        if crc32fast::hash(dst) == sums[i] {
                            Ok(())
                        } else {
                            self.checksum_failures.fetch_add(1, Ordering::Relaxed);
                            Err(SwapError::Corrupt { slot })
                        }
                    }
                };
            }
            self.mempool.free_pages(bounce);
            self.read_calls.fetch_add(1, Ordering::Relaxed);
            k = end;
        }
        out
    }

    fn preadv_all(&self, pages: &mut [Page], slot: Slot) -> Result<(), SwapError> {
        let base = u64::from(slot) * PAGE_SIZE as u64;
        let end = base + (pages.len() * PAGE_SIZE) as u64;
        let mut off = base;
        while off < end {
            let idx = ((off - base) as usize) / PAGE_SIZE;
            let within = ((off - base) as usize) % PAGE_SIZE;
            if within > 0 {
                // A short read ended inside a page (never with O_DIRECT).
                self.file
                    .read_exact_at(&mut pages[idx].as_mut_slice()[within..], off)
                    .map_err(|source| SwapError::Io { op: "pread", slot, source })?;
                off += (PAGE_SIZE - within) as u64;
                continue;
            }
            let mut iov: Vec<IoSliceMut<'_>> =
                pages[idx..].iter_mut().map(|p| IoSliceMut::new(p.as_mut_slice())).collect();
            match rustix::io::preadv(&self.file, &mut iov, off) {
                Ok(0) => {
                    let source = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(SwapError::Io { op: "preadv", slot, source });
                }
                Ok(n) => off += n as u64,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(SwapError::Io { op: "preadv", slot, source: e.into() }),
            }
        }
        Ok(())
    }

    /// Drops one object of `slot` (the page, for a raw slot); the slot is
    /// free once its last object is dropped.
    ///
    /// # Errors
    /// [`SwapError::NotInUse`] for a slot that is not in use.
    pub fn free(&self, slot: Slot) -> Result<(), SwapError> {
        let mut g = self.lock();
        if !g.map.in_use(slot) {
            return Err(SwapError::NotInUse { slot });
        }
        let left = g.refs.get_mut(slot as usize).map_or(0, |n| {
            *n = n.saturating_sub(1);
            *n
        });
        if left == 0 {
            g.map.free(slot);
            if !g.ahead.blocks.is_empty() {
                let mut free = Vec::new();
                g.ahead.forget(slot, &mut free);
                drop(g);
                self.mempool.free_pages(free);
            }
        }
        Ok(())
    }

    /// How many of `slots` were written fewer than `window` objects ago
    /// (wrapping at 2^32): how far back in the writeback stream a slot lies,
    /// as the refault distance of mm/workingset.c is counted in evictions.
    /// One lock for all of them.
    pub fn written_within(&self, slots: &[Slot], window: u64) -> usize {
        let now = self.objects_written.load(Ordering::Relaxed) as u32;
        let g = self.lock();
        slots
            .iter()
            .filter(|&&s| u64::from(now.wrapping_sub(g.written_at.get(s as usize).copied().unwrap_or(now))) < window)
            .count()
    }

    /// Reads objects back: `reqs[i]` is (slot, offset, destination), and
    /// the destination's length is the object's. Each slot is read,
    /// decrypted and checked once, however many of its objects are asked
    /// for, and neighbouring slots are read by one `preadv` (as
    /// [`read_batch`](Self::read_batch)). `out[i]` is the result for
    /// `reqs[i]`; an error for a slot is the error of each of its objects.
    pub fn read_objs(&self, reqs: &mut [(Slot, u16, &mut [u8])]) -> Vec<Result<(), SwapError>> {
        let mut slots: Vec<Slot> = reqs.iter().map(|r| r.0).collect();
        slots.sort_unstable();
        slots.dedup();
        let mut blocks = vec![0u8; slots.len() * PAGE_SIZE];
        let results = {
            let mut breqs: Vec<(Slot, &mut [u8])> =
                slots.iter().copied().zip(blocks.chunks_exact_mut(PAGE_SIZE)).collect();
            self.read_batch(&mut breqs)
        };
        reqs.iter_mut()
            .map(|(slot, off, dst)| {
                let b = slots.binary_search(slot).expect("every slot was read");
                match &results[b] {
                    Err(e) => Err(e.clone_for(*slot)),
                    Ok(()) => {
                        let at = b * PAGE_SIZE + usize::from(*off);
                        match blocks.get(at..at + dst.len()).filter(|_| usize::from(*off) + dst.len() <= PAGE_SIZE) {
                            Some(src) => {
                                dst.copy_from_slice(src);
                                Ok(())
                            }
                            None => Err(SwapError::BadPage { len: usize::from(*off) + dst.len() }),
                        }
                    }
                }
            })
            .collect()
    }

    /// Whether more than half of `max_bytes` is in use: the kernel's
    /// `vm_swap_full()`, past which a page swapped in gives up its slot.
    pub fn half_full(&self) -> bool {
        u64::from(self.lock().map.inuse()) * PAGE_SIZE as u64 * 2 > self.max_bytes
    }

    pub fn stats(&self) -> SwapStats {
        let g = self.lock();
        SwapStats {
            slots_in_use: u64::from(g.map.inuse()),
            file_bytes: u64::from(g.map.nr_slots()) * PAGE_SIZE as u64,
            pages_written: self.pages_written.load(Ordering::Relaxed),
            objects_written: self.objects_written.load(Ordering::Relaxed),
            write_calls: self.write_calls.load(Ordering::Relaxed),
            pages_read: self.pages_read.load(Ordering::Relaxed),
            read_calls: self.read_calls.load(Ordering::Relaxed),
            checksum_failures: self.checksum_failures.load(Ordering::Relaxed),
            direct_io: self.direct_io,
            readahead: self.ahead.is_some(),
            readahead_blocks: self.ahead_ready.load(Ordering::Relaxed),
            readahead_hits: self.ahead_hits.load(Ordering::Relaxed),
        }
    }

    /// Bytes of the file in the page cache: part of the process's
    /// footprint that RSS does not show (near zero with `O_DIRECT`).
    /// `None` where the kernel lacks `cachestat`.
    pub fn page_cache_bytes(&self) -> Option<u64> {
        let len = self.file.metadata().map_or(0, |m| m.len());
        cached_pages(&self.file, len).map(|p| p * PAGE_SIZE as u64)
    }

    /// Bytes of in-memory bookkeeping (the checksum and write-clock tables,
    /// the slot bitmap).
    pub fn metadata_bytes(&self) -> usize {
        let g = self.lock();
        g.sums.capacity() * 4
            + g.refs.capacity() * 2
            + g.written_at.capacity() * 4
            + (g.map.nr_slots() as usize).div_ceil(8)
            + g.ahead.blocks.len() * PAGE_SIZE
    }

    /// Fault injection (`zmem bench soak`, tests): the next `n` writes fail
    /// with EIO, as a failing disk would, or with ENOSPC, as a full one.
    #[doc(hidden)]
    pub fn inject_write_errors(&self, n: u32, enospc: bool) {
        self.inject_enospc.store(enospc, Ordering::Relaxed);
        self.inject_eio.store(n, Ordering::Relaxed);
    }

    /// The file through a buffered descriptor of its own (any offset and
    /// length work), for fault-injection tests and the fuzz target.
    #[doc(hidden)]
    pub fn file(&self) -> &File {
        self.buffered.get_or_init(|| {
            use std::os::fd::AsRawFd;
            let path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .unwrap_or_else(|_| self.file.try_clone().expect("dup the swap file"))
        })
    }
}
