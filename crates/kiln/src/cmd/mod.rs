pub mod bench;
pub mod devices;
pub mod generate;
pub mod selftest;
