//! Every bad input is rejected with an error that names the problem, before any compute.
//!
//! Each test asserts `is_err()` and that the message contains the words of the check in
//! crates/flash-attn/src/params.rs. A device mismatch (q, k, v or the seqlens on different
//! devices) needs a GPU and is not tested here.

use candle_core::{DType, Device, Result, Shape, Tensor};
use flash_attn3::{
    flash_attn, flash_attn_varlen, flash_attn_varlen_offsets, flash_attn_varlen_windowed, flash_attn_windowed,
    FlashAttn, SeqOffsets, Tuning,
};
use flash_attn3_tests::assert_err;

const CPU: Device = Device::Cpu;

fn zeros(shape: impl Into<Shape>, dtype: DType) -> Tensor {
    Tensor::zeros(shape, dtype, &CPU).unwrap()
}

fn f32s(shape: impl Into<Shape>) -> Tensor {
    zeros(shape, DType::F32)
}

fn seqlens(cu: &[u32]) -> Tensor {
    Tensor::from_vec(cu.to_vec(), cu.len(), &CPU).unwrap()
}

/// A valid varlen call but for the given seqlens and maxima: q (10, 4, 32), k/v (12, 2, 32).
fn varlen_with(seqlens_q: &Tensor, seqlens_k: &Tensor, max_q: usize, max_k: usize) -> Result<Tensor> {
    let (q, k) = (f32s((10, 4, 32)), f32s((12, 2, 32)));
    flash_attn_varlen(&q, &k, &k, seqlens_q, seqlens_k, max_q, max_k, 0.1, false)
}

// ------------------------------------------------------------------------------------------
// dtypes
// ------------------------------------------------------------------------------------------

#[test]
fn f64_inputs_are_rejected() {
    let t = zeros((1, 8, 2, 16), DType::F64);
    assert_err(
        flash_attn(&t, &t, &t, 0.25, false),
        &["f32, f16, bf16 or f8e4m3", "F64"],
    );
    let t = zeros((8, 2, 16), DType::F64);
    let s = seqlens(&[0, 8]);
    assert_err(
        flash_attn_varlen(&t, &t, &t, &s, &s, 8, 8, 0.25, false),
        &["f32, f16, bf16 or f8e4m3", "F64"],
    );
}

#[test]
fn integer_inputs_are_rejected() {
    let t = zeros((1, 8, 2, 16), DType::U32);
    assert_err(
        flash_attn(&t, &t, &t, 0.25, false),
        &["f32, f16, bf16 or f8e4m3", "U32"],
    );
    let t = zeros((1, 8, 2, 16), DType::I64);
    assert_err(
        FlashAttn::new(0.25).forward_with_lse(&t, &t, &t),
        &["f32, f16, bf16 or f8e4m3", "I64"],
    );
}

#[test]
fn mixed_dtypes_are_rejected() {
    let q = zeros((1, 8, 2, 16), DType::F32);
    let h = zeros((1, 8, 2, 16), DType::F16);
    let b = zeros((1, 8, 2, 16), DType::BF16);
    assert_err(flash_attn(&q, &h, &h, 0.25, false), &["share one dtype", "F16"]);
    assert_err(flash_attn(&b, &b, &q, 0.25, false), &["share one dtype", "F32"]);
    assert_err(flash_attn(&h, &b, &h, 0.25, false), &["share one dtype", "BF16"]);
}

// ------------------------------------------------------------------------------------------
// Ranks and shapes
// ------------------------------------------------------------------------------------------

#[test]
fn rank_3_inputs_to_flash_attn_are_rejected() {
    let t3 = f32s((8, 2, 16));
    let t4 = f32s((1, 8, 2, 16));
    assert_err(flash_attn(&t3, &t3, &t3, 0.25, false), &["rank 4", "q"]);
    assert_err(flash_attn(&t4, &t3, &t4, 0.25, false), &["rank 4", "k"]);
    assert_err(flash_attn_windowed(&t4, &t4, &t3, 0.25, None, None), &["rank 4", "v"]);
    let t5 = f32s((1, 1, 8, 2, 16));
    assert_err(flash_attn(&t5, &t5, &t5, 0.25, false), &["rank 4"]);
}

