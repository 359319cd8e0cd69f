//! [`Model`]: what every model shares — its compiled functions ([`Compiled`]), its repeated block
//! lists (for sequential offload) — so that a pipeline drives any component as
//! a `&mut dyn Model`, and model code only says which part is the whole forward
//! ([`Compiled::whole`]) and which parts are repeated blocks ([`Compiled::block`],
//! [`crate::Blocks::run`]).
//!
//! Compiled functions take and return [`Args`]: tensors under names (`"hidden_states"`,
//! `"rope.cos"`), so that the traced forward reads its inputs by name, never by position.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_tensor::{CompiledFunction, Tensor};

use crate::error::{Error, Result};
use crate::module::{join_name, weights_of, CompileMode, Module};
use crate::offload::BlockList;

/// A model that pipelines drive without knowing its type: compiling it, streaming its blocks. Implementors hold one [`Compiled`] and give access to it; everything else has a
/// default.
pub trait Model: Module {
    /// The model's compile mode and compiled functions (shared with its clones).
    fn compiled(&self) -> &Compiled;
    fn compiled_mut(&mut self) -> &mut Compiled;

    /// Calls `f` with each list of repeated blocks that sequential offload streams, in the order
    /// the forward runs them. Default: the model has none (it moves whole).
    fn block_lists(&mut self, f: &mut dyn FnMut(&mut dyn BlockList)) {
        let _ = f;
    }

    /// Runs the forward as compiled programs from now on ([`CompileMode::Full`]: diffusers'
    /// `torch.compile(model)`; [`CompileMode::RepeatedBlocks`]: `compile_repeated_blocks()`, one
    /// program per block type called with each block's weights) or op by op again
    /// ([`CompileMode::None`]). Programs are compiled on the first call with each input
    /// signature and kept, also by clones of the model.
    fn compile(&mut self, mode: CompileMode) {
        self.compiled_mut().set_mode(mode);
    }

    fn compile_mode(&self) -> CompileMode {
        self.compiled().mode()
    }

    /// How many programs the model's compiled functions hold (one per function and input
    /// signature).
    fn compiled_programs(&self) -> usize {
        self.compiled().programs()
    }
}

