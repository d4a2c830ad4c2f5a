//! TensorBoard event files: the `tfevents` format that `tensorboard --logdir` reads,
//! as PyTorch's `torch.utils.tensorboard.SummaryWriter` writes it.
//!
//! A file is a sequence of TFRecords, each `length (u64, little-endian)`,
//! `masked CRC32C of the length (u32)`, `data`, `masked CRC32C of the data (u32)`,
//! whose data is one `Event` protocol buffer (`tensorflow/core/util/event.proto`):
//! first `file_version: "brain.Event:2"`, then one event per logged step holding a
//! `Summary` of scalar values. The messages are declared here with `prost`'s derive,
//! with only the fields written.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, Message)]
struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `tensorflow.Summary.Value` with its `simple_value` (a scalar).
#[derive(Clone, PartialEq, Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, tag = "2")]
    simple_value: f32,
}

/// TFRecord's masked CRC32C (Castagnoli), which keeps a CRC of data that holds CRCs
/// from being trivially zero.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Seconds since the Unix epoch.
pub(crate) fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// One event file, written record by record and flushed after each, so that a
/// TensorBoard watching the directory shows a run while it trains.
pub(crate) struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.{seconds}.{host}.{pid}.0` (the name TensorBoard
    /// looks for) and writes its file-version record.
    pub(crate) fn create(dir: &Path) -> std::io::Result<EventWriter> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.0",
            now() as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let mut writer = EventWriter {
            file: BufWriter::new(File::create(&path)?),
            path,
        };
        writer.write(&Event {
            wall_time: now(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(writer)
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event holding `values` as scalars at `step`.
    pub(crate) fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> std::io::Result<()> {
        let value = values
            .iter()
            .map(|(tag, v)| Value {
                tag: tag.to_string(),
                simple_value: *v as f32,
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }

    fn write(&mut self, event: &Event) -> std::io::Result<()> {
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        self.file.write_all(&length)?;
        self.file.write_all(&masked_crc(&length).to_le_bytes())?;
        self.file.write_all(&data)?;
        self.file.write_all(&masked_crc(&data).to_le_bytes())?;
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC32C's check value (RFC 3720, B.4: 32 bytes of zeros), and the mask.
    #[test]
    fn the_checksum_is_crc32c_masked_as_tfrecord_does() {
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(
            masked_crc(&[]),
            0u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    /// Each record is framed as length, its CRC, the data, its CRC; the data decodes
    /// back to the event written.
    #[test]
    fn records_frame_the_events_and_decode_back() {
        let dir = std::env::temp_dir().join(format!("tchd-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalars(7, &[("loss", 1.5), ("lr", 0.25)]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut events = Vec::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            assert_eq!(rest[8..12], masked_crc(&rest[..8]).to_le_bytes());
            let data = &rest[12..12 + len];
            assert_eq!(rest[12 + len..16 + len], masked_crc(data).to_le_bytes());
            events.push(Event::decode(data).unwrap());
            rest = &rest[16 + len..];
        }
        assert_eq!(events.len(), 2);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        assert_eq!(events[1].step, 7);
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("{:?}", events[1])
        };
        let got: Vec<_> = s
            .value
            .iter()
            .map(|v| (v.tag.as_str(), v.simple_value))
            .collect();
        assert_eq!(got, [("loss", 1.5), ("lr", 0.25)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
