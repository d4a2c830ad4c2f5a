//! The C library's calls (libc): processes and signals, file descriptors (the
//! launcher's stderr tee), the host's name, kernel and network interfaces, glibc's
//! allocator, and libtorch's CUDA half loaded by name. Each is a safe function; the
//! signal handler that preemption installs lives here whole, since its safety rests
//! on what it does (async-signal-safe atomics only).

use std::ffi::{c_char, CStr};
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

/// Loads libtorch's CUDA half, `libtorch_cuda.so`, for the whole process (`dlopen`
/// with `RTLD_NOW | RTLD_GLOBAL`), found as the program finds libtorch (its rpath, or
/// `LD_LIBRARY_PATH`); nothing where there is none (a CPU-only libtorch). Loading it
/// registers CUDA with libtorch.
pub(crate) fn load_libtorch_cuda() {
    // SAFETY: the name is a C string; the library is libtorch's own, whose
    // initializers only register CUDA's hooks with libtorch (which this process has
    // loaded already); the handle is kept for the process's life (never `dlclose`d).
    unsafe {
        libc::dlopen(
            c"libtorch_cuda.so".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
        )
    };
}

/// This host's name (`gethostname`); `None` when it cannot be read.
pub(crate) fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what is passed.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast::<c_char>(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    ok.then(|| String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// The kernel's name, release and machine (`uname`); `None` when it fails.
pub(crate) fn uname() -> Option<(String, String, String)> {
    // SAFETY: `utsname` is plain C data (arrays of `c_char`), valid when zeroed.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a writable `utsname`.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return None;
    }
    let field = |f: &[c_char]| {
        let bytes: Vec<u8> = f
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    Some((
        field(&uts.sysname),
        field(&uts.release),
        field(&uts.machine),
    ))
}

/// The name of the network interface that has `address` (`getifaddrs`); `None` when
/// none has it or the list cannot be read.
pub(crate) fn interface_with(address: IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list that freeifaddrs releases
    // below, once; each entry's `ifa_addr` is null or points at a sockaddr of its
    // family, and `ifa_name` at a C string, all valid until then.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return None;
        }
        let mut found = None;
        let mut entry = list;
        while !entry.is_null() && found.is_none() {
            let ifa = &*entry;
            let addr = ifa.ifa_addr;
            let this = if addr.is_null() {
                None
            } else {
                match (*addr).sa_family as i32 {
                    libc::AF_INET => {
                        let sin = &*(addr as *const libc::sockaddr_in);
                        Some(IpAddr::from(sin.sin_addr.s_addr.to_ne_bytes()))
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(addr as *const libc::sockaddr_in6);
                        Some(IpAddr::from(sin6.sin6_addr.s6_addr))
                    }
                    _ => None,
                }
            };
            if this == Some(address) {
                found = Some(CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned());
            }
            entry = ifa.ifa_next;
        }
        libc::freeifaddrs(list);
        found
    }
}

/// Sets glibc's mmap threshold to `mmap` bytes (`mallopt(M_MMAP_THRESHOLD)`: blocks at
/// least that large are mapped, and given back to the system when freed) and its trim
/// threshold to `trim` bytes (`M_TRIM_THRESHOLD`: the free memory at the top of the
/// heap beyond which it is given back). Either fixes both: glibc stops adjusting them.
pub(crate) fn set_malloc_thresholds(mmap: i32, trim: i32) {
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, mmap) };
    // SAFETY: as above.
    unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, trim) };
}

