//! The program's `errno` around the shim's own calls: a leaf, which every
//! interposer may use.

use std::ffi::c_int;

/// Runs `f`, the shim's own work after a call of the program's, and gives
/// the program's thread back the `errno` that call left: starting a pager
/// makes calls of its own, and the program reads `errno` after ours (Python
/// read `EAGAIN` after an `unshare` that succeeded; a failed one would have
/// reported the wrong error).
pub(crate) fn keeping_errno(f: impl FnOnce()) {
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    f();
    set_errno(e);
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location has no preconditions.
    let slot = unsafe { libc::__errno_location() };
    // SAFETY: it returns this thread's errno slot, valid and aligned.
    unsafe { *slot = e };
}
