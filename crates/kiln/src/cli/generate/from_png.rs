//! `kiln generate --from PNG`: the call a PNG kiln wrote records, with the flags given on the
//! command line taking precedence.

use std::path::Path;

use anyhow::{anyhow, bail, Result};

use super::{CallArgs, GenerateArgs, Given, Load};
use crate::GenerateCall;

/// The call and load settings of `--from`, and which image of the call the PNG is.
pub struct FromPng {
    pub call: CallArgs,
    pub load: Load,
    pub image_index: usize,
    pub image_count: usize,
}

pub fn read(png: &Path, args: &GenerateArgs, given: &Given) -> Result<FromPng> {
    let params = crate::read_png_parameters(png)?;
    if params.call.is_empty() {
        bail!(
            "{} has kiln parameters but not the call's arguments (written by an older kiln); it cannot be generated again",
            png.display()
        );
    }
    let stored = GenerateCall::from_json(&params.call).map_err(|e| {
        anyhow!(
            "{}: the stored call arguments are not ones kiln knows: {e}",
            png.display()
        )
    })?;
    let mut merged = params.call.clone();
    // The steps and the sigmas are one setting: either flag replaces both stored values.
    if given.contains("num_inference_steps") || given.contains("sigmas") {
        merged.remove("num_inference_steps");
        merged.remove("sigmas");
    }
    for (key, value) in args.call.0.to_json() {
        if given.contains(&key) {
            merged.insert(key, value);
        }
    }
    let call = CallArgs(GenerateCall::from_json(&merged).map_err(|e| super::flagged(&e))?);
    let pick = |id: &str, flag: &str| -> String {
        match params.extras.get(id) {
            Some(stored) if !given.contains(id) => stored.clone(),
            _ => flag.to_string(),
        }
    };
    let load = Load {
        model: if given.contains("model") {
            args.model.clone()
        } else {
            Some(params.model.clone())
        },
        component_files: recorded_component_files(png, &params.extras, args, given)?,
        keep_quantized: match given.contains("keep_quantized") {
            true => args.component_files.keep_quantized,
            false => params.extras.get("keep_quantized").is_some_and(|v| v == "true"),
        },
        revision: if given.contains("revision") {
            args.revision.clone()
        } else {
            params.extras.get("revision").cloned()
        },
        dtype: pick("dtype", &args.dtype),
        device: pick("device", &args.device),
        // How many devices ran it is not part of the image: the mesh is this run's.
        tp: args.tp,
        ulysses_degree: args.ulysses_degree,
        ring_degree: args.ring_degree,
        compile: pick("compile", &args.compile),
    };
    Ok(FromPng {
        call,
        load,
        image_index: params.image_index,
        image_count: stored.image_count(),
    })
}

/// The components the PNG's run read from single files, each checked against its recorded
/// sha256; a file given on the command line replaces the recorded one.
fn recorded_component_files(
    png: &Path,
    extras: &std::collections::BTreeMap<String, String>,
    args: &GenerateArgs,
    given: &Given,
) -> Result<std::collections::BTreeMap<String, std::path::PathBuf>> {
    let mut files = args.component_files.files();
    for component in super::ComponentFileArgs::COMPONENTS {
        if given.contains(component) {
            continue;
        }
        let Some(path) = extras.get(component) else {
            continue;
        };
        let flag = format!("--{}", component.replace('_', "-"));
        let sha = kiln_pipelines::lora::file_sha256(Path::new(path)).map_err(|e| {
            anyhow!(
                "{}: the run read its {component} from {path}, which cannot be read now ({e}); pass {flag} FILE",
                png.display()
            )
        })?;
        if extras.get(&format!("{component}_sha256")) != Some(&sha) {
            bail!(
                "{}: {path} is not the file the run read its {component} from (its sha256 changed); pass {flag} FILE to use it anyway",
                png.display()
            );
        }
        files.insert(component.to_string(), path.into());
    }
    Ok(files)
}
