//! The page source of the pool: a mempool with a bulk page allocator.
//!
//! This is the user-space shape of the kernel's `mempool_t` with the bulk
//! page allocator that the dm-crypt series adds. A request for N pages runs,
//! in order:
//!
//! 1. a bulk allocation: pages freed earlier (resident first, then released
//!    ones), then fresh pages carved from large mmap'd arenas, as long as the
//!    pool stays under `max_pages`;
//! 2. the reserve of `min_nr` pages kept for exactly this moment, so that
//!    reclaim can make progress when nothing else can be had;
//! 3. a bounded wait (`wait_timeout`) for other users to free pages.
//!
//! What it could not get is reported ([`BulkAlloc::missing`]), never hidden.
//!
//! Freed pages refill the reserve first. Free pages above `high_watermark`
//! go back to the OS with `MADV_DONTNEED`, in sorted, coalesced batches of at
//! least [`RELEASE_BATCH`] pages: one DONTNEED costs ~12–25 µs on this VM
//! while another thread runs (a TLB shootdown), so never one page at a time,
//! and all of a batch's ranges in one `process_madvise`, one shootdown.
//!
//! # Accounting
//! [`Mempool::bytes_held`] counts every resident byte: pages handed out, free
//! resident pages, the reserve, and the bookkeeping vectors. Released pages
//! are address space only and are not counted.
//!
//! # Safety model
//! This file is the only `unsafe` of the crate. A [`Page`] owns one
//! page-aligned 4 KiB page of an arena exactly as a `Box` owns its value:
//! the allocator hands each page to one `Page` at a time, and takes it back
//! only by value. Arenas are unmapped only when no `Page` is outstanding
//! (otherwise they are leaked), so a `Page` never dangles.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};
use zmem_common::{unpoison, LockExt};

use thiserror::Error;

use zmem_common::PAGE_SIZE;
/// The smallest batch of pages released to the OS at once.
pub const RELEASE_BATCH: usize = 64;

/// One 4 KiB page of pool memory, owned exclusively (like a `Box<[u8; 4096]>`).
#[derive(Debug)]
pub struct Page {
    ptr: NonNull<u8>,
}

// SAFETY: a Page is the only handle to its 4 KiB (see the module's safety
// model), so moving it to another thread moves sole ownership, as for Box.
unsafe impl Send for Page {}
// SAFETY: &Page only gives out &[u8]; shared reads from several threads are fine.
unsafe impl Sync for Page {}

impl Page {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: 1. ptr is non-null, page-aligned and points to PAGE_SIZE
        // mapped, readable bytes of a live arena (arenas outlive every Page);
        // 2. no &mut to these bytes exists while &self is held, since only
        // this Page can hand one out and it needs &mut self to do so.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), PAGE_SIZE) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes this the only
        // reference to the page's bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), PAGE_SIZE) }
    }

    fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
}

/// Settings of a mempool.
#[derive(Debug, Clone)]
pub struct MempoolConfig {
    /// Pages held back for when nothing else can be allocated.
    pub min_nr: usize,
    /// Pages per arena mapping (2 MiB by default).
    pub arena_pages: usize,
    /// Free resident pages kept for reuse; more go back to the OS
    /// ([`Mempool::set_high_watermark`] changes it).
    pub high_watermark: usize,
    /// The most pages step 1 may have out at once (a memory limit); `None`
    /// for no limit other than mmap failing. The reserve comes on top.
    pub max_pages: Option<usize>,
    /// How long step 3 waits for pages to be freed.
    pub wait_timeout: Duration,
}

