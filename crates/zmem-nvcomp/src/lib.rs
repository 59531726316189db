//! NVIDIA GPUs as a zmem compression device, through nvCOMP's batched LZ4.
//!
//! [`NvcompLz4`] is a [`BatchCompressor`]: the tier, `zmem bench compress`
//! and anything else that takes the batch API can run on it. A batch costs
//! one host-to-device copy, one nvCOMP call and one copy back, queued on a
//! CUDA stream; [`BatchCompressor::submit`] returns as soon as that is queued,
//! so several batches can be in flight on several streams.
//!
//! nvCOMP's LZ4 writes plain LZ4 blocks, which liblz4 reads. So:
//! - objects the GPU compressed load on the CPU, and by default
//!   [`Placement::Cpu`] decompresses there: a page fault waits for one
//!   page, and a GPU round trip costs more than liblz4 decoding it
//!   ([`Placement::Gpu`] is for objects this process compressed itself:
//!   nvCOMP's decoder does not reject corrupt blocks);
//! - with [`NvcompConfig::verify`], every object is decompressed by liblz4
//!   and compared with its page before it is returned (the check the
//!   multi-engine device offers);
//! - when every stream is busy, an item does not fit a GPU chunk, or a CUDA
//!   call fails, the batch runs on liblz4 instead and the counters say so.
//!   A page is never lost to the device.
//!
//! Nothing is linked: [`Gpu::open`] loads `libnvcomp.so.6` and the driver's
//! `libcuda.so.1` with `dlopen`, so this crate builds, and its callers run,
//! on machines with neither (the open is then a clear error).

mod gpu;
mod sys;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use zmem_common::LockExt;
use zmem_compress::batch::{check_shape, MAX_BATCH_SIZE};
use zmem_compress::{
    Batch, BatchCompressor, CodecSpec, CompressError, DecompressError, Error, ItemError, Op, PendingBatch, Sequential,
    Ticket,
};

pub use gpu::Gpu;
use gpu::{Dir, Slot, CHUNK};

/// The name nvCOMP's library has in the `nvidia-libnvcomp-cu13` wheel and in
/// NVIDIA's packages.
pub const DEFAULT_LIBRARY: &str = "libnvcomp.so.6";

/// Why the device could not be opened or a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NvcompError {
    #[error(
        "cannot load {library}: {msg}. The GPU compressor needs NVIDIA's driver and nvCOMP 6 \
         (pip install nvidia-libnvcomp-cu13, then put its nvidia/libnvcomp/lib64 on LD_LIBRARY_PATH \
         or name the file)"
    )]
    Load { library: String, msg: String },
    #[error("invalid nvcomp configuration: {0}")]
    Config(String),
    #[error("nvCOMP {found} is not supported: zmem needs nvCOMP 6.x")]
    Version { found: u32 },
    #[error("no CUDA device {device}: the driver sees {count}")]
    NoDevice { device: i32, count: i32 },
    #[error("{call} failed: CUDA error {code} {msg}")]
    Cuda { call: &'static str, code: i32, msg: String },
    #[error("{call} failed: nvcompStatus_t {status}")]
    Nvcomp { call: &'static str, status: i32 },
}

/// Where decompression runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// liblz4 on the calling thread: the latency a page fault wants, and the
    /// decoder zmem fuzzes: a corrupt object is an error of its own item.
    #[default]
    Cpu,
    /// nvCOMP on the GPU: throughput for large loads of objects this process
    /// compressed itself.
    ///
    /// nvCOMP 6.0's LZ4 decoder is not a safe decoder of untrusted input
    /// (measured on an H200, `tests/gpu.rs`): it reports success for most
    /// corrupt blocks, and a corrupt block can change the output of a
    /// sound one in the same batch. So a GPU batch is redone on liblz4
    /// whenever an item does not decode to exactly its output buffer's
    /// length. That catches truncated objects, but not every corrupt one.
    Gpu,
}

