//! The worker's side (`zmem usemem-worker`): write S bytes of stamped corpus
//! pages, report, wait for the parent, read everything back and verify it.

use std::io::{BufRead, Write};
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::EnginesConfig;
use zmem_settings::parse_size;
use zmem_tier::TierConfig;
use zmem_uffd::{Mapping, Pager, PagerConfig};

/// What a worker reports.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct WorkerReport {
    pub(super) write_secs: f64,
    pub(super) read_secs: f64,
    pub(super) mismatched_pages: u64,
    pub(super) sys_secs: f64,
    pub(super) user_secs: f64,
    /// zmem workers only: their tier's counters at the end of writing
    /// (`zswpout`, `zswpin` and `cached_reused`: at the end of the run).
    pub(super) zswpout: u64,
    pub(super) zswpin: u64,
    pub(super) cached_reused: u64,
    /// The pager's metadata per managed page, at the end of writing.
    pub(super) metadata_bytes_per_page: f64,
    pub(super) rejects: u64,
    pub(super) stored_pages: u64,
    pub(super) same_filled_pages: u64,
    pub(super) pool_total_size: u64,
    pub(super) written_back_pages: u64,
    /// Bytes written to the swap file for them (compressed writeback packs
    /// several pages per 4 KiB slot).
    pub(super) swap_written_bytes: u64,
    /// The worker's peak RSS (VmHWM): its pages, its pool, its metadata.
    pub(super) peak_rss_bytes: u64,
    /// zmem workers: the most of their swap file seen in the page cache.
    pub(super) swap_page_cache_bytes: u64,
}

/// This process's peak RSS, from `VmHWM` in /proc/self/status.
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    zmem_common::procfs::kb_field(&s, "VmHWM:").unwrap_or(0)
}

/// The worker's side: `zmem usemem-worker`.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[arg(long, value_parser = parse_size)]
    size: usize,
    /// A pager limit: run on zmem. Without it, plain memory.
    #[arg(long, value_parser = parse_size)]
    zmem_limit: Option<usize>,
    #[arg(long, default_value = "lz4")]
    compressor: String,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Which worker this is (varies the pages).
    #[arg(long, default_value_t = 0)]
    id: usize,
}

/// Word `i` of page `p` of worker `id`: a corpus page, stamped with its
/// number so that no two pages are alike.
fn page_word(c: &Corpus, id: usize, p: usize, i: usize) -> u64 {
    let src = c.page(p % c.len());
    let w = u64::from_ne_bytes(src[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    if i == 0 {
        w ^ ((id as u64) << 48 | p as u64)
    } else {
        w
    }
}

fn cpu_secs() -> (f64, f64) {
    // /proc/self/stat fields 14 and 15 (utime, stime), in clock ticks (100 Hz
    // on Linux); the command name may hold spaces, so count after ')'.
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / 100.0;
    (tick(11), tick(12))
}

/// The batched configs' compressor: the multi-engine device, one engine
/// per core. A reclaim pass's pages are submitted at once (the tier keeps
/// at most 128 in flight; the queues hold that four times over, so a
/// submit never waits for room), and the reclaim thread compresses its own
/// core's share. A fault's load decompresses on its handler: a cross-core
/// wake-up costs more than its batch (`sync_on_caller`). Idle engines
/// sleep at once: spinning took CPU from the worker for nothing.
fn engines(batch: usize) -> EnginesConfig {
    EnginesConfig {
        batch_size: batch,
        wq_depth: 512,
        idle_spin: std::time::Duration::ZERO,
        // An engine item takes ~5 µs; one unfinished after this was
        // descheduled, and the reclaim thread runs it itself.
        completion_timeout: std::time::Duration::from_micros(200),
        // With both cores busy (two workers) the engines ran ~20% of the
        // items and the batched config was 9-12% slower than the sequential
        // one; with one core free they ran ~45%.
        min_offload_percent: 33,
        sync_on_caller: true,
        ..EnginesConfig::default()
    }
}

pub fn worker(args: &WorkerArgs) -> Result<()> {
    let c = Corpus::sample();
    let pages = args.size.div_ceil(PAGE_SIZE);
    let plain;
    let (mut pager, mut region) = (None, None);
    let words: &[std::sync::atomic::AtomicU64] = if let Some(limit) = args.zmem_limit {
        let mut cfg = PagerConfig::with_limit(limit);
        cfg.tier = TierConfig {
            compressor: args.compressor.parse()?,
            batch_size: args.batch,
            engines: (args.batch > 1).then(|| engines(args.batch)),
            memory_budget: limit,
            max_pool_percent: 50,
            ..TierConfig::default()
        };
        pager = Some(Pager::new(cfg)?);
        region = Some(pager.as_ref().expect("just set").map(pages * PAGE_SIZE)?);
        region.as_ref().expect("just set").words()
    } else {
        plain = Mapping::new(pages * PAGE_SIZE)?;
        plain.words()
    };
    let mut out = std::io::stdout().lock();
    let step = (64 << 20) / PAGE_SIZE;
    let t = Instant::now();
    for p in 0..pages {
        for i in 0..PAGE_SIZE / 8 {
            words[p * 512 + i].store(page_word(c, args.id, p, i), Ordering::Relaxed);
        }
        if (p + 1) % step == 0 {
            writeln!(out, "P {}", step * PAGE_SIZE)?;
            out.flush()?;
        }
    }
    let mut rep = WorkerReport { write_secs: t.elapsed().as_secs_f64(), ..WorkerReport::default() };
    if let Some(p) = pager.as_ref() {
        let s = p.tier().stats();
        rep.zswpout = s.zswpout;
        rep.metadata_bytes_per_page = p.stats().metadata_bytes_per_page;
        rep.stored_pages = s.stored_pages;
        rep.same_filled_pages = s.same_filled_pages;
        rep.pool_total_size = s.pool_total_size;
        rep.written_back_pages = s.written_back_pages;
        rep.swap_written_bytes = s.swap_written_bytes;
        rep.rejects = s.reject_compress_poor + s.reject_compress_fail + s.reject_alloc_fail + s.reject_reclaim_fail;
        rep.swap_page_cache_bytes = p.tier().swap_file().and_then(|f| f.page_cache_bytes()).unwrap_or(0);
    }
    writeln!(out, "W {}", serde_json::to_string(&rep)?)?;
    out.flush()?;
    // Sleep until the parent says go (it samples the pool meanwhile).
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let t = Instant::now();
    let mut bad = 0u64;
    for p in 0..pages {
        if (0..PAGE_SIZE / 8).any(|i| words[p * 512 + i].load(Ordering::Relaxed) != page_word(c, args.id, p, i)) {
            bad += 1;
        }
        if (p + 1) % step == 0 {
            writeln!(out, "P {}", step * PAGE_SIZE)?;
            out.flush()?;
        }
    }
    rep.read_secs = t.elapsed().as_secs_f64();
    rep.mismatched_pages = bad;
    (rep.user_secs, rep.sys_secs) = cpu_secs();
    if let Some(p) = pager.as_ref() {
        let s = p.tier().stats();
        (rep.zswpout, rep.zswpin, rep.cached_reused) = (s.zswpout, s.zswpin, s.cached_reused);
        let cached = p.tier().swap_file().and_then(|f| f.page_cache_bytes()).unwrap_or(0);
        rep.swap_page_cache_bytes = rep.swap_page_cache_bytes.max(cached);
    }
    rep.peak_rss_bytes = peak_rss();
    writeln!(out, "D {}", serde_json::to_string(&rep)?)?;
    out.flush()?;
    drop(region);
    drop(pager);
    Ok(())
}
