//! `/proc/self/pagemap`: write tracking with `PAGEMAP_SCAN` (Linux 6.7),
//! which pages of a range were written since the last scan; and plain
//! reads of page-table entries, which pages of a range are mapped.

use std::os::fd::AsFd;
use std::os::fd::OwnedFd;

use linux_raw_sys::general as uapi;
use rustix::io::Errno;
use rustix::ioctl::Opcode;

use crate::sys::{call, UffdError};
use zmem_common::PAGE_SIZE;

/// `PAGEMAP_SCAN`: `_IOWR('f', 16, struct pm_scan_arg)`.
pub const PAGEMAP_SCAN: Opcode = 0xC060_6610;

/// Page-table entries read from `/proc/self/pagemap`, one `u64` per page.
#[derive(Debug)]
pub struct PageMap {
    fd: zmem_common::host::fds::KeptFd,
}

/// Pagemap entry bits: the page is present, or swapped out by the kernel.
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAP: u64 = 1 << 62;
/// The page is mapped by this process only (its map count is one).
const PM_MMAP_EXCLUSIVE: u64 = 1 << 56;

/// What [`PageMap::shared_pages`] counts in a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SharedPages {
    /// Present pages another process maps too (not the zero page).
    pub shared: usize,
    /// Present pages (not the zero page).
    pub present: usize,
}

impl SharedPages {
    /// At least half of the present pages are shared: evicting them would
    /// free little (the other process keeps them).
    pub fn mostly_shared(&self) -> bool {
        self.shared > 0 && self.shared * 2 >= self.present
    }
}

impl PageMap {
    /// # Errors
    /// opening `/proc/self/pagemap`.
    pub fn open() -> Result<PageMap, UffdError> {
        Ok(PageMap { fd: open_pagemap()? })
    }

    /// Whether each of the `n` pages from `addr` holds a page: present, or
    /// swapped out by the kernel (not a hole, and not a uffd-wp marker).
    /// One `pread`.
    ///
    /// # Errors
    /// The read's error (a short read counts as EIO).
    pub fn mapped(&self, addr: u64, n: usize) -> Result<Vec<bool>, UffdError> {
        Ok(self.entries(addr, n)?.into_iter().map(|e| e & (PM_PRESENT | PM_SWAP) != 0).collect())
    }

    /// How many of the `n` pages from `addr` are present and mapped by
    /// another process too (a fork left them shared), out of how many are
    /// present. One `pread`, and a `PAGEMAP_SCAN` if any is not exclusive.
    ///
    /// # Errors
    /// As [`mapped`](Self::mapped).
    /// The shared zero page (a read of a never-written page) counts in
    /// neither: it is mapped by everyone and costs nothing, and pagemap
    /// shows it present and not exclusive, as a shared page.
    pub fn shared_pages(&self, addr: u64, n: usize) -> Result<SharedPages, UffdError> {
        Ok(self.shared_per(addr, n, n.max(1))?.pop().unwrap_or(SharedPages { shared: 0, present: 0 }))
    }

    /// [`shared_pages`](Self::shared_pages) for each group of `per` pages
    /// (the last may be shorter) of the `n` from `addr`, in as many
    /// syscalls as for one.
    ///
    /// # Errors
    /// As [`mapped`](Self::mapped).
    pub fn shared_per(&self, addr: u64, n: usize, per: usize) -> Result<Vec<SharedPages>, UffdError> {
        let e = self.entries(addr, n)?;
        let candidate = |i: usize| e[i] & PM_PRESENT != 0 && e[i] & PM_MMAP_EXCLUSIVE == 0;
        let zero = if (0..n).any(candidate) { Some(self.zero_pages(addr, n)?) } else { None };
        let is_zero = |i: usize| zero.as_ref().is_some_and(|z| z[i]);
        Ok((0..n)
            .step_by(per.max(1))
            .map(|g| {
                let pages = g..(g + per.max(1)).min(n);
                let present = pages.clone().filter(|&i| e[i] & PM_PRESENT != 0 && !is_zero(i)).count();
                let shared = pages.filter(|&i| candidate(i) && !is_zero(i)).count();
                SharedPages { shared, present }
            })
            .collect())
    }