/// How to open the device.
#[derive(Debug, Clone)]
pub struct NvcompConfig {
    /// nvCOMP's library: a file name the loader searches for, or a path.
    pub library: String,
    /// The CUDA device ordinal.
    pub device: i32,
    /// Streams (each with its own buffers for one batch) made at most;
    /// a batch that finds them all busy runs on liblz4.
    pub streams: usize,
    /// Where decompression runs.
    pub decompress: Placement,
    /// Decompress every GPU output with liblz4 and compare it with its page.
    pub verify: bool,
}

impl Default for NvcompConfig {
    fn default() -> Self {
        NvcompConfig {
            library: DEFAULT_LIBRARY.to_string(),
            device: 0,
            streams: 4,
            decompress: Placement::Cpu,
            verify: false,
        }
    }
}

/// Counters of one [`NvcompLz4`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NvcompStats {
    /// Batches the GPU ran, and their items.
    pub gpu_batches: u64,
    pub gpu_items: u64,
    /// Items liblz4 ran instead: decompression on the CPU, items larger
    /// than a chunk, and the batches below.
    pub cpu_items: u64,
    /// Batches that found every stream busy.
    pub busy_fallbacks: u64,
    /// Batches a CUDA or nvCOMP call failed for (rerun on liblz4).
    pub gpu_errors: u64,
    /// GPU outputs that liblz4 did not read back to their page.
    pub verify_failures: u64,
    /// GPU decompression batches redone on liblz4 because an item did not
    /// decode to its buffer's length.
    pub gpu_redone: u64,
}

#[derive(Debug, Default)]
struct Counters {
    gpu_batches: AtomicU64,
    gpu_items: AtomicU64,
    cpu_items: AtomicU64,
    busy_fallbacks: AtomicU64,
    gpu_errors: AtomicU64,
    verify_failures: AtomicU64,
    gpu_redone: AtomicU64,
}

fn bump(c: &AtomicU64, n: usize) {
    c.fetch_add(n as u64, Ordering::Relaxed);
}

/// State shared by the compressor and its batches in flight.
#[derive(Debug)]
struct Shared {
    gpu: Arc<Gpu>,
    cfg: NvcompConfig,
    /// Idle slots; `made` counts every slot, idle or busy.
    idle: Mutex<Vec<Slot>>,
    made: AtomicUsize,
    counters: Counters,
    /// liblz4, for the CPU paths and for verification.
    cpu: Sequential,
}

/// nvCOMP's batched LZ4 on one GPU, behind the batch API. Its name is
/// `lz4@nvcomp`; its objects are LZ4 blocks.
#[derive(Debug)]
pub struct NvcompLz4 {
    shared: Arc<Shared>,
}

impl NvcompLz4 {
    /// Opens the device and makes its first stream.
    ///
    /// # Errors
    /// See [`Gpu::open`]; [`NvcompError::Config`] for `streams` of 0.
    pub fn new(cfg: NvcompConfig) -> Result<NvcompLz4, NvcompError> {
        if cfg.streams == 0 {
            return Err(NvcompError::Config("streams must be at least 1".to_string()));
        }
        let gpu = Gpu::open(&cfg.library, cfg.device)?;
        let first = Slot::new(&gpu)?;
        let lz4: CodecSpec = "lz4".parse().expect("lz4 is a codec");
        let cpu = Sequential::new(lz4.factory(), MAX_BATCH_SIZE).expect("MAX_BATCH_SIZE is a valid batch size");
        let shared = Shared {
            gpu,
            cfg,
            idle: Mutex::new(vec![first]),
            made: AtomicUsize::new(1),
            counters: Counters::default(),
            cpu,
        };
        Ok(NvcompLz4 { shared: Arc::new(shared) })
    }

    /// The device this runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.shared.gpu
    }

    pub fn stats(&self) -> NvcompStats {
        let c = &self.shared.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NvcompStats {
            gpu_batches: r(&c.gpu_batches),
            gpu_items: r(&c.gpu_items),
            cpu_items: r(&c.cpu_items),
            busy_fallbacks: r(&c.busy_fallbacks),
            gpu_errors: r(&c.gpu_errors),
            verify_failures: r(&c.verify_failures),
            gpu_redone: r(&c.gpu_redone),
        }
    }
}

