//! kiln-io
