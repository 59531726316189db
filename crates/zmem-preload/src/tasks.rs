//! This process's threads: which run now, and whether any but zmem's do.
//! Read from `/proc/self/task` while the program keeps `/proc`; after it
//! changed its root (`modes::leaving_root`), from a `/proc/self/stat` kept
//! open before, and zmem's own thread ids.

use std::path::Path;
use std::sync::atomic::Ordering;
use zmem_common::host::fds::Wait;

/// Whether a thread other than `but` and zmem's (by name, `host::thread::is_zmem_name`, and the
/// io_uring workers of its swap file) is in this process (or `/proc`
/// cannot tell).
///
/// Without `/proc` (the program changed its root) it counts instead: the
/// process's threads ([`self_stat`]) against zmem's running ones
/// (`zmem_common::host::thread::ours`). Any other thread counts then, an
/// io_uring worker among them, until it ends on its own.
pub(crate) fn others_than_zmem(but: i32) -> bool {
    match tasks() {
        Some(t) => t.iter().any(|(tid, comm)| *tid != but && !is_zmem(comm) && !comm.starts_with("iou-wrk-")),
        None => thread_count().is_none_or(|n| {
            n > 1 + zmem_common::host::thread::ours(&mut [0; zmem_common::host::thread::LISTED]) + io_workers_alive()
        }),
    }
}

/// zmem's io_uring workers (`iou-wrk-TID`, TID a thread of zmem's) when
/// the program changed its root ([`keep_self_stat`]): `pid << 32 | tid`,
/// 0 for none. No new one comes after (`no_new_io_workers`).
/// (The kernel's bound for a ring's workers is 4 a CPU, at most the ring's
/// 64 entries.)
static IO_WORKERS: [std::sync::atomic::AtomicU64; 64] = [const { std::sync::atomic::AtomicU64::new(0) }; 64];

/// How many of [`IO_WORKERS`] still run: a thread of this process by
/// that id (`tgkill` with no signal, which needs no `/proc`).
pub(crate) fn io_workers_alive() -> usize {
    let me = std::process::id();
    IO_WORKERS
        .iter()
        .map(|w| w.load(Ordering::Acquire))
        .filter(|&w| w != 0 && (w >> 32) as u32 == me)
        // SAFETY: signal 0 only checks that thread `tid` of this process
        // exists; nothing is sent.
        .filter(|&w| unsafe { libc::syscall(libc::SYS_tgkill, me, w as u32 as i32, 0) } == 0)
        .count()
}

/// Notes zmem's io_uring workers while `/proc` is there, after keeping
/// new ones from starting.
pub(crate) fn note_io_workers() {
    zmem_common::host::thread::no_new_io_workers();
    let me = std::process::id();
    let mut zmem = [0; zmem_common::host::thread::LISTED];
    let n = zmem_common::host::thread::ours(&mut zmem);
    let ours = |comm: &str| {
        comm.trim_end()
            .strip_prefix("iou-wrk-")
            .and_then(|t| t.parse::<i32>().ok())
            .is_some_and(|t| zmem[..n].contains(&t))
    };
    let workers = tasks().unwrap_or_default().into_iter().filter(|(_, comm)| ours(comm));
    for (slot, (tid, _)) in IO_WORKERS.iter().zip(workers) {
        slot.store(u64::from(me) << 32 | u64::from(tid as u32), Ordering::Release);
    }
}

/// This process's `/proc/self/stat` (pid, state, ..., the threads and the
/// main thread's exit status), read by its path, or, once the program
/// changed its root, through the descriptor [`leaving_root`](crate::modes::leaving_root) kept.
pub(crate) fn self_stat() -> Option<String> {
    match zmem_common::host::fds::read_to_string(Wait::Yes, Path::new("/proc/self/stat")) {
        Ok(s) => Some(s),
        Err(_) => {
            let kept = SELF_STAT.load(Ordering::Acquire);
            if kept == 0 || (kept >> 32) as u32 != std::process::id() {
                return None;
            }
            zmem_common::host::fds::pread_to_string(kept as u32 as i32).ok()
        }
    }
}

/// The threads of this process now, by `/proc/self/stat` (field 20).
pub(crate) fn thread_count() -> Option<usize> {
    zmem_common::procfs::stat_field(&self_stat()?, 20)?.parse().ok()
}

/// `/proc/self/stat` kept open by a process that changed its root
/// ([`leaving_root`](crate::modes::leaving_root)): `pid << 32 | fd`, or 0. The pid tells a forked
/// child that the descriptor it inherited is its parent's file.
static SELF_STAT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Opens `/proc/self/stat` for good, where this process has not yet
/// (a regular file: unlike a directory's descriptor, it leads nowhere
/// outside the new root).
pub(crate) fn keep_self_stat() {
    let me = std::process::id();
    if (SELF_STAT.load(Ordering::Acquire) >> 32) as u32 == me {
        return;
    }
    match zmem_common::host::fds::open_for_good(Path::new("/proc/self/stat")) {
        Ok(fd) => SELF_STAT.store(u64::from(me) << 32 | u64::from(fd as u32), Ordering::Release),
        Err(e) => log::debug!("/proc/self/stat: {e}"),
    }
    note_io_workers();
}

/// This process's threads now, (tid, name); `None` without `/proc`.
pub(crate) fn tasks() -> Option<Vec<(i32, String)>> {
    // Kept descriptors (`zmem_common::host::fds`): the program's other threads
    // may be closing every descriptor meanwhile.
    let task = Path::new("/proc/self/task");
    let names = zmem_common::host::fds::dir_names(Wait::Yes, task).ok()?;
    Some(
        names
            .into_iter()
            .filter_map(|t| {
                let tid = t.to_str()?.parse().ok()?;
                Some((
                    tid,
                    zmem_common::host::fds::read_to_string(Wait::Yes, &task.join(&t).join("comm")).unwrap_or_default(),
                ))
            })
            .collect(),
    )
}

/// Whether a thread of this name is zmem's.
pub(crate) fn is_zmem(comm: &str) -> bool {
    zmem_common::host::thread::is_zmem_name(comm.as_bytes())
}

/// The threads of this process now.
pub(crate) fn threads() -> usize {
    zmem_common::host::fds::dir_names(Wait::Yes, Path::new("/proc/self/task"))
        .map(|n| n.len())
        .ok()
        .or_else(thread_count)
        .unwrap_or(usize::MAX)
}
