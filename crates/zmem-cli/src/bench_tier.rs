//! `zmem bench tier`: the corpus through the tier.
//!
//! - writeback off, the pool big enough for everything: store and load MB/s;
//! - writeback on, the pool limited to `--pool-percent` of the data: store
//!   MB/s (the shrinker runs inline) and load MB/s (part from the file);
//! - `pool_total_size` against the sum of the objects' compressed sizes;
//! - writeback MB/s of the whole pool, encrypted and not;
//! - recompression of the whole pool with `--recompress` (zram's
//!   `recompress`): MB/s, the pool's size before and after, and load MB/s
//!   from the recompressed pool against the first one.
//!
//! With `--device engines` or `--device nvcomp` it measures instead the
//! store path on that device against liblz4 on the calling thread, in the
//! same run: each stores every folio (writeback off) in passes of `--pass`
//! folios through `Tier::store_many`, as the pager's reclaim does, and
//! loads every page back on the CPU.
//!
//! MB/s counts uncompressed bytes (10^6). Every loaded page is compared with
//! what was stored.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Result};
use serde::Serialize;
use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::{BatchCompressor, CodecSpec, Engines, EnginesConfig};
use zmem_swapfile::SwapFileConfig;
use zmem_tier::{LoadOutcome, StoreOutcome, StoreRequest, Tier, TierConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Raw or .zst page file; default: the embedded sample.
    #[arg(long)]
    corpus: Option<PathBuf>,
    #[arg(long, default_value = "lz4")]
    compressor: String,
    /// MiB of pages to store (the corpus repeats).
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// Pages per store call (the folio).
    #[arg(long, default_value_t = 16)]
    folio: usize,
    /// Pool limit with writeback on, in percent of the data's compressed size.
    #[arg(long, default_value_t = 50)]
    pool_percent: usize,
    /// Directory for the swap file.
    #[arg(long)]
    swapfile: Option<PathBuf>,
    /// The stronger compressor entries are recompressed with.
    #[arg(long, default_value = "zstd")]
    recompress: String,
    /// Folios per store call: above 1, `Tier::store_many` stores them
    /// together (a compressor that runs beside the caller then keeps
    /// several batches in flight).
    #[arg(long, default_value_t = 8)]
    pass: usize,
    /// `cpu` (the full report), or `engines` / `nvcomp`: the store path on
    /// that device against liblz4 on one core (lz4 only for nvcomp).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// nvcomp only: streams, the most batches in flight on the GPU.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    #[arg(long, default_value = zmem_nvcomp::DEFAULT_LIBRARY)]
    nvcomp_lib: String,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    compressor: String,
    mib: usize,
    folio_pages: usize,
    store_mbps_wb_off: f64,
    load_mbps_wb_off: f64,
    /// Pages of folios rejected with writeback off (a page did not compress).
    rejected_pages_wb_off: usize,
    store_mbps_wb_on: f64,
    load_mbps_wb_on: f64,
    written_back_pages: u64,
    pool_total_size: u64,
    compressed_bytes: u64,
    pool_overhead: f64,
    writeback_mbps_encrypted: f64,
    writeback_mbps_plain: f64,
    recompress_to: String,
    /// Uncompressed MB/s of the pages recompressed.
    recompress_mbps: f64,
    recompressed_pages: usize,
    pool_before_recompress: u64,
    pool_after_recompress: u64,
    /// Load MB/s from the recompressed pool (writeback off).
    load_mbps_recompressed: f64,
}

fn mbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e6
}

struct Data {
    pages: Vec<u8>,
}

impl Data {
    fn page(&self, i: usize) -> &[u8] {
        &self.pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]
    }
    fn n(&self) -> usize {
        self.pages.len() / PAGE_SIZE
    }
}

