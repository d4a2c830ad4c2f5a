//! Parsing and validating the attribute's options.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::{LitBool, LitFloat, LitInt, LitStr, Token};

pub const VALID: &str = "backend, nproc_per_node, bucket_cap_mb, find_unused_parameters, static_graph, comm_hook, timeout, deadlock_check, mixed_precision, grad_accum, optimizer, zero, crate";

/// The options of `#[distributed(…)]`, validated.
#[derive(Clone, Default)]
pub struct Options {
    /// The variant of `Backend` (`Gloo`, `Nccl`), spanned at the user's literal.
    pub backend: Option<syn::Ident>,
    pub nproc_per_node: Option<usize>,
    pub bucket_cap_mb: Option<f64>,
    pub find_unused_parameters: Option<bool>,
    pub static_graph: Option<bool>,
    /// The variant of `CommHook` (`None`, `Fp16`, `Bf16`), spanned at the user's
    /// literal.
    pub comm_hook: Option<syn::Ident>,
    pub timeout: Option<f64>,
    pub deadlock_check: Option<f64>,
    /// `Auto`, or the variant of `MixedPrecision` (`No`, `Bf16`, `Fp16`), spanned at
    /// the user's literal.
    pub mixed_precision: Option<syn::Ident>,
    pub grad_accum: Option<usize>,
    /// The variant of `Implementation` (`Fused`, `Foreach`, `Tch`), spanned at the
    /// user's literal.
    pub optimizer: Option<syn::Ident>,
    /// The ZeRO stage (1).
    pub zero: Option<u8>,
    pub krate: Option<syn::Path>,
}

/// Parses the option's value, or says what it should look like.
fn expect<T: Parse>(input: ParseStream, example: &str) -> syn::Result<T> {
    let span = input.span();
    input
        .parse()
        .map_err(|_| syn::Error::new(span, format!("expected `{example}`")))
}

fn number(input: ParseStream, what: &str, example: &str) -> syn::Result<(f64, Span)> {
    if input.peek(LitInt) {
        let lit: LitInt = input.parse()?;
        Ok((lit.base10_parse::<f64>()?, lit.span()))
    } else if input.peek(LitFloat) {
        let lit: LitFloat = input.parse()?;
        Ok((lit.base10_parse::<f64>()?, lit.span()))
    } else {
        Err(input.error(format!(
            "`{what}` takes a number, e.g. `{what} = {example}`"
        )))
    }
}

/// A string option whose value must be one of `valid`'s spellings: the variant it
/// names, spanned at the literal.
fn one_of(
    input: ParseStream,
    example: &str,
    valid: &[(&str, &str)],
    unknown: impl FnOnce(&str) -> String,
) -> syn::Result<syn::Ident> {
    let lit: LitStr = expect(input, example)?;
    let value = lit.value();
    match valid.iter().find(|(spelling, _)| *spelling == value) {
        Some((_, variant)) => Ok(syn::Ident::new(variant, lit.span())),
        None => Err(syn::Error::new(lit.span(), unknown(&value))),
    }
}

