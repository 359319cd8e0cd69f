//! Attention on NVIDIA GPUs through cuDNN's fused flash attention: XLA's GPU compiler turns a
//! `stablehlo.custom_call @"__cudnn$fmhaSoftmax"` into one cuDNN kernel that never materialises the
//! `[B, H, Sq, Sk]` scores.
//!
//! The call's form (operands, results, layouts, `api_version`, the `backend_config` JSON) follows
//! JAX's own lowering of `jax.nn.dot_product_attention(..., implementation="cudnn")` for the
//! heads-first (BNTH) layout, read in `jax/_src/cudnn/fused_attention_stablehlo.py` of jax 0.11.1
//! (`create_dot_product_attention_backend_config`, `_dot_product_attention_fwd_cuda_lowering`,
//! `check_is_flash_attention`); see `../shared/design/cpu-kernels.md`, last section.
//!
//! **Unproven**: no kiln test has run this on a GPU yet. `kiln selftest --device cuda` checks it
//! against the f64 reference, and `scripts/gpu-check` saves JAX's lowering of one call next to
//! kiln's so the two can be compared on the machine that has the plugin. Setting
//! `KILN_CUDNN_ATTENTION=0` turns it off (the plain lowering is used everywhere).

use std::fmt::Write;
use std::sync::OnceLock;

use kiln_hlo::{Builder, CustomCall, Value};
use kiln_pjrt::{NamedValue, Platform};
use kiln_types::{DType, Shape};

use crate::device::Device;

/// The custom-call target of cuDNN's fused attention forward pass without bias or dropout.
pub(crate) const TARGET: &str = "__cudnn$fmhaSoftmax";

/// A fused attention call: `softmax(scale · q kᵀ [+ causal mask]) v` on heads-first tensors
/// `q` `[batch, heads, q_len, head_dim]`, `k` and `v` `[batch, heads, kv_len, head_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct FusedAttention {
    pub batch: usize,
    pub heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
    pub dtype: DType,
    pub scale: f64,
    pub causal: bool,
}

/// What the lowering needs to know about the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub platform: Platform,
    /// The GPU's compute capability (major, minor), when the plugin reports it.
    pub compute_capability: Option<(u32, u32)>,
}

impl Target {
    pub(crate) fn of(device: &Device) -> Target {
        let compute_capability = match device.platform() {
            Platform::Cuda => device
                .pjrt()
                .attributes()
                .iter()
                .find(|(name, _)| name == "compute_capability")
                .and_then(|(_, v)| match v {
                    NamedValue::String(s) => parse_capability(s),
                    _ => None,
                }),
            _ => None,
        };
        Target {
            platform: device.platform(),
            compute_capability,
        }
    }
}

fn parse_capability(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Whether `KILN_CUDNN_ATTENTION` allows the fused lowering (anything but `0`/`off`/`false`).
fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| match std::env::var("KILN_CUDNN_ATTENTION").as_deref() {
        Ok("0") | Ok("off") | Ok("false") => false,
        Ok("1") | Ok("on") | Ok("true") | Err(_) => true,
        Ok(other) => {
            tracing::warn!("KILN_CUDNN_ATTENTION={other} is not one of 1, on, true, 0, off, false; using on");
            true
        }
    })
}

