//! `zmem usemem`: the seeds' vm-scalability `usemem` experiment, in miniature.
//!
//! N worker processes each write S bytes of real corpus pages, sleep, then
//! read everything back and verify it, under a limit L on the group. One
//! invocation runs several configurations side by side:
//!
//! - `zmem:CODEC[@BATCH]`: each worker maps its memory from a zmem pager
//!   with limit L/N (a pager is per process) and compressor CODEC; with
//!   `@BATCH` (2..=32) through the multi-engine device, one engine per core,
//!   in batches of BATCH (the batched path: a reclaim pass's pages are
//!   submitted at once and compress on every core); without, on the
//!   reclaim thread, one page at a time;
//! - `kernel[:lzo|lzo-rle|deflate]`: plain memory, in a cgroup v1 memory
//!   cgroup limited to L, with a swap file and the kernel's zswap on (root);
//! - `swap`: the same with zswap off;
//! - `none`: plain memory, no limit.
//!
//! Every machine setting the kernel runs change (swap, zswap parameters,
//! the cgroup, debugfs) is restored by [`KernelSetup`]'s Drop, on success,
//! error or Ctrl-C.
//!
//! Workers talk to the parent over a pipe, one line each: `P <bytes>`
//! (progress), `W <json>` (written; waits for a line on stdin), `D <json>`
//! (done).

pub(crate) mod kernel;
mod report;
mod worker;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use zmem_common::PAGE_SIZE;
use zmem_compress::CodecSpec;
use zmem_settings::parse_size;

use kernel::{debugfs_zswap, kernel_rejects, vmstat, KernelSetup};
use report::{chart, print_table, RunReport};
pub use worker::{worker, WorkerArgs, WorkerReport};

// The doc comments are `--help`'s text, where `zstd[:LEVEL]` is syntax, not a
// rustdoc link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Bytes each worker writes (K, M, G suffixes).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: usize,
    /// Limit on the workers' memory (default: half of all they write).
    #[arg(long, value_parser = parse_size)]
    limit: Option<usize>,
    /// Configurations, comma-separated or repeated: zmem:CODEC[@BATCH],
    /// kernel[:lzo|lzo-rle|deflate], swap, none. `@BATCH` compresses each
    /// reclaim pass in batches of BATCH on the multi-engine device, one
    /// engine per core; without it, on the reclaim thread. Kernel runs need
    /// root and are skipped with a message without it.
    #[arg(long = "config", value_delimiter = ',', default_value = "zmem:lz4,zmem:lz4@8,kernel:lzo,none")]
    configs: Vec<String>,
    /// How long workers sleep between writing and reading back, ms.
    #[arg(long, default_value_t = 1000)]
    sleep_ms: u64,
    /// Where the kernel runs put their swap file (a disk filesystem, not tmpfs).
    #[arg(long, default_value = "/var/tmp")]
    swap_dir: PathBuf,
    /// Write the results as JSON here.
    #[arg(long, default_value = "zmem-usemem.json")]
    json: PathBuf,
    /// Draw the throughputs as an SVG bar chart here.
    #[arg(long, default_value = "zmem-usemem.svg")]
    svg: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// After the runs, each zmem configuration again at the kernel's
    /// footprint: its limit moved by the difference between the kernel's
    /// peak footprint and its own (as `zmem compare --equal-footprint`).
    /// zmem's limit holds its pool; cgroup v1 does not charge zswap's, so
    /// at one limit the kernel holds more memory. Needs a kernel config.
    #[arg(long)]
    equal_footprint: bool,
}

/// One configuration to run.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Config {
    Zmem { codec: CodecSpec, batch: usize },
    Kernel { compressor: String },
    Swap,
    None,
}

impl Config {
    fn parse(s: &str) -> Result<Config> {
        let s = s.trim();
        Ok(match s.split_once(':').map_or((s, ""), |(a, b)| (a, b)) {
            ("zmem", rest) => {
                let (codec, batch) = rest.split_once('@').map_or((rest, "1"), |(c, b)| (c, b));
                let codec: CodecSpec =
                    if codec.is_empty() { "lz4".parse()? } else { codec.parse().context("zmem codec")? };
                let batch: usize = batch.parse().with_context(|| format!("batch size in `{s}`"))?;
                if !(1..=32).contains(&batch) {
                    bail!("batch size in `{s}` must be in 1..=32");
                }
                Config::Zmem { codec, batch }
            }
            ("kernel", c) => {
                let c = if c.is_empty() { "lzo" } else { c };
                if !["lzo", "lzo-rle", "deflate", "lz4", "zstd", "842"].contains(&c) {
                    bail!("unknown kernel compressor `{c}` (lzo, lzo-rle or deflate)");
                }
                Config::Kernel { compressor: c.to_string() }
            }
            ("swap", "") => Config::Swap,
            ("none", "") => Config::None,
            _ => bail!("unknown configuration `{s}`: zmem:CODEC[@BATCH], kernel[:COMPRESSOR], swap or none"),
        })
    }

