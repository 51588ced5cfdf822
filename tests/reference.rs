//! An f64 attention reference written from the definition, and the helpers the CPU and GPU
//! tests share.
//!
//! The reference is deliberately naive: for every (sequence, head, query row) it materialises
//! the scores of the visible keys, applies the softcap, subtracts the row maximum and takes the
//! softmax in f64. Nothing is tiled and nothing is shared with the library, so it checks the
//! library's semantics (mask alignment, softcap, GQA, varlen packing, LSE) as well as its
//! numerics. Gradients are the analytic derivatives of that definition:
//!
//! ```text
//! x_j = q·k_j,  s_j = scale·x_j,  f_j = c·tanh(s_j / c) (or s_j),  p = softmax(f over visible j)
//! o = Σ p_j v_j,            lse = max f + ln Σ exp(f_j - max f)
//! dv_j += p_j dO,           dp_j = dO·v_j,      D = Σ_j p_j dp_j,    df_j = p_j (dp_j - D)
//! dx_j = scale · df_j · (1 - tanh²(s_j / c)) (softcap) or scale · df_j
//! dq += dx_j k_j,           dk_j += dx_j q      (dk, dv summed over the q heads of a GQA group)
//! ```
//!
//! Inputs of any float dtype and device are copied to the CPU and converted to f64 exactly
//! (f16/bf16 → f64 is exact), so a half-precision test compares against the reference of the
//! *same rounded* inputs. Outputs are f64 CPU tensors.
//!
//! Randomness: [`TestRng`] is a small seeded generator (splitmix64 + Box–Muller) rather than
//! candle's `Tensor::randn`, whose CPU generator cannot be seeded. Every test draws a fresh seed
//! (time ⊕ a counter) and prints it; `FA3_TEST_SEED=<seed>` replays a failing run.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{bail, DType, Device, Result, Tensor, Var};

// ------------------------------------------------------------------------------------------
// Options and masks
// ------------------------------------------------------------------------------------------

/// The options of one test call, in the library's f32: [`Opts::builder`] gives the call and
/// [`Opts::reference`] the same options (the same rounded values) for the f64 reference.
#[derive(Debug, Clone, Copy)]
pub struct Opts {
    pub scale: f32,
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub softcap: Option<f32>,
    /// How the GPU schedules the call (the reference ignores it): to reach a kernel that the
    /// default choice keeps for larger calls.
    pub tuning: flash_attn3::Tuning,
}

impl Opts {
    pub fn new(scale: f64) -> Self {
        Self {
            scale: scale as f32,
            left: None,
            right: None,
            softcap: None,
            tuning: flash_attn3::Tuning::default(),
        }
    }
    pub fn tuned(self, tuning: flash_attn3::Tuning) -> Self {
        Self { tuning, ..self }
    }
    pub fn causal(self) -> Self {
        Self { right: Some(0), ..self }
    }
    /// `causal()` when `causal` is true, else unchanged.
    pub fn causal_if(self, causal: bool) -> Self {
        if causal {
            self.causal()
        } else {
            self
        }
    }
    pub fn window(self, left: Option<usize>, right: Option<usize>) -> Self {
        Self { left, right, ..self }
    }
    pub fn softcap(self, cap: f32) -> Self {
        Self {
            softcap: Some(cap),
            ..self
        }
    }
    pub fn builder(&self) -> flash_attn3::FlashAttn {
        let fa = flash_attn3::FlashAttn::new(self.scale)
            .window(self.left, self.right)
            .tuning(self.tuning);
        match self.softcap {
            Some(cap) => fa.softcap(cap),
            None => fa,
        }
    }
    pub fn reference(&self) -> RefOptions {
        let r = RefOptions::new(self.scale as f64).window(self.left, self.right);
        match self.softcap {
            Some(cap) => r.softcap(cap as f64),
            None => r,
        }
    }
}

/// What the reference computes: the same options as `flash_attn3::FlashAttn`, in f64.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RefOptions {
    /// Multiplies q·k before the softcap and the softmax.
    pub softmax_scale: f64,
    /// Keys more than this many positions left of the query's diagonal are masked (None: unbounded).
    pub window_left: Option<usize>,
    /// Keys more than this many positions right of the query's diagonal are masked (None: unbounded).
    pub window_right: Option<usize>,
    /// `s -> c·tanh(s / c)` before the softmax.
    pub softcap: Option<f64>,
    /// Attention sinks: one logit per q head that joins every row's softmax denominator (and
    /// never the output). `'static` keeps the options `Copy`: tests leak their small tables
    /// ([`RefOptions::sinks`]).
    pub sinks: Option<&'static [f64]>,
}

impl RefOptions {
    /// Unmasked, uncapped attention scaled by `softmax_scale`.
    pub fn new(softmax_scale: f64) -> Self {
        Self {
            softmax_scale,
            window_left: None,
            window_right: None,
            softcap: None,
            sinks: None,
        }
    }

    /// Unmasked attention with the usual scale `1 / sqrt(head_dim)`.
    pub fn for_head_dim(head_dim: usize) -> Self {
        Self::new(1.0 / (head_dim as f64).sqrt())
    }

    /// Causal attention: the right window becomes 0 (the left one is kept).
    pub fn causal(mut self, causal: bool) -> Self {
        if causal {
            self.window_right = Some(0);
        }
        self
    }

