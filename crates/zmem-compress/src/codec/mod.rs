//! Single-page codecs behind one trait.
//!
//! Each codec lives in its own file and keeps its library context (hash
//! tables, zstd `CCtx`/`DCtx`, libdeflate state) inside the [`Compressor`]
//! value, so a context is allocated once and reused for every page that the
//! owning thread or engine compresses: the per-CPU `acomp_ctx` of zswap.
//!
//! Names follow the kernel's crypto names (`lz4`, `zstd`, `deflate`, `lzo`,
//! `lzo-rle`); a level may follow a colon, as in `zstd:3` or `zstd:-1`.

mod deflate;
mod lz4;
pub mod lzo;
mod zstd;

use std::fmt;
use std::str::FromStr;

use crate::{CompressError, DecompressError, Error};

/// One-page compression with a reusable context.
///
/// # Contract
/// - `compress` MUST be given a `dst` at least as long as `src`. It returns
///   the compressed length, which is always `< src.len()`; output that would
///   not be smaller is [`CompressError::Poor`] (zswap's -ENOSPC).
/// - `decompress` returns the decompressed length. It never panics and never
///   writes past `dst`, whatever `src` holds; corrupt or truncated input is a
///   [`DecompressError`].
/// - Output is a pure function of the input and the codec settings, so the
///   same page compressed by any instance (any engine, the software fallback)
///   gives the same bytes.
pub trait Compressor: Send {
    /// The codec's canonical name, with its level: `lz4`, `zstd:1`.
    fn name(&self) -> &str;

    /// Compresses `src` into `dst`.
    ///
    /// # Errors
    /// [`CompressError::Poor`] when the output would be `>= src.len()`,
    /// [`CompressError::DstTooSmall`] when `dst` is shorter than `src`.
    /// `dst` holds unspecified bytes after an error.
    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError>;

    /// Decompresses `src` into `dst`.
    ///
    /// # Errors
    /// [`DecompressError::Corrupt`] for corrupt or truncated input,
    /// [`DecompressError::Overrun`] when the output does not fit. `dst` holds
    /// unspecified bytes after an error, but nothing past it is written.
    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError>;

    /// Decompresses `src` into exactly `dst.len()` bytes: how the tier loads a
    /// page, since a stream cut on an instruction boundary can decode cleanly
    /// to fewer bytes.
    ///
    /// # Errors
    /// As [`decompress`](Self::decompress), plus
    /// [`DecompressError::LengthMismatch`] for a short result.
    fn decompress_exact(&mut self, src: &[u8], dst: &mut [u8]) -> Result<(), DecompressError> {
        let want = dst.len();
        match self.decompress(src, dst)? {
            n if n == want => Ok(()),
            got => Err(DecompressError::LengthMismatch { codec: static_name(self.name()), got, want }),
        }
    }
}

/// The `&'static` kernel name of a codec instance's name (`zstd:3` → `zstd`).
pub(crate) fn static_name(name: &str) -> &'static str {
    let base = name.split(':').next().unwrap_or(name);
    CodecKind::ALL.into_iter().find(|k| k.name() == base).map_or("codec", CodecKind::name)
}

/// The codecs zmem knows, named as the kernel names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CodecKind {
    Lz4,
    Zstd,
    Deflate,
    Lzo,
    LzoRle,
}

impl CodecKind {
    /// Every codec, in the order `--help` and errors list them.
    pub const ALL: [CodecKind; 5] =
        [CodecKind::Lz4, CodecKind::Zstd, CodecKind::Deflate, CodecKind::Lzo, CodecKind::LzoRle];

