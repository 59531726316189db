//! `Pool`: a compressor plus a zs pool (`struct zswap_pool`). Refcounted by
//! the tree shards that hold its entries (see `tree.rs`); a pool that is no
//! longer current lives until its last entry goes.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use zmem_compress::BatchCompressor;
use zmem_zsmalloc::{Mempool, ZsPool, ZsPoolConfig};

/// A compressor and the zs pool holding what it compressed.
pub struct Pool {
    pub(crate) id: u32,
    pub(crate) name: String,
    /// Stores compress and loads decompress through this (the batch API;
    /// sequential or engines): one compressor, so what it wrote is what
    /// reads it back, whatever its name says.
    pub(crate) compressor: Arc<dyn BatchCompressor>,
    pub(crate) zs: ZsPool,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("id", &self.id).field("compressor", &self.name).finish_non_exhaustive()
    }
}

impl Pool {
    pub(crate) fn new(
        id: u32,
        compressor: Arc<dyn BatchCompressor>,
        zs_cfg: ZsPoolConfig,
        mempool: Arc<Mempool>,
        group_pages: Arc<AtomicUsize>,
    ) -> Result<Pool, zmem_zsmalloc::ZsError> {
        Ok(Pool { id, name: compressor.name(), compressor, zs: ZsPool::new_in_group(zs_cfg, mempool, group_pages)? })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// The compressor's name, as in `lz4` or `zstd:1`.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn zs(&self) -> &ZsPool {
        &self.zs
    }
}
