//! The call arguments of `kiln generate`: one struct whose fields are diffusers' keyword arguments
//! (each flag is the keyword with dashes), and its conversion to the pipeline-neutral
//! [`GenerateCall`]. PNGs store this struct as JSON, which `--from` reads back.

use anyhow::{bail, Result};
use clap::ArgAction;
use kiln::{CallDefaults, GenerateCall};
use serde::{Deserialize, Serialize};

pub const DRAW: &str = "What to draw";
pub const SAMPLE: &str = "How to sample";
pub const RUN: &str = "How to run";
pub const OUTPUT: &str = "Output";

/// The arguments of one pipeline call. `None` (or an empty list) means not given: the model's or
/// the pipeline's default.
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallArgs {
    /// The prompt. Give it several times for a batch: one image file per prompt and image.
    #[arg(long, value_name = "TEXT", action = ArgAction::Append, required_unless_present = "from", help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt: Vec<String>,
    /// What not to draw: once for every prompt, or once per --prompt. FLUX.1 uses it only with
    /// --true-cfg-scale above 1.
    #[arg(long, value_name = "TEXT", action = ArgAction::Append, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub negative_prompt: Vec<String>,
    /// The second text encoder's prompt (FLUX.1: T5; SD3: CLIP-G); default: --prompt. Once, or
    /// once per --prompt.
    #[arg(long, value_name = "TEXT", action = ArgAction::Append, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_2: Vec<String>,
    /// The second text encoder's negative prompt; default: --negative-prompt.
    #[arg(long, value_name = "TEXT", action = ArgAction::Append, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub negative_prompt_2: Vec<String>,
    /// SD3: the third text encoder's (T5) prompt; default: --prompt.
    #[arg(long, value_name = "TEXT", action = ArgAction::Append, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_3: Vec<String>,
    /// SD3: the third text encoder's negative prompt; default: --negative-prompt.
    #[arg(long, value_name = "TEXT", action = ArgAction::Append, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub negative_prompt_3: Vec<String>,
    /// Image height in pixels (default: the model's).
    #[arg(long, value_name = "PIXELS", allow_negative_numbers = true, value_parser = count, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<usize>,
    /// Image width in pixels (default: the model's).
    #[arg(long, value_name = "PIXELS", allow_negative_numbers = true, value_parser = count, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
    /// Images per prompt (default 1).
    #[arg(long, value_name = "N", visible_alias = "num-images", allow_negative_numbers = true, value_parser = count, help_heading = DRAW)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_images_per_prompt: Option<usize>,

    /// Seed of the torch CPU generator that draws the initial noise of the batch (default 0). As
    /// torch's `manual_seed`, a negative seed (down to -2^63) is taken modulo 2^64.
    #[arg(long, value_name = "SEED", allow_negative_numbers = true, value_parser = seed, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Denoising steps (default: the model's).
    #[arg(long, value_name = "N", visible_alias = "steps", allow_negative_numbers = true, value_parser = count, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_inference_steps: Option<usize>,
    /// The sigmas of the schedule instead, comma-separated (1.0,0.75,0.5,0.25); their count is
    /// the number of steps.
    #[arg(long, value_name = "S,S,...", value_delimiter = ',', allow_negative_numbers = true, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sigmas: Option<Vec<f64>>,
    /// Guidance scale (default: the model's). FLUX.1 [dev] embeds it; [schnell] ignores it.
    #[arg(long, value_name = "SCALE", visible_alias = "guidance", allow_negative_numbers = true, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance_scale: Option<f64>,
    /// FLUX.1: true classifier-free guidance (default 1, off); above 1 with a --negative-prompt
    /// the transformer runs twice per step.
    #[arg(long, value_name = "SCALE", visible_alias = "true-cfg", allow_negative_numbers = true, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub true_cfg_scale: Option<f64>,
    /// Tokens of the T5 prompt (FLUX.2: of the Mistral chat text) (default: the model's; FLUX.1 and
    /// SD3 allow up to 512).
    #[arg(long, value_name = "TOKENS", allow_negative_numbers = true, value_parser = count, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sequence_length: Option<usize>,
    /// SD3: the transformer layers skip-layer guidance leaves out, comma-separated (7,8,9).
    #[arg(long, value_name = "I,I,...", value_delimiter = ',', allow_negative_numbers = true, value_parser = count, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_guidance_layers: Option<Vec<usize>>,
    /// SD3: the skip-layer guidance scale (diffusers' default 2.8).
    #[arg(long, value_name = "SCALE", allow_negative_numbers = true, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_layer_guidance_scale: Option<f64>,
    /// SD3: the fraction of the steps at which skip-layer guidance starts (default 0.01).
    #[arg(long, value_name = "FRACTION", allow_negative_numbers = true, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_layer_guidance_start: Option<f64>,
    /// SD3: the fraction of the steps at which skip-layer guidance stops (default 0.2).
    #[arg(long, value_name = "FRACTION", allow_negative_numbers = true, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_layer_guidance_stop: Option<f64>,
    /// SD3: the number of CLIP layers skipped from the end for the prompt embeddings.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = count, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_skip: Option<usize>,
    /// FLUX.2: the text encoder's hidden states stacked into the prompt embeddings,
    /// comma-separated (diffusers' default 10,20,30; FLUX.2 [klein] 9,18,27).
    #[arg(long, value_name = "K,K,...", value_delimiter = ',', allow_negative_numbers = true, value_parser = count, help_heading = SAMPLE)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_encoder_out_layers: Option<Vec<usize>>,
}

