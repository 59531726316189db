//! Adoption: managing memory the program mapped itself, by mapping, as the
//! kernel sees it, whoever made it (glibc's brk heap and arenas, another
//! allocator's chunks, a runtime's heap).
//!
//! A scan ([`Pager::scan_mappings`], and the reclaim thread every
//! [`AdoptConfig::interval`] and before it evicts) lists the writable
//! mappings (`vmas.rs`) and adopts each private anonymous one that is
//! [`AdoptConfig::threshold`] or larger, or that extends a region already
//! adopted (a heap that grew), less what it must never manage:
//! - zmem's own memory and its threads' stacks, the program's thread
//!   stacks unless [`AdoptConfig::stacks`], and what the program locked
//!   (`zmem_common::host::owned`; the shim records `mlock`s and `MAP_LOCKED`), or
//!   everything new once it called `mlockall` ([`Pager::stop_adopting`]);
//! - what a region already covers;
//! - shared, file-backed, device and hugetlb mappings (not anonymous);
//! - the .bss of every loaded ELF object (the zero-filled end of its data
//!   segment, which the loader maps anonymous right after the segment's
//!   file-backed pages; `vmas::static_data` reads the object's program
//!   headers for its extent): the C library's and zmem's own statics live
//!   there, and zmem's threads touch them (a fault there would be served by
//!   the thread that took it). An anonymous mapping after a file that is
//!   not an ELF object is the program's: SBCL maps its core over the start
//!   of its 4 GiB heap;
//! - a tail shorter than a folio (regions are whole folios): registered
//!   with the region, so that the kernel keeps the mapping one VMA (an
//!   mremap across VMAs fails), but never evicted.
//!
//! Adopting `[a, b)` ([`Pager::adopt`]):
//! 1. put an adopted region in the table, all folios `Never`, unless a
//!    region has part of the range;
//! 2. register it with the userfaultfd (MISSING, and WP with write
//!    tracking); a mapping that changed meanwhile fails here, and the
//!    region leaves the table. In this order, every UNMAP the kernel
//!    reports for the range finds the region;
//! 3. read which pages are present (`/proc/self/pagemap`) and make their
//!    folios Resident, under their stripe locks (a fault may have been
//!    first); the other pages of such a folio were never touched, and get
//!    the zero page then (`zero_absent`), not a fault each later.
//!
//! The program keeps the mapping: it may unmap it (UNMAP events make holes;
//! a region with nothing left is forgotten, `retire`), move it (REMAP), or
//! map something new in a hole, which a later scan adopts as a region of
//! its own (two regions may then overlap, the newer in the older's hole;
//! `region_at` skips holes). Dropping the pager gives every adopted region
//! back whole: its evicted folios are loaded and it is unregistered.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use zmem_common::host::owned::{self, Kind};
use zmem_common::{LockExt, RwLockExt};

use super::install::{Load, Served};
use super::region::{Within, FOLIO_TABLE_BYTES};
use super::stats::inc;
use super::{AdoptConfig, Folio, Inner, Pager, PagerError, RegionState};
use crate::pagemap::PageMap;
use crate::vmas::{self, StaticData};
use zmem_common::PAGE_SIZE;

/// Pages read from `/proc/self/pagemap` per `pread`.
const PAGEMAP_CHUNK: usize = 4096;

/// How long [`Pager::adopt`] waits for the pager's threads to run.
const STARTING_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

/// A range adopted and registered, whose pages already there are not
/// taken in yet (`Inner::register_adopted`, then `Inner::adopt_registered`).
struct Registered {
    st: Arc<RegionState>,
    /// Where it was registered (its length is `st.len`).
    addr: u64,
    /// The pages before the cut (`Inner::registered_through`).
    upto: usize,
}

impl Inner {
    /// Whether every thread the pager started runs its own code, past the
    /// start-up that may wait for the dynamic loader's lock.
    pub(super) fn threads_running(&self) -> bool {
        let n = self.threads_started.load(Ordering::Acquire);
        n != 0 && self.running.lock_ok().len() >= n
    }

