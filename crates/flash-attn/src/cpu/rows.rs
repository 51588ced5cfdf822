//! f32 views of the (tokens, heads, dim) rows of q, k, v, o and dO, whatever their strides.
//!
//! f32 inputs are read in place; f16/bf16 inputs are converted once to a contiguous f32 copy
//! (memory linear in the sequence length). Fixed-length inputs (batch, seqlen, heads, dim) are
//! addressed by a packed token index `t = b * seqlen + i`, so the kernels see one layout.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result, WithDType};
use half::{bf16, f16};

/// A value type the CPU path reads and writes; all arithmetic happens in f32.
pub(crate) trait Element: WithDType + Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Element for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Rows of `dim` contiguous f32 values indexed by (packed token, head).
pub(crate) struct Rows<'a> {
    data: Cow<'a, [f32]>,
    offset: usize,
    /// Tokens per batch entry (fixed-length inputs); the packed total for varlen inputs.
    seqlen: usize,
    batch_stride: usize,
    token_stride: usize,
    head_stride: usize,
    pub dim: usize,
}

/// Copies a strided input into a contiguous f32 buffer in logical order. The last
/// dimension is contiguous (the API checks it), so whole rows are copied at a time.
fn to_f32_contiguous<T: Element>(data: &[T], layout: &Layout) -> Vec<f32> {
    if let Some((start, end)) = layout.contiguous_offsets() {
        return data[start..end].iter().map(|x| x.to_f32()).collect();
    }
    let (dims, stride) = (layout.dims(), layout.stride());
    let (outer, dim) = (&dims[..dims.len() - 1], dims[dims.len() - 1]);
    let mut out = Vec::with_capacity(layout.shape().elem_count());
    let mut index = vec![0usize; outer.len()];
    for _ in 0..outer.iter().product::<usize>() {
        let start = layout.start_offset() + index.iter().zip(stride).map(|(i, s)| i * s).sum::<usize>();
        out.extend(data[start..start + dim].iter().map(|x| x.to_f32()));
        // Advance the row index like an odometer, last outer dimension fastest.
        for axis in (0..outer.len()).rev() {
            index[axis] += 1;
            if index[axis] < outer[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
    out
}

impl<'a> Rows<'a> {
    /// A view of a rank-4 (batch, seqlen, heads, dim) or rank-3 (total, heads, dim) input.
    pub fn new(storage: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        let (data, layout) = match storage {
            CpuStorage::F32(data) => (Cow::Borrowed(data.as_slice()), layout.clone()),
            CpuStorage::F16(data) => (
                Cow::Owned(to_f32_contiguous(data, layout)),
                Layout::contiguous(layout.shape()),
            ),
            CpuStorage::BF16(data) => (
                Cow::Owned(to_f32_contiguous(data, layout)),
                Layout::contiguous(layout.shape()),
            ),
            other => bail!("flash-attn3: unsupported dtype {:?} on the CPU", other.dtype()),
        };
        let dims = layout.dims();
        let stride = layout.stride();
        let (seqlen, batch_stride, token_stride, head_stride) = match *dims {
            [_, seqlen, _, _] => (seqlen, stride[0], stride[1], stride[2]),
            [total, _, _] => (total, 0, stride[0], stride[1]),
            _ => bail!("flash-attn3: expected a rank-3 or rank-4 input, got {dims:?}"),
        };
        Ok(Self {
            data,
            offset: layout.start_offset(),
            seqlen: seqlen.max(1),
            batch_stride,
            token_stride,
            head_stride,
            dim: *dims.last().unwrap(),
        })
    }

    #[inline]
    fn index(&self, token: usize, head: usize) -> usize {
        let (b, i) = (token / self.seqlen, token % self.seqlen);
        self.offset + b * self.batch_stride + i * self.token_stride + head * self.head_stride
    }

    /// The row of `head` at packed position `token`.
    #[inline]
    pub fn row(&self, token: usize, head: usize) -> &[f32] {
        let start = self.index(token, head);
        &self.data[start..start + self.dim]
    }

    /// A pointer to that row. Rows of consecutive tokens of one sequence and head are
    /// `token_stride()` elements apart, so a block of them is a strided matrix.
    #[inline]
    pub fn ptr(&self, token: usize, head: usize) -> *const f32 {
        let start = self.index(token, head);
        assert!(start + self.dim <= self.data.len());
        // Derived from the whole buffer: matrix products read the following rows too.
        unsafe { self.data.as_ptr().add(start) }
    }

    pub fn token_stride(&self) -> usize {
        self.token_stride
    }
}

/// A raw pointer that tasks share to write disjoint parts of one output buffer.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);

// SAFETY: every user writes only to the rows its task owns, so no element is shared.
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T: Element> SharedMut<T> {
    /// Writes `values` at `offset`.
    ///
    /// # Safety
    /// `offset..offset + values.len()` lies in the buffer and no other task writes to it.
    #[inline]
    pub unsafe fn write(&self, offset: usize, values: &[f32]) {
        let dst = std::slice::from_raw_parts_mut(self.0.add(offset), values.len());
        for (d, &x) in dst.iter_mut().zip(values) {
            *d = T::from_f32(x);
        }
    }
}
