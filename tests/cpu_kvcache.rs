//! `flash_attn_with_kvcache` on the CPU (flash_attn3::kvcache): the call against a model of the
//! cache kept here in f64 — which rows each sequence's keys are, what the append writes, where
//! rotary turns q and k — and the f64 attention reference over the keys that model gives.
//! Contiguous and paged caches (every page size, shuffled pages, a prefix page shared by two
//! sequences), append with and without rotary (interleaved or not), cache_batch_idx
//! permutations, zero-length sequences, GQA, causal / window / softcap; then the errors.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use flash_attn3::kvcache::PAGE_SIZES;
use flash_attn3::FlashAttn;
use flash_attn3_tests::{
    assert_close, assert_err, attention_ref_varlen, cumulative, random_paged_layout, rotary_tables, to_f64_vec, Opts,
    PagedLayout, TestRng,
};

const F32_TOL: f64 = 1e-5;

/// One random kvcache call and the host model of its cache.
struct Case {
    batch: usize,
    seqlen_q: usize,
    seqlen_new: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    dv: usize,
    /// Keys each sequence holds before the call.
    lens: Vec<usize>,
    /// None: contiguous, one cache row per sequence (through `batch_idx`); Some: the page size.
    page_size: Option<usize>,
    /// Cache slot of key j of sequence b: (slot, row) in the caches' first two dims.
    slots: Vec<Vec<(usize, usize)>>,
    page_table: Option<Vec<u32>>,
    max_pages: usize,
    batch_idx: Option<Vec<u32>>,
    /// The caches' first two dims.
    cache_dims: (usize, usize),
}

impl Case {
    fn random(rng: &mut TestRng, page_size: Option<usize>, append: bool) -> Self {
        let batch = rng.range(1, 4);
        let kv_heads = rng.pick(&[1, 2]);
        let heads = kv_heads * rng.pick(&[1, 3, 4]);
        let d = rng.pick(&[32, 64, 40]);
        let dv = rng.pick(&[d, 48]);
        let seqlen_new = if append { rng.range(1, 5) } else { 0 };
        let seqlen_q = if append { seqlen_new } else { rng.range(1, 5) };
        // One sequence empty when nothing is appended (zero keys: zero output, LSE -inf).
        let lens: Vec<usize> = (0..batch)
            .map(|b| if b == 1 && !append { 0 } else { rng.range(0, 300) })
            .collect();
        let keys: Vec<usize> = lens.iter().map(|l| l + seqlen_new).collect();
        match page_size {
            None => {
                let capacity = keys.iter().copied().max().unwrap() + rng.range(0, 40);
                let rows_in_cache = batch + rng.range(0, 3);
                // A permutation: batch entry b uses cache row batch_idx[b].
                let batch_idx: Vec<u32> = rng.permutation(rows_in_cache)[..batch].to_vec();
                let slots = (0..batch)
                    .map(|b| (0..keys[b]).map(|j| (batch_idx[b] as usize, j)).collect())
                    .collect();
                Self {
                    batch,
                    seqlen_q,
                    seqlen_new,
                    heads,
                    kv_heads,
                    d,
                    dv,
                    lens,
                    page_size,
                    slots,
                    page_table: None,
                    max_pages: 0,
                    batch_idx: Some(batch_idx),
                    cache_dims: (rows_in_cache, capacity),
                }
            }
            Some(ps) => {
                let PagedLayout {
                    table,
                    max_pages,
                    num_pages,
                } = random_paged_layout(rng, &lens, &keys, ps);
                let slots = (0..batch)
                    .map(|b| {
                        (0..keys[b])
                            .map(|j| (table[b * max_pages + j / ps] as usize, j % ps))
                            .collect()
                    })
                    .collect();
                Self {
                    batch,
                    seqlen_q,
                    seqlen_new,
                    heads,
                    kv_heads,
                    d,
                    dv,
                    lens,
                    page_size,
                    slots,
                    page_table: Some(table),
                    max_pages,
                    batch_idx: None,
                    cache_dims: (num_pages, ps),
                }
            }
        }
    }

    fn describe(&self) -> String {
        format!(
            "batch {} sq {} new {} heads {}/{} d {}/{} lens {:?} page {:?}",
            self.batch,
            self.seqlen_q,
            self.seqlen_new,
            self.heads,
            self.kv_heads,
            self.d,
            self.dv,
            self.lens,
            self.page_size
        )
    }

