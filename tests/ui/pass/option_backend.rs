// `backend = "gloo"` chooses the process group's backend.
#[tch_distributed::distributed(backend = "gloo")]
fn train() -> tch_distributed::Backend {
    tch_distributed::current().unwrap().backend()
}

fn main() {
    assert_eq!(train(), tch_distributed::Backend::Gloo);
}
