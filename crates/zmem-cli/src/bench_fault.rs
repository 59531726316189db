//! `zmem bench fault`: what a fault costs in a pager region.
//!
//! - zero-fill: the first touch of each folio of a fresh region;
//! - pool: touches of folios evicted into the pool (fault-around loads the
//!   whole folio and maps it with one COPY);
//! - swap: the same with a pool so small that the folios were written back;
//! - fill: writing real pages into a region four times the limit, eviction
//!   included (MB/s).
//!
//! Latencies are per 4 KiB (a folio's fault divided by its pages), measured
//! on the touching thread, so they include the wake-up of the handler.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;
use zmem_compress::corpus::Corpus;
use zmem_compress::PAGE_SIZE;
use zmem_tier::TierConfig;
use zmem_uffd::{Pager, PagerConfig, Region};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The pager's limit, MiB.
    #[arg(long, default_value_t = 64)]
    limit_mib: usize,
    /// Folio size, KiB.
    #[arg(long, default_value_t = 64)]
    folio_kib: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Latency {
    faults: usize,
    p50_us_per_4k: f64,
    p99_us_per_4k: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    limit_mib: usize,
    folio_kib: usize,
    zero_fill: Latency,
    pool: Latency,
    swap: Latency,
    fill_mbps_with_eviction: f64,
    evicted_mib: u64,
}

fn latency(mut ns: Vec<u64>, pages_per_folio: usize) -> Latency {
    ns.sort_unstable();
    let at = |q: f64| ns.get(((ns.len() as f64 * q) as usize).min(ns.len().saturating_sub(1))).copied().unwrap_or(0);
    let per = |v: u64| v as f64 / 1000.0 / pages_per_folio as f64;
    Latency { faults: ns.len(), p50_us_per_4k: per(at(0.50)), p99_us_per_4k: per(at(0.99)) }
}

/// Writes corpus pages over the whole region.
fn fill(r: &Region) {
    let c = Corpus::sample();
    let w = r.words();
    for pg in 0..r.len() / PAGE_SIZE {
        let src = c.page(pg % c.len());
        for (i, chunk) in src.chunks_exact(8).enumerate() {
            w[pg * 512 + i].store(u64::from_ne_bytes(chunk.try_into().expect("8 bytes")), Ordering::Relaxed);
        }
    }
}

/// Touches the first word of every folio; returns the latencies of the
/// touches that loaded a folio from the tier.
fn touch_loaded(p: &Pager, r: &Region, folio: usize) -> Vec<u64> {
    let w = r.words();
    let mut out = Vec::new();
    for f in 0..r.len() / folio {
        let before = p.stats().load_faults;
        let t = Instant::now();
        std::hint::black_box(w[f * folio / 8].load(Ordering::Relaxed));
        let ns = t.elapsed().as_nanos() as u64;
        if p.stats().load_faults > before {
            out.push(ns);
        }
    }
    out
}

fn pager(limit: usize, folio: usize, tier: TierConfig) -> Result<Pager> {
    let mut cfg = PagerConfig::with_limit(limit);
    cfg.folio_size = folio;
    cfg.tier = tier;
    Ok(Pager::new(cfg)?)
}

pub fn run(args: &Args) -> Result<()> {
    let folio = args.folio_kib << 10;
    if !folio.is_power_of_two() || !(4..=2048).contains(&args.folio_kib) || args.limit_mib < 16 {
        bail!("--folio-kib must be a power of two in 4..=2048 and --limit-mib at least 16");
    }
    let limit = args.limit_mib << 20;
    let ppf = folio / PAGE_SIZE;

    // Zero-fill.
    let p = pager(limit, folio, TierConfig { memory_budget: limit, ..TierConfig::default() })?;
    let r = p.map(limit / 2)?;
    let mut zero = Vec::new();
    for f in 0..r.len() / folio {
        let t = Instant::now();
        std::hint::black_box(r.words()[f * folio / 8].load(Ordering::Relaxed));
        zero.push(t.elapsed().as_nanos() as u64);
    }
    drop(r);
    drop(p);

    // Fill 4x the limit (eviction included), then fault the evicted folios
    // back from the pool. The pool may take the whole limit here.
    let p = pager(limit, folio, TierConfig { memory_budget: limit, max_pool_percent: 100, ..TierConfig::default() })?;
    let r = p.map(2 * limit)?;
    let t = Instant::now();
    fill(&r);
    let fill_secs = t.elapsed().as_secs_f64();
    let evicted = p.stats().evicted_folios * folio as u64;
    let pool = touch_loaded(&p, &r, folio);
    drop(r);
    drop(p);

    // The same through a tiny pool: the folios come from the swap file.
    let p = pager(
        limit,
        folio,
        TierConfig { memory_budget: limit, max_pool_bytes: Some(2 << 20), ..TierConfig::default() },
    )?;
    let r = p.map(2 * limit)?;
    fill(&r);
    let swap = touch_loaded(&p, &r, folio);
    let wb = p.tier().stats().written_back_pages;
    drop(r);
    drop(p);

    let rep = Report {
        limit_mib: args.limit_mib,
        folio_kib: args.folio_kib,
        zero_fill: latency(zero, ppf),
        pool: latency(pool, ppf),
        swap: latency(swap, ppf),
        fill_mbps_with_eviction: (2 * limit) as f64 / fill_secs / 1e6,
        evicted_mib: evicted >> 20,
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &rep)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "pager limit {} MiB, {} KiB folios; latency per 4 KiB, measured on the faulting thread",
        rep.limit_mib, rep.folio_kib
    )?;
    for (name, l) in [("zero-fill", &rep.zero_fill), ("from pool", &rep.pool), ("from swap", &rep.swap)] {
        writeln!(
            out,
            "{name:<10} {:>6} faults   p50 {:>7.2} us   p99 {:>7.2} us",
            l.faults, l.p50_us_per_4k, l.p99_us_per_4k
        )?;
    }
    writeln!(
        out,
        "fill of {} MiB with eviction: {:.0} MB/s ({} MiB evicted); {} pages written back in the swap run",
        2 * rep.limit_mib,
        rep.fill_mbps_with_eviction,
        rep.evicted_mib,
        wb
    )?;
    Ok(())
}
