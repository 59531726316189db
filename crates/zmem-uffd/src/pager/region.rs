//! Regions: managed memory handed out by [`Pager::map`], and their folio
//! tables.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use zmem_common::{unpoison, LockExt, RwLockExt};

use super::{Folio, Inner, Pager, PagerError};
use crate::mapping::Mapping;
use crate::sys::{Uffd, UffdError};
use zmem_common::PAGE_SIZE;

/// The folio locks of a pager, striped by region and folio.
pub(super) const STRIPES: usize = 256;

/// A region's bookkeeping: `FOLIO_TABLE_BYTES` per folio.
#[derive(Debug)]
pub(super) struct RegionState {
    pub(super) id: u32,
    /// The tier key of page 0: `id << 40`, or for a region split off by a
    /// partial mremap the key of the page it came from, so that its pages'
    /// entries stay where they are (`events.rs`, `split_moved`).
    pub(super) key_base: u64,
    pub(super) start: AtomicU64,
    pub(super) mapping: Mutex<Option<Mapping>>,
    /// Ranges (offsets in the region) the program unmapped itself: the
    /// kernel may have handed their addresses to another mapping since, so
    /// the region's own unmap must leave them alone.
    pub(super) unmapped: Mutex<Vec<(usize, usize)>>,
    /// The parts of `unmapped` that a partial mremap moved elsewhere (to a
    /// region split off): the kernel's UNMAP of the old range that follows
    /// the REMAP must not drop their entries, which serve the pages where
    /// they went.
    pub(super) moved: Mutex<Vec<(usize, usize)>>,
    /// `unmapped` is not empty (read without its lock on the fault path).
    pub(super) has_holes: AtomicBool,
    /// Adopted: a mapping the program made, registered by the pager (see
    /// `adopt.rs`). It is the program's to unmap; the pager forgets the
    /// region once all of it is unmapped.
    pub(super) adopted: bool,
    /// Its mapping is executable too (SBCL's heap), so reclaim MOVEs its
    /// pages into the executable staging slots (`staging.rs`). Learned
    /// from the first MOVE the plain slots refused.
    pub(super) exec: AtomicBool,
    pub(super) len: usize,
    /// Bytes registered past `len` that belong to no region: an adopted
    /// mapping's tail shorter than a folio (`adopt.rs`). Faults there are
    /// stray ones; `uaccess.rs` looks at its pages with mincore.
    pub(super) tail: AtomicUsize,
    pub(super) state: Box<[AtomicU8]>,
    pub(super) referenced: Box<[AtomicBool]>,
    /// The folio has an entry in the CLOCK queue (at most one, so the hand
    /// passes each folio once per sweep).
    pub(super) queued: Box<[AtomicBool]>,
    /// The folio was loaded and its pages' pool entries kept as clean
    /// copies (`Tier::retain_clean`): its next eviction stores with
    /// `store_reusing`. A hint only: the tier compares the bytes.
    pub(super) cached: Box<[AtomicBool]>,
    /// Some page of the folio is poisoned (it failed to load). The folio is
    /// never evicted again: a poison marker does not move, and the folio
    /// would come back with zeros there. It leaves the lists until the
    /// program drops it whole.
    pub(super) poisoned: Box<[AtomicBool]>,
    /// Pages of a Resident folio that a partial load left in the tier (bit
    /// `i`: page `i` of the folio), as a PTE holding a swap entry: not
    /// mapped, their entries the only copy. A fault on one loads it
    /// (`Inner::load_pages`, `PagerConfig::fault_around`). Zero for a folio in any other state;
    /// written under the folio's stripe lock, through `Inner::set_swapped`
    /// and `Inner::clear_swapped`, which keep `FolioTable::swapped_pages`.
    pub(super) swapped: Box<[AtomicU64]>,
    /// `ReclaimLists::evict_clock` when the folio was last evicted: a fault that
    /// loads it back soon after (a refault distance under the resident
    /// folios, as mm/workingset.c measures it) shows it is in use.
    pub(super) evicted_at: Box<[AtomicU32]>,
    /// Looks the folio may still pass as accessed though nothing was seen
    /// (`Lru::isolate`): reads of a resident page are invisible here, so a
    /// folio that came back soon after its eviction earns a few.
    pub(super) protect: Box<[AtomicU8]>,
    /// Loads of the folio still to be made whole, not partial
    /// (`DENSE_LOADS`): its last partial load was soon followed by faults
    /// on every page it left in the tier, so the program reads it all while
    /// it is resident. A hint, learned again at each partial load.
    pub(super) dense: Box<[AtomicU8]>,
    /// `ReclaimLists::evict_clock` at the folio's last partial load: how
    /// soon the program came back for the rest of it (`dense`).
    pub(super) loaded_at: Box<[AtomicU32]>,
}

