//! The pager's counters.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Pager;
use zmem_common::PAGE_SIZE;

/// Buckets of [`PagerStats::refault_distance`].
pub const REFAULT_BUCKETS: usize = 7;

/// The [`PagerStats::refault_distance`] bucket of a load `distance` folios
/// after its eviction, with `resident` folios resident.
pub(super) fn refault_bucket(distance: usize, resident: usize) -> usize {
    (0..REFAULT_BUCKETS - 1).find(|&i| distance < resident >> (REFAULT_BUCKETS - 2 - i)).unwrap_or(REFAULT_BUCKETS - 1)
}

/// The upper bounds of the first [`PagerStats::refault_distance`] buckets,
/// as shares of the resident folios (the last bucket has none).
const REFAULT_BOUNDS: [f64; REFAULT_BUCKETS - 1] = [1.0 / 32.0, 1.0 / 16.0, 1.0 / 8.0, 0.25, 0.5, 1.0];

/// How many of the loads counted in `hist` (by refault distance) came
/// within `share` of the resident folios, each bucket taken as spread
/// evenly over its range. Past the resident set's size the distances are
/// not told apart: no more than the bounded buckets are counted.
pub fn refaults_within(hist: &[u64; REFAULT_BUCKETS], share: f64) -> f64 {
    let mut low = 0.0;
    let mut n = 0.0;
    for (i, &high) in REFAULT_BOUNDS.iter().enumerate() {
        if share >= high {
            n += hist[i] as f64;
        } else if share > low {
            n += hist[i] as f64 * (share - low) / (high - low);
        }
        low = high;
    }
    n
}

/// An estimate of the stall (ns) a program with `stall_ns` of it, and
/// loads of the refault distances in `hist`, would have had at `factor`
/// times its limit: the cold-age reasoning of the far-memory papers, from
/// the distances zmem records (mm/workingset.c's).
///
/// - Larger (`factor` > 1): the resident set grows by about `factor - 1`
///   of itself (the pool keeps its share), and a load whose refault
///   distance is within that would have been a hit.
/// - Smaller: reads of resident pages are invisible, so the re-reads that
///   a smaller resident set would miss are taken to be as many as the
///   loads the same step larger would save (the density of reuse distances
///   is taken as even around the resident set's size).
///
/// Each load saved or added costs the stall's mean per load. With no loads
/// there is nothing to go by, and the stall is given as it is.
pub fn stall_at_limit(factor: f64, stall_ns: u64, hist: &[u64; REFAULT_BUCKETS]) -> u64 {
    let loads: u64 = hist.iter().sum();
    if loads == 0 || factor.is_nan() || factor <= 0.0 {
        return stall_ns;
    }
    let per_load = stall_ns as f64 / loads as f64;
    let moved = refaults_within(hist, (factor - 1.0).abs()) * per_load;
    let est = if factor >= 1.0 { stall_ns as f64 - moved } else { stall_ns as f64 + moved };
    est.max(0.0) as u64
}

