include!(concat!(env!("OUT_DIR"), "/plain/min_gpt.rs"));
