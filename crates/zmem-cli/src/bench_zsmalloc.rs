//! `zmem bench zsmalloc`: the pool on objects sized like real compressed
//! pages. Reports, per codec and chain size:
//! - malloc+free throughput, as a ratio to the system allocator measured in
//!   the same run on the same size stream;
//! - `pool_total_size / sum of object sizes` in the steady state, after
//!   freeing a random half, and after `compact()`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;
use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::CompressError;
use zmem_zsmalloc::{Handle, Mempool, MempoolConfig, ZsPool, ZsPoolConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Raw or .zst page file; default: the embedded sample.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Codecs whose per-page output sizes make the object stream.
    #[arg(long, default_value = "lz4,zstd:1")]
    codec: String,
    /// zspage chain sizes to compare (1..=16).
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    chain: Vec<usize>,
    /// Objects in the steady-state pool.
    #[arg(long, default_value_t = 65536)]
    objects: usize,
    /// Rounds of the throughput loop (best kept).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    codec: String,
    chain_size: usize,
    objects: usize,
    mean_object: f64,
    zs_mops: f64,
    sys_mops: f64,
    zs_vs_sys: f64,
    steady_ratio: f64,
    after_free_ratio: f64,
    after_compact_ratio: f64,
    metadata_ratio: f64,
    compact_pages_freed: usize,
}

/// Object sizes a codec gives the corpus pages (a Poor page is stored raw).
fn sizes(spec: zmem_compress::CodecSpec, corpus: &Corpus) -> Vec<usize> {
    let mut c = spec.build();
    let mut out = vec![0u8; PAGE_SIZE];
    corpus
        .pages()
        .map(|p| match c.compress(p, &mut out) {
            Ok(n) => n,
            Err(CompressError::Poor) => PAGE_SIZE,
            Err(e) => panic!("{spec}: {e}"),
        })
        .collect()
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// malloc every size of the window, then free them all; Mops/s of (malloc+free) pairs.
fn zs_rate(pool: &ZsPool, stream: &[usize], repeat: usize) -> f64 {
    let mut best = 0f64;
    let mut hs: Vec<Handle> = Vec::with_capacity(4096);
    for _ in 0..repeat {
        let start = Instant::now();
        for window in stream.chunks(4096) {
            hs.extend(window.iter().map(|&s| pool.malloc(s).expect("malloc")));
            for h in hs.drain(..) {
                pool.free(h).expect("free");
            }
        }
        best = best.max(stream.len() as f64 / start.elapsed().as_secs_f64() / 1e6);
    }
    best
}

fn sys_rate(stream: &[usize], repeat: usize) -> f64 {
    let mut best = 0f64;
    let mut bs: Vec<Box<[u8]>> = Vec::with_capacity(4096);
    for _ in 0..repeat {
        let start = Instant::now();
        for window in stream.chunks(4096) {
            // Uninitialised-equivalent: a zeroed allocation is calloc, which
            // for these sizes costs the same as malloc from the free lists.
            bs.extend(window.iter().map(|&s| vec![0u8; s].into_boxed_slice()));
            bs.clear();
        }
        best = best.max(stream.len() as f64 / start.elapsed().as_secs_f64() / 1e6);
    }
    std::hint::black_box(&bs);
    best
}

pub fn run(args: &Args) -> Result<()> {
    let specs = zmem_compress::codec::parse_list(&args.codec)?;
    for &c in &args.chain {
        if !(1..=16).contains(&c) {
            bail!("--chain {c} is out of range; valid chain sizes are 1..=16");
        }
    }
    if args.objects == 0 || args.repeat == 0 {
        bail!("--objects and --repeat must be at least 1");
    }
    let corpus = Corpus::sample_or(args.corpus.as_deref())?;
    let mut out = std::io::stdout().lock();
    if !args.json {
        writeln!(out, "corpus: {} ({} pages); {} objects per pool", corpus.origin(), corpus.len(), args.objects)?;
        writeln!(
            out,
            "{:<8} {:>5} {:>8} {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>6}",
            "codec", "chain", "mean B", "zs Mop/s", "sys Mop/s", "zs/sys", "steady", "-50%", "compact", "meta"
        )?;
    }
    let mut rows = Vec::new();
    for spec in specs {
        let base = sizes(spec, &corpus);
        let stream: Vec<usize> = (0..args.objects).map(|i| base[i % base.len()]).collect();
        let total: usize = stream.iter().sum();
        for &chain in &args.chain {
            let mempool = Arc::new(Mempool::new(MempoolConfig::default())?);
            let pool = ZsPool::new(ZsPoolConfig { chain_size: chain, merge_classes: true }, mempool)?;
            let sys = sys_rate(&stream, args.repeat);
            let zs = zs_rate(&pool, &stream, args.repeat);

            let handles: Vec<Handle> = stream.iter().map(|&s| pool.malloc(s)).collect::<Result<_, _>>()?;
            let steady = pool.pool_total_size() as f64 / total as f64;
            let meta = pool.metadata_bytes() as f64 / total as f64;
            let mut x = 0x2545_F491_4F6C_DD1Du64 ^ chain as u64;
            let mut kept = 0usize;
            for (h, &s) in handles.iter().zip(&stream) {
                if xorshift(&mut x) & 1 == 0 {
                    pool.free(*h)?;
                } else {
                    kept += s;
                }
            }
            let after_free = pool.pool_total_size() as f64 / kept as f64;
            let freed = pool.compact();
            let after_compact = pool.pool_total_size() as f64 / kept as f64;
            let row = Row {
                codec: spec.to_string(),
                chain_size: chain,
                objects: stream.len(),
                mean_object: total as f64 / stream.len() as f64,
                zs_mops: zs,
                sys_mops: sys,
                zs_vs_sys: zs / sys,
                steady_ratio: steady,
                after_free_ratio: after_free,
                after_compact_ratio: after_compact,
                metadata_ratio: meta,
                compact_pages_freed: freed,
            };
            if !args.json {
                writeln!(
                    out,
                    "{:<8} {:>5} {:>8.0} {:>9.2} {:>9.2} {:>6.2}x {:>8.3} {:>8.3} {:>8.3} {:>5.1}%",
                    row.codec,
                    chain,
                    row.mean_object,
                    zs,
                    sys,
                    row.zs_vs_sys,
                    steady,
                    after_free,
                    after_compact,
                    meta * 100.0
                )?;
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
