// `vs.save(p)` and `vs.load(p)` on a `VarStore` (and through `&VarStore`) become the
// rank-aware versions; `save` on a `Tensor` is left alone. The receiver is evaluated
// once, whatever its type.
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed]
fn train(dir: &std::path::Path) -> anyhow::Result<()> {
    let mut vs = VarStore::new(Device::Cpu);
    let _net = nn::linear(vs.root(), 2, 2, Default::default());
    vs.save(dir.join("a.safetensors"))?;
    let by_ref: &VarStore = &vs;
    by_ref.save(dir.join("b.safetensors"))?;
    vs.load(dir.join("a.safetensors"))?;
    Tensor::ones([2], (Kind::Float, Device::Cpu)).save(dir.join("t.pt"))?;
    // Receivers with a side effect: one call each.
    let calls = std::cell::Cell::new(0);
    let tensor = || {
        calls.set(calls.get() + 1);
        Tensor::ones([2], (Kind::Float, Device::Cpu))
    };
    tensor().save(dir.join("once.pt"))?;
    let store = || {
        calls.set(calls.get() + 1);
        &vs
    };
    store().save(dir.join("c.safetensors"))?;
    fn counted<'a>(calls: &std::cell::Cell<i32>, vs: &'a mut VarStore) -> &'a mut VarStore {
        calls.set(calls.get() + 1);
        vs
    }
    counted(&calls, &mut vs).load(dir.join("c.safetensors"))?;
    assert_eq!(calls.get(), 3, "each receiver evaluated once");
    Ok(())
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("ui-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    train(&dir)?;
    for f in ["a.safetensors", "b.safetensors", "t.pt", "once.pt", "c.safetensors"] {
        assert!(dir.join(f).exists(), "{f}");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
