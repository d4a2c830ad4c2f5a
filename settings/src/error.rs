//! The settings' errors. The SDK's own [`Error`](../tch_distributed/enum.Error.html)
//! takes each as its variant of the same name and text.

/// A setting that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A run configuration that is not usable: a file that is not valid TOML or has an
    /// unknown key, or answers that end too early; the message says what to fix.
    #[error("{0}")]
    Config(String),

    /// A setting given a value it does not take: `given` is the setting as it was
    /// written (`--grad-accum 0`, `TCH_DISTRIBUTED_GRAD_ACCUM="0"`, `grad_accum = "0" in
    /// FILE`, `grad_accum = 0` in the attribute), `allowed` what it takes (the row's
    /// message).
    #[error("{given}: {allowed}")]
    Setting { given: String, allowed: String },

    /// An I/O operation failed; `context` names the operation and path.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// A result whose error is a setting's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
