//! Unary, binary (broadcasting), scalar, comparison and selection ops.

use kiln_hlo::{Builder, CompareDirection, Value};
use kiln_types::DType;

use super::emit::{broadcast_shapes, broadcast_to, full_like, gelu_erf, gelu_tanh, upcast, x_sigmoid};
use crate::dispatch::apply1;
use crate::error::{Error, Result};
use crate::lower::{self, cpu::Handler};
use crate::tensor::Tensor;

type BinaryFn = fn(&mut Builder, &Value, &Value) -> kiln_hlo::Result<Value>;

impl Tensor {
    fn unary(&self, op: &'static str, f: fn(&mut Builder, &Value) -> kiln_hlo::Result<Value>) -> Result<Tensor> {
        apply1(op, &[self], |b, p| f(b, &p[0]))
    }

    /// A unary float op computed in f32 and rounded once to the input dtype (torch's CPU kernels
    /// for bf16/f16 work this way).
    fn unary_f32(&self, op: &'static str, f: fn(&mut Builder, &Value) -> kiln_hlo::Result<Value>) -> Result<Tensor> {
        let dtype = self.dtype();
        if !dtype.is_float() {
            return Err(Error::invalid(
                op,
                format!("needs a floating-point tensor, got {dtype}"),
            ));
        }
        apply1(op, &[self], |b, p| {
            let x = upcast(b, &p[0])?;
            let y = f(b, &x)?;
            b.convert(&y, dtype)
        })
    }

