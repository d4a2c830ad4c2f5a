include!(concat!(env!("OUT_DIR"), "/plain/resnet.rs"));
