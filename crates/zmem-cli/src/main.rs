//! The `zmem` command.
//!
//! - `zmem usemem`: the usemem experiment, zmem against the kernel's zswap.
//! - `zmem run -- CMD`: CMD with its large anonymous memory managed by zmem.
//! - `zmem compare --limit L -- CMD`: CMD as is, under zmem, and under the
//!   kernel's zswap: time and peak footprint side by side.
//! - `zmem stats PID`: the stats of a process under `zmem run`.
//! - `zmem bench compress`: codec and batch throughput on real pages.
//! - `zmem corpus capture --pid PID -o FILE`: capture a process's anonymous
//!   pages to benchmark on.
// No unsafe code, except in the soak, which plays a program: it unmaps,
// drops and moves its own managed memory with raw madvise/munmap/mremap;
// in the SIGBUS bench, whose signal handler serves faults; and in the
// signal set-up of `main` and of `run` (which forwards signals to its
// program).
#![deny(unsafe_code)]

mod bench_compress;
mod bench_fault;
#[allow(unsafe_code)]
mod bench_sigbus;
#[allow(unsafe_code)]
mod bench_soak;
mod bench_start;
mod bench_tier;
mod bench_zsmalloc;
mod compare;
mod controller;
mod run;
mod usemem;

use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "zmem", version, about = "A compressed-memory tier for Linux, in user space")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Benchmarks (ratios against a baseline measured in the same run).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// The usemem experiment: N workers write S bytes of real pages under a
    /// limit, sleep, read back and verify; zmem side by side with the
    /// kernel's zswap, plain swap and no limit.
    Usemem(usemem::Args),
    /// Run a program with its large anonymous memory managed by zmem
    /// (LD_PRELOAD); its exit status is passed through.
    Run(run::Args),
    /// A program as is, under zmem and under the kernel's zswap (a cgroup
    /// limit and a swap file, restored afterwards): time and peak
    /// footprint side by side.
    Compare(compare::Args),
    /// Print the stats of a process running under `zmem run`.
    Stats(run::StatsArgs),
    /// One usemem worker (started by `zmem usemem`).
    #[command(hide = true)]
    UsememWorker(usemem::WorkerArgs),
    /// Page corpora: capture real pages to benchmark on.
    Corpus {
        #[command(subcommand)]
        what: CorpusCmd,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Compress and decompress MB/s, ratio, and batched/sequential speedup.
    Compress(bench_compress::Args),
    /// Pool overhead and malloc/free throughput of the zsmalloc-style pool.
    Zsmalloc(bench_zsmalloc::Args),
    /// Fault latency (p50/p99 per 4 KiB) of the userfaultfd pager: zero-fill, pool, swap file.
    Fault(bench_fault::Args),
    /// One fault served by a handler thread against the faulting thread's
    /// own SIGBUS handler (UFFD_FEATURE_SIGBUS): decompress and COPY.
    Sigbus(bench_sigbus::Args),
    /// Store and load MB/s through the tier, with writeback off and on, and writeback MB/s.
    Tier(bench_tier::Args),
    /// Verified reads and writes of a region several times the limit, under
    /// munmap, madvise, mremap, compressor switches and injected faults.
    Soak(bench_soak::Args),
    /// What a short program pays to start and exit under `zmem run` while
    /// memory is plentiful, against the same program as is, alternated.
    Start(bench_start::Args),
}

#[derive(Debug, Subcommand)]
enum CorpusCmd {
    /// Capture present, private, anonymous pages of a running process
    /// (through /proc/PID/pagemap and /proc/PID/mem; needs ptrace access).
    Capture {
        #[arg(long)]
        pid: u32,
        /// Output file; raw concatenated 4 KiB pages (zstd-compressed if it ends in .zst).
        #[arg(short, long)]
        output: PathBuf,
        /// Sample at most this many pages, evenly spaced.
        #[arg(long, default_value_t = 16384)]
        max_pages: usize,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Bench { what: BenchCmd::Compress(args) } => bench_compress::run(&args),
        Cmd::Bench { what: BenchCmd::Zsmalloc(args) } => bench_zsmalloc::run(&args),
        Cmd::Bench { what: BenchCmd::Tier(args) } => bench_tier::run(&args),
        Cmd::Bench { what: BenchCmd::Fault(args) } => bench_fault::run(&args),
        Cmd::Bench { what: BenchCmd::Sigbus(args) } => bench_sigbus::run(&args),
        Cmd::Bench { what: BenchCmd::Soak(args) } => bench_soak::run(&args),
        Cmd::Bench { what: BenchCmd::Start(args) } => bench_start::run(&args),
        Cmd::Usemem(args) => usemem::run(&args),
        Cmd::Compare(args) => compare::run(&args),
        Cmd::Run(_) => unreachable!("handled in main"),
        Cmd::Stats(args) => run::stats(&args),
        Cmd::UsememWorker(args) => usemem::worker(&args),
        Cmd::Corpus { what: CorpusCmd::Capture { pid, output, max_pages } } => capture(pid, &output, max_pages),
    }
}

fn capture(pid: u32, output: &PathBuf, max_pages: usize) -> Result<()> {
    let mut pages = Vec::new();
    let n = zmem_compress::corpus::capture(pid, max_pages, &mut pages)?;
    let bytes = if output.extension().is_some_and(|e| e == "zst") { zstd_encode(&pages)? } else { pages };
    std::fs::write(output, &bytes).with_context(|| format!("write {}", output.display()))?;
    println!("captured {n} pages ({} MiB) from pid {pid} into {}", (n * 4096) >> 20, output.display());
    Ok(())
}

fn zstd_encode(data: &[u8]) -> Result<Vec<u8>> {
    zmem_compress::corpus::zstd_encode(data).context("zstd-compress the capture")
}

/// `zmem stats 1234 | head`: a write to a closed pipe ends the process
/// quietly (SIGPIPE), as it does `cat`, rather than panicking in
/// `println!` (Rust starts with SIGPIPE ignored). Only for commands that
/// change nothing: `zmem run` must outlive whatever happens to its output
/// while the program runs, and `usemem`, `compare` and `bench soak` write
/// to their workers' pipes and must live to restore the machine (swap,
/// cgroups, zswap) if a worker dies.
#[allow(unsafe_code)]
fn die_quietly_on_a_closed_pipe() {
    // SAFETY: sets a signal's disposition to the default action, before
    // any thread is started; no handler of ours is involved.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    zmem_common::init_stderr_logger();
    if let Cmd::Run(args) = &cli.cmd {
        return match run::run(args) {
            Ok(code) => code,
            Err(e) => {
                let _ = writeln!(io::stderr(), "zmem run: {e:#}");
                ExitCode::from(127)
            }
        };
    }
    if matches!(
        cli.cmd,
        Cmd::Stats(_)
            | Cmd::Corpus { .. }
            | Cmd::Bench {
                what: BenchCmd::Compress(_)
                    | BenchCmd::Zsmalloc(_)
                    | BenchCmd::Tier(_)
                    | BenchCmd::Fault(_)
                    | BenchCmd::Sigbus(_)
                    | BenchCmd::Start(_)
            }
    ) {
        die_quietly_on_a_closed_pipe();
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed pipe (`zmem usemem … | head`) is not an error.
            if e.chain().any(|c| c.downcast_ref::<io::Error>().is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe))
            {
                return ExitCode::SUCCESS;
            }
            let _ = writeln!(io::stderr(), "zmem: {e:#}");
            ExitCode::FAILURE
        }
    }
}