impl FusedAttention {
    /// The fused call for these inputs on `target`, or `None` when the plain lowering must be used:
    /// not a CUDA device, not bf16/f16, a head dim cuDNN's flash attention does not take (a
    /// multiple of 8, at most 128, or 256 from compute capability 9.0 on, as JAX checks), a value
    /// head dim other than the query's, an additive mask, or a causal mask on a non-square
    /// score matrix (cuDNN's causal mask is aligned differently from kiln's there).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn plan(
        target: Target,
        q: &[usize],
        k: &[usize],
        v: &[usize],
        dtype: DType,
        additive_mask: bool,
        causal: bool,
        scale: f64,
    ) -> Option<FusedAttention> {
        if target.platform != Platform::Cuda || !enabled() {
            return None;
        }
        if !matches!(dtype, DType::BF16 | DType::F16) || additive_mask {
            return None;
        }
        let (&[batch, heads, q_len, head_dim], &[_, _, kv_len, _], &[.., v_dim]) = (q, k, v) else {
            return None;
        };
        let max_head_dim = match target.compute_capability {
            Some((major, _)) if major >= 9 => 256,
            _ => 128,
        };
        if head_dim % 8 != 0 || head_dim > max_head_dim || v_dim != head_dim {
            return None;
        }
        if causal && q_len != kv_len {
            return None;
        }
        Some(FusedAttention {
            batch,
            heads,
            q_len,
            kv_len,
            head_dim,
            dtype,
            scale,
            causal,
        })
    }

    /// The `backend_config` JSON, key for key and in the order JAX writes it (`json.dumps`).
    pub(crate) fn backend_config(&self) -> String {
        let element_type = if self.dtype == DType::F16 { "F16" } else { "BF16" };
        let mask = if self.causal { "CAUSAL" } else { "NO_MASK" };
        let dims = |lc: usize, rc: usize| {
            format!(
                "{{\"lhs_contracting_dimensions\": [\"{lc}\"], \"rhs_contracting_dimensions\": [\"{rc}\"], \
                 \"lhs_batch_dimensions\": [\"0\", \"1\"], \"rhs_batch_dimensions\": [\"0\", \"1\"]}}"
            )
        };
        let mut s = String::with_capacity(1200);
        s.push_str("{\"operation_queue_id\": \"0\", \"cudnn_fmha_backend_config\": {");
        s.push_str(
            "\"algorithm\": {\"algo_id\": \"0\", \"math_type\": \"TENSOR_OP_MATH\", \
             \"tuning_knobs\": {\"17\": \"1\", \"24\": \"0\"}, \"is_cudnn_frontend\": true, \
             \"workspace_size\": \"0\"}, ",
        );
        let _ = write!(s, "\"fmha_scale\": {}, ", json_float(self.scale));
        let _ = write!(
            s,
            "\"intermediate_tensor_shape\": {{\"element_type\": \"{element_type}\", \
             \"dimensions\": [\"{}\", \"{}\", \"{}\", \"{}\"], \"tuple_shapes\": [], \
             \"layout\": {{\"dim_level_types\": [], \"dim_unique\": [], \"dim_ordered\": [], \
             \"minor_to_major\": [\"3\", \"2\", \"1\", \"0\"], \"tiles\": [], \
             \"element_size_in_bits\": \"0\", \"memory_space\": \"0\", \
             \"index_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \
             \"pointer_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \
             \"dynamic_shape_metadata_prefix_bytes\": \"0\"}}, \
             \"is_dynamic_dimension\": [false, false, false, false]}}, ",
            self.batch, self.heads, self.q_len, self.kv_len
        );
        let _ = write!(s, "\"is_flash_attention\": true, \"mask_type\": \"{mask}\", ");
        // BNTH: BMM1 q[B,N,T,H]·k[B,N,S,H] -> [B,N,T,S]; BMM2 p[B,N,T,S]·v[B,N,S,H] -> [B,N,T,H].
        let _ = write!(
            s,
            "\"bmm1_dot_dimension_numbers\": {}, \"bmm2_dot_dimension_numbers\": {}, ",
            dims(3, 3),
            dims(3, 2)
        );
        s.push_str(
            "\"dropout_rate\": 0.0, \"seed\": 42, \"sliding_window_length\": 0, \
             \"max_seg_per_batch\": 1, \"is_paged_attention\": false}}",
        );
        s
    }

    /// Emits the call on q, k, v (unscaled: the scale is the call's `fmha_scale`) and returns the
    /// `[batch, heads, q_len, head_dim]` output in the input dtype. The second result, a `ui8[0]`
    /// workspace, is dropped.
    pub(crate) fn emit(&self, b: &mut Builder, q: &Value, k: &Value, v: &Value) -> kiln_hlo::Result<Value> {
        let row_major = vec![3, 2, 1, 0];
        let call = CustomCall {
            target: TARGET.to_string(),
            api_version: 2,
            backend_config: self.backend_config(),
            operand_layouts: vec![row_major.clone(); 3],
            result_layouts: vec![row_major, vec![0]],
        };
        let out_shape = Shape::new(vec![self.batch, self.heads, self.q_len, self.head_dim]);
        let results = b.custom_call_full(
            &call,
            &[q.clone(), k.clone(), v.clone()],
            &[(out_shape, self.dtype), (Shape::new(vec![0]), DType::U8)],
        )?;
        Ok(results.into_iter().next().expect("the call has two results"))
    }
}

