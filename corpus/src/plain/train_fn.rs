include!(concat!(env!("OUT_DIR"), "/plain/train_fn.rs"));