/// A count or a size: a whole number, 0 or more (clap names the flag in front of the message).
pub fn count(value: &str) -> Result<usize, String> {
    let v = value.trim();
    if v.strip_prefix('-').is_some_and(|n| n.parse::<f64>().is_ok()) {
        return Err("it cannot be negative: give a whole number, 0 or more".to_string());
    }
    v.parse::<usize>().map_err(|e| match e.kind() {
        std::num::IntErrorKind::PosOverflow => format!("it is larger than {}", usize::MAX),
        _ => "give a whole number, 0 or more".to_string(),
    })
}

/// A seed as torch's `Generator.manual_seed` takes it: -2^63 ..= 2^64 - 1, a negative seed taken
/// modulo 2^64 (torch reads it as a signed 64-bit integer and uses its bits).
pub fn seed(value: &str) -> Result<u64, String> {
    let range = "a seed is a whole number from -9223372036854775808 to 18446744073709551615 (torch's range)";
    let v: i128 = value.trim().parse().map_err(|_| range.to_string())?;
    if v < 0 {
        i64::try_from(v).map(|s| s as u64).map_err(|_| range.to_string())
    } else {
        u64::try_from(v).map_err(|_| range.to_string())
    }
}

/// The flag of a `CallArgs` field: `true_cfg_scale` → `--true-cfg-scale`.
pub fn flag(field: &str) -> String {
    format!("--{}", field.replace('_', "-"))
}

