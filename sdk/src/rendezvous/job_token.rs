//! A per-job secret for the rendezvous store. With a token, the job's ranks see the
//! store through a sealed view (`Store::sealed`): every key under a prefix derived from
//! the token, every value encrypted and authenticated (XChaCha20-Poly1305, a key
//! derived from the token, the full key name as associated data). So a client without
//! the token (another job pointed at the wrong port, a script that writes c10d's usual
//! key names, one that lists the keys and reads or overwrites them) can neither read
//! the job's values nor write one that the job accepts: what it writes counts as
//! absent. A rank started with another token is refused at rendezvous.
//!
//! `tchrun` (and a program that starts its own ranks) makes one for a job on one node
//! and gives it to its ranks in `TCH_DISTRIBUTED_JOB_TOKEN`; across nodes, or under
//! SLURM, MPI or torchrun, the user sets that variable on every node (the same value),
//! and without it nothing changes. What the token does not hide: the keys' names and
//! sizes, and a client can still delete keys or flood the port (the book's Security
//! chapter).

use std::io::Read;

use chacha20poly1305::aead::{AeadCore, AeadInPlace, KeyInit, OsRng};
use chacha20poly1305::{Tag, XChaCha20Poly1305, XNonce};
use sha2::{Digest, Sha256};

use super::store::Store;
use crate::error::{Error, Result};
use crate::ffi::store::Sealer;
use crate::ffi::SECRET_BYTES;

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
        crate::settings::var("job_token").map(JobToken)
    }

    /// A fresh token: 128 random bits from the system (`/dev/urandom`), in hex.
    ///
    /// # Errors
    /// [`Error::Io`] when the system's random source cannot be read.
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

    /// The key that seals the job's store values: a hash of the token, apart from the
    /// prefix's and the check value's.
    pub(crate) fn secret(&self) -> [u8; SECRET_BYTES] {
        self.hash("seal").into()
    }

    fn digest(&self, purpose: &str) -> String {
        hex(&self.hash(purpose)[..16])
    }

    fn hash(&self, purpose: &str) -> sha2::digest::Output<Sha256> {
        let mut hash = Sha256::new();
        hash.update(b"tch-distributed job token\0");
        hash.update(purpose.as_bytes());
        hash.update(b"\0");
        hash.update(self.0.as_bytes());
        hash.finalize()
    }
}

/// The job's view of `store`: its keys under `prefix`, after the token's own prefix
/// and sealed when the job has a token ([`Store::sealed`]), else under `prefix` alone
/// as they are.
pub(crate) fn view(store: &Store, token: Option<&JobToken>, prefix: &str) -> Result<Store> {
    match token {
        Some(token) => store.sealed(&format!("{}{prefix}", token.prefix()), token),
        None => store.with_prefix(prefix),
    }
}

impl Store {
    /// The job's sealed view of this store (`sealed_store.cpp`): every key under
    /// `prefix` (joined with `/`, as [`with_prefix`](Self::with_prefix)), every value
    /// encrypted and authenticated with a key derived from `token` and bound to its
    /// full key ([`job_token`](self)). A value that does not open (written
    /// without the token, or moved from another key) counts as absent: `get` waits on
    /// for one that opens, up to the timeout, then errors saying so; `add` replaces it.
    pub(crate) fn sealed(&self, prefix: &str, token: &JobToken) -> Result<Store> {
        let cprefix = super::store::cstring(prefix, "prefix")?;
        let secret = token.secret();
        self.view(self.raw().sealed::<Cipher>(&cprefix, &secret))
    }
}

/// How many bytes sealing adds to a value: the random nonce and the tag.
pub(crate) const SEAL_OVERHEAD: usize = 24 + 16;

/// The sealed store's cipher (`sealed_store.cpp` calls it through
/// [`Sealer`]'s trampolines): XChaCha20-Poly1305, the full key as associated data.
struct Cipher;

impl Sealer for Cipher {
    const OVERHEAD: usize = SEAL_OVERHEAD;

    /// Seals a store value: `out` gets the nonce, the ciphertext and the tag. A fresh
    /// random nonce each time (192 bits, so random ones never repeat in practice).
    fn seal(secret: &[u8; SECRET_BYTES], key: &[u8], plain: &[u8], out: &mut [u8]) -> bool {
        let cipher = cipher(secret);
        let (nonce, rest) = out.split_at_mut(24);
        let (body, tag) = rest.split_at_mut(plain.len());
        body.copy_from_slice(plain);
        let fresh = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        nonce.copy_from_slice(&fresh);
        match cipher.encrypt_in_place_detached(&fresh, key, body) {
            Ok(t) => {
                tag.copy_from_slice(&t);
                true
            }
            Err(_) => false,
        }
    }

    /// Opens a sealed store value: whether it was sealed with this secret under this
    /// key.
    fn open(secret: &[u8; SECRET_BYTES], key: &[u8], sealed: &[u8], out: &mut [u8]) -> bool {
        let Some(body_len) = sealed.len().checked_sub(SEAL_OVERHEAD) else {
            return false;
        };
        let cipher = cipher(secret);
        let (nonce, rest) = sealed.split_at(24);
        let (body, tag) = rest.split_at(body_len);
        out.copy_from_slice(body);
        let opened = cipher.decrypt_in_place_detached(
            XNonce::from_slice(nonce),
            key,
            out,
            Tag::from_slice(tag),
        );
        opened.is_ok()
    }
}