impl Default for MempoolConfig {
    fn default() -> Self {
        MempoolConfig {
            min_nr: 64,
            arena_pages: 512,
            high_watermark: 1024,
            max_pages: None,
            wait_timeout: Duration::from_millis(10),
        }
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MempoolError {
    #[error("invalid mempool configuration: {0}")]
    Config(#[from] zmem_common::ConfigError),
    #[error("mmap of a {bytes}-byte arena failed: {source}")]
    Mmap { bytes: usize, source: rustix::io::Errno },
}

/// The result of a bulk request: the pages obtained, and how many are missing.
#[derive(Debug)]
pub struct BulkAlloc {
    pub pages: Vec<Page>,
    pub requested: usize,
}

impl BulkAlloc {
    pub fn missing(&self) -> usize {
        self.requested - self.pages.len()
    }

    pub fn is_complete(&self) -> bool {
        self.missing() == 0
    }
}

/// A snapshot of the mempool's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MempoolStats {
    /// Pages handed out and not yet freed (reserve pages included).
    pub pages_in_use: usize,
    /// Free pages still resident, kept for reuse.
    pub pages_free: usize,
    /// Free pages given back to the OS (address space only).
    pub pages_released: usize,
    /// Pages in the reserve now.
    pub reserve_pages: usize,
    /// Pages ever carved from arenas.
    pub pages_mapped: usize,
    pub arenas: usize,
    /// Requests served partly or wholly from the reserve.
    pub reserve_allocs: u64,
    /// Requests that waited for freed pages.
    pub waits: u64,
    /// Requests that returned fewer pages than asked.
    pub partial_allocs: u64,
    /// System calls that released pages (`process_madvise`, or `madvise`
    /// where the kernel refuses the first), and the pages they released.
    pub release_calls: u64,
    pub pages_released_total: u64,
}

struct Arena {
    base: NonNull<u8>,
    pages: usize,
}

struct Inner {
    arenas: Vec<Arena>,
    /// Next uncarved page of the last arena.
    bump: usize,
    free: Vec<Page>,
    released: Vec<Page>,
    reserve: Vec<Page>,
    /// Pages out through step 1 (counted against max_pages).
    out_normal: usize,
    /// Pages out from the reserve.
    out_reserve: usize,
    stats: MempoolStats,
}

// SAFETY: Inner's raw pointers are arena bases, only used to carve pages and
// to munmap in Drop; all access is under the Mempool's mutex.
unsafe impl Send for Inner {}

/// A page source with a reserve, bulk allocation and batched release.
pub struct Mempool {
    cfg: MempoolConfig,
    inner: Mutex<Inner>,
    freed: Condvar,
    /// Free resident pages kept for reuse (the high watermark now).
    keep: AtomicUsize,
}

impl std::fmt::Debug for Mempool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mempool").field("cfg", &self.cfg).field("stats", &self.stats()).finish()
    }
}

impl Mempool {
    /// Creates the mempool and fills its reserve with `min_nr` resident pages.
    ///
    /// # Errors
    /// [`MempoolError::Config`] for a zero-page arena, or
    /// [`MempoolError::Mmap`] if the reserve cannot be mapped.
    pub fn new(cfg: MempoolConfig) -> Result<Mempool, MempoolError> {
        if cfg.arena_pages == 0 {
            return Err(zmem_common::ConfigError::out_of_range("arena_pages", cfg.arena_pages, "1..").into());
        }
        let pool = Mempool {
            inner: Mutex::new(Inner {
                arenas: Vec::new(),
                bump: 0,
                free: Vec::new(),
                released: Vec::new(),
                reserve: Vec::new(),
                out_normal: 0,
                out_reserve: 0,
                stats: MempoolStats::default(),
            }),
            freed: Condvar::new(),
            keep: AtomicUsize::new(cfg.high_watermark),
            cfg,
        };
        {
            let mut g = pool.lock();
            for _ in 0..pool.cfg.min_nr {
                let mut p = carve(&mut g, pool.cfg.arena_pages)?;
                // Fault it in now: the reserve must not need the OS later.
                p.as_mut_slice()[0] = 0;
                g.reserve.push(p);
            }
        }
        Ok(pool)
    }

    pub fn config(&self) -> &MempoolConfig {
        &self.cfg
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock_ok()
    }

    /// Keeps at most about `pages` free resident pages for reuse from now
    /// on (the rest go back to the OS at the next frees): a small memory
    /// limit should not pay for a large cache.
    pub fn set_high_watermark(&self, pages: usize) {
        self.keep.store(pages, Ordering::Relaxed);
    }

    /// The high watermark now.
    pub fn high_watermark(&self) -> usize {
        self.keep.load(Ordering::Relaxed)
    }

    /// One page, by the same steps as a bulk request of one.
    pub fn alloc_page(&self) -> Option<Page> {
        self.alloc_pages_bulk_array(1).pages.pop()
    }

