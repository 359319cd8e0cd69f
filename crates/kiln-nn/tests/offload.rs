//! Streaming repeated blocks from host memory on a synthetic model with large blocks and small
//! activations: the results are bit for bit those of the model on the device, eager and as
//! compiled blocks; the device holds at most two blocks (kiln's count of live device bytes);
//! each block's transfer is issued before the previous block's computation is awaited.

use kiln_nn::offload::{move_weights, onload, stop_streaming, stream_blocks, with_weights};
use kiln_nn::{impl_model, impl_module, Blocks, CompileMode, Compiled, Linear, Model as _, OffloadEvent, OffloadLog};
use kiln_tensor::{reset_thread_peak_device_memory, thread_device_memory, DType, Device, MemoryKind, Tensor};

const WIDTH: usize = 256;
const BLOCKS: usize = 6;

#[derive(Clone, Debug)]
struct Block {
    proj: Linear,
}
impl_module!(Block { proj: "proj" });

#[derive(Clone, Debug)]
struct Model {
    embed: Linear,
    blocks: Blocks<Block>,
    head: Linear,
    compiled: Compiled,
}
impl_module!(Model {
    embed: "embed",
    blocks: "blocks",
    head: "head",
});

impl_model!(Model {
    compiled: compiled,
    blocks: [blocks],
});

fn linear(seed: usize, d: &Device) -> Linear {
    let w: Vec<f32> = (0..WIDTH * WIDTH)
        .map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 1000.0 - 0.5) / 8.0)
        .collect();
    let b: Vec<f32> = (0..WIDTH).map(|i| ((i + seed) % 13) as f32 / 100.0).collect();
    Linear {
        weight: Tensor::from_f32(&w, DType::F32, [WIDTH, WIDTH], d).unwrap(),
        bias: Some(Tensor::from_f32(&b, DType::F32, [WIDTH], d).unwrap()),
        all_reduce: false,
        quant: None,
    }
}

/// The model, compiled as `mode` (its functions are shared by every model of one `compiled`).
fn model(d: &Device, compiled: &Compiled, mode: CompileMode) -> Model {
    let mut m = Model {
        embed: linear(100, d),
        blocks: Blocks::new("blocks", (0..BLOCKS).map(|i| Block { proj: linear(i, d) }).collect()),
        head: linear(200, d),
        compiled: compiled.clone(),
    };
    m.compile(mode);
    m
}

impl Model {
    fn forward(&self, x: &Tensor) -> kiln_nn::Result<Tensor> {
        self.compiled.whole("", self, x.clone(), |m, x| {
            let mut h = m.embed.forward(x)?;
            for i in 0..m.blocks.len() {
                h = m.blocks.run(&m.compiled, i, h, |b, h| Ok(b.proj.forward(h)?.tanh()?))?;
            }
            m.head.forward(&h)
        })
    }
}

const BLOCK_BYTES: u64 = ((WIDTH * WIDTH + WIDTH) * 4) as u64;

fn input(d: &Device) -> Tensor {
    let x: Vec<f32> = (0..4 * WIDTH).map(|i| (i % 17) as f32 / 17.0).collect();
    Tensor::from_f32(&x, DType::F32, [4, WIDTH], d).unwrap()
}

/// The model in host memory with its blocks streaming, and a device copy of its other weights.
fn offloaded(
    d: &Device,
    log: &OffloadLog,
    compiled: &Compiled,
    mode: CompileMode,
) -> (Model, kiln_nn::offload::BlockStream) {
    let mut host = model(d, compiled, mode);
    move_weights(&mut host, d.host_memory_kind().unwrap()).unwrap();
    let stream = stream_blocks(&mut host, "model", log).unwrap();
    assert_eq!(stream.block_bytes(), vec![BLOCK_BYTES; BLOCKS]);
    let (weights, moved) = onload(&host, &stream.host_keys()).unwrap();
    assert_eq!(
        moved,
        2 * BLOCK_BYTES,
        "embed and head move, the blocks stay in host memory"
    );
    let on_device = with_weights(&host, weights).unwrap();
    assert_eq!(on_device.embed.weight.memory(), Some(MemoryKind::Device));
    assert_eq!(
        on_device.blocks.iter().next().unwrap().proj.weight.memory(),
        Some(MemoryKind::PinnedHost)
    );
    (on_device, stream)
}

