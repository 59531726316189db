//! The swap-file reader on arbitrary file contents: a slot is written, then
//! overwritten (or cut short) with the input, and read back. The read must
//! fail (corrupt, or I/O for a short file) or return exactly the page that
//! was written: never other bytes, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zmem_swapfile::fuzz::check_slot_read;

fuzz_target!(|data: &[u8]| {
    check_slot_read(data);
});
