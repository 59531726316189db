//! A test run again, alone, in a child process of its test binary: for a
//! test that must die by a signal, or that must not share its process
//! with other tests' pagers.

/// Set in that child process.
const CHILD_ENV: &str = "ZMEM_UFFD_TEST_CHILD";

/// Whether this process is such a child.
pub fn in_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// Runs test `name` (its path as the harness lists it: `module::test` in a
/// test binary of modules) again in a child process (with `CHILD_ENV` set), as the
/// only test there, and returns its output.
pub fn run_child(name: &str) -> std::process::Output {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap()
}
