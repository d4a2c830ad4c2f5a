include!(concat!(env!("OUT_DIR"), "/plain/lora.rs"));
