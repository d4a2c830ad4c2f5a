//! A per-job secret for the rendezvous store: every key the job's ranks use lives
//! under a prefix derived from it, so that a client without it (another job pointed at
//! the wrong port, a script that writes c10d's usual key names) cannot read or
//! overwrite them by name, and a rank started with another token is refused at
//! rendezvous.
//!
//! `tchrun` (and a program that starts its own ranks) makes one for a job on one node
//! and gives it to its ranks in `TCH_DISTRIBUTED_JOB_TOKEN`; across nodes, or under
//! SLURM, MPI or torchrun, the user sets that variable on every node (the same value),
//! and without it nothing changes. The store itself has no credentials: a client that
//! reaches its port can still list the keys (c10d's `listKeys`) and so find the prefix
//! (see the book's Security chapter).

use std::io::Read;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::store::Store;

/// The variable that carries the job's token to its ranks.
pub(crate) const JOB_TOKEN_ENV: &str = "TCH_DISTRIBUTED_JOB_TOKEN";

/// Where rank 0 publishes the token's check value, outside the job's prefix.
const CHECK_KEY: &str = "tch-distributed/job-token-check";

/// A job's secret. Never printed: neither `Debug` nor `Display` shows it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct JobToken(String);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobToken(…)")
    }
}

impl JobToken {
    /// The token in `TCH_DISTRIBUTED_JOB_TOKEN`, if set and not empty.
    pub(crate) fn from_env() -> Option<JobToken> {
        std::env::var(JOB_TOKEN_ENV)
            .ok()
            .filter(|t| !t.trim().is_empty())
            .map(JobToken)
    }

    /// A fresh token: 128 random bits from the system (`/dev/urandom`), in hex.
    ///
    /// Errors with [`Error::Io`] when the system's random source cannot be read.
    pub(crate) fn generate() -> Result<JobToken> {
        let mut bytes = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|source| Error::Io {
                context: "cannot read /dev/urandom for the job's token".into(),
                source,
            })?;
        Ok(JobToken(hex(&bytes)))
    }

    /// The token's value, for the ranks' environment.
    pub(crate) fn value(&self) -> &str {
        &self.0
    }

    /// The prefix of every key of the job (`job-` and 32 hex digits): a hash of the
    /// token, so that neither the prefix nor the check value gives the other away.
    pub(crate) fn prefix(&self) -> String {
        format!("job-{}", self.digest("prefix"))
    }

    fn digest(&self, purpose: &str) -> String {
        let mut hash = Sha256::new();
        hash.update(b"tch-distributed job token\0");
        hash.update(purpose.as_bytes());
        hash.update(b"\0");
        hash.update(self.0.as_bytes());
        hex(&hash.finalize()[..16])
    }
}

/// `prefix` under the job's own prefix when the job has a token (`job-…/worker/…`),
/// else `prefix` as it is.
pub(crate) fn under_job(token: Option<&JobToken>, prefix: &str) -> String {
    match token {
        Some(token) => format!("{}{prefix}", token.prefix()),
        None => prefix.to_string(),
    }
}

/// At rendezvous, on `store` (the job's store, before its prefix): rank 0 publishes
/// the token's check value, every other rank compares its own with it (waiting up to
/// the store's timeout for rank 0).
///
/// Errors with [`Error::Config`] when the tokens differ, saying so without showing
/// either; with the store's error when rank 0's value does not come.
pub(crate) fn agree(store: &Store, token: Option<&JobToken>, rank: usize) -> Result<()> {
    let Some(token) = token else { return Ok(()) };
    let check = token.digest("check");
    if rank == 0 {
        return store.set(CHECK_KEY, check.as_bytes());
    }
    let published = store.get(CHECK_KEY)?;
    if published != check.as_bytes() {
        return Err(Error::Config(format!(
            "rank {rank}'s job token ({JOB_TOKEN_ENV}) differs from rank 0's: this rank \
             joined another job's rendezvous store (check MASTER_ADDR and MASTER_PORT), or \
             its token was set differently; start every rank of a job with the same token \
             (tchrun gives its ranks its own)"
        )));
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_never_shown() {
        let (a, b) = (JobToken::generate().unwrap(), JobToken::generate().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.value().len(), 32);
        assert_eq!(format!("{a:?}"), "JobToken(…)");
        assert!(!a.prefix().contains(a.value()));
    }

    #[test]
    fn the_prefix_and_the_check_are_the_tokens_and_give_nothing_away() {
        let a = JobToken("one".into());
        let b = JobToken("two".into());
        assert_eq!(a.prefix(), JobToken("one".into()).prefix());
        assert_ne!(a.prefix(), b.prefix());
        assert!(a.prefix().starts_with("job-") && a.prefix().len() == 36);
        assert_ne!(a.digest("check"), a.digest("prefix"));
        assert_eq!(
            under_job(Some(&a), "/worker/attempt_0"),
            format!("{}/worker/attempt_0", a.prefix())
        );
        assert_eq!(under_job(None, "/worker/attempt_0"), "/worker/attempt_0");
    }

    #[test]
    fn ranks_with_other_tokens_are_refused_without_showing_either() {
        let store = Store::in_process().unwrap();
        let ours = JobToken("ours-secret".into());
        let theirs = JobToken("theirs-secret".into());
        agree(&store, None, 1).unwrap();
        agree(&store, Some(&ours), 0).unwrap();
        agree(&store, Some(&ours), 1).unwrap();
        let error = agree(&store, Some(&theirs), 1).unwrap_err().to_string();
        assert!(error.contains("job token"), "{error}");
        assert!(!error.contains("secret"), "a token shown: {error}");
    }
}
