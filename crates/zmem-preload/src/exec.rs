//! exec with an environment of the program's making: the shim and the
//! tree's settings go with it.
//!
//! `zmem run` puts the shim in `LD_PRELOAD` and the tree's settings
//! (`ZMEM_TREE`, `ZMEM_LIMIT`, ...) in the environment, and a child
//! inherits both. A program that starts a child with an environment it
//! made itself dropped them, and the child ran outside the limit: Python's
//! `subprocess.run(..., env={"PATH": ...})` took 214 MiB under a 64M
//! limit, as did `env -i` and `env LD_PRELOAD=libtcmalloc.so.4`. A process
//! in a memory cgroup cannot leave it that way.
//!
//! So the exec family is interposed where a program can reach it:
//! `execve`, `execveat`, `fexecve`, `execv`, `execvp`, `execvpe`,
//! `posix_spawn` and `posix_spawnp`. The new environment gets the shim at
//! the head of `LD_PRELOAD` (before what the program put there, as `zmem
//! run` does) and each `ZMEM_*` variable this process started with that it
//! lacks; what the program set itself is kept. `ZMEM_DISABLE=1` in the new
//! environment is the program's way out: then nothing changes.
//!
//! Where a userfaultfd made here now would serve faults from user mode
//! only ([`user_mode_only_here`], asked at each exec: a program may have
//! dropped its privileges since it started, as `runuser` does before it
//! runs a server), the new environment also gets `glibc.pthread.rseq=0` in
//! `GLIBC_TUNABLES`, unless it says something of rseq itself. The kernel
//! writes a thread's rseq area (in its TLS, at the top of its stack) on
//! every return to user space, and under user mode only that write to an
//! evicted page is a SIGSEGV (`zmem run` sets the same for itself, see its
//! `tunables_for_user_mode_only`).
//!
//! Not covered: `execl`, `execle` and `execlp` are C-variadic (Rust cannot
//! define them), and glibc's `system`, `popen` and `execl*` call its
//! internal `__execve`. All but `execle` pass the program's own `environ`,
//! which still holds the shim unless the program removed it from there.
//!
//! The child side of `vfork` (CPython's `_posixsubprocess` uses it) calls
//! `execve` on memory it shares with its parent, whose other threads run
//! on: nothing here allocates, takes a lock or touches a lazily set
//! thread-local. The new environment is built on the stack (or, past
//! [`STACK_VARS`] variables or [`STACK_BYTES`] of new values, in a
//! mapping made with the raw system call, never freed if the exec
//! succeeds); what it adds was prepared when the library was loaded
//! ([`prepare`]).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

extern "C" {
    static environ: *const *const c_char;
}

/// What [`prepare`] found: the shim's path and the variables to carry, and
/// the C library's own functions that the wrappers call on to.
struct Carry {
    /// The shim's path, as the dynamic loader loaded it; empty where
    /// nothing is carried (the shim is disabled here).
    shim: CString,
    /// `LD_PRELOAD=` and the shim's path.
    preload: CString,
    /// Every `ZMEM_*=...` of the environment this process started with.
    vars: Vec<CString>,
    /// The next `execvpe`, `posix_spawn` and `posix_spawnp` (0: none).
    execvpe: usize,
    posix_spawn: usize,
    posix_spawnp: usize,
    /// The next `system` and `popen`.
    system: usize,
    popen: usize,
}

static CARRY: OnceLock<Carry> = OnceLock::new();

/// Pointers the new environment may have on the stack (it needs one more
/// than its variables).
const STACK_VARS: usize = 512;
/// Bytes of new values (`LD_PRELOAD=...`, `GLIBC_TUNABLES=...`) the stack
/// holds.
const STACK_BYTES: usize = 4096;