/// Ends the process at once with `code` (`_exit`): no exit handler, no destructor,
/// no flush of Rust's buffers.
pub(crate) fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` ends the process without running any handler; it has no
    // precondition.
    unsafe { libc::_exit(code) }
}

/// Sends `signo` to process `pid` (`kill`); the caller makes sure that `pid` is
/// still its child (not reaped, so not reused).
///
/// # Errors
/// The system's error (no such process, no permission).
pub(crate) fn kill(pid: u32, signo: i32) -> io::Result<()> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: kill(2) has no memory-safety precondition.
    if unsafe { libc::kill(pid, signo) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Makes the child that `cmd` starts call `setsid` (a session of its own) and ask for
/// `SIGKILL` when its parent, this process's thread that forks it, dies
/// (`PR_SET_PDEATHSIG`); it exits at once if its parent is no longer this process (it
/// died before the request was in place). Linux only; elsewhere nothing.
pub(crate) fn new_session_killed_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: setsid, prctl, getppid and _exit are,
        // and `last_os_error` only reads errno (no allocation).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() == -1 {
                    return Err(io::Error::last_os_error());
                }
                let (signal, unused) = (libc::SIGKILL as libc::c_ulong, 0 as libc::c_ulong);
                if libc::prctl(libc::PR_SET_PDEATHSIG, signal, unused, unused, unused) == -1 {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// A pipe, both ends close-on-exec (`pipe2(O_CLOEXEC)`): (reader, writer).
///
/// # Errors
/// The system's error.
pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded: both are new descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Points fd 2 (stderr) at `fd`'s file (`dup2(fd, 2)`), atomically: every write to
/// stderr goes to the old or the new file. What fd 2 pointed at is closed unless
/// another descriptor refers to it.
///
/// # Errors
/// The system's error.
pub(crate) fn redirect_stderr(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: `fd` is open for the call. fd 2 is the standard library's stderr, open
    // for the whole process (std opens /dev/null at startup for a closed one), so no
    // other Rust owner holds that number; it stays open (now a copy of `fd`), and
    // whatever writes to stderr still writes to an open descriptor.
    if unsafe { libc::dup2(fd.as_raw_fd(), 2) } == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Registers `f` to run at the process's normal exit (`atexit`); `false` when it
/// cannot. `f` must not panic (a panic cannot unwind out of it: it aborts).
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a safe function that lives for the whole program.
    unsafe { libc::atexit(f) == 0 }
}

/// How many distinct senders of the first preemption signal are told apart; a
/// further sender's signal counts as a second request.
pub(crate) const SENDERS: usize = 4;

/// The processes that sent the first preemption signal so far (`si_pid`; 0 is the
/// kernel, as for a terminal's Ctrl-C), shared by the handlers that
/// [`on_preemption_signal`] installs. Only atomics: it is read and written in signal
/// handlers.
pub(crate) struct Senders([AtomicI32; SENDERS]);

/// Marks an empty slot of [`Senders`] (no process has pid -1).
const NO_SENDER: i32 = -1;

impl Senders {
    pub(crate) fn new() -> Self {
        Senders(std::array::from_fn(|_| AtomicI32::new(NO_SENDER)))
    }

    /// Records `pid` as a sender of the first signal; false when it had sent it
    /// already (or no slot is left): a second request.
    pub(crate) fn first_from(&self, pid: i32) -> bool {
        for slot in &self.0 {
            match slot.compare_exchange(NO_SENDER, pid, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return true,
                Err(seen) if seen == pid => return false,
                Err(_) => {}
            }
        }
        false
    }
}

/// Installs a handler of `signo` (one of several preemption signals sharing `first`
/// and `senders`): the first request stores its signal in `first` (0 while none);
/// a repeat of it from a sender not seen yet is ignored; a second request (the same
/// signal from a sender seen already, or another signal) ends the process at once with
/// `exit_code` (see [`Preemption`](crate::Preemption)).
///
/// # Errors
/// The system's error when the handler cannot be installed.
pub(crate) fn on_preemption_signal(
    signo: i32,
    first: Arc<AtomicUsize>,
    senders: Arc<Senders>,
    exit_code: i32,
) -> io::Result<()> {
    // SAFETY: the handler is async-signal-safe: it reads the siginfo it is given
    // (`si_pid`, which the kernel sets for a signal that a process sent), loads, stores and compare-exchanges atomics (no lock, no allocation: `Senders` is
    // atomics only, its `Arc`s are cloned before, never in the handler), and ends the
    // process with signal_hook's `exit` (`_exit`).
    unsafe {
        signal_hook_registry::register_sigaction(signo, move |info| {
            // SIGTERM and SIGINT sent by a process carry its pid.
            let sender = info.si_pid();
            let seen = first.load(Ordering::SeqCst);
            if seen == 0 {
                senders.first_from(sender);
                first.store(signo as usize, Ordering::SeqCst);
            } else if seen != signo as usize || !senders.first_from(sender) {
                // A second request: exit at once, as a shell would.
                signal_hook::low_level::exit(exit_code);
            }
        })
    }
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_counts_once() {
        let senders = Senders::new();
        // SLURM's signal to the rank, then the launcher's forwarded copy: one request.
        assert!(senders.first_from(4242));
        assert!(senders.first_from(17));
        // The scheduler again, or the launcher forwarding a second Ctrl-C: a second
        // request.
        assert!(!senders.first_from(4242));
        assert!(!senders.first_from(17));
        // A terminal's Ctrl-C comes from the kernel (pid 0), twice for a second one.
        assert!(senders.first_from(0));
        assert!(!senders.first_from(0));
    }

    #[test]
    fn senders_beyond_the_slots_count_as_second_requests() {
        let senders = Senders::new();
        for pid in 0..SENDERS as i32 {
            assert!(senders.first_from(pid), "sender {pid}");
        }
        assert!(!senders.first_from(1000));
    }

    #[test]
    fn the_hostname_and_the_kernel_are_read() {
        assert!(hostname().is_some_and(|h| !h.is_empty()));
        assert!(uname().is_some_and(|(sysname, _, _)| !sysname.is_empty()));
    }
}
