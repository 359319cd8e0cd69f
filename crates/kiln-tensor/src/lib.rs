//! kiln-tensor
