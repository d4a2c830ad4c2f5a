//! One pass over the function that validation and the rewrite both read: what its
//! locals and parameters are (optimizers, training closures, the context or process
//! group), which loops train, which conditions depend on the rank, and which calls
//! every rank must make together. The two cannot disagree: a loop that the rewrite
//! shards is the loop that validation treats as a collective.

use std::collections::BTreeSet;

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::visit::{self, Visit};
use syn::{parse_quote, Expr, ItemFn};

use crate::rules::{GROUP_SOURCES, HANDS_ON, RANK_NAMES, TRAINING_CALLS};

/// What the function's names are, found once.
pub struct Analysis {
    /// [`RANK_NAMES`] and the locals bound from them (`let main = ctx.rank() == 0;`),
    /// followed through chains of `let`s.
    pub rank_names: BTreeSet<String>,
    /// Locals bound to an optimizer that `.build(&vs, lr)` made (the SDK's
    /// `Optimizer` once rewritten).
    pub optimizers: Vec<syn::Ident>,
    /// What makes a loop that is handed it, or calls it, a training loop: the
    /// optimizers above, the parameters whose declared type names an optimizer
    /// (`opt: &mut nn::Optimizer`), and the closures that train (`let mut train_step =
    /// |x, y| { …; opt.backward_step(&loss) };`).
    pub trainers: Vec<syn::Ident>,
    /// Locals and parameters that hold the job's context or its process group
    /// (`let ctx = tch_distributed::current().unwrap();`, `pg: &ProcessGroup`).
    pub groups: Vec<syn::Ident>,
}

impl Analysis {
    pub fn of(func: &ItemFn) -> Self {
        let mut optimizers = OptimizerLocals(Vec::new());
        optimizers.visit_block(&func.block);
        let optimizers = optimizers.0;
        let mut trainers = typed_params(&func.sig, &["Optimizer"]);
        trainers.extend(optimizers.iter().cloned());
        let closures = training_closures(&func.block, &trainers);
        trainers.extend(closures);
        let mut groups = typed_params(&func.sig, &["Context", "ProcessGroup"]);
        groups.extend(group_locals(&func.block, &groups));
        Analysis {
            rank_names: rank_dependent_locals(func),
            optimizers,
            trainers,
            groups,
        }
    }

    /// Whether `expr` depends on the rank: it mentions one of [`Self::rank_names`].
    pub fn depends_on_rank(&self, expr: &Expr) -> bool {
        mentions(expr.to_token_stream(), &self.rank_names)
    }

    /// Whether a loop body trains: it runs a backward pass or an optimizer step
    /// ([`TRAINING_CALLS`]), passes one of [`Self::trainers`] to a call or calls one,
    /// or calls a method on `self` (which may hold the optimizer and step it).
    /// Closures and nested loops count; items do not. The rewrite shards such a loop;
    /// any other loop (an evaluation loop) runs whole on every rank.
    pub fn trains(&self, body: &syn::Block) -> bool {
        trains(body, &self.trainers)
    }

    /// Whether a `for` loop over `expr` with `body` is sharded by the rewrite: a
    /// training loop over anything but a range.
    pub fn sharded_loop(&self, expr: &Expr, body: &syn::Block) -> bool {
        !matches!(expr, Expr::Range(_)) && self.trains(body)
    }

    /// The name of the optimizer, training closure, context or process group that a
    /// call's argument hands on (`&mut opt`, `ctx`, `&ctx.process_group()`), if any.
    pub fn handed_on(&self, arg: &Expr) -> Option<&syn::Ident> {
        match arg {
            Expr::Reference(r) => self.handed_on(&r.expr),
            Expr::Paren(p) => self.handed_on(&p.expr),
            Expr::MethodCall(m)
                if m.args.is_empty() && HANDS_ON.contains(&m.method.to_string().as_str()) =>
            {
                self.handed_on(&m.receiver)
            }
            _ => receiver_ident(arg)
                .and_then(|id| self.trainers.iter().chain(&self.groups).find(|t| *t == id)),
        }
    }
}

/// Whether `tokens` mention one of `names` as an identifier.
fn mentions(tokens: TokenStream, names: &BTreeSet<String>) -> bool {
    tokens.into_iter().any(|t| match t {
        proc_macro2::TokenTree::Ident(i) => names.contains(&i.to_string()),
        proc_macro2::TokenTree::Group(g) => mentions(g.stream(), names),
        _ => false,
    })
}

