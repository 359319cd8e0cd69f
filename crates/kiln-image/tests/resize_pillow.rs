//! Input images against Pillow 13.0.0: the Lanczos resize and mode conversions bit for bit
//! (tests/fixtures/pillow_resize.bin, written by tools/fixtures/pillow_resize_fixture.py), the
//! oracle's preprocessed inputs, and clear errors for files that are not usable images.

use std::io::Cursor;

use kiln_image::{ImageError, InputImage};
use safetensors::SafeTensors;

const NO_LIMIT: u64 = u64::MAX;

// --- the fixture ---------------------------------------------------------------------------

/// The fixture script's SplitMix64 byte stream (each output as 8 little-endian bytes).
fn splitmix64_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
    })
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
}

enum Expected {
    Pixels(Vec<u8>),
    Digest(u64),
}

struct Case {
    name: String,
    op: u8,
    input: InputImage,
    out_w: u32,
    out_h: u32,
    out_channels: u8,
    expected: Expected,
}

fn fixture_cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pillow_resize.bin");
    let bytes = std::fs::read(path).expect("tests/fixtures/pillow_resize.bin");
    let mut r = Reader(&bytes);
    assert_eq!(r.take(8), b"KILNRSZ1");
    let n = r.u32();
    let mut cases = Vec::new();
    for _ in 0..n {
        let name_len = r.u16() as usize;
        let name = String::from_utf8(r.take(name_len).to_vec()).unwrap();
        let op = r.u8();
        let source = r.u8();
        let payload = match source {
            0 => Err(r.u64()),
            1 => {
                let len = r.u32() as usize;
                Ok(r.take(len).to_vec())
            }
            other => panic!("{name}: unknown source {other}"),
        };
        let (channels, in_w, in_h, out_w, out_h, out_channels) = (r.u8(), r.u32(), r.u32(), r.u32(), r.u32(), r.u8());
        let input = match payload {
            Err(seed) => {
                let data = splitmix64_bytes(seed, (in_w * in_h) as usize * usize::from(channels));
                InputImage::new(in_w, in_h, channels, data).unwrap()
            }
            Ok(file) => InputImage::decode(&file, &name, NO_LIMIT).unwrap(),
        };
        assert_eq!(
            (input.width(), input.height(), input.channels()),
            (in_w, in_h, channels),
            "{name}"
        );
        let expected = match r.u8() {
            0 => {
                let len = r.u32() as usize;
                Expected::Pixels(r.take(len).to_vec())
            }
            1 => Expected::Digest(r.u64()),
            other => panic!("{name}: unknown expectation {other}"),
        };
        cases.push(Case {
            name,
            op,
            input,
            out_w,
            out_h,
            out_channels,
            expected,
        });
    }
    assert!(r.0.is_empty(), "trailing bytes in the fixture");
    cases
}