/// A float as Python's `json.dumps` writes it (shortest round-trip digits, always with a `.`
/// or an exponent).
fn json_float(x: f64) -> String {
    let s = format!("{x:?}");
    if s.contains(['.', 'e', 'E']) || !x.is_finite() {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: Target = Target {
        platform: Platform::Cuda,
        compute_capability: Some((9, 0)),
    };

    fn plan(target: Target, q: [usize; 4], k: [usize; 4], dtype: DType, causal: bool) -> Option<FusedAttention> {
        FusedAttention::plan(target, &q, &k, &k, dtype, false, causal, 0.125)
    }

    #[test]
    fn cuda_bf16_attention_lowers_to_the_cudnn_call_with_jax_backend_config() {
        // FLUX.1's joint attention at 1024²: 24 heads of 128, 4096 image + 512 text tokens.
        let fused = plan(H200, [1, 24, 4608, 128], [1, 24, 4608, 128], DType::BF16, false).unwrap();
        let mut b = Builder::new();
        let q = b.parameter([1, 24, 4608, 128], DType::BF16);
        let k = b.parameter([1, 24, 4608, 128], DType::BF16);
        let v = b.parameter([1, 24, 4608, 128], DType::BF16);
        let out = fused.emit(&mut b, &q, &k, &v).unwrap();
        assert_eq!(out.dims(), &[1, 24, 4608, 128]);
        let text = b.finish(&[out]).unwrap();
        let t = "tensor<1x24x4608x128xbf16>";
        assert!(
            text.contains(
                "%v3:2 = stablehlo.custom_call @\"__cudnn$fmhaSoftmax\"(%v0, %v1, %v2) {api_version = 2 : i32, backend_config = \""
            ),
            "{text}"
        );
        let layouts = "operand_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<[3, 2, 1, 0]> : tensor<4xindex>, \
                       dense<[3, 2, 1, 0]> : tensor<4xindex>], result_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>, \
                       dense<[0]> : tensor<1xindex>]";
        assert!(text.contains(layouts), "{text}");
        assert!(
            text.contains(&format!(": ({t}, {t}, {t}) -> ({t}, tensor<0xui8>)")),
            "{text}"
        );
        assert!(text.contains(&format!("return %v3#0 : {t}")), "{text}");
        // The JSON itself, as cpu-kernels.md lists its fields (escaped inside the attribute).
        let config = fused.backend_config();
        for part in [
            r#""operation_queue_id": "0""#,
            r#""algorithm": {"algo_id": "0", "math_type": "TENSOR_OP_MATH", "tuning_knobs": {"17": "1", "24": "0"}, "is_cudnn_frontend": true, "workspace_size": "0"}"#,
            r#""fmha_scale": 0.125"#,
            r#""element_type": "BF16", "dimensions": ["1", "24", "4608", "4608"]"#,
            r#""minor_to_major": ["3", "2", "1", "0"]"#,
            r#""is_flash_attention": true, "mask_type": "NO_MASK""#,
            r#""bmm1_dot_dimension_numbers": {"lhs_contracting_dimensions": ["3"], "rhs_contracting_dimensions": ["3"], "lhs_batch_dimensions": ["0", "1"], "rhs_batch_dimensions": ["0", "1"]}"#,
            r#""bmm2_dot_dimension_numbers": {"lhs_contracting_dimensions": ["3"], "rhs_contracting_dimensions": ["2"], "lhs_batch_dimensions": ["0", "1"], "rhs_batch_dimensions": ["0", "1"]}"#,
            r#""dropout_rate": 0.0, "seed": 42, "sliding_window_length": 0, "max_seg_per_batch": 1, "is_paged_attention": false"#,
        ] {
            assert!(config.contains(part), "{part} not in {config}");
            let escaped = part.replace('"', "\\\"");
            assert!(text.contains(&escaped), "{escaped} not in {text}");
        }
        // Balanced JSON: every brace closes.
        assert_eq!(config.matches('{').count(), config.matches('}').count());
    }

    #[test]
    fn causal_f16_and_the_limits_of_the_fused_path() {
        let causal = plan(H200, [2, 12, 77, 64], [2, 12, 77, 64], DType::F16, true).unwrap();
        assert!(causal.backend_config().contains(r#""element_type": "F16""#));
        assert!(causal.backend_config().contains(r#""mask_type": "CAUSAL""#));
        // Not on CPU or TPU, not in f32, not with a bias, not for a non-square causal mask.
        for platform in [Platform::Cpu, Platform::Tpu] {
            let t = Target {
                platform,
                compute_capability: None,
            };
            assert_eq!(plan(t, [1, 2, 8, 64], [1, 2, 8, 64], DType::BF16, false), None);
        }
        assert_eq!(plan(H200, [1, 2, 8, 64], [1, 2, 8, 64], DType::F32, false), None);
        assert_eq!(
            FusedAttention::plan(
                H200,
                &[1, 2, 8, 64],
                &[1, 2, 8, 64],
                &[1, 2, 8, 64],
                DType::BF16,
                true,
                false,
                0.1
            ),
            None
        );
        assert_eq!(plan(H200, [1, 2, 8, 64], [1, 2, 16, 64], DType::BF16, true), None);
        assert!(plan(H200, [1, 2, 8, 64], [1, 2, 16, 64], DType::BF16, false).is_some());
        // Head dims: multiples of 8 up to 128, up to 256 from compute capability 9.0.
        let ampere = Target {
            platform: Platform::Cuda,
            compute_capability: Some((8, 0)),
        };
        assert_eq!(plan(ampere, [1, 1, 8, 256], [1, 1, 8, 256], DType::BF16, false), None);
        assert!(plan(H200, [1, 1, 8, 256], [1, 1, 8, 256], DType::BF16, false).is_some());
        assert_eq!(plan(H200, [1, 1, 8, 512], [1, 1, 8, 512], DType::BF16, false), None);
        assert_eq!(plan(H200, [1, 1, 8, 36], [1, 1, 8, 36], DType::BF16, false), None);
        // A value head dim other than the query's.
        assert_eq!(
            FusedAttention::plan(
                H200,
                &[1, 2, 8, 64],
                &[1, 2, 8, 64],
                &[1, 2, 8, 32],
                DType::BF16,
                false,
                false,
                0.1
            ),
            None
        );
    }

    #[test]
    fn the_cuda_text_parses_in_xla_and_cpu_keeps_the_plain_lowering() {
        let device = Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)");
        // The CPU plugin parses and verifies the module, then finds no Host kernel for the target:
        // so the text is valid StableHLO, only the backend is missing.
        let fused = plan(H200, [1, 2, 8, 16], [1, 2, 8, 16], DType::BF16, false).unwrap();
        let mut b = Builder::new();
        let p: Vec<Value> = (0..3).map(|_| b.parameter([1, 2, 8, 16], DType::BF16)).collect();
        let out = fused.emit(&mut b, &p[0], &p[1], &p[2]).unwrap();
        let text = b.finish(&[out]).unwrap();
        let err = device
            .client()
            .compile(&text, &kiln_pjrt::CompileOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(TARGET), "{err}");
        assert!(!err.to_lowercase().contains("parse"), "{err}");
        // On the CPU device the same bf16 attention takes the plain lowering: it compiles and runs
        // (the fused call would fail to compile there, as above), eager and traced.
        assert_eq!(Target::of(&device).platform, Platform::Cpu);
        let t = |seed: f32| {
            let data: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
            crate::Tensor::from_f32(&data, DType::BF16, [1, 2, 8, 16], &device).unwrap()
        };
        let (q, k, v) = (t(0.1), t(0.2), t(0.3));
        let attention = |a: &[crate::Tensor]| {
            crate::Tensor::scaled_dot_product_attention(&a[0], &a[1], &a[2], &crate::AttentionMask::None, None)
        };
        let eager = attention(&[q.clone(), k.clone(), v.clone()]).unwrap();
        let traced = crate::CompiledFunction::new("attention_cpu")
            .call(&[q, k, v], |a| attention(a).map(|o| vec![o]))
            .unwrap();
        assert_eq!(eager.to_f32_vec().unwrap(), traced[0].to_f32_vec().unwrap());
    }

    #[test]
    fn floats_are_written_as_python_json_writes_them() {
        assert_eq!(json_float(0.125), "0.125");
        assert_eq!(json_float(1.0), "1.0");
        assert_eq!(json_float(1.0 / 128f64.sqrt()), "0.08838834764831843"); // python: 1/math.sqrt(128)
        assert_eq!(parse_capability("9.0"), Some((9, 0)));
        assert_eq!(parse_capability("sm_90"), None);
    }
}