/// Implements [`Model`] for a struct from its [`Compiled`] field and its lists of streamed
/// [`crate::Blocks`] (in forward order, none by default):
/// `impl_model!(Transformer { compiled: compiled, blocks: [transformer_blocks] });`.
/// Attributes (doc comments) before the type go on the impl.
#[macro_export]
macro_rules! impl_model {
    ($(#[$meta:meta])* $ty:ty { compiled: $compiled:ident $(, blocks: [$($list:ident),* $(,)?])? $(,)? }) => {
        $(#[$meta])*
        impl $crate::Model for $ty {
            fn compiled(&self) -> &$crate::Compiled {
                &self.$compiled
            }
            fn compiled_mut(&mut self) -> &mut $crate::Compiled {
                &mut self.$compiled
            }
            $(
                fn block_lists(&mut self, f: &mut dyn FnMut(&mut dyn $crate::offload::BlockList)) {
                    $( f(&mut self.$list); )*
                }
            )?
        }
    };
}

/// Tensors under names, in insertion order: the inputs and results of a compiled function (the
/// order is the program's parameter and result order).
#[derive(Clone, Debug, Default)]
pub struct Args {
    entries: Vec<(Cow<'static, str>, Tensor)>,
}

impl Args {
    pub fn new() -> Self {
        Self::default()
    }

    /// `self` with `tensor` (cloned) under `name`.
    pub fn with(mut self, name: impl Into<Cow<'static, str>>, tensor: &Tensor) -> Self {
        self.insert(name, tensor.clone());
        self
    }

    /// `self` with `tensor` under `name` when there is one.
    pub fn with_opt(self, name: impl Into<Cow<'static, str>>, tensor: Option<&Tensor>) -> Self {
        match tensor {
            Some(t) => self.with(name, t),
            None => self,
        }
    }

    /// Puts `tensor` under `name`, in place of the tensor already there (which keeps its
    /// position) or last.
    pub fn insert(&mut self, name: impl Into<Cow<'static, str>>, tensor: Tensor) {
        let name = name.into();
        match self.entries.iter_mut().find(|(n, _)| *n == name) {
            Some(entry) => entry.1 = tensor,
            None => self.entries.push((name, tensor)),
        }
    }

    /// Puts `tensors` under `name.0`, `name.1`, ...
    pub fn insert_list(&mut self, name: &str, tensors: impl IntoIterator<Item = Tensor>) {
        for (i, t) in tensors.into_iter().enumerate() {
            self.insert(format!("{name}.{i}"), t);
        }
    }

    /// Removes and returns the tensors named `name.0`, `name.1`, ... (up to the first missing).
    pub fn take_list(&mut self, name: &str) -> Vec<Tensor> {
        (0..).map_while(|i| self.remove(&format!("{name}.{i}"))).collect()
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.opt(name).ok_or_else(|| self.missing(name))
    }

    /// `self` with rotary tables under `rope.cos` and `rope.sin`.
    pub fn with_rope(self, rope: &crate::RopeTables) -> Self {
        self.with("rope.cos", &rope.cos).with("rope.sin", &rope.sin)
    }

    /// The rotary tables passed with [`Args::with_rope`].
    pub fn rope(&self) -> Result<crate::RopeTables> {
        Ok(crate::RopeTables {
            cos: self.get("rope.cos")?.clone(),
            sin: self.get("rope.sin")?.clone(),
        })
    }

    /// The tensor named `name`, if there is one.
    pub fn opt(&self, name: &str) -> Option<&Tensor> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// Removes and returns the tensor named `name`.
    pub fn take(&mut self, name: &str) -> Result<Tensor> {
        self.remove(name).ok_or_else(|| self.missing(name))
    }

    fn remove(&mut self, name: &str) -> Option<Tensor> {
        let i = self.entries.iter().position(|(n, _)| n == name)?;
        Some(self.entries.remove(i).1)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(n, _)| n.as_ref())
    }

    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.entries.iter().map(|(_, t)| t)
    }

    fn missing(&self, name: &str) -> Error {
        Error::Config {
            component: "compiled function".into(),
            message: format!(
                "no tensor named `{name}` among [{}]",
                self.names().collect::<Vec<_>>().join(", ")
            ),
        }
    }

    fn from_parts(names: Vec<Cow<'static, str>>, tensors: impl IntoIterator<Item = Tensor>) -> Self {
        Args {
            entries: names.into_iter().zip(tensors).collect(),
        }
    }

    fn into_parts(self) -> (Vec<Cow<'static, str>>, Vec<Tensor>) {
        self.entries.into_iter().unzip()
    }
}

/// What a compiled forward returns: converted to named tensors (the program's results) and back.
pub trait Outputs: Sized {
    fn into_args(self) -> Args;
    fn from_args(args: Args) -> Result<Self>;
}

impl Outputs for Args {
    fn into_args(self) -> Args {
        self
    }
    fn from_args(args: Args) -> Result<Self> {
        Ok(args)
    }
}

/// One tensor, named `output`.
impl Outputs for Tensor {
    fn into_args(self) -> Args {
        Args::new().with("output", &self)
    }
    fn from_args(mut args: Args) -> Result<Self> {
        args.take("output")
    }
}

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
    use kiln_tensor::Device;

    fn scalar(v: f32, d: &Device) -> Tensor {
        Tensor::from_slice(&[v], [1], d).unwrap()
    }

    fn value(t: &Tensor) -> f32 {
        t.to_f32_vec().unwrap()[0]
    }

    #[test]
    fn args_keep_their_order_replace_by_name_and_name_what_is_missing() {
        let d = Device::cpu().expect("the CPU PJRT plugin must be installed");
        let mut args = Args::new()
            .with("x", &scalar(1.0, &d))
            .with_opt("none", None)
            .with("y", &scalar(2.0, &d));
        args.insert("x", scalar(3.0, &d));
        args.insert_list("h", [scalar(4.0, &d), scalar(5.0, &d)]);
        assert_eq!(args.names().collect::<Vec<_>>(), ["x", "y", "h.0", "h.1"]);
        assert_eq!(value(args.get("x").unwrap()), 3.0);
        assert!(args.opt("none").is_none());
        let err = args.get("z").unwrap_err().to_string();
        assert!(err.contains("no tensor named `z` among [x, y, h.0, h.1]"), "{err}");
        assert_eq!(args.take_list("h").iter().map(value).collect::<Vec<_>>(), [4.0, 5.0]);
        assert_eq!(value(&args.take("y").unwrap()), 2.0);
        assert_eq!(args.len(), 1);
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