/// Bytes of folio table per folio: state, referenced, queued, cached,
/// poisoned, protect, dense (one each), evicted_at and loaded_at (4 each)
/// and swapped (8).
pub(super) const FOLIO_TABLE_BYTES: usize = 23;

impl RegionState {
    /// The tier key of page `page` of this region.
    pub(super) fn key(&self, page: usize) -> u64 {
        self.key_base + page as u64
    }

    pub(super) fn folio(&self, f: usize) -> Folio {
        Folio::from_u8(self.state[f].load(Ordering::Acquire))
    }

    pub(super) fn set_folio(&self, f: usize, s: Folio) {
        self.state[f].store(s as u8, Ordering::Release);
    }

    /// `[addr, addr + len)` lies inside the region where it is now, or
    /// EINVAL (a REMAP moved it between the caller's look and this one:
    /// the caller treats it as any failed ioctl).
    fn check(&self, op: &'static str, addr: u64, len: u64) -> Result<(), UffdError> {
        let s = self.start.load(Ordering::Acquire);
        if addr >= s && addr + len <= s + self.len as u64 {
            Ok(())
        } else {
            Err(UffdError::Ioctl { op, addr, len, errno: rustix::io::Errno::INVAL })
        }
    }

    /// `UFFDIO_ZEROPAGE` over `[addr, addr + len)` of this region. The
    /// kernel fills within one of its mappings per call, and a region may
    /// span several (the program mprotected part of it, or an adopted
    /// neighbour did not merge): then page by page.
    pub(super) fn zero_fill(&self, uffd: &Uffd, addr: u64, len: u64) -> Result<u64, UffdError> {
        self.check("UFFDIO_ZEROPAGE", addr, len)?;
        // SAFETY: the range lay in this region, registered with `uffd`,
        // when checked; only a REMAP completed since could have moved it,
        // and then the ioctl fails or meets another range registered with
        // `uffd`. No Rust reference covers any of them (their bytes are
        // reached only through atomics and the kernel).
        let r = unsafe { uffd.zeropage(addr, len, false) };
        if !crosses_mappings(&r, len) {
            return r;
        }
        for a in (addr..addr + len).step_by(PAGE_SIZE) {
            // Any other error: not this region's any more (unmapped, not
            // registered), nothing to fill; the caller wakes the faulting
            // thread.
            // SAFETY: as above, one page of the range.
            if let Err(e @ UffdError::Again { .. }) = unsafe { uffd.zeropage(a, PAGE_SIZE as u64, false) } {
                return Err(e);
            }
        }
        Ok(len)
    }

