//! Leaf layers, each loaded from its diffusers/transformers weight names.

use kiln_tensor::{Conv2dParams, DType, Tensor};

use crate::error::Result;
use crate::weights::Weights;

/// `nn.Linear`: `weight [out, in]`, optional `bias [out]`. On a mesh a row-parallel one
/// (`all_reduce`) sums its partial products over the devices before the bias is added once.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub all_reduce: bool,
}

impl Linear {
    pub fn load(w: &Weights, in_features: usize, out_features: usize, bias: bool) -> Result<Self> {
        Self::load_as(w, in_features, out_features, bias, w.dtype())
    }

    /// [`Self::load`] in `dtype` instead of the model's (transformers' `_keep_in_fp32_modules`).
    pub fn load_as(w: &Weights, in_features: usize, out_features: usize, bias: bool, dtype: DType) -> Result<Self> {
        Ok(Linear {
            weight: w.get_as(Self::weight, [out_features, in_features], dtype)?,
            bias: if bias {
                Some(w.get_as(Self::bias, [out_features], dtype)?)
            } else {
                None
            },
            all_reduce: w.parallel_style().is_some_and(|s| s.reduces()),
        })
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.all_reduce {
            return Ok(x.linear(&self.weight, self.bias.as_ref())?);
        }
        // transformers adds a row-parallel bias once after the sum; torch's DTensor path adds b/n
        // on every device before it (diffusers' FLUX.1): the same value up to rounding.
        let sum = x.linear(&self.weight, None)?.all_reduce_sum()?;
        Ok(match &self.bias {
            Some(b) => sum.add(b)?,
            None => sum,
        })
    }
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}

/// `nn.Conv2d` with square kernel, stride and padding.
#[derive(Clone, Debug)]
pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub params: Conv2dParams,
}

impl Conv2d {
    pub fn load(
        w: &Weights,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        params: Conv2dParams,
        bias: bool,
    ) -> Result<Self> {
        let groups = params.groups.max(1);
        Ok(Conv2d {
            weight: w.get(Self::weight, [out_channels, in_channels / groups, kernel, kernel])?,
            bias: if bias {
                Some(w.get(Self::bias, [out_channels])?)
            } else {
                None
            },
            params,
        })
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.conv2d(&self.weight, self.bias.as_ref(), self.params)?)
    }
    /// The same convolution on a channels-last `[N, H, W, C]` input.
    pub fn forward_channels_last(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.conv2d_channels_last(&self.weight, self.bias.as_ref(), self.params)?)
    }
}

/// `nn.LayerNorm` over the last dimension (affine optional).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub weight: Option<Tensor>,
    pub bias: Option<Tensor>,
    pub eps: f64,
}

impl LayerNorm {
    pub fn load(w: &Weights, dim: usize, eps: f64) -> Result<Self> {
        Ok(LayerNorm {
            weight: Some(w.get(Self::weight, [dim])?),
            bias: Some(w.get(Self::bias, [dim])?),
            eps,
        })
    }
    /// Without learnable parameters (`elementwise_affine=False`).
    pub fn plain(eps: f64) -> Self {
        LayerNorm {
            weight: None,
            bias: None,
            eps,
        }
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.layer_norm(self.weight.as_ref(), self.bias.as_ref(), self.eps)?)
    }
}

/// `nn.RMSNorm` (one rounding at the end).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn load(w: &Weights, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: w.get(Self::weight, [dim])?,
            eps,
        })
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm(Some(&self.weight), self.eps)?)
    }
}

/// `nn.GroupNorm` with affine parameters.
#[derive(Clone, Debug)]
pub struct GroupNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    pub groups: usize,
    pub eps: f64,
}

impl GroupNorm {
    pub fn load(w: &Weights, groups: usize, channels: usize, eps: f64) -> Result<Self> {
        Ok(GroupNorm {
            weight: w.get(Self::weight, [channels])?,
            bias: w.get(Self::bias, [channels])?,
            groups,
            eps,
        })
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.group_norm(self.groups, Some(&self.weight), Some(&self.bias), self.eps)?)
    }
    /// The same normalization on a channels-last `[N, ..., C]` input.
    pub fn forward_channels_last(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.group_norm_channels_last(self.groups, Some(&self.weight), Some(&self.bias), self.eps)?)
    }
    /// `silu(self.forward_channels_last(x))` as one op (one pass on CPU).
    pub fn forward_channels_last_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.group_norm_silu_channels_last(self.groups, Some(&self.weight), Some(&self.bias), self.eps)?)
    }
}

/// `nn.Embedding`: looks up rows of `weight [num, dim]`.
#[derive(Clone, Debug)]
pub struct Embedding {
    pub weight: Tensor,
}

impl Embedding {
    pub fn load(w: &Weights, num: usize, dim: usize) -> Result<Self> {
        Ok(Embedding {
            weight: w.get(Self::weight, [num, dim])?,
        })
    }
    /// `ids` of any shape (integer) → `[..ids.shape, dim]`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let dim = self.weight.dims()[1];
        let flat = ids.reshape([ids.numel()])?;
        let rows = self.weight.index_select(0, &flat)?;
        let mut shape = ids.dims().to_vec();
        shape.push(dim);
        Ok(rows.reshape(shape)?)
    }
}

crate::impl_module!(Linear { weight, bias });
crate::impl_module!(Conv2d { weight, bias });
crate::impl_module!(LayerNorm { weight, bias });
crate::impl_module!(RmsNorm { weight });
crate::impl_module!(GroupNorm { weight, bias });
crate::impl_module!(Embedding { weight });
