//! Tracing: the same op code recording into one program instead of running.
//!
//! A [`Trace`] owns the builder of a program under construction. Tensors whose storage is a traced
//! value route their ops here (see `dispatch::apply_on`). A concrete tensor met inside a trace (a
//! weight not passed as an argument, a constant table) is lifted to a program parameter, one per
//! buffer however often it is used, and kept so that every call of the program passes it again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_hlo::{Builder, Value};
use kiln_types::Shape;

use crate::device::Device;
use crate::dispatch::parameter_for;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

#[derive(Clone)]
pub(crate) struct Trace(Arc<TraceInner>);

struct TraceInner {
    device: Device,
    state: Mutex<TraceState>,
}

struct TraceState {
    builder: Builder,
    /// Concrete tensors lifted to parameters, in parameter order after the declared arguments.
    captured: Vec<Tensor>,
    /// (buffer, logical shape) → the value standing for it.
    lifted: HashMap<(usize, Shape), Value>,
}

impl Trace {
    pub(crate) fn new(device: &Device) -> Trace {
        let mut builder = Builder::new();
        builder.set_manual_partitions(device.mesh_size());
        Trace(Arc::new(TraceInner {
            device: device.clone(),
            state: Mutex::new(TraceState {
                builder,
                captured: Vec::new(),
                lifted: HashMap::new(),
            }),
        }))
    }

    pub(crate) fn same(&self, other: &Trace) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub(crate) fn device(&self) -> &Device {
        &self.0.device
    }

    fn state(&self) -> MutexGuard<'_, TraceState> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Declares the next argument of the program for the concrete tensor `t` and returns the
    /// traced value standing for it. `CompiledFunction` declares every argument before tracing, so
    /// arguments come first among the parameters and lifted tensors after them.
    pub(crate) fn argument(&self, t: &Tensor) -> Result<Tensor> {
        let mut st = self.state();
        let v = parameter_for(&mut st.builder, t).map_err(|source| Error::Build { op: "trace", source })?;
        Ok(Tensor::traced(self.clone(), v))
    }

    fn value_of(&self, st: &mut TraceState, op: &'static str, t: &Tensor) -> Result<Value> {
        if let Some((trace, value)) = t.trace() {
            if !trace.same(self) {
                return Err(Error::invalid(
                    op,
                    "operands come from two different compiled functions being traced",
                ));
            }
            return Ok(value.clone());
        }
        if t.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.device().to_string(),
                rhs: t.device().to_string(),
            });
        }
        let id = t.buffer_id().expect("a tensor that is not traced has a buffer");
        let key = (id, t.shape().clone());
        if let Some(v) = st.lifted.get(&key) {
            return Ok(v.clone());
        }
        let v = parameter_for(&mut st.builder, t).map_err(|source| Error::Build { op, source })?;
        st.captured.push(t.clone());
        st.lifted.insert(key, v.clone());
        Ok(v)
    }

    /// Records an op: `build` emits into the trace's program.
    pub(crate) fn apply(
        &self,
        op: &'static str,
        inputs: &[&Tensor],
        build: impl FnOnce(&mut Builder, &[Value]) -> kiln_hlo::Result<Vec<Value>>,
    ) -> Result<Vec<Tensor>> {
        let mut st = self.state();
        let values = inputs
            .iter()
            .map(|t| self.value_of(&mut st, op, t))
            .collect::<Result<Vec<_>>>()?;
        let outputs = build(&mut st.builder, &values).map_err(|source| Error::Build { op, source })?;
        drop(st);
        Ok(outputs.into_iter().map(|v| Tensor::traced(self.clone(), v)).collect())
    }

    /// A reshape of a traced value, recorded in the program.
    pub(crate) fn reshape(&self, value: &Value, shape: Shape) -> Result<Tensor> {
        let v = self
            .state()
            .builder
            .reshape(value, shape)
            .map_err(|source| Error::Build { op: "reshape", source })?;
        Ok(Tensor::traced(self.clone(), v))
    }

    /// Ends the trace with `outputs` as the program's results: the program text and the concrete
    /// tensors lifted to parameters after the declared arguments.
    pub(crate) fn finish(&self, outputs: &[Tensor]) -> Result<(String, Vec<Tensor>)> {
        let mut st = self.state();
        let values = outputs
            .iter()
            .map(|t| self.value_of(&mut st, "return", t))
            .collect::<Result<Vec<_>>>()?;
        let program = st
            .builder
            .finish(&values)
            .map_err(|source| Error::Build { op: "return", source })?;
        Ok((program, std::mem::take(&mut st.captured)))
    }
}
