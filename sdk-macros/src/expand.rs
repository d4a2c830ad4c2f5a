//! Validating the function and rewriting its body.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{parse_quote, parse_quote_spanned, Expr, ItemFn};

use crate::analysis::{may_call, receiver_ident, Analysis};
use crate::attr::Options;
use crate::rules::{ADAPTORS, FORWARD_METHODS, RESULT_METHODS, UNEVEN_ADAPTORS};

/// Where a function is: at the top level (`Scope::default()`), or a method of an
/// `impl` block under the attribute.
#[derive(Default)]
pub struct Scope {
    /// The block's type and `::` (`Trainer::`), which tells its methods' loops from
    /// other functions' of the same name; empty for a function.
    pub name: String,
    /// A method that returns the block's type (`-> Self`, `-> Result<Trainer>`): it
    /// builds the struct's fields, whose types the struct declares.
    pub constructor: bool,
}

/// The rewrites of DESIGN.md's table.
struct Rewrite {
    krate: TokenStream,
    /// What the function's names are: the optimizers it built, the loops that
    /// train.
    analysis: Analysis,
    /// Identifies the function's `for` loops, the same in every rank's binary: a hash
    /// of the function's name, and how many loops came before.
    loop_site: u64,
    /// Numbers the statements whose exits are agreed (their labels and names).
    exits: u64,
    /// Leave `.build(&vs, lr)` as written: in a constructor of an `impl` block under
    /// the attribute, whose optimizer goes into a field of the struct's own type
    /// (tch's `nn::Optimizer`), averaged by the DDP built at its first step.
    keep_build: bool,
    errors: Vec<syn::Error>,
}

/// The data source of a loop's iterator expression: the receiver under its chain of
/// [`ADAPTORS`] (`Iter2::new(…).shuffle()` in `Iter2::new(…).shuffle().enumerate()`),
/// or the expression itself.
fn source_of(expr: &mut Expr) -> &mut Expr {
    let depth = adaptors(expr).len();
    let mut source = expr;
    for _ in 0..depth {
        let Expr::MethodCall(m) = source else {
            unreachable!("counted above")
        };
        source = &mut m.receiver;
    }
    source
}

/// The [`ADAPTORS`] a loop's iterator expression ends with, outermost first.
fn adaptors(expr: &Expr) -> Vec<String> {
    let mut names = Vec::new();
    let mut e = expr;
    while let Expr::MethodCall(m) = e {
        let name = m.method.to_string();
        if !ADAPTORS.contains(&name.as_str()) {
            break;
        }
        names.push(name);
        e = &m.receiver;
    }
    names
}

