//! `zmem bench compress`: per-codec MB/s and ratio on real pages, and the
//! speedup of the multi-engine device over the sequential adapter at the same
//! batch size, both measured in the same run.
//!
//! Each figure is the best of `--repeat` interleaved rounds (sequential, then
//! engines, then again), each round at least `--secs` long, because these
//! machines are noisy and interleaving keeps drift out of the ratio.

use std::io::{self, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::Serialize;
use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::{
    Batch, BatchCompressor, CodecSpec, CompressError, Engines, EnginesConfig, Op, Sequential, Ticket, WqMode,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Raw or .zst page file; default: the embedded 2048-page sample.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Codecs, comma-separated, as `name[:level]`.
    #[arg(long, default_value = "lz4,zstd:-1,zstd:1,deflate:1,lzo,lzo-rle")]
    codec: String,
    /// Batch sizes to measure (1..=32).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch: Vec<usize>,
    /// Engines of the device; default: the number of cores.
    #[arg(long)]
    engines: Option<usize>,
    /// Work-queue mapping: global (round-robin) or per-cpu.
    #[arg(long, default_value = "global")]
    wq_mode: String,
    /// Batches kept in flight through submit/poll (1 = synchronous calls).
    #[arg(long, default_value_t = 1)]
    inflight: usize,
    /// Decompress-and-compare every output on the device.
    #[arg(long)]
    verify: bool,
    /// The device measured against the sequential adapter: `engines` (the
    /// multi-engine device) or `nvcomp` (a CUDA GPU through nvCOMP's batched
    /// LZ4; lz4 only; needs NVIDIA's driver and libnvcomp.so.6).
    #[arg(long, default_value = "engines")]
    device: String,
    /// nvCOMP's library, a file name the loader searches for or a path.
    #[arg(long, default_value = zmem_nvcomp::DEFAULT_LIBRARY)]
    nvcomp_lib: String,
    /// Seconds per measurement round.
    #[arg(long, default_value_t = 0.15)]
    secs: f64,
    /// Rounds per figure (the best is kept).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    codec: String,
    device: String,
    batch: usize,
    ratio: f64,
    poor_pages: usize,
    seq_compress_mbps: f64,
    seq_decompress_mbps: f64,
    engines: usize,
    wq_mode: String,
    inflight: usize,
    eng_compress_mbps: f64,
    eng_decompress_mbps: f64,
    compress_speedup: f64,
    decompress_speedup: f64,
    sw_fallback_calls: u64,
    helped_calls: u64,
    engine_calls: u64,
    verify_failures: u64,
    /// nvcomp only: items the GPU ran, and items that ran on liblz4.
    gpu_items: u64,
    cpu_items: u64,
}

/// The device under test.
enum Device {
    Engines(Engines),
    Nvcomp(zmem_nvcomp::NvcompLz4),
}

impl Device {
    fn bc(&self) -> &dyn BatchCompressor {
        match self {
            Device::Engines(e) => e,
            Device::Nvcomp(n) => n,
        }
    }
}

/// Compressed form of the corpus under one codec (Poor pages left out).
struct Compressed {
    objs: Vec<Vec<u8>>,
    stored_bytes: usize,
    poor: usize,
}

fn compress_corpus(spec: CodecSpec, corpus: &Corpus) -> Compressed {
    let mut c = spec.build();
    let mut out = vec![0u8; PAGE_SIZE];
    let (mut objs, mut stored_bytes, mut poor) = (Vec::new(), 0, 0);
    for page in corpus.pages() {
        match c.compress(page, &mut out) {
            Ok(n) => {
                stored_bytes += n;
                objs.push(out[..n].to_vec());
            }
            Err(CompressError::Poor) => {
                // Stored raw by the tier: counts as a whole page.
                stored_bytes += PAGE_SIZE;
                poor += 1;
            }
            Err(e) => panic!("{spec}: {e}"),
        }
    }
    Compressed { objs, stored_bytes, poor }
}

/// Runs `pass` (which returns the uncompressed bytes it handled) until
/// `secs` have gone by; returns MB/s (10^6 bytes).
fn rate(secs: f64, mut pass: impl FnMut() -> usize) -> f64 {
    let start = Instant::now();
    let mut bytes = 0usize;
    while start.elapsed() < Duration::from_secs_f64(secs) {
        bytes += pass();
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e6
}

/// One pass of compressing every page, `batch` at a time, with up to
/// `inflight` batches submitted at once.
fn compress_pass(
    bc: &dyn BatchCompressor,
    pages: &[&[u8]],
    batch: usize,
    inflight: usize,
    spare: &mut Vec<Batch>,
) -> usize {
    run_pass(bc, Op::Compress, pages, batch, inflight, spare, PAGE_SIZE);
    pages.len() * PAGE_SIZE
}

fn decompress_pass(
    bc: &dyn BatchCompressor,
    objs: &[&[u8]],
    batch: usize,
    inflight: usize,
    spare: &mut Vec<Batch>,
) -> usize {
    run_pass(bc, Op::Decompress, objs, batch, inflight, spare, PAGE_SIZE);
    objs.len() * PAGE_SIZE
}

fn run_pass(
    bc: &dyn BatchCompressor,
    op: Op,
    srcs: &[&[u8]],
    batch: usize,
    inflight: usize,
    spare: &mut Vec<Batch>,
    room: usize,
) {
    if inflight <= 1 {
        let mut outs = vec![vec![0u8; room]; batch];
        let mut res_c = vec![Ok(0); batch];
        let mut res_d = vec![Ok(0); batch];
        for chunk in srcs.chunks(batch) {
            let mut dsts: Vec<&mut [u8]> = outs.iter_mut().take(chunk.len()).map(|o| &mut o[..]).collect();
            let r = match op {
                Op::Compress => bc.compress_batch(chunk, &mut dsts, &mut res_c[..chunk.len()]),
                Op::Decompress => bc.decompress_batch(chunk, &mut dsts, &mut res_d[..chunk.len()]),
            };
            r.expect("batch within batch_size");
            if op == Op::Decompress {
                assert!(res_d[..chunk.len()].iter().all(|r| *r == Ok(PAGE_SIZE)), "decompress failed in bench");
            }
        }
        return;
    }
    let mut window: std::collections::VecDeque<Ticket> = std::collections::VecDeque::new();
    for chunk in srcs.chunks(batch) {
        if window.len() == inflight {
            let t = window.pop_front().expect("window is full");
            spare.push(bc.wait(t));
        }
        let mut b = spare.pop().unwrap_or_else(|| Batch::new(op));
        b.refill(op, chunk.iter().copied(), |_| room);
        window.push_back(bc.submit(b).expect("batch within batch_size"));
    }
    for t in window {
        spare.push(bc.wait(t));
    }
}

pub fn run(args: &Args) -> Result<()> {
    let specs = zmem_compress::codec::parse_list(&args.codec)?;
    if specs.is_empty() {
        bail!("--codec names no codec");
    }
    for &b in &args.batch {
        if !(1..=zmem_compress::batch::MAX_BATCH_SIZE).contains(&b) {
            bail!("--batch {b} is out of range; valid sizes are 1..={}", zmem_compress::batch::MAX_BATCH_SIZE);
        }
    }
    if !(args.secs > 0.0 && args.secs < 60.0) || args.repeat == 0 || args.inflight == 0 {
        bail!("--secs must be in (0, 60), --repeat and --inflight at least 1");
    }
    let wq_mode: WqMode = args.wq_mode.parse()?;
    let nvcomp = match args.device.as_str() {
        "engines" => false,
        "nvcomp" => true,
        d => bail!("unknown --device {d:?}; valid devices are: engines, nvcomp"),
    };
    if nvcomp {
        if let Some(s) = specs.iter().find(|s| s.to_string() != "lz4") {
            bail!("--device nvcomp runs lz4 only, not {s}; pass --codec lz4");
        }
    }
    let corpus = Corpus::sample_or(args.corpus.as_deref())?;
    let pages: Vec<&[u8]> = corpus.pages().collect();
    let engines = args.engines.unwrap_or_else(|| EnginesConfig::default().engines);

    let mut out = io::stdout().lock();
    if !args.json {
        writeln!(
            out,
            "corpus: {} ({} pages, {} MiB)",
            corpus.origin(),
            corpus.len(),
            (corpus.len() * PAGE_SIZE) >> 20
        )?;
        writeln!(
            out,
            "device: {}, engines: {engines}, wq_mode: {wq_mode}, inflight: {}, best of {} x {:.2}s; MB/s = 10^6 uncompressed bytes/s",
            args.device, args.inflight, args.repeat, args.secs
        )?;
        writeln!(
            out,
            "{:<10} {:>5} {:>6} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "codec", "batch", "ratio", "seq c MB/s", "seq d MB/s", "dev c MB/s", "dev d MB/s", "c speed", "d speed"
        )?;
    }
    let mut rows = Vec::new();
    for spec in &specs {
        let comp = compress_corpus(*spec, &corpus);
        let objs: Vec<&[u8]> = comp.objs.iter().map(Vec::as_slice).collect();
        let ratio = (corpus.len() * PAGE_SIZE) as f64 / comp.stored_bytes as f64;
        for &batch in &args.batch {
            let seq = Sequential::new(spec.factory(), batch)?;
            let cfg = EnginesConfig {
                engines,
                wq_mode,
                batch_size: batch,
                verify_compress: args.verify,
                ..Default::default()
            };
            let dev = if nvcomp {
                let ncfg = zmem_nvcomp::NvcompConfig {
                    library: args.nvcomp_lib.clone(),
                    streams: args.inflight.max(1),
                    decompress: zmem_nvcomp::Placement::Gpu,
                    verify: args.verify,
                    ..Default::default()
                };
                let n = zmem_nvcomp::NvcompLz4::new(ncfg)?;
                if !args.json && rows.is_empty() {
                    writeln!(out, "GPU: {} (nvCOMP {})", n.gpu().name(), n.gpu().nvcomp_version())?;
                }
                Device::Nvcomp(n)
            } else {
                Device::Engines(Engines::new(cfg, spec.factory())?)
            };
            let mut spare = Vec::new();
            let (mut sc, mut sd, mut ec, mut ed) = (0f64, 0f64, 0f64, 0f64);
            for _ in 0..args.repeat {
                sc = sc.max(rate(args.secs, || compress_pass(&seq, &pages, batch, 1, &mut spare)));
                ec = ec.max(rate(args.secs, || compress_pass(dev.bc(), &pages, batch, args.inflight, &mut spare)));
                sd = sd.max(rate(args.secs, || decompress_pass(&seq, &objs, batch, 1, &mut spare)));
                ed = ed.max(rate(args.secs, || decompress_pass(dev.bc(), &objs, batch, args.inflight, &mut spare)));
            }
            let (st, nst) = match &dev {
                Device::Engines(e) => (zmem_compress::EngineStats::sum(&e.stats()), Default::default()),
                Device::Nvcomp(n) => (Default::default(), n.stats()),
            };
            if nst.verify_failures > 0 || nst.gpu_errors > 0 {
                bail!("nvcomp: {nst:?}");
            }
            let row = Row {
                codec: spec.to_string(),
                device: args.device.clone(),
                batch,
                ratio,
                poor_pages: comp.poor,
                seq_compress_mbps: sc,
                seq_decompress_mbps: sd,
                engines,
                wq_mode: wq_mode.to_string(),
                inflight: args.inflight,
                eng_compress_mbps: ec,
                eng_decompress_mbps: ed,
                compress_speedup: ec / sc,
                decompress_speedup: ed / sd,
                sw_fallback_calls: st.sw_fallback_calls,
                helped_calls: st.helped_calls,
                engine_calls: st.compress_calls + st.decompress_calls - st.helped_calls - st.sw_fallback_calls,
                verify_failures: st.verify_failures + nst.verify_failures,
                gpu_items: nst.gpu_items,
                cpu_items: nst.cpu_items,
            };
            if !args.json {
                writeln!(
                    out,
                    "{:<10} {:>5} {:>6.2} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>7.2}x {:>7.2}x",
                    row.codec, batch, ratio, sc, sd, ec, ed, row.compress_speedup, row.decompress_speedup
                )?;
                out.flush()?;
            }
            rows.push(row);
        }
    }
    if args.json {
        serde_json::to_writer_pretty(&mut out, &rows)?;
        writeln!(out)?;
    }
    Ok(())
}
