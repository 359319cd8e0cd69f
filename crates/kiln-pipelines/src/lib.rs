//! kiln-pipelines
