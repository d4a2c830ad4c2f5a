//! The optimizer's state on disk, in `torch.optim`'s `state_dict` layout, as
//! safetensors: `state.{j}.{name}` tensors and the `param_groups` as JSON in the
//! file's metadata, `j` numbering the parameters group after group as `torch.optim`
//! numbers them.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{json, Value};
use tch::{Device, Tensor};

use super::kernels::{Algorithm, Group, Implementation, ParamState};
use super::{Mode, Optimizer};
use crate::error::{checkpoint, checkpoint_from, Result};
use crate::ffi;

/// The metadata keys: `torch.optim`'s `param_groups`, and the class they belong to.
const PARAM_GROUPS: &str = "param_groups";
const OPTIMIZER: &str = "optimizer";
/// In a file of a ZeRO run, which dim-0 chunk of every state tensor it holds:
/// `{"rank": r, "world_size": n}` (the rows `torch.chunk` gives rank r of n).
const DIM0_SHARD: &str = "dim0_shard";

/// `torch.optim`'s numbering of the optimizer's parameters: for each group, its
/// parameters' places in the optimizer (the store's order).
fn torch_order(opt: &Optimizer) -> Vec<Vec<usize>> {
    let mut groups = vec![Vec::new(); opt.groups.len()];
    for (i, &g) in opt.groups_of.iter().enumerate() {
        groups[g].push(i);
    }
    groups
}

/// The optimizer's parameters' names in the `VarStore` (`l1.weight`), in its order.
pub(super) fn param_names(opt: &Optimizer) -> Vec<String> {
    let v = opt.variables.lock().expect("variable store lock");
    let by_data: HashMap<usize, &String> = v
        .named_variables
        .iter()
        .map(|(name, t)| (crate::ffi::tensor_key(t), name))
        .collect();
    opt.params
        .iter()
        .map(|p| {
            by_data
                .get(&crate::ffi::tensor_key(p))
                .map_or_else(String::new, |n| n.to_string())
        })
        .collect()
}

/// One group's options as `torch.optim` writes them, with its parameters' numbers and
/// names (`param_names`, as `torch.optim` keeps them when given named parameters).
fn group_json(
    group: &Group,
    params: &[usize],
    names: &[&str],
    implementation: Implementation,
) -> Value {
    // tch's arithmetic is closest to torch.optim's foreach.
    let fused = implementation == Implementation::Fused;
    let (foreach, fused) = if fused {
        (Value::Null, Value::Bool(true))
    } else {
        (Value::Bool(true), Value::Null)
    };
    let lr = group.lr;
    match group.algorithm {
        Algorithm::Sgd {
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } => json!({
            "lr": lr, "momentum": momentum, "dampening": dampening,
            "weight_decay": weight_decay, "nesterov": nesterov, "maximize": false,
            "foreach": foreach, "differentiable": false, "fused": fused, "params": params,
            "param_names": names,
        }),
        Algorithm::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
            decoupled,
        } => json!({
            "lr": lr, "betas": [beta1, beta2], "eps": eps, "weight_decay": weight_decay,
            "amsgrad": amsgrad, "maximize": false, "foreach": foreach, "capturable": false,
            "differentiable": false, "fused": fused, "decoupled_weight_decay": decoupled,
            "params": params, "param_names": names,
        }),
        Algorithm::RmsProp {
            alpha,
            eps,
            weight_decay,
            momentum,
            centered,
        } => json!({
            "lr": lr, "momentum": momentum, "alpha": alpha, "eps": eps, "centered": centered,
            "weight_decay": weight_decay, "capturable": false, "foreach": foreach,
            "maximize": false, "differentiable": false, "params": params,
            "param_names": names,
        }),
    }
}

