include!(concat!(env!("OUT_DIR"), "/plain/finetune.rs"));
