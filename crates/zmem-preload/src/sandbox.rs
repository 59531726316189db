//! seccomp: a program that puts itself under a filter leaves zmem first.
//!
//! A filter applies to the thread that installs it (with
//! `SECCOMP_FILTER_FLAG_TSYNC`, to every thread of the process, zmem's
//! too), and zmem cannot know which calls it allows. The shim makes calls
//! of its own on the program's threads: `unlink` of the stats file at the
//! exit, the userfaultfd ioctls of a new mapping, `madvise` and `mprotect`
//! at a partial munmap. OpenSSH's pre-authentication child kills the thread
//! that makes any call its filter does not list (`SECCOMP_RET_KILL`, which
//! kills the thread alone): the exit handler's `unlink` killed its only
//! thread, zmem's threads kept the process alive as a zombie with threads,
//! and the privileged monitor waited for it for good. Every `ssh` to a
//! server under `zmem run` hung after authentication. A TSYNC filter that
//! forbids `ioctl` would stop zmem's handler at its next `UFFDIO_COPY`,
//! and the program's next fault with it.
//!
//! So a call that installs a filter (`prctl(PR_SET_SECCOMP)`, or the
//! `seccomp` system call through glibc's `syscall`, which libseccomp
//! uses) first gives the memory back and stops zmem's threads
//! (`modes::sandboxed`, as `unshare` does), and removes the stats file. The
//! process then runs unmanaged, as do the children it forks; a program it
//! execs starts a shim of its own, under the filter (a filter that returns
//! an error, as container runtimes' do, turns that shim off). Should the
//! call fail, nothing was installed, and a new pager takes the memory back.
//! A call that cannot install anything (libseccomp's probes pass no
//! program) goes straight to the kernel.
//!
//! A shim that starts under a filter (a program exec'd in a sandbox) first
//! has a forked probe make zmem's calls ([`filter_kills_zmem`]), and stays
//! off where one of them kills; a filter that returns errors is left to
//! the pager, which copes or does not start.
//! A filter installed by a raw `syscall` instruction (Chromium's sandbox,
//! Go's runtime), which no library call sees, cannot be left first. Where
//! it refuses zmem's calls to serve a fault, or kills one of zmem's
//! threads, the program's next fault would wait for good: the process is
//! stopped loudly instead (`Inner::stop_if_filtered` in the pager, and
//! [`lost_pager_thread`] from the stats thread, within a second). A filter
//! that kills every thread making a call the stats thread makes too still
//! hangs.
//!
//! A program that changes its root (`chroot`, or `pivot_root` through
//! `syscall`) stays managed; the stats file, which zmem finds by its path,
//! goes first (`modes::leaving_root`).
//!
//! Whatever killed the program's last thread, zmem's threads must not keep
//! the process alive: the stats thread ends it as the kernel would have
//! ([`program_gone`], [`end_as_the_program_did`]).

use std::ffi::{c_int, c_long, c_ulong};

/// `seccomp(2)`'s operations that install something.
const SECCOMP_SET_MODE_STRICT: c_long = 0;
const SECCOMP_SET_MODE_FILTER: c_long = 1;
/// `prctl(PR_SET_SECCOMP, mode)`'s modes.
const PRCTL_MODE_STRICT: c_ulong = 1;
const PRCTL_MODE_FILTER: c_ulong = 2;

/// Whether `seccomp(op, flags, args)` may install a filter or strict mode:
/// strict mode takes no flags and no arguments, a filter takes a program.
fn installs(op: c_long, flags: c_long, args: c_long) -> bool {
    match op {
        SECCOMP_SET_MODE_STRICT => flags == 0 && args == 0,
        SECCOMP_SET_MODE_FILTER => args != 0,
        _ => false,
    }
}