    /// `UFFDIO_COPY` of `src` to `dst` in this region (write-protected when
    /// `wp`, for write tracking).
    /// Page by page where the range spans more than one of the kernel's
    /// mappings (see `zero_fill`).
    pub(super) fn copy_in(&self, uffd: &Uffd, dst: u64, src: &[u8], wp: bool) -> Result<u64, UffdError> {
        self.check("UFFDIO_COPY", dst, src.len() as u64)?;
        // SAFETY: 1. src is a live slice of src.len() bytes; 2. the
        // destination lies in this region (checked), reached only through
        // atomics and the kernel.
        let r = unsafe { uffd.copy_wp(dst, src.as_ptr(), src.len() as u64, false, wp) };
        if !crosses_mappings(&r, src.len() as u64) {
            return r;
        }
        for (i, page) in src.chunks(PAGE_SIZE).enumerate() {
            let a = dst + (i * PAGE_SIZE) as u64;
            // SAFETY: as above, one page of each.
            match unsafe { uffd.copy_wp(a, page.as_ptr(), page.len() as u64, false, wp) } {
                Err(e @ UffdError::Again { .. }) => return Err(e),
                Err(e) if gone(&e) => log::debug!("{e}: no longer registered (the region is being dropped)"),
                Err(e) => log::error!("UFFDIO_COPY of a page failed: {e}"),
                Ok(_) => {}
            }
        }
        Ok(src.len() as u64)
    }

    /// `UFFDIO_MOVE` of `[src, src + len)` of this region to `dst` in the
    /// caller's staging area, stopping at the first hole.
    pub(super) fn move_out(&self, uffd: &Uffd, src: u64, dst: u64, len: u64) -> Result<u64, UffdError> {
        self.check("UFFDIO_MOVE", src, len)?;
        // SAFETY: the source lies in this region (checked) and the
        // destination in the reclaim thread's staging area (its caller's
        // contract); no Rust reference covers either.
        unsafe { uffd.move_until_hole(dst, src, len) }
    }

    /// Which of pages `[first, first + n)` the program unmapped, or `None`
    /// when it unmapped none of the region (the common case).
    pub(super) fn holes_in(&self, first: usize, n: usize) -> Option<Vec<bool>> {
        let holes = self.unmapped.lock_ok();
        if holes.is_empty() {
            return None;
        }
        let mut out = vec![false; n];
        for &(a, b) in holes.iter() {
            let (a, b) = (a / PAGE_SIZE, b.div_ceil(PAGE_SIZE));
            for p in a.max(first)..b.min(first + n) {
                out[p - first] = true;
            }
        }
        Some(out)
    }

    /// Whether the program unmapped byte `off` of the region.
    pub(super) fn in_hole(&self, off: usize) -> bool {
        self.has_holes.load(Ordering::Acquire) && self.unmapped.lock_ok().iter().any(|&(a, b)| (a..b).contains(&off))
    }

    /// Records that the program unmapped `[a, b)` (offsets) of the region.
    pub(super) fn add_hole(&self, a: usize, b: usize) {
        self.unmapped.lock_ok().push((a, b));
        self.has_holes.store(true, Ordering::Release);
    }

    /// How much of what the region maps (outside its holes) lies in
    /// `[lo, hi)` (addresses, where the region is now).
    pub(super) fn mapped_in(&self, lo: u64, hi: u64) -> Within {
        let base = self.start.load(Ordering::Acquire);
        let parts = self.mapped_parts();
        if !parts.iter().any(|&(a, b)| base + (a as u64) < hi && base + b as u64 > lo) {
            Within::Nothing
        } else if parts.iter().all(|&(a, b)| base + a as u64 >= lo && base + b as u64 <= hi) {
            Within::All
        } else {
            Within::Part
        }
    }

    /// The parts of the region (offsets) the program has not unmapped.
    pub(super) fn mapped_parts(&self) -> Vec<(usize, usize)> {
        let mut holes = self.unmapped.lock_ok().clone();
        holes.sort_unstable();
        let mut out = Vec::new();
        let mut at = 0;
        for (a, b) in holes.into_iter().chain([(self.len, self.len)]) {
            if a > at {
                out.push((at, a));
            }
            at = at.max(b);
        }
        out
    }

    pub(super) fn swap_folio(&self, f: usize, s: Folio) -> Folio {
        Folio::from_u8(self.state[f].swap(s as u8, Ordering::AcqRel))
    }
}

