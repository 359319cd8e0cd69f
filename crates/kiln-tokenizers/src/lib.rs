//! kiln-tokenizers
