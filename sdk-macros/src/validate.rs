//! Rejecting, at compile time, what the attribute cannot serve or what would hang.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Expr, ItemFn};

use crate::analysis::{receiver_ident, Analysis};
use crate::rules::collective;

/// Rejects function shapes the attribute cannot serve, and collectives inside
/// branches that only some ranks take. All errors are reported together.
pub fn validate(func: &ItemFn, analysis: &Analysis) -> syn::Result<()> {
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
    let mut walk = Walk {
        analysis,
        depth: 0,
        condition: String::new(),
        what: "",
        loops: Vec::new(),
        loops_at_branch: 0,
        next_loop: 0,
        sharded: Vec::new(),
        order: 0,
        collectives: Vec::new(),
        exits: Vec::new(),
        errors: &mut errors,
    };
    walk.visit_block(&func.block);
    walk.check_exits();
    let mut errors = errors.into_iter();
    match errors.next() {
        None => Ok(()),
        Some(mut first) => {
            errors.for_each(|e| first.combine(e));
            Err(first)
        }
    }
}

const BRANCH: &str = "a branch that only some ranks take";
const LOOP: &str = "a loop that runs a different number of times on each rank";

/// A call that every rank must make together, where the walk met it.
struct Collective {
    /// Its place in the function, in source order.
    order: usize,
    /// The loops around it, outermost first.
    loops: Vec<usize>,
    /// How the messages name it: "`.backward()` (the backward pass all-reduces …)".
    name: String,
}

/// A `return`, `break` or `continue` inside a rank-dependent branch.
struct Exit {
    order: usize,
    /// The loops around it; for `break` and `continue`, the innermost is the one it
    /// leaves or restarts.
    loops: Vec<usize>,
    keyword: &'static str,
    /// The `return …`, `break` or `continue` as written, for the error's span.
    tokens: TokenStream,
    condition: String,
    what: &'static str,
}

/// Walks the function once, in source order: rejects collectives inside `if`,
/// `match`, `while` and `for` whose condition depends on the rank, and records them
/// and the rank-dependent exits for [`Walk::check_exits`].
struct Walk<'e> {
    analysis: &'e Analysis,
    /// How many rank-dependent branches enclose the current node.
    depth: usize,
    /// The innermost rank-dependent condition, and what it governs, for the message.
    condition: String,
    what: &'static str,
    /// The loops around the current node, and how many of them were entered before
    /// the outermost rank-dependent branch.
    loops: Vec<usize>,
    loops_at_branch: usize,
    next_loop: usize,
    /// The loops that #[distributed] shards: their exits are agreed over the ranks.
    sharded: Vec<usize>,
    order: usize,
    collectives: Vec<Collective>,
    exits: Vec<Exit>,
    errors: &'e mut Vec<syn::Error>,
}

/// An expression as the messages quote it: `ctx.rank() > 0`.
fn quoted(e: &impl ToTokens) -> String {
    e.to_token_stream()
        .to_string()
        .replace(" . ", ".")
        .replace(" (", "(")
        .replace(" .. ", "..")
        .replace("! ", "!")
        .replace("& ", "&")
        .replace("&&", "&& ")
}

