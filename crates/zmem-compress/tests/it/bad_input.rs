//! Bad names, levels and batch sizes give clear errors that list the choices.

use zmem_common::PAGE_SIZE;
use zmem_compress::engines::{Engines, EnginesConfig};
use zmem_compress::{Batch, BatchCompressor, CodecSpec, Error, Sequential};

#[test]
fn unknown_codec_lists_valid_ones() {
    let e = "lz5".parse::<CodecSpec>().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::UnknownCodec { .. }));
    for name in ["lz4", "zstd", "deflate", "lzo", "lzo-rle"] {
        assert!(msg.contains(name), "{msg}");
    }
}

#[test]
fn level_out_of_range_names_the_range() {
    let e = "zstd:99".parse::<CodecSpec>().unwrap_err();
    assert!(matches!(e, Error::LevelOutOfRange { codec: "zstd", level: 99, .. }), "{e}");
    assert!(e.to_string().contains("22"), "{e}");
    let e = "deflate:0".parse::<CodecSpec>().unwrap_err();
    assert!(e.to_string().contains("1..=12"), "{e}");
    assert!(matches!("zstd:fast".parse::<CodecSpec>(), Err(Error::BadLevel { .. })));
    assert!(matches!("lz4:3".parse::<CodecSpec>(), Err(Error::NoLevel { codec: "lz4", .. })));
}

#[test]
fn names_roundtrip_and_levels_default() {
    for s in ["lz4", "zstd:1", "zstd:-7", "deflate:9", "lzo", "lzo-rle"] {
        assert_eq!(s.parse::<CodecSpec>().unwrap().to_string(), s);
    }
    assert_eq!("zstd".parse::<CodecSpec>().unwrap().to_string(), "zstd:1");
    assert_eq!(zmem_compress::codec::parse_list("lz4, zstd:3").unwrap().len(), 2);
}

#[test]
fn batch_larger_than_batch_size_is_refused_untouched() {
    let seq = Sequential::from_spec("lz4".parse().unwrap());
    let eng =
        Engines::new(EnginesConfig { engines: 2, ..Default::default() }, "lz4".parse::<CodecSpec>().unwrap().factory())
            .unwrap();
    for bc in [&seq as &dyn BatchCompressor, &eng] {
        let n = bc.batch_size() + 1;
        let pages = vec![[7u8; PAGE_SIZE]; n];
        let srcs: Vec<&[u8]> = pages.iter().map(|p| &p[..]).collect();
        let mut outs = vec![[0u8; PAGE_SIZE]; n];
        let mut dsts: Vec<&mut [u8]> = outs.iter_mut().map(|p| &mut p[..]).collect();
        let mut res = vec![Ok(0); n];
        let e = bc.compress_batch(&srcs, &mut dsts, &mut res).unwrap_err();
        assert_eq!(e, Error::BatchTooLarge { got: n, max: n - 1 });
        assert!(e.to_string().contains(&format!("1..={}", n - 1)), "{e}");
        assert!(outs.iter().all(|o| o.iter().all(|&b| b == 0)));
        assert!(matches!(bc.submit(Batch::compress(srcs.iter().copied())), Err(Error::BatchTooLarge { .. })));
    }
}

#[test]
fn engine_config_errors_are_clear() {
    let f = "lz4".parse::<CodecSpec>().unwrap().factory();
    let e = Engines::new(EnginesConfig { engines: 0, ..Default::default() }, f.clone()).unwrap_err();
    assert!(e.to_string().contains("engines"), "{e}");
    let e = Engines::new(EnginesConfig { batch_size: 33, ..Default::default() }, f).unwrap_err();
    assert!(e.to_string().contains("1..=32"), "{e}");
    let e = "sideways".parse::<zmem_compress::WqMode>().unwrap_err();
    assert!(e.to_string().contains("per-cpu") && e.to_string().contains("global"), "{e}");
}