/// `prctl`, which C declares variadic: the x86-64 argument registers are
/// the same for a fixed callee (as for `mremap`). Only `PR_SET_SECCOMP` is
/// looked at; the rest is the kernel's, as glibc passes it.
#[no_mangle]
pub unsafe extern "C" fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int {
    // SAFETY: the kernel's prctl with the caller's arguments.
    let call = || unsafe { libc::syscall(libc::SYS_prctl, option, a2, a3, a4, a5) } as c_int;
    let sets = option == libc::PR_SET_SECCOMP && (a2 == PRCTL_MODE_STRICT || (a2 == PRCTL_MODE_FILTER && a3 != 0));
    if sets {
        crate::modes::sandboxed(call, |&r| r != 0)
    } else {
        call()
    }
}

/// glibc's `syscall`, through which libseccomp installs its filters. Every
/// other call (the shim's own and the Rust runtime's too, which bind here)
/// is made as glibc makes it: the `syscall` instruction, and `-1` with
/// `errno` for a result in `[-4095, -1]`.
#[cfg(target_arch = "x86_64")]
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    // SAFETY: the caller's system call with the caller's arguments, as
    // glibc's `syscall` would make it.
    let call = || unsafe { crate::errno::raw(n, [a1, a2, a3, a4, a5, a6]) };
    match n {
        libc::SYS_seccomp if installs(a1, a2, a3) => crate::modes::sandboxed(call, |&r| r < 0),
        libc::SYS_chroot | libc::SYS_pivot_root => crate::modes::leaving_root(call, |&r| r < 0),
        // The same as glibc's own wrappers (`creds.rs`, `mmap.rs`): a
        // program may make these calls either way (libcap's syscaller
        // makes its calls through `syscall`).
        libc::SYS_capset => crate::creds::capabilities_set(call),
        libc::SYS_unshare => crate::ns::unsharing(a1 as c_int, call),
        libc::SYS_fork => crate::fork::raw_fork(0, call),
        libc::SYS_clone if a1 & libc::CLONE_VM as c_long == 0 => crate::fork::raw_fork(a1 as u64, call),
        libc::SYS_clone3 if a2 >= 8 => match clone3_flags(a1) {
            flags if flags & libc::CLONE_VM as u64 == 0 => crate::fork::raw_fork(flags, call),
            _ => call(),
        },
        libc::SYS_setns => crate::ns::entering_ns(a1 as c_int, a2 as c_int, call),
        _ => call(),
    }
}

/// The flags of `clone3`'s `struct clone_args` at `args` (its first
/// field), or `CLONE_VM` where they cannot be read: the call is then left
/// to the kernel, which answers a bad pointer with EFAULT. Read with
/// `process_vm_readv`, which fails where a plain read would fault.
fn clone3_flags(args: c_long) -> u64 {
    let mut flags = 0u64;
    let local = libc::iovec { iov_base: (&raw mut flags).cast(), iov_len: 8 };
    let remote = libc::iovec { iov_base: args as *mut std::ffi::c_void, iov_len: 8 };
    // SAFETY: writes 8 bytes into `flags`, ours; reads this process's
    // memory at `args`, or fails (EFAULT) where it is not mapped.
    let n = unsafe { libc::process_vm_readv(std::process::id() as libc::pid_t, &local, 1, &remote, 1, 0) };
    if n == 8 {
        flags
    } else {
        libc::CLONE_VM as u64
    }
}

/// `chroot`: a program that changes its root stays managed, and zmem
/// leaves nothing in the new root (`modes::leaving_root`). OpenSSH's
/// pre-authentication child chroots into `/run/sshd`, as do DNS, FTP and
/// mail servers' workers. zmem keeps no directory open across it: a
/// directory descriptor from outside is a way out of the new root
/// (`fchdir`), for the program and for whoever takes it over.
#[cfg(target_arch = "x86_64")]
#[no_mangle]
pub unsafe extern "C" fn chroot(path: *const std::ffi::c_char) -> c_int {
    // SAFETY: the kernel's chroot with the caller's path (a string, or
    // EFAULT); `raw`, not `libc::syscall`, which binds to ours above.
    let call = || unsafe { crate::errno::raw(libc::SYS_chroot, [path as c_long, 0, 0, 0, 0, 0]) } as c_int;
    crate::modes::leaving_root(call, |&r| r != 0)
}