impl Walk<'_> {
    fn branch(&mut self, condition: &Expr, what: &'static str, body: impl FnOnce(&mut Self)) {
        if self.analysis.depends_on_rank(condition) {
            let outer = std::mem::replace(&mut self.condition, quoted(condition));
            let outer_what = std::mem::replace(&mut self.what, what);
            if self.depth == 0 {
                self.loops_at_branch = self.loops.len();
            }
            self.depth += 1;
            body(self);
            self.depth -= 1;
            self.condition = outer;
            self.what = outer_what;
        } else {
            body(self);
        }
    }

    fn in_loop(&mut self, body: impl FnOnce(&mut Self)) {
        self.next_loop += 1;
        self.loops.push(self.next_loop);
        body(self);
        self.loops.pop();
    }

    /// Records a call every rank must make; inside a rank-dependent branch, rejects it
    /// with the error spanning `at`. `call` names it as written, `why` says why it is
    /// collective, `fix` how to write it instead.
    fn collective(&mut self, at: &dyn ToTokens, call: String, why: &str, fix: &str) {
        self.order += 1;
        self.collectives.push(Collective {
            order: self.order,
            loops: self.loops.clone(),
            name: format!("{call} ({why})"),
        });
        if self.depth > 0 {
            self.errors.push(syn::Error::new_spanned(
                at,
                format!(
                    "{call} inside {} (`{}`) would hang: {why}, and the ranks that skip \
                     it never join. {fix}",
                    self.what, self.condition
                ),
            ));
        }
    }

    fn exit(&mut self, keyword: &'static str, at: &dyn ToTokens) {
        if self.depth == 0 {
            return;
        }
        // Taken in the body of a loop that #[distributed] shards (not in a loop inside
        // it): every rank takes it with the first that does (see `exits.rs`).
        if self.loops.last().is_some_and(|l| self.sharded.contains(l)) {
            return;
        }
        // A `break` or `continue` of a loop that runs inside the branch stays inside
        // it.
        if keyword != "return" && self.loops.len() > self.loops_at_branch {
            return;
        }
        self.order += 1;
        self.exits.push(Exit {
            order: self.order,
            loops: self.loops.clone(),
            keyword,
            tokens: at.to_token_stream(),
            condition: self.condition.clone(),
            what: self.what,
        });
    }

    /// Rejects each rank-dependent exit that skips a collective the other ranks still
    /// run: for `return`, any that comes later or belongs to a loop it leaves; for
    /// `break`, any of the loop it leaves; for `continue`, any later in the loop it
    /// restarts.
    fn check_exits(&mut self) {
        for exit in &self.exits {
            let skipped = self.collectives.iter().find(|c| match exit.keyword {
                "return" => c.order > exit.order || exit.loops.iter().any(|l| c.loops.contains(l)),
                "break" => exit.loops.last().is_some_and(|l| c.loops.contains(l)),
                _ => c.order > exit.order && exit.loops.last().is_some_and(|l| c.loops.contains(l)),
            });
            let Some(skipped) = skipped else { continue };
            let keyword = exit.keyword;
            self.errors.push(syn::Error::new_spanned(
                &exit.tokens,
                format!(
                    "`{keyword}` inside {} (`{}`) would hang: the ranks that take it skip \
                     {} while the others wait for them there. Decide on every rank alike \
                     (`if tch_distributed::any_rank(…)? {{ … }}`, or a value every rank \
                     shares), or leave after the last collective",
                    exit.what, exit.condition, skipped.name
                ),
            ));
        }
    }

    /// A call given the context or the process group (`log(&ctx, …)`), or a training
    /// closure called: what it runs is unknown here, and may be a collective.
    fn hands_on(&mut self, at: &dyn ToTokens, call: String, func: Option<&Expr>, args: &[&Expr]) {
        if let Some(closure) = func
            .and_then(receiver_ident)
            .filter(|id| self.analysis.trainers.contains(id))
        {
            let why = format!(
                "`{closure}` trains (a backward pass or an optimizer step, which average \
                 the gradients over the ranks)"
            );
            self.collective(at, call, &why, "Move it out so that every rank calls it");
            return;
        }
        let given = args
            .iter()
            .find_map(|a| self.analysis.handed_on(a))
            .filter(|id| self.analysis.groups.contains(id))
            .cloned();
        if let Some(group) = given {
            let why = format!(
                "it is given `{group}`, the job's context or process group, and may run a \
                 collective with it (a barrier, an all-reduce, a checkpoint)"
            );
            self.collective(
                at,
                call,
                &why,
                "Call it on every rank (it can test the rank itself), or pass it only what \
                 it needs (e.g. `ctx.rank()`)",
            );
        }
    }
}

