//! Leaf layers, each loaded from its diffusers/transformers weight names.

use kiln_tensor::{Conv2dParams, DType, Tensor};

use crate::error::Result;
use crate::weights::Weights;

/// `nn.Linear`: `weight [out, in]`, optional `bias [out]`. On a mesh a row-parallel one
/// (`all_reduce`) sums its partial products over the devices before the bias is added once.
///
/// A weight kept quantized (GGUF blocks, see `kiln_io::gguf::decompose`) holds `q + 128` as u8 in
/// `weight` and its per-group f16 scales (and offsets) in `quant`; the forward dequantizes it next
/// to the product, in diffusers' float16 arithmetic, then casts it to `quant.dtype`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub all_reduce: bool,
    pub quant: Option<QuantScales>,
}

/// The scales (and offsets) of a [`Linear`] weight kept quantized.
#[derive(Clone, Debug)]
pub struct QuantScales {
    /// `[out, in / group]`, f16.
    pub scale: Tensor,
    /// `[out, in / group]`, f16, for the types with one.
    pub offset: Option<Tensor>,
    /// The dtype the weight is used in (the model's).
    pub dtype: DType,
    /// Two 4-bit elements per byte of the weight.
    pub packed: bool,
}

crate::impl_module!(QuantScales {
    scale: "weight_scale",
    offset: "weight_offset"
});

/// The stored integers of a quantized weight are `q + QUANT_BIAS`.
const QUANT_BIAS: f64 = 128.0;

impl Linear {
    /// A plain linear layer of these tensors.
    pub fn new(weight: Tensor, bias: Option<Tensor>, all_reduce: bool) -> Self {
        Linear {
            weight,
            bias,
            all_reduce,
            quant: None,
        }
    }

    pub fn load(w: &Weights, in_features: usize, out_features: usize, bias: bool) -> Result<Self> {
        Self::load_as(w, in_features, out_features, bias, w.dtype())
    }

    /// [`Self::load`] in `dtype` instead of the model's (transformers' `_keep_in_fp32_modules`).
    pub fn load_as(w: &Weights, in_features: usize, out_features: usize, bias: bool, dtype: DType) -> Result<Self> {
        // A 4-bit weight kept quantized holds two elements per byte.
        let packed = w
            .stored_shape(Self::weight)
            .is_some_and(|s| 2 * s.dims().get(1).copied().unwrap_or(0) == in_features);
        let quant = match w.stored_shape(QuantScales::scale) {
            Some(shape) => Some(Self::load_quantized(
                w,
                (in_features, out_features),
                shape,
                packed,
                dtype,
            )?),
            None => None,
        };
        Ok(Linear {
            weight: match (&quant, packed) {
                (Some(_), true) => w.get_stored(Self::weight, [out_features, in_features / 2])?,
                (Some(_), false) => w.get_stored(Self::weight, [out_features, in_features])?,
                (None, _) => w.get_as(Self::weight, [out_features, in_features], dtype)?,
            },
            bias: if bias {
                Some(w.get_as(Self::bias, [out_features], dtype)?)
            } else {
                None
            },
            all_reduce: w.parallel_style().is_some_and(|s| s.reduces()),
            quant,
        })
    }

    fn load_quantized(
        w: &Weights,
        (in_features, out_features): (usize, usize),
        scale_shape: kiln_tensor::Shape,
        packed: bool,
        dtype: DType,
    ) -> Result<QuantScales> {
        let groups = scale_shape.dims().get(1).copied().unwrap_or(0);
        if groups == 0 || !in_features.is_multiple_of(groups) {
            return Err(crate::error::Error::Config {
                component: w.component().to_string(),
                message: format!(
                    "`{}` has scales of shape {scale_shape}, which do not divide {in_features} columns into groups",
                    w.name_of(QuantScales::scale)
                ),
            });
        }
        if w.parallel_style().is_some() {
            return Err(crate::error::Error::Config {
                component: w.component().to_string(),
                message: format!(
                    "`{}` is kept quantized, and tensor parallelism cannot split a quantized weight yet: drop --keep-quantized to use --tp",
                    w.name_of(Self::weight)
                ),
            });
        }
        Ok(QuantScales {
            scale: w.get_stored(QuantScales::scale, [out_features, groups])?,
            offset: w.get_opt_stored(QuantScales::offset, [out_features, groups])?,
            dtype,
            packed,
        })
    }

    /// The weight as the product uses it: dequantized when kept quantized.
    pub fn dense_weight(&self) -> Result<Tensor> {
        let Some(quant) = &self.quant else {
            return Ok(self.weight.clone());
        };
        let out = self.weight.dims()[0];
        let groups = quant.scale.dims()[1];
        let stored = self.weight.to_dtype(DType::F16)?;
        // Integers below 2^11 are exact in f16: unpacking and the bias subtract exactly.
        let q = match quant.packed {
            false => stored.sub_scalar(QUANT_BIAS)?,
            true => {
                // Byte j of a row: element j (low nibble) and j + in/2 (high): see
                // `kiln_io::gguf::pack_nibbles`. Q4_0 (no offsets) is biased by 8, the others by 0.
                let high = stored.div_scalar(16.0)?.floor()?;
                let low = stored.sub(&high.mul_scalar(16.0)?)?;
                let q = Tensor::cat(&[&low, &high], 1)?;
                match quant.offset {
                    None => q.sub_scalar(8.0)?,
                    Some(_) => q,
                }
            }
        };
        let inp = q.dims()[1];
        let q = q.reshape(vec![out, groups, inp / groups])?;
        let grouped = |t: &Tensor| t.reshape(vec![out, groups, 1]);
        let mut w = q.mul(&grouped(&quant.scale)?)?;
        if let Some(offset) = &quant.offset {
            w = w.add(&grouped(offset)?)?;
        }
        Ok(w.reshape(vec![out, inp])?.to_dtype(quant.dtype)?)
    }

    /// The dtype the layer computes in.
    pub fn dtype(&self) -> DType {
        match &self.quant {
            Some(q) => q.dtype,
            None => self.weight.dtype(),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let weight = self.dense_weight()?;
        if !self.all_reduce {
            return Ok(x.linear(&weight, self.bias.as_ref())?);
        }
        // transformers adds a row-parallel bias once after the sum; torch's DTensor path adds b/n
        // on every device before it (diffusers' FLUX.1): the same value up to rounding.
        let sum = x.linear(&weight, None)?.all_reduce_sum()?;
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

crate::impl_module!(Linear {
    weight,
    bias,
    quant: ""
});
crate::impl_module!(Conv2d { weight, bias });
crate::impl_module!(LayerNorm { weight, bias });
crate::impl_module!(RmsNorm { weight });
crate::impl_module!(GroupNorm { weight, bias });
crate::impl_module!(Embedding { weight });
