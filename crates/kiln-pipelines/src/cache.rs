//! Step caching as diffusers' hooks define it (`FirstBlockCacheConfig`, `TaylorSeerCacheConfig`,
//! `MagCacheConfig`, `FasterCacheConfig`): the settings, parsed from `KIND:FIELD=VALUE,...` or a
//! JSON object, and the decisions that depend on no data — MagCache's, TaylorSeer's and
//! FasterCache's schedules are functions of the settings and the step (First-Block Cache's
//! decision reads the first block's residual each step).
//!
//! [`CacheRun`] runs them: one state per CFG branch (diffusers' `cache_context`), the residuals
//! (First-Block Cache, MagCache), the Taylor factors (TaylorSeer) and the last two attention
//! outputs (FasterCache) the cached calls are served from.

use serde_json::{Map, Value};

/// diffusers' shipped FLUX.1 magnitude ratios (`diffusers.hooks.mag_cache.FLUX_MAG_RATIOS`), for
/// 28 steps: MagCache's default here, as every oracle case passes them.
pub const FLUX_MAG_RATIOS: [f32; 28] = [
    1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344, 0.98047, 1.01562,
    1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484, 0.95703, 0.93359,
    0.89062,
];

/// A step cache's settings, with diffusers' field names and defaults.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheConfig {
    /// `FirstBlockCacheConfig`: the remaining blocks run iff the first block's residual changed by
    /// more than `threshold` (relative mean absolute change) since the last computed call.
    FirstBlock { threshold: f64 },
    /// `TaylorSeerCacheConfig`: the attention outputs extrapolated between computed steps.
    TaylorSeer {
        cache_interval: usize,
        disable_cache_before_step: usize,
        disable_cache_after_step: Option<usize>,
        max_order: usize,
        /// `true`: the factors are kept in bfloat16 (diffusers' default), else float32.
        bfloat16_factors: bool,
    },
    /// `MagCacheConfig`: whole calls skipped while the accumulated magnitude-ratio error stays
    /// under `threshold`; with `calibrate`, every call computed and the ratios measured.
    MagCache {
        threshold: f64,
        max_skip_steps: usize,
        retention_ratio: f64,
        num_inference_steps: usize,
        mag_ratios: Vec<f32>,
        calibrate: bool,
    },
    /// `FasterCacheConfig` in its guidance-distilled mode: attention outputs approximated from the
    /// last two inside the timestep range, recomputed every `block_skip_range` calls.
    Faster {
        block_skip_range: usize,
        timestep_skip_range: (f64, f64),
        is_guidance_distilled: bool,
    },
}

impl CacheConfig {
    /// `KIND[:FIELD=VALUE,...]` (list values joined with `;`), e.g. `first-block:threshold=0.12`.
    pub fn parse(text: &str) -> Result<CacheConfig, String> {
        let (kind, fields) = text.split_once(':').unwrap_or((text, ""));
        let mut map = Map::new();
        for field in fields.split(',').filter(|f| !f.trim().is_empty()) {
            let (name, value) = field
                .split_once('=')
                .ok_or_else(|| format!("`{field}` is not FIELD=VALUE"))?;
            let value = value.trim();
            let item = |v: &str| -> Value {
                match v {
                    "True" | "true" => Value::Bool(true),
                    "False" | "false" => Value::Bool(false),
                    "None" | "none" => Value::Null,
                    _ => v
                        .parse::<f64>()
                        .ok()
                        .and_then(serde_json::Number::from_f64)
                        .map_or_else(|| Value::String(v.to_string()), Value::Number),
                }
            };
            let value = match value.contains(';') {
                true => Value::Array(value.split(';').map(|v| item(v.trim())).collect()),
                false => item(value),
            };
            if map.insert(name.trim().to_string(), value).is_some() {
                return Err(format!("`{}` is given twice", name.trim()));
            }
        }
        CacheConfig::from_fields(kind.trim(), &map)
    }

    /// `{"kind": KIND, FIELD: VALUE, ...}` (the server's `cache` object).
    pub fn from_json(value: &Value) -> Result<CacheConfig, String> {
        let map = value
            .as_object()
            .ok_or_else(|| format!("must be an object with `kind`, got {value}"))?;
        let kind = map
            .get("kind")
            .and_then(Value::as_str)
            .ok_or("needs `kind`: first-block, taylorseer, magcache or faster")?;
        let mut fields = map.clone();
        fields.remove("kind");
        CacheConfig::from_fields(kind, &fields)
    }