    /// The call's index tensors on `dev`: cache_seqlens, and the page table or the cache rows.
    fn index_tensors(&self, dev: &Device) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let lens: Vec<u32> = self.lens.iter().map(|&l| l as u32).collect();
        let page_table = match &self.page_table {
            Some(t) => Some(Tensor::from_vec(t.clone(), (self.batch, self.max_pages), dev)?),
            None => None,
        };
        let batch_idx = match &self.batch_idx {
            Some(i) => Some(Tensor::new(i.as_slice(), dev)?),
            None => None,
        };
        Ok((Tensor::new(lens.as_slice(), dev)?, page_table, batch_idx))
    }

    /// The first `keys[b]` keys of each sequence, packed (total keys, kv_heads, d / dv), from
    /// caches `k` / `v` given as f64 values in the caches' layout.
    fn gather_keys(&self, k: &[f64], v: &[f64], keys: &[usize]) -> Result<(Tensor, Tensor)> {
        let (rows, hk, d, dv) = (self.cache_dims.1, self.kv_heads, self.d, self.dv);
        let (mut k_seq, mut v_seq) = (Vec::new(), Vec::new());
        for (seq, &n) in self.slots.iter().zip(keys) {
            for &(slot, row) in &seq[..n] {
                let at = (slot * rows + row) * hk;
                k_seq.extend_from_slice(&k[at * d..(at + hk) * d]);
                v_seq.extend_from_slice(&v[at * dv..(at + hk) * dv]);
            }
        }
        let total_k: usize = keys.iter().sum();
        Ok((
            Tensor::from_vec(k_seq, (total_k, hk, d), &Device::Cpu)?,
            Tensor::from_vec(v_seq, (total_k, hk, dv), &Device::Cpu)?,
        ))
    }
}

/// `row` (d values, f64) turned to position `pos` by the f32 tables, in f64.
fn rotate(row: &mut [f64], pos: usize, cos: &[f32], sin: &[f32], half: usize, interleaved: bool) {
    for r in 0..half {
        let (a, b) = if interleaved { (2 * r, 2 * r + 1) } else { (r, r + half) };
        let (c, s) = (cos[pos * half + r] as f64, sin[pos * half + r] as f64);
        let (x0, x1) = (row[a], row[b]);
        row[a] = x0 * c - x1 * s;
        row[b] = x0 * s + x1 * c;
    }
}

/// Runs one case in f32 and checks the output, the LSE and the cache contents after the call.
fn check(rng: &mut TestRng, case: &Case, opts: Opts, rotary: Option<(usize, bool)>) -> Result<()> {
    let dev = Device::Cpu;
    let what = format!(
        "{} opts {opts:?} rotary {rotary:?} seed {}",
        case.describe(),
        rng.seed()
    );
    let (slots, rows) = case.cache_dims;
    let (b, hk, d, dv) = (case.batch, case.kv_heads, case.d, case.dv);
    let k_cache = rng.randn((slots, rows, hk, d), DType::F32, &dev)?;
    let v_cache = rng.randn((slots, rows, hk, dv), DType::F32, &dev)?;
    let (k_before, v_before) = (to_f64_vec(&k_cache)?, to_f64_vec(&v_cache)?);
    let q = rng.randn((b, case.seqlen_q, case.heads, d), DType::F32, &dev)?;
    let k_new = rng.randn((b, case.seqlen_new, hk, d), DType::F32, &dev)?;
    let v_new = rng.randn((b, case.seqlen_new, hk, dv), DType::F32, &dev)?;
    let (cache_seqlens, page_table, batch_idx) = case.index_tensors(&dev)?;
    let max_keys = case.lens.iter().map(|l| l + case.seqlen_new).max().unwrap();
    let tables = match rotary {
        Some((rd, _)) => Some(rotary_tables(max_keys + rng.range(0, 5), rd)?),
        None => None,
    };

    let builder = opts.builder();
    let mut call = builder.kv_cache(&k_cache, &v_cache, &cache_seqlens);
    if case.seqlen_new > 0 {
        call = call.append(&k_new, &v_new);
    }
    if let Some(pt) = &page_table {
        call = call.page_table(pt);
    }
    if let Some(idx) = &batch_idx {
        call = call.cache_batch_idx(idx);
    }
    if let (Some((cos, sin)), Some((_, interleaved))) = (&tables, rotary) {
        call = call.rotary(cos, sin, interleaved);
    }
    let (out, lse) = call.forward_with_lse(&q)?;
    assert_eq!(out.dims(), &[b, case.seqlen_q, case.heads, dv], "{what}: out shape");
    assert_eq!(lse.dims(), &[b, case.heads, case.seqlen_q], "{what}: lse shape");

    // The model: the cache after the append, and q and k_new as rotated.
    let (mut k_model, mut v_model) = (k_before.clone(), v_before.clone());
    let (mut q_rot, mut kn_rot) = (to_f64_vec(&q)?, to_f64_vec(&k_new)?);
    let vn = to_f64_vec(&v_new)?;
    let per_token = opts.left.is_some() || opts.right.is_some();
    if let (Some((cos, sin)), Some((rd, interleaved))) = (&tables, rotary) {
        let (cos, sin) = (
            cos.flatten_all()?.to_vec1::<f32>()?,
            sin.flatten_all()?.to_vec1::<f32>()?,
        );
        for bi in 0..b {
            for i in 0..case.seqlen_q {
                let pos = case.lens[bi] + if per_token { i } else { 0 };
                for h in 0..case.heads {
                    let at = ((bi * case.seqlen_q + i) * case.heads + h) * d;
                    rotate(&mut q_rot[at..at + d], pos, &cos, &sin, rd / 2, interleaved);
                }
            }
            for i in 0..case.seqlen_new {
                for h in 0..hk {
                    let at = ((bi * case.seqlen_new + i) * hk + h) * d;
                    rotate(
                        &mut kn_rot[at..at + d],
                        case.lens[bi] + i,
                        &cos,
                        &sin,
                        rd / 2,
                        interleaved,
                    );
                }
            }
        }
    }
    let mut appended = vec![false; slots * rows];
    for bi in 0..b {
        for i in 0..case.seqlen_new {
            let (slot, row) = case.slots[bi][case.lens[bi] + i];
            appended[slot * rows + row] = true;
            for h in 0..hk {
                let src = (bi * case.seqlen_new + i) * hk + h;
                let dst = (slot * rows + row) * hk + h;
                k_model[dst * d..][..d].copy_from_slice(&kn_rot[src * d..][..d]);
                v_model[dst * dv..][..dv].copy_from_slice(&vn[src * dv..][..dv]);
            }
        }
    }
    // The caches after the call: v and unrotated k copied bit for bit, untouched rows unchanged,
    // rotated k within f32 rounding of the f64 rotation.
    let (k_after, v_after) = (to_f64_vec(&k_cache)?, to_f64_vec(&v_cache)?);
    for (slot_row, &was_appended) in appended.iter().enumerate() {
        for h in 0..hk {
            let at = slot_row * hk + h;
            for x in 0..d {
                let (got, want) = (k_after[at * d + x], k_model[at * d + x]);
                let exact = !was_appended || rotary.is_none();
                let ok = if exact {
                    got == want
                } else {
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs())
                };
                assert!(ok, "{what}: k_cache slot {slot_row} head {h} dim {x}: {got} vs {want}");
            }
            for x in 0..dv {
                assert_eq!(
                    v_after[at * dv + x],
                    v_model[at * dv + x],
                    "{what}: v_cache slot {slot_row} head {h}"
                );
            }
        }
    }

    // The reference: each sequence's keys gathered from the model, one varlen f64 call.
    let keys: Vec<usize> = case.lens.iter().map(|l| l + case.seqlen_new).collect();
    let (k_ref, v_ref) = case.gather_keys(&k_model, &v_model, &keys)?;
    let q_ref = Tensor::from_vec(q_rot, (b * case.seqlen_q, case.heads, d), &dev)?;
    let cu_q = cumulative(&vec![case.seqlen_q; b]);
    let cu_k = cumulative(&keys);
    let (want, want_lse) = attention_ref_varlen(&q_ref, &k_ref, &v_ref, &cu_q, &cu_k, &opts.reference())?;
    let want = want.reshape((b, case.seqlen_q, case.heads, dv))?;
    let want_lse = want_lse
        .reshape((case.heads, b, case.seqlen_q))?
        .transpose(0, 1)?
        .contiguous()?;
    assert_close(&out, &want, F32_TOL, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, F32_TOL, &format!("{what}: lse"))?;
    Ok(())
}

