//! `unshare` and `setns`: the namespace changes the kernel allows only a
//! process with one thread, made with zmem's threads out of the way
//! (`modes::single_threaded`).

use std::ffi::{c_int, c_long};

/// `unshare`: with `CLONE_NEWUSER` (or `CLONE_THREAD`, `CLONE_SIGHAND`,
/// `CLONE_VM`) the kernel wants a single-threaded process: zmem's threads
/// step out meanwhile (`modes::single_threaded`).
#[no_mangle]
pub unsafe extern "C" fn unshare(flags: c_int) -> c_int {
    // SAFETY: the kernel's unshare with the caller's argument.
    unsharing(flags, || unsafe { crate::errno::direct(libc::SYS_unshare, [flags as c_long, 0, 0, 0, 0, 0]) } as c_int)
}

/// Makes `call`, an `unshare(flags)` (glibc's, or through its `syscall`),
/// as [`unshare`] says.
pub(crate) fn unsharing<R>(flags: c_int, call: impl FnOnce() -> R) -> R {
    if flags & (libc::CLONE_NEWUSER | libc::CLONE_THREAD | libc::CLONE_SIGHAND | libc::CLONE_VM) != 0 {
        crate::modes::single_threaded(call)
    } else {
        call()
    }
}

/// `setns`: into a user namespace, a mount namespace (the kernel wants
/// the caller not to share its filesystem context, which threads do:
/// `nsenter -m` failed) or a time namespace (EUSERS with more than one
/// thread), named by `nstype` or by what `fd` is, as `unshare`.
#[no_mangle]
pub unsafe extern "C" fn setns(fd: c_int, nstype: c_int) -> c_int {
    // SAFETY: the kernel's setns with the caller's arguments.
    let call =
        || unsafe { crate::errno::direct(libc::SYS_setns, [fd as c_long, nstype as c_long, 0, 0, 0, 0]) } as c_int;
    entering_ns(fd, nstype, call)
}

/// Makes `call`, a `setns(fd, nstype)` (glibc's, or through its
/// `syscall`), as [`setns`] says.
pub(crate) fn entering_ns<R>(fd: c_int, nstype: c_int, call: impl FnOnce() -> R) -> R {
    /// `NS_GET_NSTYPE`, `_IO(0xb7, 0x3)`: what namespace `fd` is.
    const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
    /// `CLONE_NEWTIME`, which the libc crate lacks.
    const CLONE_NEWTIME: c_int = 0x80;
    let one_thread = libc::CLONE_NEWUSER | libc::CLONE_NEWNS | CLONE_NEWTIME;
    let kind = match nstype {
        // SAFETY: an ioctl that only reads what `fd` refers to; on any
        // other descriptor it fails.
        0 => unsafe { libc::ioctl(fd, NS_GET_NSTYPE) },
        t => t,
    };
    if kind > 0 && kind & one_thread != 0 {
        crate::modes::single_threaded(call)
    } else {
        call()
    }
}
