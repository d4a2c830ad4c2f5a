include!(concat!(env!("OUT_DIR"), "/plain/trainer.rs"));
