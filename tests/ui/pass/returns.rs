// Early `return`s, `?`, methods and generic functions keep their meaning.
struct Trainer {
    steps: usize,
}

impl Trainer {
    #[tch_distributed::distributed]
    fn run(&mut self, fail: bool) -> Result<usize, String> {
        if fail {
            return Err("asked to fail".into());
        }
        let n: usize = "3".parse().map_err(|_| "parse".to_string())?;
        self.steps += n;
        Ok(self.steps)
    }
}

#[tch_distributed::distributed]
fn generic<T: Into<i64>>(x: T) -> i64 {
    let closure = |y: i64| -> i64 {
        return y * 2;
    };
    closure(x.into())
}

#[tch_distributed::distributed]
fn nothing() {
    if tch_distributed::current().is_none() {
        return;
    }
}

fn main() {
    let mut t = Trainer { steps: 1 };
    assert_eq!(t.run(false), Ok(4));
    assert_eq!(t.run(true), Err("asked to fail".into()));
    assert_eq!(generic(21i32), 42);
    nothing();
}
