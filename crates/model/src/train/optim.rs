//! AdamW over f32 master weights, the learning-rate schedule and gradient clipping.
//!
//! Our own AdamW rather than candle-nn's: a checkpoint must hold the moment estimates, and
//! candle-nn's `AdamW` keeps them private.

use candle_core::{Result, Tensor, Var};

/// AdamW hyperparameters (decoupled weight decay, as in Loshchilov & Hutter).
#[derive(Debug, Clone, Copy)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// First and second moment estimates of every parameter, in the parameters' order.
pub struct AdamW {
    pub params: AdamWParams,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
}

impl AdamW {
    /// Zero moments for `vars`.
    pub fn new(vars: &[Var], params: AdamWParams) -> Result<Self> {
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        Ok(Self {
            params,
            m: vars.iter().map(zeros).collect::<Result<_>>()?,
            v: vars.iter().map(zeros).collect::<Result<_>>()?,
        })
    }

    /// One update of every var: the gradients' global L2 norm, a clip scale of
    /// `clip / norm` where the norm exceeds `clip` (0 never clips), then AdamW at learning rate
    /// `lr`. `step` counts updates from 1 (bias correction). Weight decay applies to matrices
    /// only: decaying norm gains towards 0 would fight the normalisation they scale. Nothing
    /// changes when a gradient or `loss` (the step's loss, one value) is not finite: the caller
    /// reports the divergence from the returned statistics.
    ///
    /// Returns [global norm, clip scale, 1 if the step was skipped else 0] as an f32 tensor on
    /// the vars' device. On a GPU the whole step is three kernels queued without waiting for
    /// them (kernels/model/train_ops.cu); reading the statistics waits.
    pub fn update(
        &mut self,
        vars: &[Var],
        grads: &[Tensor],
        loss: &Tensor,
        clip: f64,
        lr: f64,
        step: usize,
    ) -> Result<Tensor> {
        self.update_with_copies(vars, grads, loss, clip, lr, step, &[])
    }

