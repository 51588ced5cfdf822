//! GPU tests (run on the GPU machine through scripts/gpu-run.sh): the Hopper forward and backward
//! kernels against the f64 reference of tests/reference.rs, with fresh random inputs for every
//! check. The backward tests are at the end of the file.
//!
//! Covered: bf16 and f16; head dims 64/96/128/192/256 and the padded ones (8, 32, 72, 80, 136,
//! 160, d != d_v);
//! causal, sliding windows, softcap, negative/zero scale; odd seqlens (not multiples of the
//! tiles, sq < sk and sq > sk); GQA ratios 1/2/4/8; batch > 1; varlen with an empty sequence;
//! non-contiguous inputs (transposed / narrowed views, read through TMA strides without copies);
//! NaN-poisoned output memory; the persistent grid with many tiles per CTA; the LSE; and the
//! errors (f32, bad head dims, mixed devices).
//!
//! Tolerances (relative to the largest reference value, `assert_close`): outputs 1e-2 (P is
//! rounded to 16 bits before P·V, as in FA3), LSE 1e-3.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::{FlashAttn, Tuning};
use flash_attn3_tests::{
    assert_close, assert_identical, attention_grads_ref, attention_grads_ref_varlen, attention_ref,
    attention_ref_varlen, cumulative, max_len, seqlens_tensor, AttnShape, Grads, Opts, TestRng,
};

const OUT_TOL: f64 = 1e-2;
const LSE_TOL: f64 = 1e-3;

fn gpu() -> Result<Device> {
    Device::new_cuda(0)
}

/// Every mask/softcap variant, scaled for a head dim.
fn variants(d: usize, rng: &mut TestRng) -> Vec<(&'static str, Opts)> {
    let base = Opts::new(1.0 / (d as f64).sqrt());
    vec![
        ("full", base),
        ("causal", Opts { right: Some(0), ..base }),
        (
            "window",
            Opts {
                left: Some(rng.range(0, 40)),
                right: Some(rng.range(0, 40)),
                ..base
            },
        ),
        (
            "window-left",
            Opts {
                left: Some(rng.range(1, 100)),
                right: Some(0),
                ..base
            },
        ),
        (
            "window-right",
            Opts {
                left: None,
                right: Some(rng.range(0, 30)),
                ..base
            },
        ),
        (
            "softcap",
            Opts {
                softcap: Some(rng.pick(&[5.0, 30.0])),
                ..base
            },
        ),
        (
            "causal-softcap",
            Opts {
                right: Some(0),
                softcap: Some(10.0),
                ..base
            },
        ),
    ]
}

/// Fills the allocator's free memory with NaN so that an output element the kernel forgets to
/// write shows up as NaN (which `assert_close` never accepts).
fn poison(dev: &Device, elems: usize) -> Result<()> {
    let t = Tensor::full(f32::NAN, elems.max(1), dev)?;
    drop(t);
    Ok(())
}

/// Checks one fixed-length call (q, k, v given, possibly non-contiguous) against the reference,
/// twice: with the split count chosen per call (small test shapes leave most SMs idle, so keys
/// of more than 8 blocks are split) and with `num_splits(1)` (one CTA walks all keys of a tile).
fn check(q: &Tensor, k: &Tensor, v: &Tensor, o: Opts, what: &str) -> Result<()> {
    check_splits(q, k, v, o, &[0, 1], what)
}

/// `check` with the given split counts (`num_splits`), each against the same reference.
fn check_splits(q: &Tensor, k: &Tensor, v: &Tensor, o: Opts, splits_list: &[usize], what: &str) -> Result<()> {
    let (b, sq, h, _) = q.dims4()?;
    let (want, want_lse) = attention_ref(q, k, v, &o.reference())?;
    for &splits in splits_list {
        poison(q.device(), 2 * b * sq * h * v.dim(3)?)?;
        let (out, lse) = o.builder().num_splits(splits).forward_with_lse(q, k, v)?;
        assert_eq!(out.dtype(), q.dtype(), "{what}: out dtype");
        assert_eq!(lse.dtype(), DType::F32, "{what}: lse dtype");
        let what = format!("{what} num_splits({splits})");
        assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
        assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
    }
    Ok(())
}

fn check_shape(shape: AttnShape, dtype: DType, o: Opts, rng: &mut TestRng, what: &str) -> Result<()> {
    let dev = gpu()?;
    let (q, k, v) = shape.random_qkv(rng, dtype, &dev)?;
    check(&q, &k, &v, o, &format!("{what} {shape:?} {o:?} seed {}", rng.seed()))
}

#[test]
fn every_option_head_dims_64_96_128_192_256() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-options");
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 96, 128, 192, 256] {
            for (name, o) in variants(d, &mut rng) {
                let ratio = rng.pick(&[1, 2, 4, 8]);
                let kv_heads = rng.range(1, 2);
                // Odd lengths around the tile sizes, sq < sk and sq > sk.
                let (sq, sk) = if rng.coin() {
                    (rng.odd_len(1, 200), rng.odd_len(130, 330))
                } else {
                    (rng.odd_len(130, 330), rng.odd_len(1, 200))
                };
                let shape = AttnShape::new((rng.range(1, 2), sq, sk, kv_heads * ratio, kv_heads, d, d));
                check_shape(shape, dtype, o, &mut rng, &format!("{dtype:?} d{d} {name}"))?;
                n += 1;
            }
        }
    }
    println!("{n} checks passed");
    Ok(())
}