#[test]
fn kvcache_contiguous_every_option() -> Result<()> {
    let mut rng = TestRng::fresh("cpu-kvcache-contiguous");
    for append in [false, true] {
        for opts in [
            Opts::new(0.125),
            Opts::new(0.2).causal(),
            Opts::new(0.1).window(Some(37), Some(0)).softcap(5.0),
        ] {
            for rotary in [None, Some((32, false)), Some((16, true))] {
                if rotary.is_some() && !append {
                    continue;
                }
                let case = Case::random(&mut rng, None, append);
                check(&mut rng, &case, opts, rotary)?;
            }
        }
    }
    Ok(())
}

#[test]
fn kvcache_paged_every_page_size() -> Result<()> {
    let mut rng = TestRng::fresh("cpu-kvcache-paged");
    for page_size in PAGE_SIZES {
        for (append, opts, rotary) in [
            (false, Opts::new(0.125), None),
            (true, Opts::new(0.2).causal(), Some((32, false))),
            (true, Opts::new(0.15), None),
        ] {
            let case = Case::random(&mut rng, Some(page_size), append);
            check(&mut rng, &case, opts, rotary)?;
        }
    }
    Ok(())
}

/// bf16: the same call, the output within bf16 rounding of the f32 call on the same values.
#[test]
fn kvcache_bf16_matches_f32() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-bf16");
    let (b, hk, h, d, ps, pages) = (2, 2, 8, 64, 16, 12);
    let q = rng.randn((b, 3, h, d), DType::BF16, &dev)?;
    let k_cache = rng.randn((pages, ps, hk, d), DType::BF16, &dev)?;
    let v_cache = rng.randn((pages, ps, hk, d), DType::BF16, &dev)?;
    let k_new = rng.randn((b, 3, hk, d), DType::BF16, &dev)?;
    let v_new = rng.randn((b, 3, hk, d), DType::BF16, &dev)?;
    let lens = Tensor::new(&[40u32, 17], &dev)?;
    let table = Tensor::new(&[[3u32, 7, 1, 0], [9, 2, 11, 5]], &dev)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let attn = FlashAttn::new(0.125).causal(true);
    let (k32, v32) = (f32(&k_cache)?, f32(&v_cache)?);
    let want = attn
        .kv_cache(&k32, &v32, &lens)
        .append(&f32(&k_new)?, &f32(&v_new)?)
        .page_table(&table)
        .forward(&f32(&q)?)?;
    let got = attn
        .kv_cache(&k_cache, &v_cache, &lens)
        .append(&k_new, &v_new)
        .page_table(&table)
        .forward(&q)?;
    assert_eq!(got.dtype(), DType::BF16);
    assert_close(&got, &want, 1e-2, &format!("bf16 vs f32, seed {}", rng.seed()))?;
    // Both appends wrote the same values (bf16 → f32 is exact).
    assert_eq!(
        to_f64_vec(&k_cache)?,
        to_f64_vec(&k32)?,
        "the bf16 and f32 caches after the appends"
    );
    Ok(())
}