/// Whether `expr` names a place without running anything: `opt`, `self.opt`,
/// `(*opt)`.
fn is_place(expr: &Expr) -> bool {
    match expr {
        Expr::Path(_) => true,
        Expr::Field(f) => is_place(&f.base),
        Expr::Paren(p) => is_place(&p.expr),
        Expr::Unary(u) => matches!(u.op, syn::UnOp::Deref(_)) && is_place(&u.expr),
        _ => false,
    }
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
            // Each rewritten call carries the span of the user's method name, as
            // rustc points at it: a type error in the call (a loss by value, a
            // learning rate that is no `f64`) is reported on the user's line.
            Expr::MethodCall(m) => {
                let recv = &m.receiver;
                let args: Vec<&Expr> = m.args.iter().collect();
                let method = m.method.to_string();
                let span = m.method.span();
                let k = &respanned(k, span);
                let on_optimizer =
                    receiver_ident(recv).is_some_and(|id| self.analysis.optimizers.contains(id));
                match (method.as_str(), args.as_slice()) {
                    // The arguments are checked once, against tch's own signature; the
                    // original call is type-checked, never run, so that the
                    // `OptimizerConfig` import it needs stays used.
                    // The receiver and arguments are evaluated once; the call as
                    // written is type-checked (its arguments against tch's own
                    // signature, an error pointing at the user's argument) and runs
                    // for a receiver that is no configuration the SDK knows.
                    ("build", [_, _]) if self.keep_build => None,
                    ("build", [vs, lr]) => {
                        let method = &m.method;
                        let (v, l) = (
                            syn::Ident::new("__tchd_vs", vs.span()),
                            syn::Ident::new("__tchd_lr", lr.span()),
                        );
                        Some(parse_quote_spanned!(span=>
                            (&#k::__private::Probe::new(#k::__private::build_call(
                                (#recv, #vs, #lr),
                                |(__tchd_config, #v, #l)| __tchd_config.#method(#v, #l),
                            )))
                            .__tchd_build()
                        ))
                    }
                    // The SDK's optimizer returns a `Result` where tch's returns
                    // nothing: its value's type decides.
                    (name, _) if on_optimizer && RESULT_METHODS.contains(&name) => {
                        Some(parse_quote_spanned!(span=>
                            (&#k::__private::Probe::new(#m)).__tchd_or_fail(#name)
                        ))
                    }
                    // `opt.step()` on an optimizer the function did not build (a
                    // field, an argument): the gradients are averaged first when its
                    // type is an optimizer's; anything else's `step` runs as written.
                    // Only on a place (`opt`, `self.opt`), which evaluating twice
                    // cannot change.
                    ("step", []) if is_place(recv) => Some(parse_quote_spanned!(span=> {
                        (&#k::__private::Probe::new(&#recv)).__tchd_before_step();
                        #m
                    })),
                    // Any other receiver (`self.opt.as_mut().unwrap()`, a helper's
                    // value) is evaluated once, into a `ref mut` binding, as the
                    // method call would borrow it.
                    ("step", []) => Some(parse_quote_spanned!(span=> {
                        match #recv {
                            ref mut __tchd_recv => {
                                (&#k::__private::Probe::new(&*__tchd_recv)).__tchd_before_step();
                                __tchd_recv.step()
                            }
                        }
                    })),
                    // By method syntax, so that the receiver is borrowed as the
                    // user's call borrows it (an owned optimizer, a `&mut` argument,
                    // a field); `Steps` decides by its type.
                    ("backward_step", [loss]) => Some(parse_quote_spanned!(span=>
                        #recv.__tchd_backward_step(#loss)
                    )),
                    ("backward_step_clip", [loss, max]) => Some(parse_quote_spanned!(span=>
                        #recv.__tchd_backward_step_clip(#loss, #max)
                    )),
                    ("backward_step_clip_norm", [loss, max]) => Some(parse_quote_spanned!(span=>
                        #recv.__tchd_backward_step_clip_norm(#loss, #max)
                    )),
                    ("backward", []) => match self.analysis.optimizers.as_slice() {
                        [] => None,
                        [opt] => Some(parse_quote_spanned!(span=>
                            (&#k::__private::Probe::new(&mut #opt)).__tchd_backward(&#recv)
                        )),
                        several => {
                            let names: Vec<String> =
                                several.iter().map(|i| format!("`{i}`")).collect();
                            self.errors.push(syn::Error::new_spanned(
                                &*m,
                                format!(
                                    "`.backward()` in a function with {} optimizers ({}): say which model the loss trains with `{}.backward(&loss)` (or `{}.backward_step(&loss)`), so that its gradients are averaged over the ranks",
                                    several.len(),
                                    names.join(", "),
                                    several[0],
                                    several[0]
                                ),
                            ));
                            None
                        }
                    },
                    // The receiver is evaluated once, into a `ref` binding: a place
                    // (`vs`) is borrowed, not moved; a temporary (`make_model()`)
                    // lives to the end of the match.
                    ("save", [path]) => Some(parse_quote_spanned!(span=> {
                        match #recv {
                            ref __tchd_recv => match (&#k::__private::Probe::new(__tchd_recv)).__tchd_var_store() {
                                ::std::option::Option::Some(__tchd_vs) => #k::__private::save(__tchd_vs, #path),
                                ::std::option::Option::None => __tchd_recv.save(#path),
                            },
                        }
                    })),
                    // The store behind `vs.root()` becomes known to the run, so that a
                    // `fully_shard` unit built under it can be sharded at once (ZeRO
                    // stage 3 builds in shards).
                    ("root", []) => Some(parse_quote_spanned!(span=> {
                        match #recv {
                            ref __tchd_recv => match (&#k::__private::Probe::new(__tchd_recv)).__tchd_var_store() {
                                ::std::option::Option::Some(__tchd_vs) => #k::__private::root(__tchd_vs),
                                ::std::option::Option::None => __tchd_recv.root(),
                            },
                        }
                    })),
                    ("load", [path]) => Some(parse_quote_spanned!(span=> {
                        match #recv {
                            ref mut __tchd_recv => match (&#k::__private::Probe::new(&mut *__tchd_recv)).__tchd_var_store_mut() {
                                ::std::option::Option::Some(__tchd_vs) => #k::__private::load(__tchd_vs, #path),
                                ::std::option::Option::None => __tchd_recv.load(#path),
                            },
                        }
                    })),
                    ("load_partial", [path]) => Some(parse_quote_spanned!(span=> {
                        match #recv {
                            ref mut __tchd_recv => match (&#k::__private::Probe::new(&mut *__tchd_recv)).__tchd_var_store_mut() {
                                ::std::option::Option::Some(__tchd_vs) => #k::__private::load_partial(__tchd_vs, #path),
                                ::std::option::Option::None => __tchd_recv.load_partial(#path),
                            },
                        }
                    })),
                    _ => None,
                }
            }
            // A range is never data: the loop stays as written.
            // A loop that trains nothing (an evaluation loop) runs whole on every
            // rank: whatever it sums or counts is then the one-process number on
            // every rank, with no gather to write.
            Expr::ForLoop(f) if self.analysis.sharded_loop(&f.expr, &f.body) => {
                // The data source is sharded before any adaptor (`.enumerate()`,
                // `.take(n)`, …), as an Accelerate-prepared DataLoader is: the adaptors
                // then apply to this rank's batches (`.take(n)`: n batches a rank).
                let iter = source_of(&mut f.expr);
                self.loop_site = self.loop_site.wrapping_mul(0x0100_0000_01b3) ^ 1;
                let site = self.loop_site;
                // The head (agreed seed) is made before the iterator expression runs:
                // tuple fields are evaluated in order. No block around the expression:
                // its temporaries (e.g. the Iter2 behind `.shuffle()`) must live as
                // long as the loop.
                let new_iter: Expr = parse_quote!((&#k::__private::Probe::new((
                    {
                        static __TCHD_RUNS: ::std::sync::atomic::AtomicU64 =
                            ::std::sync::atomic::AtomicU64::new(0);
                        #k::__private::loop_head(#site, &__TCHD_RUNS)
                    },
                    #iter,
                )))
                .__tchd_iter());
                *iter = new_iter;
                // Behind an adaptor that keeps a number of batches of its own (a
                // `filter`), the ranks may run out at different steps: they agree on
                // the loop's end.
                if adaptors(&f.expr)
                    .iter()
                    .any(|a| UNEVEN_ADAPTORS.contains(&a.as_str()))
                {
                    let whole = &f.expr;
                    *f.expr = parse_quote!(#k::__private::agreed_ends(#whole));
                }
                let own = f.label.as_ref().map(|l| l.name.clone());
                if let Err(errors) =
                    crate::exits::agree(k, &mut f.body, own.as_ref(), &mut self.exits)
                {
                    self.errors.extend(errors);
                }
                None
            }
            Expr::Macro(m) if is_print(&m.mac) => Some(print_on_main(k, &m.mac)),
            _ => None,
        };
        if let Some(r) = replacement {
            *expr = r;
        }
    }

    fn visit_local_mut(&mut self, local: &mut syn::Local) {
        visit_mut::visit_local_mut(self, local);
        // Always there, whatever the attribute says: the precision is a run-time
        // setting (attribute, `tchrun --mixed-precision`, the variable, the file), and
        // the guard does nothing when it is `no`.
        if let Some(init) = &mut local.init {
            if may_call(&init.expr, FORWARD_METHODS) {
                let k = &self.krate;
                let value = &init.expr;
                *init.expr = parse_quote!({
                    let __tchd_autocast = #k::__private::autocast();
                    #value
                });
            }
        }
    }

    fn visit_stmt_mut(&mut self, stmt: &mut syn::Stmt) {
        if let syn::Stmt::Macro(m) = stmt {
            if is_print(&m.mac) {
                let print = print_on_main(&self.krate, &m.mac);
                *stmt = parse_quote!(#print;);
                return;
            }
        }
        visit_mut::visit_stmt_mut(self, stmt);
    }
}