/// Prepares the wrappers: called as the library is loaded, guarded (so
/// `dlsym`'s allocations go to zmem's heap). Nothing is carried where the
/// shim is disabled in this process's own environment.
pub(crate) fn prepare() {
    CARRY.get_or_init(|| {
        let sym = |name: &CStr| {
            // SAFETY: a symbol lookup by a NUL-terminated name.
            unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize }
        };
        let execvpe = sym(c"execvpe");
        let posix_spawn = sym(c"posix_spawn");
        let posix_spawnp = sym(c"posix_spawnp");
        let (system, popen) = (sym(c"system"), sym(c"popen"));
        let mut info = libc::Dl_info {
            dli_fname: std::ptr::null(),
            dli_fbase: std::ptr::null_mut(),
            dli_sname: std::ptr::null(),
            dli_saddr: std::ptr::null_mut(),
        };
        // SAFETY: dladdr fills `info` for an address inside this library
        // (this function's).
        let found = unsafe { libc::dladdr(prepare as *const () as *const c_void, &mut info) } != 0;
        let shim = (found && !info.dli_fname.is_null()).then(|| {
            // SAFETY: dli_fname points at the loader's copy of the
            // library's path, NUL-terminated and alive while the library
            // is loaded (for good).
            unsafe { CStr::from_ptr(info.dli_fname) }.to_owned()
        });
        let vars: Vec<CString> = std::env::vars_os()
            .filter(|(k, _)| k.as_encoded_bytes().starts_with(b"ZMEM_"))
            .filter_map(|(k, v)| {
                let mut s = k.into_encoded_bytes();
                s.push(b'=');
                s.extend_from_slice(v.as_encoded_bytes());
                CString::new(s).ok()
            })
            .collect();
        // Disabled: nothing carried (an empty `shim`), but the C library's
        // functions are still what the wrappers call.
        let disabled = zmem_settings::Settings::from_env().is_ok_and(|s| s.disable);
        let shim = shim.filter(|_| !disabled).unwrap_or_default();
        let mut preload = b"LD_PRELOAD=".to_vec();
        preload.extend_from_slice(shim.as_bytes());
        let vars = if shim.is_empty() { Vec::new() } else { vars };
        // No NUL inside: `shim` came from a C string.
        Carry {
            preload: CString::new(preload).unwrap_or_default(),
            shim,
            vars,
            execvpe,
            posix_spawn,
            posix_spawnp,
            system,
            popen,
        }
    });
}

fn carry() -> Option<&'static Carry> {
    if CARRY.get().is_none() {
        // A library's constructor that execs before ours ran: rare, and in
        // the parent (a vfork child runs after every constructor).
        crate::guard::guarded(prepare);
    }
    CARRY.get()
}

/// `GLIBC_TUNABLES=` and the tunable that turns glibc's rseq off.
const TUNABLES: &[u8] = b"GLIBC_TUNABLES=";
const RSEQ_OFF: &CStr = c"GLIBC_TUNABLES=glibc.pthread.rseq=0";
/// userfaultfd(2)'s flag for a descriptor that serves user-mode faults
/// only (the kernel's `include/uapi/linux/userfaultfd.h`).
const UFFD_USER_MODE_ONLY: c_int = 1;

/// Whether a userfaultfd made here now, with the credentials this thread
/// has now, would serve faults from user mode only: what
/// `zmem_uffd::Uffd::open(OpenMode::Auto)` would pick (the system call,
/// then `/dev/userfaultfd`, then `UFFD_USER_MODE_ONLY`). Raw system calls
/// only, each descriptor closed at once: it may run in a vfork child.
/// Not asked under a seccomp filter ([`under_seccomp_filter`]): one that
/// kills at `userfaultfd` would kill the program at its exec (bubblewrap's
/// `--seccomp`, which installs the filter just before it execs).
fn user_mode_only_here() -> bool {
    if under_seccomp_filter() {
        return false;
    }
    let opened = |r: libc::c_long| {
        if r >= 0 {
            // SAFETY: closing the descriptor just made here.
            unsafe { libc::syscall(libc::SYS_close, r) };
        }
        r >= 0
    };
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: userfaultfd(2) makes a descriptor or fails; nothing else.
    if opened(unsafe { libc::syscall(libc::SYS_userfaultfd, flags) }) {
        return false;
    }
    let dev = c"/dev/userfaultfd";
    // SAFETY: openat(2) of a NUL-terminated path; nothing else.
    if opened(unsafe { libc::syscall(libc::SYS_openat, libc::AT_FDCWD, dev.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) })
    {
        return false;
    }
    // SAFETY: as the first call.
    opened(unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) })
}

