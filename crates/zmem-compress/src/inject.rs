//! Fault injection: [`FailEvery`] wraps a real [`BatchCompressor`] and fails
//! every Nth compression, as a flaky hardware engine would. For soaks and
//! tests of the paths a failed store takes; never in a default data path.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Batch, BatchCompressor, CompressError, DecompressError, Error, Ticket};

/// Fails compression `every`-th item (counted across calls) with
/// [`CompressError::Codec`]; everything else is the inner codec's.
pub struct FailEvery<C> {
    inner: C,
    every: u64,
    calls: AtomicU64,
}

impl<C: BatchCompressor> FailEvery<C> {
    /// `every` is at least 1 (1: every compression fails).
    pub fn new(inner: C, every: u64) -> Self {
        FailEvery { inner, every: every.max(1), calls: AtomicU64::new(1) }
    }

    /// Injected failures so far.
    pub fn injected(&self) -> u64 {
        self.calls.load(Ordering::Relaxed).saturating_sub(1) / self.every
    }
}

impl<C> std::fmt::Debug for FailEvery<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailEvery").field("every", &self.every).finish_non_exhaustive()
    }
}

impl<C: BatchCompressor> BatchCompressor for FailEvery<C> {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn batch_size(&self) -> usize {
        self.inner.batch_size()
    }

    fn compress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, CompressError>],
    ) -> Result<(), Error> {
        self.inner.compress_batch(src, dst, out)?;
        for o in out.iter_mut() {
            if self.calls.fetch_add(1, Ordering::Relaxed) % self.every == 0 {
                *o = Err(CompressError::Codec { codec: "inject", msg: "injected failure".into() });
            }
        }
        Ok(())
    }

    fn decompress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, DecompressError>],
    ) -> Result<(), Error> {
        self.inner.decompress_batch(src, dst, out)
    }

    fn submit(&self, batch: Batch) -> Result<Ticket, Error> {
        self.inner.submit(batch)
    }

    fn poll(&self, ticket: &Ticket) -> bool {
        self.inner.poll(ticket)
    }

    fn wait(&self, ticket: Ticket) -> Batch {
        self.inner.wait(ticket)
    }
}