/// Counters of a pager. Serialized as they are named here: the `pager`
/// object of a process's stats file (`zmem stats`).
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PagerStats {
    /// Faults on never-touched folios, resolved with the zero page.
    pub zero_faults: u64,
    /// Faults that loaded a folio from the tier.
    pub load_faults: u64,
    /// Faults on a resident folio: a page the program dropped, or a second
    /// fault on a folio that another fault just brought in.
    pub dropped_page_faults: u64,
    /// Faults that waited for an eviction to finish (each counted once,
    /// however often it was looked at again)…
    pub eviction_waits: u64,
    /// …and how long they waited, from the first look that found their
    /// folio Evicting to the one that served them: a fault on a folio
    /// whose pass is being stored waits for the whole pass.
    pub eviction_wait_ns: u64,
    /// Folios a fault took back from staging while their pass was being
    /// stored (`Inner::rescue`): they stay resident, and the pass's
    /// entries for them are dropped.
    pub rescued_folios: u64,
    /// Faults that loaded a folio back soon after its eviction (a refault
    /// distance under the resident folios): it earns looks it passes as
    /// accessed.
    pub workingset_refaults: u64,
    /// Loads of evicted folios by refault distance (the folios evicted
    /// between a folio's eviction and its load), as a share of the resident
    /// folios at the load: under 1/32, 1/16, 1/8, 1/4, 1/2, 1, and the
    /// rest. A load in the first buckets is a folio reclaim took while it
    /// was in use: a read of a resident page is invisible here (no
    /// accessed bit), so CLOCK saw it cold.
    pub refault_distance: [u64; REFAULT_BUCKETS],
    /// Faults outside every region (a region being dropped, or zmem
    /// touching its own staging: a bug), answered with a zero page.
    pub stray_faults: u64,
    pub evicted_folios: u64,
    /// Folios whose store was rejected and which were put back.
    pub eviction_rejects: u64,
    pub direct_reclaim_waits: u64,
    /// Store requests (a folio, or a run of one) of a reclaim pass that a
    /// fault waiting for reclaim stored itself (`direct.rs`).
    pub direct_reclaim_stores: u64,
    /// Times the limit turned soft: usage was over it and a reclaim pass
    /// could evict nothing (the pool full with writeback off or failing,
    /// or nothing evictable). Reclaim then backs off and faults stop
    /// waiting for it, as under memory.high.
    pub limit_soft_events: u64,
    /// Whether the limit is soft now.
    pub limit_soft: bool,
    /// Folios whose pages could not be moved out (mlocked, pinned): they
    /// stay resident and are never stored or written back.
    pub unevictable_folios: u64,
    /// Bytes of folios whose store was rejected, kept uncompressed until
    /// they are faulted in again.
    pub held_bytes: u64,
    /// Times new stores switched codec (`PagerConfig::strong_codec`).
    pub codec_switches: u64,
    /// Faults on evicted folios that continued a sequential stream (they
    /// load whole folios, and read ahead: `readahead_folios`).
    pub walk_load_faults: u64,
    /// Pages that failed to load (a corrupt swap slot, an I/O error): they
    /// are poisoned, so the program gets SIGBUS there instead of wrong data.
    pub poisoned_pages: u64,
    /// Folio moves where UFFDIO_MOVE's count of what moved was wrong, and
    /// the staging slot's page tables were believed instead (a Linux 6.18
    /// bug; see `move_span`).
    pub move_recounts: u64,
    /// Times a handler pinned itself to the CPU of the thread that took
    /// most of its faults (`PagerConfig::handler_follow`), and times it let
    /// the scheduler place it again.
    pub handler_follows: u64,
    pub handler_releases: u64,
    /// Faults served with the thread held on the handler's CPU
    /// (`PagerConfig::handler_hold`).
    pub handler_holds: u64,
    /// Folios loaded back before a fork, so that the child's copy is whole.
    pub fork_loads: u64,
    /// Forked children handed their memory (`fork_event`), faults of theirs
    /// served before, and pages a child imported from its parent.
    pub fork_handovers: u64,
    pub fork_child_faults: u64,
    pub fork_imported_pages: u64,
    /// Folios loaded ahead of sequential faults (`readahead.rs`, `ReadAhead`).
    pub readahead_folios: u64,
    /// Never-touched folios given zeros ahead of sequential write faults.
    pub zero_ahead_folios: u64,
    /// Victims taken from the once list: folios a walk of loads went past
    /// (`lru.rs`, `Lru::once`).
    pub walk_evictions: u64,
    /// Victims taken without a look, in list order, because every folio
    /// looked at within the pass's budget was accessed (`Lru::isolate`):
    /// reclaim is evicting a working set larger than the limit.
    pub unlooked_evictions: u64,
    /// Adoptions whose range changed between the scan and the
    /// registration: the changed part was left unmanaged (`adopt_range`).
    pub adoption_cuts: u64,
    /// Regions adopted from a mapping an mremap had just moved, before
    /// its REMAP was read: the moved regions take the range back.
    pub early_adoptions: u64,
    /// Folios that could not move because a forked child shares their
    /// pages, given their own copy (`MADV_POPULATE_WRITE`) to move later.
    pub cow_breaks: u64,
    /// Scans of the address space for mappings to adopt (`adopt.rs`).
    pub mapping_scans: u64,
    /// Mappings the program made that the pager adopted, and their bytes.
    pub adopted_regions: u64,
    pub adopted_bytes: u64,
    /// Adopted regions forgotten because the program unmapped all of them
    /// (or changed their mapping while they were being adopted).
    pub retired_regions: u64,
    /// Regions split off by an mremap that moved part of a region: the
    /// moved part, managed at its new address with its entries.
    pub split_regions: u64,
    /// Write-tracking checks (a read-only PAGEMAP_SCAN of one folio CLOCK
    /// passes).
    pub write_scans: u64,
    /// Sweeps that write-protected every resident folio again, so that
    /// later checks see only the writes after them (`lru.rs`).
    pub write_sweeps: u64,
    /// Folios found written, which CLOCK then passes over once.
    pub written_folios: u64,
    /// Reclaim passes that moved folios out to store them.
    pub reclaim_passes: u64,
    /// Times the staging area was freed (`MADV_DONTNEED`, a TLB
    /// shootdown): once several passes filled it, or at the end of a burst
    /// of reclaim (`staging.rs`).
    pub staging_frees: u64,
    /// Folios found mostly shared with another process (a fork) and set
    /// aside, not evicted and their shared pages charged to no one, until they
    /// are mostly this process's own again.
    pub shared_parks: u64,
    /// Bytes of shared pages in the folios set aside now.
    pub shared_bytes: u64,
    /// Bytes mapped in resident folios (pages a partial load left in the
    /// tier not counted).
    pub resident_bytes: u64,
    /// Faults on an evicted folio that loaded only the pages around the
    /// faulting one (`PagerConfig::fault_around`): a fault that continued
    /// no read-ahead stream.
    pub partial_load_faults: u64,
    /// Faults on an evicted folio that loaded it whole, not partly,
    /// because its last partial load was followed by faults on all the
    /// rest of it (`RegionState::dense`).
    pub dense_load_faults: u64,
    /// Folios whose partial load the program followed with faults on
    /// every page it left in the tier; `filled_soon_folios` of them within
    /// an eighth of a turn of the resident folios (`RegionState::dense`).
    pub filled_folios: u64,
    pub filled_soon_folios: u64,
    /// Faults on a page a partial load left in the tier.
    pub swapped_page_faults: u64,
    /// Faults that loaded pages from the tier and read none from the swap
    /// file, and the handler's time on their loads (`load_pages`), ns.
    pub pool_load_faults: u64,
    pub pool_load_fault_ns: u64,
    /// Faults that read pages from the swap file too, and the same time.
    pub swap_load_faults: u64,
    pub swap_load_fault_ns: u64,
    /// Time faults waited in the throttle above the limit (direct
    /// reclaim), ns.
    pub throttle_ns: u64,
    /// The program's stall on the limit, ns: the time its faults spent on
    /// loads (`pool_load_fault_ns`, `swap_load_fault_ns`), waiting for an
    /// eviction (`eviction_wait_ns`) and in the throttle (`throttle_ns`).
    /// Faults on never-touched memory are not in it: the program pays
    /// them whatever the limit. What `zmem run --max-slowdown` holds near
    /// its target, as a share of the program's CPU time.
    pub stall_ns: u64,
    /// Pages reclaim passes stored, and the passes' time storing them (ns,
    /// wall: the compression an eviction costs).
    pub reclaim_store_pages: u64,
    pub reclaim_store_ns: u64,
    /// Bytes of resident folios' pages left in the tier by partial loads.
    pub swapped_bytes: u64,
    /// Pages a load stepped over because the program was dropping them
    /// (a REMOVE or UNMAP read, its `drop_range` not yet done).
    pub fenced_pages: u64,
    /// Never-touched pages of folios partly present at adoption that got
    /// the zero page then (`zero_absent`), rather than a fault each later.
    pub adopted_zero_pages: u64,
    /// Pages after a stray fault that got the zero page with it
    /// (`zero_stray_ahead`).
    pub stray_zero_pages: u64,
    /// The pager's metadata: its folio tables, the CLOCK queue and the
    /// tier's entries (an estimate).
    pub metadata_bytes: u64,
    /// `metadata_bytes` in its parts: the regions' folio tables,
    pub metadata_folio_table_bytes: u64,
    /// the reclaim lists' items,
    pub metadata_reclaim_list_bytes: u64,
    /// the tier's tree blocks (16 entries each),
    pub metadata_tier_block_bytes: u64,
    /// the tier's LRU items (one per block),
    pub metadata_tier_lru_bytes: u64,
    /// and the page hashes of kept swap entries.
    pub metadata_kept_hash_bytes: u64,
    /// Bytes of the regions the pager manages now (from their folio tables).
    pub managed_bytes: u64,
    /// `metadata_bytes` per managed 4 KiB page (zram's table entry is 16 B).
    pub metadata_bytes_per_page: f64,
    /// Resident bytes plus the pool plus metadata: what the limit bounds.
    pub usage_bytes: u64,
    /// The limit that applies now: the configured one, or in a process
    /// tree this process's share of the tree's.
    pub limit_bytes: u64,
    /// The pool's share of that limit now, percent (zswap's parameter;
    /// it moves when `PagerConfig::pool_balance` is on: `balance.rs`).
    pub max_pool_percent: u32,
    /// Whether CLOCK's referenced bits are refreshed from write tracking.
    pub tracking_writes: bool,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) zero_faults: AtomicU64,
    pub(super) load_faults: AtomicU64,
    pub(super) dropped_page_faults: AtomicU64,
    pub(super) eviction_waits: AtomicU64,
    pub(super) eviction_wait_ns: AtomicU64,
    pub(super) rescued_folios: AtomicU64,
    pub(super) workingset_refaults: AtomicU64,
    pub(super) refault_distance: [AtomicU64; REFAULT_BUCKETS],
    pub(super) stray_faults: AtomicU64,
    pub(super) evicted_folios: AtomicU64,
    pub(super) eviction_rejects: AtomicU64,
    pub(super) direct_reclaim_waits: AtomicU64,
    pub(super) direct_reclaim_stores: AtomicU64,
    pub(super) limit_soft_events: AtomicU64,
    pub(super) unevictable_folios: AtomicU64,
    pub(super) poisoned_pages: AtomicU64,
    pub(super) move_recounts: AtomicU64,
    pub(super) handler_follows: AtomicU64,
    pub(super) handler_releases: AtomicU64,
    pub(super) handler_holds: AtomicU64,
    pub(super) fork_loads: AtomicU64,
    pub(super) fork_handovers: AtomicU64,
    pub(super) fork_child_faults: AtomicU64,
    pub(super) fork_imported_pages: AtomicU64,
    pub(super) readahead_folios: AtomicU64,
    pub(super) walk_evictions: AtomicU64,
    pub(super) unlooked_evictions: AtomicU64,
    pub(super) zero_ahead_folios: AtomicU64,
    pub(super) adoption_cuts: AtomicU64,
    pub(super) early_adoptions: AtomicU64,
    pub(super) cow_breaks: AtomicU64,
    pub(super) shared_parks: AtomicU64,
    pub(super) mapping_scans: AtomicU64,
    pub(super) adopted_regions: AtomicU64,
    pub(super) adopted_bytes: AtomicU64,
    pub(super) retired_regions: AtomicU64,
    pub(super) split_regions: AtomicU64,
    pub(super) write_scans: AtomicU64,
    pub(super) write_sweeps: AtomicU64,
    pub(super) written_folios: AtomicU64,
    pub(super) reclaim_passes: AtomicU64,
    pub(super) staging_frees: AtomicU64,
    pub(super) partial_load_faults: AtomicU64,
    pub(super) dense_load_faults: AtomicU64,
    pub(super) filled_folios: AtomicU64,
    pub(super) filled_soon_folios: AtomicU64,
    pub(super) swapped_page_faults: AtomicU64,
    pub(super) pool_load_faults: AtomicU64,
    pub(super) pool_load_fault_ns: AtomicU64,
    pub(super) swap_load_faults: AtomicU64,
    pub(super) swap_load_fault_ns: AtomicU64,
    pub(super) throttle_ns: AtomicU64,
    pub(super) stall_ns: AtomicU64,
    pub(super) reclaim_store_pages: AtomicU64,
    pub(super) reclaim_store_ns: AtomicU64,
    pub(super) fenced_pages: AtomicU64,
    pub(super) adopted_zero_pages: AtomicU64,
    pub(super) stray_zero_pages: AtomicU64,
    pub(super) codec_switches: AtomicU64,
    pub(super) walk_load_faults: AtomicU64,
}

