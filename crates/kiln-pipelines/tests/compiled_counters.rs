//! Compiled mode's promise, counted: the first call with a size compiles, later calls with the
//! same size compile nothing whatever the steps, seed or prompt, and a new size compiles once more.

use kiln_nn::{CompileMode, Model};
use kiln_pipelines::DiffusionPipeline;
use kiln_pipelines::{FluxCall, FluxPipeline, LoadOptions, OutputType};
use kiln_tensor::{thread_op_cache_stats, DType};
use kiln_testing::{device, oracle};

fn pipeline(mode: CompileMode) -> FluxPipeline {
    let folder = oracle().join("pipelines/flux1_dev");
    let mut pipe = FluxPipeline::from_pretrained(
        folder.to_str().unwrap(),
        &LoadOptions {
            dtype: DType::F32,
            ..Default::default()
        },
    )
    .unwrap()
    .to(&device())
    .unwrap();
    pipe.compile(mode);
    pipe
}

fn call(prompt: &str, size: usize, steps: usize, seed: u64) -> FluxCall<'static> {
    FluxCall {
        height: size,
        width: size,
        num_inference_steps: steps,
        guidance_scale: 3.5,
        max_sequence_length: 32,
        seed,
        output_type: OutputType::Latent,
        progress: false,
        ..FluxCall::prompt(prompt)
    }
}

/// (in-memory misses, programs of the transformer and of the denoising step) added by `f`.
fn counted(pipe: &mut FluxPipeline, f: impl FnOnce(&mut FluxPipeline)) -> (u64, usize) {
    let programs = |p: &mut FluxPipeline| p.transformer_mut().unwrap().compiled_programs() + p.step_programs();
    let (before, p0) = (thread_op_cache_stats(), programs(pipe));
    f(pipe);
    let (after, p1) = (thread_op_cache_stats(), programs(pipe));
    (after.compiles - before.compiles, p1 - p0)
}

fn check(mode: CompileMode, programs_per_size: usize) {
    let mut pipe = pipeline(mode);
    let (_, first) = counted(&mut pipe, |p| {
        p.call(call("a red circle", 32, 2, 0)).unwrap();
    });
    assert_eq!(
        first, programs_per_size,
        "{mode}: the first call compiles the transformer (the whole step in full mode)"
    );
    let steps = pipe.step_programs();
    assert_eq!(steps, usize::from(mode == CompileMode::Full), "{mode}: step programs");
    for (what, c) in [
        ("the same call", call("a red circle", 32, 2, 0)),
        ("more steps", call("a red circle", 32, 5, 0)),
        ("another seed", call("a red circle", 32, 2, 9)),
        ("another prompt", call("two blue squares on grass", 32, 1, 0)),
    ] {
        let (misses, programs) = counted(&mut pipe, |p| {
            p.call(c).unwrap();
        });
        assert_eq!((misses, programs), (0, 0), "{mode}: {what} must compile nothing");
    }
    let (misses, programs) = counted(&mut pipe, |p| {
        p.call(call("a red circle", 48, 2, 0)).unwrap();
    });
    assert_eq!(
        programs, programs_per_size,
        "{mode}: a new size compiles the transformer once more"
    );
    assert!(misses > 0);
    let (misses, programs) = counted(&mut pipe, |p| {
        p.call(call("a red circle", 48, 3, 1)).unwrap();
    });
    assert_eq!((misses, programs), (0, 0), "{mode}: the new size is cached too");
}

#[test]
fn the_whole_step_compiles_once_per_size() {
    check(CompileMode::Full, 1);
}

#[test]
fn repeated_blocks_compile_one_program_per_block_type_and_size() {
    check(CompileMode::RepeatedBlocks, 2);
}
