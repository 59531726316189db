//! `strict_assert!`: a debug assertion that the `strict` feature turns into a
//! real one (after foyer's `strict_assert`). Used where a bad caller (a double
//! free, a stale handle) is reported as an error in release builds but should
//! stop a debug build at the call site.

#[macro_export]
macro_rules! strict_assert {
    ($($arg:tt)*) => {
        if cfg!(any(debug_assertions, feature = "strict")) {
            assert!($($arg)*);
        }
    };
}