    /// Sets both window sides as given (no interaction with an earlier `causal`).
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_left = left;
        self.window_right = right;
        self
    }

    pub fn softcap(mut self, cap: f64) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// Attention sinks, one logit per q head, as the op takes them (f32; leaked: the table
    /// lives for the test process).
    pub fn sinks(mut self, sinks: &[f32]) -> Self {
        let wide: Vec<f64> = sinks.iter().map(|&x| x as f64).collect();
        self.sinks = Some(Box::leak(wide.into_boxed_slice()));
        self
    }

    /// Whether query `i` of a sequence of `seqlen_q` queries sees key `j` of `seqlen_k` keys,
    /// straight from the definition: the diagonal of query `i` is key `i + seqlen_k - seqlen_q`
    /// and the window keeps keys `[diag - left, diag + right]`.
    pub fn sees(&self, i: usize, j: usize, seqlen_q: usize, seqlen_k: usize) -> bool {
        if j >= seqlen_k {
            return false;
        }
        let diag = i as i64 + seqlen_k as i64 - seqlen_q as i64;
        let j = j as i64;
        let left_ok = self.window_left.is_none_or(|l| j >= diag - l as i64);
        let right_ok = self.window_right.is_none_or(|r| j <= diag + r as i64);
        left_ok && right_ok
    }

    /// The score the softmax sees for a raw product `x = q·k`.
    fn score(&self, x: f64) -> f64 {
        let s = x * self.softmax_scale;
        match self.softcap {
            Some(c) => c * (s / c).tanh(),
            None => s,
        }
    }

    /// d score / d x.
    fn score_derivative(&self, x: f64) -> f64 {
        match self.softcap {
            Some(c) => {
                let t = (x * self.softmax_scale / c).tanh();
                self.softmax_scale * (1.0 - t * t)
            }
            None => self.softmax_scale,
        }
    }
}

// ------------------------------------------------------------------------------------------
// Packed f64 data
// ------------------------------------------------------------------------------------------

/// A (tokens, heads, dim) tensor as a contiguous f64 vector.
struct Packed {
    data: Vec<f64>,
    heads: usize,
    dim: usize,
}

impl Packed {
    fn new(t: &Tensor, tokens: usize, heads: usize, dim: usize) -> Result<Self> {
        let data = to_f64_vec(t)?;
        assert_eq!(data.len(), tokens * heads * dim);
        Ok(Self { data, heads, dim })
    }

    fn row(&self, token: usize, head: usize) -> &[f64] {
        let start = (token * self.heads + head) * self.dim;
        &self.data[start..start + self.dim]
    }
}

/// Any tensor as a flat f64 vector in logical (row-major) order, read on the CPU.
pub fn to_f64_vec(t: &Tensor) -> Result<Vec<f64>> {
    let t = t.to_device(&Device::Cpu)?;
    // candle 0.11.1's CPU cast from f8e4m3 to f64 never returns (its `to_f64` for e4m3 calls
    // itself); through f32 is exact.
    let t = match t.dtype() {
        DType::F8E4M3 => t.to_dtype(DType::F32)?,
        _ => t,
    };
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    // Four partial sums: the same value to f64 rounding, several times faster than one chain.
    let mut acc = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// The problem sizes the reference works on: sequences packed along the token axis.
struct Sizes {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    head_dim_v: usize,
    total_q: usize,
    total_k: usize,
}

fn check_sizes(q: &Tensor, k: &Tensor, v: &Tensor, cu_q: &[usize], cu_k: &[usize]) -> Result<Sizes> {
    let (total_q, heads, head_dim) = q.dims3()?;
    let (total_k, kv_heads, kd) = k.dims3()?;
    let (vt, vh, head_dim_v) = v.dims3()?;
    if kd != head_dim || vt != total_k || vh != kv_heads || kv_heads == 0 || heads % kv_heads != 0 {
        bail!(
            "reference: bad shapes q {:?} k {:?} v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if cu_q.len() != cu_k.len() || cu_q.is_empty() || cu_q[0] != 0 || cu_k[0] != 0 {
        bail!("reference: bad cumulative lengths {cu_q:?} {cu_k:?}")
    }
    if cu_q.windows(2).any(|w| w[1] < w[0]) || cu_k.windows(2).any(|w| w[1] < w[0]) {
        bail!("reference: decreasing cumulative lengths {cu_q:?} {cu_k:?}")
    }
    if *cu_q.last().unwrap() != total_q || *cu_k.last().unwrap() != total_k {
        bail!("reference: cumulative lengths {cu_q:?} {cu_k:?} do not end at {total_q} / {total_k}")
    }
    Ok(Sizes {
        heads,
        kv_heads,
        head_dim,
        head_dim_v,
        total_q,
        total_k,
    })
}

/// The softmax of one query row over its visible keys.
struct RowSoftmax {
    /// Sequence-local indices of the visible keys.
    keys: Vec<usize>,
    /// Raw products q·k of those keys.
    raw: Vec<f64>,
    probs: Vec<f64>,
    /// The sink's share of the row (0 without sinks).
    sink_prob: f64,
    /// `-inf` when no key is visible (and no sink).
    lse: f64,
}

/// The softmax of query `i` (packed token `tq`) of a sequence whose keys start at packed `tk0`.
#[allow(clippy::too_many_arguments)]
fn row_softmax(
    q: &Packed,
    k: &Packed,
    opts: &RefOptions,
    (tq, i, len_q): (usize, usize, usize),
    (tk0, len_k): (usize, usize),
    head: usize,
    kv_head: usize,
) -> RowSoftmax {
    let keys: Vec<usize> = (0..len_k).filter(|&j| opts.sees(i, j, len_q, len_k)).collect();
    let qrow = q.row(tq, head);
    let raw: Vec<f64> = keys.iter().map(|&j| dot(qrow, k.row(tk0 + j, kv_head))).collect();
    let sink = opts.sinks.map(|s| s[head]);
    if keys.is_empty() {
        return RowSoftmax {
            keys,
            raw,
            probs: Vec::new(),
            sink_prob: if sink.is_some() { 1.0 } else { 0.0 },
            lse: sink.unwrap_or(f64::NEG_INFINITY),
        };
    }
    let scores: Vec<f64> = raw.iter().map(|&x| opts.score(x)).collect();
    // The sink is one more logit in the denominator, with no value row.
    let max = scores.iter().cloned().chain(sink).fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|&s| (s - max).exp()).collect();
    let sink_exp = sink.map_or(0.0, |s| (s - max).exp());
    let sum: f64 = exps.iter().sum::<f64>() + sink_exp;
    let probs = exps.iter().map(|e| e / sum).collect();
    RowSoftmax {
        keys,
        raw,
        probs,
        sink_prob: sink_exp / sum,
        lse: max + sum.ln(),
    }
}

/// Forward over packed inputs: out (total_q · h · dv) and lse (h · total_q).
fn forward_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[usize],
    cu_k: &[usize],
    opts: &RefOptions,
) -> Result<(Vec<f64>, Vec<f64>, Sizes)> {
    let sz = check_sizes(q, k, v, cu_q, cu_k)?;
    let (qp, kp, vp) = (
        Packed::new(q, sz.total_q, sz.heads, sz.head_dim)?,
        Packed::new(k, sz.total_k, sz.kv_heads, sz.head_dim)?,
        Packed::new(v, sz.total_k, sz.kv_heads, sz.head_dim_v)?,
    );
    let group = sz.heads / sz.kv_heads;
    let dv = sz.head_dim_v;
    let mut out = vec![0f64; sz.total_q * sz.heads * dv];
    let mut lse = vec![f64::NEG_INFINITY; sz.heads * sz.total_q];
    for b in 0..cu_q.len() - 1 {
        let (len_q, len_k) = (cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]);
        for h in 0..sz.heads {
            let kv_head = h / group;
            for i in 0..len_q {
                let tq = cu_q[b] + i;
                let row = row_softmax(&qp, &kp, opts, (tq, i, len_q), (cu_k[b], len_k), h, kv_head);
                lse[h * sz.total_q + tq] = row.lse;
                let o = &mut out[(tq * sz.heads + h) * dv..(tq * sz.heads + h + 1) * dv];
                for (&j, &p) in row.keys.iter().zip(&row.probs) {
                    for (o, &x) in o.iter_mut().zip(vp.row(cu_k[b] + j, kv_head)) {
                        *o += p * x;
                    }
                }
            }
        }
    }
    Ok((out, lse, sz))
}