#[test]
fn rank_4_inputs_to_varlen_are_rejected() {
    let t4 = f32s((1, 8, 2, 16));
    let t3 = f32s((8, 2, 16));
    let s = seqlens(&[0, 8]);
    assert_err(
        flash_attn_varlen(&t4, &t4, &t4, &s, &s, 8, 8, 0.25, false),
        &["rank 3", "q"],
    );
    assert_err(
        flash_attn_varlen_windowed(&t3, &t4, &t3, &s, &s, 8, 8, 0.25, None, None),
        &["rank 3", "k"],
    );
    assert_err(
        FlashAttn::new(0.25).forward_varlen_with_lse(&t3, &t3, &t4, &s, &s, 8, 8),
        &["rank 3", "v"],
    );
}

#[test]
fn batch_mismatch_is_rejected() {
    let (q, kv) = (f32s((2, 8, 2, 16)), f32s((3, 8, 2, 16)));
    assert_err(
        flash_attn(&q, &kv, &kv, 0.25, false),
        &["shapes do not match", "[2, 8, 2, 16]", "[3, 8, 2, 16]"],
    );
    let (k, v) = (f32s((2, 8, 2, 16)), f32s((1, 8, 2, 16)));
    assert_err(flash_attn(&q, &k, &v, 0.25, false), &["shapes do not match"]);
}

#[test]
fn seqlen_mismatch_between_k_and_v_is_rejected() {
    let (q, k, v) = (f32s((1, 8, 2, 16)), f32s((1, 9, 2, 16)), f32s((1, 10, 2, 16)));
    assert_err(
        flash_attn(&q, &k, &v, 0.25, false),
        &["shapes do not match", "[1, 10, 2, 16]"],
    );
    // Varlen: total_k of k and v.
    let (q, k, v) = (f32s((8, 2, 16)), f32s((9, 2, 16)), f32s((10, 2, 16)));
    let (sq, sk) = (seqlens(&[0, 8]), seqlens(&[0, 9]));
    assert_err(
        flash_attn_varlen(&q, &k, &v, &sq, &sk, 8, 9, 0.25, false),
        &["shapes do not match"],
    );
}

#[test]
fn kv_heads_mismatch_between_k_and_v_is_rejected() {
    let (q, k, v) = (f32s((1, 8, 4, 16)), f32s((1, 8, 2, 16)), f32s((1, 8, 4, 16)));
    assert_err(flash_attn(&q, &k, &v, 0.25, false), &["shapes do not match"]);
    let (q, k, v) = (f32s((8, 4, 16)), f32s((8, 2, 16)), f32s((8, 1, 16)));
    let s = seqlens(&[0, 8]);
    assert_err(
        flash_attn_varlen(&q, &k, &v, &s, &s, 8, 8, 0.25, false),
        &["shapes do not match"],
    );
}

#[test]
fn head_dim_mismatch_between_q_and_k_is_rejected() {
    let (q, k) = (f32s((1, 8, 2, 64)), f32s((1, 8, 2, 32)));
    assert_err(flash_attn(&q, &k, &k, 0.25, false), &["shapes do not match"]);
    let (q, k) = (f32s((8, 2, 64)), f32s((8, 2, 32)));
    let s = seqlens(&[0, 8]);
    assert_err(
        flash_attn_varlen(&q, &k, &k, &s, &s, 8, 8, 0.25, false),
        &["shapes do not match"],
    );
}

#[test]
fn non_integer_gqa_ratio_is_rejected() {
    let (q, kv) = (f32s((1, 8, 6, 16)), f32s((1, 8, 4, 16)));
    assert_err(flash_attn(&q, &kv, &kv, 0.25, false), &["multiple", "(6)", "(4)"]);
    // More kv heads than q heads.
    let (q, kv) = (f32s((1, 8, 2, 16)), f32s((1, 8, 4, 16)));
    assert_err(flash_attn(&q, &kv, &kv, 0.25, false), &["multiple"]);
    let (q, kv) = (f32s((8, 6, 16)), f32s((8, 4, 16)));
    let s = seqlens(&[0, 8]);
    assert_err(
        flash_attn_varlen(&q, &kv, &kv, &s, &s, 8, 8, 0.25, false),
        &["multiple"],
    );
}

