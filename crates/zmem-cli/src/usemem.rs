//! `zmem usemem`: the seeds' vm-scalability `usemem` experiment, in miniature.
//!
//! N worker processes each write S bytes of real corpus pages, sleep, then
//! read everything back and verify it, under a limit L on the group. One
//! invocation runs several configurations side by side:
//!
//! - `zmem:CODEC[@BATCH]`: each worker maps its memory from a zmem pager
//!   with limit L/N (a pager is per process), compressor CODEC and tier
//!   batch size BATCH (default 1, sequential);
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

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use zmem_compress::corpus::Corpus;
use zmem_compress::{CodecSpec, PAGE_SIZE};
use zmem_tier::TierConfig;
use zmem_uffd::{parse_size, Mapping, Pager, PagerConfig};

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
    /// kernel[:lzo|lzo-rle|deflate], swap, none. Kernel runs need root and
    /// are skipped with a message without it.
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

/// What a worker reports.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct WorkerReport {
    write_secs: f64,
    read_secs: f64,
    mismatched_pages: u64,
    sys_secs: f64,
    user_secs: f64,
    /// zmem workers only: their tier's counters at the end of writing.
    zswpout: u64,
    zswpin: u64,
    rejects: u64,
    stored_pages: u64,
    same_filled_pages: u64,
    pool_total_size: u64,
    written_back_pages: u64,
    /// The worker's peak RSS (VmHWM): its pages, its pool, its metadata.
    peak_rss_bytes: u64,
    /// zmem workers: the most of their swap file seen in the page cache.
    swap_page_cache_bytes: u64,
}

/// This process's peak RSS, from `VmHWM` in /proc/self/status.
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

