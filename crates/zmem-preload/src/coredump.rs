//! Core dumps with the evicted memory in them.
//!
//! The kernel writes a core dump after it has killed every other thread of
//! the process, zmem's handler among them, and it never waits for a
//! userfaultfd while dumping (`PF_DUMPCORE`): every page zmem had evicted
//! went into the dump as zeros. A crashing program's dump is what its
//! developer debugs, so zeros there are wrong data.
//!
//! So, where a dump may be written (`RLIMIT_CORE` above 0, or a
//! `core_pattern` that pipes to a program, which ignores the limit), the
//! shim takes the signals whose default action dumps core and which the
//! program left at `SIG_DFL` when its pager started. Its handler gives the
//! memory back first, as for `unshare` (`init::let_go`: every evicted folio
//! loaded back, the regions unregistered, zmem's threads joined), then puts
//! `SIG_DFL` back and sends the signal to its thread again, with the same
//! `siginfo` where the kernel allows it: the signal is delivered once the
//! handler returns and the kernel dumps, as it would have.
//!
//! To the program the disposition is still `SIG_DFL`: the shim's
//! `sigaction` and `signal` report `SIG_DFL` where the handler is, and
//! keep the handler where the program sets `SIG_DFL` (Python's
//! `faulthandler` puts back what it found before it raises the signal
//! again; many crash handlers call `signal(sig, SIG_DFL)` and `raise`). A runtime that
//! chains to the handler it found (HotSpot) so finds none to call, and
//! writes its own crash report as without zmem.
//!
//! Not covered: a crash in shim code or on one of zmem's threads (giving
//! the memory back could wait for a lock the crashed code holds), a dump
//! made by `gcore` or through `/proc/PID/mem` (the kernel's remote reads
//! never wait for a userfaultfd either: they fail with EIO on evicted
//! pages), and `sigvec`, `sigset` and `sysv_signal` (not interposed).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

/// The signals whose default action is a core dump (signal(7)), but
/// SIGTRAP, which debuggers use.
const DUMPING: [c_int; 9] = [
    libc::SIGQUIT,
    libc::SIGILL,
    libc::SIGABRT,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGSEGV,
    libc::SIGSYS,
    libc::SIGXCPU,
    libc::SIGXFSZ,
];

type SigactionFn = unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
type SignalFn = unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t;

extern "C" {
    /// glibc's own `sigaction` and `signal`, for calls made before
    /// [`resolve`] found the next ones in symbol order.
    fn __sigaction(sig: c_int, act: *const libc::sigaction, oact: *mut libc::sigaction) -> c_int;
    fn bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
}

/// The `sigaction` next after the shim's (glibc's, or another
/// interposer's); 0 until [`resolve`].
static NEXT: AtomicUsize = AtomicUsize::new(0);
/// The same for `signal`.
static NEXT_SIGNAL: AtomicUsize = AtomicUsize::new(0);
/// Which signals the handler was installed for (bit `sig`).
static OURS: AtomicUsize = AtomicUsize::new(0);
/// `core_pattern` pipes the dump to a program (`|...`).
static PIPE: AtomicBool = AtomicBool::new(false);
/// 0: memory not given back yet; 1: a thread is giving it back; 2: done.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Finds the next `sigaction`. At the shim's load, before the program runs.
pub(crate) fn resolve() {
    // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the next
    // definition after this library's.
    let f = unsafe { libc::dlsym(libc::RTLD_NEXT, c"sigaction".as_ptr()) } as usize;
    NEXT.store(f, Ordering::Relaxed);
    // SAFETY: as above.
    let f = unsafe { libc::dlsym(libc::RTLD_NEXT, c"signal".as_ptr()) } as usize;
    NEXT_SIGNAL.store(f, Ordering::Relaxed);
}

/// The next `signal`, called as is.
unsafe fn next_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    match NEXT_SIGNAL.load(Ordering::Relaxed) {
        // SAFETY: the caller's arguments, passed on.
        0 => unsafe { bsd_signal(sig, handler) },
        f => {
            // SAFETY: `f` is what dlsym found for `signal`, which has this
            // signature.
            let f: SignalFn = unsafe { std::mem::transmute::<usize, SignalFn>(f) };
            // SAFETY: the caller's arguments, passed on.
            unsafe { f(sig, handler) }
        }
    }
}

/// The next `sigaction`, called as is.
unsafe fn next_sigaction(sig: c_int, act: *const libc::sigaction, oact: *mut libc::sigaction) -> c_int {
    match NEXT.load(Ordering::Relaxed) {
        // SAFETY: the caller's arguments, passed on.
        0 => unsafe { __sigaction(sig, act, oact) },
        f => {
            // SAFETY: `f` is what dlsym found for `sigaction`, which has
            // this signature.
            let f: SigactionFn = unsafe { std::mem::transmute::<usize, SigactionFn>(f) };
            // SAFETY: the caller's arguments, passed on.
            unsafe { f(sig, act, oact) }
        }
    }
}

fn ours(sig: c_int) -> bool {
    (0..usize::BITS as c_int).contains(&sig) && OURS.load(Ordering::Relaxed) >> sig & 1 != 0
}

fn handler_addr() -> usize {
    on_fatal as extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) as usize
}

/// The action that installs the handler: on the thread's alternate stack
/// if it has one, with every signal blocked while it runs (no handler of
/// the program's runs while the memory is given back).
fn our_action() -> libc::sigaction {
    // SAFETY: a zeroed sigaction is a valid value, filled in below.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler_addr();
    act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
    // SAFETY: sigfillset writes the mask of our own struct.
    unsafe { libc::sigfillset(&mut act.sa_mask) };
    act
}