/// A group's options read back: `saved`'s values over `group`'s (same algorithm).
fn group_from_json(group: &Group, saved: &Value) -> Result<Group> {
    let number = |key: &str, current: f64| -> Result<f64> {
        match saved.get(key) {
            None => Ok(current),
            Some(v) => v.as_f64().ok_or_else(|| {
                checkpoint(
                    None,
                    format!("optimizer state: `{key}` is not a number: {v}"),
                )
            }),
        }
    };
    let flag =
        |key: &str, current: bool| saved.get(key).and_then(Value::as_bool).unwrap_or(current);
    let algorithm = match group.algorithm {
        Algorithm::Sgd {
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } => Algorithm::Sgd {
            momentum: number("momentum", momentum)?,
            dampening: number("dampening", dampening)?,
            weight_decay: number("weight_decay", weight_decay)?,
            nesterov: flag("nesterov", nesterov),
        },
        Algorithm::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
            decoupled,
        } => {
            let betas = saved.get("betas").and_then(Value::as_array);
            let beta = |k: usize, current: f64| {
                betas
                    .and_then(|b| b.get(k))
                    .and_then(Value::as_f64)
                    .unwrap_or(current)
            };
            Algorithm::Adam {
                beta1: beta(0, beta1),
                beta2: beta(1, beta2),
                eps: number("eps", eps)?,
                weight_decay: number("weight_decay", weight_decay)?,
                amsgrad: flag("amsgrad", amsgrad),
                decoupled,
            }
        }
        Algorithm::RmsProp {
            alpha,
            eps,
            weight_decay,
            momentum,
            centered,
        } => Algorithm::RmsProp {
            alpha: number("alpha", alpha)?,
            eps: number("eps", eps)?,
            weight_decay: number("weight_decay", weight_decay)?,
            momentum: number("momentum", momentum)?,
            centered: flag("centered", centered),
        },
    };
    Ok(Group {
        lr: number("lr", group.lr)?,
        algorithm,
    })
}

/// A tensor's bytes on the CPU, for safetensors.
struct Owned {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl Owned {
    fn new(name: String, t: &Tensor) -> Result<Owned> {
        let t = t.to_device(Device::Cpu).contiguous();
        let dtype = Dtype::try_from(t.kind())?;
        let numel = t.numel();
        let mut data = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut data, numel)?;
        Ok(Owned {
            name,
            dtype,
            shape: t.size().iter().map(|&d| d as usize).collect(),
            data,
        })
    }
}

