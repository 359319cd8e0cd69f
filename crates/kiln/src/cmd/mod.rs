pub mod bench;
pub mod devices;
pub mod generate;
pub mod pipeline;
pub mod selftest;
