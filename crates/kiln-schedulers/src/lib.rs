//! kiln-schedulers
