//! [`Module`]: every model exposes its weights by name, so that compiling, offloading and
//! sharding are each one generic walk instead of code per model.

use kiln_tensor::Tensor;

use crate::error::{Error, Result};
use crate::weights::Weights;

/// A model or layer that owns weights.
pub trait Module {
    /// Every weight, in a fixed order, with its diffusers/transformers name relative to `self`.
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor));
    /// The same walk in the same order, replacing each weight with what `f` returns (moved to
    /// another memory, sharded, or a traced stand-in while compiling).
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()>;
}

/// `prefix.name`, or `prefix` alone for a weight that is the child itself.
pub fn join_name(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (_, true) => prefix.to_string(),
        _ => format!("{prefix}.{name}"),
    }
}

/// Visits `child`'s weights with names under `prefix` (a helper for [`Module`] impls).
pub fn visit_child(prefix: &str, child: &dyn Module, f: &mut dyn FnMut(&str, &Tensor)) {
    child.visit(&mut |name, t| f(&join_name(prefix, name), t));
}

/// Maps `child`'s weights with names under `prefix` (a helper for [`Module`] impls).
pub fn map_child(
    prefix: &str,
    child: &mut dyn Module,
    f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>,
) -> Result<()> {
    child.map(&mut |name, t| f(&join_name(prefix, name), t))
}

impl Module for Tensor {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        f("", self)
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        *self = f("", self)?;
        Ok(())
    }
}

impl<M: Module> Module for Option<M> {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        if let Some(m) = self {
            m.visit(f)
        }
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        match self {
            Some(m) => m.map(f),
            None => Ok(()),
        }
    }
}

/// A list of modules, named `0`, `1`, ... as `nn.ModuleList`.
impl<M: Module> Module for Vec<M> {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        for (i, m) in self.iter().enumerate() {
            visit_child(&i.to_string(), m, f);
        }
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        for (i, m) in self.iter_mut().enumerate() {
            map_child(&i.to_string(), m, f)?;
        }
        Ok(())
    }
}

/// Implements [`Module`] for a struct by walking the listed fields, in order, each under its
/// weight name: the field's own name, or the name given after it. A field's type must be a
/// [`Module`] (a `Tensor`, a layer, an `Option` or a `Vec` of them, a [`Named`]).
///
/// Each field's name is also an associated constant of the struct named like the field
/// (`Self::norm1`), so that the loader reads the weights where the walk names them:
///
/// ```
/// use kiln_nn::{impl_module, Linear, Result, Weights};
///
/// #[derive(Clone, Debug)]
/// struct Block {
///     norm1: Linear,
///     ff: Linear,
/// }
///
/// impl_module!(Block { norm1: "norm1.linear", ff });
///
/// impl Block {
///     fn load(w: &Weights, dim: usize) -> Result<Self> {
///         Ok(Block {
///             norm1: Linear::load(&w.pp(Self::norm1), dim, 6 * dim, true)?,
///             ff: Linear::load(&w.pp(Self::ff), dim, dim, true)?,
///         })
///     }
/// }
///
/// assert_eq!((Block::norm1, Block::ff), ("norm1.linear", "ff"));
/// ```
///
/// A generic struct lists its type parameters first, each a [`Module`]:
/// `impl_module!([F] Block<F> { ff })`.
#[macro_export]
macro_rules! impl_module {
    (@name $field:ident) => {
        stringify!($field)
    };
    (@name $field:ident, $name:expr) => {
        $name
    };
    ([$($param:ident),*] $ty:ty { $($field:ident $(: $name:expr)?),* $(,)? }) => {
        impl<$($param: $crate::Module),*> $crate::Module for $ty {
            fn visit(&self, f: &mut dyn FnMut(&str, &kiln_tensor::Tensor)) {
                $( $crate::module::visit_child(Self::$field, &self.$field, f); )*
            }
            fn map(
                &mut self,
                f: &mut dyn FnMut(&str, &kiln_tensor::Tensor) -> $crate::Result<kiln_tensor::Tensor>,
            ) -> $crate::Result<()> {
                $( $crate::module::map_child(Self::$field, &mut self.$field, f)?; )*
                Ok(())
            }
        }

        /// The weight name of each field.
        #[allow(dead_code, non_upper_case_globals)]
        impl<$($param),*> $ty {
            $( const $field: &'static str = $crate::impl_module!(@name $field $(, $name)?); )*
        }
    };
    ($ty:ty { $($field:ident $(: $name:expr)?),* $(,)? }) => {
        $crate::impl_module!([] $ty { $($field $(: $name)?),* });
    };
}

/// A module walked under a name chosen when it is loaded, for a part that checkpoints name in
/// more than one way (a prefix some files have, one of two tied names, a gated or a plain
/// projection). List it in [`impl_module!`] under `""`; it derefs to the module.
#[derive(Clone, Debug)]
pub struct Named<M> {
    name: &'static str,
    module: M,
}

impl<M> Named<M> {
    /// `load(w.pp(name))`, walked as `name`.
    pub fn load(w: &Weights, name: &'static str, load: impl FnOnce(&Weights) -> Result<M>) -> Result<Self> {
        Ok(Named {
            name,
            module: load(&w.pp(name))?,
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl<M> std::ops::Deref for Named<M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.module
    }
}

impl<M> std::ops::DerefMut for Named<M> {
    fn deref_mut(&mut self) -> &mut M {
        &mut self.module
    }
}

impl<M: Module> Module for Named<M> {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        visit_child(self.name, &self.module, f)
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        map_child(self.name, &mut self.module, f)
    }
}

/// Every weight of `module`, in walk order.
pub fn weights_of(module: &dyn Module) -> Vec<Tensor> {
    let mut out = Vec::new();
    module.visit(&mut |_, t| out.push(t.clone()));
    out
}

/// A copy of `module` whose weights are `weights`, in [`Module::visit`] order.
pub fn with_weights<M: Module + Clone>(module: &M, weights: Vec<Tensor>) -> Result<M> {
    let expected = weights.len();
    let mut given = weights.into_iter();
    let mut copy = module.clone();
    let mut walked = 0;
    copy.map(&mut |name, _| {
        walked += 1;
        given.next().ok_or_else(|| Error::Config {
            component: "offload".into(),
            message: format!("{expected} weights were given for a module that has more (first missing: `{name}`)"),
        })
    })?;
    if walked != expected {
        return Err(Error::Config {
            component: "offload".into(),
            message: format!("{expected} weights were given for a module that has {walked}"),
        });
    }
    Ok(copy)
}

/// How a model runs: op by op, or as compiled programs (diffusers' `torch.compile` of the whole
/// model, or `compile_repeated_blocks`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CompileMode {
    /// Strict eager: every op is dispatched on its own.
    #[default]
    None,
    /// One program per repeated block type, called for every block with that block's weights;
    /// the rest runs eager. Compiles in about the time of one block.
    RepeatedBlocks,
    /// The whole forward as one program; in a pipeline, each denoising step (every transformer
    /// call of the guidance, the guidance and the scheduler step) is one program.
    Full,
}

impl std::str::FromStr for CompileMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" | "eager" => Ok(CompileMode::None),
            "blocks" | "repeated-blocks" => Ok(CompileMode::RepeatedBlocks),
            "full" => Ok(CompileMode::Full),
            other => Err(format!("unknown compile mode `{other}`: use none, blocks or full")),
        }
    }
}

impl std::fmt::Display for CompileMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CompileMode::None => "none",
            CompileMode::RepeatedBlocks => "blocks",
            CompileMode::Full => "full",
        })
    }
}
