//! Rendezvous: how a job's ranks find each other before the process group forms.
//!
//! - [`store`]: the c10d key-value stores (`TCPStore` on `MASTER_ADDR:MASTER_PORT`,
//!   in-process, prefixed views) through which the ranks meet;
//! - [`job_token`]: the per-job secret and the sealed view of the store it gives;
//! - [`network`]: which address the master is and which local address a rank's Gloo
//!   device binds and advertises;
//! - [`join`]: the count at the store, which waits until every rank has joined.

pub(crate) mod job_token;
pub(crate) mod join;
pub(crate) mod network;
pub(crate) mod store;

pub use network::GlooAddress;
pub use store::Store;
