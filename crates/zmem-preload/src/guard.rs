//! Reentrancy and unwinding: zmem's own code never manages its own memory,
//! and no panic crosses the C ABI.

use std::sync::atomic::{AtomicBool, Ordering};

/// The shim panicked once: it manages no new memory.
pub(crate) static BROKEN: AtomicBool = AtomicBool::new(false);

/// Set while this thread runs shim code, and for good on zmem's threads
/// (a per-thread flag, `flags.rs`).
pub(crate) fn in_zmem() -> bool {
    crate::flags::in_zmem()
}

/// Marks the calling thread as zmem's own: its allocations are never managed.
pub fn mark_internal_thread() {
    crate::flags::replace_in_zmem(true);
    crate::flags::mark_zmem_thread();
}

/// Runs `f` with the reentrancy flag set, catching any panic: nothing may
/// unwind across the C ABI (that aborts the program). After a panic the
/// shim takes no new memory (`BROKEN`) and `None` is returned; what it
/// already manages stays served.
///
/// On a program's thread, `f` runs with the asynchronous signals blocked
/// (`zmem_common::host::thread::block_async_signals`): no handler of the
/// program's runs inside the shim. One that did could wait for good: a
/// fault there on evicted memory waits for the pager's handler thread, which
/// may need a lock the interrupted shim code holds (the pager's region
/// table, mid-adoption). It would also allocate from zmem's heap (the
/// reentrancy flag is the thread's). A signal sent meanwhile is delivered
/// as `f` returns. zmem's own threads block them for good.
pub(crate) fn guarded<R>(f: impl FnOnce() -> R) -> Option<R> {
    let was = crate::flags::replace_in_zmem(true);
    let blocked = (!was).then(zmem_common::host::thread::block_async_signals);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    crate::flags::replace_in_zmem(was);
    drop(blocked);
    match r {
        Ok(r) => Some(r),
        Err(_) => {
            if !BROKEN.swap(true, Ordering::Relaxed) {
                log::error!("internal error (a panic, reported above); the shim takes no new memory");
            }
            None
        }
    }
}
