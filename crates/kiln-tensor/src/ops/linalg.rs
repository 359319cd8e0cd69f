//! Matrix products and convolution.

use kiln_hlo::{Builder, ConvDims, ConvLayout, DotDims, Value};
use kiln_types::DType;

use super::emit::{broadcast_shapes, broadcast_to};
use crate::dispatch::apply1;
use crate::error::{Error, Result};
use crate::lower::{self, cpu::Handler};
use crate::tensor::Tensor;

/// The dtype a dot/convolution accumulates in: f32 for 16-bit floats, else the input dtype.
fn accumulation_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

impl Tensor {
    /// `torch.matmul` for rank ≥ 2 operands: `[..., m, k] @ [..., k, n]` with broadcast batch
    /// dimensions. 16-bit inputs accumulate in f32; the result has the input dtype.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let op = "matmul";
        if self.dtype() != rhs.dtype() {
            return Err(Error::DType {
                op,
                lhs: self.dtype(),
                rhs: rhs.dtype(),
            });
        }
        let bad = || Error::invalid(op, format!("cannot multiply {} by {}", self.shape(), rhs.shape()));
        if self.rank() < 2 || rhs.rank() < 2 {
            return Err(bad());
        }
        let (m, k) = (self.dims()[self.rank() - 2], self.dims()[self.rank() - 1]);
        let (k2, n) = (rhs.dims()[rhs.rank() - 2], rhs.dims()[rhs.rank() - 1]);
        if k != k2 {
            return Err(bad());
        }
        let batch = broadcast_shapes(&self.dims()[..self.rank() - 2], &rhs.dims()[..rhs.rank() - 2]).ok_or_else(bad)?;
        let nb = batch.len();
        let mut ls = batch.clone();
        ls.extend([m, k]);
        let mut rs = batch.clone();
        rs.extend([k, n]);
        let dtype = self.dtype();
        apply1(op, &[self, rhs], |b, p| {
            let x = broadcast_to(b, &p[0], &ls)?;
            let y = broadcast_to(b, &p[1], &rs)?;
            let dims = DotDims {
                lhs_batch: (0..nb).collect(),
                rhs_batch: (0..nb).collect(),
                lhs_contract: vec![nb + 1],
                rhs_contract: vec![nb],
            };
            let out = b.dot_general(&x, &y, &dims, accumulation_dtype(dtype))?;
            b.convert(&out, dtype)
        })
    }

    /// `x @ weight.T + bias` (torch `nn.Linear`; `weight` is `[out, in]`), in one program.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let op = "linear";
        if weight.rank() != 2 || self.rank() == 0 || self.dims()[self.rank() - 1] != weight.dims()[1] {
            return Err(Error::invalid(
                op,
                format!(
                    "input {} does not match weight {} ([out, in])",
                    self.shape(),
                    weight.shape()
                ),
            ));
        }
        if self.dtype() != weight.dtype() {
            return Err(Error::DType {
                op,
                lhs: self.dtype(),
                rhs: weight.dtype(),
            });
        }
        if let Some(bias) = bias {
            if bias.dims() != [weight.dims()[0]] || bias.dtype() != self.dtype() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "bias {} {} does not match weight {}",
                        bias.shape(),
                        bias.dtype(),
                        weight.shape()
                    ),
                ));
            }
        }
        let dtype = self.dtype();
        let last = self.rank() - 1;
        let (k, n) = (weight.dims()[1], weight.dims()[0]);
        let m = self.numel().checked_div(k).unwrap_or(0);
        let lowering = lower::linear(self.device(), dtype, [m, k, n]);
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        apply1(op, &inputs, |b, p| {
            if let lower::Linear::CpuKernel = lowering {
                let mut shape = p[0].dims().to_vec();
                shape[last] = n;
                return b.ffi_call(Handler::Linear.target(), p, shape, dtype);
            }
            let dims = DotDims {
                lhs_contract: vec![last],
                rhs_contract: vec![1],
                ..Default::default()
            };
            let acc = accumulation_dtype(dtype);
            let mut y = b.dot_general(&p[0], &p[1], &dims, acc)?;
            if let Some(bias) = p.get(2) {
                // The bias is added before the final rounding, as oneDNN/cuBLAS epilogues do.
                let bias = b.convert(bias, acc)?;
                let bias = broadcast_to(b, &bias, y.dims())?;
                y = b.add(&y, &bias)?;
            }
            b.convert(&y, dtype)
        })
    }

    /// 2-D convolution (NCHW input, OIHW weight), torch `F.conv2d` semantics.
    pub fn conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, params: Conv2dParams) -> Result<Tensor> {
        self.conv2d_in("conv2d", ConvLayout::Nchw, weight, bias, params)
    }

    /// [`Tensor::conv2d`] on a channels-last `[N, H, W, C]` input, giving `[N, H', W', O]`; the
    /// weight stays OIHW, as checkpoints store it. XLA:CPU runs 3×3 convolutions of VAE sizes
    /// 1.1–1.5× faster in this layout (`benches/conv_layout.rs`).
    pub fn conv2d_channels_last(&self, weight: &Tensor, bias: Option<&Tensor>, params: Conv2dParams) -> Result<Tensor> {
        self.conv2d_in("conv2d_channels_last", ConvLayout::Nhwc, weight, bias, params)
    }

    fn conv2d_in(
        &self,
        op: &'static str,
        layout: ConvLayout,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: Conv2dParams,
    ) -> Result<Tensor> {
        if self.dtype() != weight.dtype() {
            return Err(Error::DType {
                op,
                lhs: self.dtype(),
                rhs: weight.dtype(),
            });
        }
        check_conv2d(op, layout, self, weight, params)?;
        if let Some(bias) = bias {
            if bias.dims() != [weight.dims()[0]] || bias.dtype() != self.dtype() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "bias {} {} does not match weight {}",
                        bias.shape(),
                        bias.dtype(),
                        weight.shape()
                    ),
                ));
            }
        }
        let dims = ConvDims {
            layout,
            stride: [params.stride; 2],
            padding: [(params.padding as i64, params.padding as i64); 2],
            lhs_dilation: [1, 1],
            rhs_dilation: [params.dilation; 2],
            feature_group_count: params.groups,
        };
        let channel_dim = match layout {
            ConvLayout::Nchw => 1,
            ConvLayout::Nhwc => 3,
        };
        let dtype = self.dtype();
        let lowering = lower::conv(self.device(), layout, dtype, self.dims(), weight.dims(), params);
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        apply1(op, &inputs, |b, p| {
            let acc = accumulation_dtype(dtype);
            let mut y = match lowering {
                lower::Conv::Xla => b.convolution(&p[0], &p[1], &dims, acc)?,
                lower::Conv::PointwiseDot => pointwise_conv_as_dot(b, &p[0], &p[1], acc)?,
                lower::Conv::Im2colDot => conv_as_columns_dot(b, &p[0], &p[1], params.padding, acc)?,
                // bias and rounding happen inside the kernel
                lower::Conv::CpuKernel(kernel) => return direct_conv(b, p, params.padding, kernel, dtype),
            };
            if let Some(bias) = p.get(2) {
                let bias = b.convert(bias, acc)?;
                let shape = y.dims().to_vec();
                let bias = b.broadcast_in_dim(&bias, shape, &[channel_dim])?;
                y = b.add(&y, &bias)?;
            }
            b.convert(&y, dtype)
        })
    }
}