    fn name(&self) -> String {
        match self {
            Config::Zmem { codec, batch: 1 } => format!("zmem:{codec}"),
            Config::Zmem { codec, batch } => format!("zmem:{codec}@{batch}"),
            Config::Kernel { compressor } => format!("kernel:{compressor}"),
            Config::Swap => "swap".into(),
            Config::None => "none".into(),
        }
    }

    fn needs_root(&self) -> bool {
        matches!(self, Config::Kernel { .. } | Config::Swap)
    }
}

// ------------------------------------------------------------------ parent

struct Workers {
    children: Vec<Child>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A worker of the kernel's configurations that the kernel's OOM killer
/// killed under the cgroup's limit: cgroup v1 kills where reclaim into
/// zswap and the swap file falls behind the workers' writes, on some runs
/// and not on others with the same figures.
#[derive(Debug)]
struct OomKilled(String);

impl std::fmt::Display for OomKilled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the kernel's OOM killer killed {} under its cgroup's limit", self.0)
    }
}

impl std::error::Error for OomKilled {}

fn run_one(
    args: &Args,
    cfg: &Config,
    limit: usize,
    stop: &Arc<AtomicBool>,
    bar: Option<&indicatif::ProgressBar>,
) -> Result<RunReport> {
    let exe = std::env::current_exe()?;
    let setup = match cfg {
        Config::Kernel { compressor } => {
            Some(KernelSetup::new(Some(compressor), limit, args.workers * args.size, &args.swap_dir)?)
        }
        Config::Swap => Some(KernelSetup::new(None, limit, args.workers * args.size, &args.swap_dir)?),
        _ => None,
    };
    let out0 = vmstat("zswpout");
    let in0 = vmstat("zswpin");
    let rejects0 = kernel_rejects();
    let t = Instant::now();
    let mut workers = Workers { children: Vec::new() };
    for id in 0..args.workers {
        let mut wargs =
            vec!["usemem-worker".to_string(), "--size".into(), args.size.to_string(), "--id".into(), id.to_string()];
        if let Config::Zmem { codec, batch } = cfg {
            wargs.extend([
                "--zmem-limit".into(),
                (limit / args.workers).to_string(),
                "--compressor".into(),
                codec.to_string(),
                "--batch".into(),
                batch.to_string(),
            ]);
        }
        let mut cmd = match setup.as_ref().and_then(KernelSetup::cgroup_procs) {
            // Only the worker goes into the cgroup: sh moves itself, then
            // execs the worker in place.
            Some(procs) => {
                let mut c = Command::new("sh");
                c.arg("-c").arg(format!("echo $$ > '{}' && exec \"$0\" \"$@\"", procs.display())).arg(&exe);
                c.args(&wargs);
                c
            }
            None => {
                let mut c = Command::new(&exe);
                c.args(&wargs);
                c
            }
        };
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        workers.children.push(cmd.spawn().context("start a worker")?);
    }
    // One reader thread per worker; messages come back on a channel.
    let (tx, rx) = std::sync::mpsc::channel::<(usize, String)>();
    for (id, c) in workers.children.iter_mut().enumerate() {
        let out = c.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send((id, line)).is_err() {
                    break;
                }
            }
            let _ = tx.send((id, "EOF".into()));
        });
    }
    drop(tx);
    let mut written: Vec<Option<WorkerReport>> = vec![None; args.workers];
    let mut done: Vec<Option<WorkerReport>> = vec![None; args.workers];
    let mut pool_ratio = None;
    let mut kernel_pool = 0;
    let mut released = false;
    while done.iter().any(Option::is_none) {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        let Ok((id, line)) = rx.recv_timeout(Duration::from_millis(100)) else { continue };
        if let Some(n) = line.strip_prefix("P ") {
            if let Some(b) = bar {
                b.inc(n.parse().unwrap_or(0));
            }
        } else if let Some(j) = line.strip_prefix("W ") {
            written[id] = Some(serde_json::from_str(j)?);
        } else if let Some(j) = line.strip_prefix("D ") {
            done[id] = Some(serde_json::from_str(j)?);
        } else if line == "EOF" && done[id].is_none() {
            let status = workers.children[id].wait()?;
            if setup.as_ref().is_some_and(|s| s.oom_kills() > 0) {
                return Err(OomKilled(format!("worker {id} of {} ({status})", cfg.name())).into());
            }
            bail!("worker {id} of {} exited early ({status})", cfg.name());
        }
        if !released && written.iter().all(Option::is_some) {
            // Everything is written: sample the pool, sleep, then read back.
            pool_ratio = match cfg {
                Config::Kernel { .. } => {
                    let (stored, size) = (debugfs_zswap("stored_pages"), debugfs_zswap("pool_total_size"));
                    kernel_pool = size;
                    (size > 0).then(|| (stored * PAGE_SIZE as u64) as f64 / size as f64)
                }
                Config::Zmem { .. } => {
                    let w = written.iter().flatten();
                    let (stored, size) =
                        w.fold((0, 0), |(s, z), r| (s + r.stored_pages - r.same_filled_pages, z + r.pool_total_size));
                    (size > 0).then(|| (stored * PAGE_SIZE as u64) as f64 / size as f64)
                }
                _ => None,
            };
            std::thread::sleep(Duration::from_millis(args.sleep_ms));
            for c in &mut workers.children {
                writeln!(c.stdin.as_mut().expect("piped"), "go")?;
            }
            released = true;
        }
    }
    for (id, c) in workers.children.iter_mut().enumerate() {
        let s = c.wait()?;
        if !s.success() {
            bail!("worker {id} of {} failed ({s})", cfg.name());
        }
    }
    workers.children.clear();
    let elapsed = t.elapsed().as_secs_f64() - args.sleep_ms as f64 / 1000.0;
    let done: Vec<WorkerReport> = done.into_iter().flatten().collect();
    let w = written.into_iter().flatten().collect::<Vec<_>>();
    let total = (args.workers * args.size) as f64;
    let write_secs = done.iter().map(|r| r.write_secs).fold(0.0, f64::max);
    let read_secs = done.iter().map(|r| r.read_secs).fold(0.0, f64::max);
    let per_worker_kbps: f64 =
        done.iter().map(|r| 2.0 * args.size as f64 / 1024.0 / (r.write_secs + r.read_secs)).sum::<f64>();
    let (zswpout, zswpin) = match cfg {
        Config::Zmem { .. } => (done.iter().map(|r| r.zswpout).sum(), done.iter().map(|r| r.zswpin).sum()),
        _ => (vmstat("zswpout") - out0, vmstat("zswpin") - in0),
    };
    let rejects = match cfg {
        Config::Zmem { .. } => w.iter().map(|r| r.rejects).sum(),
        _ => kernel_rejects().saturating_sub(rejects0),
    };
    let peak_rss: u64 = done.iter().map(|r| r.peak_rss_bytes).sum();
    let peak_footprint_bytes = match cfg {
        Config::Zmem { .. } => peak_rss + done.iter().map(|r| r.swap_page_cache_bytes).sum::<u64>(),
        Config::Kernel { .. } | Config::Swap => {
            let max_usage = setup
                .as_ref()
                .and_then(|s| s.cgroup.as_ref())
                .and_then(|cg| std::fs::read_to_string(cg.join("memory.max_usage_in_bytes")).ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(peak_rss);
            max_usage + kernel_pool
        }
        Config::None => peak_rss,
    };
    drop(setup);
    Ok(RunReport {
        peak_footprint_bytes,
        config: cfg.name(),
        workers: args.workers,
        bytes_per_worker: args.size,
        limit,
        elapsed_secs: elapsed,
        write_mbps: total / write_secs / 1e6,
        read_mbps: total / read_secs / 1e6,
        total_kbps: per_worker_kbps,
        avg_kbps_per_worker: per_worker_kbps / args.workers as f64,
        sys_secs: done.iter().map(|r| r.sys_secs).sum(),
        user_secs: done.iter().map(|r| r.user_secs).sum(),
        zswpout,
        zswpin,
        cached_reused: done.iter().map(|r| r.cached_reused).sum(),
        metadata_bytes_per_page: match cfg {
            Config::Zmem { .. } => Some(w.iter().map(|r| r.metadata_bytes_per_page).fold(0.0, f64::max)),
            _ => None,
        },
        rejects,
        written_back_pages: w.iter().map(|r| r.written_back_pages).sum(),
        writeback_bytes_per_page: {
            let (bytes, pages): (u64, u64) =
                (w.iter().map(|r| r.swap_written_bytes).sum(), w.iter().map(|r| r.written_back_pages).sum());
            (pages > 0).then(|| bytes as f64 / pages as f64)
        },
        pool_ratio,
        mismatched_pages: done.iter().map(|r| r.mismatched_pages).sum(),
        vs_kernel: None,
        elapsed_vs_none: None,
    })
}

