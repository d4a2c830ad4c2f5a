include!(concat!(env!("OUT_DIR"), "/plain/char_rnn.rs"));
