//! What every zmem crate shares: the page size (import it from here only),
//! the one table of defaults, [`ConfigError`], poison-tolerant locking, the
//! stderr logger, the `/proc` text readers ([`procfs`]), the stats files,
//! and [`host`]: the rules that let zmem live inside a program's process.
// No unsafe code but the signal mask of `host::thread` (a libc call), the
// reading and locking of a thread's TLS vector in `host::tls`, and the raw
// close, read and write of zmem's kept descriptors in `host::fds`.
#![deny(unsafe_code)]

use std::sync::{LockResult, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub mod host;
pub mod procfs;
pub mod stall;
pub mod stats_files;

/// The size of one page of user memory (x86-64).
pub const PAGE_SIZE: usize = 4096;

/// The defaults, in one place: the library configs, `zmem run`'s settings
/// and the CLI's flags all take them from here.
pub mod defaults {
    /// The managed memory's limit under `zmem run`.
    pub const LIMIT: usize = 1 << 30;
    /// The pool's share of the limit, percent (zswap's `max_pool_percent`).
    pub const MAX_POOL_PERCENT: u32 = 20;
    /// The same under `zmem run` (`ZMEM_MAX_POOL_PERCENT`). zswap's 20% is
    /// of all RAM, and cgroup v1 does not charge it to a cgroup; a zmem
    /// pool is inside the process's limit, so at 20% a program a few times
    /// its limit went mostly to the swap file. At 50%: redis (DEBUG DIGEST
    /// after BGSAVE, 24M) 17.5-19.7 s against 20.5-23.7 s, a perl hash of
    /// 300k keys under 48M 144 s against 195 s, Python the same.
    pub const RUN_MAX_POOL_PERCENT: u32 = 50;
    /// Bounds for `PagerConfig::pool_balance`, the share that moves with
    /// what misses cost, from `POOL_BALANCE_START_PERCENT`. On under `zmem
    /// run` with a swap file, unless `ZMEM_MAX_POOL_PERCENT` fixes the
    /// share (ARCHITECTURE.md, "The pool's share of the limit"). The floor
    /// was 10%: `scripts/node-random.js` under 200M sat there with 44k
    /// refaults a second against 35 swap faults, and took 3.99 s with the
    /// share fixed at 5% against 7.9-8.9 s at 10%.
    pub const POOL_BALANCE_PERCENT: (u32, u32) = (5, 80);
    /// Where the balanced share starts. It grows on evidence every 50 ms
    /// and shrinks at most once a second, by half at most, so it starts
    /// low, on the side it leaves fastest. From 50%, node-random under
    /// 200M spent its first 5-8 s stepping down, and took 12.4/16.1 s
    /// against 5.2/5.9 s from 10% (docs/benchmarks.md, 2026-12-06).
    pub const POOL_BALANCE_START_PERCENT: u32 = 10;
    /// After the pool limit is hit, stores resume below this percent of it.
    pub const ACCEPT_THRESHOLD_PERCENT: u32 = 90;
    /// The eviction unit.
    pub const FOLIO_SIZE: usize = 64 << 10;
    /// Reclaim starts above this percent of the limit, and stops below the
    /// low one. Close to the limit and to each other: every byte between
    /// the low watermark and the limit is memory the program pages through
    /// on average (ARCHITECTURE.md, "Accounting and the soft limit").
    pub const HIGH_WATERMARK_PERCENT: u32 = 99;
    pub const LOW_WATERMARK_PERCENT: u32 = 97;
    /// Folios per reclaim pass…
    pub const RECLAIM_BATCH: usize = 8;
    /// …and at least this many bytes, when folios are small.
    pub const RECLAIM_BATCH_BYTES: usize = 512 << 10;
    /// The most bytes a sequential fault loads ahead.
    pub const READ_AHEAD_BYTES: usize = 512 << 10;
    /// What a fault on an evicted folio loads when it continues no
    /// read-ahead stream (a random access): this much around the page.
    pub const FAULT_AROUND_BYTES: usize = 4 << 10;
    /// Mappings and allocations this large or larger are managed by `zmem run`.
    pub const THRESHOLD: usize = 256 << 10;
    /// A process under `zmem run` starts its pager once its anonymous
    /// memory reaches this percent of its share of the limit: a short
    /// process that stays under it pays nothing but the shim's load.
    pub const START_PERCENT: u32 = 50;
    /// Where `zmem run` puts its swap file: a disk directory.
    pub const SWAPFILE_DIR: &str = "/var/tmp";
    /// The codec.
    pub const COMPRESSOR: &str = "lz4";
    /// The codec `zmem run` switches to, when no codec was named, while
    /// the swap file serves many of the loads (`PagerConfig::strong_codec`).
    pub const STRONG_COMPRESSOR: &str = "zstd:1";
}

/// A bad setting, named: every crate's config errors are this.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `field` is `value`, outside `range`.
    #[error("{field} {value} is out of range: it must be in {range}")]
    OutOfRange { field: &'static str, value: String, range: &'static str },
    /// `field` breaks a rule that is not a range (`why` says which).
    #[error("{field}: {why}")]
    Invalid { field: &'static str, why: String },
    /// A setting (a `ZMEM_*` variable, or the flag for it) whose value is
    /// bad: `why` says how.
    #[error("{name}={value}: {why}")]
    Setting { name: String, value: String, why: String },
    /// A `ZMEM_*` name that is not a setting, or not UTF-8.
    #[error("{name}: {why}")]
    Name { name: String, why: &'static str },
    /// A size (`512M`, `1G`) that does not parse or is out of bounds.
    #[error("`{text}` {why}")]
    Size { text: String, why: &'static str },
    /// A directory that cannot hold a swap file.
    #[error("{}: {why}", dir.display())]
    SwapDir { dir: std::path::PathBuf, why: String },
}

impl ConfigError {
    pub fn out_of_range(field: &'static str, value: impl std::fmt::Display, range: &'static str) -> ConfigError {
        ConfigError::OutOfRange { field, value: value.to_string(), range }
    }

    pub fn invalid(field: &'static str, why: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { field, why: why.into() }
    }

    /// Setting `name` is `value`, which is bad because `why`.
    pub fn setting(name: &str, value: impl std::fmt::Display, why: impl std::fmt::Display) -> ConfigError {
        ConfigError::Setting { name: name.to_string(), value: value.to_string(), why: why.to_string() }
    }
}

/// Library code reports through the `log` facade; the binaries (the `zmem`
/// command, the shim, test children that check stderr) install this: one
/// line per record on stderr, `zmem: ` first. Warnings and errors by
/// default; `ZMEM_LOG=info` or `debug` for more. A second call, or a
/// program that already set a logger, changes nothing.
pub fn init_stderr_logger() {
    struct Stderr;
    impl log::Log for Stderr {
        fn enabled(&self, m: &log::Metadata<'_>) -> bool {
            m.level() <= log::max_level()
        }
        fn log(&self, r: &log::Record<'_>) {
            if self.enabled(r.metadata()) {
                use std::io::Write;
                let _ = writeln!(std::io::stderr().lock(), "zmem: {}", r.args());
            }
        }
        fn flush(&self) {}
    }
    static LOGGER: Stderr = Stderr;
    if log::set_logger(&LOGGER).is_ok() {
        let level = match std::env::var_os("ZMEM_LOG").as_ref().and_then(|v| v.to_str()) {
            Some("debug") => log::LevelFilter::Debug,
            Some("info") => log::LevelFilter::Info,
            Some("error") => log::LevelFilter::Error,
            _ => log::LevelFilter::Warn,
        };
        log::set_max_level(level);
        std::panic::set_hook(Box::new(report_panic));
    }
}

/// The panic hook of zmem's binaries and of the shim (each has its own
/// copy of std): one log line with the place and the message. std's own
/// hook reads `RUST_BACKTRACE` from the environment at the first panic,
/// and in the shim the environment is the program's memory: where zmem
/// had evicted it (redis keeps its environment on its heap, moved there
/// to make room for its process title), a panic on the pager's handler
/// thread faulted on it, waited for the handler (itself) for good, and
/// the program hung instead of aborting with this line.
fn report_panic(info: &std::panic::PanicHookInfo<'_>) {
    let msg = info
        .payload()
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    let place = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
    log::error!("panicked at {place}: {msg}");
}

/// Locks that shrug off poisoning: a thread that panicked while holding a
/// zmem lock has already reported itself, and the data the lock guards is
/// kept consistent step by step, so the others go on.
pub trait LockExt<T: ?Sized> {
    fn lock_ok(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn lock_ok(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// [`LockExt`] for `RwLock`.
pub trait RwLockExt<T: ?Sized> {
    fn read_ok(&self) -> RwLockReadGuard<'_, T>;
    fn write_ok(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_ok(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_ok(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// The value of a lock result, poisoned or not (condvar waits).
pub fn unpoison<T>(r: LockResult<T>) -> T {
    r.unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic after `init_stderr_logger` reads nothing of the environment:
    /// a child whose `environ` points at a page it may not read (as a
    /// program's environment zmem evicted would fault) panics on a thread
    /// and gets the log line. std's hook faulted there (SIGSEGV).
    #[test]
    #[allow(unsafe_code)]
    fn a_panic_is_reported_without_reading_the_environment() {
        if std::env::var_os("ZMEM_TEST_PANIC_CHILD").is_some() {
            init_stderr_logger();
            extern "C" {
                static mut environ: *const *const libc::c_char;
            }
            // SAFETY: a fresh anonymous mapping of one page, unreadable,
            // never freed: no Rust reference covers it.
            let page = unsafe {
                libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
            };
            assert_ne!(page, libc::MAP_FAILED);
            // SAFETY: this child has one other thread (the test harness's
            // main, waiting); once `environ` points at the page, nothing
            // here reads the environment but a panic hook that would, the
            // one tested.
            unsafe { environ = page as *const *const libc::c_char };
            let r = std::thread::spawn(|| panic!("on purpose")).join();
            assert!(r.is_err());
            std::process::exit(7);
        }
        let me = std::env::current_exe().unwrap();
        let out = std::process::Command::new(me)
            .args([
                "--exact",
                "tests::a_panic_is_reported_without_reading_the_environment",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("ZMEM_TEST_PANIC_CHILD", "1")
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(7), "the child: {:?}, stderr: {err}", out.status);
        assert!(err.contains("zmem: panicked at crates/zmem-common/src/lib.rs:"), "{err}");
        assert!(err.contains("on purpose"), "{err}");
    }

    #[test]
    fn a_poisoned_lock_still_opens() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = std::sync::Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *m.lock_ok() += 1;
        assert_eq!(*m.lock_ok(), 2);
        let rw = RwLock::new(5);
        *rw.write_ok() += 1;
        assert_eq!(*rw.read_ok(), 6);
    }
}
