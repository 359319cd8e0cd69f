//! [`Model`]: what every model shares — its compiled functions ([`Compiled`]), its repeated block
//! lists (for sequential offload) — so that a pipeline drives any component as
//! a `&mut dyn Model`, and model code only says which part is the whole forward
//! ([`Compiled::whole`]) and which parts are repeated blocks ([`Compiled::block`],
//! [`crate::Blocks::run`]).

use crate::blocks::BlockList;
use crate::compiled::Compiled;
use crate::module::{CompileMode, Module};
use crate::parallel::TpPlan;

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

    /// The tensor-parallel plan its weights were loaded by on a mesh, by weight names relative
    /// to the model ([`TpPlan::split_of`]). Default: every weight replicated.
    fn parallel_plan(&self) -> TpPlan {
        TpPlan::replicated()
    }

    /// How many programs the model's compiled functions hold (one per function and input
    /// signature).
    fn compiled_programs(&self) -> usize {
        self.compiled().programs()
    }
}

/// Implements [`Model`] for a struct from its [`Compiled`] field and its lists of streamed
/// [`crate::Blocks`] (fields, or fields of fields, in forward order, none by default):
/// `impl_model!(Transformer { compiled: compiled, blocks: [transformer_blocks] });`; a model
/// loaded by a tensor-parallel plan names the function of `&Self` that gives it:
/// `impl_model!(T { compiled: compiled, parallel_plan: |m| T::tp_plan(&m.config) })`.
/// Attributes (doc comments) before the type go on the impl.
#[macro_export]
macro_rules! impl_model {
    ($(#[$meta:meta])* $ty:ty {
        compiled: $compiled:ident
        $(, blocks: [$($($list:ident).+),* $(,)?])?
        $(, parallel_plan: $plan:expr)? $(,)?
    }) => {
        $(#[$meta])*
        impl $crate::Model for $ty {
            fn compiled(&self) -> &$crate::Compiled {
                &self.$compiled
            }
            fn compiled_mut(&mut self) -> &mut $crate::Compiled {
                &mut self.$compiled
            }
            $(
                fn parallel_plan(&self) -> $crate::TpPlan {
                    let plan: fn(&Self) -> $crate::TpPlan = $plan;
                    plan(self)
                }
            )?
            $(
                fn block_lists(&mut self, f: &mut dyn FnMut(&mut dyn $crate::BlockList)) {
                    $( f(&mut self.$($list).+); )*
                }
            )?
        }
    };
}
