//! `ZMEM_*` settings: parsed by `zmem run` before it starts the program, so
//! that a bad value is an error up front, and by the shim at start-up. The
//! pager itself reads no environment: it takes a `PagerConfig`.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `ZMEM_LIMIT` | `1G` | resident memory plus pool plus metadata of managed regions |
//! | `ZMEM_COMPRESSOR` | `lz4` | `lz4`, `zstd[:LEVEL]`, `deflate[:LEVEL]`, `lzo`, `lzo-rle`; unset: lz4, and zstd:1 for new stores while the swap file serves a tenth of the loads or more |
//! | `ZMEM_RECOMPRESS` | unset | a stronger codec (`zstd`, say): idle pool entries are recompressed with it in the background, as zram's `recompress` |
//! | `ZMEM_MAX_POOL_PERCENT` | unset | the pool's share of the limit, fixed (1..=100); unset: it starts at 10% and moves between 5% and 80% with what misses cost (with a swap file; without one it stays at 50%) |
//! | `ZMEM_SWAPFILE_DIR` | `/var/tmp` | write back to a swap file in this directory (not tmpfs) |
//! | `ZMEM_WRITEBACK` | `1` | `0`: no swap file; when the pool is full the limit turns soft |
//! | `ZMEM_NO_ENCRYPT` | `0` | `1`: do not encrypt the swap file |
//! | `ZMEM_THRESHOLD` | `256K` | mappings and allocations this large or larger are managed |
//! | `ZMEM_ADOPT` | `1` | `0`: manage only what the shim sees mapped (no scan of the address space) |
//! | `ZMEM_STACKS` | `0` | `1`: manage the program's thread stacks too |
//! | `ZMEM_FORK_EVENT` | `0` | `1`: a fork loads nothing back; the child takes its evicted pages over from its parent (the limit holds across fork, but a fork costs a copy of the evicted set) |
//! | `ZMEM_SHOW_LIMIT` | `0` | `1`: the program sees the limit as its machine's memory (`sysconf(_SC_PHYS_PAGES)`, `_SC_AVPHYS_PAGES`, `sysinfo`), as a program in a memory cgroup sees the cgroup's limit |
//! | `ZMEM_SCAN_MS` | `100` | how often the address space is scanned for mappings to adopt |
//! | `ZMEM_HANDLER_FOLLOW` | `1` | `0`: the fault handler never pins itself to the CPU of the thread that takes most of its faults |
//! | `ZMEM_HANDLER_HOLD` | `1` | `0`: never narrow that thread's affinity to the handler's CPU while its faults are served (done only where the scheduler keeps moving it away) |
//! | `ZMEM_FOLIO` | `64K` | eviction unit, 4K..=2M, a power of two |
//! | `ZMEM_FAULT_AROUND` | `4K` | what a fault that continues no sequential stream loads of an evicted folio (a power of two; `0` or the folio size: whole folios) |
//! | `ZMEM_READ_AHEAD` | `512K` | the most a fault that continues a sequential stream loads ahead (`0`: no read-ahead) |
//! | `ZMEM_STATS_DIR` | `/tmp/zmem-stats-UID` | where `zmem-PID.json` is updated (UID: the effective user's; one directory per user, `0700`) |
//! | `ZMEM_STATS_INTERVAL_MS` | `1000` | how often |
//! | `ZMEM_MAX_SLOWDOWN` | unset | `5%`: `zmem run` moves the tree's limit (at most `ZMEM_LIMIT`, if given) so that the program's stall on it stays near 5% of its CPU time |
//! | `ZMEM_REPORT` | unset | `zmem run` writes an SVG of the limit, resident memory, pool and stall over time to this file as the program exits |
//! | `ZMEM_TREE` | unset | the process tree's accounting segment (`zmem run` sets it): the limit is shared by every process of the tree |
//! | `ZMEM_DISABLE` | `0` | `1`: the shim passes everything through |
//! | `ZMEM_LOG` | `warn` | `info` or `debug`: more on stderr (from the shim and from `zmem`) |
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use zmem_common::defaults;
pub use zmem_common::ConfigError;
use zmem_tier::{CodecSpec, TierConfig};
use zmem_uffd::{AdoptConfig, PagerConfig};