/// The per-prompt lists, by field name.
fn per_prompt_lists(args: &CallArgs) -> [(&'static str, &[String]); 5] {
    [
        ("negative_prompt", &args.negative_prompt),
        ("prompt_2", &args.prompt_2),
        ("negative_prompt_2", &args.negative_prompt_2),
        ("prompt_3", &args.prompt_3),
        ("negative_prompt_3", &args.negative_prompt_3),
    ]
}

/// One entry per prompt of a list given once for all prompts or once per prompt.
fn per_prompt(list: &[String], batch: usize) -> Option<Vec<String>> {
    match list {
        [] => None,
        [one] => Some(vec![one.clone(); batch]),
        many => Some(many.to_vec()),
    }
}

impl CallArgs {
    /// The fields that have a value, by name.
    pub fn present(&self) -> Vec<String> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(map)) => map.into_iter().map(|(k, _)| k).collect(),
            _ => unreachable!("CallArgs serializes to a JSON object"),
        }
    }

    /// The checks that need no model: counts, zeros and non-finite numbers.
    pub fn check(&self) -> Result<()> {
        let batch = self.prompt.len();
        if batch == 0 {
            bail!("--prompt is required (or --from a PNG kiln wrote)");
        }
        for (field, list) in per_prompt_lists(self) {
            if list.len() > 1 && list.len() != batch {
                bail!(
                    "{} is given {} times for {batch} prompt(s): give it once for every prompt or once per --prompt",
                    flag(field),
                    list.len()
                );
            }
        }
        let text_lists = std::iter::once(("prompt", self.prompt.as_slice())).chain(per_prompt_lists(self));
        for (field, list) in text_lists {
            for text in list {
                kiln::check_prompt_text(text).map_err(|e| anyhow::anyhow!("{}: {e}", flag(field)))?;
            }
        }
        for (field, value) in [("height", self.height), ("width", self.width)] {
            if value == Some(0) {
                bail!(
                    "{} must be positive; leave it out for the model's default size",
                    flag(field)
                );
            }
        }
        if self.num_images_per_prompt == Some(0) {
            bail!("--num-images-per-prompt must be at least 1");
        }
        for (field, value) in [
            ("guidance_scale", self.guidance_scale),
            ("true_cfg_scale", self.true_cfg_scale),
            ("skip_layer_guidance_scale", self.skip_layer_guidance_scale),
            ("skip_layer_guidance_start", self.skip_layer_guidance_start),
            ("skip_layer_guidance_stop", self.skip_layer_guidance_stop),
        ] {
            if let Some(v) = value.filter(|v| !v.is_finite()) {
                bail!("{} must be a finite number, got {v}", flag(field));
            }
        }
        let budget = kiln::CallBudget {
            num_inference_steps: self
                .sigmas
                .as_ref()
                .map_or(self.num_inference_steps.unwrap_or(0), Vec::len),
            batch,
            num_images_per_prompt: self.num_images_per_prompt.unwrap_or(1),
            height: self.height.unwrap_or(0),
            width: self.width.unwrap_or(0),
        };
        if let Err(over) = budget.check() {
            let name = match over.argument {
                "num_inference_steps" if self.sigmas.is_some() => "--sigmas (their count)".to_string(),
                argument => flag(argument),
            };
            bail!("{}", over.message(&name));
        }
        if let Some(sigmas) = &self.sigmas {
            if let Some(v) = sigmas.iter().find(|v| !v.is_finite()) {
                bail!("--sigmas must be finite numbers, got {v}");
            }
            if let Some(steps) = self.num_inference_steps.filter(|&s| s != sigmas.len()) {
                bail!(
                    "--num-inference-steps {steps} does not match the {} --sigmas; leave it out (the sigmas set the number of steps)",
                    sigmas.len()
                );
            }
        }
        Ok(())
    }

    /// Fills in the defaults that depend on the model, so that a PNG records the values used.
    /// Pipeline defaults that never change (true CFG off, `prompt_2` = `prompt`) stay unset.
    pub fn resolve(&mut self, defaults: &CallDefaults) {
        self.height.get_or_insert(defaults.height);
        self.width.get_or_insert(defaults.width);
        self.num_images_per_prompt.get_or_insert(1);
        self.seed.get_or_insert(0);
        match &self.sigmas {
            Some(sigmas) => self.num_inference_steps = Some(sigmas.len()),
            None => {
                self.num_inference_steps.get_or_insert(defaults.num_inference_steps);
            }
        }
        self.guidance_scale.get_or_insert(defaults.guidance_scale);
        self.max_sequence_length.get_or_insert(defaults.max_sequence_length);
    }

    /// The number of images the call makes.
    pub fn image_count(&self) -> usize {
        self.prompt.len() * self.num_images_per_prompt.unwrap_or(1)
    }

    /// Image `k`'s prompt and negative prompt (diffusers' order: prompt-major).
    pub fn prompts_of_image(&self, k: usize) -> (String, Option<String>) {
        let p = k / self.num_images_per_prompt.unwrap_or(1).max(1);
        let negative = per_prompt(&self.negative_prompt, self.prompt.len()).map(|n| n[p].clone());
        (self.prompt[p].clone(), negative)
    }

    /// The call of any pipeline. Lists given once are repeated for every prompt; what is unset
    /// takes the model's or the pipeline's default.
    pub fn generate_call(&self) -> GenerateCall<'static> {
        let batch = self.prompt.len();
        GenerateCall {
            prompt: self.prompt.clone(),
            prompt_2: per_prompt(&self.prompt_2, batch),
            prompt_3: per_prompt(&self.prompt_3, batch),
            negative_prompt: per_prompt(&self.negative_prompt, batch),
            negative_prompt_2: per_prompt(&self.negative_prompt_2, batch),
            negative_prompt_3: per_prompt(&self.negative_prompt_3, batch),
            height: self.height,
            width: self.width,
            num_inference_steps: self.num_inference_steps,
            sigmas: self.sigmas.clone(),
            guidance_scale: self.guidance_scale,
            true_cfg_scale: self.true_cfg_scale,
            num_images_per_prompt: self.num_images_per_prompt,
            seed: self.seed,
            max_sequence_length: self.max_sequence_length,
            skip_guidance_layers: self.skip_guidance_layers.clone(),
            skip_layer_guidance_scale: self.skip_layer_guidance_scale,
            skip_layer_guidance_start: self.skip_layer_guidance_start,
            skip_layer_guidance_stop: self.skip_layer_guidance_stop,
            clip_skip: self.clip_skip,
            text_encoder_out_layers: self.text_encoder_out_layers.clone(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[arg(long)]
        from: Option<String>,
        #[command(flatten)]
        call: CallArgs,
    }

    fn parse(args: &[&str]) -> CallArgs {
        Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied()))
            .unwrap()
            .call
    }

    #[test]
    fn flags_are_diffusers_keywords_with_aliases_and_lists() {
        let a = parse(&[
            "--prompt",
            "a",
            "--prompt",
            "b",
            "--steps",
            "4",
            "--guidance",
            "2",
            "--true-cfg",
            "1.5",
            "--num-images",
            "2",
        ]);
        assert_eq!(a.prompt, ["a", "b"]);
        assert_eq!(
            (
                a.num_inference_steps,
                a.guidance_scale,
                a.true_cfg_scale,
                a.num_images_per_prompt
            ),
            (Some(4), Some(2.0), Some(1.5), Some(2))
        );
        let a = parse(&[
            "--prompt",
            "a",
            "--sigmas",
            "1.0,0.75,0.5",
            "--skip-guidance-layers",
            "7,8,9",
            "--text-encoder-out-layers",
            "10,20,30",
        ]);
        assert_eq!(a.sigmas, Some(vec![1.0, 0.75, 0.5]));
        assert_eq!(a.skip_guidance_layers, Some(vec![7, 8, 9]));
        assert_eq!(a.text_encoder_out_layers, Some(vec![10, 20, 30]));
        assert_eq!(a.generate_call().text_encoder_out_layers, Some(vec![10, 20, 30]));
        // Every field is a flag of the same name, and the JSON keys are the field names.
        for field in a.present() {
            assert!(Cli::command().get_arguments().any(|arg| arg.get_id() == field.as_str()));
        }
    }

    #[test]
    fn seeds_follow_torch_and_counts_refuse_negatives() {
        assert_eq!(seed("0"), Ok(0));
        assert_eq!(seed("-1"), Ok(u64::MAX));
        assert_eq!(seed("-9223372036854775808"), Ok(1 << 63));
        assert_eq!(seed("18446744073709551615"), Ok(u64::MAX));
        for bad in ["-9223372036854775809", "18446744073709551616", "1.5", "x"] {
            assert!(seed(bad).unwrap_err().contains("torch's range"), "{bad}");
        }
        // torch reads a negative seed's bits as unsigned (kiln_rng's `manual_seed_i64`).
        assert_eq!(seed("-42"), Ok((-42i64) as u64));
        assert_eq!(count("7"), Ok(7));
        assert_eq!(count("0"), Ok(0));
        assert!(count("-1").unwrap_err().contains("cannot be negative"));
        assert!(count("-0.5").unwrap_err().contains("cannot be negative"));
        assert!(count("1e3").unwrap_err().contains("whole number"));
        assert!(count("99999999999999999999999").unwrap_err().contains("larger than"));
        let a = parse(&[
            "--prompt",
            "a",
            "--seed",
            "-1",
            "--guidance-scale",
            "-2.5",
            "--sigmas=-1,0.5",
        ]);
        assert_eq!((a.seed, a.guidance_scale), (Some(u64::MAX), Some(-2.5)));
        assert_eq!(a.sigmas, Some(vec![-1.0, 0.5]));
        let err = Cli::try_parse_from(["kiln", "--prompt", "a", "--height", "-5"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--height") && err.contains("cannot be negative"), "{err}");
    }

    #[test]
    fn one_list_for_all_prompts_or_one_per_prompt() {
        let mut a = parse(&["--prompt", "a", "--prompt", "b", "--negative-prompt", "n"]);
        a.check().unwrap();
        let call = a.generate_call();
        assert_eq!(call.negative_prompt, Some(vec!["n".to_string(), "n".to_string()]));
        assert_eq!(call.prompt_2, None);
        a.negative_prompt = vec!["x".into(), "y".into(), "z".into()];
        let err = a.check().unwrap_err().to_string();
        assert!(
            err.contains("--negative-prompt is given 3 times for 2 prompt(s)"),
            "{err}"
        );
    }

    #[test]
    fn resolved_arguments_record_the_model_defaults_and_the_steps_of_the_sigmas() {
        let mut a = parse(&["--prompt", "a", "--sigmas", "1,0.5"]);
        a.resolve(&kiln::PipelineKind::Flux.defaults());
        assert_eq!(a.num_inference_steps, Some(2));
        assert_eq!(
            (a.guidance_scale, a.max_sequence_length, a.seed),
            (Some(3.5), Some(512), Some(0))
        );
        assert_eq!(a.true_cfg_scale, None);
        let a = parse(&["--prompt", "a", "--sigmas", "1,0.5", "--num-inference-steps", "3"]);
        assert!(a
            .check()
            .unwrap_err()
            .to_string()
            .contains("does not match the 2 --sigmas"));
    }

    #[test]
    fn every_argument_is_taken_by_some_pipeline() {
        for arg in CallArgs::augment_args(clap::Command::new("generate")).get_arguments() {
            let id = arg.get_id().as_str();
            assert!(
                kiln::PipelineKind::ALL.iter().any(|p| p.takes(id)),
                "no pipeline takes {id}"
            );
        }
    }
}
