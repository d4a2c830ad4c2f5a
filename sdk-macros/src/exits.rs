//! Agreed exits from a sharded loop: a `break`, `continue` or `return` that one rank
//! takes (on its own loss, say) is taken by every rank, at the same step.
//!
//! Each top-level statement of the loop's body that holds such an exit becomes a
//! labeled block that ends with the exit's number instead of taking it; right after
//! it, a point that every rank reaches, the ranks agree on the exit
//! (`__private::agree_exit`, one all-reduce of one number), and every rank takes the
//! one agreed: a `return` before a `break` before a `continue`, the first written
//! among equals. The rest of the statement after the exit is skipped on the ranks
//! that took it, as it was; the others finish the statement first. Statements
//! without exits, and loops without any, are left as they are: they cost nothing.
//!
//! Exits of loops nested in the statement, and of closures, `async` blocks and items
//! in it, stay where they are. An error (`?`) is no exit: it ends the rank, and the
//! launcher stops the others.

use std::collections::HashSet;

use proc_macro2::{Span, TokenStream};
use quote::{quote, ToTokens};
use syn::visit::{self, Visit};
use syn::visit_mut::{self, VisitMut};
use syn::{parse_quote, Expr, Stmt};

/// An exit taken in a statement: how it is taken again after the agreement, and its
/// rank among exits (higher wins).
struct Exit {
    again: Expr,
    priority: u8,
}

/// Finds the exits of one statement and replaces each with `break 'label value(k)`.
struct Finder<'a> {
    label: syn::Lifetime,
    /// The sharded loop's own label, if it has one: `break 'own` is a `break`.
    own: Option<&'a syn::Lifetime>,
    /// Whether an exit is written as `Some(k)` (a statement) or `Err(k)` (a `let`'s
    /// initializer).
    in_let: bool,
    /// Loops entered inside the statement (their unlabeled exits are theirs).
    loops: usize,
    /// Labels declared inside the statement.
    labels: Vec<String>,
    /// Names bound inside the statement: an exit's value must not use them.
    bound: HashSet<String>,
    exits: Vec<Exit>,
    errors: Vec<syn::Error>,
}

impl Finder<'_> {
    fn target_inside(&self, label: &Option<syn::Lifetime>) -> bool {
        match label {
            Some(l) => self.labels.contains(&l.ident.to_string()),
            None => self.loops > 0,
        }
    }

    fn priority(&self, label: &Option<syn::Lifetime>, stop: u8) -> u8 {
        match label {
            Some(l) if self.own.map(|o| o.ident != l.ident).unwrap_or(true) => 2,
            _ => stop,
        }
    }

    /// Checks that an exit's value (`return x`) can be computed by every rank after
    /// the statement: it uses no name bound inside it.
    fn check_value(&mut self, value: &Expr, keyword: &str) {
        struct Names<'n>(&'n HashSet<String>, Option<String>);
        impl<'ast> Visit<'ast> for Names<'_> {
            fn visit_expr_path(&mut self, p: &'ast syn::ExprPath) {
                if let Some(id) = p.path.get_ident() {
                    if self.0.contains(&id.to_string()) && self.1.is_none() {
                        self.1 = Some(id.to_string());
                    }
                }
            }
        }
        let mut names = Names(&self.bound, None);
        names.visit_expr(value);
        if let Some(name) = names.1 {
            self.errors.push(syn::Error::new_spanned(
                value,
                format!(
                    "this `{keyword}` leaves a loop that #[distributed] shards: when one rank \
                     takes it, every rank does, after the statement, so every rank computes \
                     its value there, where `{name}` (bound inside the statement) is gone. \
                     Use a value every rank has (`{keyword} Ok(())`), or `break` and \
                     compute it after the loop"
                ),
            ));
        }
    }

    fn take(&mut self, again: Expr, priority: u8) -> Expr {
        let k = self.exits.len() as u32;
        self.exits.push(Exit { again, priority });
        let label = &self.label;
        if self.in_let {
            parse_quote!(break #label (::std::result::Result::Err(#k)))
        } else {
            parse_quote!(break #label (::std::option::Option::Some(#k)))
        }
    }
}

/// Names bound by patterns anywhere in a statement.
struct Bindings<'b>(&'b mut HashSet<String>);
impl<'ast> Visit<'ast> for Bindings<'_> {
    fn visit_pat_ident(&mut self, p: &'ast syn::PatIdent) {
        self.0.insert(p.ident.to_string());
        visit::visit_pat_ident(self, p);
    }
}

