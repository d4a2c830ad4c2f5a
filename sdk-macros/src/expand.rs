//! Validating the function and rewriting its body.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{parse_quote, Expr, ItemFn};

use crate::attr::Options;

/// The rewrites of DESIGN.md's table.
struct Rewrite {
    krate: TokenStream,
}

fn path_ends_with(expr: &Expr, segments: &[&str]) -> bool {
    let Expr::Path(p) = expr else { return false };
    let names: Vec<String> = p
        .path
        .segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect();
    names.len() >= segments.len()
        && names[names.len() - segments.len()..]
            .iter()
            .zip(segments)
            .all(|(a, b)| a == b)
}

impl VisitMut for Rewrite {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        visit_mut::visit_expr_mut(self, expr);
        let k = &self.krate;
        let replacement: Option<Expr> = match expr {
            Expr::Call(call)
                if (path_ends_with(&call.func, &["Device", "cuda_if_available"])
                    && call.args.is_empty())
                    || (path_ends_with(&call.func, &["Device", "Cuda"])
                        && call.args.len() == 1) =>
            {
                // The requested device is still evaluated (and its imports used):
                // the rank's device replaces it.
                let span = call.span();
                Some(syn::parse2(quote_spanned!(span=> #k::__private::device(#call))).unwrap())
            }
            Expr::MethodCall(m) => {
                let recv = &m.receiver;
                let args: Vec<&Expr> = m.args.iter().collect();
                match (m.method.to_string().as_str(), args.as_slice()) {
                    ("build", [vs, lr]) => Some(parse_quote!({
                        let __tchd_vs = #vs;
                        #k::__private::wrap_optimizer(#recv.build(__tchd_vs, #lr), __tchd_vs)
                    })),
                    ("backward_step", [loss]) => {
                        Some(parse_quote!(#k::__private::backward_step(&mut #recv, #loss)))
                    }
                    ("backward_step_clip", [loss, max]) => Some(
                        parse_quote!(#k::__private::backward_step_clip(&mut #recv, #loss, #max)),
                    ),
                    ("backward_step_clip_norm", [loss, max]) => Some(
                        parse_quote!(#k::__private::backward_step_clip_norm(&mut #recv, #loss, #max)),
                    ),
                    ("backward", []) => Some(parse_quote!(#k::__private::backward(&#recv))),
                    ("save", [path]) => Some(parse_quote!({
                        match (&#k::__private::Probe::new(&#recv)).__tchd_var_store() {
                            ::std::option::Option::Some(__tchd_vs) => #k::__private::save(__tchd_vs, #path),
                            ::std::option::Option::None => #recv.save(#path),
                        }
                    })),
                    ("load", [path]) => Some(parse_quote!({
                        match (&#k::__private::Probe::new(&mut #recv)).__tchd_var_store_mut() {
                            ::std::option::Option::Some(__tchd_vs) => #k::__private::load(__tchd_vs, #path),
                            ::std::option::Option::None => #recv.load(#path),
                        }
                    })),
                    _ => None,
                }
            }
            Expr::ForLoop(f) => {
                let iter = &f.expr;
                // No block around it: temporaries in the iterator expression (e.g. the
                // Iter2 behind `.shuffle()`) must live as long as the loop.
                let new_iter: Expr =
                    parse_quote!((&#k::__private::Probe::new(#iter)).__tchd_iter());
                *f.expr = new_iter;
                None
            }
            Expr::Macro(m) if is_print(&m.mac) => {
                let mac = &m.mac;
                Some(parse_quote!(if #k::__private::is_main_process() { #mac }))
            }
            _ => None,
        };
        if let Some(r) = replacement {
            *expr = r;
        }
    }

    fn visit_stmt_mut(&mut self, stmt: &mut syn::Stmt) {
        if let syn::Stmt::Macro(m) = stmt {
            if is_print(&m.mac) {
                let k = &self.krate;
                let mac = &m.mac;
                *stmt = parse_quote!(if #k::__private::is_main_process() { #mac; });
                return;
            }
        }
        visit_mut::visit_stmt_mut(self, stmt);
    }
}

fn is_print(mac: &syn::Macro) -> bool {
    mac.path
        .get_ident()
        .is_some_and(|i| i == "println" || i == "print" || i == "eprintln" || i == "eprint")
}

/// The function with its body rewritten and the entry prepended.
pub fn expand(options: Options, mut func: ItemFn) -> TokenStream {
    let krate = match &options.krate {
        Some(path) => quote!(#path),
        None => quote!(::tch_distributed),
    };
    let backend = match &options.backend {
        Some(b) => quote!(::std::option::Option::Some(#b)),
        None => quote!(::std::option::Option::None),
    };
    let opt = |o: Option<TokenStream>| match o {
        Some(t) => quote!(::std::option::Option::Some(#t)),
        None => quote!(::std::option::Option::None),
    };
    let nproc = opt(options.nproc_per_node.map(|n| quote!(#n)));
    let bucket = opt(options.bucket_cap_mb.map(|n| quote!(#n)));
    let timeout = opt(options.timeout.map(|n| quote!(#n)));
    let find_unused = options.find_unused_parameters;

    Rewrite {
        krate: krate.clone(),
    }
    .visit_block_mut(&mut func.block);
    Returns {
        krate: krate.clone(),
    }
    .visit_block_mut(&mut func.block);
    let block = &func.block;
    let finish = finish(&krate);
    *func.block = parse_quote!({
        #[allow(unused_imports)]
        use #krate::__private::{
            ExitKnown as _, ExitOther as _, ShardKnown as _, ShardOther as _,
            VarStoreMutKnown as _, VarStoreMutOther as _, VarStoreRefKnown as _,
            VarStoreRefOther as _,
        };
        let __tchd_session = #krate::__private::enter(#krate::__private::Options {
            backend: #backend,
            nproc_per_node: #nproc,
            bucket_cap_mb: #bucket,
            find_unused_parameters: #find_unused,
            timeout_secs: #timeout,
        });
        let __tchd_out = #block;
        #finish
        __tchd_out
    });
    quote!(#func)
}

/// Run on every normal exit from the function: the exit barrier, unless the
/// function returns an `Err` (a rank that failed leaves at once, so that the
/// launcher sees it and stops the others instead of all waiting for it).
fn finish(krate: &TokenStream) -> TokenStream {
    quote!(__tchd_session.finish((&#krate::__private::Probe::new(&__tchd_out)).__tchd_failed());)
}

/// `return x` → `return { let __tchd_out = x; <finish>; __tchd_out }`, except in
/// closures and nested items, whose `return`s are their own.
struct Returns {
    krate: TokenStream,
}

impl VisitMut for Returns {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        match expr {
            Expr::Closure(_) | Expr::Async(_) | Expr::Const(_) => {}
            Expr::Return(r) => {
                if let Some(value) = &mut r.expr {
                    self.visit_expr_mut(value);
                }
                let value = match &r.expr {
                    Some(v) => quote!(#v),
                    None => quote!(()),
                };
                let finish = finish(&self.krate);
                r.expr = Some(Box::new(parse_quote!({
                    let __tchd_out = #value;
                    #finish
                    __tchd_out
                })));
            }
            _ => visit_mut::visit_expr_mut(self, expr),
        }
    }
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}
