//! Which local address a rank's Gloo device binds, and so advertises to its peers.
//!
//! c10d's default device binds the address that the machine's hostname resolves to.
//! On many machines that is a loopback address (`/etc/hosts` maps the hostname to
//! 127.0.0.1, or to 127.0.1.1 as Debian does), so a rank on another host connects to
//! its own loopback and the job never starts; PyTorch's users learn to set
//! `GLOO_SOCKET_IFNAME`. Here a rank binds instead the local address of its route to
//! the master, the address its own store connection to `MASTER_ADDR` leaves from,
//! which the other hosts reach by construction:
//!
//! - `GLOO_SOCKET_IFNAME` set: those interfaces (comma-separated), as PyTorch;
//! - the master on loopback (every rank on this host) or no master (one process): the
//!   master's loopback address (127.0.0.1), so that a job on one host listens on
//!   nothing that another machine can reach (c10d's default, the hostname's address,
//!   can be one that is);
//! - otherwise: the route's local address, and the interface that has it.
//!
//! With NCCL the same interface (`lo` on one host) is given to NCCL's bootstrap
//! (`NCCL_SOCKET_IFNAME`), unless that is set.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::ffi::os::interface_with;

/// The variable that names Gloo's interfaces, as PyTorch reads it.
pub(crate) const GLOO_IFNAME: &str = "GLOO_SOCKET_IFNAME";

/// Where a rank's Gloo device listens; see the module's doc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GlooAddress {
    /// The interfaces that `GLOO_SOCKET_IFNAME` names (comma-separated).
    Named(String),
    /// The local address of the route to the master, and the interface that has it
    /// (`None` when no interface lists it, say inside a container runtime).
    Route {
        address: IpAddr,
        interface: Option<String>,
    },
    /// A loopback address, and the interface that has it: every rank is on this
    /// host (the master's address, 127.0.0.1 for one process).
    Loopback {
        address: IpAddr,
        interface: Option<String>,
    },
}

impl GlooAddress {
    /// The choice for a store at `master` (`host`, `port`; `None` for an in-process
    /// store), with `named` the value of `GLOO_SOCKET_IFNAME`.
    ///
    /// # Errors
    /// The message (for the caller's [`Error::Rendezvous`](crate::Error))
    /// when `master` does not resolve, or no route leads to it.
    pub(crate) fn choose(
        named: Option<String>,
        master: Option<(&str, u16)>,
    ) -> Result<Self, String> {
        if let Some(named) = named.filter(|n| !n.trim().is_empty()) {
            return Ok(GlooAddress::Named(named));
        }
        let loopback = |address: IpAddr| GlooAddress::Loopback {
            address,
            interface: interface_with(address),
        };
        let Some((host, port)) = master else {
            return Ok(loopback(Ipv4Addr::LOCALHOST.into()));
        };
        let master = resolve_master(host, port)?;
        if master.ip().is_loopback() {
            return Ok(loopback(master.ip()));
        }
        let address = route_source(master).map_err(|e| {
            format!(
                "no route from this host to the master at {master}: {e}; check MASTER_ADDR, \
                 or name the interface that reaches it with {GLOO_IFNAME}=<interface>"
            )
        })?;
        if address.is_loopback() {
            return Ok(loopback(address));
        }
        Ok(GlooAddress::Route {
            address,
            interface: interface_with(address),
        })
    }

    /// The interfaces for the shim (`GLOO_SOCKET_IFNAME`'s value), or "".
    pub(crate) fn interfaces(&self) -> &str {
        match self {
            GlooAddress::Named(names) => names,
            _ => "",
        }
    }

    /// The address for the shim to bind, or "" for the others.
    pub(crate) fn address(&self) -> String {
        match self {
            GlooAddress::Route { address, .. } | GlooAddress::Loopback { address, .. } => {
                address.to_string()
            }
            GlooAddress::Named(_) => String::new(),
        }
    }

    /// The interface to give NCCL's bootstrap, when the route (or loopback) chose one.
    pub(crate) fn route_interface(&self) -> Option<&str> {
        match self {
            GlooAddress::Route {
                interface: Some(name),
                ..
            }
            | GlooAddress::Loopback {
                interface: Some(name),
                ..
            } => Some(name),
            _ => None,
        }
    }
}

impl fmt::Display for GlooAddress {
    /// As the banner shows it: `10.0.0.2 (eth0, the route to the master)`,
    /// `interface eth0 (GLOO_SOCKET_IFNAME)`, or `127.0.0.1 (loopback, every rank on
    /// this host)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GlooAddress::Named(names) => write!(f, "interface {names} ({GLOO_IFNAME})"),
            GlooAddress::Route {
                address,
                interface: Some(name),
            } => write!(f, "{address} ({name}, the route to the master)"),
            GlooAddress::Route {
                address,
                interface: None,
            } => write!(f, "{address} (the route to the master)"),
            GlooAddress::Loopback { address, .. } => {
                write!(f, "{address} (loopback, every rank on this host)")
            }
        }
    }
}

