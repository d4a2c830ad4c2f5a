// `for` over `TextData::iter_shuffle`: one process sees every batch.
use tch::data::TextData;

#[tch_distributed::distributed]
fn train(path: &std::path::Path) -> anyhow::Result<usize> {
    let data = TextData::new(path)?;
    let mut batches = 0;
    for batch in data.iter_shuffle(8, 4) {
        assert_eq!(batch.size(), [4, 8]);
        batches += 1;
    }
    Ok(batches)
}

fn main() -> anyhow::Result<()> {
    let path = std::env::temp_dir().join(format!("ui-text-{}.txt", std::process::id()));
    std::fs::write(&path, "the quick brown fox jumps over the lazy dog. ".repeat(20))?;
    let batches = train(&path)?;
    std::fs::remove_file(&path)?;
    assert!(batches > 0);
    Ok(())
}
