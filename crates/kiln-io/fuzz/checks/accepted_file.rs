//! What must hold for every safetensors file the parser accepts: each view matches its header
//! entry and every slice stays inside it. Shared by the `header` fuzz target and the mutation
//! test (`tests/mutation.rs`).

use kiln_io::SafetensorsFile;

pub fn check_accepted(file: &SafetensorsFile) {
    for name in file.names() {
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
                    let inner: usize = view.shape.dims()[dim + 1..].iter().product();
                    let outer: usize = view.shape.dims()[..dim].iter().product();
                    let expected = outer * range.len() * inner * view.dtype.size_in_bytes();
                    assert_eq!(bytes.len(), expected);
                }
            }
        }
    }
}