/// More sequences than pages in the pool: sequences that share pages, or hold none yet, are no
/// reason for an error (the batch index of a paged call is not a cache row).
#[test]
fn kvcache_paged_batch_above_page_count() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-few-pages");
    let (b, hk, d, ps) = (4, 1, 32, 16);
    let q = rng.randn((b, 1, 2, d), DType::F32, &dev)?;
    let cache = rng.randn((2, ps, hk, d), DType::F32, &dev)?;
    // Sequences 0 and 2 share page 1 (10 keys), 1 holds none, 3 has page 0 (16 keys).
    let lens = Tensor::new(&[10u32, 0, 10, 16], &dev)?;
    let table = Tensor::new(&[[1u32], [0], [1], [0]], &dev)?;
    let out = FlashAttn::new(0.2)
        .kv_cache(&cache, &cache, &lens)
        .page_table(&table)
        .forward(&q)?;
    for (seq, (page, n)) in [(0, (1, 10)), (2, (1, 10)), (3, (0, 16))] {
        let kv = cache.narrow(0, page, 1)?.narrow(1, 0, n)?;
        let want = FlashAttn::new(0.2).forward(&q.narrow(0, seq, 1)?, &kv, &kv)?;
        assert_close(&out.narrow(0, seq, 1)?, &want, F32_TOL, &format!("sequence {seq}"))?;
    }
    // No keys: a zero output row.
    let empty = out.narrow(0, 1, 1)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert_eq!(empty, 0.0);
    Ok(())
}

#[test]
fn kvcache_function_form() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-fn");
    let q = rng.randn((1, 1, 4, 32), DType::F32, &dev)?;
    let k_cache = rng.randn((1, 20, 2, 32), DType::F32, &dev)?;
    let v_cache = rng.randn((1, 20, 2, 32), DType::F32, &dev)?;
    let k_new = rng.randn((1, 1, 2, 32), DType::F32, &dev)?;
    let v_new = rng.randn((1, 1, 2, 32), DType::F32, &dev)?;
    let lens = Tensor::new(&[9u32], &dev)?;
    let out =
        flash_attn3::flash_attn_with_kvcache(&q, &k_cache, &v_cache, Some(&k_new), Some(&v_new), &lens, 0.2, true)?;
    // The same as plain attention over the first 10 cache rows after the append.
    let want = FlashAttn::new(0.2)
        .causal(true)
        .forward(&q, &k_cache.narrow(1, 0, 10)?, &v_cache.narrow(1, 0, 10)?)?;
    assert_close(&out, &want, F32_TOL, "function form")?;
    assert_eq!(
        to_f64_vec(&k_cache.narrow(1, 9, 1)?)?,
        to_f64_vec(&k_new)?,
        "appended row"
    );
    Ok(())
}

