//! zstd through the bulk API: one reused `CCtx` and `DCtx` per instance, no
//! checksum, no content-size or dictionary-id field, so that a 4 KiB page costs
//! only a 2-byte frame header beyond its blocks.

use std::io;

use zstd::bulk;
use zstd::zstd_safe::CParameter;

use super::{bounded_dst, Compressor};
use crate::{CompressError, DecompressError};

pub(super) const DEFAULT_LEVEL: i32 = 1;

pub(super) fn level_range() -> (i32, i32) {
    let r = zstd::compression_level_range();
    (*r.start(), *r.end())
}

pub struct Zstd {
    name: String,
    cctx: bulk::Compressor<'static>,
    dctx: bulk::Decompressor<'static>,
}

impl std::fmt::Debug for Zstd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zstd").field("name", &self.name).finish_non_exhaustive()
    }
}

impl Zstd {
    /// # Panics
    /// If zstd cannot allocate a context (out of memory) or rejects a
    /// parameter; the level was range-checked by [`super::CodecSpec`].
    pub fn new(level: i32) -> Self {
        let mut cctx = bulk::Compressor::new(level).expect("zstd: allocate CCtx");
        for p in [CParameter::ChecksumFlag(false), CParameter::ContentSizeFlag(false), CParameter::DictIdFlag(false)] {
            cctx.set_parameter(p).expect("zstd: set frame parameter");
        }
        let dctx = bulk::Decompressor::new().expect("zstd: allocate DCtx");
        Zstd { name: format!("zstd:{level}"), cctx, dctx }
    }
}

impl Compressor for Zstd {
    fn name(&self) -> &str {
        &self.name
    }

    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        let out = bounded_dst(src, dst)?;
        match self.cctx.compress_to_buffer(src, out) {
            Ok(n) => Ok(n),
            // ZSTD_error_dstSize_tooSmall is the only error a valid context
            // returns for in-memory input.
            Err(e) if e.kind() == io::ErrorKind::Other && e.to_string().contains("too small") => {
                Err(CompressError::Poor)
            }
            Err(e) => Err(CompressError::Codec { codec: "zstd", msg: e.to_string() }),
        }
    }

    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
        let cap = dst.len();
        self.dctx.decompress_to_buffer(src, dst).map_err(|e| {
            if e.to_string().contains("too small") {
                DecompressError::Overrun { codec: "zstd", cap }
            } else {
                DecompressError::Corrupt { codec: "zstd" }
            }
        })
    }
}
