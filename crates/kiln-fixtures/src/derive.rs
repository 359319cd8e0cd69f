//! Derived tensors: the `derived` list of an `xz-shuffled` entry (format 2), and the `clip-vocab`
//! kind. `tools/fixtures/oracle_pack.py` describes both and writes them; this is its unpacker.
//!
//! A derived tensor is stored as its bytes XOR the bytes an expression predicts from the file's
//! other tensors (or from torch's generator), so an exact prediction stores zeros. Expressions are
//! evaluated in float32, every arithmetic result rounded to float32, exactly as the Python
//! unpacker does (it computes each operation in double and rounds, which gives the same float32
//! for +, −, ×, ÷ and √).

use std::io;

use std::collections::HashMap;

use serde_json::Value;

use crate::{invalid, TensorSpan};

/// A value of an expression: a tensor (shape, float32 values) or a vector along one axis of the
/// other operand of a binary operation.
enum Val {
    Tensor(Vec<usize>, Vec<f32>),
    Chan(usize, Vec<f32>),
}

/// The tensors of a safetensors file by name, with absolute byte ranges.
type Spans = HashMap<String, TensorSpan>;

fn spans(file: &[u8]) -> io::Result<Spans> {
    let (base, tensors) = crate::tensors(file)?;
    let mut out = HashMap::new();
    for mut t in tensors {
        (t.start, t.end) = (base + t.start, base + t.end);
        if t.start > t.end || t.end > file.len() {
            return Err(invalid(format!("{}: a malformed safetensors entry", t.name)));
        }
        out.insert(t.name.clone(), t);
    }
    Ok(out)
}

/// Restores the derived tensors of `file` (the stored safetensors bytes, un-shuffled) in order:
/// each prediction reads the file as restored so far.
pub(crate) fn underive(file: &mut [u8], derived: &[(String, Value)]) -> io::Result<()> {
    if derived.is_empty() {
        return Ok(());
    }
    let spans = spans(file)?;
    for (name, expr) in derived {
        let span = spans
            .get(name)
            .ok_or_else(|| invalid(format!("derived: no tensor `{name}`")))?;
        let predicted = predict(file, &spans, name, span, expr)?;
        for (b, p) in file[span.start..span.end].iter_mut().zip(predicted) {
            *b ^= p;
        }
    }
    Ok(())
}

fn predict(file: &[u8], spans: &Spans, name: &str, span: &TensorSpan, expr: &Value) -> io::Result<Vec<u8>> {
    let (_, values) = tensor(evaluate(expr, file, spans)?).map_err(|e| invalid(format!("{name}: {e}")))?;
    let numel: usize = span.shape.iter().product();
    if values.len() != numel {
        return Err(invalid(format!(
            "derived: {name}: {} values predicted for {:?}",
            values.len(),
            span.shape
        )));
    }
    let out: Vec<u8> = match span.dtype.as_str() {
        "F32" => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        "BF16" => values
            .iter()
            .flat_map(|v| crate::bf16_rne(v.to_bits()).to_le_bytes())
            .collect(),
        "F16" => {
            let mut out = Vec::with_capacity(2 * values.len());
            for v in &values {
                let h = half::f16::from_f32(*v);
                if h.is_infinite() && v.is_finite() {
                    return Err(invalid(format!("derived: {name}: {v} does not fit float16")));
                }
                out.extend_from_slice(&h.to_le_bytes());
            }
            out
        }
        "U8" => {
            let mut out = Vec::with_capacity(values.len());
            for v in &values {
                if !(0.0..=255.0).contains(v) || v.fract() != 0.0 {
                    return Err(invalid(format!(
                        "derived: {name}: a U8 prediction outside the integers 0..255"
                    )));
                }
                out.push(*v as u8);
            }
            out
        }
        other => return Err(invalid(format!("derived: {name}: dtype {other} cannot be predicted"))),
    };
    if out.len() != span.end - span.start {
        return Err(invalid(format!("derived: {name}: {} bytes predicted", out.len())));
    }
    Ok(out)
}

fn dims(v: &Value) -> io::Result<Vec<usize>> {
    v.as_array()
        .ok_or_else(|| invalid(format!("derived: {v} is not a list of sizes")))?
        .iter()
        .map(|d| {
            d.as_u64()
                .map(|d| d as usize)
                .ok_or_else(|| invalid(format!("derived: size {d}")))
        })
        .collect()
}

fn uint(v: &Value) -> io::Result<usize> {
    v.as_u64()
        .map(|x| x as usize)
        .ok_or_else(|| invalid(format!("derived: {v} is not a count")))
}