/// dq, dk, dv as flat vectors in the packed layouts, and d(sinks) per q head (zeros without
/// sinks).
type FlatGrads = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// Gradients over packed inputs.
#[allow(clippy::too_many_arguments)]
fn grads_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    cu_q: &[usize],
    cu_k: &[usize],
    opts: &RefOptions,
) -> Result<(FlatGrads, Sizes)> {
    let sz = check_sizes(q, k, v, cu_q, cu_k)?;
    let (d, dv) = (sz.head_dim, sz.head_dim_v);
    let (qp, kp, vp) = (
        Packed::new(q, sz.total_q, sz.heads, d)?,
        Packed::new(k, sz.total_k, sz.kv_heads, d)?,
        Packed::new(v, sz.total_k, sz.kv_heads, dv)?,
    );
    if dout.elem_count() != sz.total_q * sz.heads * dv {
        bail!(
            "reference: dout {:?} does not match the output of q {:?}, v {:?}",
            dout.dims(),
            q.dims(),
            v.dims()
        )
    }
    let gp = Packed::new(dout, sz.total_q, sz.heads, dv)?;
    let group = sz.heads / sz.kv_heads;
    let mut dq = vec![0f64; sz.total_q * sz.heads * d];
    let mut dk = vec![0f64; sz.total_k * sz.kv_heads * d];
    let mut dvv = vec![0f64; sz.total_k * sz.kv_heads * dv];
    let mut dsinks = vec![0f64; sz.heads];
    for b in 0..cu_q.len() - 1 {
        let (len_q, len_k) = (cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]);
        for h in 0..sz.heads {
            let kv_head = h / group;
            for i in 0..len_q {
                let tq = cu_q[b] + i;
                let row = row_softmax(&qp, &kp, opts, (tq, i, len_q), (cu_k[b], len_k), h, kv_head);
                let g = gp.row(tq, h);
                let dp: Vec<f64> = row.keys.iter().map(|&j| dot(g, vp.row(cu_k[b] + j, kv_head))).collect();
                let delta: f64 = row.probs.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                // The sink's logit moves only the denominator: d/d sink = p_sink · (0 - delta).
                dsinks[h] -= row.sink_prob * delta;
                let qrow = qp.row(tq, h);
                for (n, &j) in row.keys.iter().enumerate() {
                    let tk = cu_k[b] + j;
                    let p = row.probs[n];
                    let dvrow = &mut dvv[(tk * sz.kv_heads + kv_head) * dv..(tk * sz.kv_heads + kv_head + 1) * dv];
                    for (x, &gy) in dvrow.iter_mut().zip(g) {
                        *x += p * gy;
                    }
                    let dx = p * (dp[n] - delta) * opts.score_derivative(row.raw[n]);
                    let krow = kp.row(tk, kv_head);
                    let dqrow = &mut dq[(tq * sz.heads + h) * d..(tq * sz.heads + h + 1) * d];
                    for (x, &kv) in dqrow.iter_mut().zip(krow) {
                        *x += dx * kv;
                    }
                    let dkrow = &mut dk[(tk * sz.kv_heads + kv_head) * d..(tk * sz.kv_heads + kv_head + 1) * d];
                    for (x, &qv) in dkrow.iter_mut().zip(qrow) {
                        *x += dx * qv;
                    }
                }
            }
        }
    }
    Ok(((dq, dk, dvv, dsinks), sz))
}

