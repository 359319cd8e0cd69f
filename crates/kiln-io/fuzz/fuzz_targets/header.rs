//! Any byte string as a whole safetensors file: open must return Ok or Err, never panic, and
//! every view and slice of an accepted file must stay inside it.
#![no_main]

use kiln_io::SafetensorsFile;
use libfuzzer_sys::fuzz_target;

#[path = "../checks/accepted_file.rs"]
mod accepted_file;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = SafetensorsFile::from_bytes("fuzz.safetensors", data.to_vec()) {
        accepted_file::check_accepted(&file);
    }
});
