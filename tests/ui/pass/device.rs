// `Device::cuda_if_available()` and `Device::Cuda(i)` become this rank's device.
use tch::Device;

// ANCHOR: train
#[tch_distributed::distributed]
fn train() -> (Device, Device) {
    let a = Device::cuda_if_available();
    let b = tch::Device::Cuda(3);
    (a, b)
}
// ANCHOR_END: train

fn main() {
    let mine = if tch::Cuda::is_available() { Device::Cuda(0) } else { Device::Cpu };
    assert_eq!(train(), (mine, mine));
}