/// Whether this thread runs under a seccomp filter (`Seccomp:` 2 in
/// `/proc/thread-self/status`), or that cannot be read. Raw system calls
/// and a buffer on the stack, as [`user_mode_only_here`].
fn under_seccomp_filter() -> bool {
    let path = c"/proc/thread-self/status";
    // SAFETY: openat(2) of a NUL-terminated path; nothing else.
    let fd =
        unsafe { libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return true;
    }
    let mut buf = [0u8; 8192];
    let mut len = 0;
    while len < buf.len() {
        let rest = &mut buf[len..];
        // SAFETY: read(2) into the unfilled rest of our buffer.
        let n = unsafe { libc::syscall(libc::SYS_read, fd, rest.as_mut_ptr(), rest.len()) };
        if n <= 0 {
            break;
        }
        len += n as usize;
    }
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::syscall(libc::SYS_close, fd) };
    let text = &buf[..len];
    let key = b"\nSeccomp:";
    match text.windows(key.len()).position(|w| w == key) {
        Some(i) => text[i + key.len()..].iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'0'),
        // A kernel without seccomp says nothing of it; an unread file, or one
        // cut short, may be one with a filter.
        None => len == 0 || len == buf.len(),
    }
}

/// The name part of `KEY=value` (all of it where there is no `=`).
fn name(var: &[u8]) -> &[u8] {
    var.iter().position(|&b| b == b'=').map_or(var, |i| &var[..i])
}

/// The bytes of a C string.
///
/// # Safety
/// `p` is a NUL-terminated string alive for `'a`.
unsafe fn bytes<'a>(p: *const c_char) -> &'a [u8] {
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_bytes()
}

/// Memory for the new environment where the stack's is too small: a fresh
/// anonymous mapping, by the raw system call (no allocator, no shim).
struct Spill {
    addr: *mut c_void,
    len: usize,
}

