//! The C API of `include/zmem.h`.

use std::ffi::{c_int, c_void};

use crate::errno::set_errno;
use crate::guard::guarded;
use crate::init::{managed_alloc, shim};
use crate::state::{lookup, managed_free};
use crate::stats::stats_json;

/// A program that calls the API asks for a pager: one that waits to start
/// (`waiting.rs`) starts now, on this thread, which holds no lock of an
/// allocator's.
fn start_if_waiting() {
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    guarded(crate::waiting::start_now);
    set_errno(e);
}

/// `zmem_map(len)`: managed memory of `len` bytes (any size), or NULL with
/// errno set.
#[no_mangle]
pub unsafe extern "C" fn zmem_map(len: usize) -> *mut c_void {
    if len == 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    start_if_waiting();
    managed_alloc(len).unwrap_or_else(|| {
        set_errno(libc::ENOMEM);
        std::ptr::null_mut()
    })
}

/// `zmem_unmap(p)`: frees memory from `zmem_map`. Returns 0, or -1 (EINVAL)
/// for a pointer zmem did not hand out.
#[no_mangle]
pub unsafe extern "C" fn zmem_unmap(p: *mut c_void) -> c_int {
    match lookup(p as usize) {
        Some((start, _, _)) if start == p as usize => {
            managed_free(start);
            0
        }
        _ => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

/// `zmem_is_managed(p)`: 1 if `p` points into managed memory.
#[no_mangle]
pub unsafe extern "C" fn zmem_is_managed(p: *const c_void) -> c_int {
    c_int::from(lookup(p as usize).is_some())
}

/// `zmem_stats_json(buf, len)`: this process's stats as JSON, NUL-terminated
/// and truncated to `len`. Returns the full length (as snprintf does), or -1
/// when the shim is off.
#[no_mangle]
pub unsafe extern "C" fn zmem_stats_json(buf: *mut u8, len: usize) -> isize {
    start_if_waiting();
    let Some(s) = shim() else { return -1 };
    let Some(json) = guarded(|| stats_json(s)) else { return -1 };
    if !buf.is_null() && len > 0 {
        let n = json.len().min(len - 1);
        // SAFETY: the caller gives len writable bytes at buf.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf, n);
        }
        // SAFETY: n < len, inside the caller's buffer.
        let end = unsafe { buf.add(n) };
        // SAFETY: as above: a writable byte of the caller's buffer.
        unsafe { *end = 0 };
    }
    json.len() as isize
}