/// What [`RegionState::mapped_in`] finds of a region in a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Within {
    /// Only holes of the region, or none of it.
    Nothing,
    /// Some of what it maps, not all.
    Part,
    /// All of what it maps.
    All,
}

/// Whether an ioctl over `len` bytes failed because the range is not within
/// one of the kernel's mappings (ENOENT or EINVAL), so that it is worth
/// retrying page by page.
/// Whether a fill failed because the page is no longer in a mapping
/// registered with the userfaultfd (ENOENT). With every UNMAP, REMOVE and
/// REMAP read first (a fill fails with EAGAIN while one is unread), that
/// is a region the program is freeing: `Region::drop` unregisters it before
/// it waits on the stripe locks that a load in flight holds. The memory is
/// going away, and so is what the load would have put there.
pub(super) fn gone(e: &UffdError) -> bool {
    matches!(e, UffdError::Ioctl { errno: rustix::io::Errno::NOENT, .. })
}

fn crosses_mappings(r: &Result<u64, UffdError>, len: u64) -> bool {
    len > PAGE_SIZE as u64
        && matches!(r, Err(UffdError::Ioctl { errno: rustix::io::Errno::NOENT | rustix::io::Errno::INVAL, .. }))
}

/// Memory handed out by a [`Pager`]. Unmapped (and its entries dropped) on drop.
pub struct Region {
    state: Arc<RegionState>,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("addr", &self.addr()).field("len", &self.state.len).finish()
    }
}

impl Region {
    pub fn addr(&self) -> u64 {
        self.state.start.load(Ordering::Acquire)
    }

    pub fn len(&self) -> usize {
        self.state.len
    }

    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// Whether the folio holding byte `offset` is resident (mapped, not
    /// evicted or being evicted): `mincore` for a region.
    pub fn is_resident(&self, offset: usize) -> bool {
        let f = offset / self.inner.cfg.folio_size;
        f < self.state.state.len() && self.state.folio(f) == Folio::Resident
    }

    /// The tier key of the page holding byte `offset` (for tools and tests
    /// that look at where a page is stored).
    pub fn entry_key(&self, offset: usize) -> u64 {
        self.state.key(offset / PAGE_SIZE)
    }

    /// The region as atomic words, for the lifetime of the region (touching
    /// a page faults it in).
    pub fn words(&self) -> &[AtomicU64] {
        let addr = self.addr();
        // SAFETY: 1. [addr, addr + len) is this region's mapping, which lives
        // until the Region (and so this borrow) is dropped; 2. it is
        // 8-aligned; 3. its bytes are only ever reached through atomics and
        // the kernel, so shared atomic views are sound.
        unsafe { std::slice::from_raw_parts(addr as *const AtomicU64, self.state.len / 8) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let inner = &self.inner;
        let st = &self.state;
        // A forked child may still need this region's entries.
        inner.wait_handover();
        // The handler records UNMAP and REMAP events under `events` before
        // it lets go of it; a munmap or mremap the program made returned
        // only after its event was read, so once we have held the lock, the
        // address and the holes are current.
        drop(inner.gate.events.read_ok());
        let addr = st.start.load(Ordering::Acquire);
        let mapped = st.mapped_parts();
        // Only what is still ours: a hole's addresses may belong to another
        // mapping now, even another region of this pager.
        for &(a, b) in &mapped {
            let _ = inner.uffd.unregister(addr + a as u64, (b - a) as u64);
        }
        inner.folios.regions.write_ok().remove(&(addr, st.id));
        for f in 0..st.state.len() {
            let (lock, cv) = inner.stripe(st, f);
            let mut g = lock.lock_ok();
            // A program thread (never the handler) may wait for reclaim,
            // counted in the lock (`finish` notifies only with a waiter).
            while st.folio(f) == Folio::Evicting {
                *g += 1;
                g = unpoison(cv.wait(g));
                *g -= 1;
            }
            let old = st.swap_folio(f, Folio::Never);
            let swapped = inner.clear_swapped(st, f, u64::MAX);
            drop(g);
            if old == Folio::Resident {
                inner.acct.resident.fetch_sub(1, Ordering::Relaxed);
                inner.folios.dropped.lock_ok().remove(&(st.id, f));
            }
            if old == Folio::Evicted || st.cached[f].swap(false, Ordering::Relaxed) || swapped != 0 {
                inner.invalidate_folio(st, f);
            }
        }
        inner.folios.tables.fetch_sub(st.state.len() * FOLIO_TABLE_BYTES, Ordering::Relaxed);
        // Unregistered, so munmap raises no event. The region may have been
        // mremapped since it was mapped: unmap it where it is now.
        if let Some(m) = st.mapping.lock_ok().take() {
            zmem_common::host::owned::remove(m.addr());
            std::mem::forget(m);
            for (a, b) in mapped {
                // SAFETY: [addr + a, addr + b) is part of this region's
                // mapping at its current address that the program did not
                // unmap (tracked through Remap and Unmap events); nothing
                // refers into it once the Region is gone.
                let r = unsafe { rustix::mm::munmap((addr as usize + a) as *mut _, b - a) };
                debug_assert!(r.is_ok(), "munmap of a region failed: {r:?}");
            }
        }
    }
}

impl Inner {
    /// Registers `[addr, addr + len)` (whole folios) and makes a region's
    /// bookkeeping for it, every folio Never: of zmem's own `mapping`
    /// ([`Pager::map`]), or of one the program made (`None`: adopted).
    pub(super) fn new_region(
        &self,
        addr: u64,
        len: usize,
        mapping: Option<Mapping>,
    ) -> Result<Arc<RegionState>, PagerError> {
        self.uffd.register(addr, len as u64, self.register_mode())?;
        Ok(self.region_state(addr, len, mapping, None))
    }

