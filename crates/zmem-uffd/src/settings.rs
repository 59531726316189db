//! `ZMEM_*` settings: parsed here for the shim, and by `zmem run` before it
//! starts the program, so that a bad value is an error up front.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `ZMEM_LIMIT` | `1G` | resident memory plus pool plus metadata of managed regions |
//! | `ZMEM_COMPRESSOR` | `lz4` | `lz4`, `zstd[:LEVEL]`, `deflate[:LEVEL]`, `lzo`, `lzo-rle` |
//! | `ZMEM_MAX_POOL_PERCENT` | `20` | the pool's share of the limit (1..=100) |
//! | `ZMEM_SWAPFILE_DIR` | (none) | write back to a swap file in this directory |
//! | `ZMEM_NO_ENCRYPT` | `0` | `1`: do not encrypt the swap file |
//! | `ZMEM_THRESHOLD` | `1M` | mappings and allocations this large or larger are managed |
//! | `ZMEM_FOLIO` | `64K` | eviction unit, 4K..=2M, a power of two |
//! | `ZMEM_STATS_DIR` | `/tmp/zmem-stats` | where `zmem-PID.json` is updated |
//! | `ZMEM_STATS_INTERVAL_MS` | `1000` | how often |
//! | `ZMEM_DISABLE` | `0` | `1`: the shim passes everything through |

use std::path::PathBuf;
use std::time::Duration;

use crate::PagerConfig;
use zmem_tier::{CodecSpec, TierConfig};

/// The shim's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub limit: usize,
    pub compressor: CodecSpec,
    pub max_pool_percent: u32,
    pub swapfile_dir: Option<PathBuf>,
    pub encrypt: bool,
    pub threshold: usize,
    pub folio: usize,
    pub stats_dir: PathBuf,
    pub stats_interval: Duration,
    pub disable: bool,
}

/// `1G`, `512M`, `64K` or bytes.
///
/// # Errors
/// A message naming the bad text.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a size (try 512M or 1G)"))?;
    let v = n.checked_mul(mul).ok_or_else(|| format!("`{s}` is too large"))?;
    if v == 0 {
        return Err("a size must be above zero".into());
    }
    Ok(v)
}

fn parse_bool(k: &str, v: &str) -> Result<bool, String> {
    match v {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" | "" => Ok(false),
        _ => Err(format!("{k}={v}: expected 0 or 1")),
    }
}

impl Settings {
    /// `ZMEM_THRESHOLD`'s default (a constant: the shim needs it before it
    /// may allocate).
    pub const DEFAULT_THRESHOLD: usize = 1 << 20;
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            limit: 1 << 30,
            compressor: "lz4".parse().expect("lz4 is a codec"),
            max_pool_percent: 20,
            swapfile_dir: None,
            encrypt: true,
            threshold: Settings::DEFAULT_THRESHOLD,
            folio: 64 << 10,
            stats_dir: PathBuf::from("/tmp/zmem-stats"),
            stats_interval: Duration::from_millis(1000),
            disable: false,
        }
    }
}

impl Settings {
    /// Settings from `ZMEM_*` pairs; other keys are ignored.
    ///
    /// # Errors
    /// The first bad value, as `ZMEM_X=value: why`.
    pub fn from_vars<K: AsRef<str>, V: AsRef<str>>(vars: impl IntoIterator<Item = (K, V)>) -> Result<Settings, String> {
        let mut s = Settings::default();
        for (k, v) in vars {
            let (k, v) = (k.as_ref(), v.as_ref());
            let size = |v: &str| parse_size(v).map_err(|e| format!("{k}={v}: {e}"));
            match k {
                "ZMEM_LIMIT" => s.limit = size(v)?,
                "ZMEM_COMPRESSOR" => s.compressor = v.parse().map_err(|e| format!("{k}={v}: {e}"))?,
                "ZMEM_MAX_POOL_PERCENT" => {
                    s.max_pool_percent = v
                        .parse()
                        .ok()
                        .filter(|p| (1..=100).contains(p))
                        .ok_or_else(|| format!("{k}={v}: expected a percent in 1..=100"))?;
                }
                "ZMEM_SWAPFILE_DIR" => {
                    let d = PathBuf::from(v);
                    if !d.is_dir() {
                        return Err(format!("{k}={v}: not a directory"));
                    }
                    s.swapfile_dir = Some(d);
                }
                "ZMEM_NO_ENCRYPT" => s.encrypt = !parse_bool(k, v)?,
                "ZMEM_THRESHOLD" => s.threshold = size(v)?,
                "ZMEM_FOLIO" => {
                    let f = size(v)?;
                    if !f.is_power_of_two() || !(4096..=2 << 20).contains(&f) {
                        return Err(format!("{k}={v}: a power of two in 4K..=2M"));
                    }
                    s.folio = f;
                }
                "ZMEM_STATS_DIR" => s.stats_dir = PathBuf::from(v),
                "ZMEM_STATS_INTERVAL_MS" => {
                    let ms: u64 = v.parse().map_err(|_| format!("{k}={v}: expected milliseconds"))?;
                    s.stats_interval = Duration::from_millis(ms.max(10));
                }
                "ZMEM_DISABLE" => s.disable = parse_bool(k, v)?,
                k if k.starts_with("ZMEM_") && k != "ZMEM_PRELOAD" => {
                    return Err(format!("{k}: unknown setting (see `zmem run --help`)"));
                }
                _ => {}
            }
        }
        if s.limit < 16 << 20 {
            return Err(format!("ZMEM_LIMIT={}: at least 16M", s.limit));
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
    pub fn from_env() -> Result<Settings, String> {
        Settings::from_vars(std::env::vars())
    }

    /// The pager these settings describe.
    pub fn pager_config(&self) -> PagerConfig {
        let mut cfg = PagerConfig::with_limit(self.limit);
        cfg.folio_size = self.folio;
        let mut tier = TierConfig {
            compressor: self.compressor,
            memory_budget: self.limit,
            max_pool_percent: self.max_pool_percent,
            ..TierConfig::without_writeback()
        };
        if let Some(d) = &self.swapfile_dir {
            tier = TierConfig { writeback: true, ..tier }.with_swap_dir(d.clone(), self.encrypt);
        }
        cfg.tier = tier;
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_values_parse_and_bad_ones_say_which() {
        let s = Settings::from_vars([("ZMEM_LIMIT", "256M"), ("ZMEM_COMPRESSOR", "zstd:3"), ("PATH", "/bin")]).unwrap();
        assert_eq!(s.limit, 256 << 20);
        assert_eq!(s.compressor.to_string(), "zstd:3");
        for (k, v, why) in [
            ("ZMEM_LIMIT", "lots", "ZMEM_LIMIT=lots"),
            ("ZMEM_LIMIT", "1M", "at least 16M"),
            ("ZMEM_COMPRESSOR", "snappy", "ZMEM_COMPRESSOR=snappy"),
            ("ZMEM_MAX_POOL_PERCENT", "0", "1..=100"),
            ("ZMEM_FOLIO", "48K", "power of two"),
            ("ZMEM_SWAPFILE_DIR", "/nonexistent/dir", "not a directory"),
            ("ZMEM_LIMTI", "1G", "unknown setting"),
        ] {
            let e = Settings::from_vars([(k, v)]).unwrap_err();
            assert!(e.contains(why), "{k}={v}: {e}");
        }
    }
}