/// The identifiers a pattern binds: `x`, `(a, b)`, `x: T`, `&x`.
fn collect_idents(pat: &syn::Pat, out: &mut Vec<syn::Ident>) {
    match pat {
        syn::Pat::Ident(p) => out.push(p.ident.clone()),
        syn::Pat::Type(p) => collect_idents(&p.pat, out),
        syn::Pat::Tuple(p) => p.elems.iter().for_each(|p| collect_idents(p, out)),
        syn::Pat::Reference(p) => collect_idents(&p.pat, out),
        _ => {}
    }
}

/// Every `let` of the body with its initializer (not inside items).
fn lets(block: &syn::Block) -> Vec<(Vec<syn::Ident>, Expr)> {
    struct Lets(Vec<(Vec<syn::Ident>, Expr)>);
    impl<'ast> Visit<'ast> for Lets {
        fn visit_local(&mut self, local: &'ast syn::Local) {
            if let Some(init) = &local.init {
                let mut names = Vec::new();
                collect_idents(&local.pat, &mut names);
                self.0.push((names, (*init.expr).clone()));
            }
            visit::visit_local(self, local);
        }
        fn visit_item(&mut self, _: &'ast syn::Item) {}
    }
    let mut lets = Lets(Vec::new());
    lets.visit_block(block);
    lets.0
}

fn rank_dependent_locals(func: &ItemFn) -> BTreeSet<String> {
    let lets: Vec<(Vec<syn::Ident>, TokenStream)> = lets(&func.block)
        .into_iter()
        .map(|(names, init)| (names, init.to_token_stream()))
        .collect();
    let mut names: BTreeSet<String> = RANK_NAMES.iter().map(|s| s.to_string()).collect();
    loop {
        let before = names.len();
        for (bound, init) in &lets {
            if mentions(init.clone(), &names) {
                names.extend(bound.iter().map(|i| i.to_string()));
            }
        }
        if names.len() == before {
            return names;
        }
    }
}

/// The locals bound to the context or process group: from a call in
/// [`GROUP_SOURCES`], or from another such local (`let pg = ctx.process_group();`),
/// through `?`, `.unwrap()`, `.expect(…)`, `.clone()` and references.
fn group_locals(block: &syn::Block, params: &[syn::Ident]) -> Vec<syn::Ident> {
    fn source(e: &Expr, known: &[syn::Ident]) -> bool {
        match e {
            Expr::Reference(r) => source(&r.expr, known),
            Expr::Paren(p) => source(&p.expr, known),
            Expr::Try(t) => source(&t.expr, known),
            Expr::MethodCall(m) if m.method == "process_group" => true,
            Expr::MethodCall(m) if HANDS_ON.contains(&m.method.to_string().as_str()) => {
                source(&m.receiver, known)
            }
            Expr::Call(c) => matches!(&*c.func, Expr::Path(p)
                if p.path.segments.last().is_some_and(|s| GROUP_SOURCES.contains(&s.ident.to_string().as_str()))),
            _ => receiver_ident(e).is_some_and(|id| known.contains(id)),
        }
    }
    let lets = lets(block);
    let mut known = params.to_vec();
    loop {
        let before = known.len();
        for (bound, init) in &lets {
            if let [id] = bound.as_slice() {
                if !known.contains(id) && source(init, &known) {
                    known.push(id.clone());
                }
            }
        }
        if known.len() == before {
            return known[params.len()..].to_vec();
        }
    }
}

/// Finds the method calls named in `names` (with `args` arguments, if given).
struct Finds<'a> {
    names: &'a [&'a str],
    args: Option<usize>,
    /// Whether calls inside closures count.
    closures: bool,
    found: bool,
}

impl<'ast> Visit<'ast> for Finds<'_> {
    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        if self.names.iter().any(|n| m.method == n) && self.args.is_none_or(|a| a == m.args.len()) {
            self.found = true;
        }
        visit::visit_expr_method_call(self, m);
    }
    fn visit_expr_closure(&mut self, c: &'ast syn::ExprClosure) {
        if self.closures {
            visit::visit_expr_closure(self, c);
        }
    }
    fn visit_item(&mut self, _: &'ast syn::Item) {}
}

/// Whether `expr` calls one of the methods `names` (with `args` arguments, if
/// given), outside closures and items: what the value itself is made of.
pub fn calls(expr: &Expr, names: &[&str], args: Option<usize>) -> bool {
    let mut f = Finds {
        names,
        args,
        closures: false,
        found: false,
    };
    f.visit_expr(expr);
    f.found
}

/// Whether evaluating `expr` may call one of the methods `names`: outside items, and
/// inside closures too, which the evaluation may call (`blocks.iter().fold(x, |h, b|
/// b.forward(&h))`).
pub fn may_call(expr: &Expr, names: &[&str]) -> bool {
    let mut f = Finds {
        names,
        args: None,
        closures: true,
        found: false,
    };
    f.visit_expr(expr);
    f.found
}

