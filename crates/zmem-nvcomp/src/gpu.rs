//! One GPU: its primary context, and the slots (a stream with its device and
//! pinned host buffers) that batches run in.
//!
//! A slot's buffers are laid out so that a batch costs one copy in, one
//! nvCOMP call and one copy out, all queued on the slot's stream:
//!
//! ```text
//! region A (host pinned and device):  sizes[B] | caps[B] | data: B chunks of PAGE_SIZE
//! region B (host pinned and device):  sizes[B] | status[B] | data: B chunks of `stride`
//! device only:                        in_ptrs[B] | out_ptrs[B] | temp
//! ```
//!
//! For compression A holds the pages and B the compressed objects; for
//! decompression A holds the objects and B the pages. The pointer arrays
//! point at A's and B's chunks and never change, so they are copied once,
//! when the slot is made.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use zmem_common::PAGE_SIZE;
use zmem_compress::batch::MAX_BATCH_SIZE;

use crate::sys::{self, Cuda, DevPtr, Lib, Nvcomp, Stream};
use crate::NvcompError;

/// Items one slot holds: the batch API's largest batch.
pub(crate) const SLOT_ITEMS: usize = MAX_BATCH_SIZE;
/// The largest item the GPU path takes, in and out.
pub(crate) const CHUNK: usize = PAGE_SIZE;
/// Bytes of each region before its data: two arrays of `SLOT_ITEMS` words.
const HEADER: usize = 2 * SLOT_ITEMS * 8;

/// An opened GPU with its libraries.
pub struct Gpu {
    pub(crate) cuda: Cuda,
    pub(crate) nv: Nvcomp,
    device: c_int,
    ctx: *mut c_void,
    name: String,
    nvcomp_version: u32,
    /// nvCOMP's bound on one page's compressed size, rounded up to 256.
    stride: usize,
    temp_bytes: usize,
}