    /// Up to `n` pages: bulk from the arenas, then the reserve, then a
    /// bounded wait. Never blocks longer than `wait_timeout` per round of
    /// waiting; returns what it got.
    pub fn alloc_pages_bulk_array(&self, n: usize) -> BulkAlloc {
        let mut pages = Vec::with_capacity(n);
        self.alloc_pages_bulk_cb(n, |p| pages.push(p));
        BulkAlloc { pages, requested: n }
    }

    /// As [`alloc_pages_bulk_array`](Self::alloc_pages_bulk_array), handing
    /// each page to `f` (called with the mempool's lock held: `f` MUST NOT
    /// call back into this mempool). Returns how many pages `f` received.
    pub fn alloc_pages_bulk_cb(&self, n: usize, mut f: impl FnMut(Page)) -> usize {
        let mut got = 0;
        let mut g = self.lock();
        let deadline = Instant::now() + self.cfg.wait_timeout;
        let mut waited = false;
        let mut from_reserve = false;
        loop {
            // 1. Bulk: recycled pages, then fresh ones, under max_pages.
            while got < n && self.cfg.max_pages.is_none_or(|m| g.out_normal < m) {
                let p = match g.free.pop().or_else(|| g.released.pop()) {
                    Some(p) => p,
                    None => match carve(&mut g, self.cfg.arena_pages) {
                        Ok(p) => p,
                        Err(_) => break, // out of address space or memory: try the reserve
                    },
                };
                g.out_normal += 1;
                f(p);
                got += 1;
            }
            // 2. The reserve.
            while got < n {
                let Some(p) = g.reserve.pop() else { break };
                g.out_reserve += 1;
                from_reserve = true;
                f(p);
                got += 1;
            }
            if got == n {
                break;
            }
            // 3. Wait for frees, bounded.
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            waited = true;
            g = unpoison(self.freed.wait_timeout(g, deadline - now)).0;
        }
        g.stats.reserve_allocs += u64::from(from_reserve);
        g.stats.waits += u64::from(waited);
        g.stats.partial_allocs += u64::from(got < n);
        got
    }

    /// Gives pages back: the reserve is refilled first, the rest kept for
    /// reuse, and free pages above the high watermark are released to the OS
    /// in batches.
    pub fn free_pages(&self, pages: impl IntoIterator<Item = Page>) {
        let mut to_release = Vec::new();
        {
            let mut g = self.lock();
            for p in pages {
                // Whether this page left through the reserve or not, the
                // reserve is refilled first (mempool_free), and the counters
                // of both routes are settled.
                if g.out_reserve > 0 {
                    g.out_reserve -= 1;
                } else {
                    g.out_normal -= 1;
                }
                if g.reserve.len() < self.cfg.min_nr {
                    g.reserve.push(p);
                } else {
                    g.free.push(p);
                }
            }
            let keep = self.keep.load(Ordering::Relaxed);
            if g.free.len() >= keep + RELEASE_BATCH {
                let n = g.free.len() - keep / 2;
                let at = g.free.len() - n;
                to_release = g.free.split_off(at);
            }
        }
        self.freed.notify_all();
        if !to_release.is_empty() {
            let calls = release(&mut to_release);
            let mut g = self.lock();
            g.stats.release_calls += calls;
            g.stats.pages_released_total += to_release.len() as u64;
            g.released.append(&mut to_release);
            drop(g);
            self.freed.notify_all();
        }
    }

    /// Gives every free page kept for reuse back to the OS now (the reserve
    /// stays): for a memory limit that has nothing else left to reclaim.
    /// Returns how many pages went.
    pub fn release_free(&self) -> usize {
        let mut to_release = {
            let mut g = self.lock();
            std::mem::take(&mut g.free)
        };
        let n = to_release.len();
        if n > 0 {
            let calls = release(&mut to_release);
            let mut g = self.lock();
            g.stats.release_calls += calls;
            g.stats.pages_released_total += n as u64;
            g.released.append(&mut to_release);
        }
        n
    }

