//! The run's configuration file, as `accelerate config` writes one: `tchrun config`
//! asks a few questions (or takes flags) and writes a TOML file of settings (the keys
//! of [`TABLE`](super::TABLE) whose `file` is true); `tchrun` reads it.
//!
//! The file is `--config FILE`, else `$TCH_DISTRIBUTED_CONFIG`, else
//! `$XDG_CONFIG_HOME/tch-distributed/config.toml`, else
//! `~/.config/tch-distributed/config.toml` ([`default_path`]).

use std::path::{Path, PathBuf};

use super::{Origin, Settings, TABLE};
use crate::error::{Error, Result};

/// `TCH_DISTRIBUTED_CONFIG`: the configuration file `tchrun` reads when `--config` is
/// not given.
pub const CONFIG_ENV: &str = "TCH_DISTRIBUTED_CONFIG";

/// The file's header: what it is and how it ranks against the other sources.
pub(super) const HEADER: &str = "\
# tch-distributed run configuration, written by `tchrun config` and read by `tchrun`.
# tchrun's flags and TCH_DISTRIBUTED_* variables win over it; it wins over the options
# of #[distributed(...)]. A setting left out is decided by those, or by the defaults.
";

pub(super) fn load(path: &Path) -> Result<Settings> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        context: format!("reading the run configuration {}", path.display()),
        source,
    })?;
    let table: toml::Table = toml::from_str(&text)
        .map_err(|e| Error::Config(format!("{}: {}", path.display(), e.to_string().trim_end())))?;
    let mut settings = Settings::default();
    for (key, value) in &table {
        // The key's line, for the message: the first that sets it.
        let line = text
            .lines()
            .position(|l| l.split('=').next().is_some_and(|k| k.trim() == key))
            .map_or(0, |i| i + 1);
        let origin = Origin::File(path.to_path_buf(), line);
        let Some(row) = TABLE.iter().find(|r| r.file && r.key == key) else {
            let keys: Vec<&str> = TABLE.iter().filter(|r| r.file).map(|r| r.key).collect();
            return Err(Error::Config(format!(
                "{}, line {line}: unknown field `{key}`: the file's keys are {}",
                path.display(),
                keys.join(", ")
            )));
        };
        let text = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                value.to_string()
            }
            other => {
                return Err(origin.bad(
                    row,
                    &other.to_string(),
                    &format!("{} is needed", row.values),
                ))
            }
        };
        row.set(&mut settings, &text)
            .map_err(|why| origin.bad(row, &text, &why))?;
    }
    Ok(settings)
}

pub(super) fn to_toml(settings: &Settings) -> String {
    let mut out = HEADER.to_string();
    for row in TABLE.iter().filter(|r| r.file) {
        if let Some(value) = (row.toml)(settings) {
            out += &format!("{} = {value}\n", row.key);
        }
    }
    out
}

/// Where `tchrun` looks for its configuration file when `--config` is not given, read
/// through `var`: `TCH_DISTRIBUTED_CONFIG`, else
/// `$XDG_CONFIG_HOME/tch-distributed/config.toml`, else
/// `$HOME/.config/tch-distributed/config.toml` (the XDG base directory rule that
/// `accelerate config` also follows for its cache). `None` without `HOME`.
pub fn default_path_from(var: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(path) = set(CONFIG_ENV) {
        return Some(PathBuf::from(path));
    }
    let base = set("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| set("HOME").map(|home| Path::new(&home).join(".config")))?;
    Some(base.join("tch-distributed").join("config.toml"))
}

/// Whether `TCH_DISTRIBUTED_CONFIG` names a file (which must then exist).
pub fn config_named_by_env() -> bool {
    std::env::var_os(CONFIG_ENV).is_some_and(|v| !v.is_empty())
}

/// [`default_path_from`] this process's environment.
pub fn default_path() -> Option<PathBuf> {
    default_path_from(|name| std::env::var(name).ok())
}