    /// Which of the `n` pages from `addr` map the shared zero page
    /// (`PAGEMAP_SCAN`, `PAGE_IS_PFNZERO`).
    fn zero_pages(&self, addr: u64, n: usize) -> Result<Vec<bool>, UffdError> {
        let end = addr + (n * PAGE_SIZE) as u64;
        let mut zero = vec![false; n];
        let mut buf = vec![uapi::page_region { start: 0, end: 0, categories: 0 }; 32];
        let categories = uapi::PAGE_IS_PFNZERO | uapi::PAGE_IS_PRESENT;
        let scan = Scan { flags: 0, categories, returned: uapi::PAGE_IS_PFNZERO, max_pages: 0 };
        // SAFETY: without WP flags PAGEMAP_SCAN only reads page tables.
        unsafe {
            pm_scan(&self.fd, &mut buf, addr..end, scan, &mut |a, b| {
                let (a, b) = ((a.max(addr) - addr) as usize / PAGE_SIZE, (b.min(end) - addr) as usize / PAGE_SIZE);
                zero[a..b].iter_mut().for_each(|z| *z = true);
            })
        }?;
        Ok(zero)
    }

    fn entries(&self, addr: u64, n: usize) -> Result<Vec<u64>, UffdError> {
        let mut raw = vec![0u8; n * 8];
        let at = addr / PAGE_SIZE as u64 * 8;
        let err = |errno| UffdError::Ioctl { op: "pread /proc/self/pagemap", addr, len: (n * PAGE_SIZE) as u64, errno };
        let got = rustix::io::pread(&self.fd, &mut raw, at).map_err(err)?;
        if got != raw.len() {
            return Err(err(Errno::IO));
        }
        Ok(raw.chunks_exact(8).map(|e| u64::from_ne_bytes(e.try_into().expect("8 bytes"))).collect())
    }
}

