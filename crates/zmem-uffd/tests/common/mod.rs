//! Shared by the integration tests: a watchdog that turns a hang into a
//! loud failure (a fault nobody serves, or an event nobody reads, would
//! otherwise hang CI).

use std::time::Duration;

/// Dropping it (the test ended) disconnects the channel and stops the dog.
pub struct Watchdog {
    _alive: std::sync::mpsc::Sender<()>,
}

/// Ends the test process if the test runs past `secs`.
pub fn watchdog(name: &'static str, secs: u64) -> Watchdog {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_secs(secs)) {
            eprintln!("{name}: hung for {secs} s; aborting");
            // Not `process::exit`: glibc's exit takes stdio's list lock,
            // which a thread stuck inside fork holds.
            // SAFETY: ends the process; nothing after it runs.
            unsafe { libc::_exit(101) };
        }
    });
    Watchdog { _alive: tx }
}
