//! The program's `errno` around the shim's own calls, and system calls
//! made as glibc's `syscall` makes them (`-1` and `errno`): a leaf, which
//! every interposer may use.

use std::ffi::{c_int, c_long};

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

/// The system call `n`, as glibc's `syscall` makes it: `-1` with `errno`
/// for a result in `[-4095, -1]`. The shim's wrappers make theirs here,
/// not through `libc::syscall`, which binds to the shim's `syscall` above
/// (and would take them through what it looks at a second time).
///
/// # Safety
/// What the call does with its arguments is the caller's to answer for.
pub(crate) unsafe fn direct(n: c_long, a: [c_long; 6]) -> c_long {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's contract.
        unsafe { raw(n, a) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: the caller's contract.
        unsafe { libc::syscall(n, a[0], a[1], a[2], a[3], a[4], a[5]) }
    }
}

/// The system call `n`.
///
/// # Safety
/// What the call does with its arguments is the caller's to answer for.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn raw(n: c_long, a: [c_long; 6]) -> c_long {
    let r: c_long;
    // SAFETY: the kernel's x86-64 calling convention: the number in rax,
    // the arguments in rdi, rsi, rdx, r10, r8 and r9, the result in rax;
    // rcx and r11 are overwritten. No stack is used. What the call touches
    // is the caller's contract.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") n => r,
            in("rdi") a[0],
            in("rsi") a[1],
            in("rdx") a[2],
            in("r10") a[3],
            in("r8") a[4],
            in("r9") a[5],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if (-4095..0).contains(&r) {
        set_errno(-r as c_int);
        return -1;
    }
    r
}