/// Whether a seccomp filter this process started under (an exec inside a
/// sandbox: `bwrap --seccomp`, a systemd unit's `SystemCallFilter=`)
/// kills a call that zmem makes: the signal that killed a probe, if one
/// did. Such a filter's kill lands on the program: Python exec'd by
/// bubblewrap under a filter that kills at `userfaultfd` died of SIGSYS at
/// the shim's start, where it runs without zmem. A filter that returns an
/// error is no danger: the pager copes with the error, or does not start.
/// The probe is a forked child (no `atfork` handlers, no allocation) that
/// makes the calls: userfaultfd's, by the system call and by
/// `/dev/userfaultfd`, and a registration and a copy on a mapping of its
/// own, `madvise`, `mprotect`, a file's reads and writes, an eventfd,
/// `ppoll`, `futex`, CPU affinity, thread names, `io_uring_setup`,
/// `/proc/thread-self/maps`, and a thread (`probe_thread`). It cannot try
/// everything, so it is a check of the usual kills, not a proof. Not
/// covered: a filter that kills at a fork (and not at a thread) kills the
/// program at the probe's own `clone`.
pub(crate) fn filter_kills_zmem() -> Option<c_int> {
    let status =
        zmem_common::host::fds::read_to_string(zmem_common::host::fds::Wait::Yes, "/proc/thread-self/status".as_ref())
            .ok()?;
    let mode = status.lines().find_map(|l| l.strip_prefix("Seccomp:"))?.trim();
    if mode != "2" {
        return None;
    }
    // SAFETY: a fork (a new process, this memory copied) that reports to
    // no signal (exit signal 0: a program that ignores SIGCHLD still leaves
    // it to be waited for). The child runs `probe` alone and exits.
    let pid =
        unsafe { libc::syscall(libc::SYS_clone, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long, 0 as c_long) };
    if pid == 0 {
        probe();
        // SAFETY: ends the child; nothing of it is used after.
        unsafe { libc::_exit(0) }
    }
    if pid < 0 {
        return None;
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut st: c_int = 0;
    loop {
        // SAFETY: waits for the child made above; writes `st`, ours.
        let r = unsafe { libc::waitpid(pid as libc::pid_t, &mut st, libc::__WALL | libc::WNOHANG) };
        if r == pid as libc::pid_t {
            break;
        }
        if r < 0 || std::time::Instant::now() > deadline {
            // SAFETY: the child made above; a stuck probe decides nothing.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            // SAFETY: as above.
            unsafe { libc::waitpid(pid as libc::pid_t, &mut st, libc::__WALL) };
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    libc::WIFSIGNALED(st).then(|| libc::WTERMSIG(st))
}

/// The probe's calls (see [`filter_kills_zmem`]): their results do not
/// matter, only whether the filter lets the process live through them.
#[cfg(target_arch = "x86_64")]
fn probe() {
    use linux_raw_sys::ioctl as nr;
    const PAGE: c_long = zmem_common::PAGE_SIZE as c_long;
    let page = [0u8; PAGE as usize];
    let mut buf = [0u64; 16];
    // Taken afresh for each call, after the writes that fill it.
    let at = |buf: &mut [u64; 16]| buf.as_mut_ptr() as c_long;
    // SAFETY: made only in the forked, one-thread child, which exits after:
    // each call works on descriptors and a mapping of the child's own, and
    // on `page` and `buf`, on its stack, no larger than the kernel reads
    // or writes (at most 120 bytes into `buf`, one page from `page`).
    let call = |n: c_long, a: [c_long; 6]| unsafe { crate::errno::raw(n, a) };
    let cloexec = libc::O_CLOEXEC as c_long;
    let mut fd = call(libc::SYS_userfaultfd, [cloexec | libc::O_NONBLOCK as c_long, 0, 0, 0, 0, 0]);
    let dev = call(
        libc::SYS_openat,
        [libc::AT_FDCWD as c_long, c"/dev/userfaultfd".as_ptr() as c_long, libc::O_RDWR as c_long | cloexec, 0, 0, 0],
    );
    if dev >= 0 {
        let new = zmem_uffd::sys::USERFAULTFD_IOC_NEW as c_long;
        let other = call(libc::SYS_ioctl, [dev, new, cloexec, 0, 0, 0]);
        if fd < 0 {
            fd = other;
        }
    }
    // struct uffdio_api: api 0xAA, features, ioctls (out).
    buf[0] = 0xAA;
    call(libc::SYS_ioctl, [fd, nr::UFFDIO_API as c_long, at(&mut buf), 0, 0, 0]);
    let anon = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as c_long;
    let rw = (libc::PROT_READ | libc::PROT_WRITE) as c_long;
    let p = call(libc::SYS_mmap, [0, 4 * PAGE, rw, anon, -1, 0]);
    // struct uffdio_register: start, len, mode (MISSING), ioctls (out).
    buf[..4].copy_from_slice(&[p as u64, 4 * PAGE as u64, 1, 0]);
    call(libc::SYS_ioctl, [fd, nr::UFFDIO_REGISTER as c_long, at(&mut buf), 0, 0, 0]);
    // struct uffdio_copy: dst, src, len, mode, copy (out).
    buf[..5].copy_from_slice(&[p as u64, page.as_ptr() as u64, PAGE as u64, 0, 0]);
    call(libc::SYS_ioctl, [fd, nr::UFFDIO_COPY as c_long, at(&mut buf), 0, 0, 0]);
    call(libc::SYS_madvise, [p, PAGE, libc::MADV_DONTNEED as c_long, 0, 0, 0]);
    call(libc::SYS_mprotect, [p, PAGE, rw, 0, 0, 0]);
    let f = call(libc::SYS_memfd_create, [c"zmem-probe".as_ptr() as c_long, libc::MFD_CLOEXEC as c_long, 0, 0, 0, 0]);
    call(libc::SYS_pwrite64, [f, page.as_ptr() as c_long, PAGE, 0, 0, 0]);
    call(libc::SYS_pread64, [f, at(&mut buf), 64, 0, 0, 0]);
    call(libc::SYS_fallocate, [f, 0, 0, PAGE, 0, 0]);
    let e = call(libc::SYS_eventfd2, [0, (libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) as c_long, 0, 0, 0, 0]);
    // A pollfd (fd, events POLLIN) in buf[0], a zero timespec in buf[2..4].
    buf[..4].copy_from_slice(&[e as u32 as u64 | (libc::POLLIN as u64) << 32, 0, 0, 0]);
    call(libc::SYS_ppoll, [at(&mut buf), 1, at(&mut buf) + 16, 0, 8, 0]);
    call(libc::SYS_futex, [at(&mut buf), (libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG) as c_long, 1, 0, 0, 0]);
    // This thread's CPU mask (128 bytes), set again as it is.
    if call(libc::SYS_sched_getaffinity, [0, 128, at(&mut buf), 0, 0, 0]) > 0 {
        call(libc::SYS_sched_setaffinity, [0, 128, at(&mut buf), 0, 0, 0]);
    }
    call(libc::SYS_prctl, [libc::PR_SET_NAME as c_long, c"zmem-probe".as_ptr() as c_long, 0, 0, 0, 0]);
    // struct io_uring_params, 120 bytes, zeroed.
    buf.fill(0);
    call(libc::SYS_io_uring_setup, [1, at(&mut buf), 0, 0, 0, 0]);
    let maps = call(
        libc::SYS_openat,
        [libc::AT_FDCWD as c_long, c"/proc/thread-self/maps".as_ptr() as c_long, cloexec, 0, 0, 0],
    );
    call(libc::SYS_read, [maps, at(&mut buf), 64, 0, 0, 0]);
    probe_thread();
}

/// A thread made and ended at once, as `pthread_create` makes the pager's:
/// `clone3` first, and `clone` with glibc's flags where that is `ENOSYS`
/// (container runtimes' filters answer `clone3` so, as they cannot look
/// at its flags). A filter that kills at `clone` for threads alone (its
/// flags include `CLONE_THREAD`) let the probe's fork by, and then killed
/// the program at the pager's start: Python exec'd by bubblewrap under
/// one died of SIGSYS, where it runs without zmem.
#[cfg(target_arch = "x86_64")]
fn probe_thread() {
    use std::sync::atomic::{AtomicU32, Ordering};
    // CLONE_VM | FS | FILES | SIGHAND | THREAD | SYSVSEM | SETTLS |
    // PARENT_SETTID | CHILD_CLEARTID, as glibc's `pthread_create`.
    const FLAGS: u64 = 0x3d_0f00;
    const ENOSYS: c_long = -(libc::ENOSYS as c_long);
    let mut stack = [0u64; 64];
    let (parent_tid, child_tid) = (AtomicU32::new(0), AtomicU32::new(1));
    let (ptid, ctid) = (parent_tid.as_ptr() as u64, child_tid.as_ptr() as u64);
    let (base, size) = (stack.as_mut_ptr() as u64, std::mem::size_of_val(&stack) as u64);
    // struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal,
    // stack, stack_size, tls (none: the thread reads no thread-local).
    let args: [u64; 8] = [FLAGS, 0, ctid, ptid, 0, base, size, 0];
    // SAFETY: the new thread runs `clone_exit`'s own instructions only and
    // ends; the parent's stack, `stack` (the thread's, never written) and
    // the two words the kernel writes (`parent_tid`, `child_tid`) outlive
    // it, as this waits for `child_tid`'s clearing below.
    let mut r =
        unsafe { clone_exit(libc::SYS_clone3, [&args as *const _ as c_long, size_of_val(&args) as c_long, 0, 0, 0]) };
    if r == ENOSYS {
        let top = (base + size) as c_long;
        // SAFETY: as above; `clone`'s arguments are flags, the stack's top,
        // parent_tid, child_tid, tls.
        r = unsafe { clone_exit(libc::SYS_clone, [FLAGS as c_long, top, ptid as c_long, ctid as c_long, 0]) };
    }
    if r <= 0 {
        return;
    }
    // The kernel clears `child_tid` as the thread ends (CHILD_CLEARTID):
    // until then it may still write it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    while child_tid.load(Ordering::Acquire) != 0 && std::time::Instant::now() < deadline {
        std::hint::spin_loop();
    }
}

/// The system call `n`, a `clone` or `clone3` that makes a thread: the new
/// thread ends at once (`exit`), touching no memory; the caller gets the
/// result (the thread's id, or `-errno`).
///
/// # Safety
/// `a` must make a thread that shares this memory, or fail.
#[cfg(target_arch = "x86_64")]
unsafe fn clone_exit(n: c_long, a: [c_long; 5]) -> c_long {
    let r: c_long;
    // SAFETY: the kernel's calling convention, as in `raw`. In the new
    // thread rax is 0: it makes `exit(0)` at once (which ends that thread
    // alone) and never comes back to Rust; rdi is changed only there.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "mov eax, 60",
            "xor edi, edi",
            "syscall",
            "ud2",
            "2:",
            inlateout("rax") n => r,
            in("rdi") a[0],
            in("rsi") a[1],
            in("rdx") a[2],
            in("r10") a[3],
            in("r8") a[4],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    r
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() {}

/// The wait status the program left, where only zmem's threads keep this
/// process alive: the main thread is a zombie and no other thread but
/// zmem's is left. A thread that a filter killed alone (`SECCOMP_RET_KILL`
/// is `SECCOMP_RET_KILL_THREAD`) ends a process of one thread; zmem's
/// threads would keep it, a zombie with threads, and its parent would wait
/// for good. The same holds when the program's last thread ends by
/// `pthread_exit`. As the kernel reports the main thread's status at the
/// end (field 52 of `/proc/self/stat`), that is what is returned.
pub(crate) fn program_gone() -> Option<u32> {
    let me = std::process::id();
    let stat = crate::tasks::self_stat()?;
    if zmem_common::procfs::stat_field(&stat, 3) != Some("Z") {
        return None;
    }
    // The main thread is the zombie, its tid the pid.
    if crate::tasks::others_than_zmem(me as i32) {
        return None;
    }
    zmem_common::procfs::stat_field(&stat, 52)?.parse().ok()
}

/// Ends this process with the wait status `status` that its program left
/// ([`program_gone`]): killed by the same signal (its default action, on
/// this thread), or exited with the same code.
pub(crate) fn end_as_the_program_did(status: u32) -> ! {
    let signal = (status & 0x7f) as c_int;
    let code = ((status >> 8) & 0xff) as c_int;
    if signal != 0 {
        log::warn!(
            "the program's last thread was killed by signal {signal}{}, and only zmem's threads were left: \
             the process ends as it would have without them",
            if signal == libc::SIGSYS { " (a seccomp filter)" } else { "" }
        );
        // SAFETY: the default action for one signal; no handler of ours
        // is involved.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
        // SAFETY: sigset_t is plain data, valid zeroed (an empty set).
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: adds a signal to a set of ours.
        unsafe { libc::sigaddset(&mut set, signal) };
        // SAFETY: unblocks that signal on this thread only; the set is ours.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
        let tid = rustix::thread::gettid().as_raw_nonzero().get();
        // SAFETY: a signal to this thread; its default action ends the
        // process (the signal ended a thread already).
        unsafe { libc::syscall(libc::SYS_tgkill, std::process::id(), tid, signal) };
        // SAFETY: _exit ends the process; nothing of it is used after.
        unsafe { libc::_exit(128 + signal) }
    }
    // The program's own way out (`pthread_exit` from `main`, then from
    // its last thread), not news.
    log::info!(
        "the program's threads have all ended (exit status {code}), and only zmem's were left: the process ends"
    );
    // SAFETY: as above.
    unsafe { libc::_exit(code) }
}

/// A pager thread of this process was killed (`Pager::lost_thread`): by a
/// seccomp filter installed with a raw system call, which the shim never
/// saw, and which kills the thread that makes one of zmem's calls. The
/// memory it served can no longer be given back, and the program's next
/// fault there would wait for good: the process is stopped loudly instead,
/// as after a panic of a pager thread.
pub(crate) fn lost_pager_thread(name: &str) -> ! {
    log::error!(
        "the pager's {name} thread was killed (a seccomp filter installed without a call the shim sees, \
         a raw system call, kills one of zmem's calls?): the program's memory zmem holds can no longer \
         be given back to it; aborting"
    );
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_call_that_can_install_something_is_the_sandbox_s() {
        assert!(installs(SECCOMP_SET_MODE_FILTER, 0, 0x1000));
        assert!(installs(SECCOMP_SET_MODE_FILTER, 1, 0x1000), "TSYNC");
        assert!(installs(SECCOMP_SET_MODE_STRICT, 0, 0));
        // libseccomp's probes: a filter without a program (EFAULT), strict
        // mode with flags (EINVAL).
        assert!(!installs(SECCOMP_SET_MODE_FILTER, 0, 0));
        assert!(!installs(SECCOMP_SET_MODE_FILTER, 8, 0));
        assert!(!installs(SECCOMP_SET_MODE_STRICT, 1, 0));
        assert!(!installs(2, 0, 0x1000), "SECCOMP_GET_ACTION_AVAIL");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_syscall_wrapper_returns_as_glibc_does() {
        // SAFETY: getpid takes no arguments.
        assert_eq!(unsafe { crate::errno::raw(libc::SYS_getpid, [0; 6]) }, std::process::id() as c_long);
        // SAFETY: close of a descriptor that is not open.
        assert_eq!(unsafe { crate::errno::raw(libc::SYS_close, [-1, 0, 0, 0, 0, 0]) }, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EBADF));
    }
}