#[test]
fn head_dims_over_256_are_rejected() {
    for d in [257, 512] {
        let t = f32s((1, 4, 1, d));
        assert_err(
            flash_attn(&t, &t, &t, 0.25, false),
            &["head dim", &d.to_string(), "256"],
        );
        let t = f32s((4, 1, d));
        let s = seqlens(&[0, 4]);
        assert_err(
            flash_attn_varlen(&t, &t, &t, &s, &s, 4, 4, 0.25, false),
            &["head dim", &d.to_string()],
        );
    }
    // The v head dim alone.
    let (q, v) = (f32s((1, 4, 1, 64)), f32s((1, 4, 1, 300)));
    assert_err(flash_attn(&q, &q, &v, 0.25, false), &["v head dim", "300"]);
}

#[test]
fn empty_batch_is_rejected() {
    let t = f32s((0, 8, 2, 16));
    assert_err(flash_attn(&t, &t, &t, 0.25, false), &["empty"]);
}

#[test]
fn empty_seqlens_are_rejected() {
    let (q, kv) = (f32s((1, 0, 2, 16)), f32s((1, 8, 2, 16)));
    assert_err(flash_attn(&q, &kv, &kv, 0.25, false), &["empty"]);
    let (q, kv) = (f32s((1, 8, 2, 16)), f32s((1, 0, 2, 16)));
    assert_err(flash_attn(&q, &kv, &kv, 0.25, false), &["empty"]);
}

#[test]
fn empty_heads_are_rejected() {
    let t = f32s((1, 8, 0, 16));
    assert_err(flash_attn(&t, &t, &t, 0.25, false), &["empty"]);
    let (q, kv) = (f32s((1, 8, 0, 16)), f32s((1, 8, 2, 16)));
    assert_err(flash_attn(&q, &kv, &kv, 0.25, false), &["empty", "0 heads"]);
    let (q, kv) = (f32s((1, 8, 2, 16)), f32s((1, 8, 0, 16)));
    assert_err(flash_attn(&q, &kv, &kv, 0.25, false), &["empty"]);
}

#[test]
fn empty_varlen_totals_are_rejected() {
    let (q, kv) = (f32s((0, 2, 16)), f32s((8, 2, 16)));
    let (sq, sk) = (seqlens(&[0, 0]), seqlens(&[0, 8]));
    assert_err(flash_attn_varlen(&q, &kv, &kv, &sq, &sk, 0, 8, 0.25, false), &["empty"]);
    let (q, kv) = (f32s((8, 2, 16)), f32s((0, 2, 16)));
    let (sq, sk) = (seqlens(&[0, 8]), seqlens(&[0, 0]));
    assert_err(flash_attn_varlen(&q, &kv, &kv, &sq, &sk, 8, 0, 0.25, false), &["empty"]);
}

#[test]
fn non_contiguous_last_dim_is_rejected() {
    // (b, s, d, h) transposed to (b, s, h, d): head_dim has stride h.
    let bad = f32s((1, 8, 16, 2)).transpose(2, 3).unwrap();
    let good = f32s((1, 8, 2, 16));
    assert_err(
        flash_attn(&bad, &good, &good, 0.25, false),
        &["last dimension of q", "contiguous"],
    );
    assert_err(
        flash_attn(&good, &bad, &good, 0.25, false),
        &["last dimension of k", "contiguous"],
    );
    assert_err(
        flash_attn(&good, &good, &bad, 0.25, false),
        &["last dimension of v", "contiguous"],
    );
    let bad = f32s((8, 16, 2)).transpose(1, 2).unwrap();
    let good = f32s((8, 2, 16));
    let s = seqlens(&[0, 8]);
    assert_err(
        flash_attn_varlen(&bad, &good, &good, &s, &s, 8, 8, 0.25, false),
        &["last dimension of q", "contiguous"],
    );
}

// ------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------

