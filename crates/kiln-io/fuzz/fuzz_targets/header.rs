//! Any byte string as a whole safetensors file: open must return Ok or Err, never panic, and
//! every view and slice of an accepted file must stay inside it.
#![no_main]

use kiln_io::SafetensorsFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = SafetensorsFile::from_bytes("fuzz.safetensors", data.to_vec()) else {
        return;
    };
    let names: Vec<String> = file.names().map(str::to_string).collect();
    for name in &names {
        let info = file.info(name).expect("listed names have header entries");
        let Ok(view) = file.tensor(name) else {
            continue;
        };
        assert_eq!(view.data.len(), view.numel() * view.dtype.size_in_bytes());
        assert_eq!(view.data.len(), info.data_offsets.1 - info.data_offsets.0);
        let _ = file.weight(name);
        for (dim, &size) in view.shape.dims().iter().enumerate() {
            for range in [0..size, size / 2..size, 0..size / 2, size..size.saturating_add(1)] {
                if let Ok(bytes) = view.narrow(dim, range.clone()) {
                    if view.numel() == 0 {
                        assert!(bytes.is_empty());
                        continue;
                    }
                    let row: usize = view.shape.dims()[dim + 1..].iter().product();
                    let outer: usize = view.shape.dims()[..dim].iter().product();
                    let expected = outer * range.len() * row * view.dtype.size_in_bytes();
                    assert_eq!(bytes.len(), expected);
                }
            }
        }
    }
});
