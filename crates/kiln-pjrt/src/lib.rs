//! kiln-pjrt
