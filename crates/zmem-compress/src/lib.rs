//! zmem's batch compression framework: the user-space analog of the kernel's
//! `crypto_acomp` with the batching extension that the zswap/IAA series adds.
//!
//! Layers, bottom up:
//! - [`codec`]: one [`Compressor`] per codec (lz4, zstd, deflate, lzo,
//!   lzo-rle), each owning a reusable library context.
//! - [`batch`]: the [`BatchCompressor`] trait (N pages per call,
//!   synchronously or submit-then-poll), and the [`Sequential`] adapter that
//!   makes any `Compressor` a `BatchCompressor`.
//! - [`engines`]: [`Engines`], a multi-engine device with per-engine work
//!   queues, a bounded submit wait with software fallback, and optional
//!   verification of every compressed output.
//! - [`corpus`]: real anonymous-memory pages for tests and benchmarks.
//! - [`inject`]: fault injection (a codec that fails now and then).
#![forbid(unsafe_code)]

pub mod batch;
pub mod codec;
pub mod corpus;
pub mod engines;
mod error;
pub mod inject;

pub use batch::{Batch, BatchCompressor, BatchItem, Factory, ItemError, Op, PendingBatch, Sequential, Ticket};
pub use codec::{CodecKind, CodecSpec, Compressor};
pub use engines::{EngineStats, Engines, EnginesConfig, WqMode};
pub use error::{CompressError, DecompressError, Error};