    /// The settings as `{"kind": KIND, FIELD: VALUE, ...}` (every field, defaults included).
    pub fn to_json(&self) -> Value {
        match self {
            CacheConfig::FirstBlock { threshold } => serde_json::json!({"kind": "first-block", "threshold": threshold}),
            CacheConfig::TaylorSeer {
                cache_interval,
                disable_cache_before_step,
                disable_cache_after_step,
                max_order,
                bfloat16_factors,
            } => serde_json::json!({
                "kind": "taylorseer",
                "cache_interval": cache_interval,
                "disable_cache_before_step": disable_cache_before_step,
                "disable_cache_after_step": disable_cache_after_step,
                "max_order": max_order,
                "taylor_factors_dtype": if *bfloat16_factors { "bfloat16" } else { "float32" },
            }),
            CacheConfig::MagCache {
                threshold,
                max_skip_steps,
                retention_ratio,
                num_inference_steps,
                mag_ratios,
                calibrate,
            } => serde_json::json!({
                "kind": "magcache",
                "threshold": threshold,
                "max_skip_steps": max_skip_steps,
                "retention_ratio": retention_ratio,
                "num_inference_steps": num_inference_steps,
                "mag_ratios": mag_ratios,
                "calibrate": calibrate,
            }),
            CacheConfig::Faster {
                block_skip_range,
                timestep_skip_range: (lo, hi),
                is_guidance_distilled,
            } => serde_json::json!({
                "kind": "faster",
                "spatial_attention_block_skip_range": block_skip_range,
                "spatial_attention_timestep_skip_range": [lo, hi],
                "is_guidance_distilled": is_guidance_distilled,
            }),
        }
    }