fn open_pagemap() -> Result<zmem_common::host::fds::KeptFd, UffdError> {
    use rustix::fs::{Mode, OFlags};
    zmem_common::host::fds::open_kept(zmem_common::host::fds::Wait::Yes, Errno::AGAIN, || {
        rustix::fs::open("/proc/thread-self/pagemap", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
    })
    .map_err(|e| UffdError::Ioctl { op: "open /proc/self/pagemap", addr: 0, len: 0, errno: e })
}

/// Write tracking through `PAGEMAP_SCAN` on `/proc/self/pagemap`, for ranges
/// registered in WP mode on a uffd with `WP_ASYNC`: the kernel resolves a
/// write to a write-protected page by itself (no message). A scan either
/// protects again the pages written since they were last protected,
/// atomically ([`WriteTracker::protect_written`]), or only looks
/// ([`WriteTracker::written`]).
#[derive(Debug)]
pub struct WriteTracker {
    pagemap: zmem_common::host::fds::KeptFd,
    /// A look's answer: the first written range.
    buf: [uapi::page_region; 1],
    /// A sweep's list (see `protect_written`).
    sweep_buf: Vec<uapi::page_region>,
}

impl WriteTracker {
    /// # Errors
    /// opening `/proc/self/pagemap`.
    pub fn open() -> Result<WriteTracker, UffdError> {
        let pagemap = open_pagemap()?;
        let empty = uapi::page_region { start: 0, end: 0, categories: 0 };
        Ok(WriteTracker { pagemap, buf: [empty], sweep_buf: vec![empty; 512] })
    }

    /// Write-protects again the pages of `[start, end)` written since they
    /// were last protected, atomically, for a range that may span several
    /// regions and other mappings (those not registered for WP_ASYNC are
    /// skipped). Present pages only: a scan that matched holes would put
    /// uffd-wp markers in them, which turn their MISSING faults into
    /// write-protect faults. One TLB flush for each
    /// 2 MiB page table in which a page was protected.
    ///
    /// Not `UFFDIO_WRITEPROTECT`: with WP_ASYNC (which brings
    /// WP_UNPOPULATED with it) it plants uffd-wp markers in every hole of
    /// the range, evicted pages included (and, most likely, page tables to
    /// hold them: over ten minutes of system time over LuaJIT's 128 GiB
    /// reservation).
    ///
    /// It asks for the list of what it protected, though nothing reads it:
    /// without a list (`vec` null) the kernel takes its fast path for
    /// exclusive write-protection, which ignores the categories and plants
    /// markers in the holes too (6.18's `pagemap_scan_pmd_entry`).
    ///
    /// # Errors
    /// The ioctl's error.
    pub fn protect_written(&mut self, start: u64, end: u64) -> Result<(), UffdError> {
        let flags = uapi::PM_SCAN_WP_MATCHING;
        let categories = uapi::PAGE_IS_WRITTEN | uapi::PAGE_IS_PRESENT;
        let scan = Scan { flags, categories, returned: uapi::PAGE_IS_WRITTEN, max_pages: 0 };
        // SAFETY: the scan's only effect besides reading page tables is
        // write-protecting present pages of [start, end) registered with
        // WP_ASYNC (others are skipped: no PM_SCAN_CHECK_WPASYNC), which
        // the uffd then unprotects on write by itself.
        unsafe { pm_scan(&self.pagemap, &mut self.sweep_buf, start..end, scan, &mut |_, _| {}) }
    }

    /// Whether any page of `[start, end)` was written since it was last
    /// write-protected ([`WriteTracker::protect_written`]). Only a look: no page table
    /// changes, so no TLB flush. The walk ends at the first written page,
    /// and the kernel's copy of the answer is one entry: a list of 512 is a
    /// 12 KiB allocation in every call, and reclaim makes one call a look.
    ///
    /// # Errors
    /// The ioctl's error (EPERM if the range is not WP_ASYNC-registered).
    pub fn written(&mut self, start: u64, end: u64) -> Result<bool, UffdError> {
        let flags = uapi::PM_SCAN_CHECK_WPASYNC;
        let categories = uapi::PAGE_IS_WRITTEN | uapi::PAGE_IS_PRESENT;
        let scan = Scan { flags, categories, returned: uapi::PAGE_IS_WRITTEN, max_pages: 1 };
        let mut any = false;
        // SAFETY: without PM_SCAN_WP_MATCHING the scan only reads page
        // tables.
        unsafe { pm_scan(&self.pagemap, &mut self.buf, start..end, scan, &mut |_, _| any = true) }?;
        Ok(any)
    }

    fn err(addr: u64, len: u64) -> impl Fn(Errno) -> UffdError {
        move |errno| UffdError::Ioctl { op: "PAGEMAP_SCAN", addr, len, errno }
    }
}

/// What a `PAGEMAP_SCAN` asks for: its flags, the categories a page must
/// have, those reported, and how many pages to find at most (0: all).
#[derive(Debug, Clone, Copy)]
struct Scan {
    flags: u32,
    categories: u32,
    returned: u32,
    max_pages: u64,
}

/// `PAGEMAP_SCAN` over `range` of `/proc/self/pagemap` (`fd`), in as many
/// calls as `buf` needs, or until `scan.max_pages` pages were found; `f`
/// gets each matching range.
///
/// # Safety
/// With `flags` that write-protect, the caller answers for what that does
/// to the range (see [`WriteTracker`]).
unsafe fn pm_scan(
    fd: &OwnedFd,
    buf: &mut [uapi::page_region],
    range: std::ops::Range<u64>,
    scan: Scan,
    f: &mut dyn FnMut(u64, u64),
) -> Result<(), UffdError> {
    let (mut at, end) = (range.start, range.end);
    while at < end {
        let mut a = uapi::pm_scan_arg {
            size: std::mem::size_of::<uapi::pm_scan_arg>() as u64,
            flags: u64::from(scan.flags),
            start: at,
            end,
            walk_end: 0,
            vec: buf.as_mut_ptr() as u64,
            vec_len: buf.len() as u64,
            max_pages: scan.max_pages,
            category_inverted: 0,
            category_mask: u64::from(scan.categories),
            category_anyof_mask: 0,
            return_mask: u64::from(scan.returned),
        };
        // SAFETY: PAGEMAP_SCAN reads one pm_scan_arg and writes it back
        // (walk_end), and writes at most vec_len page_regions into buf,
        // which outlives the call; what else it does to page tables is the
        // caller's contract.
        let r = unsafe { call::<PAGEMAP_SCAN, _>(fd.as_fd(), &mut a) };
        // The ioctl returns the number of regions filled, which rustix's
        // Updater discards: the buffer is zeroed after use, so the filled
        // regions are the non-empty prefix.
        r.map_err(WriteTracker::err(at, end - at))?;
        let mut found = 0;
        for reg in buf.iter_mut().take_while(|r| r.end > r.start) {
            f(reg.start, reg.end);
            found += (reg.end - reg.start) / PAGE_SIZE as u64;
            *reg = uapi::page_region { start: 0, end: 0, categories: 0 };
        }
        if scan.max_pages != 0 && found >= scan.max_pages {
            break;
        }
        if a.walk_end >= end || a.walk_end <= at {
            break;
        }
        at = a.walk_end;
    }
    Ok(())
}