/// Stores every folio, `pass` folios a call; returns the seconds taken and
/// which pages were rejected (with writeback off, a folio holding an
/// incompressible page is).
fn store_all(t: &Tier, d: &Data, folio: usize, pass: usize, may_reject: bool) -> Result<(f64, Vec<bool>)> {
    let mut rejected = vec![false; d.n()];
    let start = Instant::now();
    let mut first = 0;
    for chunk in d.pages.chunks(folio * pass * PAGE_SIZE) {
        let reqs: Vec<StoreRequest<'_>> = chunk
            .chunks(folio * PAGE_SIZE)
            .enumerate()
            .map(|(i, f)| StoreRequest { key: (first + i * folio) as u64, folio: f, reuse: false })
            .collect();
        let outs = if pass == 1 { vec![t.store(reqs[0].key, reqs[0].folio)] } else { t.store_many(&reqs) };
        for (r, out) in reqs.iter().zip(outs) {
            match out? {
                StoreOutcome::Stored { .. } => {}
                StoreOutcome::Rejected(why) => {
                    ensure!(may_reject, "store of the folio at page {} was rejected: {why:?}", r.key);
                    let k = r.key as usize;
                    rejected[k..k + r.folio.len() / PAGE_SIZE].fill(true);
                }
            }
        }
        first += chunk.len() / PAGE_SIZE;
    }
    Ok((start.elapsed().as_secs_f64(), rejected))
}

/// Loads every stored page and checks it; returns seconds and bytes loaded.
fn load_all(t: &Tier, d: &Data, rejected: &[bool]) -> Result<(f64, usize)> {
    let mut buf = vec![0u8; PAGE_SIZE];
    let mut n = 0;
    let start = Instant::now();
    for (i, &was_rejected) in rejected.iter().enumerate() {
        let out = t.load(i as u64, &mut buf)?;
        if was_rejected {
            ensure!(out == LoadOutcome::NotFound, "rejected page {i} was found");
            continue;
        }
        ensure!(out == LoadOutcome::Loaded, "page {i} missing");
        ensure!(buf == d.page(i), "page {i} came back different");
        n += PAGE_SIZE;
    }
    Ok((start.elapsed().as_secs_f64(), n))
}