/// The message for a process group that could not be made: when Gloo could not
/// connect to a peer (`remote=[ADDR]:PORT` in libtorch's `text`), which rank tried
/// which address, the likely cause and the fix; else libtorch's text without C++
/// frames.
/// `endpoint`: the store's, where the master is.
pub(crate) fn connect_failure(rank: usize, text: &str, endpoint: Option<(&str, u16)>) -> String {
    let message = crate::error::TorchText::new(text).message();
    let Some(remote) = peer_endpoint(text) else {
        return message;
    };
    // Across hosts: the master, which every rank reaches, is not on loopback.
    let multi_host = endpoint
        .and_then(|(host, port)| resolve_master(host, port).ok())
        .is_some_and(|a| !a.ip().is_loopback());
    let cause = match remote {
        peer if peer.ip().is_loopback() && multi_host => format!(
            "that is a loopback address: a rank on another host advertised it (PyTorch's \
             default where the hostname resolves to loopback, or {GLOO_IFNAME}=lo there). \
             Set {GLOO_IFNAME}=<interface> on that host, the interface that reaches the \
             others (`ip route get <MASTER_ADDR>` names it), or leave it unset under \
             tch-distributed, which binds the route to the master"
        ),
        _ => format!(
            "check that this host reaches that address (a firewall, or an interface that \
             routes elsewhere); {GLOO_IFNAME}=<interface> on each host names the interface \
             its ranks listen on"
        ),
    };
    format!("rank {rank} could not connect to a peer at {remote}: {cause}.\n{message}")
}

/// The last `[ADDR]:PORT` in Gloo's `text` whose `ADDR` is an IP address: the peer of
/// a failed connection (`remote=[127.0.0.1]:37258`, `Connection closed by peer
/// [10.0.0.2]:37602`; the file names in `[…/pair.cc:547]` are not).
pub(crate) fn peer_endpoint(text: &str) -> Option<SocketAddr> {
    text.match_indices(']')
        .filter_map(|(end, _)| {
            let start = text[..end].rfind('[')?;
            let ip = text[start + 1..end].parse::<IpAddr>().ok()?;
            let digits = text[end + 1..].strip_prefix(':')?;
            let port = digits[..digits
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(digits.len())]
                .parse()
                .ok()?;
            Some(SocketAddr::new(ip, port))
        })
        .last()
}

/// This host's address towards the master at `host:port` (the local address of the
/// route there), for naming a node; `None` when it does not resolve or has no route.
pub(crate) fn address_towards(host: &str, port: u16) -> Option<IpAddr> {
    route_source(resolve_master(host, port).ok()?).ok()
}

/// The master's address, `host:port` resolved as every rank and the store's host
/// resolve it (the first address the resolver gives).
///
/// # Errors
/// The message (for the caller's error) when `host` does not resolve or
/// has no address.
pub(crate) fn resolve_master(host: &str, port: u16) -> Result<SocketAddr, String> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("MASTER_ADDR {host:?} does not resolve: {e}"))?
        .next()
        .ok_or_else(|| format!("MASTER_ADDR {host:?} has no address"))
}

/// The local address that a connection to `to` leaves from: the kernel's choice of
/// route, read from a UDP socket connected there (connecting a UDP socket sends
/// nothing).
fn route_source(to: SocketAddr) -> std::io::Result<IpAddr> {
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(any)?;
    // Any port routes the same; 0 is not one a socket can connect to.
    let to = SocketAddr::new(to.ip(), to.port().max(1));
    socket.connect(to)?;
    Ok(socket.local_addr()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_interface_wins_and_loopback_or_no_master_binds_loopback() {
        let named = GlooAddress::choose(Some("eth1".into()), Some(("10.1.2.3", 1))).unwrap();
        assert_eq!(named, GlooAddress::Named("eth1".into()));
        assert_eq!(named.interfaces(), "eth1");
        assert_eq!(named.address(), "");
        for master in [Some(("127.0.0.1", 29500)), Some(("localhost", 29500)), None] {
            let chosen = GlooAddress::choose(None, master).unwrap();
            assert!(
                matches!(chosen, GlooAddress::Loopback { address, .. } if address.is_loopback()),
                "{master:?}: {chosen:?}"
            );
            assert!(chosen.address().starts_with("127.") || chosen.address() == "::1");
        }
        let one = GlooAddress::choose(None, Some(("127.0.0.1", 29500))).unwrap();
        assert_eq!(one.address(), "127.0.0.1");
        assert!(
            one.route_interface().is_some(),
            "{one:?}: lo, for NCCL's bootstrap"
        );
        // An empty variable is no choice.
        assert_eq!(
            GlooAddress::choose(Some(" ".into()), None)
                .unwrap()
                .address(),
            "127.0.0.1"
        );
    }

    #[test]
    fn loopback_has_an_interface_and_the_route_to_this_host_leaves_from_loopback() {
        let lo = IpAddr::from([127, 0, 0, 1]);
        assert!(interface_with(lo).is_some());
        assert_eq!(interface_with(IpAddr::from([192, 0, 2, 77])), None);
        assert!(route_source((lo, 9).into()).unwrap().is_loopback());
    }

    #[test]
    fn gloos_remote_address_is_read_from_its_text() {
        let text = "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] \
                    timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:37258";
        let shown = |text| peer_endpoint(text).map(|a| a.to_string());
        assert_eq!(shown(text).as_deref(), Some("127.0.0.1:37258"));
        assert_eq!(shown("remote=[::1]:80 x").as_deref(), Some("[::1]:80"));
        assert_eq!(shown("no peer here"), None);
        let closed = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error \
                      [10.77.0.2]:2199: Connection reset by peer";
        assert_eq!(
            peer_endpoint(closed).map(|a| a.ip()),
            Some(IpAddr::from([10, 77, 0, 2]))
        );
        assert_eq!(peer_endpoint("[/a/pair.cc:538] no address"), None);
    }

    #[test]
    fn the_banner_names_the_address_and_why() {
        let route = GlooAddress::Route {
            address: IpAddr::from([10, 77, 0, 2]),
            interface: Some("eth0".into()),
        };
        assert_eq!(
            route.to_string(),
            "10.77.0.2 (eth0, the route to the master)"
        );
        assert_eq!(route.address(), "10.77.0.2");
        assert_eq!(route.route_interface(), Some("eth0"));
        assert_eq!(
            GlooAddress::Named("eth1".into()).to_string(),
            "interface eth1 (GLOO_SOCKET_IFNAME)"
        );
    }
}
