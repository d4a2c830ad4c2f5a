//! Key-value stores for rendezvous: libtorch's `c10d::TCPStore`, `HashStore` and
//! `PrefixStore`, and a job's sealed view (`sealed_store.cpp`).

use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::os::fd::OwnedFd;
use std::time::Duration;

use super::network::resolve_master;
use crate::error::{Error, Result};
use crate::ffi::store::StoreHandle;

/// A c10d key-value store shared by all ranks; the process group rendezvous through
/// it. Cheap to share: the C++ object is reference counted.
pub struct Store {
    raw: StoreHandle,
    host: Host,
    /// The address and port of a TCP store (the one its clients connect to).
    endpoint: Option<(String, u16)>,
}

/// The message for a store that could not be reached: where, for how long, why (the
/// system's reason, when libtorch gives one), and what to check; libtorch's text
/// follows.
fn unreachable_store(host: &str, port: u16, timeout: Duration, text: &str) -> String {
    let reason = text
        .split("errno: ")
        .nth(1)
        .and_then(|rest| rest.split_once(" - "))
        .map(|(_, why)| why.trim_end_matches(|c: char| c == ')' || c == '.' || c.is_whitespace()))
        .map_or_else(String::new, |why| format!(" ({why})"));
    let text = crate::error::TorchText::new(text).message();
    format!(
        "could not reach the rendezvous store at {host}:{port} within {}{reason}: is node 0's \
         launcher (tchrun, torchrun) or, without one, rank 0 running there, and do MASTER_ADDR \
         and MASTER_PORT (--master-addr, --master-port) name it on every host?\n{text}",
        crate::error::seconds(timeout)
    )
}

/// Which process serves a store: the one to suspect when it stops answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Host {
    /// A TCP store that a rank hosts, rank 0 by convention (a launch without a
    /// launcher: SLURM, MPI, or ranks started by hand).
    Rank0,
    /// A TCP store that the launcher hosts (tchrun's and torchrun's agent store).
    Launcher,
    /// An in-process store.
    Local,
}

pub(super) fn cstring(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidInput(format!("{what} {s:?} contains a NUL byte")))
}

/// The socket a store's server listens on: the address that `host` resolves to (as
/// the ranks resolve it, [`resolve_master`]), so that a job on one host (`127.0.0.1`)
/// listens on loopback only and a job on several hosts on the master's address only,
/// not on every interface as c10d's own bind does. When the job spans `several_hosts`
/// but `host` resolves to a loopback address here (a hostname that `/etc/hosts` maps
/// to 127.0.1.1, as Debian does), the other hosts could not reach that: it listens on
/// every interface instead, as before.
///
/// # Errors
/// [`Error::PortInUse`] when the port is taken, [`Error::Rendezvous`] when
/// `host` does not resolve or the address cannot be bound.
fn listener(host: &str, port: u16, world_size: usize, several_hosts: bool) -> Result<TcpListener> {
    let fail = |message: String| Error::Rendezvous {
        addr: host.to_string(),
        port,
        rank: None,
        world_size,
        message,
    };
    let address = resolve_master(host, port).map_err(fail)?;
    let address = match address.ip() {
        ip if several_hosts && ip.is_loopback() => {
            let any: IpAddr = if ip.is_ipv4() {
                Ipv4Addr::UNSPECIFIED.into()
            } else {
                Ipv6Addr::UNSPECIFIED.into()
            };
            SocketAddr::new(any, port)
        }
        _ => address,
    };
    TcpListener::bind(address).map_err(|e| match e.kind() {
        std::io::ErrorKind::AddrInUse => Error::PortInUse {
            addr: host.to_string(),
            port,
        },
        _ => fail(format!("cannot listen on {address}: {e}")),
    })
}

impl Store {
    /// Connects to (or, with `is_server`, hosts) a `c10d::TCPStore` at `host:port`,
    /// as `torch.distributed.TCPStore`. A server listens on the address that `host`
    /// resolves to (every interface when that is a loopback address, which other
    /// hosts could not reach); see [`Store::tcp_server`] to say that every rank is on
    /// this host.
    ///
    /// Connecting retries until `timeout`. Errors: [`Error::PortInUse`] when the server
    /// cannot bind `port` (returned at once), [`Error::Rendezvous`] when the store cannot
    /// be reached within `timeout`.
    ///
    /// # Errors
    /// [`Error::PortInUse`] when the server cannot bind `port` (returned at once), [`Error::Rendezvous`] when the store cannot be reached within `timeout`.
    pub fn tcp(
        host: &str,
        port: u16,
        world_size: usize,
        is_server: bool,
        timeout: Duration,
    ) -> Result<Store> {
        if is_server {
            return Store::tcp_server(host, port, world_size, true, timeout);
        }
        Store::tcp_with(host, port, world_size, None, timeout)
    }

    /// Hosts a `c10d::TCPStore` at `host:port` (port 0: a free one, see
    /// [`Store::port`]), listening on the address that `host` resolves to: loopback
    /// for a job on this host alone. With `several_hosts`, a `host` that resolves to
    /// a loopback address here listens on every interface instead, so that the other
    /// hosts can reach it.
    ///
    /// # Errors
    /// As [`Store::tcp`].
    pub(crate) fn tcp_server(
        host: &str,
        port: u16,
        world_size: usize,
        several_hosts: bool,
        timeout: Duration,
    ) -> Result<Store> {
        let listener = listener(host, port, world_size, several_hosts)?;
        Store::tcp_with(host, port, world_size, Some(listener), timeout)
    }

