//! What the run asks of its sharded units, read from its settings in one place (FSDP2's
//! `MixedPrecisionPolicy` and `OffloadPolicy`, DeepSpeed ZeRO's bucket sizes).

use tch::Kind;

use crate::settings::Offload;

/// The run's policy for the units of ZeRO stages 2 and 3.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    /// Under mixed precision, the dtype fp32 units are all-gathered and computed in
    /// (bf16 or fp16, FSDP2's `MixedPrecisionPolicy(param_dtype=…)`).
    pub param_dtype: Option<Kind>,
    /// The bucket cap in bytes (`reduce_bucket_mb`, else `bucket_cap_mb`, DDP's 25 MiB
    /// by default): what caps the root's gradient buckets and every all-gather's
    /// buffer (DeepSpeed ZeRO-2's `reduce_bucket_size`).
    pub bucket_bytes: usize,
    /// What lives in host memory (the `offload` setting).
    pub offload: Offload,
}

impl Policy {
    /// The policy of the run whose context is `ctx`.
    pub fn of(ctx: &crate::init::Context) -> Policy {
        let settings = ctx.settings();
        let mib = settings
            .reduce_bucket_mb
            .or(settings.bucket_cap_mb)
            .unwrap_or(crate::ddp::DdpOptions::default().bucket_cap_mb);
        Policy {
            param_dtype: crate::precision::autocast_kind(ctx.mixed_precision()),
            bucket_bytes: (mib * (1 << 20) as f64) as usize,
            offload: settings.offload.unwrap_or_default(),
        }
    }
}
