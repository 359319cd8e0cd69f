//! kiln-image