/// Calls over strided cache views (k and v heads interleaved in one buffer, as flash-llama's
/// caches hold them), contiguous or paged, give what the same calls over dense copies give, an
/// append included (written into the views in place); a head dim that is strided, and an fp8
/// cache that is not dense, are refused.
#[test]
fn kvcache_strided_views() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-strided");
    let (b, s, hk, d) = (3, 40, 2, 32);
    let q = rng.randn((b, 1, 4, d), DType::F32, &dev)?;
    // (batch, seqlen, 2 kv_heads, d): k heads then v heads in each row.
    let kv = rng.randn((b, s, 2 * hk, d), DType::F32, &dev)?;
    let (k, v) = (kv.narrow(2, 0, hk)?, kv.narrow(2, hk, hk)?);
    assert!(!k.is_contiguous() && !v.is_contiguous());
    let lens = Tensor::new(&[17u32, 0, 40], &dev)?;
    let attn = FlashAttn::new(0.2).causal(true);
    let got = attn.kv_cache(&k, &v, &lens).forward(&q)?;
    let want = attn.kv_cache(&k.contiguous()?, &v.contiguous()?, &lens).forward(&q)?;
    assert_eq!(to_f64_vec(&got)?, to_f64_vec(&want)?);
    assert!(to_f64_vec(&got)?.iter().any(|&x| x != 0.0));
    // An append writes into the views in place: the same output and the same cache values as
    // the call over dense copies, and the rows around the new ones untouched.
    let (kn, vn) = (
        rng.randn((b, 1, hk, d), DType::F32, &dev)?,
        rng.randn((b, 1, hk, d), DType::F32, &dev)?,
    );
    let kv2 = kv.copy()?;
    let (k2, v2) = (kv2.narrow(2, 0, hk)?, kv2.narrow(2, hk, hk)?);
    let lens_short = Tensor::new(&[17u32, 0, 39], &dev)?;
    let call = attn.kv_cache(&k2, &v2, &lens_short).append(&kn, &vn);
    assert!(!call.appends_in_kernel(&q)?, "the CPU appends before it attends");
    let got = call.forward(&q)?;
    let (kd, vd) = (k.contiguous()?, v.contiguous()?);
    let want = attn.kv_cache(&kd, &vd, &lens_short).append(&kn, &vn).forward(&q)?;
    assert_eq!(to_f64_vec(&got)?, to_f64_vec(&want)?);
    assert_eq!(
        to_f64_vec(&k2.contiguous()?)?,
        to_f64_vec(&kd)?,
        "k after a strided append"
    );
    assert_eq!(
        to_f64_vec(&v2.contiguous()?)?,
        to_f64_vec(&vd)?,
        "v after a strided append"
    );
    assert_ne!(to_f64_vec(&kv2)?, to_f64_vec(&kv)?, "nothing appended");
    assert_eq!(
        to_f64_vec(&kv2.i((0, 17))?.contiguous()?)?,
        to_f64_vec(&Tensor::cat(&[kn.i((0, 0))?, vn.i((0, 0))?], 0)?)?
    );
    // Paged views (pages out of order, a page shared by two sequences) read as dense copies do.
    let table = Tensor::new(&[[2u32, 0], [1, 0], [3, 2]], &dev)?;
    let paged = rng.randn((4, 16, 2 * hk, d), DType::F32, &dev)?;
    let (kp, vp) = (paged.narrow(2, 0, hk)?, paged.narrow(2, hk, hk)?);
    let paged_lens = Tensor::new(&[19u32, 5, 32], &dev)?;
    let got = attn.kv_cache(&kp, &vp, &paged_lens).page_table(&table).forward(&q)?;
    let want = attn
        .kv_cache(&kp.contiguous()?, &vp.contiguous()?, &paged_lens)
        .page_table(&table)
        .forward(&q)?;
    assert_eq!(to_f64_vec(&got)?, to_f64_vec(&want)?);
    assert!(to_f64_vec(&got)?.iter().any(|&x| x != 0.0));
    // Any other strides with a dense head dim (heads outermost), and a strided head dim.
    let ks = k.contiguous()?;
    let vt = v.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    assert!(!vt.is_contiguous());
    let got = attn.kv_cache(&ks, &vt, &lens).forward(&q)?;
    let want = attn.kv_cache(&ks, &vt.contiguous()?, &lens).forward(&q)?;
    assert_eq!(to_f64_vec(&got)?, to_f64_vec(&want)?);
    let kt = ks.transpose(2, 3)?.contiguous()?.transpose(2, 3)?;
    assert_err(
        attn.kv_cache(&kt, &vt, &lens).forward(&q),
        &["head dim must be contiguous"],
    );
    // FP8 caches must be dense.
    let kv8 = kv.to_dtype(DType::F8E4M3)?;
    let (k8, v8) = (kv8.narrow(2, 0, hk)?, kv8.narrow(2, hk, hk)?);
    assert_err(
        attn.kv_cache(&k8, &v8, &lens).forward(&q.to_dtype(DType::F8E4M3)?),
        &["an fp8 k_cache must be contiguous"],
    );
    Ok(())
}

