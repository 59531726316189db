//! The batch API: the analog of the kernel's batching `acomp` interface, where
//! one request carries N pages and each page gets its own result (the per-SG
//! lengths of the zswap batching series).
//!
//! Two forms:
//! - synchronous, over borrowed buffers: [`BatchCompressor::compress_batch`]
//!   and [`BatchCompressor::decompress_batch`];
//! - asynchronous, over an owned [`Batch`]: [`BatchCompressor::submit`]
//!   returns a [`Ticket`], [`BatchCompressor::poll`] asks whether it is done,
//!   and [`BatchCompressor::wait`] blocks and hands the batch back with a
//!   result in each item. Batches are meant to be reused: their buffers keep
//!   their capacity across submissions.
//!
//! [`Sequential`] turns any [`Compressor`] into a `BatchCompressor` that runs
//! the items one after the other on the calling thread;
//! [`crate::engines::Engines`] runs them in parallel on worker engines.

use std::sync::{Arc, Mutex};
use zmem_common::LockExt;

use crate::codec::{CodecSpec, Compressor};
use crate::{CompressError, DecompressError, Error};
use zmem_common::ConfigError;

/// Builds a fresh codec context. Engines and adapters call it once per
/// context they keep, never per page.
pub type Factory = Arc<dyn Fn() -> Box<dyn Compressor> + Send + Sync>;

impl CodecSpec {
    /// A [`Factory`] for this spec.
    pub fn factory(self) -> Factory {
        Arc::new(move || self.build())
    }
}

/// What a batch does to each item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Compress,
    Decompress,
}