/// Cumulative offsets of `batch` sequences of `len` tokens each.
fn uniform_cu(batch: usize, len: usize) -> Vec<usize> {
    (0..=batch).map(|b| b * len).collect()
}

/// Reshapes fixed-length (b, s, h, d) inputs to packed (b·s, h, d).
fn pack4(t: &Tensor) -> Result<Tensor> {
    let (b, s, h, d) = t.dims4()?;
    t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.reshape((b * s, h, d))
}

// ------------------------------------------------------------------------------------------
// The reference API
// ------------------------------------------------------------------------------------------

/// Attention of q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), any float dtype/device.
/// Returns out (b, sq, h, dv) and lse (b, h, sq), both f64 on the CPU.
pub fn attention_ref(q: &Tensor, k: &Tensor, v: &Tensor, opts: &RefOptions) -> Result<(Tensor, Tensor)> {
    let (b, sq, h, _) = q.dims4()?;
    let (kb, sk, _, _) = k.dims4()?;
    let dv = v.dim(3)?;
    if kb != b {
        bail!("reference: batch of q {:?} and k {:?} differ", q.dims(), k.dims())
    }
    let (out, lse, _) = forward_packed(
        &pack4(q)?,
        &pack4(k)?,
        &pack4(v)?,
        &uniform_cu(b, sq),
        &uniform_cu(b, sk),
        opts,
    )?;
    let out = Tensor::from_vec(out, (b, sq, h, dv), &Device::Cpu)?;
    let lse = Tensor::from_vec(lse, (h, b, sq), &Device::Cpu)?
        .transpose(0, 1)?
        .contiguous()?;
    Ok((out, lse))
}

/// Varlen attention: q (total_q, h, d), k (total_k, hk, d), v (total_k, hk, dv) packed by the
/// cumulative offsets `cu_q`, `cu_k` (batch + 1 entries each). Returns out (total_q, h, dv) and
/// lse (h, total_q), f64 on the CPU.
pub fn attention_ref_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[usize],
    cu_k: &[usize],
    opts: &RefOptions,
) -> Result<(Tensor, Tensor)> {
    let (out, lse, sz) = forward_packed(q, k, v, cu_q, cu_k, opts)?;
    let out = Tensor::from_vec(out, (sz.total_q, sz.heads, sz.head_dim_v), &Device::Cpu)?;
    let lse = Tensor::from_vec(lse, (sz.heads, sz.total_q), &Device::Cpu)?;
    Ok((out, lse))
}

/// Analytic gradients of `sum(out ∘ dout)` with respect to q, k and v (fixed-length shapes),
/// f64 on the CPU, shaped like q, k and v.
pub fn attention_grads_ref(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    opts: &RefOptions,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (grads, _) = attention_grads_ref_with_sinks(q, k, v, dout, opts)?;
    Ok(grads)
}

/// [`attention_grads_ref`] and the gradient of the sinks of `opts` (heads,), zeros without.
pub fn attention_grads_ref_with_sinks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    opts: &RefOptions,
) -> Result<((Tensor, Tensor, Tensor), Tensor)> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let dv = v.dim(3)?;
    let ((dq, dk, dvv, dsinks), _) = grads_packed(
        &pack4(q)?,
        &pack4(k)?,
        &pack4(v)?,
        &pack4(dout)?,
        &uniform_cu(b, sq),
        &uniform_cu(b, sk),
        opts,
    )?;
    let cpu = Device::Cpu;
    Ok((
        (
            Tensor::from_vec(dq, (b, sq, h, d), &cpu)?,
            Tensor::from_vec(dk, (b, sk, hk, d), &cpu)?,
            Tensor::from_vec(dvv, (b, sk, hk, dv), &cpu)?,
        ),
        Tensor::from_vec(dsinks, h, &cpu)?,
    ))
}

/// The varlen form of [`attention_grads_ref`]: packed shapes, cumulative offsets.
pub fn attention_grads_ref_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    cu_q: &[usize],
    cu_k: &[usize],
    opts: &RefOptions,
) -> Result<(Tensor, Tensor, Tensor)> {
    let ((dq, dk, dvv, _), sz) = grads_packed(q, k, v, dout, cu_q, cu_k, opts)?;
    let cpu = Device::Cpu;
    Ok((
        Tensor::from_vec(dq, (sz.total_q, sz.heads, sz.head_dim), &cpu)?,
        Tensor::from_vec(dk, (sz.total_k, sz.kv_heads, sz.head_dim), &cpu)?,
        Tensor::from_vec(dvv, (sz.total_k, sz.kv_heads, sz.head_dim_v), &cpu)?,
    ))
}

// ------------------------------------------------------------------------------------------
// Comparison
// ------------------------------------------------------------------------------------------

/// The error of `got` against `want`: `max_i |got_i - want_i| / max(max_i |want_i|, 1e-6)`
/// over the finite entries of `want` — an error relative to the tensor's scale, so entries
/// near zero (which attention outputs and gradients have plenty of) do not blow it up.
///
/// Non-finite values never pass silently: a NaN on either side is an error, and an infinite
/// entry of `want` (the `-inf` LSE of a row that sees no key) must be matched exactly
/// (same sign) by `got`, as must every infinite entry of `got`. Shapes must be equal.
/// Returns the error, or an `Err` describing the first non-finite mismatch.
pub fn relative_error(got: &Tensor, want: &Tensor) -> Result<f64> {
    relative_error_with_floor(got, want, 1e-6)
}

