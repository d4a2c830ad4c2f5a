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

fn entry(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let func: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            if let Ok(block) = syn::parse2::<syn::ItemImpl>(item.clone()) {
                return entry_impl(args, block);
            }
            let e = syn::Error::new(
                e.span(),
                "#[distributed] goes on a training function (`fn`) or on an `impl` block, \
                 whose methods it all adapts",
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
    let func = adapt(options, func, &expand::Scope::default(), &mut errors);
    let errors = errors.iter().map(syn::Error::to_compile_error);
    quote::quote!(#(#errors)* #func)
}

/// `#[distributed] impl T { … }`: every method of the block is a `#[distributed]`
/// function, so that a trainer whose loop calls its own methods (`self.train_step(…)`,
/// stepping `self.opt`) is adapted whole. The first method a rank calls joins the job;
/// one called from another shares it; each call from outside ends with the exit
/// barrier, so every rank must call the same methods.
fn entry_impl(
    args: proc_macro2::TokenStream,
    mut block: syn::ItemImpl,
) -> proc_macro2::TokenStream {
    let mut errors: Vec<syn::Error> = Vec::new();
    let options = syn::parse2::<attr::Options>(args).unwrap_or_else(|e| {
        errors.push(e);
        attr::Options::default()
    });
    // Loops are told apart by the type's name and the method's.
    let ty = &block.self_ty;
    let type_name = quote::quote!(#ty).to_string();
    let name = format!("{type_name}::");
    for item in &mut block.items {
        let syn::ImplItem::Fn(method) = item else {
            continue;
        };
        let func = syn::ItemFn {
            attrs: std::mem::take(&mut method.attrs),
            vis: method.vis.clone(),
            sig: method.sig.clone(),
            block: Box::new(method.block.clone()),
        };
        // A constructor (`-> Self`, `-> Result<Trainer>`) fills the struct's fields, whose
        // types the struct declares: its `.build(&vs, lr)` stays tch's optimizer,
        // averaged by the DDP the attribute builds at its first step.
        let returns = match &method.sig.output {
            syn::ReturnType::Type(_, t) => quote::quote!(#t).to_string(),
            syn::ReturnType::Default => String::new(),
        };
        let constructor = returns
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|w| w == "Self" || w == type_name);
        let scope = expand::Scope {
            name: name.clone(),
            constructor,
        };
        let mut method_errors = Vec::new();
        match syn::parse2::<syn::ItemFn>(adapt(options.clone(), func, &scope, &mut method_errors)) {
            Ok(adapted) => {
                method.attrs = adapted.attrs;
                method.sig = adapted.sig;
                method.block = *adapted.block;
            }
            Err(e) => errors.push(e),
        }
        errors.extend(method_errors);
    }
    let errors = errors.iter().map(syn::Error::to_compile_error);
    quote::quote!(#(#errors)* #block)
}

/// Validates and rewrites `func` (a function, or a method of a block under the
/// attribute, whose loops `scope` tells apart); its errors go to `errors`. Returns the
/// function expanded, or as written when it cannot be expanded or is `const`/`async`.
fn adapt(
    options: attr::Options,
    func: syn::ItemFn,
    scope: &expand::Scope,
    errors: &mut Vec<syn::Error>,
) -> proc_macro2::TokenStream {
    let item = quote::quote!(#func);
    let analysis = analysis::Analysis::of(&func);
    if let Err(e) = validate::validate(&func, &analysis) {
        errors.push(e);
    }
    if func.sig.constness.is_some() || func.sig.asyncness.is_some() {
        return item;
    }
    match expand::expand(options, analysis, func, scope) {
        Ok(tokens) => tokens,
        Err(e) => {
            errors.push(e);
            item
        }
    }
}

fn emit_with_error(item: proc_macro2::TokenStream, e: syn::Error) -> proc_macro2::TokenStream {
    let error = e.to_compile_error();
    quote::quote!(#error #item)
}
