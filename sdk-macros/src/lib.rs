//! The `#[distributed]` attribute of `tch-distributed`.
//!
//! Use it through the runtime crate: `use tch_distributed::distributed;`.
//! The attribute is a skeleton until the macro issue lands; today it emits the
//! function unchanged so that code written against it keeps compiling.

use proc_macro::TokenStream;

/// Turns a single-GPU `tch` training function into data-parallel training.
///
/// Currently emits the function unchanged (the rewrites land with the macro issue).
#[proc_macro_attribute]
pub fn distributed(_args: TokenStream, item: TokenStream) -> TokenStream {
    item
}