fn tensor(v: Val) -> io::Result<(Vec<usize>, Vec<f32>)> {
    match v {
        Val::Tensor(s, v) => Ok((s, v)),
        Val::Chan(..) => Err(invalid("derived: a vector outside a binary operation")),
    }
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn evaluate(expr: &Value, file: &[u8], spans: &Spans) -> io::Result<Val> {
    let ev = |e: &Value| evaluate(e, file, spans);
    if let Some(name) = expr.as_str() {
        let s = spans
            .get(name)
            .ok_or_else(|| invalid(format!("derived: no tensor `{name}`")))?;
        if s.dtype != "F32" {
            return Err(invalid(format!("derived: {name} is {}, not F32", s.dtype)));
        }
        let v = file[s.start..s.end]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        return Ok(Val::Tensor(s.shape.clone(), v));
    }
    if let Some(x) = expr.as_f64() {
        return Ok(Val::Tensor(vec![], vec![x as f32]));
    }
    let obj = expr
        .as_object()
        .filter(|o| !o.is_empty())
        .ok_or_else(|| invalid(format!("derived: bad expression {expr}")))?;
    let arg = |k: &str| obj.get(k).ok_or_else(|| invalid(format!("derived: {expr}: no `{k}`")));
    if let Some(v) = obj.get("chan") {
        let values = v
            .as_array()
            .ok_or_else(|| invalid("derived: chan is not a list"))?
            .iter()
            .map(|x| {
                x.as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| invalid("derived: chan value"))
            })
            .collect::<io::Result<Vec<_>>>()?;
        return Ok(Val::Chan(uint(arg("axis")?)?, values));
    }
    if let Some(v) = obj.get("randn") {
        let n = uint(v)?;
        if n < 16 {
            return Err(invalid(
                "derived: randn of fewer than 16 values (torch's double path) is not supported",
            ));
        }
        let seed = arg("seed")?.as_u64().ok_or_else(|| invalid("derived: randn seed"))?;
        return Ok(Val::Tensor(
            vec![n],
            // The packer reproduces ATen's AVX2 kernel.
            kiln_rng::TorchGenerator::manual_seed(seed)
                .with_capability(kiln_rng::CpuCapability::Avx2)
                .randn_f32(n),
        ));
    }
    if let Some(v) = obj.get("zeros") {
        let d = dims(v)?;
        let n = d.iter().product();
        return Ok(Val::Tensor(d, vec![0.0; n]));
    }
    if let Some(i) = obj.get("at") {
        let (_, v) = tensor(ev(arg("x")?)?)?;
        let x = *v
            .get(uint(i)?)
            .ok_or_else(|| invalid(format!("derived: at {i} of {} values", v.len())))?;
        return Ok(Val::Tensor(vec![], vec![x]));
    }
    if let Some(d) = obj.get("reshape") {
        let (shape, v) = tensor(ev(arg("x")?)?)?;
        let d = dims(d)?;
        if d.iter().product::<usize>() != v.len() {
            return Err(invalid(format!("derived: reshape {shape:?} to {d:?}")));
        }
        return Ok(Val::Tensor(d, v));
    }
    if let Some(p) = obj.get("perm") {
        let (shape, v) = tensor(ev(arg("x")?)?)?;
        let perm = dims(p)?;
        let mut sorted = perm.clone();
        sorted.sort_unstable();
        if sorted != (0..shape.len()).collect::<Vec<_>>() {
            return Err(invalid(format!("derived: perm {perm:?} of {shape:?}")));
        }
        let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        let in_strides = strides(&shape);
        // Input stride of each output axis; walk the output in order with a counter.
        let st: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
        let mut out = Vec::with_capacity(v.len());
        let mut idx = vec![0usize; out_shape.len()];
        let mut offset = 0usize;
        for _ in 0..v.len() {
            out.push(v[offset]);
            for a in (0..idx.len()).rev() {
                idx[a] += 1;
                offset += st[a];
                if idx[a] < out_shape[a] {
                    break;
                }
                offset -= st[a] * idx[a];
                idx[a] = 0;
            }
        }
        return Ok(Val::Tensor(out_shape, out));
    }
    if let Some(parts) = obj.get("cat") {
        let k = uint(arg("axis")?)?;
        let parts = parts
            .as_array()
            .filter(|p| !p.is_empty())
            .ok_or_else(|| invalid("derived: cat of no parts"))?
            .iter()
            .map(|p| tensor(ev(p)?))
            .collect::<io::Result<Vec<_>>>()?;
        let s0 = &parts[0].0;
        if k >= s0.len() {
            return Err(invalid(format!("derived: cat along {k} of {s0:?}")));
        }
        for (s, _) in &parts {
            if s.len() != s0.len() || s[..k] != s0[..k] || s[k + 1..] != s0[k + 1..] {
                return Err(invalid(format!("derived: cat of {s:?} and {s0:?} along {k}")));
            }
        }
        let outer: usize = s0[..k].iter().product();
        let mut out = Vec::with_capacity(parts.iter().map(|(_, v)| v.len()).sum());
        for o in 0..outer {
            for (s, v) in &parts {
                let blk: usize = s[k..].iter().product();
                out.extend_from_slice(&v[o * blk..(o + 1) * blk]);
            }
        }
        let mut shape = s0.clone();
        shape[k] = parts.iter().map(|(s, _)| s[k]).sum();
        return Ok(Val::Tensor(shape, out));
    }
    if let Some(range) = obj.get("slice") {
        let (shape, v) = tensor(ev(arg("x")?)?)?;
        let k = uint(arg("axis")?)?;
        let r = dims(range)?;
        if r.len() != 2 || k >= shape.len() || r[0] > r[1] || r[1] > shape[k] {
            return Err(invalid(format!("derived: slice {r:?} of axis {k} of {shape:?}")));
        }
        let (outer, inner): (usize, usize) = (shape[..k].iter().product(), shape[k + 1..].iter().product());
        let mut out = Vec::with_capacity(outer * (r[1] - r[0]) * inner);
        for o in 0..outer {
            let base = o * shape[k] * inner;
            out.extend_from_slice(&v[base + r[0] * inner..base + r[1] * inner]);
        }
        let mut s = shape;
        s[k] = r[1] - r[0];
        return Ok(Val::Tensor(s, out));
    }
    if let Some(x) = obj.get("round") {
        let (shape, v) = tensor(ev(x)?)?;
        // Python's float(round(x)): ties to even, and an integer has no negative zero.
        return Ok(Val::Tensor(
            shape,
            v.into_iter().map(|x| x.round_ties_even() + 0.0).collect(),
        ));
    }
    let (op, args) = obj.iter().next().unwrap();
    let args = args
        .as_array()
        .filter(|a| obj.len() == 1 && a.len() == 2)
        .ok_or_else(|| invalid(format!("derived: bad expression {expr}")))?;
    let f: fn(f32, f32) -> f32 = match op.as_str() {
        "+" => |x, y| x + y,
        "-" => |x, y| x - y,
        "*" => |x, y| x * y,
        "/" => |x, y| x / y,
        // Python's min(x, y) and max(x, y): the first argument unless the second is smaller (larger).
        "min" => |x, y| if y < x { y } else { x },
        "max" => |x, y| if y > x { y } else { x },
        _ => return Err(invalid(format!("derived: unknown operation `{op}`"))),
    };
    let (a, c) = (ev(&args[0])?, ev(&args[1])?);
    let expand = |shape: &[usize], axis: usize, vec: &[f32]| -> io::Result<Vec<f32>> {
        if axis >= shape.len() || shape[axis] != vec.len() {
            return Err(invalid(format!(
                "derived: a vector of {} along axis {axis} of {shape:?}",
                vec.len()
            )));
        }
        let inner: usize = shape[axis + 1..].iter().product();
        let n: usize = shape.iter().product();
        Ok((0..n).map(|i| vec[(i / inner) % vec.len()]).collect())
    };
    let ((sa, va), (sc, vc)) = match (a, c) {
        (Val::Chan(..), Val::Chan(..)) => return Err(invalid("derived: two vectors")),
        (Val::Chan(axis, vec), Val::Tensor(s, v)) => ((s.clone(), expand(&s, axis, &vec)?), (s, v)),
        (Val::Tensor(s, v), Val::Chan(axis, vec)) => {
            let e = expand(&s, axis, &vec)?;
            ((s.clone(), v), (s, e))
        }
        (Val::Tensor(s, v), Val::Tensor(t, w)) => ((s, v), (t, w)),
    };
    if op == "/" && vc.contains(&0.0) {
        return Err(invalid("derived: division by zero"));
    }
    let (shape, out) = if va.len() == 1 && vc.len() != 1 {
        (sc, vc.iter().map(|&y| f(va[0], y)).collect())
    } else if vc.len() == 1 && va.len() != 1 {
        (sa, va.iter().map(|&x| f(x, vc[0])).collect())
    } else if va.len() == vc.len() {
        let shape = if sa.len() >= sc.len() { sa } else { sc };
        (shape, va.iter().zip(&vc).map(|(&x, &y)| f(x, y)).collect())
    } else {
        return Err(invalid(format!("derived: {op} of {sa:?} and {sc:?}")));
    };
    Ok(Val::Tensor(shape, out))
}

