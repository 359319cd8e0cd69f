//! [`Compiled`]: a model's compiled functions, created by name on first use, each one program per
//! input signature whose parameters are the inputs followed by the model's weights.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_tensor::CompiledFunction;

use crate::error::{Error, Result};
use crate::module::{join_name, weights_of, CompileMode, Module};
use crate::tensors::{unflatten, Flat, Layout, Tensors};

/// One compiled function for inputs of one layout, and the layout of its results (a call that
/// hits a program does not run the function, so the layout is kept from its first trace).
#[derive(Debug)]
struct Function {
    compiled: CompiledFunction,
    outputs: Mutex<Option<Layout>>,
}

impl Function {
    fn outputs(&self) -> MutexGuard<'_, Option<Layout>> {
        self.outputs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps the result layout of a trace, or checks it against the one kept.
    fn record_outputs(&self, layout: &Layout) -> Result<()> {
        let mut kept = self.outputs();
        match &*kept {
            None => *kept = Some(layout.clone()),
            Some(k) if k == layout => {}
            Some(k) => {
                return Err(Error::Config {
                    component: self.compiled.name().to_string(),
                    message: format!(
                        "a compiled function must return results of the same layout for every input signature: \
                         {layout:?} after {k:?}"
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
    /// By full name and input layout: inputs of another layout (an `Option` that holds nothing,
    /// a list of another length) are another function, even when their tensors have the same
    /// shapes.
    by_name: Mutex<BTreeMap<(String, Layout), Arc<Function>>>,
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

    fn by_name(&self) -> MutexGuard<'_, BTreeMap<(String, Layout), Arc<Function>>> {
        self.functions.by_name.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn function(&self, name: &str, inputs: &Layout) -> Arc<Function> {
        let full = join_name(&self.functions.prefix, name);
        self.by_name()
            .entry((full, inputs.clone()))
            .or_insert_with_key(|(full, _)| {
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
    pub fn whole<M: Module + Clone, I: Tensors, O: Tensors>(
        &self,
        name: &str,
        model: &M,
        inputs: I,
        forward: impl FnOnce(&M, &I) -> Result<O>,
    ) -> Result<O> {
        self.call_in(CompileMode::Full, name, model, inputs, forward)
    }

    /// One repeated block: `forward(block, inputs)`, in [`CompileMode::RepeatedBlocks`] as
    /// program `name`, which every block of that type shares (called with each block's
    /// weights), else directly.
    pub fn block<M: Module + Clone, I: Tensors, O: Tensors>(
        &self,
        name: &str,
        block: &M,
        inputs: I,
        forward: impl FnOnce(&M, &I) -> Result<O>,
    ) -> Result<O> {
        self.call_in(CompileMode::RepeatedBlocks, name, block, inputs, forward)
    }

    /// [`Self::call`] in `mode`, else `forward(module, inputs)` directly.
    fn call_in<M: Module + Clone, I: Tensors, O: Tensors>(
        &self,
        mode: CompileMode,
        name: &str,
        module: &M,
        inputs: I,
        forward: impl FnOnce(&M, &I) -> Result<O>,
    ) -> Result<O> {
        if self.mode == mode {
            self.call(name, module, inputs, forward)
        } else {
            forward(module, &inputs)
        }
    }

    /// Runs `forward(module, inputs)` as function `name`: one program per input layout and
    /// signature whose parameters are the inputs' tensors (in [`Tensors::flatten`] order)
    /// followed by the module's weights, so one program serves every module of the same shapes
    /// and weights may move without recompiling. On a first call `forward` runs once on a copy of
    /// `module` whose weights are traced stand-ins, with inputs rebuilt from traced stand-ins of
    /// their tensors; later calls rebuild the results from the program's, in the layout that trace
    /// returned.
    pub fn call<M: Module + Clone, I: Tensors, O: Tensors>(
        &self,
        name: &str,
        module: &M,
        inputs: I,
        forward: impl FnOnce(&M, &I) -> Result<O>,
    ) -> Result<O> {
        let Flat {
            tensors: mut args,
            layout,
        } = Flat::of(&inputs);
        drop(inputs);
        let function = self.function(name, &layout);
        let n = args.len();
        args.extend(weights_of(module));
        let results = function.compiled.call(&args, |traced| {
            let (inputs, weights) = traced.split_at(n);
            let mut stand_ins = weights.iter();
            let mut m = module.clone();
            m.map(&mut |_, _| Ok(stand_ins.next().expect("map walks the same weights as visit").clone()))?;
            let out = Flat::of(&forward(&m, &unflatten(&layout, inputs.to_vec())?)?);
            function.record_outputs(&out.layout)?;
            Ok::<_, Error>(out.tensors)
        })?;
        let outputs = function
            .outputs()
            .clone()
            .expect("a program's result layout is kept when it is traced");
        unflatten(&outputs, results)
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

    /// A step's typed results: a tensor, an optional one and a list.
    #[derive(Debug)]
    struct Results {
        sum: Tensor,
        product: Option<Tensor>,
        powers: Vec<Tensor>,
    }
    crate::impl_tensors!(Results { sum, product, powers });

    /// A compiled call rebuilds its typed results in the layout of the traced forward, also when
    /// it hits the program and does not run the forward; inputs of another layout are another
    /// program even when their tensors have the same shapes.
    #[test]
    fn typed_results_keep_their_layout_on_a_hit() {
        let d = Device::cpu().expect("the CPU PJRT plugin must be installed");
        let weight = scalar(10.0, &d);
        let compiled = Compiled::new("test");
        let run = |x: Option<f32>, y: Option<f32>| -> Results {
            let inputs = (x.map(|x| scalar(x, &d)), y.map(|y| scalar(y, &d)));
            compiled
                .call("f", &weight, inputs, |w, (x, y)| {
                    let x = x.as_ref().or(y.as_ref()).expect("one input");
                    Ok(Results {
                        sum: x.add(w)?,
                        product: y.as_ref().map(|y| y.mul(w)).transpose()?,
                        powers: vec![x.clone(), x.mul(x)?],
                    })
                })
                .unwrap()
        };
        for x in [1.0, 2.0] {
            let out = run(Some(x), None);
            assert_eq!(value(&out.sum), x + 10.0);
            assert!(out.product.is_none());
            assert_eq!(out.powers.iter().map(value).collect::<Vec<_>>(), [x, x * x]);
        }
        assert_eq!(compiled.programs(), 1);
        let out = run(None, Some(3.0));
        assert_eq!(value(&out.sum), 13.0);
        assert_eq!(out.product.as_ref().map(value), Some(30.0));
        assert_eq!(compiled.programs(), 2);
    }
}