/// The shim's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub limit: usize,
    pub compressor: CodecSpec,
    /// `PagerConfig::strong_codec`: zstd:1 unless a codec was named.
    pub strong_compressor: Option<CodecSpec>,
    /// `PagerConfig::recompress`.
    pub recompress: Option<CodecSpec>,
    pub max_pool_percent: u32,
    /// `PagerConfig::pool_balance`: the share moves, unless
    /// `ZMEM_MAX_POOL_PERCENT` fixed it (a share named is the share used).
    pub pool_balance: bool,
    /// Where the swap file goes; `None`: writeback is off.
    pub swapfile_dir: Option<PathBuf>,
    pub encrypt: bool,
    pub threshold: usize,
    /// Scan the address space and adopt the program's mappings.
    pub adopt: bool,
    pub stacks: bool,
    /// `PagerConfig::handler_follow`.
    pub handler_follow: bool,
    /// `PagerConfig::handler_hold`.
    pub handler_hold: bool,
    /// A forked child takes its evicted pages over from its parent
    /// (`UFFD_FEATURE_EVENT_FORK`); off (the default): a fork loads them
    /// back first.
    pub fork_event: bool,
    /// The program sees the limit as its machine's memory (the shim's
    /// `sysconf`, `sysinfo` and `/proc/meminfo`), as one in a memory cgroup sees the
    /// cgroup's: runtimes that size themselves from it (DuckDB, the JVM's
    /// default heap) size themselves to the limit.
    pub show_limit: bool,
    pub scan_interval: Duration,
    pub folio: usize,
    /// `PagerConfig::fault_around`.
    pub fault_around: usize,
    /// `PagerConfig::read_ahead`.
    pub read_ahead: usize,
    /// `ZMEM_STATS_DIR`; `None`: [`default_stats_dir`] of the process's
    /// effective user at the time of each write (a forked child may drop
    /// privileges before it execs).
    pub stats_dir: Option<PathBuf>,
    pub stats_interval: Duration,
    /// The process tree's accounting segment (`zmem_uffd::tree`).
    pub tree: Option<PathBuf>,
    /// A process's pager starts once its anonymous memory reaches this
    /// percent of its share of the limit (`ZMEM_START_PERCENT`); until
    /// then it only counts itself in the tree. 0: at once, as the shim
    /// loads. Needs adoption (the pager finds what was mapped before it).
    pub start_percent: u32,
    /// `zmem run --max-slowdown`: the stall on the limit, percent of the
    /// program's CPU time, that the controller moves the tree's limit to
    /// hold (`ZMEM_MAX_SLOWDOWN`); `None`: the limit is fixed.
    pub max_slowdown: Option<f64>,
    /// Whether `ZMEM_LIMIT` was given: with `max_slowdown`, it is the
    /// ceiling; without, the machine's memory is.
    pub limit_given: bool,
    /// `zmem run --report`: an SVG of limit, resident, pool and stall over
    /// time, written as the program exits (`ZMEM_REPORT`).
    pub report: Option<PathBuf>,
    pub disable: bool,
}

/// Where a process of user `uid` writes its stats file unless
/// `ZMEM_STATS_DIR` says otherwise: a directory of that user's own, so
/// that no user's files land in (or fail in) a directory another made.
pub fn default_stats_dir(uid: u32) -> PathBuf {
    PathBuf::from(format!("/tmp/zmem-stats-{uid}"))
}

/// `1G`, `512M`, `64K` or bytes.
///
/// # Errors
/// [`ConfigError::Size`], naming the bad text.
pub fn parse_size(s: &str) -> Result<usize, ConfigError> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let bad = |why| ConfigError::Size { text: s.to_string(), why };
    let n: usize = num.parse().map_err(|_| bad("is not a size (try 512M or 1G)"))?;
    let v = n.checked_mul(mul).ok_or_else(|| bad("is too large"))?;
    if v == 0 {
        return Err(bad("is not a size above zero"));
    }
    Ok(v)
}

