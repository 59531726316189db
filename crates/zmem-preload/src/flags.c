// Two per-thread flags the shim reads on every call of the malloc family
// and of the other functions it defines (`guard.rs`, `next.rs`), in the
// initial-exec TLS model: read at a fixed offset from the thread pointer,
// with no call to `__tls_get_addr`. Rust's `thread_local!` in a shared
// library reaches its slot through `__tls_get_addr` (the general-dynamic
// model; stable Rust cannot choose another), and AddressSanitizer defines
// `__tls_get_addr` itself: its runtime, starting from the executable's
// `.preinit_array` before any library's constructor, calls `dlsym`, which
// calls `malloc` (the shim's), whose flag read went to ASan's
// `__tls_get_addr` before ASan had looked up the real one, and jumped to
// address 0. The shim is always loaded at start (LD_PRELOAD), so its TLS
// is in the static block, which the initial-exec model needs.
static __thread unsigned char in_zmem __attribute__((tls_model("initial-exec")));
static __thread unsigned char thread_kind __attribute__((tls_model("initial-exec")));

__attribute__((visibility("hidden"))) unsigned char zmem_flag_in_zmem(void) {
    return in_zmem;
}

__attribute__((visibility("hidden"))) void zmem_flag_set_in_zmem(unsigned char v) {
    in_zmem = v;
}

__attribute__((visibility("hidden"))) unsigned char zmem_flag_thread_kind(void) {
    return thread_kind;
}

__attribute__((visibility("hidden"))) void zmem_flag_set_thread_kind(unsigned char v) {
    thread_kind = v;
}

// The buffer ranges the calling thread's last I/O calls found mapped, each
// start, end and the pager's epoch then (`uaccess.rs`): 0 as the epoch is
// no entry.
static __thread unsigned long long mapped_ranges[4][3] __attribute__((tls_model("initial-exec")));

__attribute__((visibility("hidden"))) unsigned long long *zmem_mapped_ranges(void) {
    return &mapped_ranges[0][0];
}
