//! The tier's errors. Rejections of a store are outcomes, not errors (see
//! [`StoreOutcome`](crate::StoreOutcome)).

use thiserror::Error;
use zmem_common::PAGE_SIZE;
use zmem_compress::DecompressError;
use zmem_swapfile::SwapError;

use crate::MAX_FOLIO_PAGES;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TierError {
    #[error("invalid tier configuration: {0}")]
    Config(#[from] zmem_common::ConfigError),
    #[error("a folio must be 1..={MAX_FOLIO_PAGES} whole pages of {PAGE_SIZE} bytes, got {len} bytes")]
    BadFolio { len: usize },
    #[error("key {key}: stored page failed to decompress: {source}")]
    Decompress { key: u64, source: DecompressError },
    #[error("key {key}: {source}")]
    Swap { key: u64, source: SwapError },
    #[error(transparent)]
    Compress(#[from] zmem_compress::Error),
    #[error(transparent)]
    Pool(#[from] zmem_zsmalloc::ZsError),
    #[error(transparent)]
    Mempool(#[from] zmem_zsmalloc::MempoolError),
    #[error("creating the swap file: {0}")]
    SwapCreate(SwapError),
}
