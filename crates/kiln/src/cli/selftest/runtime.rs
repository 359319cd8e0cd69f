//! Runtime conformance of a plugin, below the ops: buffers, views as program arguments, compiled
//! functions, donation, memory spaces and executable serialization.

use crate::{CompiledFunction, DType, Device, Tensor};
use anyhow::{bail, ensure, Context, Result};
use kiln_hlo::{ArgAttrs, Builder};
use kiln_pjrt::{CompileOptions, ExecuteOptions};

use super::{Row, Status};

/// Bytes of `n` elements of `dtype` that are valid values of it (bools 0/1, floats finite).
fn sample_bytes(dtype: DType, n: usize) -> Vec<u8> {
    let values: Vec<f32> = (0..n)
        .map(|i| (i as f32 * 0.75 - 3.0) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    match dtype {
        DType::Bool => (0..n).map(|i| (i % 3 == 1) as u8).collect(),
        DType::U8 => (0..n).map(|i| (i * 37 % 256) as u8).collect(),
        DType::U32 => (0..n)
            .flat_map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes())
            .collect(),
        DType::I32 => (0..n).flat_map(|i| (i as i32 * -7919 + 3).to_le_bytes()).collect(),
        DType::I64 => (0..n)
            .flat_map(|i| (i as i64 * -1_000_000_007 + (1 << 40)).to_le_bytes())
            .collect(),
        DType::F64 => values.iter().flat_map(|&v| (v as f64 / 3.0).to_le_bytes()).collect(),
        DType::F32 | DType::BF16 | DType::F16 => kiln_types::f32_to_bytes(&values, dtype),
    }
}

const ALL_DTYPES: [DType; 9] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::I32,
    DType::U32,
    DType::U8,
    DType::Bool,
];

/// Host → device → host, bit for bit, then through a program (a concatenation), in every dtype.
fn round_trip(dev: &Device, dtype: DType) -> Result<String> {
    let bytes = sample_bytes(dtype, 24);
    let t = Tensor::from_bytes(&bytes, dtype, [2, 3, 4], dev)?;
    ensure!(t.to_bytes()? == bytes, "host -> device -> host changed the bytes");
    let memory = t
        .location()
        .map(|p| p.memory)
        .context("a concrete tensor has a buffer location")?;
    let twice = Tensor::cat(&[&t, &t], 0)?;
    let mut want = bytes.clone();
    want.extend_from_slice(&bytes);
    ensure!(twice.to_bytes()? == want, "a program's output (cat) changed the bytes");
    Ok(format!("{} bytes exact, in {} memory", bytes.len(), memory.name()))
}

/// A reshaped view is handed to programs with its buffer's shape: eagerly, as a compiled
/// function's argument, and captured inside a compiled function.
fn views(dev: &Device) -> Result<String> {
    let data: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 4.0).collect();
    let base = Tensor::from_f32(&data, DType::F32, [2, 3, 4], dev)?;
    let view = base.reshape([6, 4])?;
    let ones = Tensor::ones([6, 4], DType::F32, dev)?;
    let want: Vec<f32> = data.iter().map(|v| v + 1.0).collect();
    ensure!(view.add(&ones)?.to_f32_vec()? == want, "eager op on a view");
    let f = CompiledFunction::new("selftest.view_argument");
    let out = f.call(&[view.clone(), ones.clone()], |a| {
        Ok::<_, kiln_tensor::Error>(vec![a[0].add(&a[1])?])
    })?;
    ensure!(out[0].to_f32_vec()? == want, "a view as a compiled function's argument");
    let captured = view.transpose(0, 1)?.reshape([4, 6])?;
    let g = CompiledFunction::new("selftest.view_captured");
    let out = g.call(&[Tensor::ones([4, 6], DType::F32, dev)?], |a| {
        // `view` is not an argument: the trace lifts it to a parameter of its physical shape.
        Ok::<_, kiln_tensor::Error>(vec![a[0].add(&view.reshape([4, 6])?)?, a[0].mul(&captured)?])
    })?;
    let want_t: Vec<f32> = (0..24).map(|i| data[i] + 1.0).collect();
    ensure!(
        out[0].to_f32_vec()? == want_t,
        "a view captured inside a compiled function"
    );
    ensure!(
        out[1].to_f32_vec()? == captured.to_f32_vec()?,
        "a transposed view captured inside a compiled function"
    );
    Ok("eager, as an argument, captured: exact".into())
}

