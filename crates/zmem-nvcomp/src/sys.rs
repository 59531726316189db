//! The two libraries, opened with `dlopen` when a device is first asked for:
//! the CUDA driver (`libcuda.so.1`, installed with the NVIDIA driver) and
//! nvCOMP (`libnvcomp.so.6`, which carries its own CUDA runtime). Nothing is
//! linked at build time, so zmem builds and runs on machines without either.
//!
//! Device addresses are passed as [`DevPtr`] (`u64`) where the C prototypes
//! say `void *`: on x86-64 and aarch64 both are one 64-bit integer register.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

/// A device address (`CUdeviceptr`).
pub(crate) type DevPtr = u64;
/// `CUstream`, which is also the runtime API's `cudaStream_t`.
pub(crate) type Stream = *mut c_void;
/// `CUresult`.
pub(crate) type CuResult = c_int;
/// `nvcompStatus_t`.
pub(crate) type NvStatus = c_int;

pub(crate) const CUDA_SUCCESS: CuResult = 0;
pub(crate) const CUDA_ERROR_NOT_READY: CuResult = 600;
/// `CU_STREAM_NON_BLOCKING`: no implicit ordering against the legacy stream.
pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 1;

pub(crate) const NVCOMP_SUCCESS: NvStatus = 0;
pub(crate) const NVCOMP_ERROR_OUTPUT_BUFFER_TOO_SMALL: NvStatus = 15;

/// `nvcompBatchedLZ4CompressOpts_t` (nvCOMP 6): plain bytes, no bitshuffle.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Lz4CompressOpts {
    pub data_type: c_int,
    pub bitshuffle_mode: c_int,
    pub reserved: [u8; 56],
}

/// `nvcompBatchedLZ4DecompressOpts_t` (nvCOMP 6).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Lz4DecompressOpts {
    pub backend: c_int,
    pub sort_before_hw_decompress: c_int,
    pub data_type: c_int,
    pub bitshuffle_mode: c_int,
    pub reserved: [u8; 48],
}

/// `nvcompBatchedLZ4CompressDefaultOpts`: `NVCOMP_TYPE_CHAR`, no bitshuffle.
pub(crate) const LZ4_COMPRESS_OPTS: Lz4CompressOpts =
    Lz4CompressOpts { data_type: 0, bitshuffle_mode: 0, reserved: [0; 56] };
/// `nvcompBatchedLZ4DecompressDefaultOpts`: the default backend.
pub(crate) const LZ4_DECOMPRESS_OPTS: Lz4DecompressOpts =
    Lz4DecompressOpts { backend: 0, sort_before_hw_decompress: 0, data_type: 0, bitshuffle_mode: 0, reserved: [0; 48] };

/// `nvcompProperties_t`.
#[repr(C)]
#[derive(Default)]
pub(crate) struct NvProperties {
    pub version: u32,
    pub cudart_version: u32,
}

/// A library opened with `dlopen`. It is never closed: the CUDA runtime
/// inside nvCOMP keeps threads and state that do not survive an unload.
pub(crate) struct Lib {
    handle: *mut c_void,
    name: String,
}

impl Lib {
    pub(crate) fn open(name: &str) -> Result<Lib, String> {
        let c = CString::new(name).map_err(|_| format!("{name:?} holds a NUL byte"))?;
        // SAFETY: `c` is a NUL-terminated string that outlives the call;
        // dlopen has no other precondition.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dlerror());
        }
        Ok(Lib { handle, name: name.to_string() })
    }

    /// The address of `sym`, never null.
    fn sym(&self, sym: &CStr) -> Result<*mut c_void, String> {
        // SAFETY: `handle` came from a successful dlopen and is never closed;
        // `sym` is NUL-terminated.
        let p = unsafe { libc::dlsym(self.handle, sym.as_ptr()) };
        if p.is_null() {
            return Err(format!("{} has no symbol {}: {}", self.name, sym.to_string_lossy(), dlerror()));
        }
        Ok(p)
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror takes no arguments; it returns null or a NUL-terminated
    // string that stays valid until the next dl* call on this thread, and it
    // is copied out at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        return "unknown dlopen error".to_string();
    }
    // SAFETY: non-null, NUL-terminated, see above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A table of C functions, each looked up by name in one library.
