//! Compares kiln's hand-written `#[repr(C)]` structs with the `*_STRUCT_SIZE` values and the
//! function-table offsets of the `pjrt_c_api.h` that ships in the xla-cpu-pjrt wheel.

use std::path::PathBuf;
use std::process::Command;

use kiln_pjrt::{sys, Platform, SearchPaths};

fn header() -> PathBuf {
    let loc = SearchPaths::from_environment()
        .find(Some(Platform::Cpu))
        .expect("the CPU plugin must be installed (see README)");
    let header = loc.path.parent().unwrap().join("include/pjrt_c_api.h");
    assert!(
        header.is_file(),
        "the xla-cpu-pjrt wheel should ship {}",
        header.display()
    );
    header
}

#[test]
fn struct_sizes_and_table_offsets_match_the_header() {
    let header = header();
    let dir = std::env::temp_dir().join(format!("kiln-pjrt-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"pjrt_c_api.h\"\nint main(void) {\n");
    for (name, _) in sys::CHECKED_STRUCTS {
        c.push_str(&format!("  printf(\"{name} %zu\\n\", (size_t){name}_STRUCT_SIZE);\n"));
    }
    for (field, _) in sys::CHECKED_API_OFFSETS {
        c.push_str(&format!(
            "  printf(\"api.{field} %zu\\n\", offsetof(PJRT_Api, {field}));\n"
        ));
    }
    c.push_str("  return 0;\n}\n");
    let src = dir.join("sizes.c");
    let exe = dir.join("sizes");
    std::fs::write(&src, c).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .arg("-I")
        .arg(header.parent().unwrap())
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .status()
        .expect("a C compiler (cc) is needed for this test");
    assert!(status.success(), "compiling the header check failed");
    let out = Command::new(&exe).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut checked = 0;
    for line in text.lines() {
        let (name, value) = line.split_once(' ').unwrap();
        let value: usize = value.parse().unwrap();
        let ours = if let Some(field) = name.strip_prefix("api.") {
            sys::CHECKED_API_OFFSETS.iter().find(|(n, _)| *n == field).unwrap().1
        } else {
            sys::CHECKED_STRUCTS.iter().find(|(n, _)| *n == name).unwrap().1
        };
        assert_eq!(ours, value, "{name}: kiln {ours}, header {value}");
        checked += 1;
    }
    assert_eq!(checked, sys::CHECKED_STRUCTS.len() + sys::CHECKED_API_OFFSETS.len());
    let _ = std::fs::remove_dir_all(&dir);
}
