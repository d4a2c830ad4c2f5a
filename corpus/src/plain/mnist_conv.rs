include!(concat!(env!("OUT_DIR"), "/plain/mnist_conv.rs"));
