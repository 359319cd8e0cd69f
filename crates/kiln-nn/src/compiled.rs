//! [`Compiled`]: a model's compiled functions, created by name on first use, each one program per
//! input signature whose parameters are the inputs followed by the model's weights.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_tensor::CompiledFunction;

use crate::args::{Args, Outputs};
use crate::error::{Error, Result};
use crate::module::{join_name, weights_of, CompileMode, Module};

/// One compiled function and the names of its results (a call that hits a program does not run
/// the function, so the names are kept from its first trace).
#[derive(Debug)]
struct Function {
    compiled: CompiledFunction,
    outputs: Mutex<Option<Vec<Cow<'static, str>>>>,
}

impl Function {
    fn outputs(&self) -> MutexGuard<'_, Option<Vec<Cow<'static, str>>>> {
        self.outputs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps the result names of a trace, or checks them against those kept.
    fn record_outputs(&self, names: &[Cow<'static, str>]) -> Result<()> {
        let mut kept = self.outputs();
        match &*kept {
            None => *kept = Some(names.to_vec()),
            Some(k) if k == names => {}
            Some(k) => {
                return Err(Error::Config {
                    component: self.compiled.name().to_string(),
                    message: format!(
                        "a compiled function must return the same named results for every input signature: \
                         [{}] after [{}]",
                        names.join(", "),
                        k.join(", ")
                    ),
                })
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Functions {
    prefix: String,
    by_name: Mutex<BTreeMap<String, Arc<Function>>>,
}

/// A model's compile mode and its compiled functions, created by name on first use under the
/// model's prefix (`transformer`, `transformer.transformer_blocks`). Clones share the functions
/// (offload runs clones of a model whose weights live elsewhere) and have their own mode.
#[derive(Clone, Debug)]
pub struct Compiled {
    mode: CompileMode,
    functions: Arc<Functions>,
}

impl Compiled {
    /// No function yet, [`CompileMode::None`]; functions are named `prefix.name`.
    pub fn new(prefix: impl Into<String>) -> Self {
        Compiled {
            mode: CompileMode::None,
            functions: Arc::new(Functions {
                prefix: prefix.into(),
                by_name: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    pub fn mode(&self) -> CompileMode {
        self.mode
    }

    pub fn set_mode(&mut self, mode: CompileMode) {
        self.mode = mode;
    }

    /// How many programs the functions hold (one per function and input signature).
    pub fn programs(&self) -> usize {
        self.by_name().values().map(|f| f.compiled.num_programs()).sum()
    }

    /// How many tensors the functions' traces captured instead of taking them as arguments
    /// (see [`CompiledFunction::num_captured`]).
    pub fn captured(&self) -> usize {
        self.by_name().values().map(|f| f.compiled.num_captured()).sum()
    }

    fn by_name(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Function>>> {
        self.functions.by_name.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn function(&self, name: &str) -> Arc<Function> {
        let full = join_name(&self.functions.prefix, name);
        self.by_name()
            .entry(full)
            .or_insert_with_key(|full| {
                Arc::new(Function {
                    compiled: CompiledFunction::new(full.clone()),
                    outputs: Mutex::new(None),
                })
            })
            .clone()
    }

    /// The whole forward: `forward(model, inputs)`, as the one program `name` (empty: the
    /// prefix itself) in [`CompileMode::Full`], else directly. Inside the program the mode is
    /// still `Full`, so [`Self::block`] runs its blocks' ops inline.
    pub fn whole<M: Module + Clone, O: Outputs>(
        &self,
        name: &str,
        model: &M,
        inputs: Args,
        forward: impl FnOnce(&M, &Args) -> Result<O>,
    ) -> Result<O> {
        self.call_in(CompileMode::Full, name, model, inputs, forward)
    }

    /// One repeated block: `forward(block, inputs)`, in [`CompileMode::RepeatedBlocks`] as
    /// program `name`, which every block of that type shares (called with each block's
    /// weights), else directly.
    pub fn block<M: Module + Clone, O: Outputs>(
        &self,
        name: &str,
        block: &M,
        inputs: Args,
        forward: impl FnOnce(&M, &Args) -> Result<O>,
    ) -> Result<O> {
        self.call_in(CompileMode::RepeatedBlocks, name, block, inputs, forward)
    }

    /// [`Self::call`] in `mode`, else `forward(module, inputs)` directly.
    fn call_in<M: Module + Clone, O: Outputs>(
        &self,
        mode: CompileMode,
        name: &str,
        module: &M,
        inputs: Args,
        forward: impl FnOnce(&M, &Args) -> Result<O>,
    ) -> Result<O> {
        if self.mode == mode {
            self.call(name, module, inputs, forward)
        } else {
            forward(module, &inputs)
        }
    }

    /// Runs `forward(module, inputs)` as function `name`: one program per input signature whose
    /// parameters are the inputs (in order) followed by the module's weights, so one program
    /// serves every module of the same shapes and weights may move without recompiling. On a
    /// first call `forward` runs once on a copy of `module` whose weights are traced stand-ins,
    /// with traced stand-ins of the inputs under the same names.
    pub fn call<M: Module + Clone, O: Outputs>(
        &self,
        name: &str,
        module: &M,
        inputs: Args,
        forward: impl FnOnce(&M, &Args) -> Result<O>,
    ) -> Result<O> {
        let function = self.function(name);
        let (names, mut args) = inputs.into_parts();
        let n = args.len();
        args.extend(weights_of(module));
        let results = function.compiled.call(&args, |traced| {
            let (inputs, weights) = traced.split_at(n);
            let mut stand_ins = weights.iter();
            let mut m = module.clone();
            m.map(&mut |_, _| Ok(stand_ins.next().expect("map walks the same weights as visit").clone()))?;
            let (out_names, out) = forward(&m, &Args::from_parts(names, inputs.iter().cloned()))?
                .into_args()
                .into_parts();
            function.record_outputs(&out_names)?;
            Ok::<_, Error>(out)
        })?;
        let out_names = function
            .outputs()
            .clone()
            .expect("a program's result names are kept when it is traced");
        O::from_args(Args::from_parts(out_names, results))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_tensor::{Device, Tensor};

    fn scalar(v: f32, d: &Device) -> Tensor {
        Tensor::from_slice(&[v], [1], d).unwrap()
    }

    fn value(t: &Tensor) -> f32 {
        t.to_f32_vec().unwrap()[0]
    }

    /// A compiled call returns its results under the names of the traced forward, also when it
    /// hits the program and does not run the forward.
    #[test]
    fn compiled_results_keep_their_names_on_a_hit() {
        let d = Device::cpu().expect("the CPU PJRT plugin must be installed");
        let weight = scalar(10.0, &d);
        let compiled = Compiled::new("test");
        let run = |x: f32| -> Args {
            compiled
                .call("f", &weight, Args::new().with("x", &scalar(x, &d)), |w, a| {
                    let x = a.get("x")?;
                    Ok(Args::new().with("sum", &x.add(w)?).with("product", &x.mul(w)?))
                })
                .unwrap()
        };
        for x in [1.0, 2.0] {
            let out = run(x);
            assert_eq!(out.names().collect::<Vec<_>>(), ["sum", "product"]);
            assert_eq!(value(out.get("sum").unwrap()), x + 10.0);
            assert_eq!(value(out.get("product").unwrap()), x * 10.0);
        }
        assert_eq!(compiled.programs(), 1);
    }
}