/// Whether a fatal signal now would write a dump.
fn may_dump() -> bool {
    // SAFETY: PR_GET_DUMPABLE takes no pointer.
    if unsafe { libc::prctl(libc::PR_GET_DUMPABLE) } <= 0 {
        return false;
    }
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given, which is ours.
    let limited = unsafe { libc::getrlimit(libc::RLIMIT_CORE, &mut lim) } == 0 && lim.rlim_cur == 0;
    !limited || PIPE.load(Ordering::Relaxed)
}

/// Installs the handler for each dumping signal the program left at
/// `SIG_DFL`, where a dump may be written. Once, when the first pager of
/// this program has started (a forked child inherits the handlers; an
/// exec'd program's shim installs them again).
pub(crate) fn install() {
    let pattern = std::fs::read("/proc/sys/kernel/core_pattern").unwrap_or_default();
    PIPE.store(pattern.first() == Some(&b'|'), Ordering::Relaxed);
    if !may_dump() {
        return;
    }
    for sig in DUMPING {
        // SAFETY: a zeroed sigaction is a valid "no handler" value; the
        // query writes into our own struct.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { next_sigaction(sig, std::ptr::null(), &mut old) } != 0 || old.sa_sigaction != libc::SIG_DFL {
            continue;
        }
        OURS.fetch_or(1 << sig, Ordering::Relaxed);
        // SAFETY: a valid action for a signal number in range.
        if unsafe { next_sigaction(sig, &our_action(), std::ptr::null_mut()) } != 0 {
            OURS.fetch_and(!(1 << sig), Ordering::Relaxed);
        }
    }
}

/// The handler: gives the memory back, then lets the signal's default
/// action (the dump) happen.
extern "C" fn on_fatal(sig: c_int, info: *mut libc::siginfo_t, _ctx: *mut c_void) {
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    // Not in shim code or on zmem's threads: the crashed code may hold a
    // lock that giving the memory back takes.
    if !crate::guard::in_zmem() && may_dump() {
        match STATE.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                crate::modes::give_back_for_dump();
                STATE.store(2, Ordering::Release);
            }
            // Another thread crashed too and gives it back: its dump
            // starts once it is done, and ends this thread with the rest.
            Err(_) => {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while STATE.load(Ordering::Acquire) != 2 && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }
    // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask.
    let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a valid action; no old one asked for.
    unsafe { next_sigaction(sig, &dfl, std::ptr::null_mut()) };
    // The signal stays blocked until this handler returns, then is
    // delivered with its default action. With its own siginfo (the faulting
    // address, for the dump's notes) where the kernel allows it: only to
    // the thread whose id is the process's.
    let (pid, tid) =
        (std::process::id() as libc::c_long, rustix::thread::gettid().as_raw_nonzero().get() as libc::c_long);
    // SAFETY: rt_tgsigqueueinfo reads the siginfo the kernel gave this
    // handler; tgkill takes no pointer.
    let queued = !info.is_null() && unsafe { libc::syscall(libc::SYS_rt_tgsigqueueinfo, pid, tid, sig, info) } == 0;
    if !queued {
        // SAFETY: as above.
        unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
    }
    crate::errno::set_errno(errno);
}

/// `sigaction(2)` as the program sees it: the shim's handler reads as
/// `SIG_DFL`, and `SIG_DFL` set for one of its signals keeps it.
#[no_mangle]
pub unsafe extern "C" fn sigaction(sig: c_int, act: *const libc::sigaction, oact: *mut libc::sigaction) -> c_int {
    let keep = our_action();
    // SAFETY: `act` is the caller's: null (checked first) or a valid
    // sigaction.
    let sets_default = !act.is_null() && unsafe { (*act).sa_sigaction } == libc::SIG_DFL;
    let act = if ours(sig) && sets_default && STATE.load(Ordering::Relaxed) == 0 { &keep } else { act };
    // SAFETY: the caller's pointers (or ours), passed on.
    let r = unsafe { next_sigaction(sig, act, oact) };
    // SAFETY: after a successful call `oact`, when not null, holds the old
    // action, the caller's struct.
    if r == 0 && !oact.is_null() && unsafe { (*oact).sa_sigaction } == handler_addr() {
        // SAFETY: a zeroed sigaction is SIG_DFL with no flags.
        let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above: the caller's struct, not null.
        unsafe { *oact = dfl };
    }
    r
}

/// `signal(3)` likewise: glibc's calls its own `sigaction`, not the
/// shim's. `signal(sig, SIG_DFL)` before `raise(sig)` is how many crash
/// handlers end (after printing a backtrace): it keeps the shim's handler,
/// so their dump holds the memory too.
#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    if ours(sig) && handler == libc::SIG_DFL && STATE.load(Ordering::Relaxed) == 0 {
        // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_flags = libc::SA_RESTART;
        // SAFETY: a zeroed sigaction to write the old action into.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: our own structs; `sigaction` above keeps the handler and
        // reports it as SIG_DFL.
        return match unsafe { sigaction(sig, &act, &mut old) } {
            0 => old.sa_sigaction,
            _ => libc::SIG_ERR,
        };
    }
    // SAFETY: the caller's arguments, passed on.
    let old = unsafe { next_signal(sig, handler) };
    if old == handler_addr() {
        libc::SIG_DFL
    } else {
        old
    }
}