/// The names bound by `let NAME = … .build(&vs, lr) …;` anywhere in the body.
struct OptimizerLocals(Vec<syn::Ident>);

impl<'ast> Visit<'ast> for OptimizerLocals {
    fn visit_local(&mut self, local: &'ast syn::Local) {
        let mut pat = &local.pat;
        if let syn::Pat::Type(t) = pat {
            pat = &t.pat;
        }
        if let (syn::Pat::Ident(id), Some(init)) = (pat, &local.init) {
            if calls(&init.expr, &["build"], Some(2)) && !self.0.contains(&id.ident) {
                self.0.push(id.ident.clone());
            }
        }
        visit::visit_local(self, local);
    }
    fn visit_expr_closure(&mut self, _: &'ast syn::ExprClosure) {}
    fn visit_item(&mut self, _: &'ast syn::Item) {}
}

/// The local or parameter that `expr` names: `opt`, `(opt)`.
pub fn receiver_ident(expr: &Expr) -> Option<&syn::Ident> {
    match expr {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident(),
        Expr::Paren(p) => receiver_ident(&p.expr),
        _ => None,
    }
}

fn trains(body: &syn::Block, trainers: &[syn::Ident]) -> bool {
    struct Trains<'a> {
        trainers: &'a [syn::Ident],
        found: bool,
    }
    impl Trains<'_> {
        fn hands_on(&self, arg: &Expr) -> bool {
            match arg {
                Expr::Reference(r) => self.hands_on(&r.expr),
                Expr::Paren(p) => self.hands_on(&p.expr),
                _ => receiver_ident(arg).is_some_and(|id| self.trainers.contains(id)),
            }
        }
    }
    impl<'ast> Visit<'ast> for Trains<'_> {
        fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
            let on_self = matches!(&*m.receiver, Expr::Path(p) if p.path.is_ident("self"));
            if on_self
                || TRAINING_CALLS.contains(&m.method.to_string().as_str())
                || m.args.iter().any(|a| self.hands_on(a))
            {
                self.found = true;
            }
            visit::visit_expr_method_call(self, m);
        }
        fn visit_expr_call(&mut self, c: &'ast syn::ExprCall) {
            let named = matches!(&*c.func, Expr::Path(p)
                if p.path.segments.last().is_some_and(|s| TRAINING_CALLS.contains(&s.ident.to_string().as_str())))
                || receiver_ident(&c.func).is_some_and(|id| self.trainers.contains(id));
            if named || c.args.iter().any(|a| self.hands_on(a)) {
                self.found = true;
            }
            visit::visit_expr_call(self, c);
        }
        fn visit_item(&mut self, _: &'ast syn::Item) {}
    }
    let mut t = Trains {
        trainers,
        found: false,
    };
    t.visit_block(body);
    t.found
}

/// The closures bound by `let NAME = |…| …` in `block` (not inside items) whose body
/// trains, given the trainers known so far (so one that calls another counts too).
fn training_closures(block: &syn::Block, known: &[syn::Ident]) -> Vec<syn::Ident> {
    let mut found: Vec<syn::Ident> = Vec::new();
    for (bound, init) in lets(block) {
        let ([id], Expr::Closure(c)) = (bound.as_slice(), &init) else {
            continue;
        };
        let body: syn::Block = parse_quote!({ #c });
        let mut all = known.to_vec();
        all.extend(found.iter().cloned());
        if trains(&body, &all) && !found.contains(id) {
            found.push(id.clone());
        }
    }
    found
}

/// The function's parameters whose declared type has a path segment in `types`
/// (`Optimizer` in `&mut nn::Optimizer`, `&mut tch_distributed::Optimizer`,
/// `Box<…>`).
fn typed_params(sig: &syn::Signature, types: &[&str]) -> Vec<syn::Ident> {
    fn names(tokens: TokenStream, types: &[&str]) -> bool {
        tokens.into_iter().any(|tt| match tt {
            proc_macro2::TokenTree::Ident(i) => types.iter().any(|t| i == t),
            proc_macro2::TokenTree::Group(g) => names(g.stream(), types),
            _ => false,
        })
    }
    sig.inputs
        .iter()
        .filter_map(|input| match input {
            syn::FnArg::Typed(t) => Some(t),
            syn::FnArg::Receiver(_) => None,
        })
        .filter(|t| names(t.ty.to_token_stream(), types))
        .filter_map(|t| match &*t.pat {
            syn::Pat::Ident(id) => Some(id.ident.clone()),
            _ => None,
        })
        .collect()
}