    pub fn stats(&self) -> MempoolStats {
        let g = self.lock();
        MempoolStats {
            pages_in_use: g.out_normal + g.out_reserve,
            pages_free: g.free.len(),
            pages_released: g.released.len(),
            reserve_pages: g.reserve.len(),
            arenas: g.arenas.len(),
            ..g.stats
        }
    }

    /// Every resident byte this mempool accounts for: pages in use, free
    /// resident pages, the reserve, and its own bookkeeping.
    pub fn bytes_held(&self) -> usize {
        let g = self.lock();
        let pages = g.out_normal + g.out_reserve + g.free.len() + g.reserve.len();
        let meta = std::mem::size_of::<Page>() * (g.free.capacity() + g.released.capacity() + g.reserve.capacity())
            + std::mem::size_of::<Arena>() * g.arenas.capacity()
            + std::mem::size_of::<Mempool>();
        pages * PAGE_SIZE + meta
    }
}

/// A fresh page from the last arena, mapping a new arena when it is used up.
fn carve(g: &mut Inner, arena_pages: usize) -> Result<Page, MempoolError> {
    let need_new = match g.arenas.last() {
        Some(a) => g.bump == a.pages,
        None => true,
    };
    if need_new {
        let bytes = arena_pages * PAGE_SIZE;
        // Recorded as zmem's before a scan of the address space can see it.
        let _recording = zmem_common::host::owned::spawn_lock();
        // SAFETY: an anonymous private mapping at an address of the kernel's
        // choosing aliases nothing; the result is checked before use.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                bytes,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
            )
        }
        .map_err(|source| MempoolError::Mmap { bytes, source })?;
        let base =
            NonNull::new(base.cast::<u8>()).ok_or(MempoolError::Mmap { bytes, source: rustix::io::Errno::NOMEM })?;
        zmem_common::host::owned::add(base.as_ptr() as u64, bytes, zmem_common::host::owned::Kind::Zmem);
        g.arenas.push(Arena { base, pages: arena_pages });
        g.bump = 0;
    }
    let a = g.arenas.last().ok_or(MempoolError::Mmap { bytes: 0, source: rustix::io::Errno::NOMEM })?;
    // SAFETY: bump < a.pages, so the offset stays inside the arena mapping.
    let ptr = unsafe { a.base.add(g.bump * PAGE_SIZE) };
    g.bump += 1;
    g.stats.pages_mapped += 1;
    Ok(Page { ptr })
}

/// Linux's `PIDFD_SELF_THREAD_GROUP` (6.15): "this process", to a pidfd
/// call, with no descriptor to open, keep from the program or lose at fork.
const PIDFD_SELF: libc::c_int = -10001;
/// The most ranges one `process_madvise` takes (the kernel's `UIO_MAXIOV`).
const RANGES_PER_CALL: usize = 1024;
/// The kernel refused `MADV_DONTNEED` through `process_madvise` (before
/// 6.13 it takes only a few advices; before 6.15 it knows no
/// `PIDFD_SELF`): one `madvise` per range from then on.
static BATCH_REFUSED: AtomicBool = AtomicBool::new(false);

