//! What reading the other tools' configuration files shares ([`crate::deepspeed`],
//! [`crate::accelerate`]): the file's text, a block of keys, a setting given by a key,
//! and the error for a key that is not read.

use std::path::Path;

use serde_json::{Map, Value as Json};

use crate::error::{Error, Result};
use crate::{row, Settings};

/// The text of `path`, `tool`'s configuration.
///
/// # Errors
/// [`Error::Io`] naming the file when it cannot be read.
pub(crate) fn read(path: &Path, tool: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        context: format!("reading the {tool} configuration {}", path.display()),
        source,
    })
}

/// `value`, the block of keys under `key`.
pub(crate) fn object<'a>(
    key: &str,
    value: &'a Json,
) -> std::result::Result<&'a Map<String, Json>, String> {
    value
        .as_object()
        .ok_or_else(|| format!("{key}: a block of keys (a mapping, a JSON object) is needed"))
}

/// Sets the row `key` of `settings` to `text`, which the file's key `source` gave.
///
/// # Errors
/// The row's own message for a bad value, after `source: text: `.
///
/// # Panics
/// When `key` is not a row of [`crate::TABLE`] (a fault in the caller, which names rows).
pub(crate) fn give(
    settings: &mut Settings,
    key: &str,
    source: &str,
    text: &str,
) -> std::result::Result<(), String> {
    let row = row(key).unwrap_or_else(|| panic!("`{key}` is not a row of the settings table"));
    row.set(settings, text)
        .map_err(|why| format!("{source}: {text}: {why}"))
}

/// The `offload` row's value and the file's key that gave it, from the key that offloads
/// the parameters (`param`) and the one that offloads the optimizer's state
/// (`optimizer`), each `None` when the file does not offload it (absent, or `"none"`).
/// Offloading the parameters moves the optimizer's state too, as DeepSpeed's
/// `offload_param` and FSDP2's `CPUOffloadPolicy` do: `"all"` then, whatever
/// `optimizer` says; `"optimizer"` when only the optimizer's state is offloaded.
pub(crate) fn offload<'a>(
    param: Option<&'a str>,
    optimizer: Option<&'a str>,
) -> Option<(&'a str, &'static str)> {
    match (param, optimizer) {
        (Some(source), _) => Some((source, "all")),
        (None, Some(source)) => Some((source, "optimizer")),
        (None, None) => None,
    }
}

/// The error for `key`, which tch-distributed does not read from `tool`'s file.
pub(crate) fn unknown(tool: &str, key: &str) -> String {
    format!(
        "`{key}` is not {tool} key that tch-distributed reads: remove it (the book's \
         \"Your ds_config.json and default_config.yaml\" lists the keys and what each does here)"
    )
}