/// [`relative_error`] with the scale floored at `floor` instead of 1e-6: for a tensor that is
/// legitimately (near) zero, such as dq when every query sees one key, whose error is better
/// measured against the scale of related tensors (the other gradients).
pub fn relative_error_with_floor(got: &Tensor, want: &Tensor, floor: f64) -> Result<f64> {
    if got.dims() != want.dims() {
        bail!("shape mismatch: got {:?}, want {:?}", got.dims(), want.dims())
    }
    let (g, w) = (to_f64_vec(got)?, to_f64_vec(want)?);
    let dims = want.dims().to_vec();
    let mut max_diff = 0f64;
    let mut scale = 0f64;
    for (n, (&g, &w)) in g.iter().zip(&w).enumerate() {
        if g.is_nan() || w.is_nan() || ((g.is_infinite() || w.is_infinite()) && g != w) {
            bail!("non-finite mismatch at {:?}: got {g}, want {w}", unravel(n, &dims))
        }
        if w.is_finite() {
            max_diff = max_diff.max((g - w).abs());
            scale = scale.max(w.abs());
        }
    }
    Ok(max_diff / scale.max(floor))
}

/// The largest finite `|x|` of a tensor (0 for an empty one).
pub fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(to_f64_vec(t)?
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs())))
}

/// Fails unless [`relative_error`]`(got, want) <= rel_tol`; the message names `what`, the
/// error, the worst element and its index.
pub fn assert_close(got: &Tensor, want: &Tensor, rel_tol: f64, what: &str) -> Result<()> {
    assert_close_with_floor(got, want, rel_tol, 1e-6, what)
}

/// [`assert_close`] with the scale floored at `floor` (see [`relative_error_with_floor`]).
pub fn assert_close_with_floor(got: &Tensor, want: &Tensor, rel_tol: f64, floor: f64, what: &str) -> Result<()> {
    let err = match relative_error_with_floor(got, want, floor) {
        Ok(err) => err,
        Err(e) => bail!("{what}: {e}"),
    };
    if err > rel_tol {
        let (g, w) = (to_f64_vec(got)?, to_f64_vec(want)?);
        let (worst, diff) = g
            .iter()
            .zip(&w)
            .map(|(g, w)| if w.is_finite() { (g - w).abs() } else { 0.0 })
            .enumerate()
            .fold((0, -1.0), |acc, (n, d)| if d > acc.1 { (n, d) } else { acc });
        bail!(
            "{what}: relative error {err:.3e} > {rel_tol:.1e} (shape {:?}); worst at {:?}: got {}, want {} (|diff| {diff:.3e})",
            want.dims(),
            unravel(worst, want.dims()),
            g[worst],
            w[worst]
        )
    }
    Ok(())
}

/// Three gradients (dq, dk, dv).
pub type Grads = (Tensor, Tensor, Tensor);

/// dq, dk, dv of `sum(f(q, k, v) ∘ w)` through candle's autograd. `before_backward` runs between
/// the forward and the backward (the GPU tests fill freed allocator memory with NaN there, so
/// that a gradient element the kernels forget to write fails).
pub fn autograd(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    w: &Tensor,
    before_backward: impl FnOnce() -> Result<()>,
) -> Result<Grads> {
    let (qv, kv, vv) = (Var::from_tensor(q)?, Var::from_tensor(k)?, Var::from_tensor(v)?);
    let out = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
    before_backward()?;
    let loss = (out * w)?.sum_all()?;
    let grads = loss.backward()?;
    let get = |x: &Var, name: &str| match grads.get(x.as_tensor()) {
        Some(g) => Ok(g.clone()),
        None => bail!("no gradient for {name}"),
    };
    Ok((get(&qv, "q")?, get(&kv, "k")?, get(&vv, "v")?))
}

/// Checks three gradients against the reference's, each relative to its own scale floored at the
/// largest of the three: dq (or dk) is legitimately ~0 when every query sees a single key (p = 1,
/// dS = 0), and its round-off is then measured against the gradients' scale rather than against
/// 0. Returns the largest of the three errors (for the log).
pub fn check_grads(got: &Grads, want: &Grads, rel_tol: f64, what: &str) -> Result<f64> {
    let floor = max_abs(&want.0)?
        .max(max_abs(&want.1)?)
        .max(max_abs(&want.2)?)
        .max(1e-6);
    let mut worst = 0f64;
    for (name, g, w) in [
        ("dq", &got.0, &want.0),
        ("dk", &got.1, &want.1),
        ("dv", &got.2, &want.2),
    ] {
        if g.dims() != w.dims() {
            bail!("{what}: {name} shape {:?} != {:?}", g.dims(), w.dims())
        }
        assert_close_with_floor(g, w, rel_tol, floor, &format!("{what}: {name}"))?;
        worst = worst.max(relative_error_with_floor(g, w, floor)?);
    }
    Ok(worst)
}

/// Fails unless `result` is an error whose message contains every one of `needles`.
#[track_caller]
pub fn assert_err<T: std::fmt::Debug>(result: Result<T>, needles: &[&str]) {
    match result {
        Ok(value) => panic!("expected an error mentioning {needles:?}, got Ok({value:?})"),
        Err(err) => {
            let msg = err.to_string();
            for needle in needles {
                assert!(msg.contains(needle), "the error should mention {needle:?}: {msg}");
            }
        }
    }
}

/// Fails unless the two tensors are bit-for-bit equal (same shape, dtype and values; NaN
/// never equal).
pub fn assert_identical(got: &Tensor, want: &Tensor, what: &str) -> Result<()> {
    if got.dtype() != want.dtype() {
        bail!("{what}: dtype {:?} != {:?}", got.dtype(), want.dtype())
    }
    if got.dims() != want.dims() {
        bail!("{what}: shape {:?} != {:?}", got.dims(), want.dims())
    }
    let (g, w) = (to_f64_vec(got)?, to_f64_vec(want)?);
    if let Some(n) = g.iter().zip(&w).position(|(g, w)| g != w) {
        bail!("{what}: differs at {:?}: {} vs {}", unravel(n, want.dims()), g[n], w[n])
    }
    Ok(())
}