/// GPT-2's byte → printable character table, which CLIP's BPE symbols are made of.
fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (u32::from('!')..=u32::from('~'))
        .chain(0xa1..=0xac)
        .chain(0xae..=0xff)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    cs.into_iter().map(|c| char::from_u32(c).unwrap()).collect()
}

/// CLIP's `vocab.json` as transformers writes it (Python's `json.dumps(vocab,
/// ensure_ascii=False)`) from its `merges.txt`: the 256 byte symbols, the same with `</w>`, each
/// merge joined, then `<|startoftext|>` and `<|endoftext|>`.
pub(crate) fn clip_vocab(merges: &[u8]) -> io::Result<Vec<u8>> {
    let text = std::str::from_utf8(merges).map_err(|e| invalid(format!("clip-vocab: merges.txt: {e}")))?;
    let mut lines = text.split('\n');
    if !lines.next().unwrap_or("").starts_with("#version") {
        return Err(invalid("clip-vocab: merges.txt has no #version line"));
    }
    let symbols = bytes_to_unicode();
    let tokens = symbols
        .iter()
        .map(|c| c.to_string())
        .chain(symbols.iter().map(|c| format!("{c}</w>")))
        .chain(lines.filter(|l| !l.is_empty()).map(|l| l.replace(' ', "")))
        .chain(["<|startoftext|>".to_string(), "<|endoftext|>".to_string()]);
    // A Python dict: a repeated token keeps its first place and takes the last id.
    let mut order: Vec<(String, usize)> = Vec::new();
    let mut place: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (id, t) in tokens.enumerate() {
        match place.get(&t) {
            Some(&i) => order[i].1 = id,
            None => {
                place.insert(t.clone(), order.len());
                order.push((t, id));
            }
        }
    }
    let body: Vec<String> = order
        .iter()
        .map(|(t, id)| format!("{}: {id}", serde_json::to_string(t).unwrap()))
        .collect();
    Ok(format!("{{{}}}", body.join(", ")).into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tensors: &[(&str, &str, &[usize], Vec<u8>)]) -> Vec<u8> {
        let mut head = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            head.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
            );
            data.extend_from_slice(bytes);
        }
        let head = serde_json::to_vec(&head).unwrap();
        let mut f = (head.len() as u64).to_le_bytes().to_vec();
        f.extend(head);
        f.extend(data);
        f
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn an_exact_prediction_restores_the_tensor_from_zeros() {
        let a = [1.5f32, -2.0, 0.25, 3.0, 4.0, -1.0];
        // b = a permuted ([2, 3] -> [3, 2]) * 2 + 1, c = round(a), stored as zeros.
        let b: Vec<f32> = [0, 3, 1, 4, 2, 5].iter().map(|&i| a[i] * 2.0 + 1.0).collect();
        let stored = file(&[
            ("a", "F32", &[2, 3], f32s(&a)),
            ("b", "F32", &[3, 2], vec![0; 24]),
            ("c", "U8", &[2], vec![0, 0]),
        ]);
        let mut f = stored.clone();
        let derived = vec![
            (
                "b".to_string(),
                serde_json::json!({"+": [{"*": [{"perm": [1, 0], "x": "a"}, 2]}, 1]}),
            ),
            (
                "c".to_string(),
                serde_json::json!({"round": {"slice": [2, 4], "axis": 0, "x": {"reshape": [6], "x": "a"}}}),
            ),
        ];
        underive(&mut f, &derived).unwrap();
        let want = file(&[
            ("a", "F32", &[2, 3], f32s(&a)),
            ("b", "F32", &[3, 2], f32s(&b)),
            ("c", "U8", &[2], vec![0, 3]),
        ]);
        assert_eq!(f, want);
    }

    #[test]
    fn randn_is_torchs_first_draw() {
        let mut f = file(&[("w", "F32", &[4, 8], vec![0; 128])]);
        underive(&mut f, &[("w".into(), serde_json::json!({"randn": 32, "seed": 0}))]).unwrap();
        let got: Vec<f32> = f[f.len() - 128..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, kiln_rng::TorchGenerator::manual_seed(0).randn_f32(32));
        // torch.randn(16, generator=torch.Generator().manual_seed(0))[0]
        assert_eq!(got[0], -1.1258398);
    }

    #[test]
    fn a_wrong_size_or_unknown_operation_is_an_error() {
        let mut f = file(&[("a", "F32", &[2], f32s(&[1.0, 2.0])), ("b", "F32", &[3], vec![0; 12])]);
        assert!(underive(&mut f, &[("b".into(), serde_json::json!("a"))]).is_err());
        assert!(underive(&mut f, &[("b".into(), serde_json::json!({"pow": ["a", "a"]}))]).is_err());
        assert!(underive(&mut f, &[("b".into(), serde_json::json!({"randn": 3, "seed": 0}))]).is_err());
    }

    #[test]
    fn clip_vocab_lists_symbols_then_merges() {
        let v = clip_vocab(b"#version: 0.2\ni n\nin g</w>\n").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&v).unwrap();
        let v = v.as_object().unwrap();
        assert_eq!(v.len(), 512 + 2 + 2);
        assert_eq!(v["!"], 0);
        assert_eq!(v["in"], 512);
        assert_eq!(v["ing</w>"], 513);
        assert_eq!(v["<|endoftext|>"], 515);
    }
}