    /// Waits for [`Inner::threads_running`], `STARTING_WAIT` at most:
    /// whether they run.
    fn wait_for_threads(&self) -> bool {
        let until = std::time::Instant::now() + STARTING_WAIT;
        while !self.threads_running() {
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        true
    }
}

impl Pager {
    /// Manages `[addr, addr + len)`, part of a private anonymous mapping the
    /// program made, in whole folios from `addr`. Pages already there count
    /// as resident. Returns the bytes adopted.
    ///
    /// Nothing is registered before the pager's threads are all running
    /// (`Inner::threads_running`; it waits `STARTING_WAIT` at most): a new
    /// thread registers its thread-locals' destructors with glibc as it
    /// starts, under the dynamic loader's lock, and a caller that holds
    /// that lock (a library constructor, inside `dlopen`, whose mapping
    /// crossed a late start's point) would fault on memory a handler
    /// still waiting for the lock must serve.
    ///
    /// # Errors
    /// The registration's error (the range is not one private anonymous
    /// mapping, or another userfaultfd has it), or a pagemap read's;
    /// [`PagerError::Starting`] where the threads are not running yet.
    pub fn adopt(&self, addr: u64, len: usize) -> Result<usize, PagerError> {
        if !self.inner.wait_for_threads() {
            return Err(PagerError::Starting);
        }
        self.inner.adopt_range(addr, len)
    }

    /// The program made `[addr, addr + len)` readable and writable with
    /// `mprotect`: a runtime committing the next part of a reservation it
    /// mapped `PROT_NONE` (V8 grows its heap so, 256 KiB at a time). Adopted
    /// now, before the program fills it; a scan would find it filled, up to
    /// an interval later (tests/data/commit.c, 256 MiB committed and filled
    /// so under `--limit 32M`, peaked at 174 MiB).
    ///
    /// Only what a scan would adopt, and only where one query of the
    /// mapping tells: a private anonymous mapping, not a stack, not zmem's,
    /// not one right after a file's mapping (an object's .bss may be there;
    /// the scan reads the object's headers). Everything else, and a range
    /// a region has part of, is left to the next scan. A commit made as
    /// the pager starts waits for its threads, as [`Pager::adopt`] does.
    pub fn adopt_committed(&self, addr: u64, len: usize) {
        let inner = &self.inner;
        let Some(cfg) = inner.cfg.adopt.as_ref() else { return };
        if len < cfg.threshold
            || !inner.adopting.load(Ordering::Relaxed)
            || inner.fork.frozen.load(Ordering::Acquire)
            || !inner.wait_for_threads()
        {
            return;
        }
        let Ok(fd) = inner.maps() else { return };
        let Ok(Some(v)) = vmas::mapping_at(fd, addr) else { return };
        if !v.is_private_anon_rw() || v.is_stack() {
            return;
        }
        let after_file = v.start > 0 && matches!(vmas::mapping_at(fd, v.start - 1), Ok(Some(p)) if p.file);
        let (a, b) = (addr.max(v.start), (addr + len as u64).min(v.end));
        if after_file || a >= b || !owned::overlapping(a, b).is_empty() {
            return;
        }
        if let Err(e) = inner.adopt_range(a, (b - a) as usize) {
            log::debug!("adopting {a:#x}..{b:#x} as it was committed failed: {e}");
        }
    }

    /// No scan adopts anything from now on (the program called `mlockall`:
    /// whatever it maps is locked). What is managed stays managed.
    pub fn stop_adopting(&self) {
        self.inner.adopting.store(false, Ordering::Relaxed);
    }

    /// Call before the program's `mremap` of `[addr, addr + len)`: loads
    /// back the evicted folios of every region the move would split, whose
    /// pages could not follow it (a region moved whole keeps its entries).
    pub fn prepare_remap(&self, addr: u64, len: usize) {
        let inner = &self.inner;
        let (lo, hi) = (addr, addr + len as u64);
        let split: Vec<_> =
            inner.regions_in(lo, hi).into_iter().filter(|st| st.mapped_in(lo, hi) == Within::Part).collect();
        if split.is_empty() {
            return;
        }
        // A forked child may still need their entries.
        inner.wait_handover();
        // No reclaim pass meanwhile.
        let _gate = inner.fork.reclaim_gate.lock_ok();
        let mut bounce = vec![0u8; inner.cfg.folio_size];
        for st in split {
            let base = st.start.load(Ordering::Acquire);
            let fs = inner.cfg.folio_size as u64;
            let first = (lo.max(base) - base) / fs;
            let end = (hi.min(base + st.len as u64) - base).div_ceil(fs);
            inner.load_folios(&st, first as usize..end as usize, &mut bounce, false);
        }
    }