    /// A region's bookkeeping, all folios `Never`; `key_base` as for a new
    /// region unless given. Registers nothing.
    pub(super) fn region_state(
        &self,
        addr: u64,
        len: usize,
        mapping: Option<Mapping>,
        key_base: Option<u64>,
    ) -> Arc<RegionState> {
        let nf = len / self.cfg.folio_size;
        self.folios.tables.fetch_add(nf * FOLIO_TABLE_BYTES, Ordering::Relaxed);
        let id = self.folios.next_region.fetch_add(1, Ordering::Relaxed);
        Arc::new(RegionState {
            id,
            key_base: key_base.unwrap_or(u64::from(id) << 40),
            start: AtomicU64::new(addr),
            adopted: mapping.is_none(),
            exec: AtomicBool::new(false),
            mapping: Mutex::new(mapping),
            unmapped: Mutex::new(Vec::new()),
            moved: Mutex::new(Vec::new()),
            has_holes: AtomicBool::new(false),
            len,
            tail: AtomicUsize::new(0),
            state: (0..nf).map(|_| AtomicU8::new(Folio::Never as u8)).collect(),
            referenced: (0..nf).map(|_| AtomicBool::new(false)).collect(),
            queued: (0..nf).map(|_| AtomicBool::new(false)).collect(),
            cached: (0..nf).map(|_| AtomicBool::new(false)).collect(),
            poisoned: (0..nf).map(|_| AtomicBool::new(false)).collect(),
            swapped: (0..nf).map(|_| AtomicU64::new(0)).collect(),
            evicted_at: (0..nf).map(|_| AtomicU32::new(0)).collect(),
            protect: (0..nf).map(|_| AtomicU8::new(0)).collect(),
            dense: (0..nf).map(|_| AtomicU8::new(0)).collect(),
            loaded_at: (0..nf).map(|_| AtomicU32::new(0)).collect(),
        })
    }
}

impl Pager {
    /// Maps `len` bytes (rounded up to folios) of managed memory.
    ///
    /// # Errors
    /// mmap or userfaultfd registration errors.
    pub fn map(&self, len: usize) -> Result<Region, PagerError> {
        let fs = self.inner.cfg.folio_size;
        let len = len.max(1).div_ceil(fs) * fs;
        let m = Mapping::new(len).map_err(PagerError::Map)?;
        let addr = m.addr();
        if !self.inner.cfg.keep_on_fork {
            m.dont_fork().map_err(PagerError::Map)?;
        }
        let state = self.inner.new_region(addr, len, Some(m))?;
        self.inner.folios.regions.write_ok().insert((addr, state.id), Arc::clone(&state));
        self.inner.unmapping();
        Ok(Region { state, inner: Arc::clone(&self.inner) })
    }
}

/// The folio table: every region and its folios' states, the stripe locks
/// that guard them, and what hangs off a folio between its states (pages
/// dropped while it was evicted, held pages, its pages in staging, where a
/// move sent it). Its bookkeeping is in this file (`retain_pages`,
/// `set_swapped`, `invalidate_folio`, `unhold`).
pub(super) struct FolioTable {
    /// Regions by (start, id): an adopted region may lie in a hole of an
    /// older one (the program unmapped part of it, and the kernel put a new
    /// mapping there), so two may share a start.
    pub(super) regions: std::sync::RwLock<std::collections::BTreeMap<(u64, u32), std::sync::Arc<RegionState>>>,
    /// Folio locks, striped (`stripe`); each counts the threads waiting on
    /// its condvar for a folio's eviction to finish.
    pub(super) stripes: Vec<(std::sync::Mutex<u32>, std::sync::Condvar)>,
    pub(super) next_region: std::sync::atomic::AtomicU32,
    /// Bytes of folio tables of live regions.
    pub(super) tables: std::sync::atomic::AtomicUsize,
    /// Pages of Resident folios left in the tier by partial loads
    /// (`RegionState::swapped`): `resident` counts whole folios, and usage
    /// takes these back off.
    pub(super) swapped_pages: std::sync::atomic::AtomicUsize,
    /// Bumped before a page the program had mapped may stop being mapped
    /// (an eviction, a drop or move the program made, a new region): a
    /// caller that found a range mapped at one epoch knows it still is
    /// while the epoch has not moved (`uaccess.rs`). Each pager's starts
    /// at its own base (`EPOCH_BASES`).
    pub(super) epoch: std::sync::atomic::AtomicU64,
    /// Pages dropped by the program (REMOVE, UNMAP) while their folio was
    /// Folio::Evicting, by (region id, folio): the evictor drops their entries
    /// when it finishes. Also the pages dropped from a Resident folio whose
    /// zap may still be to come (until a fault on the page shows it done):
    /// the next eviction drops them too. Written and taken under the
    /// folio's stripe lock.
    pub(super) dropped: std::sync::Mutex<std::collections::HashMap<(u32, usize), Vec<bool>>>,
    /// Folios whose store was rejected: their pages, uncompressed, until a
    /// fault maps them again. Reclaim never puts pages back itself: pages
    /// are mapped only by loads, which step over what the program is
    /// dropping (`dropping`), so a page it dropped never comes back.
    pub(super) held: std::sync::Mutex<std::collections::HashMap<(u32, usize), super::Held>>,
    pub(super) held_bytes: std::sync::atomic::AtomicUsize,
    /// The folios of the pass under way whose pages MOVE put in staging,
    /// by (region id, folio): a fault on one is served from its slot
    /// (`Inner::rescue`), as the kernel's swap cache serves a fault on a
    /// folio under writeback, instead of waiting for the whole pass to be
    /// stored. Put by reclaim before it stores the pass, taken by
    /// `finish`; looked up and marked rescued by a handler. Both under the
    /// folio's stripe lock.
    pub(super) staged: std::sync::Mutex<std::collections::HashMap<(u32, usize), super::Staged>>,
    /// Folios that were Evicting when a partial mremap moved them (all or
    /// part) into a split-off region: by (region id, folio), each new
    /// region's folio and which pages moved there. The evictor passes the
    /// folio on when it finishes (`events.rs`). Several: two mremaps can
    /// move two parts of one folio while it is evicted; and a folio waiting
    /// for its forward can itself be moved on (its forwards are passed on
    /// in turn).
    pub(super) forwards: std::sync::Mutex<std::collections::HashMap<(u32, usize), Vec<super::Forward>>>,
    /// Folios (region id, folio) whose copy-on-write reclaim broke because
    /// a MOVE found them busy (`break_cow`), and that have not moved
    /// since: busy again, they are pinned, not shared (`evict_batch`).
    /// Only the reclaim thread uses it.
    pub(super) cow_broken: std::sync::Mutex<std::collections::HashSet<(u32, usize)>>,
}

impl FolioTable {
    /// An empty table whose epoch starts at `epoch_base` (`uaccess.rs`).
    pub(super) fn new(epoch_base: u64) -> FolioTable {
        FolioTable {
            regions: std::sync::RwLock::new(std::collections::BTreeMap::new()),
            stripes: (0..STRIPES).map(|_| (std::sync::Mutex::new(0), std::sync::Condvar::new())).collect(),
            next_region: std::sync::atomic::AtomicU32::new(1),
            tables: Default::default(),
            swapped_pages: Default::default(),
            epoch: std::sync::atomic::AtomicU64::new(epoch_base),
            dropped: Default::default(),
            held: Default::default(),
            held_bytes: Default::default(),
            staged: Default::default(),
            forwards: Default::default(),
            cow_broken: Default::default(),
        }
    }
}

/// The folio table's bookkeeping: the stripe locks, the regions by address,
/// and what a folio's pages leave behind as it moves between states.
impl Inner {
    pub(super) fn stripe(&self, st: &RegionState, f: usize) -> &(Mutex<u32>, Condvar) {
        &self.folios.stripes[(st.id as usize * 7919 + f) % STRIPES]
    }

