//! Rejecting, at compile time, what the attribute cannot serve or what would hang.

use std::collections::BTreeSet;

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Expr, ItemFn};

/// Names whose value differs between ranks: a branch on them is taken by some ranks
/// only.
const RANK_NAMES: &[&str] = &[
    "rank",
    "local_rank",
    "node_rank",
    "global_rank",
    "is_main_process",
    "is_local_main_process",
];

/// Calls that every rank must make together: `#[distributed]` turns them into (or
/// they are) collectives, so a rank that skips one leaves the others waiting until
/// the timeout.
fn collective(method: &str, args: usize) -> Option<&'static str> {
    Some(match (method, args) {
        ("save", 1) => {
            "`save` on a VarStore waits for every rank (rank 0 writes the file alone, between barriers)"
        }
        ("load", 1) => "`load` on a VarStore waits for every rank (a barrier comes first)",
        ("build", 2) => {
            "building the optimizer wraps the model in DDP, which broadcasts rank 0's parameters to every rank"
        }
        ("save_state", 3) | ("load_state", 2) => {
            "every rank writes or reads its part of a checkpoint (the ranks agree on it with collectives)"
        }
        ("backward", 0 | 1)
        | ("backward_step", 1)
        | ("backward_step_clip", 2)
        | ("backward_step_clip_norm", 2) => {
            "the backward pass all-reduces the gradients with every rank"
        }
        ("barrier", 0) => "a barrier waits for every rank",
        ("all_reduce" | "broadcast" | "all_gather" | "reduce_scatter", _)
        | ("broadcast_coalesced", _) => "a collective waits for every rank",
        _ => return None,
    })
}

