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

    /// One update of every var with its gradient times `grad_scale` (clipping), at learning rate
    /// `lr`. `step` counts updates from 1 (bias correction). Weight decay applies to matrices
    /// only: decaying norm gains towards 0 would fight the normalisation they scale.
    pub fn update(&mut self, vars: &[Var], grads: &[Tensor], grad_scale: f64, lr: f64, step: usize) -> Result<()> {
        let p = self.params;
        let correction1 = 1.0 - p.beta1.powi(step as i32);
        let correction2 = 1.0 - p.beta2.powi(step as i32);
        #[cfg(feature = "cuda")]
        if vars.first().is_some_and(|v| v.device().is_cuda()) {
            // One fused kernel per tensor, the same arithmetic as the composed ops below.
            for (i, (var, g)) in vars.iter().zip(grads).enumerate() {
                let decayed = var.rank() >= 2 && p.weight_decay > 0.0;
                let kernel_step = crate::train_ops::AdamWStep {
                    grad_scale: grad_scale as f32,
                    lr: lr as f32,
                    beta1: p.beta1 as f32,
                    beta2: p.beta2 as f32,
                    eps: p.eps as f32,
                    decay: if decayed {
                        (1.0 - lr * p.weight_decay) as f32
                    } else {
                        1.0
                    },
                    correction1: correction1 as f32,
                    correction2: correction2 as f32,
                };
                crate::train_ops::adamw_cuda(var.as_tensor(), g, &self.m[i], &self.v[i], kernel_step)?;
            }
            return Ok(());
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
        Ok(())
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