impl Shared {
    /// An idle slot, a new one while fewer than `streams` exist, or `None`.
    fn take_slot(&self) -> Option<Slot> {
        if let Some(s) = self.idle.lock_ok().pop() {
            return Some(s);
        }
        let made = self.made.fetch_add(1, Ordering::AcqRel);
        if made < self.cfg.streams {
            match Slot::new(&self.gpu) {
                Ok(s) => return Some(s),
                Err(e) => log::warn!("nvcomp: cannot make stream {}: {e}", made + 1),
            }
        }
        self.made.fetch_sub(1, Ordering::AcqRel);
        None
    }

    fn put_slot(&self, s: Slot) {
        self.idle.lock_ok().push(s);
    }

    /// Whether `op` on these items goes to the GPU at all.
    fn gpu_takes(&self, op: Op, srcs: &[&[u8]], caps: impl Iterator<Item = usize>) -> bool {
        let fits = srcs.iter().all(|s| s.len() <= CHUNK);
        match op {
            Op::Compress => fits && caps.zip(srcs).all(|(c, s)| c >= s.len()),
            Op::Decompress => fits && self.cfg.decompress == Placement::Gpu,
        }
    }

    /// Queues a batch on a slot, or says why it cannot.
    fn launch(&self, op: Op, srcs: &[&[u8]], caps: &[usize]) -> Option<Slot> {
        if srcs.is_empty() || !self.gpu_takes(op, srcs, caps.iter().copied()) {
            return None;
        }
        let Some(mut slot) = self.take_slot() else {
            bump(&self.counters.busy_fallbacks, 1);
            return None;
        };
        let dir = if op == Op::Compress { Dir::Compress } else { Dir::Decompress };
        match slot.launch(dir, srcs.iter().copied(), caps.iter().copied()) {
            Ok(()) => Some(slot),
            Err(e) => {
                self.gpu_failed(slot, &e);
                None
            }
        }
    }

    fn gpu_failed(&self, slot: Slot, e: &NvcompError) {
        bump(&self.counters.gpu_errors, 1);
        log::warn!("nvcomp: {e}; the batch runs on liblz4");
        // A slot whose stream failed is dropped, not reused.
        drop(slot);
        self.made.fetch_sub(1, Ordering::AcqRel);
    }

    /// Item i's result from a synchronized slot, its output copied to `dst`.
    fn collect_compress(&self, slot: &Slot, i: usize, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        let (status, out) = slot.output(i);
        if status != sys::NVCOMP_SUCCESS {
            return Err(CompressError::Codec { codec: "lz4", msg: format!("nvCOMP status {status}") });
        }
        if out.len() >= src.len() {
            return Err(CompressError::Poor);
        }
        dst[..out.len()].copy_from_slice(out);
        if self.cfg.verify && !self.verify(src, out) {
            bump(&self.counters.verify_failures, 1);
            return Err(CompressError::VerifyFailed { codec: "lz4" });
        }
        Ok(out.len())
    }

    fn verify(&self, page: &[u8], obj: &[u8]) -> bool {
        let mut back = vec![0u8; page.len()];
        let mut res = [Ok(0)];
        let r = self.cpu.decompress_batch(&[obj], &mut [&mut back[..]], &mut res);
        r.is_ok() && res[0] == Ok(page.len()) && back == page
    }

    fn collect_decompress(slot: &Slot, i: usize, dst: &mut [u8]) -> Result<usize, DecompressError> {
        let (status, out) = slot.output(i);
        match status {
            sys::NVCOMP_SUCCESS if out.len() <= dst.len() => {
                dst[..out.len()].copy_from_slice(out);
                Ok(out.len())
            }
            sys::NVCOMP_SUCCESS | sys::NVCOMP_ERROR_OUTPUT_BUFFER_TOO_SMALL => {
                Err(DecompressError::Overrun { codec: "lz4", cap: dst.len() })
            }
            _ => Err(DecompressError::Corrupt { codec: "lz4" }),
        }
    }