#[derive(Debug, Serialize)]
struct RunReport {
    config: String,
    workers: usize,
    bytes_per_worker: usize,
    limit: usize,
    elapsed_secs: f64,
    write_mbps: f64,
    read_mbps: f64,
    /// usemem's throughput: bytes written and read back per second, all workers.
    total_kbps: f64,
    avg_kbps_per_worker: f64,
    sys_secs: f64,
    user_secs: f64,
    zswpout: u64,
    zswpin: u64,
    rejects: u64,
    written_back_pages: u64,
    /// Uncompressed bytes in the pool over pool bytes, at the end of writing.
    pool_ratio: Option<f64>,
    mismatched_pages: u64,
    /// Peak memory as the OS sees it, all workers: for zmem, peak RSS
    /// (pages, pool, metadata) plus the swap file's page cache; for the
    /// kernel, the cgroup's max_usage_in_bytes plus zswap's pool, which
    /// cgroup v1 does not charge; for none, peak RSS.
    peak_footprint_bytes: u64,
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
        rep.stored_pages = s.stored_pages;
        rep.same_filled_pages = s.same_filled_pages;
        rep.pool_total_size = s.pool_total_size;
        rep.written_back_pages = s.written_back_pages;
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
        rep.zswpin = p.tier().stats().zswpin;
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

// ------------------------------------------------------------------ kernel

const ZSWAP: &str = "/sys/module/zswap/parameters";
const CGROUP_V1: &str = "/sys/fs/cgroup/memory";

/// The machine changes a kernel run makes, undone on drop in reverse order.
#[derive(Debug, Default)]
struct KernelSetup {
    swapfile: Option<PathBuf>,
    swap_on: bool,
    zswap_saved: Vec<(String, String)>,
    cgroup: Option<PathBuf>,
    mounted_debugfs: bool,
}

fn write_param(path: &str, v: &str) -> Result<()> {
    std::fs::write(path, v).with_context(|| format!("write `{v}` to {path}"))
}

fn sh(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd).args(args).output().with_context(|| format!("run {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl KernelSetup {
    fn new(zswap: Option<&str>, limit: usize, swap_bytes: usize, dir: &Path) -> Result<KernelSetup> {
        if !rustix::process::geteuid().is_root() {
            bail!("kernel and swap runs need root (swapon, zswap parameters, a memory cgroup)");
        }
        if !Path::new(CGROUP_V1).join("memory.limit_in_bytes").exists() {
            bail!("no cgroup v1 memory controller at {CGROUP_V1}");
        }
        if zswap.is_some() && !Path::new(ZSWAP).exists() {
            bail!("this kernel has no zswap ({ZSWAP} is missing)");
        }
        let mut k = KernelSetup::default();
        // Save every zswap parameter before touching one.
        for name in ["enabled", "compressor", "max_pool_percent", "accept_threshold_percent", "shrinker_enabled"] {
            let p = format!("{ZSWAP}/{name}");
            if let Ok(v) = std::fs::read_to_string(&p) {
                k.zswap_saved.push((p, v.trim().to_string()));
            }
        }
        let file = dir.join(format!("zmem-usemem-{}.swap", std::process::id()));
        k.swapfile = Some(file.clone());
        sh("fallocate", &["-l", &swap_bytes.to_string(), &file.to_string_lossy()])?;
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        sh("mkswap", &[&file.to_string_lossy()])?;
        sh("swapon", &[&file.to_string_lossy()]).context("no swap support here")?;
        k.swap_on = true;
        match zswap {
            Some(c) => {
                write_param(&format!("{ZSWAP}/compressor"), c)
                    .with_context(|| format!("the kernel has no `{c}` for zswap (lzo, lzo-rle, deflate)"))?;
                write_param(&format!("{ZSWAP}/enabled"), "Y")?;
            }
            None => write_param(&format!("{ZSWAP}/enabled"), "N").or_else(|e| {
                if Path::new(ZSWAP).exists() {
                    Err(e)
                } else {
                    Ok(())
                }
            })?,
        }
        if !Path::new("/sys/kernel/debug/zswap").exists() && zswap.is_some() {
            k.mounted_debugfs = sh("mount", &["-t", "debugfs", "none", "/sys/kernel/debug"]).is_ok();
        }
        let cg = Path::new(CGROUP_V1).join(format!("zmem-usemem-{}", std::process::id()));
        std::fs::create_dir(&cg).with_context(|| format!("mkdir {}", cg.display()))?;
        k.cgroup = Some(cg.clone());
        std::fs::write(cg.join("memory.limit_in_bytes"), limit.to_string()).context("set memory.limit_in_bytes")?;
        Ok(k)
    }

    fn cgroup_procs(&self) -> Option<PathBuf> {
        self.cgroup.as_ref().map(|c| c.join("cgroup.procs"))
    }
}

impl Drop for KernelSetup {
    fn drop(&mut self) {
        let warn = |what: String| eprintln!("zmem usemem: restoring: {what}");
        if let Some(cg) = self.cgroup.take() {
            // The workers have exited; their pages may still be charged for
            // a moment.
            let mut ok = false;
            for _ in 0..100 {
                if std::fs::remove_dir(&cg).is_ok() {
                    ok = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if !ok {
                warn(format!("could not remove {}", cg.display()));
            }
        }
        if self.swap_on {
            if let Some(f) = &self.swapfile {
                if let Err(e) = sh("swapoff", &[&f.to_string_lossy()]) {
                    warn(format!("{e:#}"));
                }
            }
        }
        if let Some(f) = self.swapfile.take() {
            let _ = std::fs::remove_file(&f);
        }
        // Compressor before enabled, as they were saved.
        for (p, v) in self.zswap_saved.drain(..) {
            if std::fs::read_to_string(&p).is_ok_and(|cur| cur.trim() != v) {
                if let Err(e) = std::fs::write(&p, &v) {
                    warn(format!("{p} back to {v}: {e}"));
                }
            }
        }
        if self.mounted_debugfs {
            let _ = sh("umount", &["/sys/kernel/debug"]);
        }
    }
}

fn vmstat(name: &str) -> u64 {
    std::fs::read_to_string("/proc/vmstat")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()))
        .unwrap_or(0)
}

fn kernel_rejects() -> u64 {
    [
        "reject_alloc_fail",
        "reject_compress_fail",
        "reject_compress_poor",
        "reject_kmemcache_fail",
        "reject_reclaim_fail",
    ]
    .iter()
    .map(|n| debugfs_zswap(n))
    .sum()
}

fn debugfs_zswap(name: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/kernel/debug/zswap/{name}"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
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
        rejects,
        written_back_pages: w.iter().map(|r| r.written_back_pages).sum(),
        pool_ratio,
        mismatched_pages: done.iter().map(|r| r.mismatched_pages).sum(),
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
        let r = run_one(args, cfg, limit, &stop, bar.as_ref());
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let r = r.with_context(|| format!("configuration {}", cfg.name()))?;
        if r.mismatched_pages > 0 {
            bail!("{}: {} pages read back wrong", r.config, r.mismatched_pages);
        }
        reports.push(r);
    }
    print_table(&reports)?;
    std::fs::write(&args.json, serde_json::to_string_pretty(&reports)?)
        .with_context(|| format!("write {}", args.json.display()))?;
    chart(&reports, &args.svg)?;
    println!("wrote {} and {}", args.json.display(), args.svg.display());
    Ok(())
}

fn print_table(reports: &[RunReport]) -> Result<()> {
    let base = reports.iter().find(|r| r.config.starts_with("kernel"));
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<14} {:>8} {:>9} {:>9} {:>11} {:>11} {:>7} {:>9} {:>9} {:>7} {:>6} {:>10}  {}",
        "config",
        "elapsed",
        "write MB/s",
        "read MB/s",
        "total KB/s",
        "avg KB/s",
        "sys s",
        "zswpout",
        "zswpin",
        "rejects",
        "ratio",
        "peak MiB",
        base.map_or(String::new(), |b| format!("vs {}", b.config))
    )?;
    for r in reports {
        let vs = base.map_or(String::new(), |b| {
            format!(
                "write {:.2}x, read {:.2}x, elapsed {:.2}x",
                r.write_mbps / b.write_mbps,
                r.read_mbps / b.read_mbps,
                r.elapsed_secs / b.elapsed_secs
            )
        });
        writeln!(
            out,
            "{:<14} {:>7.2}s {:>10.0} {:>9.0} {:>11.0} {:>11.0} {:>7.2} {:>9} {:>9} {:>7} {:>6} {:>10}  {}",
            r.config,
            r.elapsed_secs,
            r.write_mbps,
            r.read_mbps,
            r.total_kbps,
            r.avg_kbps_per_worker,
            r.sys_secs,
            r.zswpout,
            r.zswpin,
            r.rejects,
            r.pool_ratio.map_or("-".into(), |x| format!("{x:.2}")),
            r.peak_footprint_bytes >> 20,
            vs
        )?;
    }
    Ok(())
}