fn unravel(mut n: usize, dims: &[usize]) -> Vec<usize> {
    let mut index = vec![0; dims.len()];
    for (i, &d) in dims.iter().enumerate().rev() {
        if d > 0 {
            index[i] = n % d;
            n /= d;
        }
    }
    index
}

// ------------------------------------------------------------------------------------------
// Random inputs
// ------------------------------------------------------------------------------------------

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A small seeded generator (splitmix64) for reproducible random tests.
#[derive(Debug, Clone)]
pub struct TestRng {
    seed: u64,
    state: u64,
    spare_normal: Option<f64>,
}

impl TestRng {
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            state: seed,
            spare_normal: None,
        }
    }

    /// A fresh generator: the seed comes from `FA3_TEST_SEED` when set, else from the clock and
    /// a process-wide counter (so two generators never share a seed). The seed is printed with
    /// `label`; the test harness shows it when the test fails.
    pub fn fresh(label: &str) -> Self {
        let seed = match std::env::var("FA3_TEST_SEED").ok().and_then(|s| s.parse::<u64>().ok()) {
            Some(seed) => seed,
            None => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0);
                let count = COUNTER.fetch_add(1, Ordering::Relaxed);
                splitmix(nanos ^ count.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            }
        };
        eprintln!("{label}: seed {seed} (replay with FA3_TEST_SEED={seed})");
        Self::new(seed)
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix(self.state)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        assert!(lo <= hi);
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.range(0, items.len() - 1)]
    }

    pub fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }

    /// 0..n in a random order (Fisher–Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            v.swap(i, self.range(0, i));
        }
        v
    }

    /// A standard normal sample (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        if let Some(x) = self.spare_normal.take() {
            return x;
        }
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        self.spare_normal = Some(r * theta.sin());
        r * theta.cos()
    }

    /// A length in `lo..=hi` that is not a multiple of 64 (so neither of 256): the CPU
    /// tiles are 64 queries × 256 keys and GPU tiles are multiples of 64, so odd lengths
    /// leave partial tiles everywhere.
    pub fn odd_len(&mut self, lo: usize, hi: usize) -> usize {
        let n = self.range(lo, hi);
        if n % 64 == 0 {
            if n > lo {
                n - 1
            } else {
                n + 1
            }
        } else {
            n
        }
    }

    /// Standard normal values times `std`, drawn in f64, rounded to `dtype` (f32, f16, bf16,
    /// f64) on `device`.
    pub fn randn_scaled(
        &mut self,
        shape: impl Into<candle_core::Shape>,
        std: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let data: Vec<f64> = (0..shape.elem_count()).map(|_| self.normal() * std).collect();
        Tensor::from_vec(data, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    }

    /// Standard normal values in `dtype` on `device`.
    pub fn randn(&mut self, shape: impl Into<candle_core::Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        self.randn_scaled(shape, 1.0, dtype, device)
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sizes of one fixed-length attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
}

impl AttnShape {
    /// (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v).
    pub fn new(
        (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v): (
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
        ),
    ) -> Self {
        Self {
            batch,
            seqlen_q,
            seqlen_k,
            heads,
            kv_heads,
            head_dim,
            head_dim_v,
        }
    }

    pub fn q_shape(&self) -> (usize, usize, usize, usize) {
        (self.batch, self.seqlen_q, self.heads, self.head_dim)
    }

    pub fn k_shape(&self) -> (usize, usize, usize, usize) {
        (self.batch, self.seqlen_k, self.kv_heads, self.head_dim)
    }

    pub fn v_shape(&self) -> (usize, usize, usize, usize) {
        (self.batch, self.seqlen_k, self.kv_heads, self.head_dim_v)
    }

    pub fn out_shape(&self) -> (usize, usize, usize, usize) {
        (self.batch, self.seqlen_q, self.heads, self.head_dim_v)
    }

    /// Multiply-adds of the naive reference (b · h · sq · sk · (d + dv)): a budget for test sizes.
    pub fn cost(&self) -> usize {
        self.batch * self.heads * self.seqlen_q * self.seqlen_k * (self.head_dim + self.head_dim_v)
    }

    /// The usual softmax scale, `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// Random standard-normal q, k, v of this shape.
    pub fn random_qkv(&self, rng: &mut TestRng, dtype: DType, device: &Device) -> Result<(Tensor, Tensor, Tensor)> {
        Ok((
            rng.randn(self.q_shape(), dtype, device)?,
            rng.randn(self.k_shape(), dtype, device)?,
            rng.randn(self.v_shape(), dtype, device)?,
        ))
    }

    /// A random shape: odd seqlens in `seqlen_range`, a head dim from `head_dims` (head_dim_v
    /// equal to it half of the time, else another one from the list), a GQA ratio from
    /// `gqa_ratios`, 1–4 kv heads / ratio, batch 1–3.
    pub fn random(rng: &mut TestRng, seqlen_range: (usize, usize), head_dims: &[usize], gqa_ratios: &[usize]) -> Self {
        let head_dim = rng.pick(head_dims);
        let head_dim_v = if rng.coin() { head_dim } else { rng.pick(head_dims) };
        let ratio = rng.pick(gqa_ratios);
        let kv_heads = rng.range(1, (4 / ratio).max(1));
        Self {
            batch: rng.range(1, 3),
            seqlen_q: rng.odd_len(seqlen_range.0, seqlen_range.1),
            seqlen_k: rng.odd_len(seqlen_range.0, seqlen_range.1),
            heads: kv_heads * ratio,
            kv_heads,
            head_dim,
            head_dim_v,
        }
    }
}

/// Cumulative offsets (batch + 1 entries) of sequences of the given lengths.
pub fn cumulative(lengths: &[usize]) -> Vec<usize> {
    let mut cu = vec![0];
    for &l in lengths {
        cu.push(cu.last().unwrap() + l);
    }
    cu
}

/// Cumulative offsets as the rank-1 u32 tensor the varlen API takes.
pub fn seqlens_tensor(cu: &[usize], device: &Device) -> Result<Tensor> {
    let cu: Vec<u32> = cu.iter().map(|&x| x as u32).collect();
    Tensor::from_vec(cu.clone(), cu.len(), device)
}

/// The longest sequence described by cumulative offsets.
pub fn max_len(cu: &[usize]) -> usize {
    cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
}

/// The naive candle composite: softmax(q·kᵀ·scale [+ causal mask]) · v with differentiable candle
/// ops (candle_nn's composite `softmax`: `softmax_last_dim` has no backward); kv heads broadcast for
/// GQA. Needs sq <= sk when causal (every row must see a key).
pub fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let (_, sq, h, _) = q.dims4()?;
    let sk = k.dim(1)?;
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let (b, s, hk, d) = t.dims4()?;
        t.unsqueeze(3)?
            .broadcast_as((b, s, hk, h / hk, d))?
            .reshape((b, s, h, d))
    };
    let (q, k, v) = (q.transpose(1, 2)?.contiguous()?, repeat(k)?, repeat(v)?);
    let (k, v) = (k.transpose(1, 2)?.contiguous()?, v.transpose(1, 2)?.contiguous()?);
    let mut s = (q.matmul(&k.t()?)? * scale)?;
    if causal {
        let mask: Vec<f32> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| if j + sq > i + sk { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        s = s.broadcast_add(&Tensor::from_vec(mask, (sq, sk), q.device())?)?;
    }
    let p = candle_nn::ops::softmax(&s, candle_core::D::Minus1)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous()
}