/// A count that must be at least 1.
fn at_least_one(input: ParseStream, example: &str, zero: &str) -> syn::Result<usize> {
    let lit: LitInt = expect(input, example)?;
    let n: usize = lit.base10_parse()?;
    if n == 0 {
        return Err(syn::Error::new(lit.span(), zero));
    }
    Ok(n)
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
                    format!("duplicate option `{name}`; valid options: {VALID}"),
                ));
            }
            if !VALID.split(", ").any(|v| v == name) {
                return Err(syn::Error::new(
                    key.span(),
                    format!("unknown option `{name}`; valid options: {VALID}"),
                ));
            }
            if !input.peek(Token![=]) {
                return Err(syn::Error::new(
                    key.span(),
                    format!("option `{name}` needs a value: `{name} = …`"),
                ));
            }
            input.parse::<Token![=]>()?;
            match name.as_str() {
                "backend" => {
                    options.backend = Some(one_of(
                        input,
                        "backend = \"gloo\" or backend = \"nccl\"",
                        &[("gloo", "Gloo"), ("nccl", "Nccl")],
                        |value| format!("unknown backend {value:?}: use \"gloo\" or \"nccl\""),
                    )?);
                }
                "nproc_per_node" => {
                    options.nproc_per_node = Some(at_least_one(
                        input,
                        "nproc_per_node = 2",
                        "`nproc_per_node` must be at least 1",
                    )?);
                }
                "bucket_cap_mb" => {
                    let (mb, span) = number(input, "bucket_cap_mb", "25")?;
                    if mb.is_nan() || mb <= 0.0 {
                        return Err(syn::Error::new(span, "`bucket_cap_mb` must be a positive number of MiB (PyTorch's default is 25)"));
                    }
                    options.bucket_cap_mb = Some(mb);
                }
                "find_unused_parameters" => {
                    let lit: LitBool = expect(input, "find_unused_parameters = true or … = false")?;
                    options.find_unused_parameters = Some(lit.value);
                }
                "static_graph" => {
                    let lit: LitBool = expect(input, "static_graph = true or … = false")?;
                    options.static_graph = Some(lit.value);
                }
                "comm_hook" => {
                    options.comm_hook = Some(one_of(
                        input,
                        "comm_hook = \"bf16\"",
                        &[("none", "None"), ("fp16", "Fp16"), ("bf16", "Bf16")],
                        |value| {
                            format!("unknown comm_hook {value:?}: use \"fp16\" or \"bf16\" (gradients all-reduced in half precision, as PyTorch's fp16_compress_hook and bf16_compress_hook) or \"none\"")
                        },
                    )?);
                }
                "timeout" => options.timeout = Some(seconds(input, "timeout", "600")?),
                "deadlock_check" => {
                    options.deadlock_check = Some(seconds(input, "deadlock_check", "10")?)
                }
                "mixed_precision" => {
                    options.mixed_precision = Some(one_of(
                        input,
                        "mixed_precision = \"bf16\"",
                        &[
                            ("no", "No"),
                            ("bf16", "Bf16"),
                            ("fp16", "Fp16"),
                            ("auto", "Auto"),
                        ],
                        |value| {
                            format!("unknown mixed precision {value:?}: use \"no\", \"bf16\", \"fp16\" or \"auto\" (bf16 on GPUs of compute capability 8.0 or more, fp16 below)")
                        },
                    )?);
                }
                "grad_accum" => {
                    options.grad_accum = Some(at_least_one(
                        input,
                        "grad_accum = 4",
                        "`grad_accum` is the number of micro-batches per optimizer step: at least 1",
                    )?);
                }
                "optimizer" => {
                    options.optimizer = Some(one_of(
                        input,
                        "optimizer = \"fused\"",
                        &[("fused", "Fused"), ("foreach", "Foreach"), ("tch", "Tch")],
                        |value| {
                            format!("unknown optimizer implementation {value:?}: use \"fused\" (ATen's fused kernels, as torch.optim's fused=True), \"foreach\" (torch.optim's foreach=True) or \"tch\" (tch's own arithmetic, bit for bit)")
                        },
                    )?);
                }
                "zero" => {
                    let lit: LitInt = expect(input, "zero = 1")?;
                    let stage: u8 = lit.base10_parse()?;
                    if stage > 3 {
                        return Err(syn::Error::new(
                            lit.span(),
                            format!("ZeRO stage {stage}: use 1 (optimizer state sharded, as PyTorch's ZeroRedundancyOptimizer), 2 (and gradients), 3 (and parameters, as FSDP2's fully_shard) or 0 (off)"),
                        ));
                    }
                    options.zero = Some(stage);
                }
                "crate" => {
                    let lit: LitStr = expect(input, "crate = \"path::to::tch_distributed\"")?;
                    options.krate = Some(lit.parse().map_err(|_| {
                        syn::Error::new(
                            lit.span(),
                            format!(
                                "{:?} is not a path: write the path under which tch-distributed is a dependency, e.g. `crate = \"my_tchd\"`",
                                lit.value()
                            ),
                        )
                    })?);
                }
                _ => unreachable!("checked against VALID above"),
            }
            seen.push(name);
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(options)
    }
}

/// A positive number of seconds for option `name` (`example` in the error).
fn seconds(input: ParseStream, name: &str, example: &str) -> syn::Result<f64> {
    let (secs, span) = number(input, name, example)?;
    if secs.is_nan() || secs <= 0.0 {
        return Err(syn::Error::new(
            span,
            format!("`{name}` must be a positive number of seconds, e.g. `{name} = {example}`"),
        ));
    }
    Ok(secs)
}
