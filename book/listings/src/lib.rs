//! The code listings of the guide (`book/`). Each binary in `src/bin` is one listing;
//! the chapters pull its parts in with `{{#include …:anchor}}`, and
//! `tests/listings.rs` runs every one of them, on one rank and on several.
