include!(concat!(env!("OUT_DIR"), "/plain/gan.rs"));