#[test]
fn invalid_softcap_is_rejected() {
    let t = f32s((1, 8, 2, 16));
    for cap in [0.0, -1.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert_err(FlashAttn::new(0.25).softcap(cap).forward(&t, &t, &t), &["softcap"]);
    }
    let t = f32s((8, 2, 16));
    let s = seqlens(&[0, 8]);
    assert_err(
        FlashAttn::new(0.25)
            .softcap(0.0)
            .forward_varlen(&t, &t, &t, &s, &s, 8, 8),
        &["softcap"],
    );
}

#[test]
fn non_finite_softmax_scale_is_rejected() {
    let t = f32s((1, 8, 2, 16));
    for scale in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert_err(flash_attn(&t, &t, &t, scale, false), &["softmax_scale"]);
        assert_err(
            FlashAttn::new(scale).causal(true).forward_with_lse(&t, &t, &t),
            &["softmax_scale"],
        );
    }
    let t = f32s((8, 2, 16));
    let s = seqlens(&[0, 8]);
    assert_err(
        flash_attn_varlen(&t, &t, &t, &s, &s, 8, 8, f32::NAN, true),
        &["softmax_scale"],
    );
}

// ------------------------------------------------------------------------------------------
// Varlen sequence lengths
// ------------------------------------------------------------------------------------------

#[test]
fn seqlens_of_the_wrong_dtype_are_rejected() {
    let good_k = seqlens(&[0, 5, 12]);
    let i64s = Tensor::new(&[0i64, 4, 10], &CPU).unwrap();
    assert_err(varlen_with(&i64s, &good_k, 10, 10), &["seqlens_q", "u32", "I64"]);
    let f32_lens = Tensor::new(&[0f32, 4., 10.], &CPU).unwrap();
    assert_err(
        varlen_with(&seqlens(&[0, 4, 10]), &f32_lens, 10, 10),
        &["seqlens_k", "u32", "F32"],
    );
}

#[test]
fn seqlens_of_the_wrong_rank_are_rejected() {
    let two_d = Tensor::new(&[[0u32, 4, 10]], &CPU).unwrap();
    assert_err(
        varlen_with(&two_d, &seqlens(&[0, 5, 12]), 10, 10),
        &["seqlens_q", "rank-1"],
    );
    // A single offset describes no sequence.
    assert_err(
        varlen_with(&seqlens(&[10]), &seqlens(&[12]), 10, 12),
        &["seqlens_q", ">= 2 offsets"],
    );
}

#[test]
fn seqlens_not_starting_at_zero_are_rejected() {
    assert_err(
        varlen_with(&seqlens(&[1, 4, 10]), &seqlens(&[0, 5, 12]), 10, 10),
        &["seqlens_q", "start at 0"],
    );
    assert_err(
        varlen_with(&seqlens(&[0, 4, 10]), &seqlens(&[2, 5, 12]), 10, 10),
        &["seqlens_k", "start at 0"],
    );
}

#[test]
fn decreasing_seqlens_are_rejected() {
    assert_err(
        varlen_with(&seqlens(&[0, 6, 4, 10]), &seqlens(&[0, 5, 6, 12]), 10, 12),
        &["seqlens_q", "non-decreasing"],
    );
    assert_err(
        varlen_with(&seqlens(&[0, 4, 6, 10]), &seqlens(&[0, 7, 5, 12]), 10, 12),
        &["seqlens_k", "non-decreasing"],
    );
}

#[test]
fn seqlens_not_ending_at_the_total_are_rejected() {
    assert_err(
        varlen_with(&seqlens(&[0, 4, 9]), &seqlens(&[0, 5, 12]), 10, 12),
        &["seqlens_q", "must end at", "(10)"],
    );
    assert_err(
        varlen_with(&seqlens(&[0, 4, 10]), &seqlens(&[0, 5, 11]), 10, 12),
        &["seqlens_k", "must end at", "(12)"],
    );
    // Past the total.
    assert_err(
        varlen_with(&seqlens(&[0, 4, 11]), &seqlens(&[0, 5, 12]), 10, 12),
        &["seqlens_q", "must end at"],
    );
}

