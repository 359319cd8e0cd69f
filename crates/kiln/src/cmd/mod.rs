pub mod bench;
pub mod devices;
pub mod generate;
pub mod launch;
pub mod selftest;
pub mod serve;
