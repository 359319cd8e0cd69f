//! What batching promises, on the bundled tiny model: a request's image made in a batch with
//! others (one prompt and one generator seed per image) is the one it makes alone, within the
//! oracle's float32 tolerance for final latents (`|a−b| ≤ 1e-4 + 1e-4·|b|`); the difference is
//! measured and printed.

use kiln_pipelines::{AnyPipeline, DiffusionPipeline, GenerateCall, LoadOptions, OutputType};
use kiln_tensor::Device;

fn call(prompts: &[&str], seeds: &[u64]) -> GenerateCall<'static> {
    GenerateCall {
        prompt: prompts.iter().map(|p| p.to_string()).collect(),
        seeds: Some(seeds.to_vec()),
        height: Some(64),
        width: Some(64),
        num_inference_steps: Some(4),
        output_type: OutputType::Latent,
        progress: false,
        ..Default::default()
    }
}

#[test]
fn a_batched_image_is_the_one_made_alone_within_the_f32_tolerance() {
    let device = Device::parse("cpu").unwrap();
    let model = kiln_fixtures::tiny_flux();
    let mut pipe = AnyPipeline::from_pretrained(model.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .to(&device)
        .unwrap();
    let prompts = ["a red circle", "a blue square at the top left", "a yellow triangle"];
    let seeds = [100, 101, 102];
    let batched = pipe.call(call(&prompts, &seeds)).unwrap().latents;
    let per_image = batched.to_f32_vec().unwrap();
    let row = per_image.len() / prompts.len();
    let (mut worst_abs, mut worst_ratio, mut identical) = (0f32, 0f32, true);
    for (k, (prompt, seed)) in prompts.iter().zip(seeds).enumerate() {
        let alone = pipe
            .call(call(&[prompt], &[seed]))
            .unwrap()
            .latents
            .to_f32_vec()
            .unwrap();
        assert_eq!(alone.len(), row);
        for (a, b) in per_image[k * row..(k + 1) * row].iter().zip(&alone) {
            let d = (a - b).abs();
            identical &= a.to_bits() == b.to_bits();
            worst_abs = worst_abs.max(d);
            worst_ratio = worst_ratio.max(d / (1e-4 + 1e-4 * b.abs()));
        }
    }
    eprintln!(
        "batched vs alone final latents: {}; max |a-b| = {worst_abs:e}, {:.3} of the oracle tolerance",
        if identical { "bit for bit" } else { "not bit for bit" },
        worst_ratio
    );
    assert!(
        worst_ratio <= 1.0,
        "max |a-b| {worst_abs} is past the oracle's tolerance"
    );
}