pub fn run(args: &Args) -> Result<()> {
    let spec: CodecSpec = args.compressor.parse()?;
    let stronger: CodecSpec = args.recompress.parse()?;
    if args.mib == 0
        || !(1..=512).contains(&args.folio)
        || !(1..=100).contains(&args.pool_percent)
        || !(1..=64).contains(&args.pass)
    {
        bail!("--mib must be at least 1, --folio in 1..=512, --pool-percent in 1..=100, --pass in 1..=64");
    }
    let corpus = Corpus::sample_or(args.corpus.as_deref())?;
    let n = (args.mib << 20) / PAGE_SIZE;
    let pages: Vec<u8> = (0..n).flat_map(|i| corpus.page(i % corpus.len()).iter().copied()).collect();
    let d = Data { pages };
    let bytes = d.pages.len();
    let dir = args.swapfile.clone().unwrap_or_else(std::env::temp_dir);
    let base = TierConfig { compressor: spec, max_pool_bytes: Some(bytes * 2), ..TierConfig::default() };
    if args.device != "cpu" {
        return run_device(args, spec, &d, base, corpus.origin());
    }

    // Writeback off.
    let t = Tier::new(TierConfig { writeback: false, swap: None, ..base.clone() })?;
    let (s_off, rej_off) = store_all(&t, &d, args.folio, args.pass, true)?;
    let rejected_pages = rej_off.iter().filter(|&&r| r).count();
    let st = t.stats();
    let compressed: u64 = {
        let mut c = spec.build();
        let mut out = vec![0u8; PAGE_SIZE];
        (0..d.n())
            .filter(|&i| !rej_off[i] && !is_same_filled(d.page(i)))
            .map(|i| c.compress(d.page(i), &mut out).unwrap_or(PAGE_SIZE) as u64)
            .sum()
    };
    let (l_off, l_off_bytes) = load_all(&t, &d, &rej_off)?;
    drop(t);

    // Writeback on, pool limited.
    let limit = (compressed as usize * args.pool_percent / 100).max(1 << 20);
    let t = Tier::new(TierConfig {
        max_pool_bytes: Some(limit),
        swap: Some(SwapFileConfig { dir: dir.clone(), encrypt: true, ..SwapFileConfig::default() }),
        ..base.clone()
    })?;
    let (s_on, _) = store_all(&t, &d, args.folio, args.pass, false)?;
    let wb = t.stats().written_back_pages;
    let (l_on, _) = load_all(&t, &d, &vec![false; d.n()])?;
    drop(t);

    // Writeback speed: fill an unlimited pool, then write all of it back.
    let mut wb_rates = [0f64; 2];
    for (k, encrypt) in [true, false].into_iter().enumerate() {
        let t = Tier::new(TierConfig {
            swap: Some(SwapFileConfig { dir: dir.clone(), encrypt, ..SwapFileConfig::default() }),
            ..base.clone()
        })?;
        store_all(&t, &d, args.folio, args.pass, false)?;
        let start = Instant::now();
        let went = t.writeback(d.n());
        wb_rates[k] = mbps(went * PAGE_SIZE, start.elapsed().as_secs_f64());
    }

    // Recompression: the whole pool (writeback off), then every page
    // loaded from the pool it went to.
    let t = Tier::new(TierConfig { writeback: false, swap: None, ..base.clone() })?;
    let (_, rej) = store_all(&t, &d, args.folio, args.pass, true)?;
    let pool_before = t.stats().pool_total_size;
    let start = Instant::now();
    let rc = t.recompress(stronger, usize::MAX, false)?;
    let rc_secs = start.elapsed().as_secs_f64();
    t.compact();
    let pool_after = t.stats().pool_total_size;
    let (l_rc, l_rc_bytes) = load_all(&t, &d, &rej)?;
    drop(t);

    let r = Report {
        compressor: spec.to_string(),
        mib: args.mib,
        folio_pages: args.folio,
        store_mbps_wb_off: mbps(bytes, s_off),
        load_mbps_wb_off: mbps(l_off_bytes, l_off),
        rejected_pages_wb_off: rejected_pages,
        store_mbps_wb_on: mbps(bytes, s_on),
        load_mbps_wb_on: mbps(bytes, l_on),
        written_back_pages: wb,
        pool_total_size: st.pool_total_size,
        compressed_bytes: compressed,
        pool_overhead: st.pool_total_size as f64 / compressed as f64,
        writeback_mbps_encrypted: wb_rates[0],
        writeback_mbps_plain: wb_rates[1],
        recompress_to: stronger.to_string(),
        recompress_mbps: mbps(rc.scanned * PAGE_SIZE, rc_secs),
        recompressed_pages: rc.moved,
        pool_before_recompress: pool_before,
        pool_after_recompress: pool_after,
        load_mbps_recompressed: mbps(l_rc_bytes, l_rc),
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &r)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "corpus: {}; {} MiB through the tier with {}, {}-page folios",
        corpus.origin(),
        r.mib,
        r.compressor,
        r.folio_pages
    )?;
    writeln!(
        out,
        "writeback off : store {:>7.0} MB/s   load {:>7.0} MB/s   ({} pages rejected: incompressible)",
        r.store_mbps_wb_off, r.load_mbps_wb_off, r.rejected_pages_wb_off
    )?;
    writeln!(
        out,
        "writeback on  : store {:>7.0} MB/s   load {:>7.0} MB/s   (pool limit {}% of compressed, {} pages written back)",
        r.store_mbps_wb_on, r.load_mbps_wb_on, args.pool_percent, r.written_back_pages
    )?;
    writeln!(
        out,
        "pool_total_size {} MiB / compressed {} MiB = {:.3}",
        r.pool_total_size >> 20,
        r.compressed_bytes >> 20,
        r.pool_overhead
    )?;
    writeln!(
        out,
        "writeback     : {:>7.0} MB/s encrypted (AES-XTS), {:>7.0} MB/s plain ({:.2}x)",
        r.writeback_mbps_encrypted,
        r.writeback_mbps_plain,
        r.writeback_mbps_encrypted / r.writeback_mbps_plain
    )?;
    writeln!(
        out,
        "recompress    : {:>7.0} MB/s to {}, {} pages moved; pool {:.1} -> {:.1} MiB ({:.2}x); load {:>7.0} MB/s ({:.2}x the first pool's)",
        r.recompress_mbps,
        r.recompress_to,
        r.recompressed_pages,
        r.pool_before_recompress as f64 / 1048576.0,
        r.pool_after_recompress as f64 / 1048576.0,
        r.pool_before_recompress as f64 / r.pool_after_recompress.max(1) as f64,
        r.load_mbps_recompressed,
        r.load_mbps_recompressed / r.load_mbps_wb_off
    )?;
    Ok(())
}