/// `tokens` with every span set to `span`: the crate's path in a rewritten call, so
/// that the whole callee is the user's (rustc labels a call by its callee's span).
fn respanned(tokens: &TokenStream, span: proc_macro2::Span) -> TokenStream {
    tokens
        .clone()
        .into_iter()
        .map(|mut tt| {
            if let proc_macro2::TokenTree::Group(g) = &tt {
                let mut group =
                    proc_macro2::Group::new(g.delimiter(), respanned(&g.stream(), span));
                group.set_span(span);
                tt = proc_macro2::TokenTree::Group(group);
            } else {
                tt.set_span(span);
            }
            tt
        })
        .collect()
}

fn is_print(mac: &syn::Macro) -> bool {
    mac.path
        .get_ident()
        .is_some_and(|i| i == "println" || i == "print" || i == "eprintln" || i == "eprint")
}

/// `println!(…)` and friends, as Accelerate's `accelerator.print`: the arguments are
/// evaluated on every rank (so code in them, a sample that draws random numbers or a
/// collective, runs everywhere alike) and rank 0 alone prints. `format_args!` holds
/// the evaluated arguments; formatting them is all that rank 0 alone does.
fn print_on_main(k: &TokenStream, mac: &syn::Macro) -> Expr {
    let name = mac.path.get_ident().expect("a print macro");
    let tokens = &mac.tokens;
    if tokens.is_empty() {
        // `println!()`: nothing to evaluate.
        return parse_quote!(if #k::__private::is_main_process() { ::std::#name!() });
    }
    parse_quote!(match ::std::format_args!(#tokens) {
        __tchd_args => {
            if #k::__private::is_main_process() {
                ::std::#name!("{}", __tchd_args)
            }
        }
    })
}