/// A stride-1 channels-last convolution as `columns(x) · W`, with `W` the OIHW weight as a
/// `[kh·kw·I, O]` matrix in the columns' tap order.
fn conv_as_columns_dot(b: &mut Builder, x: &Value, w: &Value, padding: usize, acc: DType) -> kiln_hlo::Result<Value> {
    let (o, i, kh, kw) = (w.dims()[0], w.dims()[1], w.dims()[2], w.dims()[3]);
    let [n, h, wd] = [x.dims()[0], x.dims()[1], x.dims()[2]];
    let columns_shape = vec![n, h + 2 * padding + 1 - kh, wd + 2 * padding + 1 - kw, kh * kw * i];
    let columns = b.ffi_call(
        Handler::Im2col.target(),
        &[x.clone(), w.clone()],
        columns_shape,
        x.dtype(),
    )?;
    let w = b.transpose(w, &[2, 3, 1, 0])?;
    let w = b.reshape(&w, vec![kh * kw * i, o])?;
    let dims = DotDims {
        lhs_contract: vec![3],
        rhs_contract: vec![0],
        ..Default::default()
    };
    b.dot_general(&columns, &w, &dims, acc)
}

/// A stride-1 channels-last convolution (input, OIHW weight, optional bias in `p`) as a native
/// kernel (`conv` or `winograd`), whose result is already biased and rounded to `dtype`.
fn direct_conv(b: &mut Builder, p: &[Value], padding: usize, kernel: Handler, dtype: DType) -> kiln_hlo::Result<Value> {
    let (x, w) = (p[0].dims(), p[1].dims());
    let grow = 2 * padding + 1;
    let shape = [x[0], x[1] + grow - w[2], x[2] + grow - w[3], w[0]];
    b.ffi_call(kernel.target(), p, shape, dtype)
}

