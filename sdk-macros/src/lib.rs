//! The `#[distributed]` attribute of `tch-distributed`. Use it through the runtime
//! crate: `use tch_distributed::distributed;`, where it is documented.

use proc_macro::TokenStream;

mod analysis;
mod attr;
mod exits;
mod expand;
mod rules;
mod validate;

// Documented where users see it, on the re-export `tch_distributed::distributed`
// (sdk/src/distributed.md), whose examples compile there.
#[proc_macro_attribute]
pub fn distributed(args: TokenStream, item: TokenStream) -> TokenStream {
    entry(args.into(), item.into()).into()
}

/// The attribute's options, as `&[&str]`: what `tch_distributed::settings::TABLE`
/// is tested against (its rows that say `attribute`), so that the two cannot drift.
#[doc(hidden)]
#[proc_macro]
pub fn __attribute_options(_: TokenStream) -> TokenStream {
    let names = attr::VALID.split(", ");
    quote::quote!(&[#(#names),*]).into()
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
    // Every error is reported; the function is still emitted (expanded with the
    // default options when they did not parse, or as written when it cannot be
    // expanded or is `const`/`async`), so that the rest of the program type-checks as
    // it will once the errors are fixed, and IDEs keep working.
    let mut errors: Vec<syn::Error> = Vec::new();
    let options = syn::parse2::<attr::Options>(args).unwrap_or_else(|e| {
        errors.push(e);
        attr::Options::default()
    });
    let analysis = analysis::Analysis::of(&func);
    if let Err(e) = validate::validate(&func, &analysis) {
        errors.push(e);
    }
    let (tokens, expand_error) = if func.sig.constness.is_some() || func.sig.asyncness.is_some() {
        (item, None)
    } else {
        match expand::expand(options, analysis, func) {
            Ok(tokens) => (tokens, None),
            Err(e) => (item, Some(e)),
        }
    };
    errors.extend(expand_error);
    let errors = errors.iter().map(syn::Error::to_compile_error);
    quote::quote!(#(#errors)* #tokens)
}

fn emit_with_error(item: proc_macro2::TokenStream, e: syn::Error) -> proc_macro2::TokenStream {
    let error = e.to_compile_error();
    quote::quote!(#error #item)
}
