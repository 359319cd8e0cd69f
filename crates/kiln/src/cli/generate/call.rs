//! The call arguments of `kiln generate`: one flag per row of the pipelines' argument table
//! ([`crate::ARGUMENTS`]), named after diffusers' keyword with dashes, with the row's help, group
//! and value check. PNGs record the call as the table's JSON, which `--from` reads back.

use anyhow::{bail, Result};
use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};
use kiln_pipelines::arguments::{ArgSpec, Group, Shape};

use crate::{ArgError, GenerateCall};

pub const DRAW: &str = "What to draw";
pub const SAMPLE: &str = "How to sample";
pub const RUN: &str = "How to run";
pub const OUTPUT: &str = "Output";

/// The flag of argument `name`: `true_cfg_scale` → `--true-cfg-scale`.
pub fn flag(name: &str) -> String {
    format!("--{}", name.replace('_', "-"))
}

/// An argument error as the command line shows it: arguments named by their flags.
pub fn flagged(e: &ArgError) -> anyhow::Error {
    anyhow::anyhow!("{}", e.render(&flag))
}

/// A count or a size (a whole number, 0 or more), for clap's value parsers.
pub fn count(value: &str) -> Result<usize, String> {
    kiln_pipelines::arguments::parse_count(value)
}

/// The arguments of one pipeline call, as the command line gives them: not given means the
/// model's or the pipeline's default.
#[derive(Default)]
pub struct CallArgs(pub GenerateCall<'static>);

impl Clone for CallArgs {
    fn clone(&self) -> Self {
        CallArgs(self.0.arguments())
    }
}

/// The flag of one row of the table.
fn flag_of(spec: &'static ArgSpec) -> Arg {
    let check = spec.check_item;
    let arg = Arg::new(spec.name)
        .long(spec.name.replace('_', "-"))
        .value_name(spec.value_name)
        .visible_aliases(spec.aliases.iter().copied())
        .help(spec.help())
        .help_heading(match spec.group {
            Group::Draw => DRAW,
            Group::Sample => SAMPLE,
        })
        .allow_negative_numbers(true)
        .value_parser(move |value: &str| check(value).map(|()| value.to_string()));
    match spec.shape {
        Shape::One => arg.action(ArgAction::Set),
        Shape::Repeated => arg.action(ArgAction::Append),
        Shape::List => arg.action(ArgAction::Append).value_delimiter(','),
    }
}

impl Args for CallArgs {
    fn augment_args(cmd: Command) -> Command {
        crate::ARGUMENTS.iter().fold(cmd, |cmd, spec| cmd.arg(flag_of(spec)))
    }
    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for CallArgs {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut call = GenerateCall::default();
        for spec in crate::ARGUMENTS {
            let Ok(Some(values)) = matches.try_get_many::<String>(spec.name) else {
                continue;
            };
            let values: Vec<String> = values.cloned().collect();
            call.set_items(spec.name, &values)
                .map_err(|e| clap::Error::raw(clap::error::ErrorKind::ValueValidation, e.render(&flag)))?;
        }
        Ok(CallArgs(call))
    }
    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl CallArgs {
    /// The checks that need no model ([`GenerateCall::check`]), and a prompt.
    pub fn check(&self) -> Result<()> {
        if self.0.prompt.is_empty() {
            bail!("--prompt is required (or --from a PNG kiln wrote)");
        }
        self.0.check().map_err(|e| flagged(&e))
    }

    /// The call of any pipeline: lists given once are repeated for every prompt.
    pub fn generate_call(&self) -> GenerateCall<'static> {
        let mut call = self.0.arguments();
        call.broadcast_texts();
        call
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[arg(long)]
        from: Option<String>,
        #[command(flatten)]
        call: CallArgs,
    }

    fn parse(args: &[&str]) -> GenerateCall<'static> {
        Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied()))
            .unwrap()
            .call
            .0
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
        // Every given argument is a flag of the same name, and the JSON keys are the names.
        for field in a.given() {
            assert!(Cli::command().get_arguments().any(|arg| arg.get_id() == field));
            assert!(a.to_json().contains_key(field));
        }
    }

    #[test]
    fn seeds_follow_torch_and_counts_refuse_negatives() {
        let seed = kiln_pipelines::arguments::parse_seed;
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
        let a = CallArgs(parse(&["--prompt", "a", "--prompt", "b", "--negative-prompt", "n"]));
        a.check().unwrap();
        let call = a.generate_call();
        assert_eq!(call.negative_prompt, Some(vec!["n".to_string(), "n".to_string()]));
        assert_eq!(call.prompt_2, None);
        let mut a = a;
        a.0.negative_prompt = Some(vec!["x".into(), "y".into(), "z".into()]);
        let err = a.check().unwrap_err().to_string();
        assert!(
            err.contains("--negative-prompt is given 3 times for 2 prompt(s)"),
            "{err}"
        );
    }

    #[test]
    fn resolved_arguments_record_the_model_defaults_and_the_steps_of_the_sigmas() {
        let mut a = parse(&["--prompt", "a", "--sigmas", "1,0.5"]);
        a.resolve(&crate::PipelineKind::named("FluxPipeline").unwrap().defaults());
        assert_eq!(a.num_inference_steps, Some(2));
        assert_eq!(
            (a.guidance_scale, a.max_sequence_length, a.seed),
            (Some(3.5), Some(512), Some(0))
        );
        assert_eq!(a.true_cfg_scale, None);
        let a = CallArgs(parse(&[
            "--prompt",
            "a",
            "--sigmas",
            "1,0.5",
            "--num-inference-steps",
            "3",
        ]));
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
                crate::PipelineKind::all().iter().any(|p| p.takes(id)),
                "no pipeline takes {id}"
            );
        }
    }
}