/// MADV_DONTNEED over `pages`, sorted and coalesced into contiguous ranges.
/// Returns the number of system calls.
///
/// Freed pool pages lie scattered (zspages come and go one by one), so a
/// batch is many ranges. Each `madvise` flushes the TLB of every CPU the
/// process runs on, an IPI to each: 64 ranges took 1.6 ms with another
/// thread of the process running, against 96 µs with none. One
/// `process_madvise` over all of them flushes once (Linux 6.16 batches
/// the flush across its ranges): 46 µs and 18 µs.
fn release(pages: &mut [Page]) -> u64 {
    pages.sort_unstable_by_key(Page::addr);
    let mut ranges: Vec<libc::iovec> = Vec::new();
    let mut i = 0;
    while i < pages.len() {
        let start = pages[i].addr();
        let mut j = i + 1;
        while j < pages.len() && pages[j].addr() == start + (j - i) * PAGE_SIZE {
            j += 1;
        }
        ranges.push(libc::iovec { iov_base: start as *mut libc::c_void, iov_len: (j - i) * PAGE_SIZE });
        i = j;
    }
    let mut calls = 0;
    for chunk in ranges.chunks(RANGES_PER_CALL) {
        if chunk.len() > 1 && !BATCH_REFUSED.load(Ordering::Relaxed) {
            calls += 1;
            let bytes: usize = chunk.iter().map(|r| r.iov_len).sum();
            // SAFETY: every range is free pages that this function holds by
            // value (no other reference to their bytes exists), and `chunk`
            // outlives the call, which only reads it. DONTNEED on private
            // anonymous memory only drops their contents, which a later
            // user overwrites or reads as zeros.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_process_madvise,
                    PIDFD_SELF,
                    chunk.as_ptr(),
                    chunk.len(),
                    libc::MADV_DONTNEED,
                    0,
                )
            };
            if r >= 0 && r as usize == bytes {
                continue;
            }
            // Refused (EINVAL, EBADF, ENOSYS, EPERM from a filter): by
            // range from now on. A short count (a range it would not take)
            // is only this batch: its ranges get a call each below, which
            // costs nothing where a page is released already.
            if r < 0 {
                BATCH_REFUSED.store(true, Ordering::Relaxed);
            }
        }
        for r in chunk {
            // SAFETY: as above, one range.
            let rc = unsafe { rustix::mm::madvise(r.iov_base, r.iov_len, rustix::mm::Advice::LinuxDontNeed) };
            // A failed DONTNEED leaves the pages resident, which is only a
            // missed saving; they stay usable.
            let _ = rc;
            calls += 1;
        }
    }
    calls
}

