//! The program under construction.

use std::fmt::Write;
use std::sync::atomic::{AtomicU32, Ordering};

use kiln_types::{DType, Shape};

use crate::error::HloError;
use crate::Result;

static NEXT_BUILDER: AtomicU32 = AtomicU32::new(1);

/// A typed SSA value of one [`Builder`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Value {
    pub(crate) builder: u32,
    pub(crate) id: usize,
    /// For an op with several results: which one (`%v3#1`).
    pub(crate) result: Option<usize>,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
}

impl Value {
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub(crate) fn name(&self) -> String {
        match self.result {
            None => format!("%v{}", self.id),
            Some(r) => format!("%v{}#{r}", self.id),
        }
    }
}

/// The MLIR type of a tensor: `tensor<2x3xf32>`, `tensor<f32>`.
pub fn tensor_type(shape: &Shape, dtype: DType) -> String {
    let mut s = String::with_capacity(24);
    s.push_str("tensor<");
    for d in shape.dims() {
        let _ = write!(s, "{d}x");
    }
    s.push_str(dtype.mlir_name());
    s.push('>');
    s
}

/// Attributes of a function argument (sharding, donation, memory kind).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ArgAttrs {
    /// Raw MLIR attribute entries, e.g. `sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>`.
    pub entries: Vec<String>,
}

impl ArgAttrs {
    /// A Shardy sharding over `mesh`: for each dimension, the mesh axes it is split over
    /// (empty = replicated along that dimension).
    pub fn sharding(mesh: &str, dims: &[&[&str]]) -> Self {
        let dims: Vec<String> = dims
            .iter()
            .map(|axes| {
                let quoted: Vec<String> = axes.iter().map(|a| format!("\"{a}\"")).collect();
                format!("{{{}}}", quoted.join(", "))
            })
            .collect();
        ArgAttrs {
            entries: vec![format!("sdy.sharding = #sdy.sharding<@{mesh}, [{}]>", dims.join(", "))],
        }
    }

    /// Adds the entries of `other`.
    pub fn with(mut self, other: ArgAttrs) -> Self {
        self.entries.extend(other.entries);
        self
    }

    /// Lets the runtime reuse this argument's buffer for output `output`.
    pub fn donate_to(output: usize) -> Self {
        ArgAttrs {
            entries: vec![format!("tf.aliasing_output = {output} : i32")],
        }
    }
}

/// Builds one `func.func @main` and prints it as a StableHLO module.
#[derive(Debug)]
pub struct Builder {
    pub(crate) uid: u32,
    next_id: usize,
    args: Vec<(Value, ArgAttrs)>,
    pub(crate) body: String,
    module_attrs: Vec<String>,
    module_prelude: Vec<String>,
    /// `Some(n)`: a per-device program over `n` partitions (see [`Builder::set_manual_partitions`]).
    manual_partitions: Option<usize>,
    channels: i64,
}

impl Default for Builder {
    fn default() -> Self {
        Self::new()
    }
}

impl Builder {
    pub fn new() -> Self {
        Builder {
            uid: NEXT_BUILDER.fetch_add(1, Ordering::Relaxed),
            next_id: 0,
            args: Vec::new(),
            body: String::with_capacity(256),
            module_attrs: Vec::new(),
            module_prelude: Vec::new(),
            manual_partitions: None,
            channels: 0,
        }
    }

    /// Makes the program a per-device (manually partitioned) SPMD program over `partitions`
    /// devices, as JAX's `shard_map` is: every argument and result is marked
    /// `mhlo.sharding = "{manual}"`, so each device runs the body on its own local values and the
    /// only communication is the collectives the body emits (`collectives.rs`).
    pub fn set_manual_partitions(&mut self, partitions: usize) {
        self.manual_partitions = (partitions > 1).then_some(partitions);
    }

    /// A fresh channel id for a collective (ids start at 1).
    pub(crate) fn next_channel(&mut self) -> i64 {
        self.channels += 1;
        self.channels
    }

    /// The partitions of a per-device program, 1 otherwise.
    pub fn partitions(&self) -> usize {
        self.manual_partitions.unwrap_or(1)
    }

    /// Adds a function argument.
    pub fn parameter(&mut self, shape: impl Into<Shape>, dtype: DType) -> Value {
        self.parameter_with(shape, dtype, ArgAttrs::default())
    }

    pub fn parameter_with(&mut self, shape: impl Into<Shape>, dtype: DType, attrs: ArgAttrs) -> Value {
        let v = self.new_value(shape.into(), dtype);
        self.args.push((v.clone(), attrs));
        v
    }