    /// The hook's name as the command line gives it.
    pub fn kind(&self) -> &'static str {
        match self {
            CacheConfig::FirstBlock { .. } => "first-block",
            CacheConfig::TaylorSeer { .. } => "taylorseer",
            CacheConfig::MagCache { .. } => "magcache",
            CacheConfig::Faster { .. } => "faster",
        }
    }

    fn from_fields(kind: &str, fields: &Map<String, Value>) -> Result<CacheConfig, String> {
        let mut f = Fields {
            kind,
            fields,
            used: Vec::new(),
        };
        let config = match kind {
            "first-block" => CacheConfig::FirstBlock {
                threshold: f.number("threshold", 0.05)?,
            },
            "taylorseer" => {
                let dtype = f.text("taylor_factors_dtype", "bfloat16")?;
                let bfloat16_factors = match dtype.trim_start_matches("torch.") {
                    "bfloat16" => true,
                    "float32" => false,
                    other => return Err(format!("`taylor_factors_dtype` is bfloat16 or float32, not {other}")),
                };
                CacheConfig::TaylorSeer {
                    cache_interval: f.count("cache_interval", 5)?,
                    disable_cache_before_step: f.count("disable_cache_before_step", 3)?,
                    disable_cache_after_step: f.optional_count("disable_cache_after_step")?,
                    max_order: f.count("max_order", 1)?,
                    bfloat16_factors,
                }
            }
            "magcache" => CacheConfig::MagCache {
                threshold: f.number("threshold", 0.06)?,
                max_skip_steps: f.count("max_skip_steps", 3)?,
                retention_ratio: f.number("retention_ratio", 0.2)?,
                num_inference_steps: f.count("num_inference_steps", 28)?,
                mag_ratios: f
                    .numbers("mag_ratios")?
                    .map_or_else(|| FLUX_MAG_RATIOS.to_vec(), |v| v.iter().map(|&x| x as f32).collect()),
                calibrate: f.flag("calibrate", false)?,
            },
            "faster" => {
                let range = f
                    .numbers("spatial_attention_timestep_skip_range")?
                    .unwrap_or(vec![-1.0, 681.0]);
                let [lo, hi] = range[..] else {
                    return Err("`spatial_attention_timestep_skip_range` takes two numbers, LOW;HIGH".into());
                };
                let _ = f.text("tensor_format", "BCHW")?;
                CacheConfig::Faster {
                    block_skip_range: f.count("spatial_attention_block_skip_range", 2)?,
                    timestep_skip_range: (lo, hi),
                    is_guidance_distilled: f.flag("is_guidance_distilled", false)?,
                }
            }
            other => {
                return Err(format!(
                    "unknown cache kind `{other}`: first-block, taylorseer, magcache or faster"
                ))
            }
        };
        if let Some(unknown) = fields.keys().find(|k| !f.used.contains(&k.as_str())) {
            return Err(format!("`{unknown}` is not a field of the {kind} cache"));
        }
        config.check()?;
        Ok(config)
    }

    /// diffusers' checks of the settings, and the ones its hooks would trip on later.
    fn check(&self) -> Result<(), String> {
        match self {
            CacheConfig::FirstBlock { threshold } if *threshold < 0.0 => {
                Err(format!("`threshold` must be at least 0, got {threshold}"))
            }
            CacheConfig::TaylorSeer { cache_interval: 0, .. } => Err("`cache_interval` must be at least 1".into()),
            CacheConfig::TaylorSeer {
                cache_interval,
                disable_cache_before_step: 0,
                ..
            } if *cache_interval > 1 => {
                Err("`disable_cache_before_step` 0 would extrapolate step 0 from nothing: give at least 1".into())
            }
            CacheConfig::MagCache {
                threshold,
                retention_ratio,
                num_inference_steps,
                mag_ratios,
                ..
            } => {
                if *threshold < 0.0 {
                    return Err(format!("`threshold` must be at least 0, got {threshold}"));
                }
                if !(0.0..=1.0).contains(retention_ratio) {
                    return Err(format!("`retention_ratio` must be in [0, 1], got {retention_ratio}"));
                }
                if *num_inference_steps == 0 || mag_ratios.is_empty() {
                    return Err("`num_inference_steps` and `mag_ratios` must not be empty or 0".into());
                }
                Ok(())
            }
            CacheConfig::Faster {
                block_skip_range: 0, ..
            } => Err("`spatial_attention_block_skip_range` must be at least 1".into()),
            CacheConfig::Faster {
                is_guidance_distilled: false,
                ..
            } => Err(
                "FasterCache's guidance (non-distilled) mode is not implemented: give is_guidance_distilled=True"
                    .into(),
            ),
            _ => Ok(()),
        }
    }

    /// MagCache: its ratios for `num_inference_steps` steps — nearest interpolation,
    /// `round(i·(L−1)/(n−1))` with ties to even (torch.round).
    pub fn magcache_ratios(mag_ratios: &[f32], steps: usize) -> Vec<f32> {
        let len = mag_ratios.len();
        match (len, steps) {
            (0, _) => Vec::new(),
            (_, 1) => vec![mag_ratios[len - 1]],
            (l, n) if l == n => mag_ratios.to_vec(),
            (l, n) => {
                let scale = (l - 1) as f64 / (n - 1) as f64;
                (0..n)
                    .map(|i| {
                        let x = (i as f32) * scale as f32;
                        mag_ratios[(x.round_ties_even() as usize).min(l - 1)]
                    })
                    .collect()
            }
        }
    }

    /// The steps whose transformer call is served from the cache, when that depends on no data
    /// (MagCache, TaylorSeer, FasterCache), for a call of `timesteps`; `None` for First-Block
    /// Cache, whose decision reads the first block's residual.
    pub fn planned_hits(&self, timesteps: &[f32]) -> Option<Vec<bool>> {
        let steps = timesteps.len();
        match self {
            CacheConfig::FirstBlock { .. } => None,
            CacheConfig::TaylorSeer {
                cache_interval,
                disable_cache_before_step: before,
                disable_cache_after_step: after,
                ..
            } => Some(
                (0..steps)
                    .map(|s| {
                        let computes = s < *before
                            || (s as i64 - *before as i64 - 1).rem_euclid(*cache_interval as i64) == 0
                            || after.is_some_and(|a| s >= a);
                        !computes
                    })
                    .collect(),
            ),
            CacheConfig::MagCache {
                threshold,
                max_skip_steps,
                retention_ratio,
                num_inference_steps,
                mag_ratios,
                calibrate,
            } => {
                // Calibration never skips.
                if *calibrate {
                    return Some(vec![false; steps]);
                }
                let ratios = CacheConfig::magcache_ratios(mag_ratios, *num_inference_steps);
                let retention = (retention_ratio * *num_inference_steps as f64 + 0.5) as usize;
                let (mut acc_ratio, mut acc_steps, mut acc_err) = (1.0f32, 0usize, 0.0f32);
                let mut has_residual = false;
                Some(
                    (0..steps)
                        .map(|i| {
                            // The state resets every `num_inference_steps` calls.
                            let s = i % num_inference_steps;
                            if s == 0 {
                                (acc_ratio, acc_steps, acc_err, has_residual) = (1.0, 0, 0.0, false);
                            }
                            if s < retention {
                                has_residual = true;
                                return false;
                            }
                            acc_ratio *= ratios.get(s).copied().unwrap_or(1.0);
                            acc_steps += 1;
                            acc_err += (1.0 - acc_ratio).abs();
                            let skip = has_residual && f64::from(acc_err) <= *threshold && acc_steps <= *max_skip_steps;
                            if !skip {
                                (acc_ratio, acc_steps, acc_err) = (1.0, 0, 0.0);
                                has_residual = true;
                            }
                            skip
                        })
                        .collect(),
                )
            }
            CacheConfig::Faster {
                block_skip_range,
                timestep_skip_range: (lo, hi),
                ..
            } => Some(
                timesteps
                    .iter()
                    .enumerate()
                    .map(|(iteration, &t)| {
                        let t = f64::from(t);
                        *lo < t && t < *hi && !(iteration > 0 && iteration % block_skip_range == 0)
                    })
                    .collect(),
            ),
        }
    }
}

/// A cache's fields as given, read by name with their defaults (the names read are kept, so that
/// an unknown one is an error).
struct Fields<'a> {
    kind: &'a str,
    fields: &'a Map<String, Value>,
    used: Vec<&'static str>,
}

