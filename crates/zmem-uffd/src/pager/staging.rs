//! The staging area: where reclaim MOVEs a batch of folios out of the
//! program, to store them. Registered with the pager's userfaultfd
//! (`UFFDIO_MOVE` wants its destination registered there), for missing
//! faults only ([`MODE`]). It keeps track
//! of which of its pages MOVE filled: only those may be read, because a
//! hole in a registered range is a MISSING fault that the handler must
//! serve, and reclaim may hold a lock the handler waits for.
//!
//! `UFFDIO_MOVE` also wants both mappings' protections equal (EINVAL
//! otherwise), and some programs' memory is executable too: SBCL's whole
//! heap is read, write and execute. So the slots have a second home, the
//! same size and also executable, mapped at the first such region's
//! eviction; each span of slots is placed in one or the other
//! ([`Staging::place`]).
//!
//! Freeing the area is a `MADV_DONTNEED`, and so a TLB shootdown into
//! every CPU the program runs on. So the area holds several passes (up to
//! `STAGING_BYTES`): each pass takes the slots after the last one's, and
//! the area is freed once the next pass might not fit
//! ([`Staging::make_room`]), or when reclaim stops for now
//! ([`Staging::release`]), so no stale copy outlives a burst of reclaim.

use crate::mapping::Mapping;
use crate::pagemap::{PageMap, SharedPages};
use crate::sys::{RegisterMode, Uffd, UffdError};
use zmem_common::PAGE_SIZE;

/// The most bytes the staging area holds: as many passes as fit, each
/// pass's slots after the last's, freed together. 2 MiB is four passes of
/// 64 KiB folios, and at most 2 MiB of stale copies between two frees.
const STAGING_BYTES: usize = 2 << 20;

/// How the area is registered: missing faults only, even where the regions
/// are write-protect tracked. A MOVE needs both mappings' page protections
/// equal, and WP registration changes that only for a shared mapping (the
/// kernel's `userfaultfd_set_vm_flags`); regions and staging are private.
/// Without WP, unregistering the area before each free does not walk its
/// 512 present PTEs to clear their uffd-wp bits and flush the TLB
/// (`userfaultfd_clear_vma`): 52 µs against 1 µs per 2 MiB here, and 8% of
/// the reclaim thread's time in `zmem usemem`.
const MODE: RegisterMode = RegisterMode { missing: true, wp: false };

#[derive(Debug)]
pub(super) struct Staging {
    map: Mapping,
    /// The executable twin of `map`, once a region needed it.
    exec: Option<Mapping>,
    /// Slot `s` is in `exec` since the last `free`.
    in_exec: Vec<bool>,
    /// `exec` could not be made: it is not tried again.
    exec_refused: bool,
    folio: usize,
    /// Slots a pass may use.
    pass_slots: usize,
    /// The first slot no pass has used since the last `free`.
    next: usize,
    /// Page `i` of the area was filled by MOVE since the last `free`.
    filled: Vec<bool>,
    /// For [`occupied`](Self::occupied); `None` where `/proc/self/pagemap`
    /// cannot be opened.
    pagemap: Option<PageMap>,
}

impl Staging {
    /// Room for passes of `pass_slots` folios of `folio` bytes (as many
    /// passes as fit in `STAGING_BYTES`, at least one), registered with
    /// `uffd`.
    pub(super) fn new(uffd: &Uffd, folio: usize, pass_slots: usize) -> Result<Staging, super::PagerError> {
        let passes = (STAGING_BYTES / (folio * pass_slots).max(1)).max(1);
        let slots = pass_slots * passes;
        let map = Mapping::new(folio * slots).map_err(super::PagerError::Map)?;
        // A child never reclaims: it need not copy staging.
        map.dont_fork().map_err(super::PagerError::Map)?;
        uffd.register(map.addr(), map.len() as u64, MODE)?;
        let pagemap = PageMap::open().map_err(|e| log::warn!("{e}: reclaim trusts UFFDIO_MOVE's byte counts")).ok();
        Ok(Staging {
            filled: vec![false; map.len() / PAGE_SIZE],
            in_exec: vec![false; slots],
            exec: None,
            exec_refused: false,
            map,
            folio,
            pass_slots,
            next: 0,
            pagemap,
        })
    }

    /// Makes room for the next pass (`pass_slots` slots from
    /// [`next_slot`](Self::next_slot)): frees the area if they do not fit.
    /// Returns whether it freed it.
    ///
    /// # Errors
    /// As [`free`](Self::free).
    pub(super) fn make_room(&mut self, uffd: &Uffd) -> Result<bool, UffdError> {
        let full = self.next + self.pass_slots > self.in_exec.len();
        if full {
            self.free(uffd)?;
        }
        Ok(full)
    }

    /// The first slot no pass has used since the last free.
    pub(super) fn next_slot(&self) -> usize {
        self.next
    }

    /// The pass that began at [`next_slot`](Self::next_slot) used the
    /// slots up to `end`: they stay as they are until the area is freed.
    pub(super) fn end_pass(&mut self, end: usize) {
        debug_assert!(end >= self.next && end <= self.in_exec.len());
        self.next = end;
    }

    /// Frees the area if a pass used it since the last free (and says
    /// whether it did): reclaim is done for now, and the stale copies go
    /// back to the OS.
    ///
    /// # Errors
    /// As [`free`](Self::free).
    pub(super) fn release(&mut self, uffd: &Uffd) -> Result<bool, UffdError> {
        let used = self.next > 0;
        if used {
            self.free(uffd)?;
        }
        Ok(used)
    }