    /// [`AdamW::update`] that also writes each var's new values, rounded to 16 bits, into
    /// `copies[i]` (a bf16 or f16 tensor and the offset of the var's values in it; `None`: no
    /// copy): the compute-dtype weights of the next step, without a cast. GPU only; an
    /// empty `copies` is [`AdamW::update`]. A skipped step leaves the copies as they were.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn update_with_copies(
        &mut self,
        vars: &[Var],
        grads: &[Tensor],
        loss: &Tensor,
        clip: f64,
        lr: f64,
        step: usize,
        copies: &[Option<(&Tensor, usize)>],
    ) -> Result<Tensor> {
        let p = self.params;
        let correction1 = 1.0 - p.beta1.powi(step as i32);
        let correction2 = 1.0 - p.beta2.powi(step as i32);
        if vars.len() != grads.len() || vars.len() != self.m.len() {
            candle_core::bail!(
                "AdamW: {} vars, {} gradients and {} moment pairs",
                vars.len(),
                grads.len(),
                self.m.len()
            )
        }
        #[cfg(feature = "cuda")]
        if loss.device().is_cuda() {
            let tensors: Vec<crate::train_ops::OptimTensor> = (0..vars.len())
                .map(|i| crate::train_ops::OptimTensor {
                    param: vars[i].as_tensor(),
                    grad: &grads[i],
                    m: &self.m[i],
                    v: &self.v[i],
                    decayed: vars[i].rank() >= 2 && p.weight_decay > 0.0,
                    copy: copies.get(i).copied().flatten(),
                })
                .collect();
            let kernel_step = crate::train_ops::AdamWStep {
                clip: clip as f32,
                lr: lr as f32,
                beta1: p.beta1 as f32,
                beta2: p.beta2 as f32,
                eps: p.eps as f32,
                matrix_decay: (1.0 - lr * p.weight_decay) as f32,
                correction1: correction1 as f32,
                correction2: correction2 as f32,
            };
            return crate::train_ops::optimizer_step(&tensors, loss, kernel_step);
        }
        if copies.iter().any(Option::is_some) {
            candle_core::bail!("AdamW: 16-bit weight copies are written on the GPU only")
        }
        let norm = global_norm(grads)?;
        let loss_value = loss
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let skip = !norm.is_finite() || loss_value.iter().any(|l| !l.is_finite());
        let grad_scale = if clip > 0.0 && norm > clip { clip / norm } else { 1.0 };
        let stats = |skipped: bool| {
            Tensor::new(
                &[norm as f32, grad_scale as f32, f32::from(u8::from(skipped))],
                loss.device(),
            )
        };
        if skip {
            return stats(true);
        }
        for (i, (var, g)) in vars.iter().zip(grads).enumerate() {
            let g = (g * grad_scale)?;
            self.m[i] = ((&self.m[i] * p.beta1)? + (&g * (1.0 - p.beta1))?)?;
            self.v[i] = ((&self.v[i] * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let m_hat = (&self.m[i] / correction1)?;
            let v_hat = (&self.v[i] / correction2)?;
            let update = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            // detach: the update is plain arithmetic, not part of any graph to differentiate.
            let theta = var.as_tensor().detach();
            let theta = if var.rank() >= 2 && p.weight_decay > 0.0 {
                (theta * (1.0 - lr * p.weight_decay))?
            } else {
                theta
            };
            var.set(&(theta - (update * lr)?)?)?;
        }
        stats(false)
    }
}

/// Linear warmup over `warmup` steps to `peak`, then cosine decay to `min` at step `total`.
/// `step` is the update about to be made, from 0.
pub fn learning_rate(step: usize, warmup: usize, total: usize, peak: f64, min: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The L2 norm of all gradients together, read back from the device once.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let sums: Vec<Tensor> = grads.iter().map(|g| g.sqr()?.sum_all()).collect::<Result<_>>()?;
    let total = Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>()?;
    Ok((total as f64).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn params() -> AdamWParams {
        AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }

    /// A step with a NaN gradient or an infinite loss changes nothing and says so; a finite one
    /// reports the global norm and the clip scale it used, and moves the weights.
    #[test]
    fn update_skips_non_finite_steps_and_reports_its_statistics() -> Result<()> {
        let dev = Device::Cpu;
        let vars = [
            Var::new(&[[1f32, 2.], [3., 4.]], &dev)?,
            Var::new(&[0.5f32, -0.5], &dev)?,
        ];
        let mut opt = AdamW::new(&vars, params())?;
        let before: Vec<Vec<f32>> = vars.iter().map(|v| v.flatten_all()?.to_vec1()).collect::<Result<_>>()?;
        let finite = [
            Tensor::new(&[[3f32, 0.], [0., 0.]], &dev)?,
            Tensor::new(&[0f32, 4.], &dev)?,
        ];
        let nan = [
            Tensor::new(&[[3f32, f32::NAN], [0., 0.]], &dev)?,
            Tensor::new(&[0f32, 4.], &dev)?,
        ];
        let loss = Tensor::new(1.5f32, &dev)?;

        for (grads, loss) in [(&nan, &loss), (&finite, &Tensor::new(f32::INFINITY, &dev)?)] {
            let stats = opt.update(&vars, grads, loss, 1.0, 1e-2, 1)?.to_vec1::<f32>()?;
            assert_eq!(stats[2], 1.0, "a non-finite step must be skipped: {stats:?}");
            let now: Vec<Vec<f32>> = vars.iter().map(|v| v.flatten_all()?.to_vec1()).collect::<Result<_>>()?;
            assert_eq!(now, before, "a skipped step changed the weights");
        }

        // Norm 5, clipped to 1: scale 0.2.
        let stats = opt.update(&vars, &finite, &loss, 1.0, 1e-2, 1)?.to_vec1::<f32>()?;
        assert_eq!(stats, vec![5.0, 0.2, 0.0]);
        let now: Vec<Vec<f32>> = vars.iter().map(|v| v.flatten_all()?.to_vec1()).collect::<Result<_>>()?;
        // The first Adam step moves each weight with a gradient by about lr against its sign.
        assert!((now[0][0] - (1.0 * (1.0 - 1e-3) - 1e-2)).abs() < 1e-5, "{now:?}");
        assert!((now[1][1] - (-0.5 - 1e-2)).abs() < 1e-5, "{now:?}");
        // No clipping: scale 1.
        let stats = opt.update(&vars, &finite, &loss, 0.0, 1e-2, 2)?.to_vec1::<f32>()?;
        assert_eq!(stats, vec![5.0, 1.0, 0.0]);
        Ok(())
    }
}