// ------------------------------------------------------------------------------------------
// Attention sinks
// ------------------------------------------------------------------------------------------

/// Tolerances of [`check_sinks`]: output, LSE, gradients (None: forward only).
#[derive(Debug, Clone, Copy)]
pub struct SinkTols {
    pub out: f64,
    pub lse: f64,
    pub grad: Option<f64>,
}

/// Random sink logits for `heads` heads: N(0, 2), and one head (when there are several) whose
/// sink dominates its rows (logit 12: the keys keep a few percent of the weight or less).
pub fn random_sinks(rng: &mut TestRng, heads: usize) -> Vec<f32> {
    let mut s: Vec<f32> = (0..heads).map(|_| (2.0 * rng.normal()) as f32).collect();
    if heads > 1 {
        s[rng.range(0, heads - 1)] = 12.0;
    }
    s
}

/// One fixed-length call with attention sinks on `dev` against the f64 reference: out and LSE,
/// then (with `tols.grad`) dq, dk, dv and d(sinks) through `loss.backward()` of
/// sum(out ∘ w). `splits`: the builder's num_splits (0: per call).
#[allow(clippy::too_many_arguments)]
pub fn check_sinks(
    rng: &mut TestRng,
    dev: &Device,
    dtype: DType,
    shape: AttnShape,
    opts: Opts,
    splits: usize,
    tols: SinkTols,
    what: &str,
) -> Result<()> {
    let what = format!("{what} {shape:?} {opts:?} splits {splits} seed {}", rng.seed());
    let q = rng.randn(shape.q_shape(), dtype, dev)?;
    let k = rng.randn(shape.k_shape(), dtype, dev)?;
    let v = rng.randn(shape.v_shape(), dtype, dev)?;
    let vals = random_sinks(rng, shape.heads);
    let reference = opts.reference().sinks(&vals);
    let sinks = Var::from_tensor(&Tensor::new(vals.as_slice(), dev)?)?;
    let attn = opts.builder().num_splits(splits).sinks(sinks.as_tensor());

    let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
    let (want, want_lse) = attention_ref(&q, &k, &v, &reference)?;
    assert_close(&out, &want, tols.out, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, tols.lse, &format!("{what}: lse"))?;

    let Some(grad_tol) = tols.grad else { return Ok(()) };
    let w = rng.randn(shape.out_shape(), dtype, dev)?;
    let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let out = attn.forward(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
    let grads = (out * &w)?.sum_all()?.backward()?;
    let get = |x: &Tensor, name: &str| match grads.get(x) {
        Some(g) => Ok(g.clone()),
        None => bail!("{what}: no gradient for {name}"),
    };
    let got = (
        get(qv.as_tensor(), "q")?,
        get(kv.as_tensor(), "k")?,
        get(vv.as_tensor(), "v")?,
    );
    let dsinks = get(sinks.as_tensor(), "sinks")?;
    let (want_grads, want_dsinks) = attention_grads_ref_with_sinks(&q, &k, &v, &w, &reference)?;
    check_grads(&got, &want_grads, grad_tol, &what)?;
    // d(sink h) = -Σ_rows exp(sink_h - lse) · rowsum(dO ∘ O): a sum of terms of both signs that
    // may cancel to far below its terms (dO is random), while each term carries the rounding of
    // O and dO to the input dtype (its unit roundoff: 2^-8 in bf16). So the error allowed is
    // grad_tol of the total plus one unit roundoff of Σ |terms|: a bf16 d256 windowed case once
    // measured 4.1e-2 of its cancelled total. A wrong or missing gradient still fails: random
    // signs leave the total near Σ |terms| / sqrt(rows), far above 2^-8 of it.
    let unit = match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-24),
    };
    let terms = sink_grad_terms_scale(&want, &want_lse, &w, &vals)?;
    let allowance = grad_tol * max_abs(&want_dsinks)? + unit * terms;
    let floor = allowance / grad_tol;
    assert_close_with_floor(
        &dsinks,
        &want_dsinks,
        grad_tol,
        floor,
        &format!("{what}: dsinks (error allowed: {grad_tol:.0e} of the total + {unit:.1e} of Σ|terms| = {terms:.3e})"),
    )?;
    Ok(())
}

