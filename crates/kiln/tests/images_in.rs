//! Image-to-image and inpainting through `kiln generate`: a FLUX.1 or SD3 folder given `--image`
//! (and `--mask-image`) runs diffusers' `FluxImg2ImgPipeline` / `FluxInpaintPipeline` /
//! `StableDiffusion3Img2ImgPipeline` / `StableDiffusion3InpaintPipeline`, and every oracle case
//! gives diffusers' images, eager and compiled, in every run mode.

mod golden;
use golden::{case_flags, check_case, generate, oracle_cases, temp_dir};

const GROUPS: [&str; 4] = ["flux1_img2img", "flux1_inpaint", "sd3_img2img", "sd3_inpaint"];

#[test]
fn every_image_to_image_and_inpainting_case_gives_diffusers_images_eager_and_compiled() {
    let dir = temp_dir("images-in");
    let cases = oracle_cases(&GROUPS);
    assert_eq!(cases.len(), 9, "{cases:?}");
    for case in &cases {
        check_case(&dir, case, "eager", &[]);
        check_case(&dir, case, "full", &["--compile", "full"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// FLUX.1 Kontext: the image's tokens beside the latents, its preferred-resolution resize and
/// `max_area`; eager, compiled whole and by blocks, and with ring attention.
#[test]
fn every_kontext_case_gives_diffusers_images() {
    let dir = temp_dir("kontext");
    let cases = oracle_cases(&["flux1_kontext"]);
    assert_eq!(cases.len(), 2, "{cases:?}");
    for case in &cases {
        check_case(&dir, case, "eager", &[]);
        check_case(&dir, case, "full", &["--compile", "full"]);
    }
    check_case(&dir, &cases[0], "blocks", &["--compile", "blocks"]);
    // The image's tokens split with the latents' (context parallelism).
    check_case(&dir, &cases[1], "ring", &["--ring-degree", "2"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Repeated-block compiles, both offload modes, `--tp 2` and `--ulysses-degree 2`, on an
/// inpainting case of each family (the inpainting path covers image-to-image's too).
#[test]
fn inpainting_gives_diffusers_images_in_every_mode() {
    let dir = temp_dir("images-in-modes");
    let root = kiln_fixtures::oracle().join("cases");
    let modes: &[(&str, &[&str])] = &[
        ("blocks", &["--compile", "blocks"]),
        ("model", &["--offload", "model"]),
        ("sequential", &["--offload", "sequential"]),
        ("tp", &["--tp", "2"]),
        ("ulysses", &["--ulysses-degree", "2"]),
    ];
    for case in [
        "flux1_inpaint/schnell_resize_rgb_mask_2images",
        "sd3_inpaint/cfg_strength1",
    ] {
        for (tag, flags) in modes {
            check_case(&dir, &root.join(case), tag, flags);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad image inputs are refused before any work, naming the argument and file, and nothing is
/// written.
#[test]
fn bad_image_inputs_are_refused_clearly() {
    let dir = temp_dir("images-in-bad");
    let case = kiln_fixtures::oracle().join("cases/flux1_inpaint/dev_square");
    std::fs::write(dir.join("empty.png"), b"").unwrap();
    std::fs::write(dir.join("text.png"), b"not an image at all").unwrap();
    let init = std::fs::read(case.join("init.png")).unwrap();
    std::fs::write(dir.join("truncated.png"), &init[..init.len() / 2]).unwrap();
    let set = |flags: &mut Vec<String>, flag: &str, value: &str| {
        let at = flags.iter().position(|f| f == flag).unwrap() + 1;
        flags[at] = value.to_string();
    };
    type Change<'a> = Box<dyn Fn(&mut Vec<String>) + 'a>;
    let cases: Vec<(&str, Change, &str)> = vec![
        ("empty", Box::new(|f| set(f, "--image", "empty.png")), "empty.png"),
        ("text", Box::new(|f| set(f, "--image", "text.png")), "text.png"),
        (
            "truncated mask",
            Box::new(|f| set(f, "--mask-image", "truncated.png")),
            "mask_image",
        ),
        ("missing", Box::new(|f| set(f, "--image", "missing.png")), "missing.png"),
        ("strength", Box::new(|f| set(f, "--strength", "1.5")), "strength"),
        (
            "no step",
            Box::new(|f| set(f, "--strength", "0")),
            "the number of pipeline steps is 0",
        ),
        (
            "two images",
            Box::new(|f| f.extend(["--image".to_string(), "empty.png".to_string()])),
            "`image` is given 2 times",
        ),
    ];
    for (what, change, expected) in cases {
        let mut flags = case_flags(&case, "out.png");
        change(&mut flags);
        let (ok, stderr) = generate(&dir, &flags);
        assert!(!ok, "{what}: accepted");
        assert!(stderr.contains(expected), "{what}: {stderr}");
        assert!(!stderr.contains("panicked"), "{what}: {stderr}");
        assert!(!dir.join("out.png").exists(), "{what}: wrote an image");
    }
    // A mask without an image.
    let mut flags = case_flags(&case, "out.png");
    let at = flags.iter().position(|f| f == "--image").unwrap();
    flags.drain(at..at + 2);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(!ok && stderr.contains("mask_image"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--from` makes an inpainted image again from its PNG (which records each input file and its
/// sha256); a changed input is named and nothing is written.
#[test]
fn from_makes_an_inpainted_image_again_and_a_changed_input_is_named() {
    let dir = temp_dir("images-in-from");
    let case = kiln_fixtures::oracle().join("cases/flux1_inpaint/dev_square");
    let mut flags = case_flags(&case, "first.png");
    for flag in flags.iter_mut() {
        let path = std::path::Path::new(flag.as_str());
        if path.extension().is_some_and(|e| e == "png") && path.is_file() {
            let copy = dir.join(path.file_name().unwrap());
            std::fs::copy(path, &copy).unwrap();
            *flag = copy.display().to_string();
        }
    }
    let (ok, stderr) = generate(&dir, &flags);
    assert!(ok, "{stderr}");
    golden::assert_matches_golden(&dir.join("first.png"), &case.join("image_0.png"));
    let from = |output: &str| generate(&dir, &["--from", "first.png", "--output", output].map(String::from));
    let (ok, stderr) = from("again.png");
    assert!(ok, "{stderr}");
    assert_eq!(
        std::fs::read(dir.join("first.png")).unwrap(),
        std::fs::read(dir.join("again.png")).unwrap(),
        "--from makes the same file"
    );
    // The mask changes (one pixel): --from names it and writes nothing.
    let mut mask = image::open(dir.join("mask.png")).unwrap().into_luma8();
    let p = mask.get_pixel_mut(0, 0);
    p.0[0] ^= 0x80;
    mask.save(dir.join("mask.png")).unwrap();
    let (ok, stderr) = from("changed.png");
    assert!(!ok);
    assert!(stderr.contains("mask.png changed"), "{stderr}");
    assert!(!dir.join("changed.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
