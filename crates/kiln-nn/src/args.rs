//! [`Args`]: tensors under names, which compiled functions take and return like any
//! [`Tensors`]. Kept for the pipelines' denoising steps until they declare typed inputs (see
//! [`crate::tensors`]); models use typed structs.

use std::borrow::Cow;

use kiln_tensor::Tensor;

use crate::error::{Error, Result};
use crate::rope::RopeTables;
use crate::tensors::{Flat, Tensors, Unflatten};

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
    pub fn with_rope(self, rope: &RopeTables) -> Self {
        self.with("rope.cos", &rope.cos).with("rope.sin", &rope.sin)
    }

    /// The rotary tables passed with [`Args::with_rope`].
    pub fn rope(&self) -> Result<RopeTables> {
        Ok(RopeTables {
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
}

/// Each entry's name (in the layout) and tensor, in order.
impl Tensors for Args {
    fn flatten(&self, flat: &mut Flat) {
        flat.push_count(self.entries.len());
        for (name, tensor) in &self.entries {
            flat.push_name(name.clone());
            flat.push(tensor);
        }
    }
    fn unflatten(from: &mut Unflatten<'_>) -> Result<Self> {
        let entries = (0..from.count()?)
            .map(|_| Ok((from.name()?, from.tensor()?)))
            .collect::<Result<_>>()?;
        Ok(Args { entries })
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
        let compiled = crate::Compiled::new("test");
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