#[test]
fn seqlens_with_different_batches_are_rejected() {
    assert_err(
        varlen_with(&seqlens(&[0, 4, 10]), &seqlens(&[0, 5, 6, 12]), 10, 12),
        &["same batch"],
    );
}

#[test]
fn sequences_longer_than_max_seqlen_are_rejected() {
    assert_err(
        varlen_with(&seqlens(&[0, 4, 10]), &seqlens(&[0, 5, 12]), 5, 12),
        &["seqlens_q", "longer than", "6"],
    );
    assert_err(
        varlen_with(&seqlens(&[0, 4, 10]), &seqlens(&[0, 5, 12]), 6, 6),
        &["seqlens_k", "longer than", "7"],
    );
}

/// The same shapes and seqlens are accepted: the failures above come from the one thing each
/// test breaks.
#[test]
fn the_baseline_calls_are_valid() -> Result<()> {
    let t = f32s((1, 8, 2, 16));
    flash_attn(&t, &t, &t, 0.25, true)?;
    let (sq, sk) = (seqlens(&[0, 4, 10]), seqlens(&[0, 5, 12]));
    varlen_with(&sq, &sk, 6, 7)?;
    // Empty sequences inside a batch are fine.
    varlen_with(&seqlens(&[0, 0, 10]), &seqlens(&[0, 5, 12]), 10, 7)?;
    Ok(())
}

// ------------------------------------------------------------------------------------------
// host-side offsets (SeqOffsets, forward_varlen_offsets): the same rules, checked on the host
// ------------------------------------------------------------------------------------------

fn offsets(cu: &[u32]) -> SeqOffsets {
    SeqOffsets::new(cu, &CPU).unwrap()
}

/// `varlen_with` through the host-offsets entry point.
fn varlen_offsets_with(seqlens_q: &SeqOffsets, seqlens_k: &SeqOffsets, max_q: usize, max_k: usize) -> Result<Tensor> {
    let (q, k) = (f32s((10, 4, 32)), f32s((12, 2, 32)));
    flash_attn_varlen_offsets(&q, &k, &k, seqlens_q, seqlens_k, max_q, max_k, 0.1, false)
}

#[test]
fn seq_offsets_reject_malformed_offsets() {
    assert_err(SeqOffsets::new(&[], &CPU), &[">= 2 offsets", "got 0"]);
    assert_err(SeqOffsets::new(&[7], &CPU), &[">= 2 offsets", "got 1"]);
    assert_err(SeqOffsets::new(&[1, 4, 10], &CPU), &["start at 0", "got 1"]);
    assert_err(SeqOffsets::new(&[0, 6, 4, 10], &CPU), &["non-decreasing", "4 after 6"]);
    assert_err(
        SeqOffsets::from_lengths([u32::MAX as usize, 1], &CPU),
        &["overflow u32"],
    );
}

#[test]
fn seq_offsets_describe_their_sequences() -> Result<()> {
    let cu = SeqOffsets::from_lengths([4, 0, 6], &CPU)?;
    assert_eq!(cu.as_slice(), &[0, 4, 4, 10]);
    assert_eq!((cu.batch(), cu.total(), cu.max_len()), (3, 10, 6));
    assert_eq!(cu.tensor().to_vec1::<u32>()?, vec![0, 4, 4, 10]);
    Ok(())
}

#[test]
fn host_offsets_not_ending_at_the_total_are_rejected() {
    assert_err(
        varlen_offsets_with(&offsets(&[0, 4, 9]), &offsets(&[0, 5, 12]), 10, 12),
        &["seqlens_q", "must end at", "(10)"],
    );
    assert_err(
        varlen_offsets_with(&offsets(&[0, 4, 10]), &offsets(&[0, 5, 11]), 10, 12),
        &["seqlens_k", "must end at", "(12)"],
    );
}

