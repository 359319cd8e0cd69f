//! kiln-hlo