    /// A client of the store at `host:port`, or with `listener` its server, which
    /// takes the listening socket over (c10d's `masterListenFd`).
    fn tcp_with(
        host: &str,
        port: u16,
        world_size: usize,
        listener: Option<TcpListener>,
        timeout: Duration,
    ) -> Result<Store> {
        let chost = cstring(host, "host")?;
        let is_server = listener.is_some();
        // c10d owns the socket from here on (it closes it with the store).
        StoreHandle::tcp(
            &chost,
            port,
            world_size as i32,
            listener.map(OwnedFd::from),
            millis(timeout),
        )
        .map(|raw| Store {
            raw,
            host: Host::Rank0,
            endpoint: Some((host.to_string(), port)),
        })
        .map_err(|message| {
            if message.contains("EADDRINUSE") || message.contains("address already in use") {
                Error::PortInUse {
                    addr: host.to_string(),
                    port,
                }
            } else {
                Error::Rendezvous {
                    addr: host.to_string(),
                    port,
                    rank: None,
                    world_size,
                    message: if is_server {
                        message
                    } else {
                        unreachable_store(host, port, timeout, &message)
                    },
                }
            }
        })
    }

    /// An in-process `c10d::HashStore`, for a world of one process: no network.
    ///
    /// # Errors
    /// [`Error::Torch`] when libtorch cannot make the store.
    pub fn in_process() -> Result<Store> {
        StoreHandle::hash()
            .map(|raw| Store {
                raw,
                host: Host::Local,
                endpoint: None,
            })
            .map_err(Error::Torch)
    }

    /// A view of this store where every key is prefixed with `prefix`
    /// (`c10d::PrefixStore`).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `prefix` holds a NUL byte; [`Error::Torch`] when
    /// libtorch cannot make the view.
    pub fn with_prefix(&self, prefix: &str) -> Result<Store> {
        let cprefix = cstring(prefix, "prefix")?;
        self.view(self.raw.prefixed(&cprefix))
    }

    /// A second connection to the same store (for a TCP store, a new client; keys and
    /// prefix are the same), so that a thread can wait on it, with a timeout of its
    /// own, without holding up the other users of this one.
    pub(crate) fn clone_connection(&self) -> Result<Store> {
        self.view(self.raw.clone_connection())
    }

    /// `raw`, a view of this store that the shim made (or its failure), served by the
    /// same process at the same endpoint.
    pub(super) fn view(&self, raw: std::result::Result<StoreHandle, String>) -> Result<Store> {
        raw.map(|raw| Store {
            raw,
            host: self.host,
            endpoint: self.endpoint.clone(),
        })
        .map_err(Error::Torch)
    }

    /// How long [`get`](Self::get) waits for a key that is not there yet.
    pub(crate) fn set_timeout(&self, timeout: Duration) -> Result<()> {
        self.raw.set_timeout(millis(timeout)).map_err(Error::Torch)
    }

    /// The TCP port of a TCP store (the bound one when it was created with port 0);
    /// `None` for other stores.
    pub fn port(&self) -> Option<u16> {
        self.raw.port()
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `key` holds a NUL byte; [`Error::Torch`] when the
    /// store cannot be reached.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let ckey = cstring(key, "key")?;
        self.raw.set(&ckey, value).map_err(Error::Torch)
    }

    /// Gets `key`, waiting for it up to the store's timeout.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `key` holds a NUL byte; [`Error::Torch`] when the
    /// store cannot be reached or the key is not set within the timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let ckey = cstring(key, "key")?;
        let value = self.raw.get(&ckey).map_err(Error::Torch)?;
        Ok(value.as_bytes().to_vec())
    }

    /// Atomically adds `delta` to the integer at `key` (0 when absent); returns the new value.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `key` holds a NUL byte; [`Error::Torch`] when the
    /// store cannot be reached.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let ckey = cstring(key, "key")?;
        self.raw.add(&ckey, delta).map_err(Error::Torch)
    }

    /// Every key in the store, as the server holds them (prefixes included; c10d's
    /// `listKeys`). Anyone who reaches a TCP store's port can list its keys: a job's
    /// token hides its values, not their names (the book's Security chapter).
    ///
    /// # Errors
    /// [`Error::Torch`] when the store cannot be read.
    pub fn list_keys(&self) -> Result<Vec<String>> {
        let bytes = self.raw.list_keys().map_err(Error::Torch)?;
        Ok(bytes
            .as_bytes()
            .split(|&b| b == 0)
            .filter(|k| !k.is_empty())
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect())
    }

    /// This store, marked as served by the launcher (the ranks joined its agent store).
    pub(crate) fn served_by_launcher(mut self) -> Store {
        self.host = Host::Launcher;
        self
    }

    /// Where a TCP store listens, as its clients were told (`host`, `port`; the port
    /// as given, 0 included); `None` for other stores.
    pub(crate) fn endpoint(&self) -> Option<(&str, u16)> {
        self.endpoint.as_ref().map(|(h, p)| (h.as_str(), *p))
    }

    /// Which process serves this store.
    pub(crate) fn host(&self) -> Host {
        self.host
    }

    /// The store's handle, for the process group built over it.
    pub(crate) fn raw(&self) -> &StoreHandle {
        &self.raw
    }
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
