include!(concat!(env!("OUT_DIR"), "/plain/evaluate.rs"));
