//! The core on a pipeline that is none of kiln's: three components declared in run order, whose
//! order alone drives offload (no code of this pipeline moves a weight).

use kiln_nn::{impl_model, impl_module, Compiled, OffloadEvent};
use kiln_tensor::{DType, Device, MemoryKind, Tensor};

use super::{DiffusionPipeline, PipelineCore, PipelineParts};
use crate::{OffloadMode, Result};

/// A square weight applied as `tanh(x·W)`.
#[derive(Clone, Debug)]
struct Layer {
    weight: Tensor,
    compiled: Compiled,
}
impl_module!(Layer { weight: "weight" });
impl_model!(Layer { compiled: compiled });

impl Layer {
    fn new(width: usize, seed: usize, device: &Device, memory: MemoryKind) -> Result<Layer> {
        let w: Vec<f32> = (0..width * width)
            .map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 1000.0 - 0.5) / 8.0)
            .collect();
        Ok(Layer {
            weight: Tensor::from_f32(&w, DType::F32, [width, width], device)?.to_memory(memory)?,
            compiled: Compiled::new(format!("layer{seed}")),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self
            .compiled
            .whole("", self, x.clone(), |m, x: &Tensor| Ok(x.matmul(&m.weight)?.tanh()?))?)
    }
}

/// The components in run order: a wide encoder, then two narrow ones.
struct Parts {
    encoder: Layer,
    denoiser: Layer,
    decoder: Layer,
}
components!(Parts: encoder, denoiser, decoder);

struct ThreeStepPipeline {
    core: PipelineCore<Parts>,
}
pipeline_parts!(ThreeStepPipeline, Parts);

const WIDE: usize = 256;
const NARROW: usize = 64;

impl ThreeStepPipeline {
    fn new() -> ThreeStepPipeline {
        ThreeStepPipeline {
            core: PipelineCore::new("three-step".into(), DType::F32, Vec::new()),
        }
    }

    fn load_components(&self, device: &Device, memory: MemoryKind) -> Result<Parts> {
        Ok(Parts {
            encoder: Layer::new(WIDE, 1, device, memory)?,
            denoiser: Layer::new(NARROW, 2, device, memory)?,
            decoder: Layer::new(NARROW, 3, device, memory)?,
        })
    }

    /// encoder → (narrowed) denoiser twice → decoder; no line of it moves a weight.
    fn call(&mut self, x: &Tensor) -> Result<Tensor> {
        self.ensure_loaded()?;
        let (parts, _) = self.core.loaded()?;
        let _finish = self.core.begin_call()?;
        let h = self.core.run("encoder", &parts.encoder, |m| m.forward(x))?;
        let mut h = h.narrow(1, 0, NARROW)?;
        for _ in 0..2 {
            h = self.core.run("denoiser", &parts.denoiser, |m| m.forward(&h))?;
        }
        self.core.run("decoder", &parts.decoder, |m| m.forward(&h))
    }
}

fn position(events: &[OffloadEvent], event: OffloadEvent) -> usize {
    events
        .iter()
        .position(|e| *e == event)
        .unwrap_or_else(|| panic!("{event:?} missing from {events:?}"))
}

#[test]
fn the_component_order_alone_drives_model_offload() {
    let device = Device::cpu().unwrap();
    let x = Tensor::from_f32(&vec![0.25; 2 * WIDE], DType::F32, [2, WIDE], &device).unwrap();
    let mut pipe = ThreeStepPipeline::new().to(&device).unwrap();
    let on_device = pipe.call(&x).unwrap().to_f32_vec().unwrap();

    pipe.enable_model_cpu_offload(&device).unwrap();
    assert_eq!(pipe.offload_mode(), OffloadMode::Model);
    let names: Vec<&str> = pipe.offload_plan().unwrap().components.iter().map(|c| c.name).collect();
    assert_eq!(
        names,
        ["encoder", "denoiser", "decoder"],
        "the plan follows the run order"
    );
    pipe.offload_log().set_recording(true);
    let offloaded = pipe.call(&x).unwrap().to_f32_vec().unwrap();
    assert_eq!(offloaded, on_device, "offload moves weights, never changes results");

    let events = pipe.offload_log().events();
    let transfer = |n: &str| OffloadEvent::Transfer(n.to_string());
    let awaited = |n: &str| OffloadEvent::Await(n.to_string());
    let released = |n: &str| OffloadEvent::Release(n.to_string());
    // Without a device budget the room is the largest need (the encoder's): the denoiser cannot
    // arrive while the encoder is there, so the encoder is awaited and leaves first.
    assert!(position(&events, awaited("encoder")) < position(&events, released("encoder")));
    assert!(position(&events, released("encoder")) < position(&events, transfer("denoiser")));
    // The two narrow ones fit together: the decoder, next in order, is on its way before the
    // denoiser's results are awaited.
    assert!(
        position(&events, transfer("decoder")) < position(&events, awaited("denoiser")),
        "{events:?}"
    );
    let transfers = events.iter().filter(|e| matches!(e, OffloadEvent::Transfer(_))).count();
    assert_eq!(transfers, 3, "each component moves once per call: {events:?}");
    assert_eq!(
        pipe.offload_log().weight_bytes(),
        0,
        "nothing stays on the device after the call"
    );
}