#[test]
fn kvcache_errors() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-errors");
    let q = rng.randn((2, 1, 4, 32), DType::F32, &dev)?;
    let kc = rng.randn((2, 32, 2, 32), DType::F32, &dev)?;
    let vc = rng.randn((2, 32, 2, 32), DType::F32, &dev)?;
    let kn = rng.randn((2, 1, 2, 32), DType::F32, &dev)?;
    let lens = Tensor::new(&[3u32, 5], &dev)?;
    let attn = FlashAttn::new(0.1);

    // cache_seqlens past the cache.
    let long = Tensor::new(&[3u32, 32], &dev)?;
    assert_err(
        attn.kv_cache(&kc, &vc, &long).append(&kn, &kn).forward(&q),
        &["its cache holds 32"],
    );
    // cache_seqlens of the wrong dtype and length.
    assert_err(
        attn.kv_cache(&kc, &vc, &lens.to_dtype(DType::I64)?).forward(&q),
        &["cache_seqlens must be a u32"],
    );
    assert_err(
        attn.kv_cache(&kc, &vc, &Tensor::new(&[1u32], &dev)?).forward(&q),
        &["cache_seqlens must be a u32"],
    );
    // Mismatched dtypes, heads, head dims.
    assert_err(
        attn.kv_cache(&kc.to_dtype(DType::BF16)?, &vc, &lens).forward(&q),
        &["k_cache must be F32"],
    );
    let q5 = rng.randn((2, 1, 5, 32), DType::F32, &dev)?;
    assert_err(attn.kv_cache(&kc, &vc, &lens).forward(&q5), &["not a multiple"]);
    let q16 = rng.randn((2, 1, 4, 16), DType::F32, &dev)?;
    assert_err(attn.kv_cache(&kc, &vc, &lens).forward(&q16), &["head dim must be q's"]);
    assert_err(
        attn.kv_cache(&kc, &vc, &lens)
            .append(&kn, &kn.narrow(1, 0, 0)?)
            .forward(&q),
        &["k_new / v_new must be"],
    );
    // cache_batch_idx out of range.
    let idx = Tensor::new(&[1u32, 2], &dev)?;
    assert_err(
        attn.kv_cache(&kc, &vc, &lens).cache_batch_idx(&idx).forward(&q),
        &["cache_batch_idx[1] = 2"],
    );
    // Paged: an unsupported page size, a page index out of range, a table too short, with
    // cache_batch_idx.
    let table = Tensor::new(&[[0u32, 1], [2, 3]], &dev)?;
    let kp24 = rng.randn((4, 24, 2, 32), DType::F32, &dev)?;
    assert_err(
        attn.kv_cache(&kp24, &kp24, &lens).page_table(&table).forward(&q),
        &["page size"],
    );
    let kp = rng.randn((4, 16, 2, 32), DType::F32, &dev)?;
    let bad = Tensor::new(&[[0u32, 1], [4, 3]], &dev)?;
    assert_err(
        attn.kv_cache(&kp, &kp, &lens).page_table(&bad).forward(&q),
        &["page_table[1][0] = 4"],
    );
    let short = Tensor::new(&[3u32, 33], &dev)?;
    assert_err(
        attn.kv_cache(&kp, &kp, &short).page_table(&table).forward(&q),
        &["its cache holds 32"],
    );
    assert_err(
        attn.kv_cache(&kp, &kp, &lens)
            .page_table(&table)
            .cache_batch_idx(&idx)
            .forward(&q),
        &["cache_batch_idx applies to contiguous caches"],
    );
    // Rotary tables too short, or of a bad shape.
    let (cos, sin) = rotary_tables(4, 16)?;
    assert_err(
        attn.kv_cache(&kc, &vc, &lens)
            .append(&kn, &kn)
            .rotary(&cos, &sin, false)
            .forward(&q),
        &["cover 4 positions"],
    );
    let (cos, sin) = rotary_tables(64, 48)?;
    assert_err(
        attn.kv_cache(&kc, &vc, &lens)
            .append(&kn, &kn)
            .rotary(&cos, &sin, false)
            .forward(&q),
        &["rotary_dim <= head_dim"],
    );
    // k without v in the function form; empty q.
    assert_err(
        flash_attn3::flash_attn_with_kvcache(&q, &kc, &vc, Some(&kn), None, &lens, 0.1, false),
        &["pass both or neither"],
    );
    assert_err(attn.kv_cache(&kc, &vc, &lens).forward(&q.narrow(1, 0, 0)?), &["empty"]);
    Ok(())
}

