//! `zmem bench fault`: what a fault costs in a pager region.
//!
//! - zero-fill: the first touch of each folio of a fresh region;
//! - pool: touches of folios evicted into the pool (fault-around loads the
//!   whole folio and maps it with one COPY);
//! - swap: the same with a pool so small that the folios were written back;
//! - fill: writing real pages into a region four times the limit, eviction
//!   included (MB/s);
//! - refault: a hot set (10% of the limit) taking 80% of random writes and
//!   a cold set (4x the limit) the rest: the share of hot touches that find
//!   their folio evicted, with write tracking on and off (same run).
//!
//! `--handlers`, `--spin-us` and `--pin` set the handler threads, their
//! busy-poll time and whether they share the faulting thread's CPU.
//!
//! Latencies are per 4 KiB (a folio's fault divided by its pages), measured
//! on the touching thread, so they include the wake-up of the handler.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;
use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
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
    /// Handler threads.
    #[arg(long, default_value_t = 1)]
    handlers: usize,
    /// Busy-poll this long for the next fault before blocking, µs.
    #[arg(long, default_value_t = 0)]
    spin_us: u64,
    /// Pin the measuring thread to CPU 0 and the handlers to the same CPU
    /// (`same`), to CPU 1 (`other`), or pin nothing (`none`); or a handler
    /// on each of CPUs 0 and 1, the measuring thread free (`percpu`;
    /// `--handlers` is then 2).
    #[arg(long, default_value = "none", value_parser = ["none", "same", "other", "percpu"])]
    pin: String,
    /// Turn write tracking off for the latency and fill parts.
    #[arg(long)]
    no_track_writes: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Refault {
    hot_touches: u64,
    hot_refault_percent_tracked: f64,
    hot_refault_percent_faults_only: f64,
    write_checks: u64,
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
    refault: Refault,
    handlers: usize,
    spin_us: u64,
    pin: String,
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

fn pager(args: &Args, limit: usize, folio: usize, tier: TierConfig) -> Result<Pager> {
    let mut cfg = PagerConfig::with_limit(limit);
    cfg.folio_size = folio;
    cfg.tier = tier;
    cfg.handler_threads = args.handlers;
    // One fault's latency, alone: folios loaded ahead would not fault. And
    // a whole folio per fault (with no stream, a fault would load only its
    // page: `fault_around`), so that the figures are per 4 KiB of a folio.
    cfg.read_ahead = 0;
    cfg.fault_around = 0;
    cfg.track_writes = !args.no_track_writes;
    cfg.handler_spin = std::time::Duration::from_micros(args.spin_us);
    cfg.handler_cpus = match args.pin.as_str() {
        "same" => vec![0],
        "other" => vec![1],
        "percpu" => vec![0, 1],
        _ => Vec::new(),
    };
    if args.pin == "percpu" {
        cfg.handler_threads = 2;
    }
    Ok(Pager::new(cfg)?)
}

/// The hot/cold refault experiment; returns (hot touches, hot refaults,
/// write checks).
fn refault(args: &Args, limit: usize, folio: usize, track_writes: bool) -> Result<(u64, u64, u64)> {
    let mut cfg = PagerConfig::with_limit(limit);
    cfg.folio_size = folio;
    cfg.track_writes = track_writes;
    cfg.handler_threads = args.handlers;
    // One fault's latency, alone: folios loaded ahead would not fault. And
    // a whole folio per fault (with no stream, a fault would load only its
    // page: `fault_around`), so that the figures are per 4 KiB of a folio.
    cfg.read_ahead = 0;
    cfg.fault_around = 0;
    let p = Pager::new(cfg)?;
    let hot_len = limit / 10;
    let r = p.map(hot_len + 4 * limit)?;
    let (hot_pages, cold_pages) = (hot_len / PAGE_SIZE, 4 * limit / PAGE_SIZE);
    let w = r.words();
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let (mut touches, mut refaults) = (0u64, 0u64);
    for _ in 0..(16 * cold_pages) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let pg = if x % 10 < 8 {
            let pg = (x >> 8) as usize % hot_pages;
            touches += 1;
            refaults += u64::from(!r.is_resident(pg * PAGE_SIZE));
            pg
        } else {
            hot_pages + (x >> 8) as usize % cold_pages
        };
        w[pg * 512 + (x >> 40) as usize % 512].fetch_add(1, Ordering::Relaxed);
    }
    Ok((touches, refaults, p.stats().write_scans))
}

pub fn run(args: &Args) -> Result<()> {
    let folio = args.folio_kib << 10;
    if !folio.is_power_of_two() || !(4..=2048).contains(&args.folio_kib) || args.limit_mib < 16 {
        bail!("--folio-kib must be a power of two in 4..=2048 and --limit-mib at least 16");
    }
    if !(1..=16).contains(&args.handlers) {
        bail!("--handlers must be in 1..=16");
    }
    let limit = args.limit_mib << 20;
    let ppf = folio / PAGE_SIZE;
    if args.pin != "none" && args.pin != "percpu" {
        let mut set = rustix::thread::CpuSet::new();
        set.set(0);
        rustix::thread::sched_setaffinity(None, &set)?;
    }

    // Zero-fill.
    let p = pager(args, limit, folio, TierConfig { memory_budget: limit, ..TierConfig::default() })?;
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
    let p =
        pager(args, limit, folio, TierConfig { memory_budget: limit, max_pool_percent: 100, ..TierConfig::default() })?;
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
        args,
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

    let (touches, tracked, checks) = refault(args, limit, folio, true)?;
    let (_, untracked, _) = refault(args, limit, folio, false)?;
    let pct = |n: u64| 100.0 * n as f64 / touches.max(1) as f64;

    let rep = Report {
        limit_mib: args.limit_mib,
        folio_kib: args.folio_kib,
        zero_fill: latency(zero, ppf),
        pool: latency(pool, ppf),
        swap: latency(swap, ppf),
        fill_mbps_with_eviction: (2 * limit) as f64 / fill_secs / 1e6,
        evicted_mib: evicted >> 20,
        refault: Refault {
            hot_touches: touches,
            hot_refault_percent_tracked: pct(tracked),
            hot_refault_percent_faults_only: pct(untracked),
            write_checks: checks,
        },
        handlers: args.handlers,
        spin_us: args.spin_us,
        pin: args.pin.clone(),
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &rep)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "pager limit {} MiB, {} KiB folios, {} handler(s), spin {} us, pin {}; latency per 4 KiB, measured on the faulting thread",
        rep.limit_mib, rep.folio_kib, rep.handlers, rep.spin_us, rep.pin
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
    writeln!(
        out,
        "refault (hot 10% of the limit takes 80% of writes): {:.2}% of {} hot touches found their folio evicted with write tracking, {:.2}% with fault-ins only ({:.1}x)",
        rep.refault.hot_refault_percent_tracked,
        rep.refault.hot_touches,
        rep.refault.hot_refault_percent_faults_only,
        rep.refault.hot_refault_percent_faults_only / rep.refault.hot_refault_percent_tracked.max(1e-9)
    )?;
    Ok(())
}