// SAFETY: `ctx` is the device's primary context, which the driver lets any
// thread make current; every other field is immutable after `open`.
unsafe impl Send for Gpu {}
// SAFETY: as for Send.
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.device)
            .field("name", &self.name)
            .field("nvcomp_version", &self.nvcomp_version)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens nvCOMP from `library` (a file name the dynamic loader searches
    /// for, or a path) and the CUDA driver, and retains `device`'s primary
    /// context.
    ///
    /// # Errors
    /// A library that cannot be loaded or lacks a symbol, a driver with no
    /// such device, an nvCOMP other than major version 6, or a CUDA error.
    pub fn open(library: &str, device: i32) -> Result<Arc<Gpu>, NvcompError> {
        let nv = Lib::open(library)
            .and_then(Nvcomp::load)
            .map_err(|msg| NvcompError::Load { library: library.to_string(), msg })?;
        let mut props = sys::NvProperties::default();
        // SAFETY: `props` is a live, writable nvcompProperties_t.
        let st = unsafe { (nv.get_properties)(&mut props) };
        if st != sys::NVCOMP_SUCCESS {
            return Err(NvcompError::Nvcomp { call: "nvcompGetProperties", status: st });
        }
        if props.version / 1000 != 6 {
            return Err(NvcompError::Version { found: props.version });
        }
        let cuda = Lib::open("libcuda.so.1")
            .and_then(Cuda::load)
            .map_err(|msg| NvcompError::Load { library: "libcuda.so.1 (the NVIDIA driver)".to_string(), msg })?;
        // SAFETY: cuInit takes a flags word that must be 0.
        check(&cuda, unsafe { (cuda.init)(0) }, "cuInit")?;
        let mut count = 0;
        // SAFETY: `count` is a live, writable int.
        check(&cuda, unsafe { (cuda.device_get_count)(&mut count) }, "cuDeviceGetCount")?;
        if device < 0 || device >= count {
            return Err(NvcompError::NoDevice { device, count });
        }
        let mut dev = 0;
        // SAFETY: `dev` is writable; the ordinal was checked against the count.
        check(&cuda, unsafe { (cuda.device_get)(&mut dev, device) }, "cuDeviceGet")?;
        let mut name_buf = [0 as c_char; 128];
        // SAFETY: the buffer holds 128 chars and the driver writes at most `len`,
        // NUL included.
        check(&cuda, unsafe { (cuda.device_get_name)(name_buf.as_mut_ptr(), 128, dev) }, "cuDeviceGetName")?;
        // SAFETY: the driver NUL-terminated the name inside the buffer.
        let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }.to_string_lossy().into_owned();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `ctx` is writable; `dev` is a valid device handle.
        check(&cuda, unsafe { (cuda.primary_ctx_retain)(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain")?;
        let mut gpu = Gpu { cuda, nv, device: dev, ctx, name, nvcomp_version: props.version, stride: 0, temp_bytes: 0 };
        gpu.make_current()?;
        let mut max_out = 0usize;
        // SAFETY: `max_out` is writable; the options are nvCOMP's defaults.
        let st = unsafe { (gpu.nv.lz4_compress_max_output)(CHUNK, sys::LZ4_COMPRESS_OPTS, &mut max_out) };
        nv_check(st, "nvcompBatchedLZ4CompressGetMaxOutputChunkSize")?;
        gpu.stride = max_out.next_multiple_of(256);
        let (mut ct, mut dt) = (0usize, 0usize);
        let total = SLOT_ITEMS * CHUNK;
        // SAFETY: the out-parameters are writable; a null stream is the
        // legacy default stream, which these size queries accept.
        let st = unsafe {
            (gpu.nv.lz4_compress_temp_size)(
                SLOT_ITEMS,
                CHUNK,
                sys::LZ4_COMPRESS_OPTS,
                &mut ct,
                total,
                std::ptr::null_mut(),
            )
        };
        nv_check(st, "nvcompBatchedLZ4CompressGetTempSize")?;
        // SAFETY: as above.
        let st = unsafe {
            (gpu.nv.lz4_decompress_temp_size)(
                SLOT_ITEMS,
                CHUNK,
                sys::LZ4_DECOMPRESS_OPTS,
                &mut dt,
                total,
                std::ptr::null_mut(),
            )
        };
        nv_check(st, "nvcompBatchedLZ4DecompressGetTempSize")?;
        gpu.temp_bytes = ct.max(dt).max(1);
        Ok(Arc::new(gpu))
    }

    /// The device's name, as the driver gives it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// nvCOMP's version, as `major * 1000 + minor * 100 + patch`.
    pub fn nvcomp_version(&self) -> u32 {
        self.nvcomp_version
    }

    /// Makes the primary context current on the calling thread: every thread
    /// that touches a slot calls this first.
    pub(crate) fn make_current(&self) -> Result<(), NvcompError> {
        // SAFETY: `ctx` is the retained primary context, valid until `drop`.
        check(&self.cuda, unsafe { (self.cuda.ctx_set_current)(self.ctx) }, "cuCtxSetCurrent")
    }

    pub(crate) fn cu(&self, r: sys::CuResult, call: &'static str) -> Result<(), NvcompError> {
        check(&self.cuda, r, call)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Every slot holds an Arc of this Gpu, so none is left.
        // SAFETY: the context was retained once in `open`.
        unsafe { (self.cuda.primary_ctx_release)(self.device) };
    }
}

fn check(cuda: &Cuda, r: sys::CuResult, call: &'static str) -> Result<(), NvcompError> {
    if r == sys::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: `p` is writable; the driver points it at a static string or
    // leaves it null.
    unsafe { (cuda.get_error_string)(r, &mut p) };
    let msg = if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null: a static NUL-terminated string of the driver's.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    Err(NvcompError::Cuda { call, code: r, msg })
}

fn nv_check(st: sys::NvStatus, call: &'static str) -> Result<(), NvcompError> {
    if st == sys::NVCOMP_SUCCESS {
        Ok(())
    } else {
        Err(NvcompError::Nvcomp { call, status: st })
    }
}

/// What a slot's batch does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    Compress,
    Decompress,
}

/// A stream and its buffers; used by one batch at a time.
pub(crate) struct Slot {
    gpu: Arc<Gpu>,
    stream: Stream,
    dev_a: DevPtr,
    dev_b: DevPtr,
    dev_ptrs: DevPtr,
    dev_temp: DevPtr,
    host: *mut u8,
    /// Items of the batch queued last.
    n: usize,
    dir: Dir,
}

// SAFETY: a Slot owns its stream and buffers outright; it moves between
// threads whole, and each thread makes the context current before using it.
unsafe impl Send for Slot {}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("n", &self.n).field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl Slot {
    fn a_len() -> usize {
        HEADER + SLOT_ITEMS * CHUNK
    }

    fn b_len(gpu: &Gpu) -> usize {
        HEADER + SLOT_ITEMS * gpu.stride
    }

    /// A new stream with its buffers, on the calling thread's current context.
    pub(crate) fn new(gpu: &Arc<Gpu>) -> Result<Slot, NvcompError> {
        gpu.make_current()?;
        let c = &gpu.cuda;
        let mut s = Slot {
            gpu: gpu.clone(),
            stream: std::ptr::null_mut(),
            dev_a: 0,
            dev_b: 0,
            dev_ptrs: 0,
            dev_temp: 0,
            host: std::ptr::null_mut(),
            n: 0,
            dir: Dir::Compress,
        };
        // From here on, `s`'s Drop frees whatever was made if a step fails.
        // SAFETY: each out-parameter is a live field of `s`; sizes are nonzero.
        unsafe {
            gpu.cu((c.stream_create)(&mut s.stream, sys::CU_STREAM_NON_BLOCKING), "cuStreamCreate")?;
        }
        // SAFETY: as above.
        unsafe { gpu.cu((c.mem_alloc)(&mut s.dev_a, Self::a_len()), "cuMemAlloc")? };
        // SAFETY: as above.
        unsafe { gpu.cu((c.mem_alloc)(&mut s.dev_b, Self::b_len(gpu)), "cuMemAlloc")? };
        // SAFETY: as above.
        unsafe { gpu.cu((c.mem_alloc)(&mut s.dev_ptrs, 2 * SLOT_ITEMS * 8), "cuMemAlloc")? };
        // SAFETY: as above.
        unsafe { gpu.cu((c.mem_alloc)(&mut s.dev_temp, gpu.temp_bytes), "cuMemAlloc")? };
        let host_len = Self::a_len() + Self::b_len(gpu);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: as above.
        unsafe { gpu.cu((c.mem_alloc_host)(&mut host, host_len), "cuMemAllocHost")? };
        s.host = host.cast();
        // The pointer arrays, staged in region A's header (free until the
        // first batch), then copied to the device once.
        let ptrs: Vec<u64> = (0..SLOT_ITEMS)
            .map(|i| s.dev_a + (HEADER + i * CHUNK) as u64)
            .chain((0..SLOT_ITEMS).map(|i| s.dev_b + (HEADER + i * gpu.stride) as u64))
            .collect();
        for (w, p) in s.host_mut().chunks_exact_mut(8).zip(&ptrs) {
            w.copy_from_slice(&p.to_ne_bytes());
        }
        // SAFETY: the source is HEADER bytes of pinned host memory this slot
        // owns, the destination the device array of the same size; the
        // synchronize below keeps the source unchanged until the copy ends.
        unsafe {
            gpu.cu((c.memcpy_htod_async)(s.dev_ptrs, s.host.cast(), HEADER, s.stream), "cuMemcpyHtoDAsync")?;
        }
        s.sync()?;
        Ok(s)
    }

    fn host_len(&self) -> usize {
        Self::a_len() + Self::b_len(&self.gpu)
    }

    /// The pinned host buffer, regions A and B.
    ///
    /// Only call while no copy on the stream uses it: after `sync`, or
    /// before the first `launch`.
    fn host_mut(&mut self) -> &mut [u8] {
        // SAFETY: `host` is a live pinned allocation of `host_len` bytes
        // owned by this slot; the borrow of `&mut self` is the only view of
        // it on the CPU, and the caller keeps the GPU's copies off it (above).
        unsafe { std::slice::from_raw_parts_mut(self.host, self.host_len()) }
    }

    /// As [`host_mut`](Self::host_mut), read-only.
    fn host(&self) -> &[u8] {
        // SAFETY: as in `host_mut`; shared borrows only read.
        unsafe { std::slice::from_raw_parts(self.host, self.host_len()) }
    }

    /// Queues one batch: copies `srcs` in, runs nvCOMP, copies the results
    /// out. `caps[i]` is item i's output room (decompression only). Every
    /// `srcs[i]` fits in `CHUNK`, and there are at most `SLOT_ITEMS`.
    pub(crate) fn launch<'a>(
        &mut self,
        dir: Dir,
        srcs: impl ExactSizeIterator<Item = &'a [u8]>,
        caps: impl Iterator<Item = usize>,
    ) -> Result<(), NvcompError> {
        let n = srcs.len();
        assert!((1..=SLOT_ITEMS).contains(&n), "a slot holds 1..={SLOT_ITEMS} items");
        self.gpu.make_current()?;
        self.n = n;
        self.dir = dir;
        // The previous batch's copies ended when it was synchronized.
        let a = self.host_mut();
        for (i, src) in srcs.enumerate() {
            assert!(src.len() <= CHUNK, "an item of {} bytes does not fit a chunk", src.len());
            a[i * 8..][..8].copy_from_slice(&(src.len() as u64).to_ne_bytes());
            a[HEADER + i * CHUNK..][..src.len()].copy_from_slice(src);
        }
        for (i, cap) in caps.take(n).enumerate() {
            a[(SLOT_ITEMS + i) * 8..][..8].copy_from_slice(&(cap.min(CHUNK) as u64).to_ne_bytes());
        }
        let host_a = self.host;
        let host_b = self.host.wrapping_add(Self::a_len());
        let g = &*self.gpu;
        let (c, nv) = (&g.cuda, &g.nv);
        let in_len = HEADER + n * CHUNK;
        let out_len = HEADER + n * g.stride;
        let sizes_a = self.dev_a;
        let caps_a = self.dev_a + (SLOT_ITEMS * 8) as u64;
        let sizes_b = self.dev_b;
        let status_b = self.dev_b + (SLOT_ITEMS * 8) as u64;
        let in_ptrs = self.dev_ptrs;
        let out_ptrs = self.dev_ptrs + (SLOT_ITEMS * 8) as u64;
        // SAFETY: the copy reads `in_len` bytes of region A's pinned host
        // mirror into the device region A, both at least that long. The host
        // bytes stay untouched until the stream is synchronized (`sync`,
        // `wait`): `launch` needs `&mut self` and every path from here to the
        // next `launch` synchronizes first.
        unsafe { g.cu((c.memcpy_htod_async)(self.dev_a, host_a.cast(), in_len, self.stream), "cuMemcpyHtoDAsync")? };
        let st = match dir {
            // SAFETY: every device address is inside this slot's allocations:
            // `n` pointers in each array, each chunk CHUNK (in) or `stride`
            // (out, nvCOMP's own bound) bytes; temp is the size nvCOMP asked
            // for `SLOT_ITEMS` chunks of CHUNK. All work is on this stream.
            Dir::Compress => unsafe {
                (nv.lz4_compress)(
                    in_ptrs,
                    sizes_a,
                    CHUNK,
                    n,
                    self.dev_temp,
                    g.temp_bytes,
                    out_ptrs,
                    sizes_b,
                    sys::LZ4_COMPRESS_OPTS,
                    status_b,
                    self.stream,
                )
            },
            // SAFETY: as above; each output room (`caps`) is at most CHUNK,
            // which is no more than `stride`.
            Dir::Decompress => unsafe {
                (nv.lz4_decompress)(
                    in_ptrs,
                    sizes_a,
                    caps_a,
                    sizes_b,
                    n,
                    self.dev_temp,
                    g.temp_bytes,
                    out_ptrs,
                    sys::LZ4_DECOMPRESS_OPTS,
                    status_b,
                    self.stream,
                )
            },
        };
        nv_check(
            st,
            if dir == Dir::Compress { "nvcompBatchedLZ4CompressAsync" } else { "nvcompBatchedLZ4DecompressAsync" },
        )?;
        // SAFETY: the device region B and its host mirror are both at least
        // `out_len` bytes; nothing reads the host side before `sync`.
        unsafe {
            g.cu((c.memcpy_dtoh_async)(host_b.cast(), self.dev_b, out_len, self.stream), "cuMemcpyDtoHAsync")?;
        }
        Ok(())
    }

    /// Whether the queued batch has finished (or failed). Never blocks.
    pub(crate) fn is_done(&self) -> bool {
        if self.gpu.make_current().is_err() {
            return true;
        }
        // SAFETY: the stream is live until drop.
        unsafe { (self.gpu.cuda.stream_query)(self.stream) != sys::CUDA_ERROR_NOT_READY }
    }

    /// Blocks until the queued batch has finished.
    pub(crate) fn sync(&self) -> Result<(), NvcompError> {
        self.gpu.make_current()?;
        // SAFETY: the stream is live until drop.
        self.gpu.cu(unsafe { (self.gpu.cuda.stream_synchronize)(self.stream) }, "cuStreamSynchronize")
    }

    /// Item i's nvCOMP status and output, after `sync`.
    pub(crate) fn output(&self, i: usize) -> (sys::NvStatus, &[u8]) {
        assert!(i < self.n);
        // Region B's header: SLOT_ITEMS sizes, then SLOT_ITEMS 4-byte statuses.
        let b = &self.host()[Self::a_len()..];
        let word = |off: usize| u64::from_ne_bytes(b[off..off + 8].try_into().expect("8 bytes"));
        let size = word(i * 8) as usize;
        let status = i32::from_ne_bytes(b[SLOT_ITEMS * 8 + i * 4..][..4].try_into().expect("4 bytes"));
        let room = match self.dir {
            Dir::Compress => self.gpu.stride,
            Dir::Decompress => CHUNK,
        };
        let len = if status == sys::NVCOMP_SUCCESS { size.min(room) } else { 0 };
        (status, &b[HEADER + i * self.gpu.stride..][..len])
    }

    pub(crate) fn len(&self) -> usize {
        self.n
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let g = &*self.gpu;
        let c = &g.cuda;
        if g.make_current().is_err() {
            return;
        }
        // Each handle below is zero or null (never made) or was made by this
        // slot, and is freed once. The stream is synchronized first so that
        // no copy or kernel still uses a buffer.
        if !self.stream.is_null() {
            // SAFETY: a live stream of this slot's.
            unsafe { (c.stream_synchronize)(self.stream) };
        }
        for p in [self.dev_a, self.dev_b, self.dev_ptrs, self.dev_temp] {
            if p != 0 {
                // SAFETY: a device allocation of this slot's, idle (above).
                unsafe { (c.mem_free)(p) };
            }
        }
        if !self.host.is_null() {
            // SAFETY: the pinned allocation of this slot's, idle (above).
            unsafe { (c.mem_free_host)(self.host.cast()) };
        }
        if !self.stream.is_null() {
            // SAFETY: a live stream of this slot's, synchronized above.
            unsafe { (c.stream_destroy)(self.stream) };
        }
    }
}
