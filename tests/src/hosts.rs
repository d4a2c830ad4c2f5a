//! Hosts made of network namespaces, for the multi-host tests: each host is a
//! namespace with its own loopback and one `eth0` (10.77.0.{i+1}/24), and a third kind
//! of namespace, the switch, holds the bridge that joins them. Nothing is created in
//! the machine's own namespace, and every name carries this process's id, so tests
//! that run at the same time never meet. Dropping [`Hosts`] deletes the namespaces
//! (and with them their links), also when the test panics.
//!
//! Creating them needs root and iproute2's `ip`; [`Hosts::new`] says why it cannot,
//! for the test to [`skip`](crate::skip).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A small network of hosts on one bridge; see the module's doc.
pub struct Hosts {
    prefix: String,
    count: usize,
}

/// Runs `ip ARGS` (at most 30 s).
fn ip(args: &[&str]) -> Result<(), String> {
    if !crate::on_path("ip") {
        return Err("no `ip` (iproute2) on PATH".into());
    }
    let out = crate::output_within(Command::new("ip").args(args), b"", Duration::from_secs(30));
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// `count` hosts (at most 200) on one bridge, each reaching the others by its
    /// [`addr`](Self::addr). Errors with the reason when namespaces cannot be made
    /// here (not root, no `ip`, no network namespaces).
    pub fn new(count: usize) -> Result<Hosts, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("network namespaces need root".into());
        }
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let hosts = Hosts {
            prefix: format!(
                "tchd-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            count,
        };
        // From here on, Drop removes whatever was made.
        let switch = hosts.switch();
        ip(&["netns", "add", &switch])?;
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for i in 0..count {
            let ns = hosts.namespace(i);
            let port = format!("p{i}");
            let cidr = format!("{}/24", hosts.addr(i));
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns",
                &switch,
            ])?;
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &port, "up"])?;
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(hosts)
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    /// The namespace of host `i`.
    pub fn namespace(&self, i: usize) -> String {
        format!("{}-h{i}", self.prefix)
    }

    /// Host `i`'s address on the bridge: `10.77.0.{i+1}`.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// The bytes host `i`'s `eth0` received and sent so far (its counters in `/sys`):
    /// what crossed between it and the other hosts.
    pub fn bytes(&self, i: usize) -> u64 {
        ["rx_bytes", "tx_bytes"]
            .iter()
            .map(|counter| {
                let mut cat = self.command(i, "cat");
                cat.arg(format!("/sys/class/net/eth0/statistics/{counter}"));
                let out = crate::output_within(&mut cat, b"", Duration::from_secs(30));
                let text = String::from_utf8_lossy(&out.stdout);
                text.trim()
                    .parse::<u64>()
                    .unwrap_or_else(|_| panic!("host {i}'s {counter}: {text:?}"))
            })
            .sum()
    }

    /// A command that runs `program` on host `i` (`ip netns exec NS program`); add
    /// its arguments and environment as to any command.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespace(i)]).arg(program);
        cmd
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..self.count {
            let _ = ip(&["netns", "del", &self.namespace(i)]);
        }
        let _ = ip(&["netns", "del", &self.switch()]);
    }
}