/// FP8 (e4m3) q, caches and new rows with per-head descales, contiguous and paged (shuffled
/// pages): the call equals the f32 call on the dequantised values (the CPU path dequantises
/// exactly and runs the f32 attention), the output rounded once to bf16, the LSE and the caches
/// after the append identical. Then the fp8 errors: rotary, and a cache of another dtype.
#[test]
fn kvcache_fp8_matches_dequantised_f32() -> Result<()> {
    let cpu = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-fp8");
    let (b, sq, sn, h, hk, d) = (3, 3, 2, 4, 2, 32);
    let lens = Tensor::new(&[5u32, 0, 17], &cpu)?;
    let e4m3 = |rng: &mut TestRng, shape: (usize, usize, usize, usize)| rng.randn(shape, DType::F8E4M3, &cpu);
    // Descales (1, heads): one per head, shared by every sequence, so that a dequantised cache
    // is one f32 tensor even where sequences share pages.
    let descale = |rng: &mut TestRng, heads: usize| -> Result<Tensor> {
        let v: Vec<f32> = (0..heads).map(|_| 0.5 + rng.uniform() as f32).collect();
        Tensor::from_vec(v, (1, heads), &cpu)
    };
    let dequantise = |x: &Tensor, descale: &Tensor| -> Result<Tensor> {
        let heads = descale.dim(1)?;
        x.to_dtype(DType::F32)?
            .broadcast_mul(&descale.reshape((1, 1, heads, 1))?)
    };
    for paged in [false, true] {
        let (cache_dims, table) = match paged {
            // Two pages of 16 per sequence, shuffled over a pool of 7.
            true => {
                let pool = rng.permutation(7);
                ((7, 16), Some(Tensor::from_vec(pool[..2 * b].to_vec(), (b, 2), &cpu)?))
            }
            false => ((b, 24), None),
        };
        let (slots, rows) = cache_dims;
        let (q8, k8, v8) = (
            e4m3(&mut rng, (b, sq, h, d))?,
            e4m3(&mut rng, (slots, rows, hk, d))?,
            e4m3(&mut rng, (slots, rows, hk, d))?,
        );
        let (kn8, vn8) = (e4m3(&mut rng, (b, sn, hk, d))?, e4m3(&mut rng, (b, sn, hk, d))?);
        let (dq, dk, dv) = (descale(&mut rng, h)?, descale(&mut rng, hk)?, descale(&mut rng, hk)?);
        let (k32, v32) = (dequantise(&k8, &dk)?, dequantise(&v8, &dv)?);
        let opts = Opts::new(1.0 / (d as f64).sqrt()).causal();

        let fp8 = opts.builder().descale(Some(&dq), Some(&dk), Some(&dv));
        let mut call = fp8.kv_cache(&k8, &v8, &lens).append(&kn8, &vn8);
        let f32_attn = opts.builder();
        let (kn32, vn32) = (dequantise(&kn8, &dk)?, dequantise(&vn8, &dv)?);
        let mut reference = f32_attn.kv_cache(&k32, &v32, &lens).append(&kn32, &vn32);
        if let Some(t) = &table {
            call = call.page_table(t);
            reference = reference.page_table(t);
        }
        let (out, lse) = call.forward_with_lse(&q8)?;
        let (want, want_lse) = reference.forward_with_lse(&dequantise(&q8, &dq)?)?;
        let what = format!("fp8 kvcache paged {paged} seed {}", rng.seed());
        assert_eq!(out.dtype(), DType::BF16, "{what}: out dtype");
        assert_eq!(
            to_f64_vec(&out)?,
            to_f64_vec(&want.to_dtype(DType::BF16)?)?,
            "{what}: out"
        );
        assert_eq!(to_f64_vec(&lse)?, to_f64_vec(&want_lse)?, "{what}: lse");
        assert_eq!(
            to_f64_vec(&dequantise(&k8, &dk)?)?,
            to_f64_vec(&k32)?,
            "{what}: k_cache after the append"
        );
        assert_eq!(
            to_f64_vec(&dequantise(&v8, &dv)?)?,
            to_f64_vec(&v32)?,
            "{what}: v_cache after the append"
        );
    }

    // Errors: rotary on an fp8 cache, an fp8 q over a cache of another dtype.
    let q8 = e4m3(&mut rng, (b, 1, h, d))?;
    let k8 = e4m3(&mut rng, (b, 24, hk, d))?;
    let (cos, sin) = rotary_tables(32, d)?;
    assert_err(
        FlashAttn::new(0.1)
            .kv_cache(&k8, &k8, &lens)
            .rotary(&cos, &sin, false)
            .forward(&q8),
        &["rotary", "fp8"],
    );
    let k16 = k8.to_dtype(DType::BF16)?;
    assert_err(
        FlashAttn::new(0.1).kv_cache(&k16, &k16, &lens).forward(&q8),
        &["k_cache must be F8E4M3"],
    );
    Ok(())
}

/// No sequence holds a key and nothing is appended: every row reads as empty (output 0, LSE
/// -inf; with sinks the head's sink logit), as on the GPU, instead of an "empty input" error from
/// the attention over zero gathered keys (found by a random case of
/// kvcache_contiguous_every_option, seed 16467300756767690483).
#[test]
fn kvcache_every_sequence_empty() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-all-empty");
    let q = rng.randn((2, 3, 4, 32), DType::F32, &dev)?;
    let kc = rng.randn((2, 8, 2, 32), DType::F32, &dev)?;
    let vc = rng.randn((2, 8, 2, 24), DType::F32, &dev)?;
    let lens = Tensor::new(&[0u32, 0], &dev)?;
    let (out, lse) = FlashAttn::new(0.2).kv_cache(&kc, &vc, &lens).forward_with_lse(&q)?;
    assert_eq!(out.dims(), &[2, 3, 4, 24]);
    assert!(to_f64_vec(&out)?.iter().all(|&x| x == 0.0), "out must be 0");
    assert_eq!(lse.dims(), &[2, 4, 3]);
    assert!(
        to_f64_vec(&lse)?.iter().all(|&x| x == f64::NEG_INFINITY),
        "lse must be -inf"
    );
    let sinks = Tensor::new(&[0.5f32, -1.0, 2.0, 0.0], &dev)?;
    let (_, lse) = FlashAttn::new(0.2)
        .sinks(&sinks)
        .kv_cache(&kc, &vc, &lens)
        .forward_with_lse(&q)?;
    let want: Vec<f64> = (0..2)
        .flat_map(|_| [0.5, -1.0, 2.0, 0.0].into_iter().flat_map(|s| [s; 3]))
        .collect();
    assert_eq!(to_f64_vec(&lse)?, want, "lse with sinks");
    Ok(())
}

