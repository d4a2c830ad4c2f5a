//! How far apart two results are: two tensors, two lists of named tensors (a model's
//! variables), or two safetensors files, as one [`Difference`].
//!
//! The test suite's one comparison. It fails (panics, saying what and where) on what
//! the usual one-liners let pass:
//!
//! - NaN or ±infinity on either side. `(a - b).abs().max()` is NaN then, and `NaN < tol`
//!   is false but `f64::max(0.0, NaN)` is `0.0`: a `fold(0.0, f64::max)` reports a
//!   perfect match for a diverged run.
//! - Different shapes, element counts, dtypes or names. A `zip` stops at the shorter
//!   side: a truncated list, or a model missing a variable, compares equal on what is
//!   left. A safetensors file that does not parse (truncated, say) fails to read.
//!
//! What it returns is a measurement, for the caller to hold against a tolerance it can
//! justify: the largest absolute and relative difference of one element, the number of
//! elements, and how many of them differ in their bits (`0` is "bit for bit equal").

use std::collections::BTreeSet;
use std::path::Path;

use tch::{Device, Kind, Tensor};

/// How far apart two results are, element by element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Difference {
    /// The largest `|a - b|` of one element.
    pub max_abs: f64,
    /// The largest `|a - b| / max(|a|, |b|)` of one element (0 where both are 0): the
    /// relative difference, symmetric in `a` and `b`.
    pub max_rel: f64,
    /// How many elements were compared (of all tensors).
    pub elements: usize,
    /// How many of them differ in their bits (for floats, `0.0` and `-0.0` differ).
    pub differing: usize,
}

impl Difference {
    /// Nothing compared yet: the start of a [`merge`](Self::merge).
    pub const NONE: Difference = Difference {
        max_abs: 0.0,
        max_rel: 0.0,
        elements: 0,
        differing: 0,
    };

    /// The difference over both comparisons' elements.
    pub fn merge(self, other: Difference) -> Difference {
        Difference {
            max_abs: self.max_abs.max(other.max_abs),
            max_rel: self.max_rel.max(other.max_rel),
            elements: self.elements + other.elements,
            differing: self.differing + other.differing,
        }
    }

    /// Whether every element is the same bits on both sides.
    pub fn is_exact(&self) -> bool {
        self.differing == 0
    }

    /// Panics, with `what` and the numbers, unless `max_abs <= tolerance`.
    pub fn assert_within(&self, tolerance: f64, what: &str) -> &Self {
        assert!(
            self.max_abs <= tolerance,
            "{what}: max |a - b| = {:e} > {tolerance:e} ({self:?})",
            self.max_abs
        );
        self
    }
}

/// The elements of a tensor, on the CPU, flattened: floats as `f64` (exact, and
/// one-to-one but for NaN payloads, from f16, bf16, f32 and f64, so that comparing the
/// `f64` bits counts the elements whose own bits differ), integers and booleans as `i64`.
enum Values {
    Float(Vec<f64>),
    Int(Vec<i64>),
}

fn values(what: &str, t: &Tensor) -> Values {
    let flat = t.detach().to_device(Device::Cpu).reshape([-1]);
    match t.kind() {
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double => Values::Float(
            Vec::<f64>::try_from(flat.to_kind(Kind::Double))
                .unwrap_or_else(|e| panic!("{what}: reading the elements: {e}")),
        ),
        Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 | Kind::Bool => {
            Values::Int(
                Vec::<i64>::try_from(flat.to_kind(Kind::Int64))
                    .unwrap_or_else(|e| panic!("{what}: reading the elements: {e}")),
            )
        }
        other => panic!("{what}: cannot compare tensors of dtype {other:?}"),
    }
}

/// One element's contribution: its absolute and relative difference.
fn element(abs: f64, a: f64, b: f64) -> (f64, f64) {
    let scale = a.abs().max(b.abs());
    (abs, if scale == 0.0 { 0.0 } else { abs / scale })
}

