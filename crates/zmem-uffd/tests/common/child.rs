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

/// Whether this test should run here: in the child process, yes; in the
/// test binary's own process, the test is run again alone in a child
/// ([`run_child`]), which must pass, and the caller returns. For a test
/// that other tests in its process would disturb: their forks share its
/// pages with children of theirs, their pagers map pages into its gaps.
pub fn alone(name: &str) -> bool {
    if in_child() {
        return true;
    }
    let o = run_child(name);
    let out = format!("stdout: {}\nstderr: {}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{name}, alone in a child process: {:?}\n{out}", o.status);
    assert!(out.contains("1 passed"), "{name} did not run in its child process\n{out}");
    false
}