/// The error of one item: which one depends on the batch's [`Op`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ItemError {
    #[error(transparent)]
    Compress(#[from] CompressError),
    #[error(transparent)]
    Decompress(#[from] DecompressError),
    /// The ticket was handed to a `BatchCompressor` other than the one
    /// that issued it: items it had not started were not run.
    #[error("the batch's ticket was waited on by another compressor; the item was not run")]
    ForeignTicket,
}

/// One item of an owned batch. `dst.len()` is the room the codec may use.
#[derive(Debug, Default, Clone)]
pub struct BatchItem {
    pub src: Vec<u8>,
    pub dst: Vec<u8>,
    /// `None` until the batch completes; then the output length or the error.
    pub result: Option<Result<usize, ItemError>>,
}

impl BatchItem {
    /// The output bytes of a completed item, or its error; `None` before
    /// the batch completes.
    pub fn output(&self) -> Option<Result<&[u8], &ItemError>> {
        match &self.result {
            Some(Ok(n)) => Some(Ok(&self.dst[..*n])),
            Some(Err(e)) => Some(Err(e)),
            None => None,
        }
    }

    /// Runs `op` on this item with `ctx`, storing the result.
    pub(crate) fn run(&mut self, op: Op, ctx: &mut dyn Compressor) -> &Result<usize, ItemError> {
        let r = match op {
            Op::Compress => ctx.compress(&self.src, &mut self.dst).map_err(ItemError::from),
            Op::Decompress => ctx.decompress(&self.src, &mut self.dst).map_err(ItemError::from),
        };
        self.result.insert(r)
    }
}

/// An owned batch for the asynchronous API.
#[derive(Debug, Clone)]
pub struct Batch {
    pub op: Op,
    pub items: Vec<BatchItem>,
}

impl Batch {
    pub fn new(op: Op) -> Self {
        Batch { op, items: Vec::new() }
    }

    /// A compress batch of `pages`, each item's `dst` as long as its page.
    pub fn compress<'a>(pages: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut b = Batch::new(Op::Compress);
        b.refill(Op::Compress, pages, |src| src.len());
        b
    }

    /// A decompress batch of `objects`, each item's `dst` `out_len` long.
    pub fn decompress<'a>(objects: impl IntoIterator<Item = &'a [u8]>, out_len: usize) -> Self {
        let mut b = Batch::new(Op::Decompress);
        b.refill(Op::Decompress, objects, |_| out_len);
        b
    }

    /// Reuses this batch's buffers for new inputs.
    pub fn refill<'a>(
        &mut self,
        op: Op,
        srcs: impl IntoIterator<Item = &'a [u8]>,
        mut room: impl FnMut(&[u8]) -> usize,
    ) {
        self.op = op;
        let mut n = 0;
        for src in srcs {
            if n == self.items.len() {
                self.items.push(BatchItem::default());
            }
            let item = &mut self.items[n];
            item.src.clear();
            item.src.extend_from_slice(src);
            item.dst.resize(room(src), 0);
            item.result = None;
            n += 1;
        }
        self.items.truncate(n);
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// A submitted batch. Hand it back to the same [`BatchCompressor`]'s `poll`
/// or `wait`.
#[derive(Debug)]
pub struct Ticket {
    pub(crate) inner: TicketInner,
}

#[derive(Debug)]
pub(crate) enum TicketInner {
    /// Completed at submit time (the sequential adapter).
    Ready(Batch),
    /// Running on a device: the engines, or a hardware backend.
    Pending(Box<dyn PendingBatch>),
}

/// A batch that a device has started: how the engines and a hardware backend
/// (a GPU through nvCOMP, say) hand their work to the ticket API.
///
/// The device that issued the ticket drives it with its own `poll` and
/// `wait` (it finds its own type again by `Any`); these two methods serve any
/// other waiter.
pub trait PendingBatch: std::any::Any + Send + std::fmt::Debug {
    /// Whether the device has finished. Never blocks.
    fn is_done(&self) -> bool;
    /// Blocks until every item the device started has finished and hands the
    /// batch back. A device that starts every item at submit time (a GPU)
    /// gives every item its real result; one that may not have started an
    /// item yet (the engines) returns it unrun, as
    /// [`ItemError::ForeignTicket`], never run with another codec.
    fn finish(self: Box<Self>) -> Batch;
}

impl Ticket {
    /// The ticket of a batch a device runs.
    pub fn pending(batch: Box<dyn PendingBatch>) -> Ticket {
        Ticket { inner: TicketInner::Pending(batch) }
    }

    /// The ticket of a batch that completed at submit time.
    pub fn ready(batch: Batch) -> Ticket {
        Ticket { inner: TicketInner::Ready(batch) }
    }

    /// Whether the batch has completed, for a device that did not issue
    /// the ticket: a pending batch is asked; an engine batch is only
    /// reported, never driven.
    pub fn is_done(&self) -> bool {
        match &self.inner {
            TicketInner::Ready(_) => true,
            TicketInner::Pending(p) => p.is_done(),
        }
    }

    /// Waits for the batch, for a device that did not issue the ticket:
    /// a pending batch completes; of an engine batch, what its engines started
    /// completes and the rest is returned unrun ([`ItemError::ForeignTicket`],
    /// never run with the wrong codec).
    pub fn finish_foreign(self) -> Batch {
        match self.inner {
            TicketInner::Ready(b) => b,
            TicketInner::Pending(p) => p.finish(),
        }
    }
}

/// N pages per call, synchronously or by submit-then-poll.
///
/// # Contract
/// - Every call takes at most [`batch_size`](Self::batch_size) items and
///   returns [`Error::BatchTooLarge`] otherwise, touching nothing.
/// - Each item gets its own result; one `Poor` page does not fail the rest.
/// - Outputs of the software implementations ([`Sequential`], the engines)
///   are byte-identical to [`Compressor::compress`] of the same codec,
///   whichever engine or fallback path ran them. A hardware backend's outputs
///   are in the same codec's format, so the software decompressor of that
///   codec reads them back, but its matcher may choose other bytes.
/// - A [`Ticket`] MUST be passed back to the instance that issued it.
///   Another instance's `wait` does not panic: it returns the items it
///   could not run as [`ItemError::ForeignTicket`].
pub trait BatchCompressor: Send + Sync {
    /// The codec name, as in `lz4` or `zstd:1`.
    fn name(&self) -> String;

    /// The most items one call takes.
    fn batch_size(&self) -> usize;

    /// Compresses `src[i]` into `dst[i]`, storing each result in `out[i]`.
    ///
    /// # Errors
    /// [`Error::BatchTooLarge`] or [`Error::BatchShape`] before any work;
    /// [`Error::ShutDown`] if the device is gone.
    fn compress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, CompressError>],
    ) -> Result<(), Error>;

    /// Decompresses `src[i]` into `dst[i]`, storing each result in `out[i]`.
    ///
    /// # Errors
    /// As [`compress_batch`](Self::compress_batch).
    fn decompress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, DecompressError>],
    ) -> Result<(), Error>;

    /// Starts `batch` and returns at once (or when the work queues accept it).
    ///
    /// # Errors
    /// [`Error::BatchTooLarge`] (the batch is dropped) or [`Error::ShutDown`].
    fn submit(&self, batch: Batch) -> Result<Ticket, Error>;

    /// Whether the batch behind `ticket` has completed. Never blocks.
    fn poll(&self, ticket: &Ticket) -> bool;

    /// Blocks until the batch completes and returns it with every result set.
    fn wait(&self, ticket: Ticket) -> Batch;

    /// Whether submitted batches run beside the caller (on engines or a
    /// device), so that submitting several before waiting on the first
    /// runs them at once. `false` (the default): `submit` does the work
    /// itself before it returns, and the synchronous calls, which copy
    /// nothing into owned buffers, are the cheaper way in.
    fn runs_beside(&self) -> bool {
        false
    }

    /// How many submitted batches keep this compressor busy: a caller that
    /// runs beside it (`Tier::store_many`) keeps this many in flight. The
    /// default is 128 pages' worth, a reclaim pass of 64 KiB folios, which
    /// stays within an engine queue's depth, so a submit never waits for
    /// room. A device with its own queues (a GPU's streams) says how many
    /// it runs at once.
    fn batches_in_flight(&self) -> usize {
        (128 / self.batch_size().max(1)).max(1)
    }
}

