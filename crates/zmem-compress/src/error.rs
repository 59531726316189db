//! Errors of the compression layer.
//!
//! A codec error is per item: one page of a batch may be `Poor` while its
//! neighbours compress fine, exactly as the per-SG-entry lengths of the
//! kernel's batching acomp API. Configuration errors ([`Error`]) are per call.

use thiserror::Error;

/// Why one page did not compress.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CompressError {
    /// The output would not be smaller than the input. zswap's -ENOSPC: the
    /// caller decides whether to keep the page raw or reject it.
    #[error("output would not be smaller than the input")]
    Poor,
    /// The destination buffer is smaller than the source. Callers MUST pass a
    /// `dst` at least as long as `src` (the codec itself stops one byte short).
    #[error("destination buffer of {got} bytes is smaller than the {need}-byte source")]
    DstTooSmall { need: usize, got: usize },
    /// The library reported a failure other than running out of room.
    #[error("{codec} failed: {msg}")]
    Codec { codec: &'static str, msg: String },
    /// `verify_compress` decompressed the output and it did not match the input.
    #[error("{codec} output failed verification")]
    VerifyFailed { codec: &'static str },
}

/// Why one compressed object did not decompress.
///
/// A decoder never panics and never writes past `dst`, whatever the input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DecompressError {
    /// The input is corrupt or truncated.
    #[error("{codec}: corrupt or truncated input")]
    Corrupt { codec: &'static str },
    /// The input decodes to more bytes than `dst` holds.
    #[error("{codec}: output does not fit in {cap} bytes")]
    Overrun { codec: &'static str, cap: usize },
    /// The input decoded cleanly but to the wrong length (a truncated stream
    /// can end on an instruction boundary).
    #[error("{codec}: decoded {got} bytes, expected {want}")]
    LengthMismatch { codec: &'static str, got: usize, want: usize },
}

/// A configuration or call error: an unknown codec, a bad level, a batch too large.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Error {
    #[error("unknown codec {name:?}; valid codecs are: {valid}")]
    UnknownCodec { name: String, valid: String },
    #[error("level {level} is out of range for {codec}; valid levels are {min}..={max}")]
    LevelOutOfRange { codec: &'static str, level: i32, min: i32, max: i32 },
    #[error("codec {codec} takes no level (got {level:?})")]
    NoLevel { codec: &'static str, level: String },
    #[error("bad level {level:?} for {codec}: expected an integer in {min}..={max}")]
    BadLevel { codec: &'static str, level: String, min: i32, max: i32 },
    #[error("batch of {got} items is larger than batch_size {max}; valid sizes are 1..={max}")]
    BatchTooLarge { got: usize, max: usize },
    #[error("batch has {srcs} sources but {dsts} destinations and {results} result slots")]
    BatchShape { srcs: usize, dsts: usize, results: usize },
    #[error("invalid engine configuration: {0}")]
    Config(#[from] zmem_common::ConfigError),
    /// A worker thread could not be started.
    #[error("spawn an engine thread: {0}")]
    Spawn(String),
    #[error("the engine device has shut down")]
    ShutDown,
}
