//! `--compile full` runs each denoising step — every transformer call of the guidance, the
//! guidance and the scheduler step — as one program. The call's scales, embeddings and timesteps
//! are that program's arguments, not constants frozen into it: calls with other guidance scales
//! reuse the program, and each one's latents are the eager call's.

use kiln_nn::CompileMode;
use kiln_pipelines::DiffusionPipeline;
use kiln_pipelines::{AnyPipeline, GenerateCall, LoadOptions, OutputType};
use kiln_testing::{device, oracle};

fn load(name: &str, mode: CompileMode) -> AnyPipeline {
    let folder = oracle().join("pipelines").join(name);
    let mut any = AnyPipeline::from_pretrained(&folder.to_string_lossy(), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    any.compile(mode);
    any
}

fn latents(any: &mut AnyPipeline, call: GenerateCall<'static>) -> Vec<f32> {
    any.call(call).unwrap().latents.to_f32_vec().unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Each call `call(p)` of `params` gives the eager call's latents compiled (within f32 rounding of a fused
/// program), each differs from the one before (the varied argument matters), and all of them
/// share `programs` step programs.
fn compiled_steps_follow_their_arguments<P: Copy>(
    name: &str,
    params: &[P],
    call: impl Fn(P) -> GenerateCall<'static>,
    programs: usize,
) {
    let (mut eager, mut compiled) = (load(name, CompileMode::None), load(name, CompileMode::Full));
    let mut previous: Option<Vec<f32>> = None;
    for (i, &p) in params.iter().enumerate() {
        let want = latents(&mut eager, call(p));
        let have = latents(&mut compiled, call(p));
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = max_abs_diff(&want, &have);
        assert!(
            diff <= 1e-4 * scale,
            "{name} call {i}: compiled differs from eager by {diff} (max {scale})"
        );
        if let Some(p) = &previous {
            assert!(
                max_abs_diff(p, &want) > 1e-3 * scale,
                "{name} call {i}: the varied argument changed nothing"
            );
        }
        previous = Some(want);
    }
    assert_eq!(compiled.step_programs(), programs, "{name}: step programs");
    assert_eq!(eager.step_programs(), 0, "{name}: eager compiles no step");
}

fn base(prompt: &str, steps: usize) -> GenerateCall<'static> {
    GenerateCall {
        prompt: vec![prompt.into()],
        height: Some(32),
        width: Some(32),
        num_inference_steps: Some(steps),
        max_sequence_length: Some(16),
        seed: Some(3),
        output_type: OutputType::Latent,
        progress: false,
        ..Default::default()
    }
}

#[test]
fn flux1_true_cfg_scale_and_guidance_are_step_arguments() {
    let call = |(true_cfg, guidance, steps): (f64, f64, usize)| GenerateCall {
        negative_prompt: Some(vec!["blurry".into()]),
        true_cfg_scale: Some(true_cfg),
        guidance_scale: Some(guidance),
        ..base("a red square", steps)
    };
    // More steps reuse the program too.
    let params = [(1.5, 3.5, 3), (4.0, 3.5, 3), (4.0, 7.0, 3), (4.0, 7.0, 4)];
    compiled_steps_follow_their_arguments("flux1_dev", &params, call, 1);
}

#[test]
fn sd3_guidance_and_skip_layer_guidance_are_step_arguments() {
    let call = |(guidance, slg): (f64, f64)| GenerateCall {
        guidance_scale: Some(guidance),
        skip_guidance_layers: Some(vec![1]),
        skip_layer_guidance_scale: Some(slg),
        skip_layer_guidance_start: Some(0.0),
        skip_layer_guidance_stop: Some(0.6),
        ..base("a cat", 4)
    };
    // Steps 1 and 2 of 4 skip layers (diffusers' strict window): two step variants.
    compiled_steps_follow_their_arguments("sd3", &[(5.0, 2.8), (7.0, 2.8), (7.0, 5.0)], call, 2);
}

#[test]
fn flux2_klein_base_cfg_scale_is_a_step_argument() {
    let call = |guidance: f64| GenerateCall {
        guidance_scale: Some(guidance),
        ..base("a blue circle", 2)
    };
    compiled_steps_follow_their_arguments("flux2_klein_base", &[2.0, 4.0], call, 1);
}