/// See [`Optimizer::state`].
pub(super) fn to_safetensors(opt: &Optimizer) -> Result<Vec<u8>> {
    let algorithm = opt.defaults.algorithm;
    let names = algorithm.state_names();
    let order = torch_order(opt);
    let mut owned = Vec::new();
    for (j, &i) in order.iter().flatten().enumerate() {
        let Some(state) = &opt.state[i] else { continue };
        for (name, t) in names.iter().zip(&state.tensors) {
            if let Some(t) = t {
                // A shard's own rows, without its padding.
                let t = match opt.mode.sharding() {
                    Some(sharding) => sharding.unpadded(i, t),
                    None => t.shallow_clone(),
                };
                // A chunk that is the whole parameter (a scalar's, on rank 0) in its
                // shape, as torch.optim keeps it.
                let p = &opt.params[i];
                let t = match t.numel() == p.numel() && t.size() != p.size() {
                    true => t.reshape(p.size().as_slice()),
                    false => t,
                };
                owned.push(Owned::new(format!("state.{j}.{name}"), &t)?);
            }
        }
        if algorithm.has_step() {
            let step = Tensor::from(state.step as f32);
            owned.push(Owned::new(format!("state.{j}.step"), &step)?);
        }
    }
    let names = param_names(opt);
    let mut next = 0;
    let groups: Vec<Value> = opt
        .groups
        .iter()
        .zip(&order)
        .map(|(group, members)| {
            let numbers: Vec<usize> = (next..next + members.len()).collect();
            let member_names: Vec<&str> = members.iter().map(|&i| names[i].as_str()).collect();
            next += members.len();
            group_json(group, &numbers, &member_names, opt.implementation)
        })
        .collect();
    let mut metadata = HashMap::from([
        (PARAM_GROUPS.to_string(), Value::Array(groups).to_string()),
        (OPTIMIZER.to_string(), algorithm.torch_name().to_string()),
    ]);
    if let Some((rank, world_size)) = opt.dim0_shard() {
        let shard = json!({ "rank": rank, "world_size": world_size });
        metadata.insert(DIM0_SHARD.to_string(), shard.to_string());
    }
    if owned.is_empty() {
        // safetensors 0.3 writes `{},"__metadata__":…}` for no tensors, which it then
        // cannot read: the header alone, as the format lays it out (its length as a
        // little-endian u64, then the JSON, padded with spaces to 8 bytes).
        let mut header = json!({ "__metadata__": metadata }).to_string().into_bytes();
        header.resize(header.len().next_multiple_of(8), b' ');
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header);
        return Ok(bytes);
    }
    let views = owned
        .iter()
        .map(|o| {
            TensorView::new(o.dtype, o.shape.clone(), &o.data)
                .map(|v| (o.name.as_str(), v))
                .map_err(|e| checkpoint_from(None, format!("optimizer state `{}`: {e}", o.name), e))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::tensor::serialize(views, &Some(metadata))
        .map_err(|e| checkpoint_from(None, format!("optimizer state: {e}"), e))
}

/// See [`Optimizer::load_state_shards`]: the shards' groups must agree; the last
/// shard's options win. A parameter's state is the one file's that holds it (an
/// unsharded state, or a ZeRO-1 file of the former layout, whole parameters per rank),
/// or the dim-0 chunks of every file of a ZeRO run put together in rank order. A
/// sharded optimizer then keeps its own chunk of it.
pub(super) fn from_safetensors(opt: &mut Optimizer, shards: &[&[u8]]) -> Result<()> {
    let bad = |why: String| checkpoint(None, format!("optimizer state: {why}"));
    let n = opt.params.len();
    // Per parameter: its state tensors' pieces (with their dim-0 rank, if chunks) and
    // its step.
    let mut pieces: Vec<[Vec<(usize, Tensor)>; 3]> = (0..n).map(|_| Default::default()).collect();
    let mut steps: Vec<Option<u64>> = vec![None; n];
    let mut groups = opt.groups.clone();
    let mut chunked = Vec::new();
    for bytes in shards {
        let (read_groups, chunks, items) = read_shard(opt, bytes)?;
        for (i, slot, t) in items {
            match slot {
                // An unsharded file holds a parameter's whole state: one piece.
                Some(k) => pieces[i][k].push((chunks.map_or(0, |(rank, _)| rank), t)),
                None => steps[i] = Some(t.double_value(&[]) as u64),
            }
        }
        chunked.extend(chunks);
        groups = read_groups;
    }
    // The files of a ZeRO run hold every parameter's chunk: all of them, one per rank,
    // or the state put together would be short (or padded) of rows.
    if let Some(&(_, world)) = chunked.first() {
        let mut ranks: Vec<usize> = chunked.iter().map(|&(rank, _)| rank).collect();
        ranks.sort_unstable();
        let whole = chunked.len() == shards.len()
            && chunked.iter().all(|&(_, w)| w == world)
            && ranks.iter().copied().eq(0..world);
        if !whole {
            return Err(bad(format!(
                "the {} files given hold the chunks of ranks {ranks:?} of a run of {world} \
                 ranks (ZeRO): give every rank's file of the same checkpoint \
                 (`optimizer-rank-R.safetensors`, R = 0 to {}) once each",
                shards.len(),
                world - 1
            )));
        }
    }
    let mut state: Vec<Option<ParamState>> = (0..n).map(|_| None).collect();
    for (i, slots) in pieces.into_iter().enumerate() {
        let p = &opt.params[i];
        let mut tensors: [Option<Tensor>; 3] = [None, None, None];
        for (k, mut slot) in slots.into_iter().enumerate() {
            if slot.is_empty() {
                continue;
            }
            slot.sort_by_key(|(rank, _)| *rank);
            // A scalar's chunk is in the scalar's shape (0-dim) in the file of the rank
            // that holds it, and empty (`[0]`) in the others': one row and none.
            let parts: Vec<Tensor> = slot
                .into_iter()
                .map(|(_, t)| match t.dim() {
                    0 => t.reshape([1]),
                    _ => t,
                })
                .collect();
            let whole = match parts.len() {
                1 => parts.into_iter().next().expect("one part"),
                _ => Tensor::f_cat(&parts, 0).map_err(|e| {
                    let shapes: Vec<Vec<i64>> = parts.iter().map(Tensor::size).collect();
                    checkpoint_from(
                        None,
                        format!(
                            "optimizer state: the chunks of parameter {i}'s state, of shapes \
                             {shapes:?} in rank order, do not fit together: give the files \
                             of one checkpoint"
                        ),
                        e,
                    )
                })?,
            };
            let full = match whole.numel() == p.numel() && whole.size() != p.size() {
                // Chunks of a scalar, or of any shape, put together.
                true => whole.reshape(p.size().as_slice()),
                false => whole,
            };
            if full.size() != p.size() {
                return Err(bad(format!(
                    "the state of parameter {i} has shape {:?}, the parameter {:?}: load it \
                     into an optimizer over the same model",
                    full.size(),
                    p.size()
                )));
            }
            let full = full.to_device(p.device());
            tensors[k] = match &opt.mode {
                Mode::Sharded(sharding) => Some(sharding.chunk(i, &full)),
                // Stage 1: this rank's rows, none past the last.
                Mode::Zero1 { zero, .. } => zero.rows(i, &full).map(|rows| rows.copy()),
                Mode::Replicated(_) => Some(full),
            };
        }
        // Stage 1 keeps no state for a parameter of which this rank holds no rows.
        if opt
            .mode
            .zero1()
            .is_some_and(|zero| zero.rows(i, p).is_none())
        {
            continue;
        }
        if tensors.iter().any(Option::is_some) || steps[i].is_some() {
            state[i] = Some(ParamState {
                step: steps[i].unwrap_or(0),
                tensors,
                step_tensor: None,
            });
        }
    }
    opt.groups = groups;
    opt.state = state;
    Ok(())
}

/// One file's tensors: `(i, Some(k), t)` for parameter `i`'s state slot `k`, `(i,
/// None, step)` for its step.
type Items = Vec<(usize, Option<usize>, Tensor)>;

/// Reads one file: the groups' options it gives, the rank whose dim-0 chunks it holds
/// and the world size they were cut for (ZeRO), if it does, and its
/// tensors.
fn read_shard(
    opt: &Optimizer,
    bytes: &[u8],
) -> Result<(Vec<Group>, Option<(usize, usize)>, Items)> {
    let bad = |why: String| checkpoint(None, format!("optimizer state: {why}"));
    let unreadable =
        |e: safetensors::SafeTensorError| checkpoint_from(None, format!("optimizer state: {e}"), e);
    let file = SafeTensors::deserialize(bytes).map_err(unreadable)?;
    let (_, metadata) = SafeTensors::read_metadata(bytes).map_err(unreadable)?;
    let metadata = metadata.metadata().clone().unwrap_or_default();
    let ours = opt.defaults.algorithm.torch_name();
    match metadata.get(OPTIMIZER) {
        Some(theirs) if theirs == ours => {}
        Some(theirs) => {
            return Err(bad(format!(
                "it is the state of {theirs}, and this optimizer is {ours}: build the \
                 optimizer the checkpoint was saved with"
            )))
        }
        None => {
            return Err(bad(
                "no `optimizer` in its metadata: not a state that Optimizer::state wrote".into(),
            ))
        }
    }
    let chunks = match metadata.get(DIM0_SHARD) {
        None => None,
        Some(text) => {
            let shard: Value = serde_json::from_str(text).unwrap_or_default();
            let field = |key: &str| shard.get(key).and_then(Value::as_u64);
            match (field("rank"), field("world_size")) {
                (Some(rank), Some(world)) if rank < world => Some((rank as usize, world as usize)),
                _ => {
                    return Err(bad(format!(
                        "its `{DIM0_SHARD}` metadata, {text}, does not name a rank below a \
                         world size: give the files as Optimizer::state wrote them"
                    )))
                }
            }
        }
    };
    let saved_groups: Vec<Value> = metadata
        .get(PARAM_GROUPS)
        .and_then(|g| serde_json::from_str(g).ok())
        .ok_or_else(|| bad("no readable `param_groups` in its metadata".into()))?;
    let order = torch_order(opt);
    let counts: Vec<usize> = saved_groups
        .iter()
        .map(|g| {
            g.get("params")
                .and_then(Value::as_array)
                .map_or(0, Vec::len)
        })
        .collect();
    let ours_counts: Vec<usize> = order.iter().map(Vec::len).collect();
    if counts != ours_counts {
        return Err(bad(format!(
            "its parameter groups hold {counts:?} parameters, this optimizer's \
             {ours_counts:?}: load it into an optimizer over the same model"
        )));
    }
    let groups = opt
        .groups
        .iter()
        .zip(&saved_groups)
        .map(|(g, saved)| group_from_json(g, saved))
        .collect::<Result<Vec<_>>>()?;
    let names = opt.defaults.algorithm.state_names();
    let mut items = Vec::new();
    for (j, &i) in order.iter().flatten().enumerate() {
        for (k, name) in names.iter().enumerate() {
            if let Ok(view) = file.tensor(&format!("state.{j}.{name}")) {
                items.push((i, Some(k), Tensor::try_from(view)?));
            }
        }
        if let Ok(view) = file.tensor(&format!("state.{j}.step")) {
            items.push((i, None, Tensor::try_from(view)?));
        }
    }
    Ok((groups, chunks, items))
}

/// See [`Optimizer::load_libtorch_archive`].
pub(super) fn from_libtorch_archive(opt: &mut Optimizer, bytes: &[u8]) -> Result<()> {
    let kind = match opt.defaults.algorithm {
        Algorithm::Sgd { .. } => 0,
        Algorithm::Adam {
            decoupled: false, ..
        } => 1,
        Algorithm::Adam {
            decoupled: true, ..
        } => 2,
        Algorithm::RmsProp { .. } => 3,
    };
    let groups: Vec<i64> = opt.groups_of.iter().map(|&g| g as i64).collect();
    let (out, steps) =
        ffi::optim::archive_state(kind, &ffi::TensorArray::new(&opt.params), &groups, bytes)
            .map_err(|t| {
                let message = format!(
                    "optimizer.pt (libtorch's optimizer archive): {}",
                    t.message()
                );
                checkpoint_from(None, message, t)
            })?;
    let mut taken = out.into_iter();
    opt.state = steps
        .iter()
        .map(|&step| {
            let mut tensors: [Option<Tensor>; 3] = [None, None, None];
            for t in tensors.iter_mut() {
                *t = taken.next().flatten();
            }
            let _unused = taken.next();
            (step >= 0).then_some(ParamState {
                step: step as u64,
                tensors,
                step_tensor: None,
            })
        })
        .collect();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{self, Module};
    use tch::Kind;

    /// Stage 2 and 3 write dim-0 chunks, one file per rank, each naming its rank in its
    /// metadata: they load in any order, put together by rank, and a missing rank's
    /// file is an error rather than a state short of rows.
    #[test]
    fn chunk_files_load_in_any_order_and_every_rank_s_must_be_there() {
        let model = || {
            let vs = nn::VarStore::new(Device::Cpu);
            // A weight of 3 rows and a bias of 3: chunks of 2 rows and 1 over 2 ranks.
            let net = nn::linear(vs.root(), 2, 3, Default::default());
            let opt = Optimizer::new(&nn::Adam::default(), &vs, 0.1).unwrap();
            (vs, net, opt)
        };
        let (_vs, net, mut opt) = model();
        let x = Tensor::ones([4, 2], (Kind::Float, Device::Cpu));
        opt.backward_step(&net.forward(&x).sum(Kind::Float))
            .unwrap();
        let whole = opt.state().unwrap();
        let tensors = |bytes: &[u8]| -> Vec<(String, Vec<u8>)> {
            let file = SafeTensors::deserialize(bytes).unwrap();
            let mut all: Vec<(String, Vec<u8>)> = file
                .tensors()
                .into_iter()
                .map(|(name, view)| (name, view.data().to_vec()))
                .collect();
            all.sort();
            all
        };
        let chunk = |rank: usize| chunk_file(&whole, rank, [(0, 2), (2, 1)][rank]);
        let (rank0, rank1) = (chunk(0), chunk(1));
        for files in [[&rank0[..], &rank1[..]], [&rank1[..], &rank0[..]]] {
            let (_vs, _net, mut loaded) = model();
            loaded.load_state_shards(&files).unwrap();
            assert_eq!(tensors(&loaded.state().unwrap()), tensors(&whole));
        }
        let (_vs, _net, mut short) = model();
        let err = short
            .load_state_shards(&[&rank1[..]])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ranks [1] of a run of 2"), "{err}");
        assert!(short.load_state_shards(&[&rank0[..], &rank0[..]]).is_err());
    }

    /// Rank `rank`'s file of a 2-rank run as stage 2 writes it, cut from the unsharded
    /// state `whole`: `rows` rows of every state tensor from row `first`.
    fn chunk_file(whole: &[u8], rank: usize, (first, rows): (usize, usize)) -> Vec<u8> {
        let file = SafeTensors::deserialize(whole).unwrap();
        let (_, metadata) = SafeTensors::read_metadata(whole).unwrap();
        let mut metadata = metadata.metadata().clone().unwrap();
        let shard = json!({ "rank": rank, "world_size": 2 });
        metadata.insert(DIM0_SHARD.to_string(), shard.to_string());
        let parts: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let (mut shape, data) = (view.shape().to_vec(), view.data());
                if name.ends_with(".step") {
                    return (name, view.dtype(), shape, data.to_vec());
                }
                let row = data.len() / shape[0];
                shape[0] = rows;
                let data = data[first * row..(first + rows) * row].to_vec();
                (name, view.dtype(), shape, data)
            })
            .collect();
        let views = parts.iter().map(|(name, dtype, shape, data)| {
            (
                name.as_str(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        });
        safetensors::tensor::serialize(views, &Some(metadata)).unwrap()
    }

    /// Chunks that do not fit together (the files of two checkpoints of other models)
    /// are an error that says so, not libtorch's panic.
    #[test]
    fn chunks_that_do_not_fit_together_are_an_error() {
        let stepped = |inputs: i64| {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = nn::linear(vs.root(), inputs, 3, Default::default());
            let mut opt = Optimizer::new(&nn::Adam::default(), &vs, 0.1).unwrap();
            let x = Tensor::ones([4, inputs], (Kind::Float, Device::Cpu));
            opt.backward_step(&net.forward(&x).sum(Kind::Float))
                .unwrap();
            (vs, opt)
        };
        let (_vs, mut opt) = stepped(2);
        let (_other_vs, mut other) = stepped(5);
        let rank0 = chunk_file(&opt.state().unwrap(), 0, (0, 2));
        let rank1 = chunk_file(&other.state().unwrap(), 1, (2, 1));
        let err = opt
            .load_state_shards(&[&rank0[..], &rank1[..]])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shapes [[2, 2], [1, 5]] in rank order, do not fit together"),
            "{err}"
        );
    }

    /// The tensors' names of a state after one step, as `torch.optim`'s `state_dict`
    /// names them: SGD keeps no `step`, Adam does.
    #[test]
    fn the_state_has_torch_optims_keys() {
        let names = |config: &dyn crate::optim::OptimizerKind| -> Vec<String> {
            let vs = nn::VarStore::new(Device::Cpu);
            let net = nn::linear(vs.root(), 2, 1, Default::default());
            let mut opt = Optimizer::new(&config.algorithm(), &vs, 0.1).unwrap();
            let x = Tensor::ones([3, 2], (Kind::Float, Device::Cpu));
            opt.backward_step(&net.forward(&x).sum(Kind::Float))
                .unwrap();
            let bytes = opt.state().unwrap();
            let mut names: Vec<String> = SafeTensors::deserialize(&bytes)
                .unwrap()
                .names()
                .into_iter()
                .cloned()
                .collect();
            names.sort();
            names
        };
        let sgd = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        };
        assert_eq!(
            names(&sgd),
            ["state.0.momentum_buffer", "state.1.momentum_buffer"]
        );
        assert_eq!(
            names(&nn::RmsProp::default()),
            [
                "state.0.square_avg",
                "state.0.step",
                "state.1.square_avg",
                "state.1.step"
            ]
        );
        let rms = nn::RmsProp {
            momentum: 0.9,
            centered: true,
            ..Default::default()
        };
        assert_eq!(
            names(&rms),
            [
                "state.0.grad_avg",
                "state.0.momentum_buffer",
                "state.0.square_avg",
                "state.0.step",
                "state.1.grad_avg",
                "state.1.momentum_buffer",
                "state.1.square_avg",
                "state.1.step"
            ]
        );
        assert_eq!(
            names(&nn::Adam::default()),
            [
                "state.0.exp_avg",
                "state.0.exp_avg_sq",
                "state.0.step",
                "state.1.exp_avg",
                "state.1.exp_avg_sq",
                "state.1.step"
            ]
        );
    }
}