/// A 1×1 channels-last convolution (stride 1, no padding, groups 1) as the dot it is:
/// `[N, H, W, C] · [O, C]ᵀ`. XLA:CPU runs a bf16 × bf16 → f32 dot on YNNPACK but widens a bf16
/// convolution to f32 first (1.7–2.4× slower, `benches/conv_bf16.rs`); the numbers are the same (exact
/// products, f32 sums).
fn pointwise_conv_as_dot(b: &mut Builder, x: &Value, w: &Value, acc: DType) -> kiln_hlo::Result<Value> {
    let (o, i) = (w.dims()[0], w.dims()[1]);
    let w = b.reshape(w, vec![o, i])?;
    let dims = DotDims {
        lhs_contract: vec![3],
        rhs_contract: vec![1],
        ..Default::default()
    };
    b.dot_general(x, &w, &dims, acc)
}

/// Shape and parameter checks of [`Tensor::conv2d`], so that errors name the op.
fn check_conv2d(op: &'static str, layout: ConvLayout, x: &Tensor, w: &Tensor, p: Conv2dParams) -> Result<()> {
    let (input, channel_dim, spatial) = match layout {
        ConvLayout::Nchw => ("NCHW", 1, [2, 3]),
        ConvLayout::Nhwc => ("NHWC", 3, [1, 2]),
    };
    if x.rank() != 4 || w.rank() != 4 {
        return Err(Error::invalid(
            op,
            format!(
                "needs an {input} input and an OIHW weight, got {} and {}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    if p.stride == 0 || p.dilation == 0 || p.groups == 0 {
        return Err(Error::invalid(
            op,
            format!(
                "stride, dilation and groups must be positive, got {}, {} and {}",
                p.stride, p.dilation, p.groups
            ),
        ));
    }
    let (c, o, i) = (x.dims()[channel_dim], w.dims()[0], w.dims()[1]);
    if c != i * p.groups || o % p.groups != 0 {
        return Err(Error::invalid(
            op,
            format!(
                "input {} does not fit weight {} with {} groups ({c} input channels, {i} per group)",
                x.shape(),
                w.shape(),
                p.groups
            ),
        ));
    }
    for (s, &dim) in spatial.iter().enumerate() {
        let (size, k) = (x.dims()[dim], w.dims()[2 + s]);
        if k == 0 || size.saturating_add(p.padding.saturating_mul(2)) < (k - 1).saturating_mul(p.dilation) + 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "the kernel of weight {} (dilation {}) does not fit input {} padded by {}",
                    w.shape(),
                    p.dilation,
                    x.shape(),
                    p.padding
                ),
            ));
        }
    }
    Ok(())
}

/// Stride, symmetric zero padding, dilation and groups of [`Tensor::conv2d`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub groups: usize,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Conv2dParams {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}
