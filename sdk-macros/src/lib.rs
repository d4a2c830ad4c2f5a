//! The `#[distributed]` attribute of `tch-distributed`. Use it through the runtime
//! crate: `use tch_distributed::distributed;`, where it is documented.

use proc_macro::TokenStream;

mod attr;
mod expand;
mod validate;

/// Turns a single-GPU `tch` training function into data-parallel training.
///
/// On entry the function joins the process group (or, run with no launcher and
/// `nproc_per_node`/`TCH_DISTRIBUTED_NPROC` above 1, launches its own ranks) and rank 0
/// prints the banner. In the body:
///
/// | single-GPU code | becomes |
/// |---|---|
/// | `Device::cuda_if_available()`, `Device::Cuda(i)` | this rank's device |
/// | `<config>.build(&vs, lr)` | also wraps `vs` in `DistributedDataParallel` |
/// | `opt.backward_step(&loss)` (`_clip`, `_clip_norm`), `loss.backward()` | gradients averaged over ranks |
/// | `for … in` a `TextDataIter` or `Iter2` | each rank gets disjoint batches, all the same count |
/// | `println!`, `print!`, `eprintln!`, `eprint!` | rank 0 only |
/// | `vs.save(p)` / `vs.load(p)` on a `VarStore` | rank 0 writes atomically between barriers / all load after a barrier |
///
/// Options: `backend = "gloo"|"nccl"`, `nproc_per_node = N`, `bucket_cap_mb = 25`,
/// `find_unused_parameters = true`, `timeout = SECONDS`, `crate = "path"`.
/// `async fn`, `const fn` and `extern fn` are rejected at compile time.
#[proc_macro_attribute]
pub fn distributed(args: TokenStream, item: TokenStream) -> TokenStream {
    entry(args.into(), item.into()).into()
}

fn entry(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let func: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            let e = syn::Error::new(
                e.span(),
                "#[distributed] goes on a training function (`fn`)",
            );
            return emit_with_error(item, e);
        }
    };
    let result = syn::parse2::<attr::Options>(args).and_then(|options| {
        validate::validate(&func)?;
        Ok(expand::expand(options, func))
    });
    match result {
        Ok(tokens) => tokens,
        // The user's function is still emitted so that IDEs keep working.
        Err(e) => emit_with_error(item, e),
    }
}

fn emit_with_error(item: proc_macro2::TokenStream, e: syn::Error) -> proc_macro2::TokenStream {
    let error = e.to_compile_error();
    quote::quote!(#error #item)
}