/// The same function compiled and eager give the same bits.
fn compiled_matches_eager(dev: &Device) -> Result<String> {
    let x = Tensor::from_f32(
        &(0..32).map(|i| (i as f32 * 0.3).sin()).collect::<Vec<_>>(),
        DType::BF16,
        [4, 8],
        dev,
    )?;
    let w = Tensor::from_f32(
        &(0..48).map(|i| (i as f32 * 0.7).cos()).collect::<Vec<_>>(),
        DType::BF16,
        [6, 8],
        dev,
    )?;
    let body = |x: &Tensor, w: &Tensor| -> kiln_tensor::Result<Tensor> { x.linear(w, None)?.gelu_tanh()?.softmax(-1) };
    let eager = body(&x, &w)?;
    let f = CompiledFunction::new("selftest.compiled");
    let traced = f.call(&[x.clone(), w.clone()], |a| {
        Ok::<_, kiln_tensor::Error>(vec![body(&a[0], &a[1])?])
    })?;
    let (e, t) = (eager.to_f32_vec()?, traced[0].to_f32_vec()?);
    let max = e.iter().zip(&t).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    // XLA may fuse differently in one program than op by op; bf16 allows one rounding step.
    ensure!(max <= 1e-2, "compiled and eager differ by {max}");
    Ok(format!("linear→gelu_tanh→softmax bf16, max |Δ| {max:.1e}"))
}

fn one_device_options(dev: &Device) -> CompileOptions {
    CompileOptions {
        device_assignment: Some(vec![vec![dev.pjrt().id() as i64]]),
        ..Default::default()
    }
}

/// `y = x + x` with `x` donated to `y`.
fn donating_program() -> Result<String> {
    let mut b = Builder::new();
    let x = b.parameter_with([4, 4], DType::F32, ArgAttrs::donate_to(0));
    let y = b.add(&x, &x)?;
    Ok(b.finish(&[y])?)
}

/// A donated input's buffer is reused for the output and the input reads as deleted; with
/// `non_donatable_input_indices` the input stays alive.
fn donation(dev: &Device) -> Result<String> {
    let client = dev.client();
    let exe = client.compile(&donating_program()?, &one_device_options(dev))?;
    let stats = exe.compiled_memory_stats().ok();
    let data: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let want: Vec<f32> = data.iter().map(|v| v * 2.0).collect();
    let upload = || {
        client.buffer_from_host(
            &kiln_types::f32_to_bytes(&data, DType::F32),
            DType::F32,
            &[4, 4],
            dev.pjrt(),
            None,
        )
    };
    let read = |b: &kiln_pjrt::Buffer| -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; 64];
        b.copy_to_host(&mut bytes)?;
        Ok(kiln_types::bytes_to_f32(&bytes, DType::F32))
    };
    let input = upload()?;
    let out = exe.execute(&[&[&input]], &ExecuteOptions::default())?;
    ensure!(read(&out[0][0])? == want, "wrong result with donation");
    ensure!(input.is_deleted()?, "the donated input is still alive");
    let kept = upload()?;
    let out = exe.execute(
        &[&[&kept]],
        &ExecuteOptions {
            non_donatable_input_indices: vec![0],
            ..Default::default()
        },
    )?;
    ensure!(read(&out[0][0])? == want, "wrong result without donation");
    ensure!(
        !kept.is_deleted()? && read(&kept)? == data,
        "a non-donatable input was consumed"
    );
    Ok(match stats {
        Some(s) => format!(
            "input reused (alias {} B), non-donatable input kept",
            s.alias_size_in_bytes
        ),
        None => "input reused, non-donatable input kept".into(),
    })
}