/// `5%`, `5` or `0.5%`: a slowdown in percent, above 0 and at most 100.
///
/// # Errors
/// [`ConfigError::Setting`] for `key`, naming the bad text.
pub fn parse_slowdown(key: &str, v: &str) -> Result<f64, ConfigError> {
    let t = v.trim();
    let n: f64 = t
        .strip_suffix('%')
        .unwrap_or(t)
        .trim()
        .parse()
        .map_err(|_| ConfigError::setting(key, v, "expected a percent, such as 5%"))?;
    if n.is_nan() || n <= 0.0 || n > 100.0 {
        return Err(ConfigError::setting(key, v, "expected a percent above 0 and at most 100%"));
    }
    Ok(n)
}

fn parse_bool(k: &str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" | "" => Ok(false),
        _ => Err(ConfigError::setting(k, v, "expected 0 or 1")),
    }
}

impl Settings {
    /// `ZMEM_THRESHOLD`'s default (a constant: the shim needs it before it
    /// may allocate).
    pub const DEFAULT_THRESHOLD: usize = defaults::THRESHOLD;
    /// Where the swap file goes unless `ZMEM_SWAPFILE_DIR` says otherwise:
    /// a disk directory (tmpfs would keep written-back pages in RAM).
    pub const DEFAULT_SWAPFILE_DIR: &'static str = defaults::SWAPFILE_DIR;
    /// The smallest limit `zmem run` takes (`zmem compare` checks it too,
    /// before it runs anything).
    pub const MIN_LIMIT: usize = 16 << 20;
}

/// Why `dir` cannot hold a swap file (not a directory, or in RAM).
///
/// # Errors
/// [`ConfigError::SwapDir`], naming the directory and what to do.
pub fn check_swapfile_dir(dir: &std::path::Path) -> Result<(), ConfigError> {
    let bad = |why: String| Err(ConfigError::SwapDir { dir: dir.to_path_buf(), why });
    if !dir.is_dir() {
        return bad("not a directory".into());
    }
    match rustix::fs::statfs(dir) {
        // TMPFS_MAGIC, RAMFS_MAGIC: pages written back there stay in memory.
        Ok(st) if st.f_type as u64 == 0x0102_1994 || st.f_type as u64 == 0x8584_58f6 => {
            bad("in RAM (tmpfs or ramfs): written-back pages would stay in memory; pick a directory on disk \
             with ZMEM_SWAPFILE_DIR or --swapfile, or turn writeback off with ZMEM_WRITEBACK=0 (--no-writeback)"
                .into())
        }
        Ok(_) => Ok(()),
        Err(e) => bad(format!("statfs: {e}")),
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            limit: defaults::LIMIT,
            compressor: defaults::COMPRESSOR.parse().expect("the default is a codec"),
            strong_compressor: Some(defaults::STRONG_COMPRESSOR.parse().expect("the default is a codec")),
            recompress: None,
            max_pool_percent: defaults::RUN_MAX_POOL_PERCENT,
            pool_balance: true,
            swapfile_dir: Some(PathBuf::from(Settings::DEFAULT_SWAPFILE_DIR)),
            encrypt: true,
            threshold: Settings::DEFAULT_THRESHOLD,
            adopt: true,
            stacks: false,
            handler_follow: true,
            handler_hold: true,
            fork_event: false,
            show_limit: false,
            scan_interval: Duration::from_millis(100),
            folio: defaults::FOLIO_SIZE,
            fault_around: defaults::FAULT_AROUND_BYTES,
            read_ahead: defaults::READ_AHEAD_BYTES,
            stats_dir: None,
            stats_interval: Duration::from_millis(1000),
            tree: None,
            start_percent: defaults::START_PERCENT,
            max_slowdown: None,
            limit_given: false,
            report: None,
            disable: false,
        }
    }
}

