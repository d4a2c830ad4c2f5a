//! Messages the ranks print.

/// Writes `tch-distributed: {message}` and a newline to stderr in one write, so that
/// the lines of ranks that share the stream do not interleave (`eprintln!` writes a
/// formatted line in pieces to the unbuffered stderr).
pub(crate) fn warn(message: impl std::fmt::Display) {
    let line = format!("tch-distributed: {message}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}

/// `eprintln!` in one write: the launcher's lines share stderr with its ranks', and
/// `eprintln!` writes a formatted line in pieces (a rank's line could land between
/// `tch-distributed` and `: received SIGTERM`).
#[doc(hidden)]
#[macro_export]
macro_rules! eprintln_whole {
    ($($arg:tt)*) => {{
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }};
}