    /// The region that holds `addr`: its range covers it and the program
    /// has not unmapped it there.
    pub(super) fn region_at(&self, addr: u64) -> Option<Arc<RegionState>> {
        let regions = self.folios.regions.read_ok();
        regions
            .range(..=(addr, u32::MAX))
            .rev()
            .map(|(_, r)| r)
            .find(|r| {
                let s = r.start.load(Ordering::Acquire);
                addr < s + r.len as u64 && !r.in_hole((addr - s) as usize)
            })
            .cloned()
    }

    /// The regions whose ranges overlap `[start, end)`, holes or not.
    pub(super) fn regions_in(&self, start: u64, end: u64) -> Vec<Arc<RegionState>> {
        let regions = self.folios.regions.read_ok();
        regions
            .range(..(end, 0))
            .map(|(_, r)| r)
            .filter(|r| r.start.load(Ordering::Acquire) + r.len as u64 > start)
            .cloned()
            .collect()
    }

    /// Drops every entry of folio `f`, and its held pages. The caller holds
    /// the folio's stripe lock, or owns the folio (a dying region).
    /// A region never touches the entries of pages in its holes: they were
    /// invalidated when the program unmapped them, or belong to the region
    /// a partial mremap split off.
    pub(super) fn invalidate_folio(&self, st: &RegionState, f: usize) {
        for p in self.folio_pages(st, f) {
            self.tier.invalidate(st.key(p));
        }
        self.unhold(st, f);
    }