    pub fn num_parameters(&self) -> usize {
        self.args.len()
    }

    /// A module attribute such as `mhlo.num_partitions = 2 : i32`.
    pub fn add_module_attr(&mut self, attr: impl Into<String>) {
        self.module_attrs.push(attr.into());
    }

    /// Declares a Shardy mesh, e.g. `("mesh", &[("x", 2)])` → `sdy.mesh @mesh = <["x"=2]>`.
    pub fn add_mesh(&mut self, name: &str, axes: &[(&str, usize)]) {
        let axes: Vec<String> = axes.iter().map(|(a, n)| format!("\"{a}\"={n}")).collect();
        self.module_prelude
            .push(format!("sdy.mesh @{name} = <[{}]>", axes.join(", ")));
    }

    /// A line placed in the module before `@main`, such as `sdy.mesh @mesh = <["x"=2]>`.
    pub fn add_module_prelude(&mut self, line: impl Into<String>) {
        self.module_prelude.push(line.into());
    }

    pub(crate) fn new_value(&mut self, shape: Shape, dtype: DType) -> Value {
        let v = Value {
            builder: self.uid,
            id: self.next_id,
            result: None,
            shape,
            dtype,
        };
        self.next_id += 1;
        v
    }

    /// The results of one op with several results: `%vN#0`, `%vN#1`, ... (and the name `%vN:k`
    /// the op's line must define).
    pub(crate) fn new_values(&mut self, results: &[(Shape, DType)]) -> (String, Vec<Value>) {
        let id = self.next_id;
        self.next_id += 1;
        let values = results
            .iter()
            .enumerate()
            .map(|(r, (shape, dtype))| Value {
                builder: self.uid,
                id,
                result: Some(r),
                shape: shape.clone(),
                dtype: *dtype,
            })
            .collect();
        (format!("%v{id}:{}", results.len()), values)
    }

    pub(crate) fn check(&self, op: &'static str, v: &Value) -> Result<()> {
        if v.builder != self.uid {
            return Err(HloError::ForeignValue { op, id: v.id });
        }
        Ok(())
    }

    /// Emits `%r = <text> : <signature>` for a new value of the given type and returns it.
    pub(crate) fn emit(&mut self, shape: Shape, dtype: DType, op_text: std::fmt::Arguments<'_>) -> Value {
        let v = self.new_value(shape, dtype);
        let _ = writeln!(self.body, "    {} = {}", v.name(), op_text);
        v
    }

    /// Prints the module with `outputs` as the results of `@main` (each with optional attributes).
    pub fn finish(&self, outputs: &[Value]) -> Result<String> {
        self.finish_with(outputs, &[])
    }

    pub fn finish_with(&self, outputs: &[Value], output_attrs: &[ArgAttrs]) -> Result<String> {
        for o in outputs {
            self.check("return", o)?;
        }
        let mut s = String::with_capacity(self.body.len() + 256);
        s.push_str("module @kiln");
        let mut module_attrs = self.module_attrs.clone();
        let manual = self.manual_partitions.map(|n| {
            module_attrs.push(format!("mhlo.num_partitions = {n} : i32"));
            "mhlo.sharding = \"{manual}\"".to_string()
        });
        if !module_attrs.is_empty() {
            let _ = write!(s, " attributes {{{}}}", module_attrs.join(", "));
        }
        let with_manual =
            |entries: &[String]| -> Vec<String> { entries.iter().cloned().chain(manual.clone()).collect() };
        s.push_str(" {\n");
        for line in &self.module_prelude {
            let _ = writeln!(s, "  {line}");
        }
        s.push_str("  func.func @main(");
        for (i, (v, attrs)) in self.args.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "{}: {}", v.name(), tensor_type(&v.shape, v.dtype));
            let entries = with_manual(&attrs.entries);
            if !entries.is_empty() {
                let _ = write!(s, " {{{}}}", entries.join(", "));
            }
        }
        s.push_str(") -> (");
        for (i, v) in outputs.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(&tensor_type(&v.shape, v.dtype));
            let entries = with_manual(output_attrs.get(i).map_or(&[][..], |a| &a.entries[..]));
            if !entries.is_empty() {
                let _ = write!(s, " {{{}}}", entries.join(", "));
            }
        }
        s.push_str(") {\n");
        s.push_str(&self.body);
        s.push_str("    return ");
        for (i, v) in outputs.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(&v.name());
        }
        if !outputs.is_empty() {
            s.push_str(" : ");
            for (i, v) in outputs.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                s.push_str(&tensor_type(&v.shape, v.dtype));
            }
        }
        s.push_str("\n  }\n}\n");
        Ok(s)
    }
}
