include!(concat!(env!("OUT_DIR"), "/plain/logging_helper.rs"));
