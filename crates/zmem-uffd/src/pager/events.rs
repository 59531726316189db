//! Events: the program dropped (madvise, munmap) or moved (mremap) memory.

use std::sync::atomic::Ordering;
use zmem_common::{LockExt, RwLockExt};

use super::{Folio, Inner};
use crate::mapping::PAGE_SIZE;

impl Inner {
    /// The program unmapped `[start, end)`: the parts of regions in it are
    /// recorded, so that dropping a region never unmaps what the kernel
    /// has since placed there.
    pub(super) fn note_unmapped(&self, start: u64, end: u64) {
        let regions = self.regions.read_ok();
        for st in regions.values() {
            let base = st.start.load(Ordering::Acquire);
            let (a, b) = (start.max(base), end.min(base + st.len as u64));
            if a < b {
                st.unmapped.lock_ok().push(((a - base) as usize, (b - base) as usize));
            }
        }
    }

    pub(super) fn drop_range(&self, start: u64, end: u64) {
        let Some(st) = self.region_at(start) else { return };
        let base = st.start.load(Ordering::Acquire);
        let first_page = ((start - base) / PAGE_SIZE as u64) as usize;
        let last_page = ((end.min(base + st.len as u64) - base).div_ceil(PAGE_SIZE as u64)) as usize;
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        for f in first_page / ppf..last_page.div_ceil(ppf) {
            let (lock, _) = self.stripe(&st, f);
            let g = lock.lock_ok();
            let pages = (f * ppf).max(first_page)..((f + 1) * ppf).min(last_page);
            if st.folio(f) == Folio::Evicting {
                // The evictor drops these pages' entries when it finishes
                // (this thread must not wait for it: see `fault`).
                let mut d = self.dropped.lock_ok();
                let mask = d.entry((st.id, f)).or_insert_with(|| vec![false; ppf]);
                mask[pages.start - f * ppf..pages.end - f * ppf].fill(true);
                continue;
            }
            for p in pages.clone() {
                self.tier.invalidate(st.key(p));
            }
            if let Some(h) = self.held.lock_ok().get_mut(&(st.id, f)) {
                h.present[pages.start - f * ppf..pages.end - f * ppf].fill(false);
            }
            let whole = first_page <= f * ppf && (f + 1) * ppf <= last_page;
            // A whole folio dropped is as if never touched; a resident folio
            // partly dropped stays resident (its dropped pages fault to zero).
            if whole && st.swap_folio(f, Folio::Never) == Folio::Resident {
                self.resident.fetch_sub(1, Ordering::Relaxed);
            }
            drop(g);
        }
    }

    /// A whole region moved: entries are region-relative, so only its
    /// address changes.
    pub(super) fn remap(&self, from: u64, to: u64, len: u64) {
        let mut regions = self.regions.write_ok();
        if let Some(st) = regions.remove(&from) {
            if st.len as u64 == len {
                st.start.store(to, Ordering::Release);
                regions.insert(to, st);
            } else {
                log::warn!("a partial mremap of a managed region is not supported; its entries are dropped");
                drop(regions);
                let fs = self.cfg.folio_size;
                for f in 0..st.len / fs {
                    self.invalidate_folio(&st, f);
                }
            }
        }
    }
}
