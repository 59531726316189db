//! The `set*id` family and `setgroups`, for a program whose threads'
//! capabilities differ from zmem's.
//!
//! Credentials are a thread's, and glibc makes them the process's: its
//! `setresgid` (and the rest) signals every other thread to make the same
//! call, and aborts the process if any result differs from the caller's.
//! A single-threaded program may give its own thread capabilities that no
//! other thread has: `setpriv --reuid=U --regid=G` sets `PR_SET_KEEPCAPS`,
//! drops its uid, raises `CAP_SETGID` again with `capset`, then sets its
//! gids. Under `zmem run` the pager's threads lost every capability at the
//! uid drop, their `setresgid` failed with EPERM, and glibc aborted setpriv
//! (`zmem run -- setpriv … CMD`, a container's usual entrypoint).
//!
//! So where the caller's capabilities differ from a zmem thread's, the call
//! is made with no thread of zmem's in the process
//! (`modes::single_threaded`); the new pager's threads then start with the
//! caller's credentials. Otherwise it goes straight to glibc.
//!
//! `capset` changes the caller's thread alone, even in glibc. After one
//! that leaves zmem's threads with other capabilities, they are replaced by
//! threads made with the caller's: a root program that gave up its
//! capabilities left zmem's threads, in its address space, with all of
//! root's.

use std::ffi::{c_char, c_int, c_long, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{gid_t, size_t, uid_t};

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit sets, in two words.
const CAP_V3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: c_int,
}

#[repr(C)]
#[derive(Default, Clone, Copy, PartialEq, Eq)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Thread `tid`'s capability sets (0: the caller's), or `None`.
fn caps(tid: c_int) -> Option<[CapData; 2]> {
    let mut h = CapHeader { version: CAP_V3, pid: tid };
    let mut d = [CapData::default(); 2];
    // SAFETY: capget reads the header and writes two `CapData`s, the v3 layout.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut CapHeader, d.as_mut_ptr()) };
    (r == 0).then_some(d)
}

/// Whether a thread of zmem's has capabilities other than the caller's.
fn diverged() -> bool {
    let Some(mine) = caps(0) else { return false };
    // Listed by zmem itself, not read from `/proc/self/task`: a program
    // that changed its root has no `/proc`, and zmem's threads kept
    // their capabilities when it gave up its own.
    let mut zmem = [0; zmem_common::host::thread::LISTED];
    let n = zmem_common::host::thread::ours(&mut zmem);
    zmem[..n].iter().any(|&tid| caps(tid).is_some_and(|theirs| theirs != mine))
}

/// Makes the call `f`: with no thread of zmem's where their capabilities
/// differ from the caller's (see the module's doc).
fn change(f: impl FnOnce() -> c_int) -> c_int {
    if crate::init::has_zmem_threads() && crate::guard::guarded(diverged).unwrap_or(false) {
        crate::modes::single_threaded(f)
    } else {
        f()
    }
}

/// The C library's `name`, looked up once into `slot` (0 if it has none).
fn next(slot: &AtomicUsize, name: &CStr) -> usize {
    let mut f = slot.load(Ordering::Relaxed);
    if f == 0 {
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the
        // definition after the shim's.
        f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char) } as usize;
        slot.store(f, Ordering::Relaxed);
    }
    f
}

macro_rules! set_ids {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let name = CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()).expect("one NUL, last");
            let f = next(&NEXT, name);
            if f == 0 {
                crate::errno::set_errno(libc::ENOSYS);
                return -1;
            }
            // SAFETY: f is the C library's function of this name, of this type.
            let f: unsafe extern "C" fn($($ty),*) -> c_int = unsafe { std::mem::transmute(f) };
            // SAFETY: the caller's arguments, as the C library takes them.
            change(|| unsafe { f($($arg),*) })
        }
    )*};
}

set_ids! {
    setuid(uid: uid_t);
    setgid(gid: gid_t);
    seteuid(uid: uid_t);
    setegid(gid: gid_t);
    setreuid(r: uid_t, e: uid_t);
    setregid(r: gid_t, e: gid_t);
    setresuid(r: uid_t, e: uid_t, s: uid_t);
    setresgid(r: gid_t, e: gid_t, s: gid_t);
    setgroups(size: size_t, list: *const gid_t);
}

/// `capset`: the caller's own sets; then, where zmem's threads have other
/// ones, they are made again with the caller's (see the module's doc).
#[no_mangle]
pub unsafe extern "C" fn capset(header: *mut c_void, data: *const c_void) -> c_int {
    // SAFETY: the kernel's capset with the caller's arguments.
    let call = || unsafe { crate::errno::direct(libc::SYS_capset, [header as c_long, data as c_long, 0, 0, 0, 0]) };
    capabilities_set(call) as c_int
}

/// Makes `call`, a `capset` (glibc's, or through its `syscall`, as libcap
/// makes it), and then what [`capset`] says; `call` gives the kernel's
/// result (0 or -1).
pub(crate) fn capabilities_set(call: impl FnOnce() -> c_long) -> c_long {
    let r = call();
    if r == 0 && crate::init::has_zmem_threads() && crate::guard::guarded(diverged).unwrap_or(false) {
        crate::errno::keeping_errno(|| crate::modes::single_threaded(|| ()));
    }
    r
}