#[test]
fn equal_lengths_and_tile_multiples() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-tiles");
    for (sq, sk) in [
        (128, 128),
        (256, 256),
        (1, 1),
        (64, 64),
        (127, 129),
        (384, 64),
        (1, 513),
    ] {
        for causal in [false, true] {
            let d = rng.pick(&[64, 128, 256]);
            let mut o = Opts::new(1.0 / (d as f64).sqrt());
            if causal {
                o.right = Some(0);
            }
            let shape = AttnShape::new((2, sq, sk, 4, 2, d, d));
            check_shape(shape, DType::BF16, o, &mut rng, "tiles")?;
        }
    }
    Ok(())
}

#[test]
fn long_sequences_many_pipeline_rounds() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-long");
    for (d, causal) in [(128, true), (64, false), (256, true)] {
        let mut o = Opts::new(1.0 / (d as f64).sqrt());
        if causal {
            o.right = Some(0);
        }
        let shape = AttnShape::new((1, 1031, 1100, 2, 1, d, d));
        check_shape(shape, DType::BF16, o, &mut rng, "long")?;
    }
    Ok(())
}

#[test]
fn padded_and_mixed_head_dims() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-head-dims");
    for (d, dv) in [
        (32, 32),
        (72, 72),
        (96, 96),
        (80, 80),
        (96, 64),
        (192, 192),
        (192, 128),
        (136, 136),
        (128, 64),
        (64, 128),
        (8, 8),
        (160, 256),
    ] {
        for causal in [false, true] {
            let mut o = Opts::new(1.0 / (d as f64).sqrt());
            if causal {
                o.right = Some(0);
            }
            let dtype = rng.pick(&[DType::BF16, DType::F16]);
            let shape = AttnShape::new((2, rng.odd_len(1, 300), rng.odd_len(1, 300), 4, 2, d, dv));
            check_shape(shape, dtype, o, &mut rng, &format!("d{d}/dv{dv}"))?;
        }
    }
    Ok(())
}

#[test]
fn scales_negative_zero_large() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-scales");
    for scale in [-0.125, 0.0, 1.0] {
        for softcap in [None, Some(20.0)] {
            let o = Opts {
                softcap,
                ..Opts::new(scale)
            };
            let shape = AttnShape::new((1, 77, 150, 2, 1, 64, 64));
            check_shape(shape, DType::BF16, o, &mut rng, "scale")?;
        }
    }
    Ok(())
}

#[test]
fn non_contiguous_inputs() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-strides");
    let dev = gpu()?;
    for d in [64, 128] {
        let (b, sq, sk, h, hk) = (2, 97, 150, 4, 2);
        // q from a (b, h, sq, d) tensor: its (b, sq, h, d) view has head stride sq·d.
        let q = rng.randn((b, h, sq, d), DType::BF16, &dev)?.transpose(1, 2)?;
        // k: the second half of the head dim of a wider tensor (token stride 2·hk·d, offset d).
        let k = rng.randn((b, sk, hk, 2 * d), DType::BF16, &dev)?.narrow(3, d, d)?;
        // v: a window of tokens of a longer tensor (offset 3 tokens).
        let v = rng.randn((b, sk + 5, hk, d), DType::BF16, &dev)?.narrow(1, 3, sk)?;
        assert!(!q.is_contiguous() && !k.is_contiguous());
        for causal in [false, true] {
            let mut o = Opts::new(1.0 / (d as f64).sqrt());
            if causal {
                o.right = Some(0);
            }
            check(&q, &k, &v, o, &format!("strided d{d} causal {causal}"))?;
        }
    }
    Ok(())
}

/// Checks one varlen call with sequence lengths `lq` / `lk` (cumulative offsets built here) and
/// `h` / `hk` heads against the reference; `fa` is the builder (options of `o`, plus any split).
#[allow(clippy::too_many_arguments)]
fn check_varlen(
    rng: &mut TestRng,
    lq: &[usize],
    lk: &[usize],
    (h, hk): (usize, usize),
    (d, dv): (usize, usize),
    dtype: DType,
    fa: flash_attn3::FlashAttn,
    o: Opts,
    what: &str,
) -> Result<()> {
    let dev = gpu()?;
    let (cu_q, cu_k) = (cumulative(lq), cumulative(lk));
    let batch = lq.len();
    let q = rng.randn((cu_q[batch], h, d), dtype, &dev)?;
    let k = rng.randn((cu_k[batch], hk, d), dtype, &dev)?;
    let v = rng.randn((cu_k[batch], hk, dv), dtype, &dev)?;
    poison(&dev, 2 * cu_q[batch] * h * dv)?;
    let (sq_t, sk_t) = (seqlens_tensor(&cu_q, &dev)?, seqlens_tensor(&cu_k, &dev)?);
    let (out, lse) = fa.forward_varlen_with_lse(&q, &k, &v, &sq_t, &sk_t, max_len(&cu_q), max_len(&cu_k))?;
    let (want, want_lse) = attention_ref_varlen(&q, &k, &v, &cu_q, &cu_k, &o.reference())?;
    let what = format!(
        "{what} {dtype:?} d{d} lq {lq:?} lk {lk:?} h {h}/{hk} seed {}",
        rng.seed()
    );
    assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
    Ok(())
}