fn run(compiled: &Compiled, mode: CompileMode) {
    let d = Device::cpu().unwrap();
    let x = input(&d);
    let reference = {
        let m = model(&d, compiled, mode);
        [m.forward(&x).unwrap(), m.forward(&x).unwrap()]
    };
    let before = thread_device_memory().live_bytes;
    let log = OffloadLog::new();
    log.set_recording(true);
    let (m, stream) = offloaded(&d, &log, compiled, mode);
    let resident = thread_device_memory().live_bytes - before;
    assert_eq!(resident, 2 * BLOCK_BYTES, "embed and head");

    reset_thread_peak_device_memory();
    // Two calls: after the last block the stream has the first one on its way for the next call.
    let outputs = [m.forward(&x).unwrap(), m.forward(&x).unwrap()];
    let peak = thread_device_memory().peak_bytes - before - resident;
    for (got, want) in outputs.iter().zip(&reference) {
        assert_eq!(got.to_bytes().unwrap(), want.to_bytes().unwrap(), "bit for bit");
    }
    stream.release();
    assert_eq!(log.weight_bytes(), 0, "release drops every streamed block");
    assert_eq!(log.peak_weight_bytes(), 2 * BLOCK_BYTES, "two blocks at most");
    let activations = 16 * (4 * WIDTH as u64 * 4);
    assert!(
        peak <= 2 * BLOCK_BYTES + activations,
        "the device held {peak} bytes beyond the resident weights: more than two blocks of {BLOCK_BYTES} plus \
         activations"
    );
    assert!(
        peak > 2 * BLOCK_BYTES - 1,
        "two blocks were on the device together ({peak})"
    );

    // Block j + 1's transfer is issued before block j's computation is awaited (at block j + 1),
    // and no block is transferred while two others are on the device.
    let events = log.events();
    let pos = |e: OffloadEvent| events.iter().position(|x| *x == e);
    let name = |j: usize| format!("model.blocks.{j}");
    for j in 0..BLOCKS - 1 {
        let transfer_next = pos(OffloadEvent::Transfer(name(j + 1))).unwrap();
        let await_this = pos(OffloadEvent::Await(name(j))).unwrap();
        assert!(
            transfer_next < await_this,
            "block {}'s transfer must be issued before block {j} is awaited: {events:?}",
            j + 1
        );
    }
    let mut on_device = 0i64;
    for e in &events {
        match e {
            OffloadEvent::Transfer(_) => {
                on_device += 1;
                assert!(on_device <= 2, "a third block was transferred: {events:?}");
            }
            OffloadEvent::Release(_) => on_device -= 1,
            OffloadEvent::Await(_) => {}
        }
    }
    let transfers = events.iter().filter(|e| matches!(e, OffloadEvent::Transfer(_))).count();
    assert_eq!(
        transfers,
        2 * BLOCKS + 1,
        "each block once per call, and the first again ahead of a third call"
    );
}

#[test]
fn streamed_blocks_match_the_device_model_and_the_device_holds_two_blocks() {
    let compiled = Compiled::new("model");
    run(&compiled, CompileMode::None);
    assert_eq!(compiled.programs(), 0, "eager compiles no function");
}

#[test]
fn streamed_compiled_blocks_match_and_share_one_program() {
    let compiled = Compiled::new("model");
    run(&compiled, CompileMode::RepeatedBlocks);
    assert_eq!(compiled.programs(), 1, "moving weights never recompiles");
}

#[test]
fn streaming_stops_and_refuses_to_run_inside_a_whole_model_program() {
    let d = Device::cpu().unwrap();
    let log = OffloadLog::new();
    let (mut m, _stream) = offloaded(&d, &log, &Compiled::new("model"), CompileMode::Full);
    let x = input(&d);
    let err = m.forward(&x).unwrap_err().to_string();
    assert!(
        err.contains("sequential offload") && err.contains("RepeatedBlocks"),
        "{err}"
    );
    stop_streaming(&mut m);
    m.compile(CompileMode::None);
    let err = m.forward(&x).unwrap_err().to_string();
    assert!(
        err.contains("pinned_host memory"),
        "without the stream the host blocks cannot run: {err}"
    );
}
