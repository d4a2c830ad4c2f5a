//! `tchrun config`'s questions, one per line, as `accelerate config` asks them. Every
//! answer goes through its row's parser ([`Setting::set`]), as a flag's would.

use std::io::{BufRead, Write};

use super::{row, Settings};
use crate::error::{Error, Result};

pub(super) fn ask(
    input: &mut impl BufRead,
    output: &mut impl Write,
    current: &Settings,
) -> Result<Settings> {
    let mut q = Questions {
        input,
        output,
        current,
        answers: Settings::default(),
    };
    q.ask("nnodes", "How many machines (nodes) does the job use?", "1")?;
    let nodes = q.answers.nnodes.unwrap_or(1);
    if nodes > 1 {
        loop {
            let question = format!("Which machine is this one, 0 to {}?", nodes - 1);
            q.ask("node_rank", &question, "0")?;
            if q.answers.node_rank.unwrap_or(0) < nodes {
                break;
            }
            q.say(&format!("  the machines are numbered 0 to {}", nodes - 1))?;
        }
        q.ask(
            "master_addr",
            "Address of machine 0, reachable from every machine?",
            "127.0.0.1",
        )?;
        while q.answers.master_port.map_or(true, |p| p == 0) {
            q.answers.master_port = None;
            q.ask(
                "master_port",
                "Port of the rendezvous store on machine 0 (the same on every machine)?",
                "none",
            )?;
            if q.answers.master_port.map_or(true, |p| p == 0) {
                q.say("  several machines need a fixed port, e.g. 29500")?;
            }
        }
    }
    q.ask(
        "gpus",
        "Which GPUs should the ranks use, by id (e.g. 0,1), or all?",
        "all",
    )?;
    if q.answers.gpu_ids().is_none() {
        q.answers.gpus = None;
    }
    let per_node_default = match q.answers.gpu_ids() {
        Some(ids) => ids.len().to_string(),
        None => "1".to_string(),
    };
    q.ask(
        "nproc_per_node",
        "How many processes (ranks) per machine?",
        &per_node_default,
    )?;
    q.ask(
        "backend",
        "Backend: gloo, nccl, or auto (NCCL on GPUs, else Gloo)?",
        "auto",
    )?;
    q.ask(
        "mixed_precision",
        "Mixed precision: no, bf16, fp16, auto, or program (the program's own choice)?",
        "program",
    )?;
    q.ask(
        "grad_accum",
        "Gradient accumulation: micro-batches per optimizer step, or program?",
        "program",
    )?;
    Ok(q.answers)
}

struct Questions<'a, R, W> {
    input: &'a mut R,
    output: &'a mut W,
    current: &'a Settings,
    answers: Settings,
}

impl<R: BufRead, W: Write> Questions<'_, R, W> {
    fn say(&mut self, line: &str) -> Result<()> {
        writeln!(self.output, "{line}").map_err(io_error)
    }

    /// Asks for the setting `key` until its parser accepts the answer. Enter keeps
    /// the current value (or, without one, leaves it unset, shown as `unset`);
    /// `unset` itself also leaves it unset.
    fn ask(&mut self, key: &str, question: &str, unset: &str) -> Result<()> {
        let row = row(key).expect("a setting of the table");
        let current = row.text(self.current);
        loop {
            let shown = current.clone().unwrap_or_else(|| unset.to_string());
            write!(self.output, "{question} [{shown}]: ").map_err(io_error)?;
            self.output.flush().map_err(io_error)?;
            let mut line = String::new();
            if self.input.read_line(&mut line).map_err(io_error)? == 0 {
                return Err(Error::Config(format!(
                    "no answer to {question:?}: the input ended"
                )));
            }
            let answer = match line.trim() {
                "" => match &current {
                    Some(c) => c.clone(),
                    None => return Ok(()),
                },
                a if a == unset => return Ok(()),
                a => a.to_string(),
            };
            match row.set(&mut self.answers, &answer) {
                Ok(()) => return Ok(()),
                Err(why) => self.say(&format!("  {answer:?}: {why}"))?,
            }
        }
    }
}

fn io_error(source: std::io::Error) -> Error {
    Error::Io {
        context: "asking for the run configuration".into(),
        source,
    }
}