    /// Puts slots `[slot, slot + n)` in the executable twin (`exec`) or in
    /// the plain area, for the next MOVEs into them; maps and registers
    /// the twin the first time. False where the twin cannot be made (a
    /// policy that forbids writable executable memory): the slots stay
    /// where they were.
    pub(super) fn place(&mut self, uffd: &Uffd, slot: usize, n: usize, exec: bool) -> bool {
        if exec && self.exec.is_none() {
            if self.exec_refused {
                return false;
            }
            let made = Mapping::new(self.map.len()).and_then(|m| {
                m.dont_fork()?;
                m.make_executable()?;
                Ok(m)
            });
            let registered =
                made.map_err(|e| e.to_string()).and_then(|m| match uffd.register(m.addr(), m.len() as u64, MODE) {
                    Ok(_) => Ok(m),
                    Err(e) => Err(e.to_string()),
                });
            match registered {
                Ok(m) => self.exec = Some(m),
                Err(e) => {
                    self.exec_refused = true;
                    log::warn!("an executable staging area cannot be made ({e}): executable memory stays resident");
                    return false;
                }
            }
        }
        debug_assert!(self.filled[slot * self.folio / PAGE_SIZE..(slot + n) * self.folio / PAGE_SIZE]
            .iter()
            .all(|&x| !x));
        self.in_exec[slot..slot + n].fill(exec);
        true
    }

    /// Whether slot `slot` is in the executable twin.
    pub(super) fn is_exec(&self, slot: usize) -> bool {
        self.in_exec[slot]
    }

    /// Which of the `n` pages from `addr` (anywhere) hold a page now, or
    /// `None` if the page tables cannot be read.
    /// Whether any of the `n` pages from `addr` is shared with another
    /// process; `None` if the page tables cannot be read.
    pub(super) fn shared_pages(&self, addr: u64, n: usize) -> Option<SharedPages> {
        self.pagemap.as_ref()?.shared_pages(addr, n).map_err(|e| log::warn!("{e}")).ok()
    }

    pub(super) fn mapped(&self, addr: u64, n: usize) -> Option<Vec<bool>> {
        self.pagemap.as_ref()?.mapped(addr, n).map_err(|e| log::warn!("{e}")).ok()
    }

    /// Which pages of slots `[slot, slot + n)` hold a page now, from the
    /// page tables (one `pread` of `/proc/self/pagemap`); `None` if they
    /// cannot be read.
    pub(super) fn occupied(&self, slot: usize, n: usize) -> Option<Vec<bool>> {
        self.mapped(self.slot_addr(slot), n * self.folio / PAGE_SIZE)
    }

    /// Where slot `slot` starts.
    pub(super) fn slot_addr(&self, slot: usize) -> u64 {
        let map = match &self.exec {
            Some(x) if self.in_exec[slot] => x,
            _ => &self.map,
        };
        map.addr() + (slot * self.folio) as u64
    }

    /// Records the pages of `slot` that MOVE filled.
    pub(super) fn mark(&mut self, slot: usize, present: &[bool]) {
        let ppf = self.folio / PAGE_SIZE;
        for (p, &x) in present.iter().enumerate() {
            self.filled[slot * ppf + p] |= x;
        }
    }

    /// Pages `[p, p + n)` of slot `slot`: they MUST have been filled.
    ///
    /// # Panics
    /// On a page MOVE did not fill (reading it would fault).
    pub(super) fn run(&self, slot: usize, p: usize, n: usize) -> &[u8] {
        let first = slot * self.folio / PAGE_SIZE + p;
        assert!(self.filled[first..first + n].iter().all(|&x| x), "a staging page MOVE did not fill");
        let addr = self.slot_addr(slot) as usize + p * PAGE_SIZE;
        // SAFETY: 1. [addr, addr + n pages) lies in our mapping and every
        // page of it was filled by MOVE (checked above), so reading it
        // faults nothing; 2. only the reclaim thread, which owns this
        // Staging, touches the area, and `free` (which changes it) takes
        // `&mut self`, so no borrow from here outlives the contents.
        unsafe { std::slice::from_raw_parts(addr as *const u8, n * PAGE_SIZE) }
    }

    /// Frees the area's pages (all of it: a page MOVE left in a slot that
    /// was not counted would fail every later MOVE there). A DONTNEED of a registered
    /// range raises a REMOVE event, and until it is read every COPY fails
    /// with EAGAIN: back to back, reclaim batches would starve faults. So
    /// the area is unregistered around it (three cheap syscalls: see [`MODE`]).
    ///
    /// # Errors
    /// Registering the area again failed: reclaim cannot go on.
    fn free(&mut self, uffd: &Uffd) -> Result<(), UffdError> {
        let used_exec = self.in_exec.contains(&true);
        for m in std::iter::once(&self.map).chain(self.exec.as_ref().filter(|_| used_exec)) {
            let (a, l) = (m.addr(), m.len() as u64);
            let _ = uffd.unregister(a, l);
            let _ = m.dontneed(0, m.len());
            uffd.register(a, l, MODE)?;
        }
        self.filled.fill(false);
        self.in_exec.fill(false);
        self.next = 0;
        Ok(())
    }

    /// Unregisters the area (before it is unmapped at the pager's end: an
    /// UNMAP event would wait for a handler that may be gone).
    pub(super) fn unregister(&self, uffd: &Uffd) {
        for m in std::iter::once(&self.map).chain(&self.exec) {
            let _ = uffd.unregister(m.addr(), m.len() as u64);
        }
    }
}
