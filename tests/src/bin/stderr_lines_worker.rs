//! `stderr_lines_worker DIR N`: once every rank of the job is ready (each puts a file
//! `ready-RANK` in `DIR` and waits for the others', so that the ranks write at the same
//! time), writes `N` lines to stderr as fast as it can, as programs do, in pieces:
//! `eprintln!` and `writeln!` on the unlocked stderr make one `write` per piece of their
//! format. Each line is `rank R line I of N: x…x end`, with `20 + 7 R` x's. For the test
//! that every line a rank writes reaches the launcher whole.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn main() {
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    let (rank, world) = (var("RANK").unwrap_or(0), var("WORLD_SIZE").unwrap_or(1));
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: stderr_lines_worker DIR N"));
    let n: usize = args.next().and_then(|a| a.parse().ok()).expect("N lines");
    std::fs::write(dir.join(format!("ready-{rank}")), b"").expect("writing DIR/ready-RANK");
    let deadline = Instant::now() + Duration::from_secs(30);
    while (0..world).any(|r| !dir.join(format!("ready-{r}")).exists()) {
        assert!(Instant::now() < deadline, "the other ranks never got ready");
        std::thread::sleep(Duration::from_millis(1));
    }
    let pad = "x".repeat(20 + 7 * rank);
    for i in 0..n {
        if i % 2 == 0 {
            eprintln!("rank {} line {} of {}: {} end", rank, i, n, pad);
        } else {
            let _ = writeln!(
                std::io::stderr(),
                "rank {} line {} of {}: {} end",
                rank,
                i,
                n,
                pad
            );
        }
    }
}