    /// Gives the adopted regions that lie wholly within `[addr, addr + len)`
    /// back to the program, as [`Drop`] does with all of them: their
    /// evicted folios loaded, the range unregistered (the tail past a
    /// region's last whole folio too), the regions forgotten. Returns the
    /// bytes given back.
    ///
    /// For a program thread's stack when the thread exits (`ZMEM_STACKS=1`):
    /// glibc keeps the stack for its next thread, which may be zmem's, and a
    /// handler on a managed stack could wait for itself. The exiting
    /// thread, still on that stack, calls this.
    pub fn release(&self, addr: u64, len: usize) -> usize {
        let inner = &self.inner;
        let (lo, hi) = (addr, addr + len as u64);
        let whole = |st: &Arc<RegionState>| {
            st.adopted && st.mapped_in(lo, hi) == Within::All && st.start.load(Ordering::Acquire) >= lo
        };
        if !inner.regions_in(lo, hi).iter().any(whole) {
            return 0;
        }
        // A forked child may still need their entries.
        inner.wait_handover();
        // No reclaim pass meanwhile: nothing of theirs is being evicted,
        // and nothing is once they are unregistered.
        let _gate = inner.fork.reclaim_gate.lock_ok();
        let mut bounce = vec![0u8; inner.cfg.folio_size];
        let regions: Vec<_> = inner.regions_in(lo, hi).into_iter().filter(whole).collect();
        for st in &regions {
            inner.give_back(st, &mut bounce);
        }
        // Then the whole range, so the tails past the regions' last whole
        // folios go too (never managed: a fault there was a stray one, and
        // a part never registered is a no-op).
        if let Err(e) = inner.uffd.unregister(lo, len as u64) {
            log::warn!("unregistering {lo:#x}..{hi:#x} to give it back failed: {e}");
        }
        regions.iter().map(|st| st.len).sum()
    }

    /// Scans the address space once and adopts what `cfg` allows. Returns
    /// the bytes adopted.
    ///
    /// # Errors
    /// Neither `PROCMAP_QUERY` nor `/proc/self/maps` could be read.
    pub fn scan_mappings(&self, cfg: &AdoptConfig) -> Result<usize, PagerError> {
        self.inner.scan_mappings(cfg)
    }
}

impl Inner {
    pub(super) fn scan_mappings(&self, cfg: &AdoptConfig) -> Result<usize, PagerError> {
        inc(&self.counters.mapping_scans);
        // No thread is between its stack's mmap and its record meanwhile.
        let _spawns = owned::scan_lock();
        let vmas = self.maps().and_then(vmas::mappings_in).map_err(PagerError::Map)?;
        let covered = self.covered();
        let mut registered = Vec::new();
        for (i, v) in vmas.iter().enumerate() {
            if !v.is_private_anon_rw() || (v.is_stack() && !cfg.stacks) {
                continue;
            }
            let mut pieces = vec![(v.start, v.end)];
            // An object's .bss, anonymous right after its file-backed data,
            // is never managed: the C library's and zmem's own statics are
            // there, and zmem's threads use both. What follows another
            // file's mapping is the program's (SBCL's heap after its core).
            match vmas::static_data(&vmas, i) {
                StaticData::None => {}
                StaticData::Bss(a, b) => subtract(&mut pieces, a, b),
                StaticData::Unknown => continue,
            }
            for (a, b, kind) in owned::overlapping(v.start, v.end) {
                // A cached stack no mapping holds whole any more was
                // unmapped (by the C library, which does not tell us): what
                // is there now is someone else's.
                if kind == Kind::CachedStack && !(v.start <= a && b <= v.end) {
                    owned::forget_stale(a);
                    continue;
                }
                if kind != Kind::Stack || !cfg.stacks {
                    subtract(&mut pieces, a, b);
                }
            }
            for &(a, b) in overlapping(&covered, v.start, v.end) {
                subtract(&mut pieces, a, b);
            }
            let big = (v.end - v.start) as usize >= cfg.threshold;
            for (a, b) in pieces {
                // A piece next to a region is that region's mapping grown
                // (brk, an arena's mprotect, a runtime committing the next
                // page of its reservation).
                let touches = !overlapping(&covered, a.saturating_sub(1), b + 1).is_empty();
                if big || touches {
                    match self.register_adopted(a, (b - a) as usize, false) {
                        Ok(Some(r)) => registered.push(r),
                        Ok(None) => {}
                        // It changed under us (unmapped, mprotected): the
                        // next scan sees it as it is then.
                        Err(e) => log::debug!("adopting {a:#x}..{b:#x} failed: {e}"),
                    }
                }
            }
        }
        // Every piece is registered before any is walked: from its
        // registration on, what the program fills there is managed, and a
        // walk takes milliseconds. SBCL's 1 GiB heap, listed after two
        // smaller mappings, was registered 21-78 ms after a late start
        // (8.5-49 ms so; debug build, beside a disk-bound loop).
        let mut adopted = 0;
        for r in registered {
            let (at, len) = (r.addr, r.st.len);
            match self.adopt_registered(r, None) {
                Ok((st, _)) => adopted += st.len,
                Err(e) => log::debug!("adopting {at:#x}+{len:#x} failed: {e}"),
            }
        }
        Ok(adopted)
    }

