pub mod bench;
pub mod devices;
pub mod generate;