#[test]
fn host_offsets_longer_than_max_seqlen_are_rejected() {
    assert_err(
        varlen_offsets_with(&offsets(&[0, 4, 10]), &offsets(&[0, 5, 12]), 5, 12),
        &["seqlens_q", "length 6", "maximum 5"],
    );
    assert_err(
        varlen_offsets_with(&offsets(&[0, 4, 10]), &offsets(&[0, 5, 12]), 10, 6),
        &["seqlens_k", "length 7", "maximum 6"],
    );
}

#[test]
fn host_offsets_with_different_batches_are_rejected() {
    assert_err(
        varlen_offsets_with(&offsets(&[0, 4, 10]), &offsets(&[0, 5, 6, 12]), 10, 12),
        &["same batch", "3 and 4"],
    );
}

#[test]
fn host_offsets_go_through_the_other_checks_too() {
    // Shapes, dtypes and options are checked as for the tensor form.
    let (q, k) = (f32s((10, 4, 32)), f32s((12, 3, 32)));
    let (sq, sk) = (offsets(&[0, 10]), offsets(&[0, 12]));
    assert_err(
        FlashAttn::new(0.1).forward_varlen_offsets(&q, &k, &k, &sq, &sk, 10, 12),
        &["multiple"],
    );
    let t = f32s((8, 2, 16));
    let s = offsets(&[0, 8]);
    assert_err(
        FlashAttn::new(f32::NAN).forward_varlen_offsets_with_lse(&t, &t, &t, &s, &s, 8, 8),
        &["softmax_scale"],
    );
}

#[test]
fn host_offsets_compute_what_the_tensor_form_computes() -> Result<()> {
    let dev = &CPU;
    let q = Tensor::randn(0f32, 1., (10, 4, 32), dev)?;
    let k = Tensor::randn(0f32, 1., (12, 2, 32), dev)?;
    let v = Tensor::randn(0f32, 1., (12, 2, 32), dev)?;
    let (cq, ck) = ([0u32, 4, 4, 10], [0u32, 5, 7, 12]);
    let attn = FlashAttn::new(0.2).causal(true);
    let (a, la) = attn.forward_varlen_with_lse(&q, &k, &v, &seqlens(&cq), &seqlens(&ck), 6, 5)?;
    let (b, lb) = attn.forward_varlen_offsets_with_lse(&q, &k, &v, &offsets(&cq), &offsets(&ck), 6, 5)?;
    let max_diff = |x: &Tensor, y: &Tensor| -> Result<f32> {
        // -inf LSE rows (the empty sequence has none here) would make NaN: compare as is.
        (x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    };
    assert_eq!(max_diff(&a, &b)?, 0.0);
    assert_eq!(max_diff(&la, &lb)?, 0.0);
    Ok(())
}

#[test]
fn invalid_tuning_is_rejected() {
    let t = f32s((1, 8, 2, 16));
    let default = Tuning::default();
    let invalid: [(Tuning, &[&str]); 3] = [
        (
            Tuning {
                d64_tile_rows: Some(64),
                ..default
            },
            &["d64_tile_rows", "128 or 192"],
        ),
        (
            Tuning {
                l2_section: Some(0),
                ..default
            },
            &["l2_section"],
        ),
        (
            Tuning {
                fp8_d128_block_n: Some(192),
                ..default
            },
            &["fp8_d128_block_n", "128 or 256"],
        ),
    ];
    for (tuning, expected) in invalid {
        assert_err(FlashAttn::new(0.25).tuning(tuning).forward(&t, &t, &t), expected);
    }
    // A valid tuning changes nothing on the CPU.
    let q = Tensor::randn(0f32, 1., (1, 8, 2, 16), &CPU).unwrap();
    let tuned = Tuning {
        pack_gqa: Some(true),
        d64_tile_rows: Some(128),
        direct_store: true,
        per_tile: true,
        dynamic_tiles: Some(true),
        l2_section: Some(3),
        fp8_d128_block_n: Some(256),
        fp8_vt_in_kernel: Some(false),
        global_combine: true,
        decode_one_cta_per_sm: true,
        decode_kernel: Some(true),
    };
    let a = FlashAttn::new(0.25).forward(&q, &q, &q).unwrap();
    let b = FlashAttn::new(0.25).tuning(tuned).forward(&q, &q, &q).unwrap();
    let diff = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0);
}