/// Write and read-back MB/s per configuration, as grouped bars.
fn chart(reports: &[RunReport], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let max = reports.iter().map(|r| r.write_mbps.max(r.read_mbps)).fold(1.0, f64::max) * 1.15;
    let root = SVGBackend::new(path, (200 + 160 * reports.len() as u32, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let n = reports.len();
    let mut c = ChartBuilder::on(&root)
        .caption("zmem usemem: write and read-back MB/s", ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..n as f64, 0.0..max)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = (*x - 0.5).round() as usize;
            reports.get(i).map_or(String::new(), |r| r.config.clone())
        })
        .y_desc("MB/s")
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let bars = |get: fn(&RunReport) -> f64, off: f64, color: RGBColor| {
        reports
            .iter()
            .enumerate()
            .map(move |(i, r)| Rectangle::new([(i as f64 + off, 0.0), (i as f64 + off + 0.35, get(r))], color.filled()))
    };
    c.draw_series(bars(|r| r.write_mbps, 0.12, RGBColor(66, 133, 244)))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label("write")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], RGBColor(66, 133, 244).filled()));
    c.draw_series(bars(|r| r.read_mbps, 0.53, RGBColor(234, 67, 53)))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label("read back")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], RGBColor(234, 67, 53).filled()));
    c.configure_series_labels().border_style(BLACK).draw().map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}