#[test]
fn varlen_with_empty_sequences() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-varlen");
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 96, 128, 192, 256] {
            for (name, o) in variants(d, &mut rng) {
                let batch = rng.range(2, 5);
                let mut lq: Vec<usize> = (0..batch).map(|_| rng.odd_len(1, 300)).collect();
                let lk: Vec<usize> = (0..batch).map(|_| rng.odd_len(1, 300)).collect();
                lq[rng.range(0, batch - 1)] = 0; // an empty query sequence
                if lq.iter().sum::<usize>() == 0 {
                    continue;
                }
                let ratio = rng.pick(&[1, 2, 4, 8]);
                let hk = rng.range(1, 2);
                check_varlen(
                    &mut rng,
                    &lq,
                    &lk,
                    (hk * ratio, hk),
                    (d, d),
                    dtype,
                    o.builder(),
                    o,
                    &format!("varlen {name}"),
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn decode_shapes() -> Result<()> {
    // seqlen_q 1..16 against a long cache, GQA 8 (the decode-like benchmark shape, smaller).
    let mut rng = TestRng::fresh("gpu-decode");
    for sq in [1, 3, 16] {
        for causal in [false, true] {
            let mut o = Opts::new(1.0 / (128f64).sqrt());
            if causal {
                o.right = Some(0);
            }
            let shape = AttnShape::new((2, sq, 1500, 16, 2, 128, 128));
            check_shape(shape, DType::BF16, o, &mut rng, "decode")?;
        }
    }
    Ok(())
}

/// Every `Tuning` choice gives the reference's result: the scheduling paths that the per-call
/// defaults do not take for these shapes (pack-GQA forced on and off, d64 on 128- and 192-row
/// tiles, O stored from registers, one CTA per tile, L2 sections of 1 and 3 pairs); invalid
/// values are errors.
#[test]
fn tuning_choices_agree_with_the_reference() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-tuning");
    let default = Tuning::default();
    let tunings = [
        Tuning {
            pack_gqa: Some(true),
            ..default
        },
        Tuning {
            pack_gqa: Some(false),
            ..default
        },
        Tuning {
            d64_tile_rows: Some(128),
            ..default
        },
        Tuning {
            d64_tile_rows: Some(192),
            ..default
        },
        Tuning {
            direct_store: true,
            ..default
        },
        Tuning {
            per_tile: true,
            ..default
        },
        Tuning {
            l2_section: Some(1),
            ..default
        },
        Tuning {
            l2_section: Some(3),
            ..default
        },
    ];
    for tuning in tunings {
        for (d, causal, sq) in [
            (64, true, rng.odd_len(100, 400)),
            (64, false, rng.odd_len(1, 60)),
            (128, true, rng.odd_len(100, 400)),
        ] {
            let shape = AttnShape::new((2, sq, rng.odd_len(100, 600), 8, 2, d, d));
            let (q, k, v) = shape.random_qkv(&mut rng, DType::BF16, &dev)?;
            let o = Opts::new(shape.scale()).causal_if(causal);
            let what = format!("{tuning:?} {shape:?} causal {causal} seed {}", rng.seed());
            check_splits(&q, &k, &v, o.tuned(tuning), &[0], &what)?;
        }
    }
    // Static and atomic tile claims over more tiles than the GPU has SMs (the counter is used only
    // then): unmasked d64 whose last 192-row tile leaves warpgroups idle (the default's counter)
    // and d128 whose tiles are even (the default's strides), both ways, against the reference.
    for dynamic in [Some(true), Some(false)] {
        let tuning = Tuning {
            dynamic_tiles: dynamic,
            ..default
        };
        for (d, sq) in [(64, 192 * 3 + rng.odd_len(1, 60)), (128, 128 * 3)] {
            let shape = AttnShape::new((4, sq, rng.odd_len(100, 300), 48, 48, d, d));
            let (q, k, v) = shape.random_qkv(&mut rng, DType::BF16, &dev)?;
            let what = format!("{tuning:?} {shape:?} seed {}", rng.seed());
            check_splits(&q, &k, &v, Opts::new(shape.scale()).tuned(tuning), &[0], &what)?;
        }
    }
    let q = rng.randn((1, 8, 2, 64), DType::BF16, &dev)?;
    for (bad, needle) in [
        (
            Tuning {
                d64_tile_rows: Some(64),
                ..default
            },
            "d64_tile_rows",
        ),
        (
            Tuning {
                l2_section: Some(0),
                ..default
            },
            "l2_section",
        ),
    ] {
        let e = FlashAttn::new(0.1)
            .tuning(bad)
            .forward(&q, &q, &q)
            .expect_err("must fail")
            .to_string();
        assert!(e.contains(needle), "{e}");
    }
    Ok(())
}

#[test]
fn pack_gqa_decode_like() -> Result<()> {
    // At most 64 queries with GQA: the q heads of a kv head share one tile (pack-GQA, rows
    // token-major), with every option, groups that do and do not divide the 128-row tile, both
    // dtypes, fixed-length and varlen (with an empty query sequence).
    let mut rng = TestRng::fresh("gpu-pack-gqa");
    for d in [64, 96, 128] {
        for (name, o) in variants(d, &mut rng) {
            let group = rng.pick(&[2, 3, 5, 8, 16]);
            let sq = rng.pick(&[1, 2, 7, 33, 64]);
            let sk = rng.odd_len(1, 700);
            let dtype = rng.pick(&[DType::BF16, DType::F16]);
            let shape = AttnShape::new((rng.range(1, 3), sq, sk, 2 * group, 2, d, d));
            check_shape(shape, dtype, o, &mut rng, &format!("pack-gqa {name} group {group}"))?;

            let batch = rng.range(2, 4);
            let mut lq: Vec<usize> = (0..batch).map(|_| rng.range(1, 64)).collect();
            let lk: Vec<usize> = (0..batch).map(|_| rng.odd_len(1, 500)).collect();
            lq[0] = 0;
            let what = format!("pack-gqa varlen {name} group {group}");
            check_varlen(&mut rng, &lq, &lk, (2 * group, 2), (d, d), dtype, o.builder(), o, &what)?;
        }
    }
    Ok(())
}

#[test]
fn split_kv_every_option() -> Result<()> {
    // Split-KV: the key blocks of each tile cut into shares on separate CTAs, merged by the
    // combine kernel. Forced split counts (2, 3, 7 and 128, capped at the key blocks) and the
    // automatic choice on shapes with few tiles and long keys (batch 1-2, few heads), with every
    // option, pack-GQA and plain tiles, padded head dims, fixed-length and varlen with an empty
    // query sequence and sequences shorter than one share.
    let mut rng = TestRng::fresh("gpu-split-kv");
    let mut n = 0;
    for d in [64, 128, 192, 256, 40, 96] {
        for (name, o) in variants(d, &mut rng) {
            let splits = rng.pick(&[0, 2, 3, 7, 128]);
            let dtype = rng.pick(&[DType::BF16, DType::F16]);
            let group = rng.pick(&[1, 4, 8]);
            let sq = rng.pick(&[1, 5, 16, 77, 200]);
            let sk = rng.odd_len(700, 5000);
            let shape = AttnShape::new((rng.range(1, 2), sq, sk, 2 * group, 2, d, d));
            let (q, k, v) = shape.random_qkv(&mut rng, dtype, &gpu()?)?;
            let what = format!("split-kv {name} {shape:?} {dtype:?} seed {}", rng.seed());
            check_splits(&q, &k, &v, o, &[splits], &what)?;

            let batch = rng.range(2, 4);
            let mut lq: Vec<usize> = (0..batch).map(|_| rng.range(1, 40)).collect();
            let mut lk: Vec<usize> = (0..batch).map(|_| rng.odd_len(1, 3000)).collect();
            lq[0] = 0;
            lk[batch - 1] = rng.range(1, 100); // shorter than a share: most shares see no key
            let fa = o.builder().num_splits(splits);
            let what = format!("split-kv varlen {splits} {name} group {group}");
            check_varlen(&mut rng, &lq, &lk, (2 * group, 2), (d, d), dtype, fa, o, &what)?;
            n += 2;
        }
    }
    println!("split_kv_every_option: {n} checks passed");
    Ok(())
}

#[test]
fn split_kv_merged_in_a_cluster() -> Result<()> {
    // Decode-shaped split calls (every tile's rows in the first consumer warpgroup, at most 8
    // shares, head dims up to 128, CTAs for at most half the SMs: these shapes' 4-32) merge their
    // shares inside the forward launch, each tile's
    // shares one thread-block cluster (kernels/flash_fwd/cluster_combine.cuh); the same calls with
    // `Tuning::global_combine` take the combine kernel, and 9 shares always do. Both against the
    // reference: every share count from 2 to 9, every option, pack-GQA and plain tiles, padded
    // head dims, and shares without keys (5 key blocks in 4 shares: the last one sees none).
    let mut rng = TestRng::fresh("gpu-split-kv-cluster");
    let dev = gpu()?;
    let global = Tuning {
        global_combine: true,
        ..Tuning::default()
    };
    let mut n = 0;
    for splits in [2, 3, 4, 5, 6, 7, 8, 9, 4] {
        let d = rng.pick(&[64, 128, 96, 40]);
        let options = variants(d, &mut rng);
        let (name, o) = rng.pick(&options);
        let dtype = rng.pick(&[DType::BF16, DType::F16]);
        let group = rng.pick(&[1, 4, 8]);
        let sq = if group == 8 {
            rng.pick(&[1, 2])
        } else {
            rng.pick(&[1, 3])
        };
        // 9 to 16 key blocks, or (the last case) 5 blocks in 4 shares.
        let sk = if n == 16 {
            rng.range(513, 640)
        } else {
            rng.odd_len(1100, 2040)
        };
        let shape = AttnShape::new((rng.range(1, 3), sq, sk, 2 * group, 2, d, d));
        let (q, k, v) = shape.random_qkv(&mut rng, dtype, &dev)?;
        let (want, want_lse) = attention_ref(&q, &k, &v, &o.reference())?;
        for tuning in [Tuning::default(), global] {
            poison(&dev, 2 * want.elem_count())?;
            let (out, lse) = o
                .builder()
                .tuning(tuning)
                .num_splits(splits)
                .forward_with_lse(&q, &k, &v)?;
            let what = format!(
                "split-kv {splits} shares, {name} {shape:?} {dtype:?} global_combine {} seed {}",
                tuning.global_combine,
                rng.seed()
            );
            assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
            assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
            n += 1;
        }
    }
    println!("split_kv_merged_in_a_cluster: {n} checks passed");
    Ok(())
}

#[test]
fn split_kv_small_for_sanitizer() -> Result<()> {
    // One small split-KV call of each kind (fixed-length with pack-GQA, whose 3 shares merge in
    // a thread-block cluster; varlen, through the combine kernel), for compute-sanitizer memcheck
    // and racecheck.
    let mut rng = TestRng::fresh("gpu-split-kv-small");
    let o = Opts {
        right: Some(0),
        ..Opts::new(0.125)
    };
    let (q, k, v) = AttnShape::new((1, 3, 700, 8, 2, 64, 64)).random_qkv(&mut rng, DType::BF16, &gpu()?)?;
    check_splits(&q, &k, &v, o, &[3], "split-kv small")?;
    check_varlen(
        &mut rng,
        &[0, 2, 1],
        &[300, 500, 40],
        (4, 4),
        (128, 128),
        DType::F16,
        o.builder().num_splits(4),
        o,
        "split-kv small varlen",
    )
}

#[test]
fn errors_not_fallbacks() -> Result<()> {
    let dev = gpu()?;
    let err = |r: Result<Tensor>| r.expect_err("expected an error").to_string();
    // f32 on the GPU.
    let q = Tensor::zeros((1, 8, 2, 64), DType::F32, &dev)?;
    let e = err(flash_attn3::flash_attn(&q, &q, &q, 0.125, false));
    assert!(e.contains("bf16") && e.contains("f16"), "{e}");
    // A head dim that is not a multiple of 8.
    let q = Tensor::zeros((1, 8, 2, 36), DType::BF16, &dev)?;
    let e = err(flash_attn3::flash_attn(&q, &q, &q, 0.125, false));
    assert!(e.contains("multiples of 8"), "{e}");
    // A token stride that TMA cannot express (not a multiple of 16 bytes): 3 heads x 8 = 24
    // elements per token is fine, so narrow the head dim of a 76-wide tensor (152-byte rows).
    let big = Tensor::zeros((1, 8, 1, 76), DType::BF16, &dev)?;
    let q = big.narrow(3, 0, 64)?;
    let e = err(flash_attn3::flash_attn(&q, &q, &q, 0.125, false));
    assert!(e.contains("16 bytes") || e.contains("contiguous"), "{e}");
    // Mixed devices.
    let qc = Tensor::zeros((1, 8, 2, 64), DType::BF16, &Device::Cpu)?;
    let kg = Tensor::zeros((1, 8, 2, 64), DType::BF16, &dev)?;
    let e = err(flash_attn3::flash_attn(&qc, &kg, &kg, 0.125, false));
    assert!(e.contains("device"), "{e}");
    Ok(())
}

#[test]
fn persistent_grid_many_tiles_per_cta() -> Result<()> {
    // Unmasked fixed-length calls run on a persistent grid (one CTA per SM); with hundreds of
    // query tiles every CTA processes several, reloading Q and continuing its K/V ring.
    let mut rng = TestRng::fresh("gpu-persistent");
    for (d, dtype) in [(128, DType::BF16), (64, DType::F16), (256, DType::BF16)] {
        let shape = AttnShape::new((3, 700, rng.odd_len(100, 300), 16, 4, d, d));
        let o = Opts::new(1.0 / (d as f64).sqrt());
        check_shape(shape, dtype, o, &mut rng, "persistent")?;
        let o = Opts {
            softcap: Some(15.0),
            ..o
        };
        check_shape(shape, dtype, o, &mut rng, "persistent softcap")?;
    }
    Ok(())
}

#[test]
fn persistent_small_for_racecheck() -> Result<()> {
    // Just over one tile per SM (140 heads x 1 query tile): the first CTAs take a second tile.
    // Small enough for compute-sanitizer racecheck.
    let mut rng = TestRng::fresh("gpu-persistent-small");
    let shape = AttnShape::new((1, 100, 70, 140, 35, 64, 64));
    check_shape(shape, DType::BF16, Opts::new(0.125), &mut rng, "persistent small")
}

#[test]
fn dynamic_scheduler_causal_window_varlen() -> Result<()> {
    // Masked and varlen calls run on a persistent grid whose CTAs claim tiles through an atomic
    // counter: hundreds of uneven tiles (and, varlen, tiles past a sequence's end) per launch.
    let mut rng = TestRng::fresh("gpu-dynamic");
    let dev = gpu()?;
    for (d, dtype) in [(128, DType::BF16), (64, DType::F16), (256, DType::BF16)] {
        let shape = AttnShape::new((3, 700, rng.odd_len(600, 800), 16, 4, d, d));
        let o = Opts::new(1.0 / (d as f64).sqrt());
        check_shape(shape, dtype, Opts { right: Some(0), ..o }, &mut rng, "dynamic causal")?;
        let o = Opts {
            left: Some(rng.range(1, 300)),
            right: Some(rng.range(0, 40)),
            ..o
        };
        check_shape(shape, dtype, o, &mut rng, "dynamic window")?;

        // Varlen, causal: 6 sequences of very different lengths, 32 heads.
        let batch = 6;
        let lq: Vec<usize> = (0..batch).map(|_| rng.odd_len(1, 700)).collect();
        let lk: Vec<usize> = lq.iter().map(|&l| l + rng.range(0, 50)).collect();
        let (cu_q, cu_k) = (cumulative(&lq), cumulative(&lk));
        let (h, hk) = (32, 8);
        let q = rng.randn((cu_q[batch], h, d), dtype, &dev)?;
        let k = rng.randn((cu_k[batch], hk, d), dtype, &dev)?;
        let v = rng.randn((cu_k[batch], hk, d), dtype, &dev)?;
        poison(&dev, 2 * cu_q[batch] * h * d)?;
        let o = Opts {
            right: Some(0),
            ..Opts::new(1.0 / (d as f64).sqrt())
        };
        let (sq_t, sk_t) = (seqlens_tensor(&cu_q, &dev)?, seqlens_tensor(&cu_k, &dev)?);
        let (out, lse) =
            o.builder()
                .forward_varlen_with_lse(&q, &k, &v, &sq_t, &sk_t, max_len(&cu_q), max_len(&cu_k))?;
        let (want, want_lse) = attention_ref_varlen(&q, &k, &v, &cu_q, &cu_k, &o.reference())?;
        let what = format!("dynamic varlen {dtype:?} d{d} lq {lq:?} lk {lk:?} seed {}", rng.seed());
        assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
        assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
    }
    Ok(())
}

#[test]
fn threads_on_one_device_get_the_results_of_one_thread() -> Result<()> {
    // candle queues each thread's work on a stream of that thread's own, so causal calls from
    // several threads on one device run at the same time; each claims tiles from its own
    // scheduler counter (a shared one skipped and repeated tiles). 4 threads × 6 calls of 3 ×
    // 16 heads × 8 query tiles (more tiles than SMs: the counter is used), each output equal bit
    // for bit to the one thread's result of the same inputs (a tile's sums run in one order
    // whichever CTA claims it).
    let mut rng = TestRng::fresh("gpu-threads");
    let dev = gpu()?;
    let d = 128;
    let attn = FlashAttn::new(1.0 / (d as f32).sqrt()).causal(true);
    let mut inputs = Vec::new();
    for _ in 0..4 {
        let sk = rng.odd_len(900, 1000);
        let q = rng.randn((3, sk, 16, d), DType::BF16, &dev)?;
        let k = rng.randn((3, sk, 4, d), DType::BF16, &dev)?;
        let v = rng.randn((3, sk, 4, d), DType::BF16, &dev)?;
        let want = attn.forward(&q, &k, &v)?;
        inputs.push((q, k, v, want));
    }
    // The inputs and the expected outputs, queued by this thread, are done before others read them.
    dev.synchronize()?;
    let attn = &attn;
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = inputs
            .iter()
            .enumerate()
            .map(|(t, (q, k, v, want))| {
                s.spawn(move || -> Result<()> {
                    for call in 0..6 {
                        let out = attn.forward(q, k, v)?;
                        assert_identical(&out, want, &format!("thread {t}, call {call}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.into_iter().collect()
}

#[test]
fn l2_sections_with_a_shorter_last_section() -> Result<()> {
    // Causal tiles are ordered longest first inside sections of (batch, head) pairs sized to L2
    // (scheduler.cuh): long key sequences make the sections small, here 8 pairs of d256 (3 MB of
    // K/V per head at 1.5k keys) and 24 of d128 with GQA (8 kv heads, 3 q heads each), each call
    // ending on a shorter section (22 and 36 pairs).
    let mut rng = TestRng::fresh("gpu-l2-sections");
    let cases = [
        ((2, 300, rng.odd_len(1400, 1600), 11, 11, 256, 256), DType::BF16),
        ((3, 260, rng.odd_len(2000, 2100), 12, 4, 128, 128), DType::F16),
    ];
    for (dims, dtype) in cases {
        let d = dims.5;
        let o = Opts {
            right: Some(0),
            ..Opts::new(1.0 / (d as f64).sqrt())
        };
        check_shape(AttnShape::new(dims), dtype, o, &mut rng, "l2 sections causal")?;
    }
    Ok(())
}

#[test]
fn dynamic_small_causal_for_sanitizer() -> Result<()> {
    // 140 heads x 2 query tiles, causal: more tiles than SMs, claimed through the atomic counter.
    // Small enough for compute-sanitizer.
    let mut rng = TestRng::fresh("gpu-dynamic-small");
    let shape = AttnShape::new((1, 200, 200, 140, 35, 64, 64));
    let o = Opts {
        right: Some(0),
        ..Opts::new(0.125)
    };
    check_shape(shape, DType::BF16, o, &mut rng, "dynamic small causal")
}

// ---------------------------------------------------------------------------------------------
// Backward (kernels/flash_bwd/): gradients through candle's autograd (`loss.backward()` of
// `sum(out ∘ w)`, so dL/dout = w) against the f64 analytic gradients of the reference.
// Each gradient's error is relative to its own largest value, floored at the largest of the three
// (dq is legitimately ~0 when every query sees one key), as in tests/cpu_backward.rs.
// ---------------------------------------------------------------------------------------------

const GRAD_TOL: f64 = 2e-2;

/// dq, dk, dv of `sum(f(q, k, v) ∘ w)` through candle's autograd, with the allocator's free
/// memory poisoned with NaN between the forward and the backward.
fn autograd(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    w: &Tensor,
) -> Result<Grads> {
    let elems = q.elem_count() + k.elem_count() + v.elem_count();
    flash_attn3_tests::autograd(f, (q, k, v), w, || poison(q.device(), 4 * elems))
}

/// The shared gradient check at the GPU tolerance; returns the largest error (for the log).
fn check_grads(got: &Grads, want: &Grads, what: &str) -> Result<f64> {
    flash_attn3_tests::check_grads(got, want, GRAD_TOL, what)
}

fn check_backward(shape: AttnShape, dtype: DType, o: Opts, rng: &mut TestRng, what: &str) -> Result<f64> {
    let dev = gpu()?;
    let (q, k, v) = shape.random_qkv(rng, dtype, &dev)?;
    let w = rng.randn(shape.out_shape(), dtype, &dev)?;
    let got = autograd(|q, k, v| o.builder().forward(q, k, v), &q, &k, &v, &w)?;
    assert_eq!(got.0.dtype(), dtype, "{what}: dq dtype");
    let want = attention_grads_ref(&q, &k, &v, &w, &o.reference())?;
    check_grads(&got, &want, &format!("{what} {shape:?} {o:?} seed {}", rng.seed()))
}

#[test]
fn backward_every_option_head_dims() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-bwd-options");
    let (mut n, mut worst) = (0, 0f64);
    for dtype in [DType::BF16, DType::F16] {
        // 64, 128 and 256 are instantiated; 40, 72, 96, 160 and 192 run padded; (64, 128) and
        // (192, 128) have d != d_v.
        for (d, dv) in [
            (64, 64),
            (128, 128),
            (256, 256),
            (40, 40),
            (72, 72),
            (96, 96),
            (160, 160),
            (192, 192),
            (64, 128),
            (192, 128),
        ] {
            for (name, o) in variants(d, &mut rng) {
                let ratio = rng.pick(&[1, 2, 4, 8]);
                let kv_heads = rng.range(1, 2);
                // Odd lengths around the tiles (64/128 queries, 64/128 keys), sq < sk and sq > sk.
                let (sq, sk) = if rng.coin() {
                    (rng.odd_len(1, 200), rng.odd_len(130, 330))
                } else {
                    (rng.odd_len(130, 330), rng.odd_len(1, 200))
                };
                let shape = AttnShape::new((rng.range(1, 2), sq, sk, kv_heads * ratio, kv_heads, d, dv));
                let e = check_backward(shape, dtype, o, &mut rng, &format!("bwd {dtype:?} d{d}/{dv} {name}"))?;
                worst = worst.max(e);
                n += 1;
            }
        }
    }
    println!("backward_every_option_head_dims: {n} cases, max relative error {worst:.3e}");
    Ok(())
}

#[test]
fn backward_gqa_ratios_long_sequences() -> Result<()> {
    // Many query blocks per key block (the Q/dO ring wraps many times) and every GQA ratio: a CTA
    // sums dK/dV over the whole group of q heads.
    let mut rng = TestRng::fresh("gpu-bwd-gqa");
    let mut worst = 0f64;
    for (ratio, d, dtype) in [
        (1, 128, DType::BF16),
        (2, 64, DType::F16),
        (4, 128, DType::F16),
        (8, 64, DType::BF16),
        (2, 256, DType::BF16),
        (4, 256, DType::F16),
    ] {
        let (sq, sk) = (rng.odd_len(700, 1100), rng.odd_len(700, 1100));
        let shape = AttnShape::new((2, sq, sk, 2 * ratio, 2, d, d));
        let o = Opts::new(1.0 / (d as f64).sqrt());
        worst = worst.max(check_backward(shape, dtype, o, &mut rng, "bwd gqa")?);
        worst = worst.max(check_backward(
            shape,
            dtype,
            Opts { right: Some(0), ..o },
            &mut rng,
            "bwd gqa causal",
        )?);
    }
    println!("backward_gqa_ratios_long_sequences: 12 cases, max relative error {worst:.3e}");
    Ok(())
}

#[test]
fn backward_scales_negative_zero() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-bwd-scales");
    for (scale, d) in [(-0.125, 64), (0.0, 256), (0.4, 64), (0.3, 256)] {
        let shape = AttnShape::new((1, 150, 190, 4, 2, d, d));
        check_backward(
            shape,
            DType::BF16,
            Opts::new(scale),
            &mut rng,
            &format!("bwd scale {scale} d{d}"),
        )?;
        let o = Opts {
            softcap: Some(8.0),
            right: Some(0),
            ..Opts::new(scale)
        };
        check_backward(
            shape,
            DType::BF16,
            o,
            &mut rng,
            &format!("bwd scale {scale} d{d} softcap causal"),
        )?;
    }
    Ok(())
}

#[test]
fn backward_varlen_with_empty_sequences() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-bwd-varlen");
    let dev = gpu()?;
    let (mut n, mut worst) = (0, 0f64);
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 128, 256] {
            for (name, o) in variants(d, &mut rng) {
                let batch = rng.range(2, 5);
                let mut lq: Vec<usize> = (0..batch).map(|_| rng.odd_len(1, 300)).collect();
                let lk: Vec<usize> = (0..batch).map(|_| rng.odd_len(1, 300)).collect();
                lq[rng.range(0, batch - 1)] = 0; // an empty query sequence: its keys get zero dk/dv
                let (cu_q, cu_k) = (cumulative(&lq), cumulative(&lk));
                if cu_q[batch] == 0 {
                    continue;
                }
                let hk = rng.range(1, 2);
                let h = hk * rng.pick(&[1, 2, 4]);
                let q = rng.randn((cu_q[batch], h, d), dtype, &dev)?;
                let k = rng.randn((cu_k[batch], hk, d), dtype, &dev)?;
                let v = rng.randn((cu_k[batch], hk, d), dtype, &dev)?;
                let w = rng.randn((cu_q[batch], h, d), dtype, &dev)?;
                let (sq_t, sk_t) = (seqlens_tensor(&cu_q, &dev)?, seqlens_tensor(&cu_k, &dev)?);
                let (mq, mk) = (max_len(&cu_q), max_len(&cu_k));
                let f = |q: &Tensor, k: &Tensor, v: &Tensor| o.builder().forward_varlen(q, k, v, &sq_t, &sk_t, mq, mk);
                let got = autograd(f, &q, &k, &v, &w)?;
                let want = attention_grads_ref_varlen(&q, &k, &v, &w, &cu_q, &cu_k, &o.reference())?;
                let what = format!(
                    "bwd varlen {dtype:?} d{d} {name} lq {lq:?} lk {lk:?} h {h}/{hk} seed {}",
                    rng.seed()
                );
                worst = worst.max(check_grads(&got, &want, &what)?);
                n += 1;
            }
        }
    }
    println!("backward_varlen_with_empty_sequences: {n} cases, max relative error {worst:.3e}");
    Ok(())
}

#[test]
fn backward_deterministic_bitwise() -> Result<()> {
    // dQ is summed over 8-9 key blocks per query block by concurrent CTAs: with
    // .deterministic(true) three runs must give bit-identical gradients (and correct ones).
    let mut rng = TestRng::fresh("gpu-bwd-deterministic");
    let dev = gpu()?;
    for (d, causal) in [(128, false), (64, true), (256, true)] {
        let shape = AttnShape::new((2, 1000, 1100, 8, 2, d, d));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::BF16, &dev)?;
        let w = rng.randn(shape.out_shape(), DType::BF16, &dev)?;
        let o = Opts {
            right: causal.then_some(0),
            ..Opts::new(1.0 / (d as f64).sqrt())
        };
        let f = |q: &Tensor, k: &Tensor, v: &Tensor| o.builder().deterministic(true).forward(q, k, v);
        let first = autograd(f, &q, &k, &v, &w)?;
        for run in 1..3 {
            let again = autograd(f, &q, &k, &v, &w)?;
            for (name, a, b) in [
                ("dq", &first.0, &again.0),
                ("dk", &first.1, &again.1),
                ("dv", &first.2, &again.2),
            ] {
                assert_identical(
                    b,
                    a,
                    &format!("deterministic d{d} causal {causal}: {name} of run {run}"),
                )?;
            }
        }
        let want = attention_grads_ref(&q, &k, &v, &w, &o.reference())?;
        let e = check_grads(
            &first,
            &want,
            &format!("deterministic d{d} causal {causal} seed {}", rng.seed()),
        )?;
        println!("backward_deterministic_bitwise d{d} causal {causal}: 3 identical runs, relative error {e:.3e}");
    }
    Ok(())
}

#[test]
fn backward_small_for_sanitizer() -> Result<()> {
    // Two to four key blocks, causal, GQA 2, partial tiles; default and deterministic mode; both
    // kernel shapes (d64 / d128 and the wide d256). Small enough for compute-sanitizer memcheck
    // and racecheck.
    let mut rng = TestRng::fresh("gpu-bwd-small");
    for d in [64, 256] {
        let shape = AttnShape::new((1, 150, 200, 4, 2, d, d));
        let o = Opts {
            right: Some(0),
            ..Opts::new(1.0 / (d as f64).sqrt())
        };
        check_backward(shape, DType::BF16, o, &mut rng, &format!("bwd small causal d{d}"))?;
        let dev = gpu()?;
        let (q, k, v) = shape.random_qkv(&mut rng, DType::BF16, &dev)?;
        let w = rng.randn(shape.out_shape(), DType::BF16, &dev)?;
        let got = autograd(
            |q, k, v| o.builder().deterministic(true).forward(q, k, v),
            &q,
            &k,
            &v,
            &w,
        )?;
        let want = attention_grads_ref(&q, &k, &v, &w, &o.reference())?;
        check_grads(&got, &want, &format!("bwd small causal deterministic d{d}"))?;
    }
    Ok(())
}

#[test]
fn backward_functional_matches_reference() -> Result<()> {
    // FlashAttn::backward (out, lse, dO in; no autograd) on the GPU, both dtypes, GQA, causal and
    // not, against the f64 reference; in deterministic mode also bitwise equal to autograd.
    let mut rng = TestRng::fresh("gpu-bwd-functional");
    let dev = gpu()?;
    let mut worst = 0f64;
    for (dtype, causal) in [(DType::BF16, false), (DType::F16, true)] {
        let d = rng.pick(&[64, 128, 256]);
        let shape = AttnShape::new((2, rng.odd_len(100, 600), rng.odd_len(100, 600), 8, 2, d, d));
        let (q, k, v) = shape.random_qkv(&mut rng, dtype, &dev)?;
        let w = rng.randn(shape.out_shape(), dtype, &dev)?;
        let o = Opts {
            right: causal.then_some(0),
            ..Opts::new(1.0 / (d as f64).sqrt())
        };
        let fa = o.builder().deterministic(true);
        let (out, lse) = fa.forward_with_lse(&q, &k, &v)?;
        let got = fa.backward(&q, &k, &v, &out, &lse, &w)?;
        let what = format!("functional bwd {dtype:?} {shape:?} causal {causal} seed {}", rng.seed());
        let want = attention_grads_ref(&q, &k, &v, &w, &o.reference())?;
        worst = worst.max(check_grads(&got, &want, &what)?);
        let auto = autograd(|q, k, v| fa.forward(q, k, v), &q, &k, &v, &w)?;
        assert_identical(&got.0, &auto.0, &format!("{what}: dq == autograd"))?;
        assert_identical(&got.1, &auto.1, &format!("{what}: dk == autograd"))?;
        assert_identical(&got.2, &auto.2, &format!("{what}: dv == autograd"))?;
    }
    println!(
        "backward_functional_matches_reference: 2 cases, max relative error {worst:.3e}, bitwise equal to autograd"
    );
    Ok(())
}

// FP8 (e4m3) inputs: tests/gpu/fp8.rs.
#[path = "gpu/fp8.rs"]
mod fp8;

#[path = "gpu/kvcache.rs"]
mod kvcache;

#[path = "gpu/sinks.rs"]
mod sinks;

/// flash_attn3::retain_freed_device_memory sets the GPU's default memory pool to keep freed
/// memory (release threshold u64::MAX, from CUDA's 0), and attention after a synchronisation
/// still matches the reference.
#[test]
fn retain_freed_device_memory_sets_the_pool_threshold() -> Result<()> {
    let dev = gpu()?;
    flash_attn3::retain_freed_device_memory(&dev)?;
    assert_eq!(flash_attn3::device_memory_release_threshold(&dev)?, Some(u64::MAX));
    let mut rng = TestRng::new(56);
    let shape = AttnShape::new((1, 70, 90, 4, 2, 64, 64));
    for round in 0..2 {
        dev.synchronize()?;
        check_shape(
            shape,
            DType::BF16,
            Opts::new(0.125),
            &mut rng,
            &format!("after a synchronisation, round {round}"),
        )?;
    }
    Ok(())
}
