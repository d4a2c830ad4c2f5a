//! A `VarStore`'s safetensors file, written one variable at a time and read by rows,
//! so that a sharded model (ZeRO stage 3) is never whole on a rank for its file: the
//! write all-gathers one sharded variable at a time (every rank runs the same writer,
//! so the gathers come in the same order everywhere; rank 0 writes the bytes), and the
//! read gives each sharded variable this rank's rows alone, read from the file by
//! positioned reads. Variables that are whole on every rank are written and
//! read as they are.
//! The file is the one `VarStore::save` writes (same names, dtypes and layout), so
//! PyTorch's `safetensors.torch.load_file` and `VarStore::load` read it.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::path::Path;

use safetensors::tensor::{Dtype, View};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::error::{checkpoint, io, Error, Result};
use crate::unit_registry::Units;

/// Where the ranks other than the writer send the bytes: their gathers must run all
/// the same.
const NOWHERE: &str = "/dev/null";

/// Whether `path` names a safetensors file (the format `VarStore::save` picks from
/// the extension).
pub(crate) fn is_safetensors(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

/// One variable of the file: its bytes come when the writer asks for them.
struct Lazy<'a> {
    units: Option<&'a Units>,
    var: Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    /// The writer asked for the bytes (the gather ran).
    asked: Cell<bool>,
    failure: &'a RefCell<Option<Error>>,
}

impl View for &Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.bytes())
    }

    fn data_len(&self) -> usize {
        self.len
    }
}

impl Lazy<'_> {
    /// The variable's bytes (gathered if sharded); zeros after a failure, which is
    /// kept for the writer's caller.
    fn bytes(&self) -> Vec<u8> {
        self.asked.set(true);
        let whole = match self.units {
            Some(units) => units.whole(&self.var),
            None => Ok(self.var.shallow_clone()),
        };
        let bytes = whole.and_then(|whole| {
            let whole = whole.to_device(tch::Device::Cpu).contiguous();
            let mut bytes = vec![0u8; self.len];
            whole.f_copy_data_u8(&mut bytes, whole.numel())?;
            Ok(bytes)
        });
        match bytes {
            Ok(bytes) => bytes,
            Err(e) => {
                self.failure.borrow_mut().get_or_insert(e);
                vec![0u8; self.len]
            }
        }
    }
}

/// The safetensors dtype of `kind`.
fn dtype(kind: Kind, name: &str) -> Result<Dtype> {
    Ok(match kind {
        Kind::Bool => Dtype::BOOL,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Int16 => Dtype::I16,
        Kind::Int => Dtype::I32,
        Kind::Int64 => Dtype::I64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        other => {
            return Err(Error::Usage(format!(
                "variable `{name}` is {other:?}, which safetensors files do not hold: save \
                 the model with another extension (libtorch's format)"
            )))
        }
    })
}

