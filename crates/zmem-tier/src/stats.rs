//! Counters, under zswap's debugfs names (and `zswpout`, `zswpin`, `zswpwb`
//! from /proc/vmstat), exported as a struct, JSON and Prometheus text.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub stored_pages: AtomicU64,
    pub stored_incompressible_pages: AtomicU64,
    pub same_filled_pages: AtomicU64,
    pub written_back_pages: AtomicU64,
    /// Entries now in the swap file.
    pub swap_pages: AtomicU64,
    pub pool_limit_hit: AtomicU64,
    pub reject_compress_poor: AtomicU64,
    pub reject_compress_fail: AtomicU64,
    pub reject_alloc_fail: AtomicU64,
    pub reject_reclaim_fail: AtomicU64,
    pub decompress_fail: AtomicU64,
    pub zswpout: AtomicU64,
    pub zswpin: AtomicU64,
    pub pswpin: AtomicU64,
    pub swap_refaults: AtomicU64,
    pub cold_pool_loads: AtomicU64,
    pub cached_pages: AtomicU64,
    pub cached_reused: AtomicU64,
    pub cached_dropped: AtomicU64,
    pub recompressed_pages: AtomicU64,
}

pub(crate) fn inc(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn dec(c: &AtomicU64, n: u64) {
    c.fetch_sub(n, Ordering::Relaxed);
}

/// A snapshot of the tier's counters.
///
/// Gauges: `stored_pages` (entries in the pool or kept as same-filled
/// markers), `pool_total_size`, `stored_incompressible_pages`,
/// `same_filled_pages`, `swap_pages`, `pools`. Everything else counts events
/// since the tier was made.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TierStats {
    pub stored_pages: u64,
    pub pool_total_size: u64,
    pub stored_incompressible_pages: u64,
    pub same_filled_pages: u64,
    pub written_back_pages: u64,
    pub pool_limit_hit: u64,
    pub reject_compress_poor: u64,
    pub reject_compress_fail: u64,
    pub reject_alloc_fail: u64,
    pub reject_reclaim_fail: u64,
    pub decompress_fail: u64,
    pub zswpout: u64,
    pub zswpin: u64,
    /// Pages loaded from the swap file (vmstat's `pswpin`): misses a
    /// larger pool would have served.
    pub pswpin: u64,
    /// Of those, pages written back recently enough that a somewhat larger
    /// pool would have kept them (`Tier::set_swap_refault_window`; by
    /// default, a pool twice as large): the refault distance of
    /// mm/workingset.c, counted in pages written back.
    pub swap_refaults: u64,
    /// Pages loaded from the pool that were among its oldest entries
    /// (within the same window of its cold end): a pool that much smaller
    /// would have written them back, and they would have come from the
    /// swap file.
    pub cold_pool_loads: u64,
    pub zswpwb: u64,
    /// Pages now in the swap file (entries: several share a slot).
    pub swap_pages: u64,
    /// Slots of the swap file in use (4 KiB each).
    pub swap_slots: u64,
    /// Bytes written to the swap file, for `written_back_pages` pages:
    /// compressed writeback packs several pages per slot.
    pub swap_written_bytes: u64,
    /// Slots of the swap file read ahead of the loads that wanted them
    /// (swap-in read-ahead: `SwapFile::prefetch`), and slot reads that
    /// found theirs read already.
    pub swap_readahead_blocks: u64,
    pub swap_readahead_hits: u64,
    /// Pool entries kept as the clean copy of a page that is mapped again
    /// (`Tier::retain_clean`).
    pub cached_pages: u64,
    /// Pages stored again by keeping their cached entry: unchanged since
    /// they were loaded, so nothing was compressed.
    pub cached_reused: u64,
    /// Cached entries freed: by the shrinker (instead of writing them back)
    /// or because the page was written.
    pub cached_dropped: u64,
    /// Entries moved to a stronger compressor's pool (`Tier::recompress`),
    /// zram's `recompress`.
    pub recompressed_pages: u64,
    /// Pools alive: the current one and old ones that still hold entries.
    pub pools: u64,
    /// Every resident byte the tier holds: the mempool (pool pages, free and
    /// reserve pages), pool and tree bookkeeping, the swap file's tables.
    pub memory_bytes: u64,
}

const HELP: &[(&str, &str, &str)] = &[
    ("stored_pages", "gauge", "Pages stored in the pool or as same-filled markers"),
    ("pool_total_size", "gauge", "Bytes of pool pages (zspages)"),
    ("stored_incompressible_pages", "gauge", "Pages kept raw because they do not compress"),
    ("same_filled_pages", "gauge", "Pages kept as a same-filled marker"),
    ("written_back_pages", "counter", "Pages written back to the swap file"),
    ("pool_limit_hit", "counter", "Times the pool limit was reached"),
    ("reject_compress_poor", "counter", "Stores rejected: a page did not compress and writeback is off"),
    ("reject_compress_fail", "counter", "Stores rejected: the compressor failed"),
    ("reject_alloc_fail", "counter", "Stores rejected: the pool could not allocate"),
    ("reject_reclaim_fail", "counter", "Writebacks that failed (the pages stayed in the pool)"),
    ("decompress_fail", "counter", "Loads that failed to decompress or failed their checksum"),
    ("zswpout", "counter", "Pages stored"),
    ("zswpin", "counter", "Pages loaded"),
    ("pswpin", "counter", "Pages loaded from the swap file"),
    ("swap_refaults", "counter", "Pages loaded from the swap file that a somewhat larger pool would have kept"),
    ("cold_pool_loads", "counter", "Pages loaded from the pool that a somewhat smaller pool would have written back"),
    ("zswpwb", "counter", "Pages written back"),
    ("swap_pages", "gauge", "Pages in the swap file"),
    ("swap_slots", "gauge", "4 KiB slots of the swap file in use"),
    ("swap_written_bytes", "counter", "Bytes written to the swap file"),
    ("swap_readahead_blocks", "counter", "Swap file slots read ahead of the loads that wanted them"),
    ("swap_readahead_hits", "counter", "Swap file slot reads served by read-ahead"),
    ("cached_pages", "gauge", "Pool entries kept as the clean copy of a page mapped again"),
    ("cached_reused", "counter", "Pages stored again unchanged: their cached entry was kept, nothing compressed"),
    ("cached_dropped", "counter", "Cached entries freed by the shrinker or because the page was written"),
    ("recompressed_pages", "counter", "Entries recompressed into a stronger compressor's pool"),
    ("pools", "gauge", "Pools alive"),
    ("memory_bytes", "gauge", "Resident bytes held by the tier"),
];

/// The Prometheus type (`counter` or `gauge`) and help text of the stat
/// `name` (a field of [`TierStats`]), for any writer of these stats.
pub fn describe(name: &str) -> Option<(&'static str, &'static str)> {
    HELP.iter().find(|(n, _, _)| *n == name).map(|&(_, kind, help)| (kind, help))
}

impl TierStats {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain struct serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_is_described() {
        let s = TierStats { stored_pages: 7, zswpwb: 3, ..Default::default() };
        let v = serde_json::to_value(s).unwrap();
        let fields = v.as_object().unwrap();
        assert_eq!(HELP.len(), fields.len(), "every stat has a HELP line");
        assert!(fields.keys().all(|k| describe(k).is_some()), "{fields:?}");
        assert!(s.to_json().contains("\"written_back_pages\": 0"));
        assert_eq!(describe("zswpwb"), Some(("counter", "Pages written back")));
        assert_eq!(describe("no_such_stat"), None);
    }
}
