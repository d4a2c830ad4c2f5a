include!(concat!(env!("OUT_DIR"), "/plain/trainer_methods.rs"));
