//! The CPU backward, in two race-free passes that recompute the probabilities from the LSE:
//! - by query block: dQ = scale · Σ_blocks dS·K;
//! - by key block: dV = Σ Pᵀ·dO and dK = scale · Σ dSᵀ·Q over every query head of the group,
//!
//! where P = exp(S - LSE), dS = P ∘ (dO·Vᵀ - D) (times 1 - tanh² under a softcap) and
//! D = rowsum(dO ∘ O). Each output row is written by exactly one task, so the result is
//! deterministic.

use std::f32::consts::LOG2_E;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use super::math::{probabilities, score_grads, GradBlock, ProbBlock};
use super::rows::{Element, Rows, SharedMut};
use super::{matmul, Operand, Problem, BLOCK_K, BLOCK_Q};

type Input<'a> = (&'a CpuStorage, &'a Layout);

/// The tensors every backward task reads.
struct Saved<'a> {
    q: Rows<'a>,
    k: Rows<'a>,
    v: Rows<'a>,
    dout: Rows<'a>,
    /// Per (head, packed query): the LSE in log2 units and D = rowsum(dO ∘ O).
    lse_log2: Vec<f32>,
    delta: Vec<f32>,
}

impl Saved<'_> {
    /// The per-row values of `rows` queries of `head` starting at packed position `token`.
    fn row_stats(&self, p: &Problem, head: usize, token: usize, rows: usize) -> (&[f32], &[f32]) {
        let start = head * p.dims.total_q + token;
        (&self.lse_log2[start..start + rows], &self.delta[start..start + rows])
    }
}

/// dq, dk and dv flattened and concatenated in the input dtype, each laid out like a
/// contiguous q, k and v.
pub(crate) fn backward(
    p: &Problem,
    q: Input,
    k: Input,
    v: Input,
    out: Input,
    dout: Input,
    lse: Input,
) -> Result<CpuStorage> {
    let o = Rows::new(out.0, out.1)?;
    let dout_rows = Rows::new(dout.0, dout.1)?;
    let (CpuStorage::F32(lse_data), Some((lse_start, _))) = (lse.0, lse.1.contiguous_offsets()) else {
        bail!("flash-attn3: the saved LSE must be a contiguous f32 tensor")
    };
    let dims = p.dims;
    let mut lse_log2 = vec![0f32; dims.heads * dims.total_q];
    let mut delta = vec![0f32; dims.heads * dims.total_q];
    lse_log2
        .par_chunks_mut(dims.total_q)
        .zip(delta.par_chunks_mut(dims.total_q))
        .enumerate()
        .for_each(|(h, (lse_row, delta_row))| {
            for b in 0..dims.batch {
                for i in 0..p.len_q(b) {
                    let t = p.cu_q[b] + i;
                    lse_row[t] = lse_data[lse_start + p.lse_index(b, h, i)] * LOG2_E;
                    delta_row[t] = o.row(t, h).iter().zip(dout_rows.row(t, h)).map(|(a, b)| a * b).sum();
                }
            }
        });
    let saved = Saved {
        q: Rows::new(q.0, q.1)?,
        k: Rows::new(k.0, k.1)?,
        v: Rows::new(v.0, v.1)?,
        dout: dout_rows,
        lse_log2,
        delta,
    };
    Ok(match q.0 {
        CpuStorage::F32(_) => run::<f32>(p, &saved),
        CpuStorage::F16(_) => run::<f16>(p, &saved),
        CpuStorage::BF16(_) => run::<bf16>(p, &saved),
        other => bail!("flash-attn3: unsupported dtype {:?} on the CPU", other.dtype()),
    })
}

struct Scratch {
    scores: Vec<f32>,
    dp: Vec<f32>,
    tanh: Vec<f32>,
    /// dQ of a query block, or dK of a key block.
    grad_qk: Vec<f32>,
    grad_v: Vec<f32>,
    ranges: Vec<(usize, usize)>,
}

impl Scratch {
    fn new(d: usize, dv: usize) -> Self {
        Self {
            scores: vec![0.0; BLOCK_Q * BLOCK_K],
            dp: vec![0.0; BLOCK_Q * BLOCK_K],
            tanh: vec![0.0; BLOCK_Q * BLOCK_K],
            grad_qk: vec![0.0; BLOCK_Q.max(BLOCK_K) * d],
            grad_v: vec![0.0; BLOCK_K * dv],
            ranges: Vec::with_capacity(BLOCK_Q),
        }
    }

