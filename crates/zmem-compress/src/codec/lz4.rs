//! lz4 block format through `lz4_flex` (safe encoder and decoder).

use super::{bounded_dst, Compressor};
use crate::{CompressError, DecompressError};

/// lz4 through `lz4_flex`'s block API.
#[derive(Debug, Default)]
pub struct Lz4 {
    /// `lz4_flex` refuses an output buffer below its worst-case bound even
    /// when the data would fit, so it compresses here and the result is
    /// copied out when it is smaller than the page (a 4 KiB memcpy: ~50 ns).
    scratch: Vec<u8>,
}

impl Lz4 {
    pub fn new() -> Self {
        Lz4 { scratch: Vec::new() }
    }
}

impl Compressor for Lz4 {
    fn name(&self) -> &str {
        "lz4"
    }

    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        let out = bounded_dst(src, dst)?;
        self.scratch.resize(lz4_flex::block::get_maximum_output_size(src.len()), 0);
        let n = lz4_flex::block::compress_into(src, &mut self.scratch)
            .map_err(|e| CompressError::Codec { codec: "lz4", msg: e.to_string() })?;
        let out = out.get_mut(..n).ok_or(CompressError::Poor)?;
        out.copy_from_slice(&self.scratch[..n]);
        Ok(n)
    }

    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
        lz4_flex::block::decompress_into(src, dst).map_err(|e| match e {
            lz4_flex::block::DecompressError::OutputTooSmall { .. } => {
                DecompressError::Overrun { codec: "lz4", cap: dst.len() }
            }
            _ => DecompressError::Corrupt { codec: "lz4" },
        })
    }
}