/// The checks every [`BatchCompressor`] call makes before any work: one
/// destination and one result slot per source, and at most `max` items.
///
/// # Errors
/// [`Error::BatchShape`] or [`Error::BatchTooLarge`].
pub fn check_shape(n_src: usize, n_dst: usize, n_out: usize, max: usize) -> Result<(), Error> {
    if n_src != n_dst || n_src != n_out {
        return Err(Error::BatchShape { srcs: n_src, dsts: n_dst, results: n_out });
    }
    if n_src > max {
        return Err(Error::BatchTooLarge { got: n_src, max });
    }
    Ok(())
}

/// The default batch size of adapters and engines: zswap's
/// `ZSWAP_MAX_BATCH_SIZE` in the batching series.
pub const DEFAULT_BATCH_SIZE: usize = 8;
/// The largest batch any implementation accepts.
pub const MAX_BATCH_SIZE: usize = 32;

/// A pool of codec contexts: one is taken for a call and put back after, so
/// a context is reused by whichever thread comes next and never shared.
pub(crate) struct CtxPool {
    factory: Factory,
    spare: Mutex<Vec<Box<dyn Compressor>>>,
    name: String,
}

impl CtxPool {
    pub(crate) fn new(factory: Factory) -> Self {
        let first = factory();
        let name = first.name().to_string();
        CtxPool { factory, spare: Mutex::new(vec![first]), name }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut dyn Compressor) -> R) -> R {
        let taken = self.spare.lock_ok().pop();
        let mut ctx = taken.unwrap_or_else(|| (self.factory)());
        let r = f(ctx.as_mut());
        self.spare.lock_ok().push(ctx);
        r
    }
}

impl std::fmt::Debug for CtxPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtxPool").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Any [`Compressor`] as a sequential [`BatchCompressor`]: items run in order
/// on the calling thread, with a context taken from a small pool so that
/// concurrent callers never share one.
#[derive(Debug)]
pub struct Sequential {
    ctxs: CtxPool,
    batch_size: usize,
}

impl Sequential {
    /// # Errors
    /// [`Error::Config`] if `batch_size` is 0 or above [`MAX_BATCH_SIZE`].
    pub fn new(factory: Factory, batch_size: usize) -> Result<Self, Error> {
        if !(1..=MAX_BATCH_SIZE).contains(&batch_size) {
            return Err(ConfigError::out_of_range("batch_size", batch_size, "1..=32").into());
        }
        Ok(Sequential { ctxs: CtxPool::new(factory), batch_size })
    }

    /// The adapter for a codec spec, with [`DEFAULT_BATCH_SIZE`].
    pub fn from_spec(spec: CodecSpec) -> Self {
        Sequential { ctxs: CtxPool::new(spec.factory()), batch_size: DEFAULT_BATCH_SIZE }
    }
}

impl BatchCompressor for Sequential {
    fn name(&self) -> String {
        self.ctxs.name().to_string()
    }

    fn batch_size(&self) -> usize {
        self.batch_size
    }

    fn compress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, CompressError>],
    ) -> Result<(), Error> {
        check_shape(src.len(), dst.len(), out.len(), self.batch_size)?;
        self.ctxs.with(|ctx| {
            for ((s, d), o) in src.iter().zip(dst.iter_mut()).zip(out.iter_mut()) {
                *o = ctx.compress(s, d);
            }
        });
        Ok(())
    }

    fn decompress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, DecompressError>],
    ) -> Result<(), Error> {
        check_shape(src.len(), dst.len(), out.len(), self.batch_size)?;
        self.ctxs.with(|ctx| {
            for ((s, d), o) in src.iter().zip(dst.iter_mut()).zip(out.iter_mut()) {
                *o = ctx.decompress(s, d);
            }
        });
        Ok(())
    }

    fn submit(&self, mut batch: Batch) -> Result<Ticket, Error> {
        if batch.len() > self.batch_size {
            return Err(Error::BatchTooLarge { got: batch.len(), max: self.batch_size });
        }
        let op = batch.op;
        self.ctxs.with(|ctx| {
            for item in &mut batch.items {
                item.run(op, ctx);
            }
        });
        Ok(Ticket::ready(batch))
    }

    fn poll(&self, ticket: &Ticket) -> bool {
        ticket.is_done()
    }

    fn wait(&self, ticket: Ticket) -> Batch {
        // Every ticket this adapter issues is Ready.
        ticket.finish_foreign()
    }
}