    /// Fills `ranges` with the key ranges of `rows` queries from `r0` and returns their union.
    fn set_ranges(&mut self, p: &Problem, b: usize, r0: usize, rows: usize) -> (usize, usize) {
        self.ranges.clear();
        self.ranges.extend((r0..r0 + rows).map(|i| p.key_range(b, i)));
        let live = self.ranges.iter().filter(|r| r.0 < r.1);
        (
            live.clone().map(|r| r.0).min().unwrap_or(0),
            live.map(|r| r.1).max().unwrap_or(0),
        )
    }

    /// P, dS (in `scores`, `dp`) of `rows` queries from packed `tq`, head `h`, against `cols`
    /// keys from packed `tk` (key index `c0` of the sequence), kv head `kv_head`.
    #[allow(clippy::too_many_arguments)]
    fn probs_and_grads(
        &mut self,
        p: &Problem,
        saved: &Saved,
        (tq, h, rows): (usize, usize, usize),
        (tk, kv_head, c0, cols): (usize, usize, usize, usize),
    ) {
        let (d, dv) = (p.dims.head_dim, p.dims.head_dim_v);
        let (lse_log2, delta) = saved.row_stats(p, h, tq, rows);
        // SAFETY: the rows and key rows exist in q, k, v and dO; the blocks hold rows × BLOCK_K.
        unsafe {
            matmul(
                rows,
                cols,
                d,
                self.scores.as_mut_ptr(),
                BLOCK_K,
                false,
                Operand::rows(saved.q.ptr(tq, h), saved.q.token_stride()),
                Operand::transposed(saved.k.ptr(tk, kv_head), saved.k.token_stride()),
                1.0,
            );
        }
        probabilities(ProbBlock {
            scores: &mut self.scores[..rows * BLOCK_K],
            ld: BLOCK_K,
            cols,
            col0: c0,
            ranges: &self.ranges,
            lse_log2,
            map: p.map(),
            tanh_out: &mut self.tanh[..rows * BLOCK_K],
        });
        // SAFETY: as above.
        unsafe {
            matmul(
                rows,
                cols,
                dv,
                self.dp.as_mut_ptr(),
                BLOCK_K,
                false,
                Operand::rows(saved.dout.ptr(tq, h), saved.dout.token_stride()),
                Operand::transposed(saved.v.ptr(tk, kv_head), saved.v.token_stride()),
                1.0,
            );
        }
        score_grads(GradBlock {
            probs: &self.scores,
            dp: &mut self.dp,
            ld: BLOCK_K,
            rows,
            cols,
            delta,
            tanh: p.params.softcap.map(|_| &self.tanh[..]),
        });
    }
}

fn run<T: Element>(p: &Problem, saved: &Saved) -> CpuStorage {
    let dims = p.dims;
    let nq = dims.total_q * dims.heads * dims.head_dim;
    let nk = dims.total_k * dims.kv_heads * dims.head_dim;
    let nv = dims.total_k * dims.kv_heads * dims.head_dim_v;
    let mut grads = vec![T::from_f32(0.0); nq + nk + nv];
    let dst = SharedMut(grads.as_mut_ptr());
    let scratch = || Scratch::new(dims.head_dim, dims.head_dim_v);
    p.query_blocks()
        .into_par_iter()
        .for_each_init(scratch, |s, task| grad_q(p, saved, task, s, dst));
    key_blocks(p)
        .into_par_iter()
        .for_each_init(scratch, |s, task| grad_kv(p, saved, task, s, dst, nq, nk));
    T::to_cpu_storage_owned(grads)
}

/// Key blocks `(sequence, kv head, first key)`, the unit of work of the dK/dV pass.
fn key_blocks(p: &Problem) -> Vec<(usize, usize, usize)> {
    let mut tasks = Vec::new();
    for b in 0..p.dims.batch {
        for kv_head in 0..p.dims.kv_heads {
            for c0 in (0..p.len_k(b)).step_by(BLOCK_K) {
                tasks.push((b, kv_head, c0));
            }
        }
    }
    tasks
}

