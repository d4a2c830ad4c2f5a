include!(concat!(env!("OUT_DIR"), "/plain/enumerate_loop.rs"));
