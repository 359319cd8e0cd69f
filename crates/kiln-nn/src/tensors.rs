//! [`Tensors`]: what compiled functions take and return. A value — a tensor, a struct of such
//! fields ([`crate::impl_tensors!`]), an `Option`, a `Vec`, a tuple, [`crate::RopeTables`] — is
//! flattened into its tensors in a fixed order (a program's parameters or results) and its
//! [`Layout`], what its type leaves open: whether each `Option` holds a value, how long each
//! list is. The tensors and the layout rebuild the value on the other side: traced stand-ins of
//! the inputs inside a trace, the results of a program after a call (which runs no Rust code, so
//! the results' layout is the one recorded when the program was traced).
//!
//! ```
//! # use kiln_nn::{impl_tensors, tensors::{unflatten, Flat}, RopeTables};
//! # use kiln_tensor::{Device, Tensor};
//! /// A double block's inputs: `hidden_states`, then `temb` when there is one, then the tables.
//! #[derive(Clone)]
//! struct BlockInputs {
//!     hidden_states: Tensor,
//!     temb: Option<Tensor>,
//!     rope: RopeTables,
//! }
//! impl_tensors!(BlockInputs { hidden_states, temb, rope });
//!
//! # let d = Device::cpu().unwrap();
//! # let t = |v: f32| Tensor::from_slice(&[v], [1], &d).unwrap();
//! let inputs = BlockInputs { hidden_states: t(1.0), temb: None, rope: RopeTables { cos: t(2.0), sin: t(3.0) } };
//! let flat = Flat::of(&inputs);
//! assert_eq!(flat.tensors.len(), 3);
//! let back: BlockInputs = unflatten(&flat.layout, flat.tensors).unwrap();
//! assert!(back.temb.is_none());
//! ```

use kiln_tensor::Tensor;

use crate::error::{Error, Result};

/// A value made of tensors, as a compiled function takes or returns it (see the module docs).
/// Implement it for a struct with [`crate::impl_tensors!`].
pub trait Tensors: Sized {
    /// Appends the value's tensors to `flat`, in a fixed order, and what its type leaves open to
    /// `flat`'s layout.
    fn flatten(&self, flat: &mut Flat);

    /// The value whose tensors and layout come next in `from` (what [`Self::flatten`] wrote).
    fn unflatten(from: &mut Unflatten<'_>) -> Result<Self>;
}

/// What a value's type leaves open, in flattening order: 0 or 1 per `Option`, the length of each
/// list. Two values of one type and layout have the same number of tensors, each in the same
/// place.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Layout {
    counts: Vec<usize>,
}

/// A flattened value: its tensors in order and its layout.
#[derive(Clone, Debug, Default)]
pub struct Flat {
    pub tensors: Vec<Tensor>,
    pub layout: Layout,
}

impl Flat {
    /// `value`'s tensors (clones, which share the data) and layout.
    pub fn of<T: Tensors>(value: &T) -> Self {
        let mut flat = Flat::default();
        value.flatten(&mut flat);
        flat
    }

    pub fn push(&mut self, tensor: &Tensor) {
        self.tensors.push(tensor.clone());
    }

    /// Records how many values an `Option` (0 or 1) or a list holds.
    pub fn push_count(&mut self, count: usize) {
        self.layout.counts.push(count);
    }
}

/// Tensors and a layout being read back into a value (see [`Tensors::unflatten`] and
/// [`unflatten`]).
pub struct Unflatten<'a> {
    tensors: std::vec::IntoIter<Tensor>,
    counts: std::slice::Iter<'a, usize>,
}

impl Unflatten<'_> {
    pub fn tensor(&mut self) -> Result<Tensor> {
        self.tensors.next().ok_or_else(|| short_of("tensors"))
    }

    /// What [`Flat::push_count`] recorded.
    pub fn count(&mut self) -> Result<usize> {
        self.counts.next().copied().ok_or_else(|| short_of("counts"))
    }
}

/// The `T` made of `tensors` with `layout` (those of [`Flat::of`] a `T`); every tensor and every
/// entry of the layout must be used.
pub fn unflatten<T: Tensors>(layout: &Layout, tensors: Vec<Tensor>) -> Result<T> {
    let mut from = Unflatten {
        tensors: tensors.into_iter(),
        counts: layout.counts.iter(),
    };
    let value = T::unflatten(&mut from).map_err(|e| match e {
        Error::Config { message, .. } => mismatch(&format!("{message} for a {}", std::any::type_name::<T>())),
        other => other,
    })?;
    if from.tensors.len() + from.counts.len() > 0 {
        return Err(mismatch(&format!(
            "more tensors or layout for a {}",
            std::any::type_name::<T>()
        )));
    }
    Ok(value)
}

fn mismatch(what: &str) -> Error {
    Error::Config {
        component: "compiled function".into(),
        message: format!("the tensors and layout of a value do not match its type ({what})"),
    }
}

/// An error of [`Unflatten`] running out of `what` ("tensors"); [`unflatten`] words it as a
/// mismatch of its type.
fn short_of(what: &str) -> Error {
    Error::Config {
        component: "compiled function".into(),
        message: format!("fewer {what}"),
    }
}

impl Tensors for Tensor {
    fn flatten(&self, flat: &mut Flat) {
        flat.push(self);
    }
    fn unflatten(from: &mut Unflatten<'_>) -> Result<Self> {
        from.tensor()
    }
}

