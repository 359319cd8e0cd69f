//! kiln-rng
