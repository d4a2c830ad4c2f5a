//! Parsing and validating the attribute's options: each is a row of the settings table
//! (`tch-distributed-settings`), whose own parser and check validate it here, at compile
//! time, with the message a flag, a variable or the configuration file would get.

use syn::parse::{Parse, ParseStream};
use syn::{Lit, Token};
use tch_distributed_settings::{attribute_options, row, Literal, Setting, Settings};

/// The options of `#[distributed(…)]`, validated.
#[derive(Clone, Default)]
pub struct Options {
    /// The settings written, in order, each as its key and its value as text (a
    /// string literal's contents, a number's digits, `true` or `false`): what
    /// `Settings::from_attribute` reads, here and again at run time.
    pub settings: Vec<(String, String)>,
    /// `crate = "path"`: where tch-distributed is (not a setting).
    pub krate: Option<syn::Path>,
}

/// The valid options, for the messages: the table's attribute rows, and `crate`.
fn valid() -> String {
    attribute_options()
        .chain(["crate"])
        .collect::<Vec<_>>()
        .join(", ")
}

/// A literal's value as the settings read text, when it is the kind of literal the
/// setting takes (`expected`): a string's contents, a number's digits, `true`/`false`.
fn text(lit: &Lit, expected: Literal) -> Option<String> {
    match (lit, expected) {
        (Lit::Str(s), Literal::String) => Some(s.value()),
        (Lit::Int(i), Literal::Number) => Some(i.base10_digits().to_string()),
        (Lit::Float(f), Literal::Number) => Some(f.base10_digits().to_string()),
        (Lit::Bool(b), Literal::Bool) => Some(b.value.to_string()),
        _ => None,
    }
}

impl Parse for Options {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut options = Options::default();
        let mut seen: Vec<String> = Vec::new();
        while !input.is_empty() {
            let key: syn::Ident = if input.peek(Token![crate]) {
                let k: Token![crate] = input.parse()?;
                syn::Ident::new("crate", k.span)
            } else {
                input.parse()?
            };
            let name = key.to_string();
            if seen.contains(&name) {
                return Err(syn::Error::new(
                    key.span(),
                    format!("duplicate option `{name}`; valid options: {}", valid()),
                ));
            }
            let setting = row(&name).filter(|r| r.attribute);
            if setting.is_none() && name != "crate" {
                return Err(syn::Error::new(
                    key.span(),
                    format!("unknown option `{name}`; valid options: {}", valid()),
                ));
            }
            if !input.peek(Token![=]) {
                return Err(syn::Error::new(
                    key.span(),
                    format!("option `{name}` needs a value: `{name} = …`"),
                ));
            }
            input.parse::<Token![=]>()?;
            let span = input.span();
            let lit: Option<Lit> = input.parse().ok();
            match setting {
                None => options.krate = Some(krate(lit, span)?),
                Some(setting) => {
                    let value = setting_text(&name, setting, lit.as_ref(), span)?;
                    options.settings.push((name.clone(), value));
                }
            }
            seen.push(name);
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(options)
    }
}

/// The text of option `name`'s literal, checked by its row (`setting`): its own parser
/// and check, and its message, spanned at the literal.
fn setting_text(
    name: &str,
    setting: &Setting,
    lit: Option<&Lit>,
    span: proc_macro2::Span,
) -> syn::Result<String> {
    let written = match setting.literal {
        Literal::String => "\"…\"",
        Literal::Number => "…",
        Literal::Bool => "true",
    };
    let Some(value) = lit.and_then(|lit| text(lit, setting.literal)) else {
        return Err(syn::Error::new(
            span,
            format!(
                "`{name}` takes {}, as a literal: `{name} = {written}`",
                setting.values
            ),
        ));
    };
    Settings::from_attribute([(name, value.as_str())])
        .map_err(|e| syn::Error::new(span, e.to_string()))?;
    Ok(value)
}

/// The path of `crate = "path"`.
fn krate(lit: Option<Lit>, span: proc_macro2::Span) -> syn::Result<syn::Path> {
    let Some(Lit::Str(lit)) = lit else {
        return Err(syn::Error::new(
            span,
            "expected `crate = \"path::to::tch_distributed\"`",
        ));
    };
    lit.parse().map_err(|_| {
        syn::Error::new(
            lit.span(),
            format!(
                "{:?} is not a path: write the path under which tch-distributed is a dependency, e.g. `crate = \"my_tchd\"`",
                lit.value()
            ),
        )
    })
}