#[derive(Debug, Serialize)]
struct DeviceRow {
    /// `lz4` on the calling thread (the baseline), or the device's name.
    compressor: String,
    /// Folios per store call.
    pass: usize,
    store_mbps: f64,
    load_mbps: f64,
    /// The store rate against the baseline's, measured in this run.
    store_speedup: f64,
    pool_total_size: u64,
}

/// `--device engines|nvcomp`: the store path on the device against liblz4.
fn run_device(args: &Args, spec: CodecSpec, d: &Data, base: TierConfig, origin: &str) -> Result<()> {
    let off = TierConfig { writeback: false, swap: None, engines: None, ..base };
    let mut nvcomp = None;
    let (dev, name): (Arc<dyn BatchCompressor>, String) = match args.device.as_str() {
        "engines" => {
            // Loads decompress on the caller, as the pager's handler does
            // (usemem's batched configs): one page is less work than the
            // wake-up an engine would cost.
            let e = Engines::new(EnginesConfig { sync_on_caller: true, ..EnginesConfig::default() }, spec.factory())?;
            let name = format!("{spec}@{} engines", e.stats().len());
            (Arc::new(e), name)
        }
        "nvcomp" => {
            ensure!(spec.to_string() == "lz4", "--device nvcomp runs lz4 only, not {spec}; pass --compressor lz4");
            let cfg = zmem_nvcomp::NvcompConfig {
                library: args.nvcomp_lib.clone(),
                streams: args.streams,
                verify: true,
                ..Default::default()
            };
            let n = Arc::new(zmem_nvcomp::NvcompLz4::new(cfg)?);
            let name =
                format!("lz4 on {} (nvCOMP {}, {} streams)", n.gpu().name(), n.gpu().nvcomp_version(), args.streams);
            nvcomp = Some(Arc::clone(&n));
            (n, name)
        }
        other => bail!("unknown --device {other:?}; valid devices are: cpu, engines, nvcomp"),
    };
    let mut rows: Vec<DeviceRow> = Vec::new();
    let mut rejected_base = None;
    for (label, pass, t) in
        [(spec.to_string(), 1, Tier::new(off.clone())?), (name, args.pass, Tier::with_compressor(off.clone(), dev)?)]
    {
        let (s, rej) = store_all(&t, d, args.folio, pass, true)?;
        // Both compressors write LZ4 blocks of the same pages, so the same
        // folios compress or do not.
        let base_rej = rejected_base.get_or_insert_with(|| rej.clone());
        ensure!(*base_rej == rej, "{label} rejected other folios than the baseline");
        let pool_total_size = t.stats().pool_total_size;
        let (l, l_bytes) = load_all(&t, d, &rej)?;
        let store_mbps = mbps(d.pages.len(), s);
        rows.push(DeviceRow {
            compressor: label,
            pass,
            store_mbps,
            load_mbps: mbps(l_bytes, l),
            store_speedup: store_mbps / rows.first().map_or(store_mbps, |b| b.store_mbps),
            pool_total_size,
        });
    }
    if let Some(n) = &nvcomp {
        let st = n.stats();
        ensure!(st.gpu_errors == 0 && st.verify_failures == 0, "nvcomp: {st:?}");
        ensure!(st.gpu_items > 0, "no store ran on the GPU: {st:?}");
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &rows)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "corpus: {origin}; {} MiB through the tier, {}-page folios, writeback off; loads on the CPU",
        args.mib, args.folio
    )?;
    for r in &rows {
        writeln!(
            out,
            "{:<48} pass {:>2}: store {:>7.0} MB/s ({:.2}x)   load {:>7.0} MB/s   pool {} MiB",
            r.compressor,
            r.pass,
            r.store_mbps,
            r.store_speedup,
            r.load_mbps,
            r.pool_total_size >> 20
        )?;
    }
    if let Some(n) = &nvcomp {
        writeln!(out, "nvcomp: {:?}", n.stats())?;
    }
    Ok(())
}

fn is_same_filled(p: &[u8]) -> bool {
    p.chunks_exact(8).all(|w| w == &p[..8])
}
