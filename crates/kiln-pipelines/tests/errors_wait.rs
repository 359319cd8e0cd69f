//! An error raised after work was queued on the device leaves the call only once that work has
//! finished: at each stage (the text encoders, a step interrupted by the callback, the decoder)
//! the call fails, and when it has returned nothing it queued is still in flight. Before, such an
//! error returned while XLA's threads still ran the queued programs, and the process crashed as it
//! exited (`kiln generate --clip-skip 100` on SD3 segfaulted in most runs).

use kiln_pipelines::DiffusionPipeline;

use kiln_pipelines::{LoadOptions, PipelineError, StableDiffusion3Call, StableDiffusion3Pipeline};
use kiln_tensor::{DType, Tensor};
use kiln_testing::{device, oracle};

const REPEATS: usize = 50;

fn base() -> StableDiffusion3Call<'static> {
    StableDiffusion3Call {
        height: 32,
        width: 32,
        num_inference_steps: 2,
        max_sequence_length: 8,
        progress: false,
        ..StableDiffusion3Call::prompt("a cat")
    }
}

#[test]
fn an_error_after_queued_work_returns_only_when_the_work_is_done_at_every_stage() {
    let folder = oracle().join("pipelines/sd3");
    let dev = device();
    let mut pipe = StableDiffusion3Pipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .to(&dev)
        .unwrap();
    dev.synchronize().unwrap();
    for round in 0..REPEATS {
        // Encoders: CLIP-L has run when its depth turns out too small for `clip_skip`.
        let err = pipe
            .call(StableDiffusion3Call {
                clip_skip: Some(100),
                ..base()
            })
            .err()
            .expect("clip_skip 100 is refused");
        assert!(err.to_string().contains("`clip_skip` 100 is too large"), "{err}");
        assert_eq!(
            dev.in_flight(),
            0,
            "round {round}: encoder work still in flight after the error"
        );

        // Steps: the callback interrupts after the first step's programs were queued.
        let err = pipe
            .call(StableDiffusion3Call {
                callback: Some(Box::new(|_| false)),
                ..base()
            })
            .err()
            .expect("the callback interrupts");
        assert!(matches!(err, PipelineError::Interrupted { step: 0 }), "{err}");
        assert_eq!(
            dev.in_flight(),
            0,
            "round {round}: step work still in flight after the interrupt"
        );

        // Decoder: the latents are scaled (queued) before the VAE refuses their channel count.
        let wrong = Tensor::zeros([1, 3, 4, 4], DType::F32, &dev).unwrap();
        assert!(
            pipe.decode_latents(&wrong).is_err(),
            "latents with 3 channels are refused"
        );
        assert_eq!(
            dev.in_flight(),
            0,
            "round {round}: decoder work still in flight after the error"
        );
    }
}