    fn redo_on_cpu(&self) {
        bump(&self.counters.gpu_redone, 1);
    }

    fn cpu_compress(&self, src: &[&[u8]], dst: &mut [&mut [u8]], out: &mut [Result<usize, CompressError>]) {
        bump(&self.counters.cpu_items, src.len());
        self.cpu.compress_batch(src, dst, out).expect("shape was checked");
    }

    fn cpu_decompress(&self, src: &[&[u8]], dst: &mut [&mut [u8]], out: &mut [Result<usize, DecompressError>]) {
        bump(&self.counters.cpu_items, src.len());
        self.cpu.decompress_batch(src, dst, out).expect("shape was checked");
    }

    /// Synchronizes a launched slot; on failure the slot is dropped.
    fn finish_slot(&self, slot: Slot) -> Option<Slot> {
        match slot.sync() {
            Ok(()) => {
                bump(&self.counters.gpu_batches, 1);
                bump(&self.counters.gpu_items, slot.len());
                Some(slot)
            }
            Err(e) => {
                self.gpu_failed(slot, &e);
                None
            }
        }
    }
}

/// Whether every item of a GPU decompression decoded to exactly its
/// buffer's length (see [`Placement::Gpu`]).
fn all_exact<'a, E: 'a>(results: impl Iterator<Item = &'a Result<usize, E>>, caps: &[usize]) -> bool {
    results.zip(caps).all(|(r, cap)| matches!(r, Ok(n) if n == cap))
}

impl BatchCompressor for NvcompLz4 {
    fn name(&self) -> String {
        "lz4@nvcomp".to_string()
    }

    fn batch_size(&self) -> usize {
        MAX_BATCH_SIZE
    }

    fn runs_beside(&self) -> bool {
        true
    }

    /// One batch a stream: a batch more finds every stream busy and runs
    /// on liblz4 on the caller.
    fn batches_in_flight(&self) -> usize {
        self.shared.cfg.streams
    }

    fn compress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, CompressError>],
    ) -> Result<(), Error> {
        check_shape(src.len(), dst.len(), out.len(), MAX_BATCH_SIZE)?;
        let sh = &*self.shared;
        let caps: Vec<usize> = dst.iter().map(|d| d.len()).collect();
        let Some(slot) = sh.launch(Op::Compress, src, &caps).and_then(|s| sh.finish_slot(s)) else {
            sh.cpu_compress(src, dst, out);
            return Ok(());
        };
        for (i, ((s, d), o)) in src.iter().zip(dst.iter_mut()).zip(out.iter_mut()).enumerate() {
            *o = sh.collect_compress(&slot, i, s, d);
        }
        sh.put_slot(slot);
        Ok(())
    }

    fn decompress_batch(
        &self,
        src: &[&[u8]],
        dst: &mut [&mut [u8]],
        out: &mut [Result<usize, DecompressError>],
    ) -> Result<(), Error> {
        check_shape(src.len(), dst.len(), out.len(), MAX_BATCH_SIZE)?;
        let sh = &*self.shared;
        let caps: Vec<usize> = dst.iter().map(|d| d.len()).collect();
        let Some(slot) = sh.launch(Op::Decompress, src, &caps).and_then(|s| sh.finish_slot(s)) else {
            sh.cpu_decompress(src, dst, out);
            return Ok(());
        };
        for (i, (d, o)) in dst.iter_mut().zip(out.iter_mut()).enumerate() {
            *o = Shared::collect_decompress(&slot, i, d);
        }
        sh.put_slot(slot);
        if !all_exact(out.iter(), &caps) {
            sh.redo_on_cpu();
            sh.cpu_decompress(src, dst, out);
        }
        Ok(())
    }

    fn submit(&self, mut batch: Batch) -> Result<Ticket, Error> {
        if batch.len() > MAX_BATCH_SIZE {
            return Err(Error::BatchTooLarge { got: batch.len(), max: MAX_BATCH_SIZE });
        }
        let sh = &self.shared;
        let srcs: Vec<&[u8]> = batch.items.iter().map(|it| it.src.as_slice()).collect();
        let caps: Vec<usize> = batch.items.iter().map(|it| it.dst.len()).collect();
        match sh.launch(batch.op, &srcs, &caps) {
            Some(slot) => Ok(Ticket::pending(Box::new(Pending { shared: sh.clone(), slot, batch }))),
            None => {
                sh.run_cpu(&mut batch);
                Ok(Ticket::ready(batch))
            }
        }
    }

    fn poll(&self, ticket: &Ticket) -> bool {
        ticket.is_done()
    }

    fn wait(&self, ticket: Ticket) -> Batch {
        // A pending batch finishes itself, whichever device it came from.
        ticket.finish_foreign()
    }
}

