//! `zmem run`, `zmem stats`, `zmem compare` and `zmem usemem` on real
//! programs, one file a family; every byte the programs wrote is checked, by
//! the program itself or against the same work without zmem.

mod cli;
mod common;
mod compare;
mod fork_exec;
mod paging;
mod runtimes;
mod sandboxes;
mod servers;
mod shim;
mod slowdown;
mod start;