    pub fn name(self) -> &'static str {
        match self {
            CodecKind::Lz4 => "lz4",
            CodecKind::Zstd => "zstd",
            CodecKind::Deflate => "deflate",
            CodecKind::Lzo => "lzo",
            CodecKind::LzoRle => "lzo-rle",
        }
    }

    /// The valid levels, or `None` for a codec that takes none.
    pub fn level_range(self) -> Option<(i32, i32)> {
        match self {
            CodecKind::Zstd => Some(zstd::level_range()),
            CodecKind::Deflate => Some(deflate::LEVELS),
            CodecKind::Lz4 | CodecKind::Lzo | CodecKind::LzoRle => None,
        }
    }

    /// The level used when the name carries none.
    pub fn default_level(self) -> Option<i32> {
        match self {
            CodecKind::Zstd => Some(zstd::DEFAULT_LEVEL),
            CodecKind::Deflate => Some(deflate::DEFAULT_LEVEL),
            CodecKind::Lz4 | CodecKind::Lzo | CodecKind::LzoRle => None,
        }
    }

    fn valid_list() -> String {
        CodecKind::ALL
            .iter()
            .map(|k| match k.level_range() {
                Some((lo, hi)) => format!("{}[:LEVEL {lo}..={hi}]", k.name()),
                None => k.name().to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A codec and its level, parsed from `name[:level]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CodecSpec {
    pub kind: CodecKind,
    /// Always `Some` for codecs with levels (the default filled in), `None` otherwise.
    pub level: Option<i32>,
}

impl CodecSpec {
    /// Builds a fresh compressor (with its own context) for this spec.
    pub fn build(&self) -> Box<dyn Compressor> {
        match self.kind {
            CodecKind::Lz4 => Box::new(lz4::Lz4::new()),
            CodecKind::Zstd => Box::new(zstd::Zstd::new(self.level.unwrap_or(zstd::DEFAULT_LEVEL))),
            CodecKind::Deflate => Box::new(deflate::Deflate::new(self.level.unwrap_or(deflate::DEFAULT_LEVEL))),
            CodecKind::Lzo => Box::new(lzo::Lzo::new(lzo::Version::V0)),
            CodecKind::LzoRle => Box::new(lzo::Lzo::new(lzo::Version::Rle)),
        }
    }
}

impl fmt::Display for CodecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.level {
            Some(l) => write!(f, "{}:{l}", self.kind.name()),
            None => f.write_str(self.kind.name()),
        }
    }
}

impl FromStr for CodecSpec {
    type Err = Error;

    /// Parses `lz4`, `zstd`, `zstd:3`, `zstd:-1`, `deflate:6`, `lzo`, `lzo-rle`.
    ///
    /// # Errors
    /// [`Error::UnknownCodec`], [`Error::BadLevel`], [`Error::LevelOutOfRange`]
    /// or [`Error::NoLevel`], each naming the valid choices.
    fn from_str(s: &str) -> Result<Self, Error> {
        let (name, level) = match s.split_once(':') {
            Some((n, l)) => (n.trim(), Some(l.trim())),
            None => (s.trim(), None),
        };
        let kind = CodecKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(name) || (*k == CodecKind::Lzo && name == "lzo1x"))
            .ok_or_else(|| Error::UnknownCodec { name: name.to_string(), valid: CodecKind::valid_list() })?;
        let level = match (kind.level_range(), level) {
            (None, None) => None,
            (None, Some(l)) => return Err(Error::NoLevel { codec: kind.name(), level: l.to_string() }),
            (Some(_), None) => kind.default_level(),
            (Some((min, max)), Some(l)) => {
                let level: i32 =
                    l.parse().map_err(|_| Error::BadLevel { codec: kind.name(), level: l.to_string(), min, max })?;
                if !(min..=max).contains(&level) {
                    return Err(Error::LevelOutOfRange { codec: kind.name(), level, min, max });
                }
                Some(level)
            }
        };
        Ok(CodecSpec { kind, level })
    }
}

/// Parses a comma-separated codec list such as `lz4,zstd:1,lzo`.
///
/// # Errors
/// The first entry that does not parse, as in [`CodecSpec::from_str`].
pub fn parse_list(s: &str) -> Result<Vec<CodecSpec>, Error> {
    s.split(',').filter(|p| !p.trim().is_empty()).map(str::parse).collect()
}

/// Checks the compress contract and returns the slice a codec may fill:
/// one byte shorter than `src`, so that an output that fits is always smaller.
pub(crate) fn bounded_dst<'a>(src: &[u8], dst: &'a mut [u8]) -> Result<&'a mut [u8], CompressError> {
    if dst.len() < src.len() {
        return Err(CompressError::DstTooSmall { need: src.len(), got: dst.len() });
    }
    if src.is_empty() {
        return Err(CompressError::Poor);
    }
    Ok(&mut dst[..src.len() - 1])
}