/// The value's tensors when there is one (its presence is part of the layout).
impl<T: Tensors> Tensors for Option<T> {
    fn flatten(&self, flat: &mut Flat) {
        flat.push_count(usize::from(self.is_some()));
        if let Some(value) = self {
            value.flatten(flat);
        }
    }
    fn unflatten(from: &mut Unflatten<'_>) -> Result<Self> {
        match from.count()? {
            0 => Ok(None),
            _ => Ok(Some(T::unflatten(from)?)),
        }
    }
}

/// The elements' tensors in order (the length is part of the layout).
impl<T: Tensors> Tensors for Vec<T> {
    fn flatten(&self, flat: &mut Flat) {
        flat.push_count(self.len());
        for value in self {
            value.flatten(flat);
        }
    }
    fn unflatten(from: &mut Unflatten<'_>) -> Result<Self> {
        (0..from.count()?).map(|_| T::unflatten(from)).collect()
    }
}

macro_rules! tuple_tensors {
    ($($name:ident),+) => {
        /// The elements' tensors in order.
        impl<$($name: Tensors),+> Tensors for ($($name,)+) {
            fn flatten(&self, flat: &mut Flat) {
                #[allow(non_snake_case)]
                let ($($name,)+) = self;
                $( $name.flatten(flat); )+
            }
            fn unflatten(from: &mut Unflatten<'_>) -> Result<Self> {
                Ok(($($name::unflatten(from)?,)+))
            }
        }
    };
}

tuple_tensors!(A);
tuple_tensors!(A, B);
tuple_tensors!(A, B, C);
tuple_tensors!(A, B, C, D);
tuple_tensors!(A, B, C, D, E);
tuple_tensors!(A, B, C, D, E, F);

/// Implements [`Tensors`] for a struct whose fields are all [`Tensors`], flattened in the order
/// listed (the program's parameter or result order), which must name every field once:
/// `impl_tensors!(BlockInputs { hidden_states, temb, rope });`. A struct generic over some of its
/// fields' types lists those type parameters first:
/// `impl_tensors!([C] Step<C> { constants, latents });`.
#[macro_export]
macro_rules! impl_tensors {
    ([$($param:ident),*] $ty:ty { $($field:ident),* $(,)? }) => {
        impl<$($param: $crate::Tensors),*> $crate::Tensors for $ty {
            fn flatten(&self, flat: &mut $crate::tensors::Flat) {
                $( $crate::Tensors::flatten(&self.$field, flat); )*
            }
            fn unflatten(from: &mut $crate::tensors::Unflatten<'_>) -> $crate::Result<Self> {
                // Fields are evaluated in the order written, which is the order flattened.
                Ok(Self {
                    $( $field: $crate::Tensors::unflatten(from)?, )*
                })
            }
        }
    };
    ($ty:ty { $($field:ident),* $(,)? }) => {
        $crate::impl_tensors!([] $ty { $($field),* });
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RopeTables;
    use kiln_tensor::Device;

    /// A step's inputs: what the pipeline passes every step, then the step's own tensors.
    struct Step<C> {
        constants: C,
        latents: Tensor,
    }
    crate::impl_tensors!([C] Step<C> { constants, latents });

    struct Constants {
        embeds: Tensor,
        guidance: Option<Tensor>,
        negative: Option<(Tensor, Tensor)>,
        rope: RopeTables,
        layers: Vec<Tensor>,
    }
    crate::impl_tensors!(Constants {
        embeds,
        guidance,
        negative,
        rope,
        layers
    });

    /// Tensors flatten in field order, options and lists leave their count in the layout, and the
    /// value comes back from the two; tensors or a layout of another value are an error.
    #[test]
    fn values_flatten_in_field_order_and_come_back() {
        let d = Device::cpu().expect("the CPU PJRT plugin must be installed");
        let t = |v: f32| Tensor::from_slice(&[v], [1], &d).unwrap();
        let value = |t: &Tensor| t.to_f32_vec().unwrap()[0];
        let step = Step {
            constants: Constants {
                embeds: t(1.0),
                guidance: None,
                negative: Some((t(2.0), t(3.0))),
                rope: RopeTables {
                    cos: t(4.0),
                    sin: t(5.0),
                },
                layers: vec![t(6.0), t(7.0)],
            },
            latents: t(8.0),
        };
        let flat = Flat::of(&step);
        assert_eq!(
            flat.tensors.iter().map(value).collect::<Vec<_>>(),
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
        );
        let back: Step<Constants> = unflatten(&flat.layout, flat.tensors.clone()).unwrap();
        assert!(back.constants.guidance.is_none());
        assert_eq!(
            back.constants.negative.as_ref().map(|(a, b)| (value(a), value(b))),
            Some((2.0, 3.0))
        );
        assert_eq!(back.constants.layers.len(), 2);
        assert_eq!(value(&back.latents), 8.0);

        let err = unflatten::<Step<Constants>>(&flat.layout, flat.tensors[1..].to_vec())
            .err()
            .unwrap();
        let text = err.to_string();
        assert!(text.contains("do not match its type (fewer tensors for a "), "{err}");
        assert_eq!(text.matches("do not match").count(), 1, "{err}");
        let err = unflatten::<Tensor>(&flat.layout, vec![t(0.0)]).err().unwrap();
        assert!(err.to_string().contains("more tensors or layout"), "{err}");
    }
}