/// [`tensors`], with `what` naming the pair in the failure messages.
fn tensor_pair(what: &str, a: &Tensor, b: &Tensor) -> Difference {
    assert_eq!(
        a.size(),
        b.size(),
        "{what}: different shapes, {:?} vs {:?}",
        a.size(),
        b.size()
    );
    assert_eq!(
        a.kind(),
        b.kind(),
        "{what}: different dtypes, {:?} vs {:?}",
        a.kind(),
        b.kind()
    );
    let mut diff = Difference::NONE;
    match (values(what, a), values(what, b)) {
        (Values::Float(a), Values::Float(b)) => {
            assert_eq!(a.len(), b.len(), "{what}: different element counts");
            for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    x.is_finite() && y.is_finite(),
                    "{what}: element {i} is not finite: {x} vs {y}"
                );
                let (abs, rel) = element((x - y).abs(), x, y);
                diff.max_abs = diff.max_abs.max(abs);
                diff.max_rel = diff.max_rel.max(rel);
                diff.differing += (x.to_bits() != y.to_bits()) as usize;
            }
            diff.elements = a.len();
        }
        (Values::Int(a), Values::Int(b)) => {
            assert_eq!(a.len(), b.len(), "{what}: different element counts");
            for (&x, &y) in a.iter().zip(&b) {
                let abs = (x as i128 - y as i128).unsigned_abs() as f64;
                let (abs, rel) = element(abs, x as f64, y as f64);
                diff.max_abs = diff.max_abs.max(abs);
                diff.max_rel = diff.max_rel.max(rel);
                diff.differing += (x != y) as usize;
            }
            diff.elements = a.len();
        }
        _ => unreachable!("same dtype, same representation"),
    }
    diff
}

/// How far apart `a` and `b` are. Panics when their shapes or dtypes differ, or when
/// an element on either side is NaN or infinite.
pub fn tensors(a: &Tensor, b: &Tensor) -> Difference {
    tensor_pair("tensors", a, b)
}

/// The names of a list of named tensors, checked to be distinct.
fn names<N: AsRef<str>, T>(what: &str, list: &[(N, T)]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (name, _) in list {
        assert!(
            names.insert(name.as_ref().to_string()),
            "{what}: the name {:?} appears twice",
            name.as_ref()
        );
    }
    names
}

/// [`named`] over the names `pick` accepts; both lists must still hold the same names.
pub fn named_where<NA, TA, NB, TB>(
    a: &[(NA, TA)],
    b: &[(NB, TB)],
    pick: impl Fn(&str) -> bool,
) -> Difference
where
    NA: AsRef<str>,
    TA: AsRef<Tensor>,
    NB: AsRef<str>,
    TB: AsRef<Tensor>,
{
    named_in("", a, b, pick)
}

/// [`named_where`], with `context` before every failure message.
fn named_in<NA, TA, NB, TB>(
    context: &str,
    a: &[(NA, TA)],
    b: &[(NB, TB)],
    pick: impl Fn(&str) -> bool,
) -> Difference
where
    NA: AsRef<str>,
    TA: AsRef<Tensor>,
    NB: AsRef<str>,
    TB: AsRef<Tensor>,
{
    let names_a = names(&format!("{context}first list"), a);
    let names_b = names(&format!("{context}second list"), b);
    if names_a != names_b {
        let only = |x: &BTreeSet<String>, y: &BTreeSet<String>| {
            x.difference(y).cloned().collect::<Vec<_>>()
        };
        panic!(
            "{context}different names: only in the first {:?}, only in the second {:?} \
             ({} vs {} tensors)",
            only(&names_a, &names_b),
            only(&names_b, &names_a),
            a.len(),
            b.len()
        );
    }
    let mut diff = Difference::NONE;
    for (name, x) in a.iter().filter(|(name, _)| pick(name.as_ref())) {
        let name = name.as_ref();
        let (_, y) = b
            .iter()
            .find(|(n, _)| n.as_ref() == name)
            .expect("the same names");
        diff = diff.merge(tensor_pair(
            &format!("{context}{name}"),
            x.as_ref(),
            y.as_ref(),
        ));
    }
    diff
}