    /// The pages of folio `f` of `st` (region page numbers) that are not in
    /// its holes: those whose entries are this region's.
    pub(super) fn folio_pages(&self, st: &RegionState, f: usize) -> impl Iterator<Item = usize> {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let holes = st.holes_in(f * ppf, ppf);
        (f * ppf..(f + 1) * ppf).filter(move |&p| !holes.as_ref().is_some_and(|h| h[p - f * ppf]))
    }

    /// Whether a load now keeps its pages' pool entries as clean copies
    /// (`once`: a walk's or a fork's load).
    ///
    /// A kept pool entry is memory beside the page it copies, charged to
    /// the limit: kept only below the low watermark, where it costs no
    /// eviction. (Entries in the swap file cost no memory.) A walk's
    /// folios, and a fork's (`once`), keep theirs at any usage: they go
    /// first (`Lru::once`), and their entries are what they will be evicted
    /// into, so freeing one now would only cost a compression then.
    /// Not where a controller moves the tree's limit (`zmem run
    /// --max-slowdown`): the room under its limit is the margin it gives
    /// the program, not spare memory, and copies kept there raised the
    /// usage it trims the limit to (a working set of 160 MiB held 42 MiB
    /// of them, for good).
    pub(super) fn keeps_pool_copies(&self, once: bool) -> bool {
        once || (self.usage() + self.cfg.folio_size <= self.low() && !self.limit_controlled())
    }

