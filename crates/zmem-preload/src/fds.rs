//! `close`, `close_range` and `closefrom`: the program's, except on the
//! descriptors zmem keeps (`zmem_common::host::fds`: the pager's userfaultfd,
//! swap file and readers), which it never opened. A daemon's `closefrom(3)`
//! or Python's `os.closerange(3, N)` closed them under the pager, and
//! Python crashed at once; the numbers would then have gone to the
//! program's next files, which zmem would have written to.
//!
//! To the program a kept descriptor looks closed already: `close` on it
//! fails with EBADF, and the range calls close everything around it.

use std::ffi::{c_int, c_uint};

use zmem_common::host::fds;

use crate::errno::set_errno;

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    // Inside `closing`: zmem opens and closes its own descriptors only
    // between the program's closes, so a number it just opened is never
    // closed here before it is kept.
    fds::closing(|| {
        if fds::is_kept(fd) {
            set_errno(libc::EBADF);
            return -1;
        }
        // SAFETY: the kernel's close with the caller's argument.
        unsafe { libc::syscall(libc::SYS_close, fd) as c_int }
    })
}

/// `dup2` closes `new` first, as `close` does: it waits for zmem's
/// sections in the same way, so that it never lands between a zmem
/// thread's open and the move of what it opened off a standard stream's
/// number (`zmem_common::host::fds`). The program's own numbers are its own: a
/// kept descriptor is never among 0, 1 and 2.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: the kernel's dup2 with the caller's arguments.
    fds::closing(|| unsafe { libc::syscall(libc::SYS_dup2, old, new) as c_int })
}

/// As [`dup2`], with flags.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: the kernel's dup3 with the caller's arguments.
    fds::closing(|| unsafe { libc::syscall(libc::SYS_dup3, old, new, flags) as c_int })
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    let raw = |a: c_uint, b: c_uint| {
        // SAFETY: the kernel's close_range over part of the caller's range,
        // with the caller's flags.
        unsafe { libc::syscall(libc::SYS_close_range, a, b, flags as c_uint) as c_int }
    };
    if first > last {
        return raw(first, last);
    }
    // Written before `closing`: no fault on it while zmem's sections are
    // kept out.
    let mut kept = [0; fds::SLOTS];
    fds::closing(|| {
        let n = fds::kept(&mut kept);
        close_around(&kept[..n], first, last, raw)
    })
}

/// Closes `[first, last]` but `kept` (sorted) with `raw`.
fn close_around(kept: &[c_int], first: c_uint, last: c_uint, raw: impl Fn(c_uint, c_uint) -> c_int) -> c_int {
    let mut lo = u64::from(first);
    let hi = u64::from(last);
    for &fd in kept {
        let fd = fd as u64;
        if fd < lo || fd > hi {
            continue;
        }
        if fd > lo {
            let r = raw(lo as c_uint, (fd - 1) as c_uint);
            if r != 0 {
                return r;
            }
        }
        lo = fd + 1;
    }
    if lo <= hi {
        raw(lo as c_uint, hi as c_uint)
    } else {
        0
    }
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(lowfd: c_int) {
    // SAFETY: our close_range above, over [lowfd, the largest descriptor].
    let _ = unsafe { close_range(lowfd.max(0) as c_uint, c_uint::MAX, 0) };
}