impl<'ast> Visit<'ast> for Walk<'_> {
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
        self.in_loop(|v| v.branch(&e.cond, LOOP, |v| v.visit_block(&e.body)));
    }

    fn visit_expr_loop(&mut self, e: &'ast syn::ExprLoop) {
        self.in_loop(|v| v.visit_block(&e.body));
    }

    fn visit_expr_for_loop(&mut self, e: &'ast syn::ExprForLoop) {
        self.visit_expr(&e.expr);
        if self.analysis.sharded_loop(&e.expr, &e.body) {
            self.sharded.push(self.next_loop + 1);
            // The rewrite shards it: its start agrees on the shuffle and the first
            // batch with every rank.
            self.collective(
                &e.expr,
                format!("the training loop over `{}`", quoted(&e.expr)),
                "#[distributed] shards it, and the ranks agree on its shuffle and first batch when it starts",
                "Move it out so that every rank runs it",
            );
        }
        self.in_loop(|v| v.branch(&e.expr, LOOP, |v| v.visit_block(&e.body)));
    }

    fn visit_expr_return(&mut self, e: &'ast syn::ExprReturn) {
        visit::visit_expr_return(self, e);
        self.exit("return", e);
    }

    fn visit_expr_break(&mut self, e: &'ast syn::ExprBreak) {
        visit::visit_expr_break(self, e);
        self.exit("break", e);
    }

    fn visit_expr_continue(&mut self, e: &'ast syn::ExprContinue) {
        self.exit("continue", e);
    }

    /// `main_process_first(…)` and `local_main_process_first(…)`: a barrier inside.
    fn visit_expr_call(&mut self, c: &'ast syn::ExprCall) {
        visit::visit_expr_call(self, c);
        let name = match &*c.func {
            Expr::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
            _ => None,
        };
        let call = format!("`{}(…)`", quoted(&c.func));
        match name.as_deref() {
            Some(name @ ("main_process_first" | "local_main_process_first"))
                if c.args.len() == 1 =>
            {
                self.collective(
                    c,
                    format!("`{name}(…)`"),
                    "the other ranks wait for it at a barrier",
                    "Move it out so that every rank calls it",
                );
            }
            _ => {
                let args: Vec<&Expr> = c.args.iter().collect();
                self.hands_on(c, call, Some(&c.func), &args);
            }
        }
    }

    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        visit::visit_expr_method_call(self, m);
        let method = m.method.to_string();
        let call = format!(
            "`.{method}{}`",
            if m.args.is_empty() { "()" } else { "(…)" }
        );
        // An optimizer's step: on a local, only the optimizers the analysis knows (a
        // local LR scheduler's or counter's `step` is not a collective); on anything
        // else (`self.opt`, `self.opt.as_mut().unwrap()`, a helper's value), whose
        // type only the rewrite's probe sees, every `step()`, with a way out for the
        // types that are not optimizers.
        let step_of_other = method == "step"
            && receiver_ident(&m.receiver).is_some_and(|id| !self.analysis.trainers.contains(id));
        match collective(&method, m.args.len()) {
            Some(why) if !step_of_other => {
                let fix = if matches!(method.as_str(), "save" | "load" | "load_partial") {
                    "Move it out so that every rank calls it; for a type other than VarStore, \
                     call it as `Type::method(&value, path)`, which #[distributed] leaves alone"
                } else if method == "step" && receiver_ident(&m.receiver).is_none() {
                    "Move it out so that every rank calls it; if it is not an optimizer (an LR \
                     scheduler, a counter), call it as `Type::step(&mut value)`, which \
                     #[distributed] leaves alone"
                } else {
                    "Move it out so that every rank calls it"
                };
                self.collective(m, call, why, fix);
            }
            _ => {
                let args: Vec<&Expr> = m.args.iter().collect();
                self.hands_on(m, call, None, &args);
            }
        }
    }

    // Code in closures and nested items runs whenever it is called, not where it
    // is written; it is not checked.
    fn visit_expr_closure(&mut self, _: &'ast syn::ExprClosure) {}
    fn visit_item(&mut self, _: &'ast syn::Item) {}
}
