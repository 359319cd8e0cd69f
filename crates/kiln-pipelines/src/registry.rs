//! The registry: `_class_name` → pipeline class. To add a pipeline: its files and one line in
//! [`BUILT_IN`] (or [`register`] from outside the crate, as a test does).

use std::path::PathBuf;
use std::sync::RwLock;

use kiln_io::ModelIndex;

use crate::error::Result;
use crate::loading::ModelFolder;
use crate::seam::{PipelineClass, PipelineKind};

/// The pipelines kiln ships.
static BUILT_IN: &[&PipelineClass] = &[
    &crate::flux::CLASS,
    &crate::flux::IMG2IMG_CLASS,
    &crate::flux::INPAINT_CLASS,
    &crate::flux::KONTEXT_CLASS,
    &crate::sd3::CLASS,
    &crate::sd3::IMG2IMG_CLASS,
    &crate::sd3::INPAINT_CLASS,
    &crate::flux2::CLASS,
    &crate::flux2_klein::CLASS,
    &crate::zimage::CLASS,
    &crate::zimage::IMG2IMG_CLASS,
];

/// The classes registered at run time, after the built-in ones.
static REGISTERED: RwLock<Vec<&'static PipelineClass>> = RwLock::new(Vec::new());

/// Registers `class` (e.g. a pipeline outside this crate): model folders whose
/// `model_index.json` names it load it from now on, in this process. A class name already
/// registered is an error.
pub fn register(class: PipelineClass) -> Result<PipelineKind> {
    let mut registered = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    let mut known = BUILT_IN.iter().chain(registered.iter());
    if known.any(|c| c.class_name == class.class_name) {
        return Err(crate::error::invalid(format!(
            "a pipeline class {} is registered already",
            class.class_name
        )));
    }
    let class: &'static PipelineClass = Box::leak(Box::new(class));
    registered.push(class);
    Ok(PipelineKind::of_class(class))
}

impl PipelineKind {
    /// Every class: the built-in ones, then the registered ones.
    pub fn all() -> Vec<PipelineKind> {
        let registered = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
        BUILT_IN
            .iter()
            .chain(registered.iter())
            .map(|c| PipelineKind::of_class(c))
            .collect()
    }

    /// The class named `class_name`, if kiln has it.
    pub fn named(class_name: &str) -> Option<PipelineKind> {
        PipelineKind::all().into_iter().find(|k| k.class_name() == class_name)
    }

    /// The pipeline a `model_index.json` names; another class is an error naming it and the
    /// supported ones.
    pub fn of(index: &ModelIndex) -> Result<PipelineKind> {
        let all = PipelineKind::all();
        let supported: Vec<&str> = all.iter().map(|k| k.class_name()).collect();
        let class = index.require_pipeline(&supported)?;
        Ok(*all
            .iter()
            .find(|k| k.class_name() == class)
            .expect("require_pipeline accepted one of the classes"))
    }

