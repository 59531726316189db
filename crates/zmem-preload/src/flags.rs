//! The shim's per-thread flags, kept in C (`flags.c`) for the
//! initial-exec TLS model: reading them never calls `__tls_get_addr`,
//! which AddressSanitizer defines and cannot serve before its runtime has
//! started (that file says more).

extern "C" {
    fn zmem_flag_in_zmem() -> u8;
    fn zmem_flag_set_in_zmem(v: u8);
    fn zmem_flag_thread_kind() -> u8;
    fn zmem_flag_set_thread_kind(v: u8);
    fn zmem_mapped_ranges() -> *mut u64;
}

/// Whether the calling thread runs shim code now (see `guard.rs`).
pub(crate) fn in_zmem() -> bool {
    // SAFETY: reads the calling thread's own byte in the static TLS block;
    // no argument, nothing else touched.
    unsafe { zmem_flag_in_zmem() != 0 }
}

/// Sets [`in_zmem`] and returns what it was.
pub(crate) fn replace_in_zmem(v: bool) -> bool {
    let was = in_zmem();
    // SAFETY: writes the calling thread's own byte in the static TLS
    // block; nothing else touched.
    unsafe { zmem_flag_set_in_zmem(u8::from(v)) };
    was
}

/// 0: not known yet; 1: a thread of the program's; 2: one of zmem's (see
/// `next.rs`).
pub(crate) fn thread_kind() -> u8 {
    // SAFETY: as `in_zmem`.
    unsafe { zmem_flag_thread_kind() }
}

pub(crate) fn set_thread_kind(k: u8) {
    // SAFETY: as `replace_in_zmem`.
    unsafe { zmem_flag_set_thread_kind(k) };
}

/// Marks the calling thread as zmem's (its threads call it first thing).
pub(crate) fn mark_zmem_thread() {
    set_thread_kind(2);
}

/// Entries of [`mapped_ranges`].
pub(crate) const MAPPED_RANGES: usize = 4;

/// The calling thread's own table of buffer ranges found mapped:
/// `MAPPED_RANGES` entries of start, end and epoch (`uaccess.rs`).
pub(crate) fn mapped_ranges() -> *mut [[u64; 3]; MAPPED_RANGES] {
    // SAFETY: returns the address of the calling thread's own array in the
    // static TLS block; nothing else touched.
    unsafe { zmem_mapped_ranges() }.cast()
}