/// The tch kind of a safetensors dtype.
fn kind(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// Writes the variables of `vs` that `keep` keeps (by name and tensor) to `dest` as a
/// safetensors file (none: the null device, on the ranks that do not write), one
/// variable at a time: a sharded one (of `units`, the run's) is all-gathered alone,
/// then written and dropped. Every rank calls it with the same store and `keep`: the
/// gathers are collectives.
///
/// # Errors
/// [`Error::Io`] when `dest` cannot be written; [`Error::Usage`] for a dtype
/// safetensors does not hold; [`Error::Collective`] when a gather fails.
pub(crate) fn write(
    units: Option<&Units>,
    vs: &VarStore,
    dest: Option<&Path>,
    keep: &dyn Fn(&str, &Tensor) -> bool,
) -> Result<()> {
    let failure = RefCell::new(None);
    let mut views = Vec::new();
    for (name, var) in vs.variables() {
        if !keep(&name, &var) {
            continue;
        }
        let dtype = dtype(var.kind(), &name)?;
        let shape: Vec<usize> = var.size().iter().map(|&d| d as usize).collect();
        let len = var.numel() * var.kind().elt_size_in_bytes();
        views.push((
            name,
            Lazy {
                units,
                var,
                dtype,
                shape,
                len,
                asked: Cell::new(false),
                failure: &failure,
            },
        ));
    }
    // safetensors' own order (by dtype, largest alignment first, then by name), so
    // that a write that stops early asks for the rest below in the order the other
    // ranks' writes ask for them.
    views.sort_by(|(a, x), (b, y)| y.dtype.cmp(&x.dtype).then(a.cmp(b)));
    let path = dest.unwrap_or(Path::new(NOWHERE));
    let written = safetensors::tensor::serialize_to_file(
        views.iter().map(|(n, v)| (n.as_str(), v)),
        &None,
        path,
    );
    // Every variable's gather runs on every rank, whatever happened to this write.
    for (_, view) in &views {
        if !view.asked.get() {
            let _ = view.bytes();
        }
    }
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    written.map_err(|e| match e {
        safetensors::SafeTensorError::IoError(e) => io("writing", path)(e),
        other => io("writing", path)(std::io::Error::other(format!("{other:?}"))),
    })
}

/// A safetensors file's header, read alone: where each tensor's bytes are. The bytes
/// themselves are read when asked for, a row range at a time (positioned reads), so that
/// reading a sharded variable's rows touches nothing else of the file and keeps no
/// more of it in memory than those rows.
pub(crate) struct ModelFile {
    path: std::path::PathBuf,
    file: std::fs::File,
    /// Where the tensors' bytes start (after the header).
    data_start: u64,
    tensors: std::collections::HashMap<String, safetensors::tensor::TensorInfo>,
}

impl ModelFile {
    /// Opens `path` and reads its header.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Checkpoint`] when it is not a
    /// safetensors file (a header that does not parse, or offsets past its end).
    pub fn open(path: &Path) -> Result<ModelFile> {
        use std::os::unix::fs::FileExt;
        let bad = |message: String| checkpoint(Some(path), message);
        let file = std::fs::File::open(path).map_err(io("opening", path))?;
        let len = file.metadata().map_err(io("reading", path))?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| bad("not a safetensors file: shorter than its header".into()))?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) {
            return Err(bad(format!(
                "not a safetensors file: a header of {n} bytes"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(io("reading", path))?;
        let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let data_start = 8 + n;
        let tensors: std::collections::HashMap<String, safetensors::tensor::TensorInfo> = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, info.clone()))
            .collect();
        for (name, info) in &tensors {
            let (start, end) = info.data_offsets;
            let size = info.shape.iter().product::<usize>() * info.dtype.size();
            if end < start || end - start != size || data_start + end as u64 > len {
                return Err(bad(format!(
                    "`{name}`: its bytes {start}..{end} do not hold {:?} of {:?} in a file of {len} bytes",
                    info.shape, info.dtype
                )));
            }
        }
        Ok(ModelFile {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
        })
    }

    /// The shape of tensor `name`, if the file has it.
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        let info = self.tensors.get(name)?;
        Some(info.shape.iter().map(|&d| d as i64).collect())
    }

    /// Rows `[first, first + count)` of tensor `name` (dim 0; a scalar is one row), as
    /// a tensor in the file's dtype.
    fn rows(&self, name: &str, first: i64, count: i64) -> Result<Tensor> {
        use std::os::unix::fs::FileExt;
        let info = &self.tensors[name];
        let kind = kind(info.dtype).ok_or_else(|| {
            checkpoint(
                Some(&self.path),
                format!("`{name}` has dtype {:?}", info.dtype),
            )
        })?;
        let (start, end) = info.data_offsets;
        let rows = info.shape.first().copied().unwrap_or(1).max(1);
        let row_bytes = (end - start) / rows;
        let mut bytes = vec![0u8; count as usize * row_bytes];
        let at = self.data_start + (start + first as usize * row_bytes) as u64;
        self.file
            .read_exact_at(&mut bytes, at)
            .map_err(io("reading", &self.path))?;
        let mut size: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        if let Some(d0) = size.first_mut() {
            *d0 = count;
        }
        Ok(Tensor::f_from_data_size(&bytes, &size, kind)?)
    }
}

/// Loads the safetensors file `path` into `vs`, as `VarStore::load` does (every
/// variable of the store must be in the file, with its shape), or with `partial` as
/// `VarStore::load_partial` does (the variables the file lacks are left as they are,
/// and returned by name). A sharded variable (ZeRO stage 3, a unit of `units`) reads
/// only this rank's rows of the file, cast to its dtype; the others read their own
/// bytes and take the file's dtype, as tch's loads do. Every rank calls it (the units
/// that are gathered gather their new values: a collective).
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::Checkpoint`] when it is not a
/// safetensors file, lacks a variable (but with `partial`) or has it in another shape;
/// [`Error::Collective`] when a gather fails.
pub(crate) fn load(
    units: Option<&Units>,
    vs: &VarStore,
    path: &Path,
    partial: bool,
) -> Result<Vec<String>> {
    let file = ModelFile::open(path)?;
    let mut names: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    let mut missing = Vec::new();
    for (name, var) in &names {
        let Some(shape) = file.shape(name) else {
            match partial {
                true => {
                    missing.push(name.clone());
                    continue;
                }
                false => {
                    let message = format!("no variable `{name}` (the model has it)");
                    return Err(checkpoint(Some(path), message));
                }
            }
        };
        if shape != var.size() {
            let message = format!("`{name}` has shape {shape:?}, the model {:?}", var.size());
            return Err(checkpoint(Some(path), message));
        }
        let mut rows = |first: i64, count: i64| file.rows(name, first, count);
        let sharded = match units {
            Some(units) => units.load_rows(var, &mut rows)?,
            None => false,
        };
        if !sharded {
            let whole = rows(0, shape.first().copied().unwrap_or(1))?;
            tch::no_grad(|| -> Result<()> {
                let mut var = var.shallow_clone();
                if var.kind() != whole.kind() {
                    var.set_data(&var.to_kind(whole.kind()));
                }
                var.f_copy_(&whole)?;
                Ok(())
            })?;
        }
    }
    if let Some(units) = units {
        units.after_load()?;
    }
    Ok(missing)
}