/// Rejects function shapes the attribute cannot serve, and collectives inside
/// branches that only some ranks take. All errors are reported together.
pub fn validate(func: &ItemFn) -> syn::Result<()> {
    let mut errors = Vec::new();
    let sig = &func.sig;
    if let Some(t) = &sig.asyncness {
        errors.push(syn::Error::new(
            t.span,
            "#[distributed] cannot be used on an `async fn`: collectives block the thread; \
             put the attribute on a synchronous training function and call it from your runtime with spawn_blocking",
        ));
    }
    if let Some(t) = &sig.constness {
        errors.push(syn::Error::new(
            t.span,
            "#[distributed] cannot be used on a `const fn`: training runs at run time; remove `const`",
        ));
    }
    if let Some(abi) = &sig.abi {
        errors.push(syn::Error::new(
            abi.span(),
            "#[distributed] cannot be used on an `extern` function: remove the ABI and call the training function from your `extern` wrapper",
        ));
    }
    let mut branches = RankBranches {
        rank_names: rank_dependent_locals(func),
        depth: 0,
        condition: String::new(),
        what: "",
        errors: &mut errors,
    };
    branches.visit_block(&func.block);
    let mut errors = errors.into_iter();
    match errors.next() {
        None => Ok(()),
        Some(mut first) => {
            errors.for_each(|e| first.combine(e));
            Err(first)
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

/// `RANK_NAMES` plus the locals bound from them (`let main = ctx.rank() == 0;`),
/// followed through chains of `let`s.
fn rank_dependent_locals(func: &ItemFn) -> BTreeSet<String> {
    struct Lets(Vec<(Vec<String>, TokenStream)>);
    impl<'ast> Visit<'ast> for Lets {
        fn visit_local(&mut self, local: &'ast syn::Local) {
            if let Some(init) = &local.init {
                let mut names = Vec::new();
                collect_idents(&local.pat, &mut names);
                self.0.push((names, init.expr.to_token_stream()));
            }
            visit::visit_local(self, local);
        }
    }
    fn collect_idents(pat: &syn::Pat, out: &mut Vec<String>) {
        match pat {
            syn::Pat::Ident(p) => out.push(p.ident.to_string()),
            syn::Pat::Type(p) => collect_idents(&p.pat, out),
            syn::Pat::Tuple(p) => p.elems.iter().for_each(|p| collect_idents(p, out)),
            syn::Pat::Reference(p) => collect_idents(&p.pat, out),
            _ => {}
        }
    }
    let mut lets = Lets(Vec::new());
    lets.visit_block(&func.block);
    let mut names: BTreeSet<String> = RANK_NAMES.iter().map(|s| s.to_string()).collect();
    loop {
        let before = names.len();
        for (bound, init) in &lets.0 {
            if mentions(init.clone(), &names) {
                names.extend(bound.iter().cloned());
            }
        }
        if names.len() == before {
            return names;
        }
    }
}

const BRANCH: &str = "a branch that only some ranks take";
const LOOP: &str = "a loop that runs a different number of times on each rank";

/// Finds collectives inside `if`/`match`/`while` whose condition depends on the rank.
struct RankBranches<'e> {
    rank_names: BTreeSet<String>,
    /// How many rank-dependent branches enclose the current node.
    depth: usize,
    /// The innermost rank-dependent condition, and what it governs, for the message.
    condition: String,
    what: &'static str,
    errors: &'e mut Vec<syn::Error>,
}

impl RankBranches<'_> {
    fn branch(&mut self, condition: &Expr, what: &'static str, body: impl FnOnce(&mut Self)) {
        if mentions(condition.to_token_stream(), &self.rank_names) {
            let text = condition.to_token_stream().to_string();
            let text = text
                .replace(" . ", ".")
                .replace(" (", "(")
                .replace(" .. ", "..")
                .replace("! ", "!");
            let outer = std::mem::replace(&mut self.condition, text);
            let outer_what = std::mem::replace(&mut self.what, what);
            self.depth += 1;
            body(self);
            self.depth -= 1;
            self.condition = outer;
            self.what = outer_what;
        } else {
            body(self);
        }
    }
}

impl<'ast> Visit<'ast> for RankBranches<'_> {
    fn visit_expr_if(&mut self, e: &'ast syn::ExprIf) {
        self.visit_expr(&e.cond);
        self.branch(&e.cond, BRANCH, |v| {
            v.visit_block(&e.then_branch);
            if let Some((_, els)) = &e.else_branch {
                v.visit_expr(els);
            }
        });
    }

    fn visit_expr_match(&mut self, e: &'ast syn::ExprMatch) {
        self.visit_expr(&e.expr);
        self.branch(&e.expr, BRANCH, |v| {
            e.arms.iter().for_each(|arm| v.visit_arm(arm))
        });
    }

    fn visit_expr_while(&mut self, e: &'ast syn::ExprWhile) {
        self.visit_expr(&e.cond);
        self.branch(&e.cond, LOOP, |v| v.visit_block(&e.body));
    }

    fn visit_expr_for_loop(&mut self, e: &'ast syn::ExprForLoop) {
        self.visit_expr(&e.expr);
        self.branch(&e.expr, LOOP, |v| v.visit_block(&e.body));
    }

    /// `main_process_first(…)` and `local_main_process_first(…)`: a barrier inside.
    fn visit_expr_call(&mut self, c: &'ast syn::ExprCall) {
        visit::visit_expr_call(self, c);
        if self.depth == 0 || c.args.len() != 1 {
            return;
        }
        let Expr::Path(p) = &*c.func else { return };
        let Some(name) = p.path.segments.last().map(|s| s.ident.to_string()) else {
            return;
        };
        if name == "main_process_first" || name == "local_main_process_first" {
            self.errors.push(syn::Error::new_spanned(
                c,
                format!(
                    "`{name}(…)` inside {} (`{}`) would hang: the other ranks wait for it \
                     at a barrier, and the ranks that skip it never join. Move it out so \
                     that every rank calls it",
                    self.what, self.condition
                ),
            ));
        }
    }

    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        visit::visit_expr_method_call(self, m);
        if self.depth == 0 {
            return;
        }
        let method = m.method.to_string();
        if let Some(why) = collective(&method, m.args.len()) {
            let call = if m.args.is_empty() { "()" } else { "(…)" };
            self.errors.push(syn::Error::new_spanned(
                m,
                format!(
                    "`.{method}{call}` inside {} (`{}`) would hang: \
                     {why}, and the ranks that skip it never join. Move it out \
                     so that every rank calls it{}",
                    self.what,
                    self.condition,
                    if method == "save" || method == "load" {
                        "; for a type other than VarStore, call it as `Type::method(&value, path)`, which #[distributed] leaves alone"
                    } else {
                        ""
                    }
                ),
            ));
        }
    }

    // Code in closures and nested items runs whenever it is called, not where it
    // is written; it is not checked.
    fn visit_expr_closure(&mut self, _: &'ast syn::ExprClosure) {}
    fn visit_item(&mut self, _: &'ast syn::Item) {}
}
