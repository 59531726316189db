//! Raw deflate (no zlib or gzip wrapper) through libdeflate.

use libdeflater::{CompressionError, CompressionLvl, DecompressionError};

use super::{bounded_dst, Compressor};
use crate::{CompressError, DecompressError};

pub(super) const LEVELS: (i32, i32) = (1, 12);
pub(super) const DEFAULT_LEVEL: i32 = 1;

pub struct Deflate {
    name: String,
    comp: libdeflater::Compressor,
    decomp: libdeflater::Decompressor,
}

impl std::fmt::Debug for Deflate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deflate").field("name", &self.name).finish_non_exhaustive()
    }
}

impl Deflate {
    /// # Panics
    /// If `level` is outside [`LEVELS`]; [`super::CodecSpec`] checks it first.
    pub fn new(level: i32) -> Self {
        let lvl = CompressionLvl::new(level).expect("deflate level checked by CodecSpec");
        Deflate {
            name: format!("deflate:{level}"),
            comp: libdeflater::Compressor::new(lvl),
            decomp: libdeflater::Decompressor::new(),
        }
    }
}

impl Compressor for Deflate {
    fn name(&self) -> &str {
        &self.name
    }

    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        let out = bounded_dst(src, dst)?;
        self.comp.deflate_compress(src, out).map_err(|e| match e {
            CompressionError::InsufficientSpace => CompressError::Poor,
        })
    }

    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
        let cap = dst.len();
        self.decomp.deflate_decompress(src, dst).map_err(|e| match e {
            DecompressionError::InsufficientSpace => DecompressError::Overrun { codec: "deflate", cap },
            DecompressionError::BadData => DecompressError::Corrupt { codec: "deflate" },
        })
    }
}