impl Settings {
    /// Settings from `ZMEM_*` pairs; other keys are ignored.
    ///
    /// # Errors
    /// The first bad value, as [`ConfigError::Setting`] (`ZMEM_X=value:
    /// why`) or [`ConfigError::Name`].
    pub fn from_vars<K: AsRef<str>, V: AsRef<str>>(
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Settings, ConfigError> {
        let mut s = Settings::default();
        let (mut writeback, mut swapfile_dir) = (true, None);
        for (k, v) in vars {
            let (k, v) = (k.as_ref(), v.as_ref());
            let size = |v: &str| parse_size(v).map_err(|e| ConfigError::setting(k, v, e));
            let bad = |why: &str| ConfigError::setting(k, v, why);
            match k {
                "ZMEM_LIMIT" => {
                    s.limit = size(v)?;
                    s.limit_given = true;
                }
                "ZMEM_MAX_SLOWDOWN" if v.trim().is_empty() => s.max_slowdown = None,
                "ZMEM_MAX_SLOWDOWN" => s.max_slowdown = Some(parse_slowdown(k, v)?),
                "ZMEM_REPORT" => s.report = (!v.is_empty()).then(|| PathBuf::from(v)),
                "ZMEM_COMPRESSOR" => {
                    // A codec named is the codec used.
                    s.compressor = v.parse().map_err(|e| ConfigError::setting(k, v, e))?;
                    s.strong_compressor = None;
                }
                "ZMEM_RECOMPRESS" if v.trim().is_empty() => s.recompress = None,
                "ZMEM_RECOMPRESS" => s.recompress = Some(v.parse().map_err(|e| ConfigError::setting(k, v, e))?),
                "ZMEM_MAX_POOL_PERCENT" => {
                    s.pool_balance = false;
                    s.max_pool_percent = v
                        .parse()
                        .ok()
                        .filter(|p| (1..=100).contains(p))
                        .ok_or_else(|| bad("expected a percent in 1..=100"))?;
                }
                "ZMEM_SWAPFILE_DIR" => swapfile_dir = Some(PathBuf::from(v)),
                "ZMEM_WRITEBACK" => writeback = parse_bool(k, v)?,
                "ZMEM_NO_ENCRYPT" => s.encrypt = !parse_bool(k, v)?,
                "ZMEM_THRESHOLD" => s.threshold = size(v)?,
                "ZMEM_ADOPT" => s.adopt = parse_bool(k, v)?,
                "ZMEM_STACKS" => s.stacks = parse_bool(k, v)?,
                "ZMEM_HANDLER_FOLLOW" => s.handler_follow = parse_bool(k, v)?,
                "ZMEM_HANDLER_HOLD" => s.handler_hold = parse_bool(k, v)?,
                "ZMEM_FORK_EVENT" => s.fork_event = parse_bool(k, v)?,
                "ZMEM_SHOW_LIMIT" => s.show_limit = parse_bool(k, v)?,
                "ZMEM_SCAN_MS" => {
                    let ms: u64 = v.parse().map_err(|_| bad("expected milliseconds"))?;
                    s.scan_interval = Duration::from_millis(ms.clamp(1, 60_000));
                }
                "ZMEM_FOLIO" => {
                    let f = size(v)?;
                    if !f.is_power_of_two() || !(4096..=2 << 20).contains(&f) {
                        return Err(bad("a power of two in 4K..=2M"));
                    }
                    s.folio = f;
                }
                "ZMEM_FAULT_AROUND" => {
                    let f = if v.trim() == "0" { 0 } else { size(v)? };
                    if f != 0 && (!f.is_power_of_two() || f < 4096) {
                        return Err(bad("0, or a power of two of at least 4K"));
                    }
                    s.fault_around = f;
                }
                "ZMEM_READ_AHEAD" => {
                    let r = if v.trim() == "0" { 0 } else { size(v)? };
                    if r > 64 << 20 {
                        return Err(bad("at most 64M"));
                    }
                    s.read_ahead = r;
                }
                "ZMEM_STATS_DIR" => s.stats_dir = (!v.is_empty()).then(|| PathBuf::from(v)),
                "ZMEM_STATS_INTERVAL_MS" => {
                    let ms: u64 = v.parse().map_err(|_| bad("expected milliseconds"))?;
                    s.stats_interval = Duration::from_millis(ms.max(10));
                }
                "ZMEM_START_PERCENT" => {
                    s.start_percent = v
                        .parse()
                        .ok()
                        .filter(|p| (0..=100).contains(p))
                        .ok_or_else(|| bad("expected a percent in 0..=100"))?;
                }
                "ZMEM_DISABLE" => s.disable = parse_bool(k, v)?,
                "ZMEM_TREE" => s.tree = (!v.is_empty()).then(|| PathBuf::from(v)),
                // Read by the logger itself (`zmem_common::init_stderr_logger`).
                "ZMEM_LOG" => {}
                k if k.starts_with("ZMEM_") && k != "ZMEM_PRELOAD" => {
                    return Err(ConfigError::Name {
                        name: k.to_string(),
                        why: "unknown setting (see `zmem run --help`)",
                    });
                }
                _ => {}
            }
        }
        s.swapfile_dir = if writeback {
            let d = swapfile_dir.unwrap_or_else(|| PathBuf::from(Settings::DEFAULT_SWAPFILE_DIR));
            check_swapfile_dir(&d).map_err(|e| match e {
                ConfigError::SwapDir { why, .. } => ConfigError::setting("ZMEM_SWAPFILE_DIR", d.display(), why),
                e => e,
            })?;
            Some(d)
        } else {
            None
        };
        if s.limit < Settings::MIN_LIMIT {
            return Err(ConfigError::setting("ZMEM_LIMIT", s.limit, "at least 16M"));
        }
        if s.threshold < s.folio {
            s.threshold = s.folio;
        }
        Ok(s)
    }

    /// The settings from this process's environment.
    ///
    /// # Errors
    /// As [`Settings::from_vars`].
    /// Only `ZMEM_*` variables are read, as bytes: any other variable may
    /// hold anything (a non-UTF-8 value is no error, and never a panic).
    pub fn from_env() -> Result<Settings, ConfigError> {
        Settings::from_vars(zmem_vars(std::env::vars_os())?)
    }

    /// The pager these settings describe.
    /// `PagerConfig::share_floor` of [`Settings::pager_config`], without
    /// building it.
    pub fn share_floor(&self) -> usize {
        PagerConfig::share_floor_for(self.folio, defaults::RECLAIM_BATCH)
    }

    pub fn pager_config(&self) -> PagerConfig {
        let mut cfg = PagerConfig::with_limit(self.limit);
        cfg.folio_size = self.folio;
        cfg.fault_around = self.fault_around;
        cfg.read_ahead = self.read_ahead;
        // A smaller pool is worth something only where what it cannot hold
        // goes to the swap file.
        let balance = self.pool_balance && self.swapfile_dir.is_some();
        let mut tier = TierConfig {
            compressor: self.compressor,
            memory_budget: self.limit,
            // The balanced share's start, or the share named.
            max_pool_percent: if balance { defaults::POOL_BALANCE_START_PERCENT } else { self.max_pool_percent },
            ..TierConfig::without_writeback()
        };
        if let Some(d) = &self.swapfile_dir {
            tier = TierConfig { writeback: true, ..tier }.with_swap_dir(d.clone(), self.encrypt);
        }
        cfg.tier = tier;
        cfg.recompress = self.recompress;
        cfg.pool_balance = balance.then_some(defaults::POOL_BALANCE_PERCENT);
        // Without a swap file nothing is loaded from the disk.
        cfg.strong_codec = self.strong_compressor.filter(|_| self.swapfile_dir.is_some());
        cfg.adopt = self.adopt.then_some(AdoptConfig {
            threshold: self.threshold,
            stacks: self.stacks,
            interval: self.scan_interval,
        });
        cfg.tree = self.tree.clone();
        cfg.fork_event = self.fork_event;
        cfg.handler_follow = self.handler_follow;
        cfg.handler_hold = self.handler_hold;
        cfg
    }
}

/// The `ZMEM_*` pairs of an environment given as bytes; other variables
/// are skipped whatever they hold.
///
/// # Errors
/// A `ZMEM_*` variable whose value is not UTF-8.
pub fn zmem_vars(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<(String, String)>, ConfigError> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = Vec::new();
    for (k, v) in vars {
        if !k.as_bytes().starts_with(b"ZMEM_") {
            continue;
        }
        let k = k.into_string().map_err(|k| ConfigError::Name {
            name: k.to_string_lossy().into_owned(),
            why: "a ZMEM_ name that is not UTF-8",
        })?;
        let v = v.into_string().map_err(|v| ConfigError::setting(&k, v.to_string_lossy(), "not UTF-8"))?;
        out.push((k, v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_values_parse_and_bad_ones_say_which() {
        let s = Settings::from_vars([
            ("ZMEM_LIMIT", "256M"),
            ("ZMEM_COMPRESSOR", "zstd:3"),
            ("ZMEM_RECOMPRESS", "zstd:9"),
            ("PATH", "/bin"),
            ("ZMEM_LOG", "debug"),
        ])
        .unwrap();
        assert_eq!(s.limit, 256 << 20);
        assert_eq!(s.compressor.to_string(), "zstd:3");
        assert_eq!(s.pager_config().recompress.map(|c| c.to_string()).as_deref(), Some("zstd:9"));
        assert_eq!(Settings::from_vars::<&str, &str>([]).unwrap().pager_config().recompress, None);
        // A codec named is the only codec; unnamed, the strong one comes in
        // while the swap file is busy, and only with a swap file.
        assert_eq!(s.pager_config().strong_codec, None);
        let d = Settings::from_vars::<&str, &str>([]).unwrap().pager_config();
        assert_eq!(d.strong_codec.map(|c| c.to_string()).as_deref(), Some("zstd:1"));
        let off = Settings::from_vars([("ZMEM_WRITEBACK", "0")]).unwrap().pager_config();
        for folio in ["4K", "64K", "2M"] {
            let s = Settings::from_vars([("ZMEM_FOLIO", folio)]).unwrap();
            assert_eq!(s.share_floor(), s.pager_config().share_floor(), "{folio}");
        }
        assert_eq!(off.strong_codec, None);
        for (k, v, why) in [
            ("ZMEM_LIMIT", "lots", "ZMEM_LIMIT=lots"),
            ("ZMEM_LIMIT", "1M", "at least 16M"),
            ("ZMEM_COMPRESSOR", "snappy", "ZMEM_COMPRESSOR=snappy"),
            ("ZMEM_RECOMPRESS", "zstd:99", "ZMEM_RECOMPRESS=zstd:99"),
            ("ZMEM_MAX_POOL_PERCENT", "0", "1..=100"),
            ("ZMEM_START_PERCENT", "150", "0..=100"),
            ("ZMEM_START_PERCENT", "abc", "0..=100"),
            ("ZMEM_FOLIO", "48K", "power of two"),
            ("ZMEM_FAULT_AROUND", "12K", "power of two"),
            ("ZMEM_READ_AHEAD", "1G", "at most 64M"),
            ("ZMEM_READ_AHEAD", "lots", "ZMEM_READ_AHEAD=lots"),
            ("ZMEM_SWAPFILE_DIR", "/nonexistent/dir", "not a directory"),
            ("ZMEM_SWAPFILE_DIR", "/dev/shm", "in RAM"),
            ("ZMEM_WRITEBACK", "maybe", "expected 0 or 1"),
            ("ZMEM_LIMTI", "1G", "unknown setting"),
        ] {
            let e = Settings::from_vars([(k, v)]).unwrap_err();
            assert!(e.to_string().contains(why), "{k}={v}: {e}");
            match e {
                ConfigError::Setting { name, value, .. } => assert_eq!(name, k, "{value}"),
                ConfigError::Name { name, .. } => assert_eq!(name, "ZMEM_LIMTI"),
                e => panic!("{k}={v}: {e:?} names no setting"),
            }
        }
    }

    #[test]
    fn writeback_is_on_by_default_and_can_be_turned_off() {
        let s = Settings::from_vars::<&str, &str>([]).unwrap();
        assert_eq!(s.swapfile_dir.as_deref(), Some(std::path::Path::new("/var/tmp")));
        assert!(s.pager_config().tier.writeback);
        let s = Settings::from_vars([("ZMEM_WRITEBACK", "0")]).unwrap();
        assert_eq!(s.swapfile_dir, None);
        assert!(!s.pager_config().tier.writeback);
    }

    #[test]
    fn the_pools_share_moves_unless_a_share_is_named_or_there_is_no_swap_file() {
        let on = Some(defaults::POOL_BALANCE_PERCENT);
        let cfg = Settings::from_vars::<&str, &str>([]).unwrap().pager_config();
        assert_eq!((cfg.pool_balance, cfg.tier.max_pool_percent), (on, defaults::POOL_BALANCE_START_PERCENT));
        let s = Settings::from_vars([("ZMEM_MAX_POOL_PERCENT", "30")]).unwrap();
        assert_eq!((s.pager_config().pool_balance, s.pager_config().tier.max_pool_percent), (None, 30));
        let s = Settings::from_vars([("ZMEM_WRITEBACK", "0")]).unwrap();
        assert_eq!((s.pager_config().pool_balance, s.pager_config().tier.max_pool_percent), (None, 50));
    }

    /// Issue 11, finding 2: `std::env::vars()` panicked on a non-UTF-8
    /// variable, inside the program's first mmap.
    #[test]
    fn a_slowdown_is_a_percent_above_zero_and_at_most_a_hundred() {
        let with = |v: &str| Settings::from_vars([("ZMEM_MAX_SLOWDOWN", v), ("ZMEM_WRITEBACK", "0")]);
        assert_eq!(with("5%").unwrap().max_slowdown, Some(5.0));
        assert_eq!(with(" 0.5 % ").unwrap().max_slowdown, Some(0.5));
        assert_eq!(with("100").unwrap().max_slowdown, Some(100.0));
        assert_eq!(with("").unwrap().max_slowdown, None);
        for bad in ["0", "0%", "150%", "abc", "-5%", "nan", "5%%"] {
            let e = with(bad).unwrap_err().to_string();
            assert!(e.contains("ZMEM_MAX_SLOWDOWN") && e.contains(bad.trim()), "{bad}: {e}");
        }
        let s = Settings::from_vars([("ZMEM_LIMIT", "64M"), ("ZMEM_WRITEBACK", "0")]).unwrap();
        assert!(s.limit_given && !Settings::from_vars([("ZMEM_WRITEBACK", "0")]).unwrap().limit_given);
    }

    #[test]
    fn a_non_utf8_variable_is_skipped_and_a_non_utf8_setting_is_an_error() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let bad = || OsString::from_vec(vec![b'a', 0xff, 0xfe]);
        let env =
            vec![(OsString::from("LANG_X"), bad()), (bad(), OsString::from("1")), ("ZMEM_LIMIT".into(), "64M".into())];
        let v = zmem_vars(env).unwrap();
        assert_eq!(v, [("ZMEM_LIMIT".to_string(), "64M".to_string())]);
        let e = zmem_vars(vec![(OsString::from("ZMEM_LIMIT"), bad())]).unwrap_err().to_string();
        assert!(e.contains("ZMEM_LIMIT") && e.contains("not UTF-8"), "{e}");
    }
}