/// Every memory space the device lists: a tensor copied there reads back the same, reports that
/// memory, and comes back to device memory for an op.
fn memory_spaces(dev: &Device) -> Vec<Row> {
    let kinds: Vec<String> = dev.pjrt().memories().iter().map(|m| m.kind().to_string()).collect();
    let mut rows = vec![Row::new(
        "memory",
        "memory spaces listed".into(),
        Status::Pass,
        kinds.join(", "),
    )];
    let data: Vec<f32> = (0..12).map(|i| i as f32 - 5.5).collect();
    for kind in ["pinned_host", "unpinned_host"] {
        if !kinds.iter().any(|k| k == kind) {
            rows.push(Row::new(
                "memory",
                format!("{kind} round trip"),
                Status::Skip,
                "the device has no such memory".into(),
            ));
            continue;
        }
        let check = || -> Result<String> {
            let t = Tensor::from_f32(&data, DType::F32, [3, 4], dev)?;
            let host = t.to_memory_kind(kind)?;
            ensure!(
                host.memory_kind()? == kind,
                "the copy reports memory {}",
                host.memory_kind()?
            );
            ensure!(host.to_f32_vec()? == data, "reading the {kind} copy changed the values");
            let back = host.to_memory_kind("device")?;
            ensure!(
                back.add(&t)?.to_f32_vec()? == data.iter().map(|v| v * 2.0).collect::<Vec<_>>(),
                "op after return"
            );
            Ok("device -> host -> device exact".into())
        };
        rows.push(row("memory", format!("{kind} round trip"), check()));
    }
    rows
}

/// Serialize a compiled program, load it back, and get the same bits from both.
fn serialization(dev: &Device) -> Result<String> {
    let client = dev.client();
    let mut b = Builder::new();
    let x = b.parameter([8, 16], DType::F32);
    let w = b.parameter([16, 4], DType::F32);
    let dims = kiln_hlo::DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![0],
        ..Default::default()
    };
    let y = b.dot_general(&x, &w, &dims, DType::F32)?;
    let y = b.tanh(&y)?;
    let exe = client.compile(&b.finish(&[y])?, &one_device_options(dev))?;
    let bytes = exe.serialize()?;
    ensure!(!bytes.is_empty(), "empty serialization");
    let loaded = client.deserialize_executable(&bytes)?;
    let xs: Vec<f32> = (0..128).map(|i| (i as f32 * 0.1).sin()).collect();
    let ws: Vec<f32> = (0..64).map(|i| (i as f32 * 0.2).cos()).collect();
    let bx = client.buffer_from_host(
        &kiln_types::f32_to_bytes(&xs, DType::F32),
        DType::F32,
        &[8, 16],
        dev.pjrt(),
        None,
    )?;
    let bw = client.buffer_from_host(
        &kiln_types::f32_to_bytes(&ws, DType::F32),
        DType::F32,
        &[16, 4],
        dev.pjrt(),
        None,
    )?;
    let run = |e: &kiln_pjrt::LoadedExecutable| -> Result<Vec<u8>> {
        let out = e.execute(&[&[&bx, &bw]], &ExecuteOptions::default())?;
        let mut host = vec![0u8; 8 * 4 * 4];
        out[0][0].copy_to_host(&mut host)?;
        Ok(host)
    };
    let (a, c) = (run(&exe)?, run(&loaded)?);
    if a != c {
        bail!("the loaded program's output differs from the compiled one's");
    }
    let fingerprint = exe.fingerprint().unwrap_or_default();
    Ok(format!(
        "{} bytes, same output bits{}",
        bytes.len(),
        if fingerprint.is_empty() {
            String::new()
        } else {
            ", fingerprint ok".into()
        }
    ))
}

pub(super) fn row(section: &'static str, name: String, r: Result<String>) -> Row {
    match r {
        Ok(detail) => Row::new(section, name, Status::Pass, detail),
        Err(e) => Row::new(
            section,
            name,
            Status::Fail,
            format!("{e:#}").lines().next().unwrap_or("").to_string(),
        ),
    }
}

pub fn run(dev: &Device) -> Vec<Row> {
    let mut rows = Vec::new();
    for dtype in ALL_DTYPES {
        rows.push(row("buffers", format!("round trip {dtype}"), round_trip(dev, dtype)));
    }
    rows.push(row(
        "programs",
        "reshaped views as program arguments".into(),
        views(dev),
    ));
    rows.push(row(
        "programs",
        "compiled function = eager".into(),
        compiled_matches_eager(dev),
    ));
    rows.push(row("programs", "donation".into(), donation(dev)));
    rows.push(row("programs", "executable serialization".into(), serialization(dev)));
    rows.extend(memory_spaces(dev));
    rows
}