impl Shared {
    /// Runs an owned batch on liblz4.
    fn run_cpu(&self, batch: &mut Batch) {
        bump(&self.counters.cpu_items, batch.len());
        // liblz4's adapter runs an owned batch in place, at submit time.
        let op = batch.op;
        let ticket = self.cpu.submit(std::mem::replace(batch, Batch::new(op))).expect("at most MAX_BATCH_SIZE items");
        *batch = self.cpu.wait(ticket);
    }
}

/// A batch queued on a slot's stream.
#[derive(Debug)]
struct Pending {
    shared: Arc<Shared>,
    slot: Slot,
    batch: Batch,
}

impl PendingBatch for Pending {
    fn is_done(&self) -> bool {
        self.slot.is_done()
    }

    fn finish(self: Box<Self>) -> Batch {
        let Pending { shared, slot, mut batch } = *self;
        let Some(slot) = shared.finish_slot(slot) else {
            shared.run_cpu(&mut batch);
            return batch;
        };
        for (i, item) in batch.items.iter_mut().enumerate() {
            let r = match batch.op {
                Op::Compress => shared.collect_compress(&slot, i, &item.src, &mut item.dst).map_err(ItemError::from),
                Op::Decompress => Shared::collect_decompress(&slot, i, &mut item.dst).map_err(ItemError::from),
            };
            item.result = Some(r);
        }
        shared.put_slot(slot);
        if batch.op == Op::Decompress {
            let caps: Vec<usize> = batch.items.iter().map(|it| it.dst.len()).collect();
            if !all_exact(batch.items.iter().map(|it| it.result.as_ref().expect("set above")), &caps) {
                shared.redo_on_cpu();
                shared.run_cpu(&mut batch);
            }
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_clear_error_that_names_it() {
        let cfg = NvcompConfig { library: "/nonexistent/libnvcomp.so.6".into(), ..NvcompConfig::default() };
        let e = NvcompLz4::new(cfg).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, NvcompError::Load { .. }), "{e:?}");
        assert!(msg.contains("/nonexistent/libnvcomp.so.6"), "{msg}");
        assert!(msg.contains("nvidia-libnvcomp-cu13"), "{msg}");
    }

    #[test]
    fn a_library_without_nvcomps_symbols_is_refused_by_name() {
        // libc is loadable but is not nvCOMP.
        let cfg = NvcompConfig { library: "libc.so.6".into(), ..NvcompConfig::default() };
        let msg = NvcompLz4::new(cfg).unwrap_err().to_string();
        assert!(msg.contains("nvcompGetProperties"), "{msg}");
    }

    #[test]
    fn the_option_structs_have_nvcomps_sizes() {
        // Both are passed by value: a wrong size would shift every argument.
        assert_eq!(std::mem::size_of::<sys::Lz4CompressOpts>(), 64);
        assert_eq!(std::mem::size_of::<sys::Lz4DecompressOpts>(), 64);
    }
}