    pub fn neg(&self) -> Result<Tensor> {
        self.unary("neg", Builder::negate)
    }
    pub fn abs(&self) -> Result<Tensor> {
        self.unary("abs", Builder::abs)
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_f32("exp", Builder::exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        self.unary_f32("log", Builder::log)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_f32("sqrt", Builder::sqrt)
    }
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary_f32("rsqrt", Builder::rsqrt)
    }
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary_f32("tanh", Builder::tanh)
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary_f32("sigmoid", Builder::logistic)
    }
    pub fn sin(&self) -> Result<Tensor> {
        self.unary_f32("sin", Builder::sin)
    }
    pub fn cos(&self) -> Result<Tensor> {
        self.unary_f32("cos", Builder::cos)
    }
    pub fn erf(&self) -> Result<Tensor> {
        self.unary_f32("erf", Builder::erf)
    }
    pub fn floor(&self) -> Result<Tensor> {
        self.unary_f32("floor", Builder::floor)
    }
    pub fn ceil(&self) -> Result<Tensor> {
        self.unary_f32("ceil", Builder::ceil)
    }
    /// Round half to even (`torch.round`, `numpy.round`).
    pub fn round(&self) -> Result<Tensor> {
        self.unary_f32("round", Builder::round_even)
    }
    pub fn square(&self) -> Result<Tensor> {
        apply1("square", &[self], |b, p| b.multiply(&p[0], &p[0]))
    }
    /// `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Tensor> {
        self.unary_f32("silu", |b, x| x_sigmoid(b, x, 1.0))
    }
    /// `x * sigmoid(1.702 x)` (CLIP).
    pub fn quick_gelu(&self) -> Result<Tensor> {
        self.unary_f32("quick_gelu", |b, x| x_sigmoid(b, x, 1.702))
    }
    /// Exact GELU, `0.5 x (1 + erf(x / sqrt 2))`.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary_f32("gelu", gelu_erf)
    }
    /// GELU with the tanh approximation (`approximate="tanh"`, also `gelu_new` in f32).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        match lower::gelu_tanh(self.device(), self.dtype(), self.is_traced(), self.numel()) {
            lower::GeluTanh::CpuKernel => {
                let dims = self.dims().to_vec();
                apply1("gelu_tanh", &[self], |b, p| {
                    b.ffi_call(Handler::Gelu.target(), p, dims, p[0].dtype())
                })
            }
            lower::GeluTanh::Xla => self.unary_f32("gelu_tanh", gelu_tanh),
        }
    }

    fn binary(&self, op: &'static str, rhs: &Tensor, f: BinaryFn) -> Result<Tensor> {
        if self.dtype() != rhs.dtype() {
            return Err(Error::DType {
                op,
                lhs: self.dtype(),
                rhs: rhs.dtype(),
            });
        }
        let shape = broadcast_shapes(self.dims(), rhs.dims()).ok_or_else(|| Error::Broadcast {
            op,
            lhs: self.shape().clone(),
            rhs: rhs.shape().clone(),
        })?;
        apply1(op, &[self, rhs], |b, p| {
            let x = broadcast_to(b, &p[0], &shape)?;
            let y = broadcast_to(b, &p[1], &shape)?;
            f(b, &x, &y)
        })
    }

    /// Elementwise `self + rhs` with broadcasting (both must have the same dtype).
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary("add", rhs, Builder::add)
    }
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary("sub", rhs, Builder::subtract)
    }
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary("mul", rhs, Builder::multiply)
    }
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary("div", rhs, Builder::divide)
    }
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary("maximum", rhs, Builder::maximum)
    }
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary("minimum", rhs, Builder::minimum)
    }
    pub fn pow(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary("pow", rhs, Builder::power)
    }

    fn scalar_op(&self, op: &'static str, value: f64, f: BinaryFn, scalar_first: bool) -> Result<Tensor> {
        apply1(op, &[self], |b, p| {
            let c = full_like(b, &p[0], value);
            if scalar_first {
                f(b, &c, &p[0])
            } else {
                f(b, &p[0], &c)
            }
        })
    }

    /// `self + value`, with `value` rounded to the tensor's dtype first (torch's rule for
    /// `bf16_tensor + python_float`). The value is part of the compiled program: for values that
    /// change from call to call, pass a scalar tensor to [`Tensor::add`] instead.
    pub fn add_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("add_scalar", value, Builder::add, false)
    }
    pub fn sub_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("sub_scalar", value, Builder::subtract, false)
    }
    /// `value - self`.
    pub fn rsub_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("rsub_scalar", value, Builder::subtract, true)
    }
    /// `self * value` in the tensor's dtype. (torch multiplies bf16 by a Python float in f32;
    /// use [`Tensor::mul_scalar_f32`] for that rounding.)
    pub fn mul_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("mul_scalar", value, Builder::multiply, false)
    }
    pub fn div_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("div_scalar", value, Builder::divide, false)
    }
    pub fn pow_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("pow_scalar", value, Builder::power, false)
    }
    pub fn maximum_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("maximum_scalar", value, Builder::maximum, false)
    }
    pub fn minimum_scalar(&self, value: f64) -> Result<Tensor> {
        self.scalar_op("minimum_scalar", value, Builder::minimum, false)
    }

    /// `self * value` computed in f32 and rounded once to the tensor's dtype — torch's CPU
    /// semantics for a 16-bit tensor times a Python float.
    pub fn mul_scalar_f32(&self, value: f64) -> Result<Tensor> {
        let dtype = self.dtype();
        apply1("mul_scalar_f32", &[self], |b, p| {
            let x = upcast(b, &p[0])?;
            let c = full_like(b, &x, value);
            let y = b.multiply(&x, &c)?;
            b.convert(&y, dtype)
        })
    }

    /// `self / value` computed in f32 and rounded once (torch, 16-bit tensor / Python float).
    pub fn div_scalar_f32(&self, value: f64) -> Result<Tensor> {
        let dtype = self.dtype();
        apply1("div_scalar_f32", &[self], |b, p| {
            let x = upcast(b, &p[0])?;
            let c = full_like(b, &x, value);
            let y = b.divide(&x, &c)?;
            b.convert(&y, dtype)
        })
    }

    /// `min(max(self, lo), hi)`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        apply1("clamp", &[self], |b, p| {
            let l = full_like(b, &p[0], lo);
            let h = full_like(b, &p[0], hi);
            let x = b.maximum(&p[0], &l)?;
            b.minimum(&x, &h)
        })
    }

    fn compare(&self, op: &'static str, rhs: &Tensor, dir: CompareDirection) -> Result<Tensor> {
        if self.dtype() != rhs.dtype() {
            return Err(Error::DType {
                op,
                lhs: self.dtype(),
                rhs: rhs.dtype(),
            });
        }
        let shape = broadcast_shapes(self.dims(), rhs.dims()).ok_or_else(|| Error::Broadcast {
            op,
            lhs: self.shape().clone(),
            rhs: rhs.shape().clone(),
        })?;
        apply1(op, &[self, rhs], |b, p| {
            let x = broadcast_to(b, &p[0], &shape)?;
            let y = broadcast_to(b, &p[1], &shape)?;
            b.compare(dir, &x, &y)
        })
    }

    /// Elementwise comparisons; the result is a `bool` tensor.
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare("eq", rhs, CompareDirection::Eq)
    }
    pub fn ne(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare("ne", rhs, CompareDirection::Ne)
    }
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare("lt", rhs, CompareDirection::Lt)
    }
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare("le", rhs, CompareDirection::Le)
    }
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare("gt", rhs, CompareDirection::Gt)
    }
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare("ge", rhs, CompareDirection::Ge)
    }

    /// `self ? on_true : on_false` elementwise; `self` is a bool tensor; all three broadcast.
    pub fn where_cond(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        let op = "where";
        if self.dtype() != DType::Bool {
            return Err(Error::invalid(
                op,
                format!("the condition must be bool, got {}", self.dtype()),
            ));
        }
        if on_true.dtype() != on_false.dtype() {
            return Err(Error::DType {
                op,
                lhs: on_true.dtype(),
                rhs: on_false.dtype(),
            });
        }
        let bad = |a: &Tensor, c: &Tensor| Error::Broadcast {
            op,
            lhs: a.shape().clone(),
            rhs: c.shape().clone(),
        };
        let s = broadcast_shapes(on_true.dims(), on_false.dims()).ok_or_else(|| bad(on_true, on_false))?;
        let s = broadcast_shapes(&s, self.dims()).ok_or_else(|| bad(self, on_true))?;
        apply1(op, &[self, on_true, on_false], |b, p| {
            let c = broadcast_to(b, &p[0], &s)?;
            let t = broadcast_to(b, &p[1], &s)?;
            let f = broadcast_to(b, &p[2], &s)?;
            b.select(&c, &t, &f)
        })
    }
}