impl Fields<'_> {
    fn get(&mut self, name: &'static str) -> Option<&Value> {
        self.used.push(name);
        self.fields.get(name).filter(|v| !v.is_null())
    }

    fn number(&mut self, name: &'static str, default: f64) -> Result<f64, String> {
        let kind = self.kind;
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| format!("`{name}` of the {kind} cache must be a number, got {v}")),
        }
    }

    fn optional_count(&mut self, name: &'static str) -> Result<Option<usize>, String> {
        let kind = self.kind;
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x >= 0.0 && x.fract() == 0.0 && x <= 1e9 => Ok(Some(x as usize)),
                _ => Err(format!(
                    "`{name}` of the {kind} cache must be a whole number ≥ 0, got {v}"
                )),
            },
        }
    }

    fn count(&mut self, name: &'static str, default: usize) -> Result<usize, String> {
        Ok(self.optional_count(name)?.unwrap_or(default))
    }

    fn numbers(&mut self, name: &'static str) -> Result<Option<Vec<f64>>, String> {
        let kind = self.kind;
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_f64().filter(|x| x.is_finite()))
                .collect::<Option<Vec<f64>>>()
                .map(Some)
                .ok_or_else(|| format!("`{name}` of the {kind} cache must be numbers (A;B;...)")),
            Some(v) => Err(format!(
                "`{name}` of the {kind} cache must be a list of numbers (A;B;...), got {v}"
            )),
        }
    }

    fn flag(&mut self, name: &'static str, default: bool) -> Result<bool, String> {
        let kind = self.kind;
        match self.get(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(format!("`{name}` of the {kind} cache is True or False, got {v}")),
        }
    }

    fn text(&mut self, name: &'static str, default: &str) -> Result<String, String> {
        match self.get(name) {
            None => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Ok(v.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_with_diffusers_names_and_defaults() {
        assert_eq!(
            CacheConfig::parse("first-block:threshold=0.12").unwrap(),
            CacheConfig::FirstBlock { threshold: 0.12 }
        );
        assert_eq!(
            CacheConfig::parse("taylorseer").unwrap(),
            CacheConfig::TaylorSeer {
                cache_interval: 5,
                disable_cache_before_step: 3,
                disable_cache_after_step: None,
                max_order: 1,
                bfloat16_factors: true,
            }
        );
        let faster = CacheConfig::parse(
            "faster:spatial_attention_block_skip_range=4,spatial_attention_timestep_skip_range=200;990,is_guidance_distilled=True,tensor_format=BCHW",
        )
        .unwrap();
        assert_eq!(
            faster,
            CacheConfig::Faster {
                block_skip_range: 4,
                timestep_skip_range: (200.0, 990.0),
                is_guidance_distilled: true
            }
        );
        let json = serde_json::json!({"kind": "first-block", "threshold": 0.2});
        assert_eq!(
            CacheConfig::from_json(&json).unwrap(),
            CacheConfig::FirstBlock { threshold: 0.2 }
        );
    }

    #[test]
    fn bad_settings_are_named() {
        for (text, expected) in [
            ("tea", "unknown cache kind `tea`"),
            ("first-block:threshold=-1", "`threshold` must be at least 0"),
            (
                "first-block:thresh=1",
                "`thresh` is not a field of the first-block cache",
            ),
            ("first-block:threshold", "`threshold` is not FIELD=VALUE"),
            (
                "first-block:threshold=x",
                "`threshold` of the first-block cache must be a number",
            ),
            ("taylorseer:cache_interval=0", "`cache_interval` must be at least 1"),
            ("taylorseer:max_order=1.5", "must be a whole number"),
            ("magcache:retention_ratio=2", "`retention_ratio` must be in [0, 1]"),
            ("faster:is_guidance_distilled=False", "not implemented"),
            ("first-block:threshold=1,threshold=2", "given twice"),
        ] {
            let err = CacheConfig::parse(text).unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn magcache_calibration_never_skips() {
        let config = CacheConfig::parse("magcache:calibrate=true,num_inference_steps=4").unwrap();
        assert!(matches!(config, CacheConfig::MagCache { calibrate: true, .. }));
        assert_eq!(config.to_json()["calibrate"], true);
        assert_eq!(CacheConfig::from_json(&config.to_json()).unwrap(), config);
        assert_eq!(config.planned_hits(&[0.0; 6]).unwrap(), [false; 6]);
    }

    #[test]
    fn magcache_ratios_interpolate_with_ties_to_even() {
        let src: Vec<f32> = (0..28).map(|i| i as f32).collect();
        let ten = CacheConfig::magcache_ratios(&src, 10);
        assert_eq!(ten, [0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0, 24.0, 27.0]);
        // n = 19: 1.5 → 2, 4.5 → 4 (torch.round).
        let nineteen = CacheConfig::magcache_ratios(&src, 19);
        assert_eq!(nineteen[1], 2.0);
        assert_eq!(nineteen[3], 4.0);
        assert_eq!(CacheConfig::magcache_ratios(&src, 1), [27.0]);
    }
}

/// A call's step cache as it runs: the settings, the planned decisions (when they depend on no
/// data) and one state per branch (diffusers' `cache_context`: `cond`, `uncond`), fresh for
/// every pipeline call, with the count of transformer calls served from the cache.
pub(crate) struct CacheRun {
    pub config: CacheConfig,
    planned: Option<Vec<bool>>,
    branches: [BranchState; 2],
    /// The call's timesteps (FasterCache compares each call's with its range).
    timesteps: Vec<f32>,
    /// FasterCache's state, kept on diffusers' hooks and so shared by the branches.
    faster: FasterState,
    pub served: usize,
    pub calls: usize,
}

/// FasterCache's state (per attention module in diffusers; every module's counts alike): the
/// calls so far and the last two outputs of every attention module, `(prev, last)`.
#[derive(Default)]
struct FasterState {
    iteration: usize,
    outputs: Vec<(kiln_tensor::Tensor, kiln_tensor::Tensor)>,
}

/// TaylorSeer's state of one branch (per attention module in diffusers; every module's steps
/// alike): the step of the last computed call, and per attention output its factors (order
/// 0, 1, ...; in the factor dtype) and its dtype.
#[derive(Default)]
pub(crate) struct TaylorState {
    last_update: Option<usize>,
    factors: Vec<Vec<kiln_tensor::Tensor>>,
    dtypes: Vec<kiln_tensor::DType>,
}

impl TaylorState {
    /// A computed call `step`'s attention outputs: the new factors, `new[0] = F`,
    /// `new[j+1] = (new[j] − stored[j]) / (step − last_update)` while a stored factor of order
    /// `j` (of F's shape) exists, up to `max_order`; kept rounded to the factor dtype.
    fn update(
        &mut self,
        outputs: Vec<kiln_tensor::Tensor>,
        step: usize,
        max_order: usize,
        factor_dtype: kiln_tensor::DType,
    ) -> kiln_nn::Result<()> {
        let stored = std::mem::take(&mut self.factors);
        self.dtypes = outputs.iter().map(|f| f.dtype()).collect();
        for (i, f) in outputs.into_iter().enumerate() {
            let mut new = vec![f];
            if let (Some(last), Some(old)) = (self.last_update, stored.get(i)) {
                let delta = (step - last) as f64;
                for j in 0..max_order {
                    let Some(previous) = old.get(j).filter(|p| p.dims() == new[j].dims()) else {
                        break;
                    };
                    let next = new[j].sub(&previous.to_dtype(new[j].dtype())?)?.div_scalar_f32(delta)?;
                    new.push(next);
                }
            }
            let new = new
                .iter()
                .map(|t| t.to_dtype(factor_dtype))
                .collect::<kiln_tensor::Result<Vec<_>>>()?;
            self.factors.push(new);
        }
        self.last_update = Some(step);
        Ok(())
    }

    /// The attention outputs predicted for `step`: `Σ_k factor_k · off^k / k!` with
    /// `off = step − last_update`, in the outputs' dtype.
    fn predict(&self, step: usize) -> kiln_nn::Result<Vec<kiln_tensor::Tensor>> {
        let Some(last) = self.last_update else {
            return Err(kiln_nn::Error::Config {
                component: "transformer".into(),
                message: format!(
                    "the taylorseer cache would predict step {step} before any computed step \
                     (disable_cache_before_step must be at least 1)"
                ),
            });
        };
        let off = (step - last) as f64;
        self.factors
            .iter()
            .zip(&self.dtypes)
            .map(|(factors, &dtype)| {
                let mut out = factors[0].to_dtype(dtype)?;
                let mut factorial = 1.0;
                for (k, f) in factors.iter().enumerate().skip(1) {
                    factorial *= k as f64;
                    let coefficient = off.powi(k as i32) / factorial;
                    out = out.add(&f.to_dtype(dtype)?.mul_scalar_f32(coefficient)?)?;
                }
                Ok(out)
            })
            .collect()
    }
}

/// One branch's state: its call count and the residuals it keeps.
#[derive(Default)]
pub(crate) struct BranchState {
    pub step: usize,
    /// MagCache: the block stack's residual; First-Block Cache: the rest's (after the first block).
    pub residual: Option<kiln_tensor::Tensor>,
    /// First-Block Cache: the first block's residual of the last computed call.
    pub head_residual: Option<kiln_tensor::Tensor>,
    /// TaylorSeer: the Taylor factors of the attention outputs.
    pub taylor: TaylorState,
    /// MagCache's `calibrate`: the magnitude ratio of every call.
    pub mag_ratios: Vec<f64>,
}

impl CacheRun {
    /// The run of `config` over a call's `timesteps` (the steps that run).
    pub fn new(config: CacheConfig, timesteps: &[f32]) -> CacheRun {
        CacheRun {
            planned: config.planned_hits(timesteps),
            config,
            branches: Default::default(),
            timesteps: timesteps.to_vec(),
            faster: FasterState::default(),
            served: 0,
            calls: 0,
        }
    }

    /// The state of `branch` and whether its next call is planned to be served from the cache.
    pub fn next(&mut self, branch: crate::pipeline::Branch) -> (&CacheConfig, bool, &mut BranchState) {
        let state = &mut self.branches[branch as usize];
        let planned = self
            .planned
            .as_ref()
            .is_some_and(|p| p.get(state.step).copied().unwrap_or(false));
        self.calls += 1;
        (&self.config, planned, state)
    }

    /// MagCache calibration's ratio: `mean(‖r‖ / (‖r_prev‖ + 1e-8))`, the norms over the last
    /// axis (each token's), in float32; the mean over every device's tokens under context
    /// parallelism (see [`sequence_mean`]).
    pub fn magnitude_ratio(r: &kiln_tensor::Tensor, previous: &kiln_tensor::Tensor) -> kiln_nn::Result<f64> {
        let norms = |t: &kiln_tensor::Tensor| -> kiln_nn::Result<kiln_tensor::Tensor> {
            Ok(t.to_dtype(kiln_tensor::DType::F32)?
                .square()?
                .sum(&[-1], false)?
                .sqrt()?)
        };
        let ratios = norms(r)?.div(&norms(previous)?.add_scalar(1e-8)?)?;
        let n = ratios.dims().iter().product::<usize>();
        Ok(sequence_mean(&ratios.reshape([n])?)?.to_scalar()?)
    }

    /// What the run reports on the call's output: the calls served from the cache, of all, and
    /// with MagCache's `calibrate` each state's magnitude ratios.
    pub fn report(run: Option<std::cell::RefCell<CacheRun>>, out: &mut crate::call::PipelineOutput) {
        let Some(run) = run.map(std::cell::RefCell::into_inner) else {
            return;
        };
        out.served_from_cache = Some((run.served, run.calls));
        if let CacheConfig::MagCache { calibrate: true, .. } = run.config {
            let ratios = run.branches.into_iter().map(|b| b.mag_ratios);
            out.calibrated_mag_ratios = Some(ratios.filter(|r| !r.is_empty()).collect());
        }
    }

    /// First-Block Cache's measure: `mean|r − r_prev| / mean|r_prev|`, in float32; the means
    /// over every device's tokens under context parallelism (see [`sequence_mean`]).
    pub fn relative_change(r: &kiln_tensor::Tensor, previous: &kiln_tensor::Tensor) -> kiln_nn::Result<f64> {
        let mean_abs = |t: &kiln_tensor::Tensor| -> kiln_nn::Result<kiln_tensor::Tensor> {
            let n = t.dims().iter().product::<usize>();
            sequence_mean(&t.to_dtype(kiln_tensor::DType::F32)?.reshape([n])?.abs()?)
        };
        let diff = mean_abs(&r.sub(previous)?)?;
        let base = mean_abs(previous)?;
        Ok(diff.div(&base)?.to_scalar()?)
    }
}

/// The mean of the values of `t` (`[n]`, float32), a cache measure's token-wise values: without
/// context parallelism `t.mean()` (the rounding the oracle's decisions were checked with); with
/// it, the sum over the sequence axis' members (an all-reduce, every device then holds the same
/// value) divided by `n · degree`. That is the mean both when `t` holds this device's equal share
/// of the sequence and when it holds the whole sequence on every device (the models keep the
/// residuals these measures read whole where the split pads the sequence,
/// `context_parallel::whole_if_padded`: the all-reduce then adds `degree` equal copies).
fn sequence_mean(t: &kiln_tensor::Tensor) -> kiln_nn::Result<kiln_tensor::Tensor> {
    let degree = t.device().axes().context.degree();
    if degree == 1 {
        return Ok(t.mean(&[0], false)?);
    }
    let count = t.dims()[0] * degree;
    Ok(t.sum(&[0], false)?
        .all_reduce_sum_along(kiln_tensor::MeshAxis::Sequence)?
        .div_scalar(count as f64)?)
}

/// One transformer call of `branch` under MagCache: `skip` with the block stack's last residual
/// on the planned steps (no block runs), else `compute` (the prediction and the residual, kept).
/// With `calibrate` every call computes and its magnitude ratio to the last call is recorded.
pub(crate) fn magcache_call(
    run: &mut CacheRun,
    branch: crate::pipeline::Branch,
    compute: impl FnOnce() -> kiln_nn::Result<(kiln_tensor::Tensor, kiln_tensor::Tensor)>,
    skip: impl FnOnce(&kiln_tensor::Tensor) -> kiln_nn::Result<kiln_tensor::Tensor>,
) -> kiln_nn::Result<kiln_tensor::Tensor> {
    let (config, planned, state) = run.next(branch);
    let calibrating = match *config {
        CacheConfig::MagCache {
            calibrate: true,
            num_inference_steps,
            ..
        } => Some(num_inference_steps),
        _ => None,
    };
    let step = state.step;
    state.step += 1;
    if let (Some(residual), true) = (&state.residual, planned) {
        let out = skip(residual)?;
        run.served += 1;
        return Ok(out);
    }
    let (out, residual) = compute()?;
    if let Some(steps) = calibrating {
        // diffusers' state resets after `num_inference_steps` calls: the next ratio is 1 again.
        let ratio = match (&state.residual, step % steps) {
            (Some(previous), 1..) => CacheRun::magnitude_ratio(&residual, previous)?,
            _ => 1.0,
        };
        state.mag_ratios.push(ratio);
    }
    state.residual = Some(residual);
    Ok(out)
}

/// The [`CachedTransformer`] methods every transformer forwards to its own `forward_*` methods of
/// the same names, for inputs `$inputs` and first-block output `$head` (which has `residual`).
macro_rules! forward_cached_transformer {
    ($inputs:ty, $head:ty) => {
        fn magcache_compute(&self, inputs: &$inputs) -> kiln_nn::Result<(Tensor, Tensor)> {
            self.forward_magcache_compute(inputs)
        }
        fn magcache_skip(&self, inputs: &$inputs, residual: &Tensor) -> kiln_nn::Result<Tensor> {
            self.forward_magcache_skip(inputs, residual)
        }
        fn recording_attention(&self, inputs: &$inputs) -> kiln_nn::Result<(Tensor, Vec<Tensor>)> {
            self.forward_recording_attention(inputs)
        }
        fn with_attention(&self, inputs: &$inputs, attention: &[Tensor]) -> kiln_nn::Result<Tensor> {
            self.forward_with_attention(inputs, attention)
        }
        fn first_block(&self, inputs: &$inputs) -> kiln_nn::Result<$head> {
            self.forward_first_block(inputs)
        }
        fn first_block_residual(head: &$head) -> &Tensor {
            &head.residual
        }
    };
}
pub(crate) use forward_cached_transformer;

/// A transformer's forward as diffusers' cache hooks change it (see [`cached_call`]), for
/// inputs `I`.
pub(crate) trait CachedTransformer<I> {
    /// First-Block Cache: what the first block's call leaves for the rest.
    type FirstBlock;
    /// MagCache's computed call: the prediction and the block stack's residual.
    fn magcache_compute(&self, inputs: &I) -> kiln_nn::Result<(kiln_tensor::Tensor, kiln_tensor::Tensor)>;
    /// MagCache's skipped call: no block runs, the residual added to the stack's input.
    fn magcache_skip(&self, inputs: &I, residual: &kiln_tensor::Tensor) -> kiln_nn::Result<kiln_tensor::Tensor>;
    /// The prediction and every hooked attention module's outputs.
    fn recording_attention(&self, inputs: &I) -> kiln_nn::Result<(kiln_tensor::Tensor, Vec<kiln_tensor::Tensor>)>;
    /// The prediction with the attention modules' outputs given.
    fn with_attention(&self, inputs: &I, attention: &[kiln_tensor::Tensor]) -> kiln_nn::Result<kiln_tensor::Tensor>;
    /// The embeddings and the first block.
    fn first_block(&self, inputs: &I) -> kiln_nn::Result<Self::FirstBlock>;
    /// The first block's residual, the measure's input.
    fn first_block_residual(head: &Self::FirstBlock) -> &kiln_tensor::Tensor;
    /// The other blocks: the prediction and their residual.
    fn first_block_rest(
        &self,
        inputs: &I,
        head: &Self::FirstBlock,
    ) -> kiln_nn::Result<(kiln_tensor::Tensor, kiln_tensor::Tensor)>;
    /// The prediction from the first block's output and the kept residual.
    fn first_block_served(
        &self,
        inputs: &I,
        head: &Self::FirstBlock,
        residual: &kiln_tensor::Tensor,
    ) -> kiln_nn::Result<kiln_tensor::Tensor>;
}

/// One transformer call of `branch` under the run's cache: MagCache skips every block on its
/// planned calls; First-Block Cache runs the first block and the rest only when its residual
/// changed by more than the threshold; TaylorSeer and FasterCache replace the hooked attention
/// outputs on their cached calls.
pub(crate) fn cached_call<I, M: CachedTransformer<I>>(
    model: &M,
    inputs: &I,
    run: &mut CacheRun,
    branch: crate::pipeline::Branch,
) -> kiln_nn::Result<kiln_tensor::Tensor> {
    match &run.config {
        CacheConfig::MagCache { .. } => magcache_call(
            run,
            branch,
            || model.magcache_compute(inputs),
            |residual| model.magcache_skip(inputs, residual),
        ),
        CacheConfig::TaylorSeer { .. } | CacheConfig::Faster { .. } => attention_cache_call(
            run,
            branch,
            || model.recording_attention(inputs),
            |attention| model.with_attention(inputs, attention),
        ),
        CacheConfig::FirstBlock { .. } => first_block_call(
            run,
            branch,
            || model.first_block(inputs),
            M::first_block_residual,
            |head| model.first_block_rest(inputs, head),
            |head, residual| model.first_block_served(inputs, head, residual),
        ),
    }
}

/// One transformer call of `branch` under First-Block Cache: `head` runs the embeddings and the
/// first block (`residual_of` its image residual, `image out − image in`); the rest runs
/// (`rest`: the prediction and the residual `image after the last block − after the first`,
/// kept with the head's residual) unless the head's residual changed by at most `threshold`
/// (`mean|r − r_prev| / mean|r_prev|`, `r_prev` the last computed call's) — then `cached` gives
/// the prediction from the head's output and the kept residual.
pub(crate) fn first_block_call<H>(
    run: &mut CacheRun,
    branch: crate::pipeline::Branch,
    head: impl FnOnce() -> kiln_nn::Result<H>,
    residual_of: impl Fn(&H) -> &kiln_tensor::Tensor,
    rest: impl FnOnce(&H) -> kiln_nn::Result<(kiln_tensor::Tensor, kiln_tensor::Tensor)>,
    cached: impl FnOnce(&H, &kiln_tensor::Tensor) -> kiln_nn::Result<kiln_tensor::Tensor>,
) -> kiln_nn::Result<kiln_tensor::Tensor> {
    let CacheConfig::FirstBlock { threshold } = run.config else {
        return Err(kiln_nn::Error::Config {
            component: "transformer".into(),
            message: format!(
                "internal error: the {} cache is not First-Block Cache",
                run.config.kind()
            ),
        });
    };
    let (_, _, state) = run.next(branch);
    let step = state.step;
    state.step += 1;
    let head = head()?;
    let change = match (&state.head_residual, &state.residual) {
        (Some(previous), Some(_)) => Some(CacheRun::relative_change(residual_of(&head), previous)?),
        _ => None,
    };
    let compute = change.is_none_or(|d| d > threshold);
    // The measure and the decision of every call (KILN_LOG=kiln_pipelines::cache=debug).
    tracing::debug!(
        "first-block cache: {} call {step}: change {} → {}",
        match branch {
            crate::pipeline::Branch::Cond => "cond",
            crate::pipeline::Branch::Uncond => "uncond",
        },
        change.map_or("none".to_string(), |d| d.to_string()),
        if compute { "computed" } else { "served" }
    );
    if let (false, Some(residual)) = (compute, &state.residual) {
        let out = cached(&head, residual)?;
        run.served += 1;
        return Ok(out);
    }
    let (out, residual) = rest(&head)?;
    state.head_residual = Some(residual_of(&head).clone());
    state.residual = Some(residual);
    Ok(out)
}

/// One transformer call of `branch` under a cache of the attention modules' outputs (TaylorSeer,
/// FasterCache): `compute` runs the model and gives the prediction with every attention output
/// (in the model's order); on a cached call `given` runs it with the attention outputs predicted
/// (TaylorSeer: the branch's Taylor series; FasterCache: `last + (last − prev) · 0.5`) and the
/// attention modules do not run. Everything else in the blocks runs on every call.
pub(crate) fn attention_cache_call(
    run: &mut CacheRun,
    branch: crate::pipeline::Branch,
    compute: impl FnOnce() -> kiln_nn::Result<(kiln_tensor::Tensor, Vec<kiln_tensor::Tensor>)>,
    given: impl FnOnce(&[kiln_tensor::Tensor]) -> kiln_nn::Result<kiln_tensor::Tensor>,
) -> kiln_nn::Result<kiln_tensor::Tensor> {
    let config = run.config.clone();
    let (_, planned, state) = run.next(branch);
    let step = state.step;
    state.step += 1;
    match config {
        CacheConfig::TaylorSeer {
            max_order,
            bfloat16_factors,
            ..
        } => {
            if planned {
                let predicted = state.taylor.predict(step)?;
                run.served += 1;
                return given(&predicted);
            }
            let (out, outputs) = compute()?;
            let factor_dtype = match bfloat16_factors {
                true => kiln_tensor::DType::BF16,
                false => kiln_tensor::DType::F32,
            };
            state.taylor.update(outputs, step, max_order, factor_dtype)?;
            Ok(out)
        }
        CacheConfig::Faster {
            block_skip_range,
            timestep_skip_range: (lo, hi),
            ..
        } => {
            // The state is the hooks' own, not the branch's: every call counts.
            let t = f64::from(run.timesteps.get(step).copied().unwrap_or(f32::NAN));
            let iteration = run.faster.iteration;
            run.faster.iteration += 1;
            let skip = lo < t && t < hi && !(iteration > 0 && iteration.is_multiple_of(block_skip_range));
            if skip {
                if run.faster.outputs.is_empty() {
                    return Err(kiln_nn::Error::Config {
                        component: "transformer".into(),
                        message: format!(
                            "the faster cache would approximate the first call (timestep {t} lies inside \
                             spatial_attention_timestep_skip_range ({lo}, {hi})) from nothing: the range must \
                             end below the first timestep"
                        ),
                    });
                }
                let approximated = run
                    .faster
                    .outputs
                    .iter()
                    .map(|(prev, last)| Ok(last.add(&last.sub(prev)?.mul_scalar_f32(0.5)?)?))
                    .collect::<kiln_nn::Result<Vec<_>>>()?;
                let out = given(&approximated)?;
                run.faster.outputs = std::mem::take(&mut run.faster.outputs)
                    .into_iter()
                    .zip(approximated)
                    .map(|((_, last), new)| (last, new))
                    .collect();
                run.served += 1;
                return Ok(out);
            }
            let (out, outputs) = compute()?;
            let previous = std::mem::take(&mut run.faster.outputs);
            run.faster.outputs = match previous.is_empty() {
                true => outputs.into_iter().map(|o| (o.clone(), o)).collect(),
                false => previous
                    .into_iter()
                    .zip(outputs)
                    .map(|((_, last), new)| (last, new))
                    .collect(),
            };
            Ok(out)
        }
        other => Err(kiln_nn::Error::Config {
            component: "transformer".into(),
            message: format!(
                "internal error: the {} cache does not cache attention outputs",
                other.kind()
            ),
        }),
    }
}