    /// The folder of `model` (a folder, or a Hugging Face repo id in the local cache) and the
    /// pipeline its `model_index.json` names, without loading anything else.
    pub fn of_model(model: &str, revision: Option<&str>) -> Result<(PathBuf, PipelineKind)> {
        let folder = ModelFolder::open(model, revision)?;
        let kind = PipelineKind::of(&folder.index)?;
        Ok((folder.root, kind))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arguments::GenerateCall;
    use crate::seam::CallDefaults;

    fn kind(name: &str) -> PipelineKind {
        PipelineKind::named(name).unwrap()
    }

    #[test]
    fn every_argument_a_call_can_give_is_taken_by_some_pipeline() {
        // Every row of the table given (the argument test checks that each row is a field).
        let mut everything = GenerateCall::prompt("a");
        for row in crate::ARGUMENTS {
            let value = match row.shape {
                crate::arguments::Shape::One if row.value_name == "true|false" => serde_json::json!(true),
                crate::arguments::Shape::One if row.value_name == "FILE" => serde_json::json!("m.png"),
                crate::arguments::Shape::One if row.name == "cache" => serde_json::json!({"kind": "magcache"}),
                crate::arguments::Shape::One => serde_json::json!(1),
                _ => serde_json::json!([]),
            };
            if row.name != "prompt" {
                everything.set_json(row.name, &value).unwrap();
            }
        }
        let given = everything.given();
        assert_eq!(given.len(), 30);
        for argument in given {
            assert!(
                PipelineKind::all().iter().any(|k| k.takes(argument)),
                "no pipeline takes {argument}"
            );
        }
        for kind in PipelineKind::all() {
            assert!(kind.arguments().iter().all(|a| kind.takes(a)));
        }
    }

    #[test]
    fn an_argument_the_pipeline_does_not_take_is_named() {
        let call = GenerateCall {
            clip_skip: Some(1),
            ..GenerateCall::prompt("a")
        };
        assert!(kind("StableDiffusion3Pipeline").check_arguments(&call).is_ok());
        let err = kind("FluxPipeline").check_arguments(&call).unwrap_err().to_string();
        assert_eq!(err, "`clip_skip` is not an argument of FluxPipeline");
        let call = GenerateCall {
            true_cfg_scale: Some(2.0),
            ..GenerateCall::prompt("a")
        };
        assert!(kind("FluxPipeline").check_arguments(&call).is_ok());
        let err = kind("StableDiffusion3Pipeline")
            .check_arguments(&call)
            .unwrap_err()
            .to_string();
        assert_eq!(err, "`true_cfg_scale` is not an argument of StableDiffusion3Pipeline");
        // FLUX.2 has one text encoder and no negative prompt, and its own hidden-state layers.
        let call = GenerateCall {
            text_encoder_out_layers: Some(vec![10, 20, 30]),
            ..GenerateCall::prompt("a")
        };
        assert!(kind("Flux2Pipeline").check_arguments(&call).is_ok());
        let err = kind("FluxPipeline").check_arguments(&call).unwrap_err().to_string();
        assert_eq!(err, "`text_encoder_out_layers` is not an argument of FluxPipeline");
        for (argument, call) in [
            (
                "prompt_2",
                GenerateCall {
                    prompt_2: Some(vec!["b".into()]),
                    ..GenerateCall::prompt("a")
                },
            ),
            (
                "negative_prompt",
                GenerateCall {
                    negative_prompt: Some(vec!["b".into()]),
                    ..GenerateCall::prompt("a")
                },
            ),
        ] {
            let err = kind("Flux2Pipeline").check_arguments(&call).unwrap_err().to_string();
            assert_eq!(err, format!("`{argument}` is not an argument of Flux2Pipeline"));
        }
        assert!(!kind("Flux2Pipeline").arguments().contains(&"negative_prompt_2"));
        // FLUX.2 [klein] takes FLUX.2's arguments (no negative prompt: CFG uses the empty one).
        assert_eq!(
            kind("Flux2KleinPipeline").arguments(),
            kind("Flux2Pipeline").arguments()
        );
        let call = GenerateCall {
            negative_prompt: Some(vec!["b".into()]),
            ..GenerateCall::prompt("a")
        };
        let err = kind("Flux2KleinPipeline")
            .check_arguments(&call)
            .unwrap_err()
            .to_string();
        assert_eq!(err, "`negative_prompt` is not an argument of Flux2KleinPipeline");
        assert!(kind("Flux2Pipeline").arguments().contains(&"text_encoder_out_layers"));
        // A generator list counts as `seed`, which every pipeline takes.
        assert_eq!(
            GenerateCall {
                seeds: Some(vec![1]),
                ..Default::default()
            }
            .given(),
            ["seed"]
        );
    }

    #[test]
    fn defaults_are_the_pipeline_calls_defaults() {
        assert_eq!(
            kind("FluxPipeline").defaults(),
            CallDefaults {
                height: 0,
                width: 0,
                num_inference_steps: 28,
                guidance_scale: 3.5,
                max_sequence_length: 512,
            }
        );
        assert_eq!(
            kind("StableDiffusion3Pipeline").defaults(),
            CallDefaults {
                height: 0,
                width: 0,
                num_inference_steps: 28,
                guidance_scale: 7.0,
                max_sequence_length: 256,
            }
        );
        assert_eq!(
            kind("Flux2Pipeline").defaults(),
            CallDefaults {
                height: 0,
                width: 0,
                num_inference_steps: 50,
                guidance_scale: 4.0,
                max_sequence_length: 512,
            }
        );
        assert_eq!(kind("Flux2KleinPipeline").defaults(), kind("Flux2Pipeline").defaults());
    }

    #[test]
    fn a_nul_in_any_prompt_is_refused_naming_the_argument() {
        assert!(GenerateCall::prompt("a cat, ünïcode ✓\ttab\nline").check_text().is_ok());
        let err = GenerateCall::prompt("a\0b").check_text().unwrap_err().to_string();
        assert_eq!(
            err,
            "`prompt`: the text has a NUL character (at byte 1), which a PNG text chunk cannot hold; remove it"
        );
        let call = GenerateCall {
            negative_prompt_3: Some(vec!["ok".into(), "\0".into()]),
            ..GenerateCall::prompt("a")
        };
        assert!(call
            .check_text()
            .unwrap_err()
            .to_string()
            .starts_with("`negative_prompt_3`:"));
    }

    #[test]
    fn an_input_image_maps_the_folder_class_as_diffusers_auto_pipelines_do() {
        use crate::arguments::FileRef;
        let plain = GenerateCall::prompt("a");
        let image = GenerateCall {
            image: Some(vec![FileRef::new("i.png")]),
            ..GenerateCall::prompt("a")
        };
        let masked = GenerateCall {
            image: Some(vec![FileRef::new("i.png")]),
            mask_image: Some(FileRef::new("m.png")),
            ..GenerateCall::prompt("a")
        };
        let mapped = |class: &str, call: &GenerateCall<'_>| kind(class).for_call(call).class_name();
        for (class, img2img, inpaint) in [
            ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"),
            (
                "StableDiffusion3Pipeline",
                "StableDiffusion3Img2ImgPipeline",
                "StableDiffusion3InpaintPipeline",
            ),
            ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageImg2ImgPipeline"),
        ] {
            assert_eq!(mapped(class, &plain), class);
            assert_eq!(mapped(class, &image), img2img);
            assert_eq!(mapped(class, &masked), inpaint);
        }
        assert_eq!(mapped("FluxKontextPipeline", &image), "FluxKontextPipeline");
        // Their defaults are their own: FLUX.1's image classes guide at 7.0, SD3's run 50 steps.
        assert_eq!(kind("FluxImg2ImgPipeline").defaults().guidance_scale, 7.0);
        assert_eq!(kind("FluxInpaintPipeline").defaults().guidance_scale, 7.0);
        assert_eq!(kind("FluxKontextPipeline").defaults().guidance_scale, 3.5);
        assert_eq!(
            kind("StableDiffusion3Img2ImgPipeline").defaults().num_inference_steps,
            50
        );
        // A mask is an argument of the inpainting classes only.
        assert!(kind("FluxInpaintPipeline").check_arguments(&masked).is_ok());
        let err = kind("FluxImg2ImgPipeline")
            .check_arguments(&masked)
            .unwrap_err()
            .to_string();
        assert_eq!(err, "`mask_image` is not an argument of FluxImg2ImgPipeline");
    }

    #[test]
    fn class_names_are_diffusers_and_distinct() {
        let names: Vec<&str> = PipelineKind::all().iter().map(|k| k.class_name()).collect();
        assert_eq!(
            names,
            [
                "FluxPipeline",
                "FluxImg2ImgPipeline",
                "FluxInpaintPipeline",
                "FluxKontextPipeline",
                "StableDiffusion3Pipeline",
                "StableDiffusion3Img2ImgPipeline",
                "StableDiffusion3InpaintPipeline",
                "Flux2Pipeline",
                "Flux2KleinPipeline",
                "ZImagePipeline",
                "ZImageImg2ImgPipeline"
            ]
        );
    }
}