fn grad_q<T: Element>(
    p: &Problem,
    saved: &Saved,
    (b, h, r0): (usize, usize, usize),
    s: &mut Scratch,
    dst: SharedMut<T>,
) {
    let d = p.dims.head_dim;
    let rows = BLOCK_Q.min(p.len_q(b) - r0);
    let kv_head = h / p.dims.group();
    let (tq, tk) = (p.cu_q[b] + r0, p.cu_k[b]);
    let span = s.set_ranges(p, b, r0, rows);
    s.grad_qk[..rows * d].fill(0.0);
    for c0 in (span.0..span.1).step_by(BLOCK_K) {
        let cols = BLOCK_K.min(span.1 - c0);
        s.probs_and_grads(p, saved, (tq, h, rows), (tk + c0, kv_head, c0, cols));
        // SAFETY: dS is rows × cols, k has cols rows from tk + c0, grad_qk holds rows × d.
        unsafe {
            matmul(
                rows,
                d,
                cols,
                s.grad_qk.as_mut_ptr(),
                d,
                true,
                Operand::rows(s.dp.as_ptr(), BLOCK_K),
                Operand::rows(saved.k.ptr(tk + c0, kv_head), saved.k.token_stride()),
                p.params.softmax_scale,
            );
        }
    }
    for r in 0..rows {
        // SAFETY: row (tq + r, h) of dq belongs to this task alone.
        unsafe { dst.write(((tq + r) * p.dims.heads + h) * d, &s.grad_qk[r * d..(r + 1) * d]) };
    }
}

/// The first index in `0..n` where the monotone predicate `before` turns false.
fn partition_point(n: usize, before: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if before(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

fn grad_kv<T: Element>(
    p: &Problem,
    saved: &Saved,
    (b, kv_head, c0): (usize, usize, usize),
    s: &mut Scratch,
    dst: SharedMut<T>,
    nq: usize,
    nk: usize,
) {
    let dims = p.dims;
    let (d, dv) = (dims.head_dim, dims.head_dim_v);
    let cols = BLOCK_K.min(p.len_k(b) - c0);
    let tk = p.cu_k[b] + c0;
    s.grad_qk[..cols * d].fill(0.0);
    s.grad_v[..cols * dv].fill(0.0);
    // Key ranges grow with the query index, so the queries that see this block are contiguous.
    let first = partition_point(p.len_q(b), |i| p.key_range(b, i).1 <= c0);
    let end = partition_point(p.len_q(b), |i| p.key_range(b, i).0 < c0 + cols);
    for h in kv_head * dims.group()..(kv_head + 1) * dims.group() {
        for r0 in (first..end.max(first)).step_by(BLOCK_Q) {
            let rows = BLOCK_Q.min(end - r0);
            let tq = p.cu_q[b] + r0;
            s.set_ranges(p, b, r0, rows);
            s.probs_and_grads(p, saved, (tq, h, rows), (tk, kv_head, c0, cols));
            // SAFETY: P and dS are rows × cols; dO and q have `rows` rows from tq; the
            // accumulators hold cols × dv and cols × d.
            unsafe {
                matmul(
                    cols,
                    dv,
                    rows,
                    s.grad_v.as_mut_ptr(),
                    dv,
                    true,
                    Operand::transposed(s.scores.as_ptr(), BLOCK_K),
                    Operand::rows(saved.dout.ptr(tq, h), saved.dout.token_stride()),
                    1.0,
                );
                matmul(
                    cols,
                    d,
                    rows,
                    s.grad_qk.as_mut_ptr(),
                    d,
                    true,
                    Operand::transposed(s.dp.as_ptr(), BLOCK_K),
                    Operand::rows(saved.q.ptr(tq, h), saved.q.token_stride()),
                    p.params.softmax_scale,
                );
            }
        }
    }
    for j in 0..cols {
        let row = (tk + j) * dims.kv_heads + kv_head;
        // SAFETY: key row (tk + j, kv_head) of dk and dv belongs to this task alone.
        unsafe {
            dst.write(nq + row * d, &s.grad_qk[j * d..(j + 1) * d]);
            dst.write(nq + nk + row * dv, &s.grad_v[j * dv..(j + 1) * dv]);
        }
    }
}