macro_rules! fn_table {
    ($(#[$m:meta])* $table:ident { $($field:ident = $sym:literal: fn($($arg:ty),* $(,)?) -> $ret:ty;)* }) => {
        $(#[$m])*
        #[allow(non_snake_case)]
        pub(crate) struct $table {
            _lib: Lib,
            $(pub(crate) $field: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl $table {
            pub(crate) fn load(lib: Lib) -> Result<Self, String> {
                Ok($table {
                    $($field: {
                        let p = lib.sym($sym)?;
                        // SAFETY: `p` is the non-null address of the exported
                        // C function `$sym`, whose prototype in the vendor's
                        // header is the signature written here.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> $ret>(p) }
                    },)*
                    _lib: lib,
                })
            }
        }
    };
}

fn_table! {
    /// The CUDA driver API calls zmem makes.
    Cuda {
        init = c"cuInit": fn(c_uint) -> CuResult;
        device_get_count = c"cuDeviceGetCount": fn(*mut c_int) -> CuResult;
        device_get = c"cuDeviceGet": fn(*mut c_int, c_int) -> CuResult;
        device_get_name = c"cuDeviceGetName": fn(*mut c_char, c_int, c_int) -> CuResult;
        primary_ctx_retain = c"cuDevicePrimaryCtxRetain": fn(*mut *mut c_void, c_int) -> CuResult;
        primary_ctx_release = c"cuDevicePrimaryCtxRelease_v2": fn(c_int) -> CuResult;
        ctx_set_current = c"cuCtxSetCurrent": fn(*mut c_void) -> CuResult;
        mem_alloc = c"cuMemAlloc_v2": fn(*mut DevPtr, usize) -> CuResult;
        mem_free = c"cuMemFree_v2": fn(DevPtr) -> CuResult;
        mem_alloc_host = c"cuMemAllocHost_v2": fn(*mut *mut c_void, usize) -> CuResult;
        mem_free_host = c"cuMemFreeHost": fn(*mut c_void) -> CuResult;
        memcpy_htod_async = c"cuMemcpyHtoDAsync_v2": fn(DevPtr, *const c_void, usize, Stream) -> CuResult;
        memcpy_dtoh_async = c"cuMemcpyDtoHAsync_v2": fn(*mut c_void, DevPtr, usize, Stream) -> CuResult;
        stream_create = c"cuStreamCreate": fn(*mut Stream, c_uint) -> CuResult;
        stream_destroy = c"cuStreamDestroy_v2": fn(Stream) -> CuResult;
        stream_synchronize = c"cuStreamSynchronize": fn(Stream) -> CuResult;
        stream_query = c"cuStreamQuery": fn(Stream) -> CuResult;
        get_error_string = c"cuGetErrorString": fn(CuResult, *mut *const c_char) -> CuResult;
    }
}

fn_table! {
    /// nvCOMP 6's batched LZ4 (`nvcomp/lz4.h`).
    Nvcomp {
        get_properties = c"nvcompGetProperties": fn(*mut NvProperties) -> NvStatus;
        lz4_compress_temp_size = c"nvcompBatchedLZ4CompressGetTempSize":
            fn(usize, usize, Lz4CompressOpts, *mut usize, usize, Stream) -> NvStatus;
        lz4_compress_max_output = c"nvcompBatchedLZ4CompressGetMaxOutputChunkSize":
            fn(usize, Lz4CompressOpts, *mut usize) -> NvStatus;
        // (uncompressed ptrs, uncompressed bytes, max uncompressed chunk, chunks,
        //  temp, temp bytes, compressed ptrs, compressed bytes, opts, statuses, stream)
        lz4_compress = c"nvcompBatchedLZ4CompressAsync":
            fn(DevPtr, DevPtr, usize, usize, DevPtr, usize, DevPtr, DevPtr, Lz4CompressOpts, DevPtr, Stream) -> NvStatus;
        lz4_decompress_temp_size = c"nvcompBatchedLZ4DecompressGetTempSize":
            fn(usize, usize, Lz4DecompressOpts, *mut usize, usize, Stream) -> NvStatus;
        // (compressed ptrs, compressed bytes, output buffer bytes, output bytes,
        //  chunks, temp, temp bytes, output ptrs, opts, statuses, stream)
        lz4_decompress = c"nvcompBatchedLZ4DecompressAsync":
            fn(DevPtr, DevPtr, DevPtr, DevPtr, usize, DevPtr, usize, DevPtr, Lz4DecompressOpts, DevPtr, Stream) -> NvStatus;
    }
}

// SAFETY: the tables hold function pointers and a dlopen handle that is never
// closed; the CUDA driver API and nvCOMP's host functions may be called from
// any thread.
unsafe impl Send for Cuda {}
// SAFETY: as for Send; nothing in a table is mutated after `load`.
unsafe impl Sync for Cuda {}
// SAFETY: as for `Cuda`.
unsafe impl Send for Nvcomp {}
// SAFETY: as for `Cuda`.
unsafe impl Sync for Nvcomp {}