fn cipher(secret: &[u8; SECRET_BYTES]) -> XChaCha20Poly1305 {
    XChaCha20Poly1305::new_from_slice(secret).expect("a 32-byte key")
}

/// At rendezvous, on `store` (the job's store, before its prefix): rank 0 publishes
/// the token's check value, every other rank compares its own with it (waiting up to
/// the store's timeout for rank 0).
///
/// # Errors
/// [`Error::Config`] when the tokens differ, saying so without showing
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
    use std::time::Duration;

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
        assert_ne!(a.secret(), b.secret());
        assert_eq!(a.secret(), JobToken("one".into()).secret());
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

    /// An in-process store and the job's sealed view of it under `/worker/attempt_0`,
    /// whose reads give up after `timeout`.
    fn sealed(token: &str, timeout: Duration) -> (Store, Store) {
        let raw = Store::in_process().unwrap();
        let token = JobToken(token.into());
        let view = view(&raw, Some(&token), "/worker/attempt_0").unwrap();
        view.set_timeout(timeout).unwrap();
        (raw, view)
    }

    fn full(token: &str, key: &str) -> String {
        format!("{}/worker/attempt_0/{key}", JobToken(token.into()).prefix())
    }

    #[test]
    fn the_sealed_view_keeps_values_under_the_prefix_and_unreadable_without_the_token() {
        let (raw, view) = sealed("ours", Duration::from_secs(5));
        view.set("gloo/addr", b"127.0.0.1:29500").unwrap();
        assert_eq!(view.get("gloo/addr").unwrap(), b"127.0.0.1:29500");
        assert_eq!(raw.list_keys().unwrap(), [full("ours", "gloo/addr")]);
        let stored = raw.get(&full("ours", "gloo/addr")).unwrap();
        assert_eq!(stored.len(), b"127.0.0.1:29500".len() + SEAL_OVERHEAD);
        assert!(
            !stored.windows(9).any(|w| w == b"127.0.0.1"),
            "stored in the clear: {stored:?}"
        );
        // Sealed twice, the same value looks different (a fresh nonce each time).
        view.set("gloo/addr", b"127.0.0.1:29500").unwrap();
        assert_ne!(raw.get(&full("ours", "gloo/addr")).unwrap(), stored);
        // Counters count, and reading one (add 0) does not create it.
        assert_eq!(view.add("count", 1).unwrap(), 1);
        assert_eq!(view.add("count", 2).unwrap(), 3);
        assert_eq!(view.add("count", 0).unwrap(), 3);
        assert_eq!(view.add("absent", 0).unwrap(), 0);
        assert_eq!(view.get("count").unwrap(), b"3");
        assert_eq!(raw.list_keys().unwrap().len(), 2);
        // Without a token, the same prefix reads the sealed bytes, not the value.
        let bare = view_without_token(&raw);
        assert_eq!(bare.get("count").unwrap().len(), 1 + SEAL_OVERHEAD);
    }

    fn view_without_token(raw: &Store) -> Store {
        view(
            raw,
            None,
            &format!("{}/worker/attempt_0", JobToken("ours".into()).prefix()),
        )
        .unwrap()
    }

    #[test]
    fn a_value_written_without_the_token_counts_as_absent() {
        let (raw, view) = sealed("ours", Duration::from_millis(300));
        // Forged in the clear at the full key, as a client that listed the keys would.
        raw.set(&full("ours", "verdict"), b"size 0=3").unwrap();
        raw.add(&full("ours", "count"), 5).unwrap();
        let error = view.get("verdict").unwrap_err().to_string();
        assert!(
            error.contains("failed authentication with the job's token"),
            "{error}"
        );
        // A counter starts again from 0 over the forged one.
        assert_eq!(view.add("count", 0).unwrap(), 0);
        assert_eq!(view.add("count", 1).unwrap(), 1);
        // A sealed value moved to another key does not open there.
        view.set("mine", b"value").unwrap();
        let moved = raw.get(&full("ours", "mine")).unwrap();
        raw.set(&full("ours", "other"), &moved).unwrap();
        assert!(view.get("other").is_err());
        // Nor does a value sealed at our key with another token's secret.
        let ours = format!("{}/worker/attempt_0", JobToken("ours".into()).prefix());
        let theirs = raw.sealed(&ours, &JobToken("theirs".into())).unwrap();
        theirs.set("mine", b"theirs").unwrap();
        assert!(view.get("mine").is_err());
    }

    #[test]
    fn a_read_waits_past_a_forged_value_for_the_jobs_own() {
        let (raw, view) = sealed("ours", Duration::from_secs(20));
        raw.set(&full("ours", "addr"), b"forged").unwrap();
        let writer = view.clone_connection().unwrap();
        let started = std::time::Instant::now();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            writer.set("addr", b"real").unwrap();
        });
        assert_eq!(view.get("addr").unwrap(), b"real");
        assert!(started.elapsed() >= Duration::from_millis(200));
        late.join().unwrap();
    }
}