    /// After pages `mask` of folio `f` (bit `i`: page `i`; `u64::MAX`: all)
    /// were mapped again from `pages`, the folio's bytes: their pool entries
    /// stay as clean copies (`Tier::retain_clean`) if `keep_pool` (the
    /// caller's [`keeps_pool_copies`](Self::keeps_pool_copies), taken before
    /// it mapped them), their other entries go.
    /// Same locking as [`invalidate_folio`](Self::invalidate_folio).
    pub(super) fn retain_pages(
        &self,
        st: &RegionState,
        f: usize,
        mask: u64,
        pages: &[u8],
        (once, keep_pool): (bool, bool),
    ) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let mut kept = false;
        // A written-back entry is kept only where the pool could not take
        // the page anyway (`Tier::retain_clean_unless`): a hot page would
        // otherwise go back and forth between the program and its slot,
        // each load a read of the disk, while the pool sits half empty. A
        // walk's keep theirs, as its pool entries: the walk reads on, its
        // folios go out behind it, into these entries, and are not read
        // again soon (`a_walk_over_more_than_the_limit_evicts_behind_itself`
        // compressed 26% of what it evicted without this, 2-5% with it).
        let room = !once && self.tier.pool_has_room();
        for p in self.folio_pages(st, f) {
            let i = p - f * ppf;
            if i < 64 && mask >> i & 1 == 0 {
                continue;
            }
            kept |=
                self.tier.retain_clean_unless(st.key(p), &pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE], keep_pool, room);
        }
        if mask == u64::MAX {
            st.cached[f].store(kept, Ordering::Relaxed);
            self.unhold(st, f);
        } else if kept {
            st.cached[f].store(true, Ordering::Relaxed);
        }
    }

    /// Marks pages `mask` of Resident folio `f` as left in the tier (none of
    /// them was). The caller holds the folio's stripe lock.
    pub(super) fn set_swapped(&self, st: &RegionState, f: usize, mask: u64) {
        let old = st.swapped[f].fetch_or(mask, Ordering::Relaxed);
        debug_assert_eq!(old & mask, 0, "pages marked swapped twice");
        self.folios.swapped_pages.fetch_add((mask & !old).count_ones() as usize, Ordering::Relaxed);
    }

    /// Unmarks pages `mask` of folio `f` (loaded, dropped, or the folio
    /// leaves Resident); returns those of them that were marked. The caller
    /// holds the folio's stripe lock.
    pub(super) fn clear_swapped(&self, st: &RegionState, f: usize, mask: u64) -> u64 {
        if st.swapped[f].load(Ordering::Relaxed) & mask == 0 {
            return 0;
        }
        let was = st.swapped[f].fetch_and(!mask, Ordering::Relaxed) & mask;
        self.folios.swapped_pages.fetch_sub(was.count_ones() as usize, Ordering::Relaxed);
        was
    }

    pub(super) fn unhold(&self, st: &RegionState, f: usize) {
        if let Some(h) = self.folios.held.lock_ok().remove(&(st.id, f)) {
            self.folios.held_bytes.fetch_sub(h.data.len(), Ordering::Relaxed);
        }
    }
}
