//! The stats file `DIR/zmem-PID.json`, and the JSON `zmem_stats_json` returns.

use std::sync::atomic::Ordering;

use crate::init::{current, Shim, LIVE};
use crate::PAGE;

/// (written to a temporary name and renamed, so readers see whole files).
/// The stats file: `DIR/zmem-PID.json`, rewritten every `interval`
pub(crate) fn stats_main(dir: &std::path::Path, interval: std::time::Duration) {
    let pid = std::process::id();
    if let Err(e) = std::fs::create_dir_all(dir) {
        log::warn!("no stats directory {}: {e}", dir.display());
        return;
    }
    let path = dir.join(format!("zmem-{pid}.json"));
    let tmp = dir.join(format!(".zmem-{pid}.json.tmp"));
    loop {
        if let Some(s) = current() {
            let json = stats_json(s);
            if std::fs::write(&tmp, json).and_then(|()| std::fs::rename(&tmp, &path)).is_err() {
                return;
            }
        }
        std::thread::sleep(interval);
    }
}

pub(crate) fn stats_json(s: &Shim) -> String {
    let p = s.pager.stats();
    let t = s.pager.tier().stats();
    let tier: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap_or(serde_json::Value::Null);
    // The footprint as the OS sees it: RSS (the program's pages, the pool,
    // zmem's metadata) plus the swap file's pages in the page cache.
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map_or(0, |pages| pages * PAGE as u64);
    let cached = s.pager.tier().swap_file().and_then(|f| f.page_cache_bytes()).unwrap_or(0);
    // The process tree that shares the limit: its usage and each process's.
    let tree = s.pager.tree().map_or(serde_json::Value::Null, |t| {
        let members: Vec<_> = t
            .members()
            .iter()
            .map(|m| {
                serde_json::json!({
                    "pid": m.pid,
                    "usage_bytes": m.usage,
                    "peak_usage_bytes": m.peak,
                    "share_bytes": m.share,
                    "evicted_folios": m.evicted,
                })
            })
            .collect();
        serde_json::json!({
            "path": s.settings.tree.as_ref().map(|p| p.display().to_string()),
            "limit": t.limit(),
            "usage_bytes": t.usage(),
            "peak_usage_bytes": t.peak(),
            "processes": members,
        })
    });
    serde_json::json!({
        "pid": std::process::id(),
        "footprint": {
            "rss_bytes": rss,
            "swap_page_cache_bytes": cached,
            "footprint_bytes": rss + cached,
            "limit": s.settings.limit,
        },
        "updated_unix_ms": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        "limit": s.settings.limit,
        "compressor": s.pager.tier().compressor(),
        "recompress": s.settings.recompress.map(|c| c.to_string()),
        "managed_mappings": LIVE.load(Ordering::Relaxed),
        "pager": {
            "usage_bytes": p.usage_bytes,
            "limit_bytes": p.limit_bytes,
            "max_pool_percent": p.max_pool_percent,
            "resident_bytes": p.resident_bytes,
            "metadata_bytes": p.metadata_bytes,
            "managed_bytes": p.managed_bytes,
            "metadata_bytes_per_page": p.metadata_bytes_per_page,
            "zero_faults": p.zero_faults,
            "load_faults": p.load_faults,
            "evicted_folios": p.evicted_folios,
            "eviction_rejects": p.eviction_rejects,
            "eviction_waits": p.eviction_waits,
            "workingset_refaults": p.workingset_refaults,
            "direct_reclaim_waits": p.direct_reclaim_waits,
            "limit_soft_events": p.limit_soft_events,
            "limit_soft": p.limit_soft,
            "unevictable_folios": p.unevictable_folios,
            "held_bytes": p.held_bytes,
            "poisoned_pages": p.poisoned_pages,
            "tracking_writes": p.tracking_writes,
            "stray_faults": p.stray_faults,
            "dropped_page_faults": p.dropped_page_faults,
            "move_recounts": p.move_recounts,
            "fork_loads": p.fork_loads,
            "fork_handovers": p.fork_handovers,
            "fork_child_faults": p.fork_child_faults,
            "fork_imported_pages": p.fork_imported_pages,
            "readahead_folios": p.readahead_folios,
            "walk_evictions": p.walk_evictions,
            "partial_load_faults": p.partial_load_faults,
            "swapped_page_faults": p.swapped_page_faults,
            "fenced_pages": p.fenced_pages,
            "adopted_zero_pages": p.adopted_zero_pages,
            "stray_zero_pages": p.stray_zero_pages,
            "swapped_bytes": p.swapped_bytes,
            "zero_ahead_folios": p.zero_ahead_folios,
            "adoption_cuts": p.adoption_cuts,
            "cow_breaks": p.cow_breaks,
            "shared_parks": p.shared_parks,
            "shared_bytes": p.shared_bytes,
            "mapping_scans": p.mapping_scans,
            "adopted_regions": p.adopted_regions,
            "adopted_bytes": p.adopted_bytes,
            "retired_regions": p.retired_regions,
            "split_regions": p.split_regions,
        },
        "tier": tier,
        "tree": tree,
    })
    .to_string()
}