impl Spill {
    fn new(len: usize) -> Option<Spill> {
        let len = len.next_multiple_of(zmem_common::PAGE_SIZE);
        // SAFETY: a fresh anonymous mapping at an address the kernel picks.
        let p = unsafe {
            libc::syscall(
                libc::SYS_mmap,
                0usize,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        (p != -1 && p != 0).then_some(Spill { addr: p as *mut c_void, len })
    }
}

impl Drop for Spill {
    fn drop(&mut self) {
        // SAFETY: our own mapping, not referenced once the exec returned.
        unsafe { libc::syscall(libc::SYS_munmap, self.addr, self.len) };
    }
}

/// Calls `f` with `envp`, or with a copy that carries the shim and the
/// tree's settings where `envp` lacks them (see the module's doc).
///
/// # Safety
/// `envp` is null or a null-terminated array of NUL-terminated strings,
/// alive across the call.
unsafe fn with_env<R>(envp: *const *const c_char, f: impl FnOnce(*const *const c_char) -> R) -> R {
    // A thread the handler holds on its CPU (`zmem_uffd::unhold_current_thread`)
    // hands no child its narrowed mask.
    zmem_uffd::unhold_current_thread();
    let Some(c) = carry().filter(|c| !c.shim.as_bytes().is_empty()) else { return f(envp) };
    if envp.is_null() {
        return f(envp);
    }
    // SAFETY: the caller's contract: `envp` is a null-terminated array of
    // NUL-terminated strings.
    let Some(EnvScan { n, preload_at, tunables_at, has }) = (unsafe { scan(envp, c) }) else { return f(envp) };
    let missing = c.vars.iter().enumerate().take(64).filter(|(i, _)| has >> i & 1 == 0).count();
    // LD_PRELOAD's value lacks the shim: a new value, the shim first.
    // The value of entry `i` (an index below `n`), its `KEY=` skipped.
    let value = |i: usize, key_eq: &[u8]| {
        // SAFETY: i < n, an entry of `envp`.
        let p = unsafe { *envp.wrapping_add(i) };
        // SAFETY: each entry is a NUL-terminated string.
        let v = unsafe { bytes(p) };
        &v[key_eq.len().min(v.len())..]
    };
    let old_preload = preload_at.map(|i| value(i, b"LD_PRELOAD="));
    let shim = c.shim.as_bytes();
    let preload_ok = old_preload.is_some_and(|v| v.split(|&b| b == b' ' || b == b':').any(|t| t == shim));
    let old_tunables = tunables_at.map(|i| value(i, TUNABLES));
    // What the environment says of rseq stands; else it goes off where
    // this process's userfaultfd would be for user mode only.
    let rseq_said = old_tunables.is_some_and(|v| v.split(|&b| b == b':').any(|t| name(t) == b"glibc.pthread.rseq"));
    let rseq_off = !rseq_said && user_mode_only_here();
    if preload_ok && missing == 0 && !rseq_off {
        return f(envp);
    }
    let added = missing + usize::from(preload_at.is_none()) + usize::from(rseq_off && tunables_at.is_none());
    let slots = n + added + 1;
    // The new LD_PRELOAD value: "LD_PRELOAD=" shim " " old, NUL.
    let preload_len = old_preload.filter(|_| !preload_ok).map_or(0, |v| c.preload.as_bytes().len() + 1 + v.len() + 1);
    // The new GLIBC_TUNABLES value: the old one, ":", the tunable, NUL.
    let rseq = &RSEQ_OFF.to_bytes()[TUNABLES.len()..];
    let tunables_len = old_tunables.filter(|_| rseq_off).map_or(0, |v| TUNABLES.len() + v.len() + 1 + rseq.len() + 1);
    let text_len = preload_len + tunables_len;
    let mut stack_ptrs = [std::ptr::null::<c_char>(); STACK_VARS];
    let mut stack_bytes = [0u8; STACK_BYTES];
    let spill;
    let (ptrs, text): (&mut [*const c_char], &mut [u8]) = if slots <= STACK_VARS && text_len <= STACK_BYTES {
        (&mut stack_ptrs[..], &mut stack_bytes[..])
    } else {
        let ptr_bytes = slots * std::mem::size_of::<*const c_char>();
        let Some(s) = Spill::new(ptr_bytes + text_len) else { return f(envp) };
        spill = s;
        let text = spill.addr.cast::<u8>().wrapping_add(ptr_bytes);
        // SAFETY: the mapping is fresh, readable and writable, page-aligned
        // (so aligned for pointers) and `ptr_bytes + text_len` long; the
        // two slices do not overlap and live no longer than `spill`.
        let ptrs = unsafe { std::slice::from_raw_parts_mut(spill.addr.cast::<*const c_char>(), slots) };
        // SAFETY: as above, the mapping's bytes after the pointers.
        (ptrs, unsafe { std::slice::from_raw_parts_mut(text, text_len) })
    };
    let (text, tunables_text) = text.split_at_mut(preload_len);
    for (i, p) in ptrs.iter_mut().enumerate().take(n) {
        // SAFETY: i < n, an entry of `envp`.
        *p = unsafe { *envp.wrapping_add(i) };
    }
    let mut k = n;
    match (preload_at, old_preload) {
        (Some(i), Some(old)) if !preload_ok => {
            let head = c.preload.as_bytes();
            ptrs[i] = if old.is_empty() { joined(text, &[head]) } else { joined(text, &[head, b" ", old]) };
        }
        (None, _) => {
            ptrs[k] = c.preload.as_ptr();
            k += 1;
        }
        _ => {}
    }
    for (i, v) in c.vars.iter().enumerate().take(64) {
        if has >> i & 1 == 0 {
            ptrs[k] = v.as_ptr();
            k += 1;
        }
    }
    if rseq_off {
        match (tunables_at, old_tunables) {
            (Some(i), Some(old)) => {
                let t = tunables_text;
                ptrs[i] =
                    if old.is_empty() { joined(t, &[TUNABLES, rseq]) } else { joined(t, &[TUNABLES, old, b":", rseq]) };
            }
            _ => {
                ptrs[k] = RSEQ_OFF.as_ptr();
                k += 1;
            }
        }
    }
    ptrs[k] = std::ptr::null();
    f(ptrs.as_ptr())
}

/// What [`with_env`] learns of an environment: its length, the index of
/// its LD_PRELOAD and GLIBC_TUNABLES, and which of the carried variables
/// (bit i: `c.vars[i]`, up to 64 of them) it sets.
struct EnvScan {
    n: usize,
    preload_at: Option<usize>,
    tunables_at: Option<usize>,
    has: u64,
}

/// Scans `envp`; `None` where it disables zmem (`ZMEM_DISABLE` true: a
/// false or bad value is not the program letting it go, and the child's
/// shim then says so). No allocation.
///
/// # Safety
/// `envp` is a null-terminated array of NUL-terminated strings.
unsafe fn scan(envp: *const *const c_char, c: &Carry) -> Option<EnvScan> {
    let mut e = EnvScan { n: 0, preload_at: None, tunables_at: None, has: 0 };
    loop {
        // SAFETY: `envp` is null-terminated (the caller's contract), and
        // no entry before `e.n` was null.
        let p = unsafe { *envp.wrapping_add(e.n) };
        if p.is_null() {
            return Some(e);
        }
        // SAFETY: each entry is a NUL-terminated string.
        let var = unsafe { bytes(p) };
        let key = name(var);
        if key == b"ZMEM_DISABLE" && matches!(&var[key.len()..], b"=1" | b"=true" | b"=yes") {
            return None;
        }
        if key == b"LD_PRELOAD" {
            e.preload_at = Some(e.n);
        }
        if key == &TUNABLES[..TUNABLES.len() - 1] {
            e.tunables_at = Some(e.n);
        }
        if key.starts_with(b"ZMEM_") {
            for (i, v) in c.vars.iter().enumerate().take(64) {
                if name(v.as_bytes()) == key {
                    e.has |= 1 << i;
                }
            }
        }
        e.n += 1;
    }
}

/// Writes `parts` one after the other and a NUL at the start of `buf`
/// (long enough: the caller sized it); the string's address.
fn joined(buf: &mut [u8], parts: &[&[u8]]) -> *const c_char {
    let mut at = 0;
    for part in parts {
        buf[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    buf[at] = 0;
    buf.as_ptr().cast()
}

/// The program's `environ`.
fn program_environ() -> *const *const c_char {
    // SAFETY: reading the C library's `environ` pointer, as execv does.
    unsafe { environ }
}

/// execveat(2); -1 with errno set on failure (it returns only then).
fn raw_execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    // SAFETY: the system call with the caller's arguments, as glibc's
    // wrapper makes it; on success it does not return.
    unsafe { libc::syscall(libc::SYS_execveat, dirfd, path, argv, envp, flags) as c_int }
}

#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    let call = |e: *const *const c_char| {
        // SAFETY: the system call with the caller's arguments, as glibc's
        // wrapper makes it (-1 and errno on failure, the only return).
        unsafe { libc::syscall(libc::SYS_execve, path, argv, e) as c_int }
    };
    // SAFETY: the caller's envp, as execve(2) requires it.
    unsafe { with_env(envp, call) }
}

#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    // SAFETY: as in execve.
    unsafe { with_env(envp, |e| raw_execveat(dirfd, path, argv, e, flags)) }
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    // SAFETY: as in execve; an empty path with AT_EMPTY_PATH is the file
    // `fd` itself, as glibc's fexecve does it.
    unsafe { with_env(envp, |e| raw_execveat(fd, c"".as_ptr(), argv, e, libc::AT_EMPTY_PATH)) }
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: the program's own environment, as glibc's execv passes it.
    unsafe { execve(path, argv, program_environ()) }
}

