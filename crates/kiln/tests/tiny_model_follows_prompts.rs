//! The bundled tiny model follows its prompts: for every prompt × seed of `assets/tiny-flux/eval.json`
//! the image's background colour, shape colour and (when named) position must match the caption,
//! judged with the plain pixel statistics `tools/tiny_flux/shapes.py` defines (same numbers).

use std::path::PathBuf;

use image::RgbImage;
use kiln::defaults::ModelDefaults;
use kiln::{DType, Device, FluxCall, FluxPipeline, LoadOptions};
use serde_json::Value;

fn model() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tiny-flux"))
}

struct Check {
    palette: Vec<(String, [f64; 3])>,
    border: usize,
    threshold: f64,
    min_pixels: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn dist(a: [f64; 3], b: [f64; 3]) -> f64 {
    ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2) + (a[2] - b[2]).powi(2)).sqrt()
}

struct Analysis {
    background: String,
    color: Option<String>,
    position: Option<&'static str>,
}

impl Check {
    fn nearest(&self, rgb: [f64; 3]) -> String {
        self.palette
            .iter()
            .min_by(|a, b| dist(a.1, rgb).total_cmp(&dist(b.1, rgb)))
            .map(|(n, _)| n.clone())
            .unwrap_or_default()
    }

    fn median_rgb(pixels: &[[f64; 3]]) -> [f64; 3] {
        [0, 1, 2].map(|c| median(pixels.iter().map(|p| p[c]).collect()))
    }

    fn analyse(&self, img: &RgbImage) -> Analysis {
        let (w, h) = (img.width() as usize, img.height() as usize);
        let px = |x: usize, y: usize| {
            let p = img.get_pixel(x as u32, y as u32).0;
            [p[0] as f64, p[1] as f64, p[2] as f64]
        };
        let frame: Vec<[f64; 3]> = (0..h)
            .flat_map(|y| (0..w).map(move |x| (x, y)))
            .filter(|&(x, y)| x < self.border || y < self.border || x >= w - self.border || y >= h - self.border)
            .map(|(x, y)| px(x, y))
            .collect();
        let bg = Self::median_rgb(&frame);
        let far: Vec<(usize, [f64; 3])> = (0..h)
            .flat_map(|y| (0..w).map(move |x| (x, y)))
            .map(|(x, y)| (x, px(x, y)))
            .filter(|(_, p)| dist(*p, bg) > self.threshold)
            .collect();
        let background = self.nearest(bg);
        if far.len() < self.min_pixels {
            return Analysis {
                background,
                color: None,
                position: None,
            };
        }
        let colors: Vec<[f64; 3]> = far.iter().map(|(_, p)| *p).collect();
        let cx = far.iter().map(|(x, _)| *x as f64).sum::<f64>() / far.len() as f64 + 0.5;
        let third = w as f64 / 3.0;
        let position = if cx < third {
            "left"
        } else if cx < 2.0 * third {
            "middle"
        } else {
            "right"
        };
        Analysis {
            background,
            color: Some(self.nearest(Self::median_rgb(&colors))),
            position: Some(position),
        }
    }
}

#[test]
fn bundled_model_follows_its_prompts() {
    let dir = model();
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("eval.json")).unwrap()).unwrap();
    let defaults = ModelDefaults::for_folder(&dir).unwrap().expect("kiln_defaults.json");
    let check = Check {
        palette: spec["palette"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let c: Vec<f64> = v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                (k.clone(), [c[0], c[1], c[2]])
            })
            .collect(),
        border: spec["check"]["border_px"].as_u64().unwrap() as usize,
        threshold: spec["check"]["shape_threshold"].as_f64().unwrap(),
        min_pixels: spec["check"]["shape_min_pixels"].as_u64().unwrap() as usize,
    };
    let seeds: Vec<u64> = spec["seeds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect();
    let mut pipe = FluxPipeline::from_pretrained(
        dir.to_str().unwrap(),
        &LoadOptions {
            dtype: DType::BF16,
            revision: None,
        },
    )
    .unwrap()
    .to(&Device::cpu().unwrap())
    .unwrap();
    let (mut passed, mut total) = (0, 0);
    for p in spec["prompts"].as_array().unwrap() {
        let prompt = p["prompt"].as_str().unwrap();
        for &seed in &seeds {
            let out = pipe
                .call(FluxCall {
                    height: defaults.height,
                    width: defaults.width,
                    num_inference_steps: defaults.num_inference_steps,
                    guidance_scale: defaults.guidance_scale,
                    max_sequence_length: defaults.max_sequence_length,
                    seed,
                    progress: false,
                    ..FluxCall::prompt(prompt)
                })
                .unwrap();
            let a = check.analyse(&out.images[0]);
            let ok = Some(a.background.as_str()) == p["background"].as_str()
                && a.color.as_deref() == p["color"].as_str()
                && (p["position"].is_null() || a.position == p["position"].as_str());
            if !ok {
                eprintln!(
                    "miss: seed {seed} {prompt:?}: background {}, colour {:?}, position {:?}",
                    a.background, a.color, a.position
                );
            }
            passed += ok as usize;
            total += 1;
        }
    }
    let accuracy = passed as f64 / total as f64;
    eprintln!("prompt accuracy: {passed}/{total} = {:.1} %", accuracy * 100.0);
    assert!(total >= 48, "eval.json should have at least 48 prompt × seed pairs");
    assert!(accuracy >= 0.9, "accuracy {:.1} % is below 90 %", accuracy * 100.0);
}