impl Drop for Mempool {
    fn drop(&mut self) {
        let g = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        if g.out_normal + g.out_reserve != 0 {
            // Pages are still out: leak the arenas rather than let them dangle.
            return;
        }
        g.free.clear();
        g.released.clear();
        g.reserve.clear();
        for a in g.arenas.drain(..) {
            // SAFETY: every page of this arena has come back (none is out),
            // and the free lists holding them were just cleared, so nothing
            // refers to the mapping any more; base/len are the mmap's own.
            let r = unsafe { rustix::mm::munmap(a.base.as_ptr().cast(), a.pages * PAGE_SIZE) };
            debug_assert!(r.is_ok(), "munmap of a mempool arena failed: {r:?}");
            zmem_common::host::owned::remove(a.base.as_ptr() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn pool(min_nr: usize, max: Option<usize>, wait_ms: u64) -> Mempool {
        Mempool::new(MempoolConfig {
            min_nr,
            arena_pages: 16,
            high_watermark: 8,
            max_pages: max,
            wait_timeout: Duration::from_millis(wait_ms),
        })
        .unwrap()
    }

    #[test]
    fn bulk_then_reserve_then_partial() {
        let mp = pool(4, Some(10), 5);
        let a = mp.alloc_pages_bulk_array(12);
        assert!(a.is_complete(), "10 normal + 2 reserve");
        assert_eq!(mp.stats().reserve_pages, 2);
        let b = mp.alloc_pages_bulk_array(5);
        assert_eq!(b.pages.len(), 2, "the rest of the reserve, then a timed-out wait");
        assert_eq!(b.missing(), 3);
        let s = mp.stats();
        assert_eq!((s.partial_allocs, s.waits, s.pages_in_use), (1, 1, 14));
        mp.free_pages(a.pages);
        mp.free_pages(b.pages);
        let s = mp.stats();
        assert_eq!((s.pages_in_use, s.reserve_pages), (0, 4));
    }

    #[test]
    fn pages_are_distinct_and_writable() {
        let mp = pool(2, None, 1);
        let mut a = mp.alloc_pages_bulk_array(100).pages;
        for (i, p) in a.iter_mut().enumerate() {
            p.as_mut_slice().fill(i as u8);
        }
        for (i, p) in a.iter().enumerate() {
            assert!(p.as_slice().iter().all(|&b| b == i as u8));
        }
        mp.free_pages(a);
    }

    #[test]
    fn release_is_batched_and_accounted() {
        let mp = pool(0, None, 1);
        let a = mp.alloc_pages_bulk_array(200).pages;
        let held = mp.bytes_held();
        assert!(held >= 200 * PAGE_SIZE);
        mp.free_pages(a);
        let s = mp.stats();
        assert!(s.pages_released_total >= RELEASE_BATCH as u64, "{s:?}");
        // Arenas of 16 pages, sorted and coalesced: far fewer calls than pages.
        assert!(s.release_calls * 8 <= s.pages_released_total, "{s:?}");
        assert!(mp.bytes_held() < held);
        assert_eq!(s.pages_free + s.pages_released, 200);
    }

    /// Freed pool pages lie scattered: a batch of them is many ranges, and
    /// goes in one system call (one TLB shootdown), unless the kernel
    /// refuses `process_madvise` for it. Every range is released all the
    /// same: its bytes read back as zeros.
    #[test]
    fn scattered_pages_are_released_in_one_call_and_read_as_zeros() {
        let mp = pool(0, None, 1);
        let a = mp.alloc_pages_bulk_array(200).pages;
        let (mut odd, mut even) = (Vec::new(), Vec::new());
        for (i, mut p) in a.into_iter().enumerate() {
            p.as_mut_slice().fill(0xAB);
            if i % 2 == 1 {
                odd.push(p)
            } else {
                even.push(p)
            }
        }
        let addrs: Vec<usize> = odd.iter().map(Page::addr).collect();
        mp.free_pages(odd);
        let s = mp.stats();
        let ranges = s.pages_released_total;
        assert!(ranges >= RELEASE_BATCH as u64, "{s:?}");
        // 6.15 has PIDFD_SELF, and lets a process give itself any advice.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut v = release.split(|c: char| !c.is_ascii_digit()).filter_map(|x| x.parse::<u32>().ok());
        let batches = (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (6, 15);
        if !batches && BATCH_REFUSED.load(Ordering::Relaxed) {
            assert_eq!(s.release_calls, ranges, "one madvise per range: {s:?}");
        } else {
            assert_eq!(s.release_calls, 1, "{ranges} ranges in one process_madvise: {s:?}");
        }
        let zeroed = addrs
            .iter()
            .filter(|&&a| {
                // SAFETY: a page of an arena of `mp`, which is alive (arenas
                // are unmapped only when it drops); free or released, so no
                // `Page` is handed out for it and nothing writes it now.
                let bytes = unsafe { std::slice::from_raw_parts(a as *const u8, PAGE_SIZE) };
                bytes.iter().all(|&b| b == 0)
            })
            .count();
        assert_eq!(zeroed as u64, s.pages_released_total, "{s:?}");
        assert_eq!(zeroed + s.pages_free, addrs.len());
        mp.free_pages(even);
    }

    #[test]
    fn the_free_pages_kept_follow_the_watermark_and_can_all_be_released() {
        let mp = pool(4, None, 1);
        let a = mp.alloc_pages_bulk_array(300).pages;
        mp.set_high_watermark(200);
        mp.free_pages(a);
        let s = mp.stats();
        // 300 freed, 200 + a batch kept at most: released down to half of 200.
        assert_eq!((s.pages_free, s.reserve_pages), (100, 4), "{s:?}");
        let b = mp.alloc_pages_bulk_array(150).pages;
        assert_eq!(mp.stats().pages_in_use, 150, "100 reused and 50 new");
        mp.set_high_watermark(8);
        mp.free_pages(b);
        assert_eq!(mp.stats().pages_free, 4);
        assert_eq!(mp.release_free(), 4, "the free pages go, the reserve stays");
        let s = mp.stats();
        assert_eq!((s.pages_free, s.reserve_pages), (0, 4), "{s:?}");
        assert_eq!(mp.release_free(), 0);
    }

    #[test]
    fn exhausted_reserve_waits_for_a_free_and_succeeds() {
        let mp = Arc::new(pool(2, Some(4), 2000));
        let held = mp.alloc_pages_bulk_array(6).pages;
        assert_eq!(held.len(), 6);
        let mp2 = Arc::clone(&mp);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            mp2.free_pages(held);
        });
        let start = Instant::now();
        let got = mp.alloc_pages_bulk_array(3);
        assert!(got.is_complete(), "a free during the wait must satisfy it");
        assert!(start.elapsed() < Duration::from_millis(1500));
        t.join().unwrap();
        mp.free_pages(got.pages);
    }
}