/// Varlen queries (`KvCacheAttn::varlen_q`, FA3's cu_seqlens_q): sequences with 0, 1 or many
/// queries in one call over contiguous and paged caches, against the f64 reference over each
/// sequence's keys (its queries the last of its keys, bottom-right); then its errors.
#[test]
fn kvcache_varlen_queries() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-kvcache-varlen-q");
    for page_size in [None, Some(16), Some(64)] {
        for opts in [
            Opts::new(0.125).causal(),
            Opts::new(0.1),
            Opts::new(0.09).window(Some(40), Some(0)).softcap(6.0),
        ] {
            let case = Case::random(&mut rng, page_size, false);
            let (b, hk, d, dv, h) = (case.batch, case.kv_heads, case.d, case.dv, case.heads);
            let what = format!("{} opts {opts:?} seed {}", case.describe(), rng.seed());
            // Query counts: none, one (a decode token) or a chunk, at most the keys held.
            let q_lens: Vec<usize> = (0..b)
                .map(|i| match rng.range(0, 3) {
                    0 => 0,
                    1 => case.lens[i].min(1),
                    _ => rng.range(0, case.lens[i] + 1).min(37),
                })
                .collect();
            let total_q: usize = q_lens.iter().sum();
            if total_q == 0 {
                continue;
            }
            let (slots, rows) = case.cache_dims;
            let k_cache = rng.randn((slots, rows, hk, d), DType::F32, &dev)?;
            let v_cache = rng.randn((slots, rows, hk, dv), DType::F32, &dev)?;
            let q = rng.randn((total_q, h, d), DType::F32, &dev)?;
            let (cache_seqlens, page_table, batch_idx) = case.index_tensors(&dev)?;
            let cu = flash_attn3::SeqOffsets::from_lengths(q_lens.iter().copied(), &dev)?;
            let mut call = opts
                .builder()
                .kv_cache(&k_cache, &v_cache, &cache_seqlens)
                .varlen_q(&cu);
            if let Some(pt) = &page_table {
                call = call.page_table(pt);
            }
            if let Some(idx) = &batch_idx {
                call = call.cache_batch_idx(idx);
            }
            let (out, lse) = call.forward_with_lse(&q)?;
            assert_eq!(out.dims(), &[total_q, h, dv], "{what}: out shape");
            assert_eq!(lse.dims(), &[h, total_q], "{what}: lse shape");

            // The reference: each sequence's keys gathered through the host model of the cache.
            let (k_ref, v_ref) = case.gather_keys(&to_f64_vec(&k_cache)?, &to_f64_vec(&v_cache)?, &case.lens)?;
            let q_ref = Tensor::from_vec(to_f64_vec(&q)?, (total_q, h, d), &dev)?;
            let (want, want_lse) = attention_ref_varlen(
                &q_ref,
                &k_ref,
                &v_ref,
                &cumulative(&q_lens),
                &cumulative(&case.lens),
                &opts.reference(),
            )?;
            assert_close(&out, &want, F32_TOL, &format!("{what}: out"))?;
            assert_close(&lse, &want_lse, F32_TOL, &format!("{what}: lse"))?;
        }
    }

    // Errors: q not packed, offsets that do not end at q's tokens or do not match the batch,
    // and the options a varlen call cannot take.
    let kc = rng.randn((2, 32, 2, 32), DType::F32, &dev)?;
    let lens = Tensor::new(&[3u32, 5], &dev)?;
    let cu = flash_attn3::SeqOffsets::new(&[0, 1, 3], &dev)?;
    let attn = FlashAttn::new(0.1);
    let q4 = rng.randn((1, 3, 4, 32), DType::F32, &dev)?;
    assert_err(
        attn.kv_cache(&kc, &kc, &lens).varlen_q(&cu).forward(&q4),
        &["q must be (total_q, heads, head_dim)"],
    );
    let q5 = rng.randn((5, 4, 32), DType::F32, &dev)?;
    assert_err(
        attn.kv_cache(&kc, &kc, &lens).varlen_q(&cu).forward(&q5),
        &["cu_seqlens_q ends at 3 but q holds 5 tokens"],
    );
    let q3 = rng.randn((3, 4, 32), DType::F32, &dev)?;
    let three = flash_attn3::SeqOffsets::new(&[0, 1, 2, 3], &dev)?;
    assert_err(
        attn.kv_cache(&kc, &kc, &lens).varlen_q(&three).forward(&q3),
        &["cache_seqlens must be a u32 tensor of shape [3]"],
    );
    let kn = rng.randn((2, 1, 2, 32), DType::F32, &dev)?;
    assert_err(
        attn.kv_cache(&kc, &kc, &lens)
            .append(&kn, &kn)
            .varlen_q(&cu)
            .forward(&q3),
        &["store the new keys first"],
    );
    Ok(())
}
