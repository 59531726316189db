//! The tier's settings.

use std::path::PathBuf;

use zmem_common::defaults;
use zmem_compress::{CodecSpec, EnginesConfig};
use zmem_swapfile::SwapFileConfig;
use zmem_zsmalloc::{MempoolConfig, ZsPoolConfig};

/// Settings of a tier.
#[derive(Debug, Clone)]
pub struct TierConfig {
    pub compressor: CodecSpec,
    /// Pages per compress call of the sequential adapter (1..=32).
    pub batch_size: usize,
    /// Compress through the multi-engine device instead.
    pub engines: Option<EnginesConfig>,
    /// The pool limit in bytes; when `None`, `max_pool_percent` of
    /// `memory_budget`.
    pub max_pool_bytes: Option<usize>,
    pub max_pool_percent: u32,
    pub memory_budget: usize,
    /// After the limit is hit, stores resume below this percent of it.
    pub accept_threshold_percent: u32,
    /// Write cold entries back to the swap file (memory.zswap.writeback).
    pub writeback: bool,
    /// The swap file; needed for writeback.
    pub swap: Option<SwapFileConfig>,
    /// Free an entry when it is loaded (the default, as zswap does).
    pub exclusive_loads: bool,
    pub zs: ZsPoolConfig,
    pub mempool: MempoolConfig,
}

/// Total RAM from /proc/meminfo, or 1 GiB if it cannot be read (through
/// a kept descriptor: a pager may start while the program runs).
pub fn total_ram() -> usize {
    zmem_common::host::fds::read_to_string(zmem_common::host::fds::Wait::Yes, std::path::Path::new("/proc/meminfo"))
        .ok()
        .and_then(|s| zmem_common::procfs::kb_field(&s, "MemTotal:"))
        .map_or(1 << 30, |bytes| bytes as usize)
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            compressor: defaults::COMPRESSOR.parse().expect("the default is a codec"),
            batch_size: zmem_compress::batch::DEFAULT_BATCH_SIZE,
            engines: None,
            max_pool_bytes: None,
            max_pool_percent: defaults::MAX_POOL_PERCENT,
            memory_budget: total_ram(),
            accept_threshold_percent: defaults::ACCEPT_THRESHOLD_PERCENT,
            writeback: true,
            swap: Some(SwapFileConfig::default()),
            exclusive_loads: true,
            zs: ZsPoolConfig::default(),
            mempool: MempoolConfig::default(),
        }
    }
}

impl TierConfig {
    /// A tier with no swap file: writeback off, incompressible pages rejected.
    pub fn without_writeback() -> Self {
        TierConfig { writeback: false, swap: None, ..Default::default() }
    }

    pub fn with_swap_dir(mut self, dir: PathBuf, encrypt: bool) -> Self {
        self.swap = Some(SwapFileConfig { dir, encrypt, ..SwapFileConfig::default() });
        self
    }
}