    /// What the regions cover (their mapped parts), sorted and merged: a
    /// scan looks each mapping up here by binary search, rather than
    /// walking thousands of regions (V8's heap is one per 256 KiB page).
    fn covered(&self) -> Vec<(u64, u64)> {
        let mut parts: Vec<(u64, u64)> = Vec::new();
        for st in self.folios.regions.read_ok().values() {
            let base = st.start.load(Ordering::Acquire);
            if st.has_holes.load(Ordering::Acquire) {
                parts.extend(st.mapped_parts().into_iter().map(|(a, b)| (base + a as u64, base + b as u64)));
            } else {
                parts.push((base, base + st.len as u64));
            }
        }
        parts.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(parts.len());
        for (a, b) in parts {
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        out
    }

    pub(super) fn adopt_range(&self, addr: u64, len: usize) -> Result<usize, PagerError> {
        Ok(self.adopt_range_with(addr, len, None)?.map_or(0, |(st, _)| st.len))
    }

    /// In a forked child's new pager: adopts `[addr, addr + len)`, where
    /// `has[p]` says page `p` has an entry in the parent's snapshot. A page
    /// with one that this process does not have is the child's evicted
    /// page: its folio is Evicted (or, beside present pages, Resident with
    /// the page left in the tier). Returns the region and, per page,
    /// whether to import its entry (`true`) or put it in place (a folio too
    /// large to mark the page left in the tier); `None` if nothing was
    /// adopted.
    #[allow(clippy::type_complexity)]
    pub(super) fn adopt_with_entries(
        &self,
        addr: u64,
        len: usize,
        has: &[bool],
    ) -> Result<Option<(Arc<RegionState>, Vec<bool>)>, PagerError> {
        Ok(self.adopt_range_with(addr, len, Some(has))?.map(|(st, take)| (st, take.unwrap_or_default())))
    }

    /// Adopts `[addr, addr + len)` (see `adopt_range`; `has`: in a forked
    /// child, the pages the parent's snapshot has).
    ///
    /// Registered only once it is in the table: from the registration
    /// on, the kernel reports an UNMAP of the range, and the handler
    /// must find this region to record the hole. Registered first, an
    /// UNMAP read before the insert was lost: glibc trimmed the brk
    /// heap just after, grew it back (a mapping of its own, not
    /// registered), and eviction took the new page from there while
    /// no COPY could bring it back (Python then read zeros).
    ///
    /// The tail past the last whole folio is registered too, so that the
    /// kernel does not split the mapping there: an mremap of a range
    /// across two VMAs fails with EFAULT, and glibc's realloc of a
    /// chunk it mmapped is such an mremap. The tail belongs to no
    /// region: a fault there is a stray one and gets a zero page, which
    /// is what an anonymous page never touched holds; a page there is
    /// never evicted.
    ///
    /// UFFDIO_REGISTER steps over gaps without a word. A range listed as
    /// one mapping may have lost its end meanwhile (glibc trimmed its
    /// brk heap: no UNMAP, since it was not registered yet) and got it
    /// back as a mapping of its own (not registered: it cannot merge
    /// with ours). From the first boundary inside the range, the range
    /// is a hole of the region and is unregistered: eviction must never
    /// MOVE pages out of memory no COPY can put them back into (it did,
    /// and Python read zeros).
    ///
    /// In a forked child taking its parent's pages over (`has`), the
    /// program has not run since the fork: a boundary there is one the
    /// parent's region had (the program split it with an `mprotect` or
    /// a `madvise` on part of it), each side registered, and only a gap
    /// ends the range (a `MADV_DONTFORK` mapping, which the child does
    /// not have). Cut at the first boundary, the pages past it (evicted
    /// in the parent, unregistered here) read as zeros.
    #[allow(clippy::type_complexity)]
    fn adopt_range_with(
        &self,
        addr: u64,
        len: usize,
        has: Option<&[bool]>,
    ) -> Result<Option<(Arc<RegionState>, Option<Vec<bool>>)>, PagerError> {
        match self.register_adopted(addr, len, has.is_some())? {
            Some(r) => self.adopt_registered(r, has).map(Some),
            None => Ok(None),
        }
    }

    /// The first half of [`adopt_range_with`](Self::adopt_range_with): the
    /// region in the table and registered, up to its cut (`forked`: in a
    /// forked child, where only a gap cuts). `None` where nothing is to
    /// be managed.
    fn register_adopted(&self, addr: u64, len: usize, forked: bool) -> Result<Option<Registered>, PagerError> {
        let fs = self.cfg.folio_size;
        // The region is whole folios; the tail shorter than a folio is
        // registered with it but left unmanaged (see below).
        let full = len / PAGE_SIZE * PAGE_SIZE;
        let len = full / fs * fs;
        if len == 0 || addr % PAGE_SIZE as u64 != 0 {
            return Ok(None);
        }
        let st = self.region_state(addr, len, None, None);
        st.tail.store(full - len, Ordering::Relaxed);
        let nf = len / fs;
        // Every event already read is in the table first: an mremap or a
        // munmap returns once its event is read, not handled, and a
        // region the handler is about to move here must be seen here.
        drop(self.gate.events.read_ok());
        {
            let mut regions = self.folios.regions.write_ok();
            // Never a second region over memory a region has. zmem's own
            // mappings are recorded before a scan can see them, but a
            // mapping the program changes while it is listed (an arena
            // growing) can show up twice, and registering is harmless.
            let taken = regions.values().any(|r| r.mapped_in(addr, addr + len as u64) != Within::Nothing);
            if taken {
                self.folios.tables.fetch_sub(nf * FOLIO_TABLE_BYTES, Ordering::Relaxed);
                log::debug!("not adopting {addr:#x}+{len:#x}: a region has part of it");
                return Ok(None);
            }
            regions.insert((addr, st.id), Arc::clone(&st));
        }
        self.unmapping();
        // Registered once in the table, the tail too (see above).
        if let Err(e) = self.uffd.register(addr, full as u64, self.register_mode()) {
            self.folios.regions.write_ok().remove(&(addr, st.id));
            self.folios.tables.fetch_sub(nf * FOLIO_TABLE_BYTES, Ordering::Relaxed);
            return Err(e.into());
        }
        // From the first boundary inside the range: a hole (see above).
        let (end, end_full) = (addr + len as u64, addr + full as u64);
        let cut = self.registered_through(addr, end_full, forked);
        if cut < end_full {
            let _ = self.uffd.unregister(cut, end_full - cut);
        }
        if cut < end {
            inc(&self.counters.adoption_cuts);
            log::debug!("{addr:#x}..{end:#x} changed while adopted: not managed from {cut:#x}");
            st.add_hole((cut - addr) as usize, len);
            if cut - addr < fs as u64 {
                // Retired, not just taken out of the table: a fault since
                // the registration may have made a folio Resident and put
                // it on the lists, and reclaim must not move it out of
                // memory that is no longer registered.
                let _ = self.uffd.unregister(addr, cut - addr);
                self.retire(&st);
                return Ok(None);
            }
        }
        inc(&self.counters.adopted_regions);
        log::debug!("adopted {addr:#x}..{:#x} as region {}", addr + len as u64, st.id);
        self.counters.adopted_bytes.fetch_add(len as u64, Ordering::Relaxed);
        // Pages past a cut are a hole of the region: none is taken.
        let upto = if cut < end { (cut - addr) as usize / PAGE_SIZE } else { len / PAGE_SIZE };
        Ok(Some(Registered { st, addr, upto }))
    }

    /// The second half of [`adopt_range_with`](Self::adopt_range_with):
    /// the pages already there, from pagemap. Faults since the
    /// registration were served as in any region; a folio they made
    /// Resident is left as it is.
    #[allow(clippy::type_complexity)]
    fn adopt_registered(
        &self,
        r: Registered,
        has: Option<&[bool]>,
    ) -> Result<(Arc<RegionState>, Option<Vec<bool>>), PagerError> {
        if !self.cfg.inject_adopt_delay.is_zero() {
            std::thread::sleep(self.cfg.inject_adopt_delay);
        }
        let take = self.adopt_pages(&r.st, r.addr, r.st.len, r.upto, has)?;
        if self.usage() > self.high() {
            self.kick_reclaim();
        }
        Ok((r.st, take))
    }

    /// Where the mapping at `addr`, just registered up to `end_full`, ends:
    /// at the first boundary inside the range, or in a forked child
    /// (`forked`) at the first gap (see `adopt_range_with`). `addr` where
    /// it cannot be told.
    fn registered_through(&self, addr: u64, end_full: u64, forked: bool) -> u64 {
        let through = |fd| match forked {
            true => vmas::mapped_through(fd, addr, end_full).map(|e| Some((addr, e))),
            false => vmas::covering(fd, addr),
        };
        match self.maps().and_then(through) {
            Ok(Some((s, e))) if s <= addr => e.min(end_full),
            Ok(_) => addr,
            Err(e) => {
                log::warn!("checking the mapping at {addr:#x} after registering it failed: {e}");
                addr
            }
        }
    }

    /// The pages of `[addr, addr + len)`, just adopted as `st`, as
    /// `/proc/self/pagemap` shows them: each folio with a present page is
    /// Resident (its absent pages get the zero page); in a forked child
    /// (`has`, the parent's snapshot), a page the parent has and this
    /// process lacks is evicted here. Pages from `upto` on are past a cut.
    /// Returns, per page, whether to import the parent's entry.
    fn adopt_pages(
        &self,
        st: &Arc<RegionState>,
        addr: u64,
        len: usize,
        upto: usize,
        has: Option<&[bool]>,
    ) -> Result<Option<Vec<bool>>, PagerError> {
        let pm = PageMap::open()?;
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let pages = len / PAGE_SIZE;
        let mut take = has.map(|_| vec![false; pages]);
        let mut p = 0;
        while p < pages {
            let n = PAGEMAP_CHUNK.min(pages - p);
            let mapped = pm.mapped(addr + (p * PAGE_SIZE) as u64, n)?;
            // In a forked child, what it inherited is its parent's too.
            let shared = match has {
                Some(_) => pm.shared_per(addr + (p * PAGE_SIZE) as u64, n, ppf)?,
                None => Vec::new(),
            };
            for (i, chunk) in mapped.chunks(ppf).enumerate() {
                let f = p / ppf + i;
                // The pages of this folio the parent's snapshot has and this
                // process lacks: evicted here.
                let evicted: Vec<bool> = match has {
                    Some(h) => (0..chunk.len())
                        .map(|j| !chunk[j] && f * ppf + j < upto && h.get(f * ppf + j).copied().unwrap_or(false))
                        .collect(),
                    None => Vec::new(),
                };
                let any_evicted = evicted.contains(&true);
                let present = chunk.iter().any(|&m| m);
                if !present && !any_evicted {
                    continue;
                }
                let (lock, _) = self.stripe(st, f);
                let _g = lock.lock_ok();
                if st.folio(f) != Folio::Never {
                    continue;
                }
                // Unmapped since the registration (the handler read the
                // UNMAP before this lock): what pagemap showed there was
                // the old mapping's, or a new one's, not registered.
                if st.has_holes.load(Ordering::Acquire)
                    && st.holes_in(f * ppf, ppf).is_some_and(|h| !h.contains(&false))
                {
                    continue;
                }
                if !present {
                    st.set_folio(f, Folio::Evicted);
                    if let Some(t) = take.as_mut() {
                        for (j, &e) in evicted.iter().enumerate() {
                            t[f * ppf + j] = e;
                        }
                    }
                    continue;
                }
                match shared.get(i).filter(|s| s.mostly_shared()) {
                    Some(s) => self.became_resident_shared(st, f, s.shared),
                    None => self.became_resident(st, f),
                }
                if any_evicted {
                    let mut mask = 0u64;
                    for (j, &e) in evicted.iter().enumerate().filter(|(_, e)| **e) {
                        if j < 64 {
                            mask |= 1 << j;
                            if let Some(t) = take.as_mut() {
                                t[f * ppf + j] = e;
                            }
                        }
                    }
                    self.set_swapped(st, f, mask);
                }
                let filled: Vec<bool> =
                    (0..chunk.len()).map(|j| chunk[j] || evicted.get(j).copied().unwrap_or(false)).collect();
                self.zero_absent(st, f, &filled);
            }
            p += n;
        }
        Ok(take)
    }

    /// Folio `f` of `st`, just adopted as Resident because some of its
    /// pages are present (`present`): its other pages were never touched,
    /// and get the zero page now, in one ioctl per run, as the kernel's
    /// fault would give them. Left alone, each cost a fault round trip on
    /// its first touch (Python: ~1,100 a run, 60-100 µs each). A page
    /// touched meanwhile (EEXIST) or a pending event (EAGAIN) ends a run
    /// early: its pages fault as before. Never in a hole, so only while
    /// no handler is reading events (as `copy_folio`). The caller holds
    /// the folio's stripe lock.
    fn zero_absent(&self, st: &RegionState, f: usize, present: &[bool]) {
        if present.iter().all(|&m| m) {
            return;
        }
        let Ok(_events) = self.gate.events.try_read() else { return };
        let ppf = present.len();
        let holes = st.holes_in(f * ppf, ppf);
        let absent: Vec<bool> = (0..ppf).map(|j| !present[j] && !holes.as_ref().is_some_and(|h| h[j])).collect();
        let folio_addr = st.start.load(Ordering::Acquire) + (f * self.cfg.folio_size) as u64;
        let mut j = 0;
        while j < ppf {
            let run = absent[j..].iter().take_while(|&&a| a == absent[j]).count();
            if absent[j] {
                let a = folio_addr + (j * PAGE_SIZE) as u64;
                if st.zero_fill(&self.uffd, a, (run * PAGE_SIZE) as u64).is_ok() {
                    self.counters.adopted_zero_pages.fetch_add(run as u64, Ordering::Relaxed);
                }
            }
            j += run;
        }
    }

    /// Forgets an adopted region the program has unmapped all of.
    pub(super) fn retire(&self, st: &Arc<RegionState>) {
        let base = st.start.load(Ordering::Acquire);
        if self.folios.regions.write_ok().remove(&(base, st.id)).is_none() {
            return;
        }
        for f in 0..st.state.len() {
            let (lock, _) = self.stripe(st, f);
            let _g = lock.lock_ok();
            // Pages dropped half a folio at a time leave it Resident; an
            // Evicting one is finished by its evictor, which drops the
            // entries of what was unmapped meanwhile.
            match st.folio(f) {
                Folio::Resident => {
                    st.set_folio(f, Folio::Never);
                    self.acct.resident.fetch_sub(1, Ordering::Relaxed);
                    self.folios.dropped.lock_ok().remove(&(st.id, f));
                    let swapped = self.clear_swapped(st, f, u64::MAX);
                    if st.cached[f].swap(false, Ordering::Relaxed) || swapped != 0 {
                        self.invalidate_folio(st, f);
                    }
                }
                Folio::Evicted => {
                    st.set_folio(f, Folio::Never);
                    self.invalidate_folio(st, f);
                }
                _ => {}
            }
        }
        self.folios.tables.fetch_sub(st.state.len() * FOLIO_TABLE_BYTES, Ordering::Relaxed);
        log::debug!("retired region {} at {base:#x}", st.id);
        inc(&self.counters.retired_regions);
    }

    /// Gives every adopted region back to the program whole: its evicted
    /// folios loaded, unregistered, forgotten. Reclaim must be stopped.
    pub(super) fn release_adopted(&self) {
        let adopted: Vec<_> = self.folios.regions.read_ok().values().filter(|r| r.adopted).cloned().collect();
        let mut bounce = vec![0u8; self.cfg.folio_size];
        for st in adopted {
            self.give_back(&st, &mut bounce);
        }
    }

    /// Gives adopted region `st` back to the program: its evicted folios
    /// loaded, what it maps unregistered, the region forgotten. Until it
    /// is unregistered, a fault there is still served as the region's.
    /// The caller keeps reclaim from isolating.
    pub(super) fn give_back(&self, st: &Arc<RegionState>, bounce: &mut [u8]) {
        self.load_region(st, bounce, false);
        let base = st.start.load(Ordering::Acquire);
        for (a, b) in st.mapped_parts() {
            let _ = self.uffd.unregister(base + a as u64, (b - a) as u64);
        }
        self.retire(st);
    }

    /// Loads every Evicted folio of `st` back into the program, as a fault
    /// would (`fork` counts them). The caller keeps reclaim from isolating.
    pub(super) fn load_region(&self, st: &Arc<RegionState>, bounce: &mut [u8], fork: bool) {
        self.load_folios(st, 0..st.state.len(), bounce, fork);
    }

    fn load_folios(&self, st: &Arc<RegionState>, folios: std::ops::Range<usize>, bounce: &mut [u8], fork: bool) {
        for f in folios {
            loop {
                let (lock, _) = self.stripe(st, f);
                let g = lock.lock_ok();
                // Evicted, or Resident with pages a partial load left in
                // the tier.
                let want = match st.folio(f) {
                    Folio::Evicted => None,
                    Folio::Resident if st.swapped[f].load(Ordering::Relaxed) != 0 => {
                        Some(st.swapped[f].load(Ordering::Relaxed))
                    }
                    _ => break,
                };
                let r = self.load_pages(st, f, want, bounce, if fork { Load::Fork } else { Load::Back });
                drop(g);
                if r != Served::Again {
                    if fork {
                        inc(&self.counters.fork_loads);
                    }
                    break;
                }
                // An event is unread: the handler reads it, then the COPY
                // goes through.
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

/// The intervals of sorted, disjoint `set` that overlap `[a, b)`.
fn overlapping(set: &[(u64, u64)], a: u64, b: u64) -> &[(u64, u64)] {
    let first = set.partition_point(|&(_, e)| e <= a);
    let last = first + set[first..].partition_point(|&(s, _)| s < b);
    &set[first..last]
}

/// Takes `[a, b)` out of the sorted, disjoint `pieces`.
fn subtract(pieces: &mut Vec<(u64, u64)>, a: u64, b: u64) {
    let mut out = Vec::with_capacity(pieces.len() + 1);
    for &(s, e) in pieces.iter() {
        if b <= s || e <= a {
            out.push((s, e));
            continue;
        }
        if s < a {
            out.push((s, a));
        }
        if b < e {
            out.push((b, e));
        }
    }
    *pieces = out;
}

#[cfg(test)]
mod tests {
    use super::subtract;

    #[test]
    fn overlapping_finds_what_touches_a_range() {
        let set = [(10, 20), (30, 40), (50, 60)];
        assert_eq!(super::overlapping(&set, 0, 10), &[] as &[(u64, u64)]);
        assert_eq!(super::overlapping(&set, 0, 11), &[(10, 20)]);
        assert_eq!(super::overlapping(&set, 19, 31), &[(10, 20), (30, 40)]);
        assert_eq!(super::overlapping(&set, 20, 30), &[] as &[(u64, u64)]);
        assert_eq!(super::overlapping(&set, 55, 100), &[(50, 60)]);
    }

    #[test]
    fn subtract_cuts_holes_and_ends() {
        let mut p = vec![(0, 100)];
        subtract(&mut p, 10, 20);
        assert_eq!(p, vec![(0, 10), (20, 100)]);
        subtract(&mut p, 0, 5);
        subtract(&mut p, 90, 200);
        assert_eq!(p, vec![(5, 10), (20, 90)]);
        subtract(&mut p, 8, 30);
        assert_eq!(p, vec![(5, 8), (30, 90)]);
        subtract(&mut p, 0, 1000);
        assert!(p.is_empty());
    }
}