pub(super) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl super::Inner {
    /// A fault waited `ns` on the limit: a load, an eviction, the
    /// throttle (`PagerStats::stall_ns`). Counted here and in the tree's
    /// slot, where `zmem run --max-slowdown` reads it.
    pub(super) fn stalled(&self, ns: u64) {
        self.counters.stall_ns.fetch_add(ns, Ordering::Relaxed);
        if let Some(m) = &self.acct.member {
            m.add_stall(ns);
        }
    }
}

impl Pager {
    /// The process tree this pager shares its limit with, if any.
    pub fn tree(&self) -> Option<&crate::tree::Tree> {
        self.inner.acct.member.as_ref().map(crate::tree::Member::tree)
    }

    /// The process is exiting: its usage leaves its tree's count at once
    /// ([`crate::tree::Member::leave`]). Atomics only, for an exit handler.
    pub fn leave_tree(&self) {
        if let Some(m) = &self.inner.acct.member {
            m.leave();
        }
    }

    pub fn stats(&self) -> PagerStats {
        let c = &self.inner.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let folios = self.inner.folios.tables.load(Ordering::Relaxed) / super::region::FOLIO_TABLE_BYTES;
        let managed_bytes = (folios * self.inner.cfg.folio_size) as u64;
        // The parts read once, so that they add up to `metadata_bytes`.
        let (tables, lists) = (self.inner.folios.tables.load(Ordering::Relaxed), self.inner.list_metadata());
        let tier_parts = self.inner.tier.entry_metadata_parts();
        let metadata = tables + lists + tier_parts.0 + tier_parts.1 + tier_parts.2;
        PagerStats {
            zero_faults: r(&c.zero_faults),
            adoption_cuts: r(&c.adoption_cuts),
            early_adoptions: r(&c.early_adoptions),
            readahead_folios: r(&c.readahead_folios),
            walk_evictions: r(&c.walk_evictions),
            unlooked_evictions: r(&c.unlooked_evictions),
            zero_ahead_folios: r(&c.zero_ahead_folios),
            load_faults: r(&c.load_faults),
            dropped_page_faults: r(&c.dropped_page_faults),
            eviction_waits: r(&c.eviction_waits),
            eviction_wait_ns: r(&c.eviction_wait_ns),
            rescued_folios: r(&c.rescued_folios),
            workingset_refaults: r(&c.workingset_refaults),
            refault_distance: std::array::from_fn(|i| r(&c.refault_distance[i])),
            stray_faults: r(&c.stray_faults),
            evicted_folios: r(&c.evicted_folios),
            eviction_rejects: r(&c.eviction_rejects),
            direct_reclaim_waits: r(&c.direct_reclaim_waits),
            direct_reclaim_stores: r(&c.direct_reclaim_stores),
            limit_soft_events: r(&c.limit_soft_events),
            limit_soft: self.inner.acct.soft.load(Ordering::Relaxed),
            unevictable_folios: r(&c.unevictable_folios),
            held_bytes: self.inner.folios.held_bytes.load(Ordering::Relaxed) as u64,
            codec_switches: r(&c.codec_switches),
            walk_load_faults: r(&c.walk_load_faults),
            poisoned_pages: r(&c.poisoned_pages),
            move_recounts: r(&c.move_recounts),
            handler_follows: r(&c.handler_follows),
            handler_releases: r(&c.handler_releases),
            handler_holds: r(&c.handler_holds),
            fork_loads: r(&c.fork_loads),
            fork_handovers: r(&c.fork_handovers),
            fork_child_faults: r(&c.fork_child_faults),
            fork_imported_pages: r(&c.fork_imported_pages),
            cow_breaks: r(&c.cow_breaks),
            shared_parks: r(&c.shared_parks),
            shared_bytes: (self.inner.lists.shared_pages.load(Ordering::Relaxed) * PAGE_SIZE) as u64,
            mapping_scans: r(&c.mapping_scans),
            adopted_regions: r(&c.adopted_regions),
            adopted_bytes: r(&c.adopted_bytes),
            retired_regions: r(&c.retired_regions),
            split_regions: r(&c.split_regions),
            write_scans: r(&c.write_scans),
            write_sweeps: r(&c.write_sweeps),
            written_folios: r(&c.written_folios),
            reclaim_passes: r(&c.reclaim_passes),
            staging_frees: r(&c.staging_frees),
            resident_bytes: self.inner.resident_bytes() as u64,
            swapped_bytes: (self.inner.folios.swapped_pages.load(Ordering::Relaxed) * PAGE_SIZE) as u64,
            partial_load_faults: r(&c.partial_load_faults),
            dense_load_faults: r(&c.dense_load_faults),
            filled_folios: r(&c.filled_folios),
            filled_soon_folios: r(&c.filled_soon_folios),
            swapped_page_faults: r(&c.swapped_page_faults),
            pool_load_faults: r(&c.pool_load_faults),
            pool_load_fault_ns: r(&c.pool_load_fault_ns),
            swap_load_faults: r(&c.swap_load_faults),
            swap_load_fault_ns: r(&c.swap_load_fault_ns),
            throttle_ns: r(&c.throttle_ns),
            stall_ns: r(&c.stall_ns),
            reclaim_store_pages: r(&c.reclaim_store_pages),
            reclaim_store_ns: r(&c.reclaim_store_ns),
            fenced_pages: r(&c.fenced_pages),
            adopted_zero_pages: r(&c.adopted_zero_pages),
            stray_zero_pages: r(&c.stray_zero_pages),
            metadata_bytes: metadata as u64,
            metadata_folio_table_bytes: tables as u64,
            metadata_reclaim_list_bytes: lists as u64,
            metadata_tier_block_bytes: tier_parts.0 as u64,
            metadata_tier_lru_bytes: tier_parts.1 as u64,
            metadata_kept_hash_bytes: tier_parts.2 as u64,
            managed_bytes,
            metadata_bytes_per_page: if managed_bytes == 0 {
                0.0
            } else {
                metadata as f64 / (managed_bytes / PAGE_SIZE as u64) as f64
            },
            usage_bytes: self.inner.usage() as u64,
            limit_bytes: self.inner.limit() as u64,
            max_pool_percent: self.inner.pool_percent(),
            tracking_writes: self.inner.tracking,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refault_buckets_are_shares_of_the_resident_folios() {
        let r = 3200;
        assert_eq!(refault_bucket(0, r), 0);
        assert_eq!(refault_bucket(99, r), 0); // < 1/32
        assert_eq!(refault_bucket(100, r), 1); // 1/32
        assert_eq!(refault_bucket(399, r), 2); // < 1/8
        assert_eq!(refault_bucket(800, r), 4); // 1/4
        assert_eq!(refault_bucket(1599, r), 4);
        assert_eq!(refault_bucket(1600, r), 5); // 1/2
        assert_eq!(refault_bucket(3199, r), 5);
        assert_eq!(refault_bucket(3200, r), 6); // >= 1
                                                // Nothing resident: every load is past it.
        assert_eq!(refault_bucket(0, 0), 6);
        assert_eq!(refault_bucket(5, 0), 6);
    }

    #[test]
    fn refaults_within_a_share_count_whole_buckets_and_a_part_of_the_next() {
        let h = [32, 32, 64, 128, 256, 512, 1000];
        assert_eq!(refaults_within(&h, 0.0), 0.0);
        assert_eq!(refaults_within(&h, 1.0 / 32.0), 32.0);
        // Half of [1/4, 1/2): 3/8.
        assert_eq!(refaults_within(&h, 0.375), 32.0 + 32.0 + 64.0 + 128.0 + 128.0);
        // Past the resident set: the bounded buckets only.
        assert_eq!(refaults_within(&h, 3.0), 1024.0);
    }

    #[test]
    fn a_larger_limit_saves_the_near_refaults_and_a_smaller_one_adds_as_many() {
        // 1000 loads, 10 ms of stall: 10 us each; 250 within a quarter.
        let h = [50, 50, 50, 100, 250, 250, 250];
        let stall = 10_000_000;
        assert_eq!(stall_at_limit(1.25, stall, &h), 7_500_000);
        assert_eq!(stall_at_limit(0.75, stall, &h), 12_500_000);
        assert_eq!(stall_at_limit(0.5, stall, &h), 15_000_000);
        assert_eq!(stall_at_limit(1.0, stall, &h), stall);
        // Every load near: twice the memory saves them all, never below 0.
        assert_eq!(stall_at_limit(3.0, stall, &[1000, 0, 0, 0, 0, 0, 0]), 0);
        // No loads: nothing to go by.
        assert_eq!(stall_at_limit(0.5, 42, &[0; REFAULT_BUCKETS]), 42);
    }
}
