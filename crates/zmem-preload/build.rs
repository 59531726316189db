//! Links the shim so that its own calls of the functions it defines (the
//! malloc family above all) reach its own definitions.
//!
//! The loader looks a symbol up in the executable first, before any
//! preload. In a program whose executable defines the malloc family
//! (rustc links jemalloc in), the C code inside the shim (zstd's contexts
//! and workspaces) called the program's `calloc` from zmem's threads, and
//! the handler faulted on the allocator's evicted metadata with no one left
//! to serve it: `zmem run -- rustc` hung once new stores switched to zstd.
//! `-Bsymbolic-functions` binds those calls to the shim's `calloc`, which
//! serves zmem's threads from zmem's heap. For every other symbol it
//! changes nothing: the shim already came first after the executable.
//!
//! It also compiles `src/flags.c`: the shim's per-thread flags, in the
//! initial-exec TLS model (the file says why).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
    println!("cargo:rerun-if-changed=src/flags.c");
    cc::Build::new().file("src/flags.c").flag("-ftls-model=initial-exec").compile("zmem_flags");
}
