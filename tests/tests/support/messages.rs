//! The failure messages that the book's troubleshooting chapter shows, checked
//! against what the tests observe.
//!
//! Each message is a file `book/src/errors/NAME.txt`, which
//! `book/src/troubleshooting.md` includes verbatim (`{{#include errors/NAME.txt}}`).
//! A test that provokes the failure compares the message it observed, with the parts
//! that vary from run to run replaced by `{placeholders}` ([`redact`]), with that
//! file, and fails when they differ: the book cannot drift from the SDK. After
//! changing a message on purpose, rewrite the files with
//! `TCHD_BLESS=1 cargo test -p tch-distributed-tests --test NAME` and review the diff.
#![allow(dead_code)]

use std::path::PathBuf;

fn recorded_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../book/src/errors")
        .join(format!("{name}.txt"))
}

/// Panics unless `message` is the text of `book/src/errors/{name}.txt`; with
/// `TCHD_BLESS=1` in the environment, writes it there instead.
pub fn assert_recorded(name: &str, message: &str) {
    let path = recorded_path(name);
    let message = format!("{}\n", message.trim_end());
    if std::env::var("TCHD_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &message)
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let recorded = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        recorded == message,
        "the message differs from the book's copy, {}:\n--- book\n{recorded}--- observed\n{message}\
         If the change is meant, rerun this test with TCHD_BLESS=1 to rewrite the book's copy",
        path.display()
    );
}

/// `text` with the number that follows each occurrence of a rule's prefix replaced by
/// its placeholder: `redact("pass 12", &[("pass ", "{n}")])` is `"pass {n}"`. A number
/// is a run of digits and dots; a prefix followed by no digit is left alone.
pub fn redact(text: &str, rules: &[(&str, &str)]) -> String {
    let mut out = text.to_string();
    for (prefix, placeholder) in rules {
        let mut result = String::new();
        let mut rest = out.as_str();
        while let Some(at) = rest.find(prefix) {
            let (before, after) = rest.split_at(at + prefix.len());
            result.push_str(before);
            let digits = after
                .char_indices()
                .take_while(|(_, c)| c.is_ascii_digit() || *c == '.')
                .last()
                .map(|(i, c)| i + c.len_utf8())
                .unwrap_or(0);
            let number = after[..digits].trim_end_matches('.');
            if number.chars().any(|c| c.is_ascii_digit()) {
                result.push_str(placeholder);
                rest = &after[number.len()..];
            } else {
                rest = after;
            }
        }
        result.push_str(rest);
        out = result;
    }
    out
}

/// The message in `stderr` that begins with `start`: that line and the ones that
/// continue it (indented by two spaces, or `hint: …`).
pub fn message_block(stderr: &str, start: &str) -> String {
    let mut lines = stderr.lines().skip_while(|l| !l.starts_with(start));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no line starting with {start:?} in:\n{stderr}"));
    let mut block = vec![first];
    block.extend(lines.take_while(|l| l.starts_with("  ") || l.starts_with("hint: ")));
    block.join("\n")
}

/// The marks of raw libtorch text, which no message may show unless asked for.
pub const RAW: [&str; 4] = [
    "Internal torch error",
    "Exception raised from",
    "frame #",
    "panicked",
];

/// Panics when `text` holds raw libtorch text ([`RAW`]).
pub fn assert_no_raw_text(text: &str) {
    for raw in RAW {
        assert!(!text.contains(raw), "{raw:?} in:\n{text}");
    }
}