type ExecvpeFn = unsafe extern "C" fn(*const c_char, *const *const c_char, *const *const c_char) -> c_int;

#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    let Some(next) = carry().map(|c| c.execvpe).filter(|&f| f != 0) else {
        crate::errno::set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: `next` is the C library's execvpe (dlsym), of this type.
    let next = unsafe { std::mem::transmute::<usize, ExecvpeFn>(next) };
    // SAFETY: called with the caller's arguments and an environment as
    // valid as theirs.
    let call = |e| unsafe { next(file, argv, e) };
    // SAFETY: the caller's envp, as execvpe requires it.
    unsafe { with_env(envp, call) }
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: as glibc's execvp: execvpe with the program's environment.
    unsafe { execvpe(file, argv, program_environ()) }
}

type SpawnFn = unsafe extern "C" fn(
    *mut libc::pid_t,
    *const c_char,
    *const libc::posix_spawn_file_actions_t,
    *const libc::posix_spawnattr_t,
    *const *mut c_char,
    *const *mut c_char,
) -> c_int;

/// posix_spawn or posix_spawnp through the C library's `next`.
///
/// # Safety
/// posix_spawn's contract.
unsafe fn spawn(
    next: Option<usize>,
    pid: *mut libc::pid_t,
    path: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    let Some(next) = next.filter(|&f| f != 0) else { return libc::ENOSYS };
    // SAFETY: `next` is the C library's function of this type (dlsym).
    let next = unsafe { std::mem::transmute::<usize, SpawnFn>(next) };
    // SAFETY: called with the caller's arguments and an environment as
    // valid as theirs.
    let call = |e: *const *const c_char| unsafe { next(pid, path, actions, attr, argv, e.cast()) };
    // SAFETY: the caller's envp, as posix_spawn requires it.
    unsafe { with_env(envp.cast(), call) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    let next = carry().map(|c| c.posix_spawn);
    // SAFETY: the caller's contract, passed on.
    unsafe { spawn(next, pid, path, actions, attr, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    let next = carry().map(|c| c.posix_spawnp);
    // SAFETY: the caller's contract, passed on.
    unsafe { spawn(next, pid, file, actions, attr, argv, envp) }
}

/// `system(3)`: the C library's, after the calling thread has its own CPU
/// mask back (`zmem_uffd::unhold_current_thread`). glibc spawns its shell
/// with an internal posix_spawn that no wrapper sees; the child's
/// environment is the process's, which has the shim already.
#[no_mangle]
pub unsafe extern "C" fn system(command: *const c_char) -> c_int {
    zmem_uffd::unhold_current_thread();
    let Some(next) = carry().map(|c| c.system).filter(|&f| f != 0) else {
        crate::errno::set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: `next` is the C library's `system` (dlsym).
    let next = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char) -> c_int>(next) };
    // SAFETY: the caller's argument, as system(3) takes it.
    unsafe { next(command) }
}

/// `popen(3)`, as `system` above.
#[no_mangle]
pub unsafe extern "C" fn popen(command: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    zmem_uffd::unhold_current_thread();
    let Some(next) = carry().map(|c| c.popen).filter(|&f| f != 0) else {
        crate::errno::set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    type PopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
    // SAFETY: `next` is the C library's `popen` (dlsym).
    let next = unsafe { std::mem::transmute::<usize, PopenFn>(next) };
    // SAFETY: the caller's arguments, as popen(3) takes them.
    unsafe { next(command, mode) }
}