/// The function with its body rewritten and the entry prepended.
pub fn expand(
    options: Options,
    analysis: Analysis,
    mut func: ItemFn,
    scope: &Scope,
) -> syn::Result<TokenStream> {
    let krate = match &options.krate {
        Some(path) => quote!(#path),
        None => quote!(::tch_distributed),
    };
    // The settings written, as `(key, text)`: checked by their rows already (attr.rs),
    // read by the same rows at run time (`Settings::from_attribute`). The rest of the
    // run's settings come from the environment (`tch_distributed::settings`).
    let given = options
        .settings
        .iter()
        .map(|(key, value)| quote!((#key, #value)));

    let mut rewrite = Rewrite {
        krate: krate.clone(),
        analysis,
        loop_site: format!("{}{}", scope.name, func.sig.ident)
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            }),
        exits: 0,
        keep_build: scope.constructor,
        errors: Vec::new(),
    };
    rewrite.visit_block_mut(&mut func.block);
    if let Some(mut e) = rewrite.errors.pop() {
        for other in rewrite.errors {
            e.combine(other);
        }
        return Err(e);
    }
    Returns {
        krate: krate.clone(),
    }
    .visit_block_mut(&mut func.block);
    let block = &func.block;
    let finish = finish(&krate);
    *func.block = parse_quote!({
        #[allow(unused_imports)]
        use #krate::__private::{
            BackwardKnown as _, BackwardOther as _, BuildKnown as _, BuildOther as _,
            ExitKnown as _, ExitOther as _, ResultKnown as _, ResultOther as _,
            ShardKnown as _, ShardOther as _,
            StepKnown as _, StepOther as _, Steps as _, VarStoreMutKnown as _,
            VarStoreMutOther as _, VarStoreRefKnown as _, VarStoreRefOther as _,
        };
        let __tchd_session = #krate::__private::enter(&[#(#given),*]);
        let __tchd_out = #block;
        #finish
        __tchd_out
    });
    Ok(quote!(#func))
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