#[test]
fn matches_pillow_bit_for_bit() {
    let cases = fixture_cases();
    assert!(cases.len() >= 90, "{} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let out = match case.op {
            0 => case.input.resize_lanczos(case.out_w, case.out_h),
            1 => case.input.resize_lanczos(case.out_w, case.out_h).to_luma(),
            2 => case.input.to_luma(),
            3 => case.input.to_rgb(),
            other => panic!("{}: unknown op {other}", case.name),
        };
        assert_eq!(
            (out.width(), out.height(), out.channels()),
            (case.out_w, case.out_h, case.out_channels)
        );
        match &case.expected {
            Expected::Pixels(want) => {
                let differ = out.data().iter().zip(want).filter(|(a, b)| a != b).count();
                if differ > 0 || out.data().len() != want.len() {
                    failures.push(format!("{}: {differ} of {} bytes differ", case.name, want.len()));
                }
            }
            Expected::Digest(want) => {
                if fnv1a64(out.data()) != *want {
                    failures.push(format!("{}: digest differs", case.name));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from Pillow:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

// --- the oracle's preprocessed inputs ----------------------------------------------------------

fn tensor_f32(st: &SafeTensors, key: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
    (t.shape().to_vec(), bytemuck::pod_collect_to_vec(t.data()))
}

/// The top-left `rows`×`cols` of planar `[c, h, w]` data.
fn top_left(planar: &[f32], c: usize, (h, w): (usize, usize), (rows, cols): (usize, usize)) -> Vec<f32> {
    let mut out = Vec::with_capacity(c * rows * cols);
    for ch in 0..c {
        for y in 0..rows {
            out.extend_from_slice(&planar[ch * h * w + y * w..][..cols]);
        }
    }
    out
}

fn normalized(image: &InputImage) -> Vec<f32> {
    image.to_planar_f32().into_iter().map(|x| 2.0 * x - 1.0).collect()
}

/// diffusers' VaeImageProcessor: the init image Lanczos-resized (FLUX.1, SD3; Kontext to its
/// preferred resolution), the mask resized in its own mode, then L, then binarised at 0.5;
/// FLUX.2's references center-cropped and converted to RGB.
#[test]
fn oracle_preprocessed_inputs() {
    let cases = kiln_fixtures::oracle().join("cases");
    let mut checked = 0;
    for (case, key) in [
        ("flux1_img2img/dev_batch2x2_low_strength_resize", "image.preprocessed"),
        ("flux1_img2img/dev_strength06_nonsquare", "image.preprocessed"),
        ("flux1_img2img/schnell_strength1", "image.preprocessed"),
        ("flux1_inpaint/dev_square", "image.preprocessed"),
        ("flux1_inpaint/schnell_resize_rgb_mask_2images", "image.preprocessed"),
        ("sd3_img2img/cfg_square", "image.preprocessed"),
        ("sd3_img2img/default_size_resize_nocfg", "image.preprocessed"),
        ("sd3_inpaint/batch2_resize_nocfg", "image.preprocessed"),
        ("sd3_inpaint/cfg_strength1", "image.preprocessed"),
        ("flux1_kontext/auto_resize_true_cfg", "image.preprocessed.crop32"),
        (
            "flux1_kontext/default_size_max_area_2images",
            "image.preprocessed.crop32",
        ),
    ] {
        let dir = cases.join(case);
        let bytes = std::fs::read(dir.join("tensors.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let call: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("call.json")).unwrap()).unwrap();
        let (shape, want) = tensor_f32(&st, key);
        let (h, w) = match call["derived"]["image_resized_hw"].as_array() {
            Some(hw) => (hw[0].as_u64().unwrap() as usize, hw[1].as_u64().unwrap() as usize),
            None => (shape[2], shape[3]),
        };
        let init = InputImage::open(&dir.join("init.png"), NO_LIMIT).unwrap();
        let resized = init.resize_lanczos(w as u32, h as u32);
        let got = top_left(&normalized(&resized), 3, (h, w), (shape[2], shape[3]));
        assert!(got == want, "{case}: {key} differs");
        checked += 1;

        if let Ok(t) = st.tensor("mask.preprocessed") {
            let want: Vec<f32> = bytemuck::pod_collect_to_vec(t.data());
            let mask = InputImage::open(&dir.join("mask.png"), NO_LIMIT).unwrap();
            let mask = mask.resize_lanczos(w as u32, h as u32).to_luma();
            let got: Vec<f32> = mask
                .to_planar_f32()
                .into_iter()
                .map(|x| if x < 0.5 { 0.0 } else { 1.0 })
                .collect();
            assert!(got == want, "{case}: mask.preprocessed differs");
            checked += 1;
        }
    }
    for case in [
        "flux2_dev_edit/one_ref_crop",
        "flux2_dev_edit/two_refs_default_size",
        "flux2_klein_edit/one_ref_nonsquare",
    ] {
        let dir = cases.join(case);
        let bytes = std::fs::read(dir.join("tensors.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let call: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("call.json")).unwrap()).unwrap();
        for (i, r) in call["derived"]["refs"].as_array().unwrap().iter().enumerate() {
            let box_: Vec<u32> = r["crop_box_ltrb"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let input = InputImage::open(&dir.join(r["file"].as_str().unwrap()), NO_LIMIT).unwrap();
            assert_eq!(
                [input.width(), input.height()],
                [
                    r["input_size_wh"][0].as_u64().unwrap() as u32,
                    r["input_size_wh"][1].as_u64().unwrap() as u32
                ]
            );
            let cropped = input
                .to_rgb()
                .crop(box_[0], box_[1], box_[2] - box_[0], box_[3] - box_[1])
                .unwrap();
            let (shape, want) = tensor_f32(&st, &format!("image{i}.preprocessed.crop16"));
            let size = (cropped.height() as usize, cropped.width() as usize);
            let got = top_left(&normalized(&cropped), 3, size, (shape[2], shape[3]));
            assert!(got == want, "{case}: ref {i} differs");
            checked += 1;
        }
    }
    // 11 images, 4 masks, 4 references.
    assert_eq!(checked, 19);
}

// --- the other operations -------------------------------------------------------------------

fn image(width: u32, height: u32, channels: u8, seed: u64) -> InputImage {
    let data = splitmix64_bytes(seed, (width * height) as usize * usize::from(channels));
    InputImage::new(width, height, channels, data).unwrap()
}

#[test]
fn new_checks_channels_and_length() {
    assert!(InputImage::new(2, 2, 3, vec![0; 12]).is_ok());
    let err = InputImage::new(2, 2, 3, vec![0; 11]).unwrap_err();
    assert!(
        matches!(
            err,
            ImageError::InputLength {
                expected: 12,
                got: 11,
                ..
            }
        ),
        "{err}"
    );
    let err = InputImage::new(2, 2, 5, vec![0; 20]).unwrap_err();
    assert!(matches!(err, ImageError::InputChannels { channels: 5 }), "{err}");
    assert!(InputImage::new(u32::MAX, u32::MAX, 4, Vec::new()).is_err());
}

#[test]
fn luma_rgb_and_planar() {
    let rgb = InputImage::new(2, 1, 3, vec![255, 0, 0, 10, 200, 30]).unwrap();
    // (255·19595 + 0x8000) >> 16 = 76; (10·19595 + 200·38470 + 30·7471 + 0x8000) >> 16 = 124.
    assert_eq!(rgb.to_luma().data(), [76, 124]);
    let rgba = InputImage::new(2, 1, 4, vec![255, 0, 0, 0, 10, 200, 30, 7]).unwrap();
    assert_eq!(rgba.to_luma(), rgb.to_luma());
    assert_eq!(rgba.to_rgb(), rgb);
    let la = InputImage::new(2, 1, 2, vec![9, 1, 250, 2]).unwrap();
    assert_eq!(la.to_luma().data(), [9, 250]);
    assert_eq!(la.to_rgb().data(), [9, 9, 9, 250, 250, 250]);
    let l = la.to_luma();
    assert_eq!(l.to_luma(), l);
    assert_eq!(l.to_rgb(), la.to_rgb());

    let planar = rgb.to_planar_f32();
    assert_eq!(planar, [1.0, 10.0 / 255.0, 0.0, 200.0 / 255.0, 0.0, 30.0 / 255.0]);
    assert_eq!(l.to_planar_f32(), [9.0 / 255.0, 250.0 / 255.0]);
}

#[test]
fn crop_inside_and_outside() {
    let im = image(5, 4, 3, 7);
    let c = im.crop(1, 2, 3, 2).unwrap();
    assert_eq!((c.width(), c.height(), c.channels()), (3, 2, 3));
    for y in 0..2 {
        for x in 0..3 {
            let src = ((y + 2) * 5 + x + 1) * 3;
            assert_eq!(&c.data()[(y * 3 + x) * 3..][..3], &im.data()[src..src + 3]);
        }
    }
    assert_eq!(im.crop(0, 0, 5, 4).unwrap(), im);
    assert_eq!(im.crop(5, 4, 0, 0).unwrap().data(), [] as [u8; 0]);
    for (l, t, w, h) in [(1, 0, 5, 4), (0, 1, 5, 4), (6, 0, 0, 1), (u32::MAX, 0, 2, 1)] {
        let err = im.crop(l, t, w, h).unwrap_err();
        assert!(matches!(err, ImageError::CropOutside { .. }), "{err}");
        assert!(err.to_string().contains("5x4"), "{err}");
    }
}

#[test]
fn resize_keeps_same_size_and_mode() {
    let im = image(9, 7, 2, 3);
    assert_eq!(im.resize_lanczos(9, 7), im);
    let out = im.resize_lanczos(4, 11);
    assert_eq!(
        (out.width(), out.height(), out.channels(), out.data().len()),
        (4, 11, 2, 88)
    );
    // Opaque RGBA resizes like RGB (premultiplying by 255 changes nothing).
    let rgb = image(13, 17, 3, 4);
    let rgba_data: Vec<u8> = rgb.data().chunks(3).flat_map(|p| [p[0], p[1], p[2], 255]).collect();
    let rgba = InputImage::new(13, 17, 4, rgba_data).unwrap();
    for (w, h) in [(20, 9), (5, 30), (13, 30), (40, 40)] {
        assert_eq!(rgba.resize_lanczos(w, h).to_rgb(), rgb.resize_lanczos(w, h), "{w}x{h}");
    }
    // Degenerate sizes give empty or black images, never a panic.
    assert!(im.resize_lanczos(0, 5).data().is_empty());
    let empty = InputImage::new(0, 3, 1, Vec::new()).unwrap();
    assert_eq!(empty.resize_lanczos(2, 2).data(), [0, 0, 0, 0]);
}

// --- decoding -------------------------------------------------------------------------------

fn encode_png(image: &InputImage) -> Vec<u8> {
    let color = match image.channels() {
        1 => image::ExtendedColorType::L8,
        2 => image::ExtendedColorType::La8,
        3 => image::ExtendedColorType::Rgb8,
        _ => image::ExtendedColorType::Rgba8,
    };
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        image.data(),
        image.width(),
        image.height(),
        color,
    )
    .unwrap();
    out
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut out = (data.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    out.extend_from_slice(&crc32(&[&kind[..], data].concat()).to_be_bytes());
    out
}

/// A PNG whose header claims `width`×`height` RGBA pixels, with a few bytes of (bogus) data.
fn png_claiming(width: u32, height: u32) -> Vec<u8> {
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 6, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    png.extend(chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00]));
    png.extend(chunk(b"IEND", &[]));
    png
}

#[test]
fn decodes_every_mode_as_pillow_opens_it() {
    for channels in 1..=4 {
        let im = image(7, 5, channels, u64::from(channels));
        let back = InputImage::decode(&encode_png(&im), "test", 35).unwrap();
        assert_eq!(back, im);
    }
    // 16-bit RGB keeps the high byte, like Pillow's "RGB;16B" unpacking (0x01FF -> 1, not 2).
    let samples: Vec<u16> = vec![0x01FF, 0x80FF, 0xFF7F, 0x0000, 0x7F80, 0xFFFF];
    let buffer = image::ImageBuffer::<image::Rgb<u16>, _>::from_raw(2, 1, samples).unwrap();
    let mut png = Cursor::new(Vec::new());
    buffer.write_to(&mut png, image::ImageFormat::Png).unwrap();
    let back = InputImage::decode(png.get_ref(), "test", 2).unwrap();
    assert_eq!((back.channels(), back.data()), (3, &[1, 0x80, 0xFF, 0, 0x7F, 0xFF][..]));
}

fn png_with(width: u32, color: png::ColorType, depth: png::BitDepth, trns: Option<&[u8]>, row: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, 1);
    encoder.set_color(color);
    encoder.set_depth(depth);
    if let Some(trns) = trns {
        encoder.set_trns(trns.to_vec());
    }
    encoder.write_header().unwrap().write_image_data(row).unwrap();
    out
}

/// Pillow 13.0.0 on the same files: "L" [0, 85, 170, 255]; "L" [5, 7] with a `transparency` of
/// 5; "RGB" [1, 2, 3] with a `transparency` of (1, 2, 3).
#[test]
fn png_variants_open_as_pillow_opens_them() {
    use png::{BitDepth, ColorType};
    let gray2 = png_with(4, ColorType::Grayscale, BitDepth::Two, None, &[0b0001_1011]);
    let im = InputImage::decode(&gray2, "x", NO_LIMIT).unwrap();
    assert_eq!((im.channels(), im.data()), (1, &[0, 85, 170, 255][..]));
    let keyed = png_with(2, ColorType::Grayscale, BitDepth::Eight, Some(&[0, 5]), &[5, 7]);
    let im = InputImage::decode(&keyed, "x", NO_LIMIT).unwrap();
    assert_eq!((im.channels(), im.data()), (1, &[5, 7][..]));
    let keyed = png_with(
        1,
        ColorType::Rgb,
        BitDepth::Eight,
        Some(&[0, 1, 0, 2, 0, 3]),
        &[1, 2, 3],
    );
    let im = InputImage::decode(&keyed, "x", NO_LIMIT).unwrap();
    assert_eq!((im.channels(), im.data()), (3, &[1, 2, 3][..]));
    // Palette images come out as RGB (Pillow: mode "P"), RGBA with a `tRNS` chunk.
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, 2, 1);
    encoder.set_color(ColorType::Indexed);
    encoder.set_palette(vec![10, 20, 30, 40, 50, 60]);
    encoder.set_trns(vec![255, 0]);
    encoder.write_header().unwrap().write_image_data(&[1, 0]).unwrap();
    let im = InputImage::decode(&out, "x", NO_LIMIT).unwrap();
    assert_eq!((im.channels(), im.data()), (4, &[40, 50, 60, 0, 10, 20, 30, 255][..]));
}

#[test]
fn open_reads_files_and_names_them_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let im = image(6, 4, 3, 11);
    let path = dir.path().join("in.png");
    std::fs::write(&path, encode_png(&im)).unwrap();
    assert_eq!(InputImage::open(&path, 24).unwrap(), im);

    let err = InputImage::open(&path, 23).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            ImageError::InputTooLarge {
                width: 6,
                height: 4,
                pixels: 24,
                max_pixels: 23,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("in.png") && msg.contains("6x4") && msg.contains("23") && msg.contains("scale it down"),
        "{msg}"
    );

    let missing = dir.path().join("missing.png");
    let err = InputImage::open(&missing, NO_LIMIT).unwrap_err();
    assert!(
        matches!(err, ImageError::InputRead { .. }) && err.to_string().contains("missing.png"),
        "{err}"
    );

    let empty = dir.path().join("empty.png");
    std::fs::write(&empty, b"").unwrap();
    let err = InputImage::open(&empty, NO_LIMIT).unwrap_err();
    assert!(matches!(err, ImageError::InputEmpty { .. }), "{err}");
    assert!(
        err.to_string().contains("empty.png") && err.to_string().contains("PNG"),
        "{err}"
    );

    let text = dir.path().join("notes.png");
    std::fs::write(&text, b"these are not pixels, just some text\n").unwrap();
    let err = InputImage::open(&text, NO_LIMIT).unwrap_err();
    assert!(
        matches!(err, ImageError::InputFormat { .. }) && err.to_string().contains("notes.png"),
        "{err}"
    );

    let truncated = dir.path().join("cut.png");
    let big = encode_png(&image(40, 40, 3, 12));
    std::fs::write(&truncated, &big[..big.len() / 2]).unwrap();
    let err = InputImage::open(&truncated, NO_LIMIT).unwrap_err();
    assert!(matches!(err, ImageError::InputDecode { .. }), "{err}");
    assert!(
        err.to_string().contains("cut.png") && err.to_string().contains("truncated"),
        "{err}"
    );
}

#[test]
fn upload_errors_are_clear() {
    let what = "field `image`";
    let err = InputImage::decode(&[], what, NO_LIMIT).unwrap_err();
    assert!(
        matches!(err, ImageError::InputEmpty { .. }) && err.to_string().contains(what),
        "{err}"
    );
    let err = InputImage::decode(b"GIF89a not really", what, NO_LIMIT).unwrap_err();
    assert!(err.to_string().contains(what), "{err}");
    let err = InputImage::decode(b"{\"json\": true}", what, NO_LIMIT).unwrap_err();
    assert!(
        matches!(err, ImageError::InputFormat { .. }) && err.to_string().contains(what),
        "{err}"
    );
    let png = encode_png(&image(20, 20, 1, 5));
    for cut in [8, 20, 33, 40, png.len() / 2, png.len() - 30] {
        let err = InputImage::decode(&png[..cut], what, NO_LIMIT).unwrap_err();
        assert!(matches!(err, ImageError::InputDecode { .. }), "cut at {cut}: {err}");
    }
}

/// The limit is checked on the header's size: a PNG claiming 10^10 (or 2^62) pixels is refused
/// without the decoder allocating them (which would abort the test).
#[test]
fn pixel_limit_is_checked_before_decoding() {
    for (w, h) in [(100_000, 100_000), (i32::MAX as u32, i32::MAX as u32)] {
        let err = InputImage::decode(&png_claiming(w, h), "field `image`", 4096 * 4096).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, ImageError::InputTooLarge { width, height, .. } if (width, height) == (w, h)),
            "{msg}"
        );
        assert!(
            msg.contains("field `image`") && msg.contains(&format!("{w}x{h}")) && msg.contains("16777216"),
            "{msg}"
        );
    }
    // Allowed by the limit, the same file fails in decoding, cleanly.
    let err = InputImage::decode(&png_claiming(3, 2), "x", 6).unwrap_err();
    assert!(matches!(err, ImageError::InputDecode { .. }), "{err}");
    let err = InputImage::decode(&png_claiming(0, 5), "field `mask`", NO_LIMIT).unwrap_err();
    assert!(
        matches!(
            err,
            ImageError::InputNoPixels {
                width: 0,
                height: 5,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("field `mask`") && err.to_string().contains("0x5"),
        "{err}"
    );
    // The same through a file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.png");
    std::fs::write(&path, png_claiming(u32::MAX, 3)).unwrap();
    let err = InputImage::open(&path, 1 << 24).unwrap_err();
    assert!(
        matches!(err, ImageError::InputTooLarge { .. }) && err.to_string().contains("huge.png"),
        "{err}"
    );
}