/// How far apart two lists of named tensors (say, two models' variables) are, tensor
/// by tensor under the same name, whatever the lists' order. Panics when the names
/// differ (a variable missing on one side, or one too many), when a name appears
/// twice, and as [`tensors`] does for each pair.
pub fn named<NA, TA, NB, TB>(a: &[(NA, TA)], b: &[(NB, TB)]) -> Difference
where
    NA: AsRef<str>,
    TA: AsRef<Tensor>,
    NB: AsRef<str>,
    TB: AsRef<Tensor>,
{
    named_where(a, b, |_| true)
}

/// The tensors of a safetensors file, sorted by name. Panics, naming the file, when it
/// cannot be read or parsed (missing, or truncated: its header then points past its end).
pub fn read(path: &Path) -> Vec<(String, Tensor)> {
    let mut named =
        Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    named.sort_by(|x, y| x.0.cmp(&y.0));
    named
}

/// How far apart two safetensors files' tensors are, as [`named`].
pub fn files(a: &Path, b: &Path) -> Difference {
    files_where(a, b, |_| true)
}

/// [`files`] over the tensors whose name `pick` accepts (both files must still hold
/// the same names).
pub fn files_where(a: &Path, b: &Path, pick: impl Fn(&str) -> bool) -> Difference {
    let context = format!("{} vs {}: ", a.display(), b.display());
    named_in(&context, &read(a), &read(b), pick)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(values: &[f32]) -> Tensor {
        Tensor::from_slice(values)
    }

    /// The message of the panic that `f` must end in.
    fn panic_message<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> String {
        let Err(e) = std::panic::catch_unwind(f) else {
            panic!("must fail, not pass");
        };
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    }

    #[test]
    fn measures_absolute_relative_and_bitwise_differences() {
        let d = tensors(&t(&[1.0, 2.0, 0.0, -4.0]), &t(&[1.0, 2.5, -0.0, -4.0]));
        assert_eq!(d.max_abs, 0.5);
        assert_eq!(d.max_rel, 0.2);
        assert_eq!(d.elements, 4);
        // 2.0 vs 2.5, and 0.0 vs -0.0 (equal values, different bits).
        assert_eq!(d.differing, 2);
        assert!(!d.is_exact());
        let same = tensors(&t(&[1.0, 2.0]), &t(&[1.0, 2.0]));
        assert!(same.is_exact() && same.max_abs == 0.0 && same.elements == 2);
        let ints = tensors(
            &Tensor::from_slice(&[3i64, 7]),
            &Tensor::from_slice(&[3i64, 4]),
        );
        assert_eq!((ints.max_abs, ints.differing), (3.0, 1));
    }

    #[test]
    fn nan_on_either_side_fails() {
        for (a, b) in [([1.0, f32::NAN], [1.0, 2.0]), ([1.0, 2.0], [1.0, f32::NAN])] {
            let m = panic_message(|| tensors(&t(&a), &t(&b)));
            assert!(m.contains("element 1 is not finite"), "{m}");
        }
        // NaN against NaN is no match either.
        let m = panic_message(|| tensors(&t(&[f32::NAN]), &t(&[f32::NAN])));
        assert!(m.contains("not finite"), "{m}");
    }

    #[test]
    fn infinity_fails() {
        let m = panic_message(|| tensors(&t(&[f32::INFINITY]), &t(&[f32::INFINITY])));
        assert!(m.contains("element 0 is not finite: inf vs inf"), "{m}");
        let m = panic_message(|| tensors(&t(&[0.0]), &t(&[f32::NEG_INFINITY])));
        assert!(m.contains("not finite"), "{m}");
    }

    #[test]
    fn shape_and_dtype_mismatches_fail() {
        // A truncated list of values: a zip would compare the first two and pass.
        let m = panic_message(|| tensors(&t(&[1.0, 2.0, 3.0]), &t(&[1.0, 2.0])));
        assert!(m.contains("different shapes, [3] vs [2]"), "{m}");
        let m = panic_message(|| tensors(&t(&[1.0, 2.0]), &t(&[1.0, 2.0]).view([2, 1])));
        assert!(m.contains("different shapes"), "{m}");
        let m = panic_message(|| tensors(&t(&[1.0]), &t(&[1.0]).to_kind(Kind::Double)));
        assert!(m.contains("different dtypes"), "{m}");
    }

    #[test]
    fn a_missing_or_extra_name_fails() {
        let a = vec![("w", t(&[1.0])), ("b", t(&[2.0]))];
        let missing = vec![("w", t(&[1.0]))];
        let m = panic_message(|| named(&a, &missing));
        assert!(m.contains("only in the first [\"b\"]"), "{m}");
        let m = panic_message(|| named(&missing, &a));
        assert!(m.contains("only in the second [\"b\"]"), "{m}");
        let renamed = vec![("w", t(&[1.0])), ("bias", t(&[2.0]))];
        let m = panic_message(|| named(&a, &renamed));
        assert!(m.contains("different names"), "{m}");
        let twice = vec![("w", t(&[1.0])), ("w", t(&[1.0]))];
        let m = panic_message(|| named(&twice, &twice));
        assert!(m.contains("appears twice"), "{m}");
        // Order does not matter; the pairs are matched by name.
        let reordered = vec![("b", t(&[2.0])), ("w", t(&[1.5]))];
        let d = named(&a, &reordered);
        assert_eq!((d.max_abs, d.elements, d.differing), (0.5, 2, 1));
        let d = named_where(&a, &reordered, |n| n == "b");
        assert_eq!((d.max_abs, d.elements), (0.0, 1));
        // The failure names the tensor.
        let nan = vec![("w", t(&[f32::NAN])), ("b", t(&[2.0]))];
        let m = panic_message(|| named(&a, &nan));
        assert!(m.starts_with("w: element 0 is not finite"), "{m}");
    }

    /// A fresh directory holding `a.safetensors` (`w`: 3 elements, `b`: 1).
    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("tchd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = vec![("w", t(&[1.0, 2.0, 3.0])), ("b", t(&[4.0]))];
        Tensor::write_safetensors(&a, dir.join("a.safetensors")).unwrap();
        dir
    }

    #[test]
    fn files_compare_by_name_and_a_truncated_file_fails() {
        let dir = scratch("compare-files");
        let a = dir.join("a.safetensors");
        let d = files(&a, &a);
        assert!(d.is_exact() && d.elements == 4, "{d:?}");

        let bytes = std::fs::read(&a).unwrap();
        let truncated = dir.join("truncated.safetensors");
        std::fs::write(&truncated, &bytes[..bytes.len() - 4]).unwrap();
        let m = panic_message(|| files(&a, &truncated));
        assert!(m.contains("truncated.safetensors"), "{m}");

        let missing = dir.join("missing.safetensors");
        Tensor::write_safetensors(&[("w", t(&[1.0, 2.0, 3.0]))], &missing).unwrap();
        let m = panic_message(|| files(&a, &missing));
        assert!(
            m.contains("missing.safetensors") && m.contains("only in the first [\"b\"]"),
            "{m}"
        );

        let short = dir.join("short.safetensors");
        Tensor::write_safetensors(&[("w", t(&[1.0, 2.0])), ("b", t(&[4.0]))], &short).unwrap();
        let m = panic_message(|| files(&a, &short));
        assert!(m.contains("w: different shapes, [3] vs [2]"), "{m}");

        let nan = dir.join("nan.safetensors");
        Tensor::write_safetensors(&[("w", t(&[1.0, f32::NAN, 3.0])), ("b", t(&[4.0]))], &nan)
            .unwrap();
        let m = panic_message(|| files(&a, &nan));
        assert!(m.contains("w: element 1 is not finite: 2 vs NaN"), "{m}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
