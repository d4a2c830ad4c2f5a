include!(concat!(env!("OUT_DIR"), "/plain/lazy_optimizer.rs"));
