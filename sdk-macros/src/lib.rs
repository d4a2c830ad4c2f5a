//! The `#[distributed]` attribute of `tch-distributed`. Use it through the runtime
//! crate: `use tch_distributed::distributed;`, where it is documented.

use proc_macro::TokenStream;

mod attr;
mod expand;
mod validate;

// Documented where users see it, on the re-export `tch_distributed::distributed`
// (sdk/src/distributed.md), whose examples compile there.
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
        expand::expand(options, func)
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
