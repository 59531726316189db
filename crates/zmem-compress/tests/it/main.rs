//! Integration tests of zmem-compress, one binary with modules.

mod bad_input;
mod codecs;
mod engines;
mod fuzz_replay;
mod liblz4;
mod liblzo2;
mod util;