/// max over heads of Σ_{batch, row} |exp(sink_h - lse) · rowsum(dO ∘ O)|, from the reference's
/// out (b, sq, h, dv) and LSE (b, h, sq), dO = `dout`: the scale of each head's d(sink) sum.
fn sink_grad_terms_scale(out: &Tensor, lse: &Tensor, dout: &Tensor, sinks: &[f32]) -> Result<f64> {
    let (b, sq, h, dv) = out.dims4()?;
    let (o, l, w) = (to_f64_vec(out)?, to_f64_vec(lse)?, to_f64_vec(dout)?);
    let mut scale = vec![0f64; h];
    for bi in 0..b {
        for i in 0..sq {
            for (hi, sc) in scale.iter_mut().enumerate() {
                let at = ((bi * sq + i) * h + hi) * dv;
                let d: f64 = (0..dv).map(|c| o[at + c] * w[at + c]).sum();
                let p = (sinks[hi] as f64 - l[(bi * h + hi) * sq + i]).exp();
                *sc += (p * d).abs();
            }
        }
    }
    Ok(scale.into_iter().fold(0f64, f64::max))
}

/// A varlen call with attention sinks on `dev` against the f64 reference, masked and not:
/// sequences of `lens_q` queries over `lens_k` keys, (heads, kv_heads, head_dim) = `hhd`.
#[allow(clippy::too_many_arguments)]
pub fn check_sinks_varlen(
    rng: &mut TestRng,
    dev: &Device,
    dtype: DType,
    lens_q: &[usize],
    lens_k: &[usize],
    (h, hk, d): (usize, usize, usize),
    scale: f64,
    tols: SinkTols,
) -> Result<()> {
    let (cu_q, cu_k) = (cumulative(lens_q), cumulative(lens_k));
    let (total_q, total_k) = (cu_q[lens_q.len()], cu_k[lens_k.len()]);
    let q = rng.randn((total_q, h, d), dtype, dev)?;
    let k = rng.randn((total_k, hk, d), dtype, dev)?;
    let v = rng.randn((total_k, hk, d), dtype, dev)?;
    let vals = random_sinks(rng, h);
    let sinks = Tensor::new(vals.as_slice(), dev)?;
    let seq_offsets = |lens: &[usize]| flash_attn3::SeqOffsets::from_lengths(lens.iter().copied(), dev);
    let (max_q, max_k) = (max_len(&cu_q), max_len(&cu_k));
    for opts in [Opts::new(scale), Opts::new(scale).causal()] {
        let (out, lse) = opts.builder().sinks(&sinks).forward_varlen_offsets_with_lse(
            &q,
            &k,
            &v,
            &seq_offsets(lens_q)?,
            &seq_offsets(lens_k)?,
            max_q,
            max_k,
        )?;
        let (want, want_lse) = attention_ref_varlen(&q, &k, &v, &cu_q, &cu_k, &opts.reference().sinks(&vals))?;
        let what = format!("varlen with sinks {opts:?} seed {}", rng.seed());
        assert_close(&out, &want, tols.out, &format!("{what}: out"))?;
        assert_close(&lse, &want_lse, tols.lse, &format!("{what}: lse"))?;
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// KV cache layouts
// ------------------------------------------------------------------------------------------

/// A paged KV cache layout (`FlashAttn::kv_cache(..).page_table(..)`): `table` (batch,
/// max_pages) row-major into a pool of `num_pages` pages.
#[derive(Debug, Clone)]
pub struct PagedLayout {
    pub table: Vec<u32>,
    pub max_pages: usize,
    pub num_pages: usize,
}

/// Rotary tables (positions, rotary_dim / 2), f32 on the CPU, of a base-10000 RoPE: the kvcache
/// tests' cos and sin.
pub fn rotary_tables(positions: usize, rotary_dim: usize) -> Result<(Tensor, Tensor)> {
    let half = rotary_dim / 2;
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for p in 0..positions {
        for i in 0..half {
            let angle = p as f64 / 10000f64.powf(i as f64 / half as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(cos, (positions, half), &dev)?,
        Tensor::from_vec(sin, (positions, half), &dev)?,
    ))
}

/// A random paged layout for sequences that hold `lens[b]` keys before a call and `keys[b]`
/// after it, in pages of `page_size`: pages taken in a shuffled order from a pool with 1 to 3
/// spare pages, sequences 0 and 1 sharing their first page when both already hold one (an
/// append never writes into it: a shared prompt prefix), table entries past a sequence's pages
/// anything in range, and 0 to 2 spare columns.
pub fn random_paged_layout(rng: &mut TestRng, lens: &[usize], keys: &[usize], page_size: usize) -> PagedLayout {
    let batch = keys.len();
    let pages_of = |n: usize| n.div_ceil(page_size);
    let max_pages = keys.iter().map(|&n| pages_of(n)).max().unwrap_or(0).max(1) + rng.range(0, 2);
    let share = batch > 1 && lens[0] >= page_size && lens[1] >= page_size;
    let needed: usize = keys.iter().map(|&n| pages_of(n)).sum::<usize>() - share as usize;
    let num_pages = needed + rng.range(1, 3);
    let mut free = rng.permutation(num_pages);
    let mut table = vec![0u32; batch * max_pages];
    for b in 0..batch {
        for p in 0..max_pages {
            table[b * max_pages + p] = if p < pages_of(keys[b]) {
                if share && b == 1 && p == 0 {
                    table[0]
                } else {
                    free.pop().unwrap()
                }
            } else {
                rng.range(0, num_pages - 1) as u32
            };
        }
    }
    PagedLayout {
        table,
        max_pages,
        num_pages,
    }
}