impl VisitMut for Finder<'_> {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        match expr {
            Expr::Closure(_) | Expr::Async(_) | Expr::Const(_) => {}
            Expr::ForLoop(_) | Expr::While(_) | Expr::Loop(_) => {
                let label = match &*expr {
                    Expr::ForLoop(e) => e.label.clone(),
                    Expr::While(e) => e.label.clone(),
                    Expr::Loop(e) => e.label.clone(),
                    _ => unreachable!(),
                };
                if let Some(l) = &label {
                    self.labels.push(l.name.ident.to_string());
                }
                self.loops += 1;
                visit_mut::visit_expr_mut(self, expr);
                self.loops -= 1;
                if label.is_some() {
                    self.labels.pop();
                }
            }
            Expr::Block(b) if b.label.is_some() => {
                self.labels
                    .push(b.label.as_ref().unwrap().name.ident.to_string());
                visit_mut::visit_expr_mut(self, expr);
                self.labels.pop();
            }
            Expr::Break(b) if !self.target_inside(&b.label) => {
                if let Some(value) = &b.expr {
                    self.check_value(value, "break");
                }
                let priority = self.priority(&b.label, 1);
                let again = expr.clone();
                *expr = self.take(again, priority);
            }
            Expr::Continue(c) if !self.target_inside(&c.label) => {
                let priority = self.priority(&c.label, 0);
                let again = expr.clone();
                *expr = self.take(again, priority);
            }
            Expr::Return(r) => {
                if let Some(value) = &r.expr {
                    self.check_value(value, "return");
                }
                let again = expr.clone();
                *expr = self.take(again, 3);
            }
            _ => visit_mut::visit_expr_mut(self, expr),
        }
    }

    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

/// Rewrites the body of a sharded loop (labeled `own`) so that its exits are agreed;
/// `next` numbers the labels and names the statements add. Leaves a body without
/// exits as it is.
pub fn agree(
    krate: &TokenStream,
    body: &mut syn::Block,
    own: Option<&syn::Lifetime>,
    next: &mut u64,
) -> Result<(), Vec<syn::Error>> {
    let mut errors = Vec::new();
    let mut stmts = Vec::new();
    for stmt in std::mem::take(&mut body.stmts) {
        *next += 1;
        let n = *next;
        let label = syn::Lifetime::new(&format!("'__tchd_exits_{n}"), Span::call_site());
        let mut bound = HashSet::new();
        Bindings(&mut bound).visit_stmt(&stmt);
        let mut finder = Finder {
            label: label.clone(),
            own,
            in_let: matches!(stmt, Stmt::Local(_)),
            loops: 0,
            labels: Vec::new(),
            bound,
            exits: Vec::new(),
            errors: Vec::new(),
        };
        let mut stmt = stmt;
        let original = stmt.clone();
        match &mut stmt {
            Stmt::Expr(e, _) => finder.visit_expr_mut(e),
            Stmt::Local(local) => {
                if let Some(init) = &mut local.init {
                    finder.visit_expr_mut(&mut init.expr);
                    if let Some((_, diverge)) = &mut init.diverge {
                        finder.visit_expr_mut(diverge);
                    }
                }
            }
            Stmt::Item(_) | Stmt::Macro(_) => {}
        }
        errors.append(&mut finder.errors);
        if finder.exits.is_empty() {
            stmts.push(original);
            continue;
        }
        let priorities: Vec<u8> = finder.exits.iter().map(|e| e.priority).collect();
        let arms = finder.exits.iter().enumerate().map(|(k, e)| {
            let k = k as u32;
            let again = &e.again;
            quote!(::std::option::Option::Some(#k) => #again,)
        });
        let taken = syn::Ident::new(&format!("__tchd_exit_{n}"), Span::call_site());
        let agree = quote! {
            match #krate::__private::agree_exit(#taken, &[#(#priorities),*]) {
                #(#arms)*
                _ => {}
            }
        };
        match stmt {
            Stmt::Expr(e, _) => {
                stmts.push(parse_quote! {
                    let #taken: ::std::option::Option<u32> = #label: {
                        #e;
                        ::std::option::Option::None
                    };
                });
                stmts.push(Stmt::Expr(syn::parse2(agree).expect("a match"), None));
            }
            Stmt::Local(local) => {
                let simple = matches!(&local.pat, syn::Pat::Ident(p) if p.subpat.is_none())
                    || matches!(&local.pat, syn::Pat::Type(t) if matches!(&*t.pat, syn::Pat::Ident(p) if p.subpat.is_none()));
                let init = local.init.as_ref().expect("exits were found in it");
                if !simple || init.diverge.is_some() {
                    errors.push(syn::Error::new_spanned(
                        original.to_token_stream(),
                        "an exit (`break`, `continue`, `return`) inside a `let` with a pattern \
                         or an `else`, in a loop that #[distributed] shards: the ranks agree on \
                         an exit at the end of its statement, where a pattern's names cannot \
                         wait. Bind one name (`let x = …;`) or take the exit in a statement \
                         of its own (`if … { break }`)",
                    ));
                    stmts.push(original);
                    continue;
                }
                let value = &init.expr;
                let value_name = syn::Ident::new(&format!("__tchd_value_{n}"), Span::call_site());
                stmts.push(parse_quote! {
                    let #value_name = #label: {
                        ::std::result::Result::<_, u32>::Ok(#value)
                    };
                });
                stmts.push(parse_quote! {
                    let #taken: ::std::option::Option<u32> = #value_name.as_ref().err().copied();
                });
                stmts.push(Stmt::Expr(syn::parse2(agree).expect("a match"), None));
                let attrs = &local.attrs;
                let pat = &local.pat;
                stmts.push(parse_quote! {
                    #(#attrs)*
                    let #pat = match #value_name {
                        ::std::result::Result::Ok(__tchd_v) => __tchd_v,
                        ::std::result::Result::Err(_) => ::std::unreachable!(),
                    };
                });
            }
            _ => unreachable!("no exits are looked for there"),
        }
    }
    body.stmts = stmts;
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}