pub fn run(args: &Args) -> Result<()> {
    if !(1..=64).contains(&args.workers) {
        bail!("--workers must be in 1..=64");
    }
    let limit = args.limit.unwrap_or(args.workers * args.size / 2);
    let mut configs = Vec::new();
    for c in &args.configs {
        let c = Config::parse(c)?;
        if c.needs_root() && !rustix::process::geteuid().is_root() {
            eprintln!("zmem usemem: skipping {} (needs root: swapon, zswap parameters, a memory cgroup)", c.name());
            continue;
        }
        configs.push(c);
    }
    if let Some(c) = configs.iter().find(|c| matches!(c, Config::Zmem { .. })) {
        let per = limit / args.workers;
        if per < 8 << 20 {
            bail!("--limit gives each zmem worker {per} bytes; {} needs at least 8 MiB per worker", c.name());
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        // Workers get the SIGINT too and die; the parent notices, stops,
        // and restores the machine.
        ctrlc::set_handler(move || stop.store(true, Ordering::Relaxed)).context("install a Ctrl-C handler")?;
    }
    println!(
        "usemem: {} workers x {} MiB of corpus pages, limit {} MiB, sleep {} ms between write and read-back",
        args.workers,
        args.size >> 20,
        limit >> 20,
        args.sleep_ms
    );
    let mut reports = Vec::new();
    for cfg in &configs {
        let bar = (!args.quiet).then(|| {
            let b = indicatif::ProgressBar::new((2 * args.workers * args.size) as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template("{prefix:>16} [{bar:40}] {bytes}/{total_bytes} {elapsed}")
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            b.set_prefix(cfg.name());
            b
        });
        let mut r = run_one(args, cfg, limit, &stop, bar.as_ref());
        // The kernel's run once more, and said so: one OOM kill is the
        // kernel's luck of the run, two are its result.
        if let Some(e) = r.as_ref().err().and_then(|e| e.downcast_ref::<OomKilled>()) {
            eprintln!("zmem: {e}; its configuration runs once more");
            if let Some(b) = &bar {
                b.reset();
            }
            r = run_one(args, cfg, limit, &stop, bar.as_ref());
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let r = r.with_context(|| format!("configuration {}", cfg.name()))?;
        if r.mismatched_pages > 0 {
            bail!("{}: {} pages read back wrong", r.config, r.mismatched_pages);
        }
        reports.push(r);
    }
    if args.equal_footprint {
        let kernel = reports.iter().find(|r| r.config.starts_with("kernel")).map(|k| k.peak_footprint_bytes);
        let Some(kernel) = kernel else {
            bail!("--equal-footprint needs a kernel configuration that ran (it measures the kernel's footprint)");
        };
        let zmem: Vec<(&Config, u64)> = configs
            .iter()
            .zip(&reports)
            .filter(|(c, _)| matches!(c, Config::Zmem { .. }))
            .map(|(c, r)| (c, r.peak_footprint_bytes))
            .collect();
        for (cfg, footprint) in zmem {
            let matched = crate::compare::equal_footprint_limit(limit as u64, footprint, kernel) as usize;
            let mut r = run_one(args, cfg, matched, &stop, None)
                .with_context(|| format!("configuration {} at {} MiB", cfg.name(), matched >> 20))?;
            if r.mismatched_pages > 0 {
                bail!("{}: {} pages read back wrong", r.config, r.mismatched_pages);
            }
            r.config = format!("{}/{}M", r.config, matched >> 20);
            reports.push(r);
        }
    }
    report::compare_with_baselines(&mut reports);
    print_table(&reports)?;
    std::fs::write(&args.json, serde_json::to_string_pretty(&reports)?)
        .with_context(|| format!("write {}", args.json.display()))?;
    chart(&reports, &args.svg)?;
    println!("wrote {} and {}", args.json.display(), args.svg.display());
    Ok(())
}
