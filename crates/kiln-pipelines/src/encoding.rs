//! Prompt encodings made once and passed back in: [`PromptEncoding`] holds what a pipeline's own
//! `encode_prompt` computes from the texts (its `prompt_embeds`, and FLUX.1's and SD3's pooled
//! embeddings, and the negatives a call with guidance uses), one row per prompt, on the host.
//!
//! On the host, not on the device: an encoding kept for later (a server's cache) then takes no
//! device memory, which the models and the call budget need, it is the same for every device
//! and worker, and its size is its bytes. Uploading it back costs a copy of a few MiB per prompt;
//! the values are the bytes the device gave, so a call made from it is the call made from the
//! text, bit for bit ([`crate::AnyPipeline::encode_prompt`]).

use std::path::PathBuf;

use kiln_tensor::{DType, Device, Tensor};

use crate::error::{invalid, Result};

/// One tensor's values on the host: little-endian bytes of `dtype`, row-major `dims`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    bytes: Vec<u8>,
    dtype: DType,
    dims: Vec<usize>,
}

impl HostTensor {
    /// Waits for `t` and copies it to the host.
    pub fn of(t: &Tensor) -> Result<HostTensor> {
        Ok(HostTensor {
            bytes: t.to_bytes()?,
            dtype: t.dtype(),
            dims: t.dims().to_vec(),
        })
    }

    /// The values on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_bytes(&self.bytes, self.dtype, self.dims.clone(), device)?)
    }

    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn size_in_bytes(&self) -> usize {
        self.bytes.len()
    }

    fn rows(&self) -> usize {
        self.dims.first().copied().unwrap_or(0)
    }

    fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows().max(1)
    }

    /// The rows of `parts` in order, row `r` of each part `count` times in a row
    /// (`torch.repeat_interleave`), then the parts concatenated (`torch.cat(dim=0)`). The parts
    /// must agree on everything but the rows.
    fn rows_of(parts: &[(&HostTensor, usize)]) -> Result<HostTensor> {
        let (first, _) = parts
            .first()
            .ok_or_else(|| invalid("no prompt encoding to batch: give at least one"))?;
        let mut bytes = Vec::new();
        let mut rows = 0;
        for (part, count) in parts {
            if part.dtype != first.dtype || part.dims[1..] != first.dims[1..] {
                return Err(invalid(format!(
                    "prompt encodings of shapes {:?} ({}) and {:?} ({}) cannot be batched: encode them with the same settings",
                    first.dims, first.dtype, part.dims, part.dtype
                )));
            }
            let row = part.row_bytes();
            for r in 0..part.rows() {
                for _ in 0..*count {
                    bytes.extend_from_slice(&part.bytes[r * row..(r + 1) * row]);
                }
            }
            rows += part.rows() * count;
        }
        let mut dims = first.dims.clone();
        dims[0] = rows;
        Ok(HostTensor {
            bytes,
            dtype: first.dtype,
            dims,
        })
    }
}

/// The call settings an encoding depends on besides the texts, resolved (defaults filled in):
/// an encoding is used only by a call that resolves to the same.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EncodingSettings {
    pub max_sequence_length: usize,
    /// Whether the negatives are encoded: the call runs classifier-free guidance (SD3, FLUX.2
    /// [klein] base) or FLUX.1's true CFG with a negative prompt.
    pub negative: bool,
    /// The pipeline's other call arguments the encoding depends on (SD3's `clip_skip`, FLUX.2's
    /// `text_encoder_out_layers`), resolved: each name and its value as JSON text.
    pub arguments: Vec<(&'static str, String)>,
}

impl EncodingSettings {
    /// The resolved value of argument `name`, when the encoding depends on it.
    pub fn argument(&self, name: &str) -> Option<serde_json::Value> {
        let (_, json) = self.arguments.iter().find(|(n, _)| *n == name)?;
        serde_json::from_str(json).ok()
    }
}

/// What an encoding depends on: the model, the texts it reads and the settings. Two calls with
/// one key have one encoding (the key of a cache of them).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PromptKey {
    pub(crate) root: PathBuf,
    /// The pipeline's class.
    pub(crate) class: &'static str,
    pub(crate) dtype: DType,
    /// The text arguments the encoding reads, by name, as the call gives them.
    pub(crate) texts: Vec<(&'static str, Option<Vec<String>>)>,
    pub(crate) settings: EncodingSettings,
}

impl PromptKey {
    /// The bytes the key holds (its texts), roughly, for a cache's budget.
    pub fn size_in_bytes(&self) -> usize {
        let texts: usize = self
            .texts
            .iter()
            .flat_map(|(_, t)| t.iter().flatten())
            .map(|t| t.len() + std::mem::size_of::<String>())
            .sum();
        texts + self.root.as_os_str().len() + std::mem::size_of::<PromptKey>()
    }

    pub fn settings(&self) -> &EncodingSettings {
        &self.settings
    }
}

/// A pipeline's prompt encoding, one row per prompt (not per image), on the host: made by
/// [`crate::AnyPipeline::encode_prompt`], used by a [`crate::GenerateCall`] whose
/// `prompt_encoding` it is.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptEncoding {
    pub(crate) root: PathBuf,
    /// The pipeline's class.
    pub(crate) class: &'static str,
    /// The pipeline's dtype.
    pub(crate) dtype: DType,
    pub(crate) settings: EncodingSettings,
    pub(crate) prompt_embeds: HostTensor,
    /// FLUX.1 and SD3.
    pub(crate) pooled_prompt_embeds: Option<HostTensor>,
    /// With [`EncodingSettings::negative`].
    pub(crate) negative_prompt_embeds: Option<HostTensor>,
    /// SD3's, and FLUX.1's with true CFG.
    pub(crate) negative_pooled_prompt_embeds: Option<HostTensor>,
    /// Of embeddings whose rows hold prompts of different lengths (Z-Image's): each row's tokens,
    /// the rest of the row padding.
    pub(crate) prompt_lengths: Option<Vec<usize>>,
    pub(crate) negative_prompt_lengths: Option<Vec<usize>>,
}

impl PromptEncoding {
    /// The prompts it encodes (rows).
    pub fn rows(&self) -> usize {
        self.prompt_embeds.rows()
    }

    /// The class of the pipeline that made it.
    pub fn class_name(&self) -> &'static str {
        self.class
    }

    pub fn settings(&self) -> &EncodingSettings {
        &self.settings
    }

    pub fn prompt_embeds(&self) -> &HostTensor {
        &self.prompt_embeds
    }

    pub fn pooled_prompt_embeds(&self) -> Option<&HostTensor> {
        self.pooled_prompt_embeds.as_ref()
    }

    pub fn negative_prompt_embeds(&self) -> Option<&HostTensor> {
        self.negative_prompt_embeds.as_ref()
    }

    pub fn negative_pooled_prompt_embeds(&self) -> Option<&HostTensor> {
        self.negative_pooled_prompt_embeds.as_ref()
    }

    fn tensors(&self) -> [Option<&HostTensor>; 4] {
        [
            Some(&self.prompt_embeds),
            self.pooled_prompt_embeds.as_ref(),
            self.negative_prompt_embeds.as_ref(),
            self.negative_pooled_prompt_embeds.as_ref(),
        ]
    }

    /// The bytes of its tensors.
    pub fn size_in_bytes(&self) -> usize {
        self.tensors()
            .into_iter()
            .flatten()
            .map(HostTensor::size_in_bytes)
            .sum()
    }

    /// One encoding of the rows of `parts` in order, each row of a part `count` times in a row:
    /// e.g. the encodings of several requests' prompts, each repeated per image, for one batched
    /// call. The parts must come from one model with one set of settings.
    pub fn batch(parts: &[(&PromptEncoding, usize)]) -> Result<PromptEncoding> {
        let (first, _) = parts
            .first()
            .ok_or_else(|| invalid("no prompt encoding to batch: give at least one"))?;
        if let Some((other, _)) = parts.iter().find(|(p, _)| {
            (&p.root, p.class, p.dtype, &p.settings) != (&first.root, first.class, first.dtype, &first.settings)
                || p.tensors().map(|t| t.is_some()) != first.tensors().map(|t| t.is_some())
        }) {
            return Err(invalid(format!(
                "prompt encodings of {} ({:?}) and {} ({:?}) cannot be batched: encode them for one model with the same settings",
                first.root.display(),
                first.settings,
                other.root.display(),
                other.settings
            )));
        }
        let rows = |get: fn(&PromptEncoding) -> Option<&HostTensor>| -> Result<Option<HostTensor>> {
            if get(first).is_none() {
                return Ok(None);
            }
            let parts: Vec<(&HostTensor, usize)> = parts
                .iter()
                .map(|(p, n)| (get(p).expect("checked: every part has it"), *n))
                .collect();
            HostTensor::rows_of(&parts).map(Some)
        };
        let lengths = |get: fn(&PromptEncoding) -> Option<&Vec<usize>>| -> Option<Vec<usize>> {
            get(first)?;
            Some(
                parts
                    .iter()
                    .flat_map(|(p, n)| {
                        get(p)
                            .into_iter()
                            .flatten()
                            .flat_map(move |l| std::iter::repeat_n(*l, *n))
                    })
                    .collect(),
            )
        };
        Ok(PromptEncoding {
            prompt_lengths: lengths(|p| p.prompt_lengths.as_ref()),
            negative_prompt_lengths: lengths(|p| p.negative_prompt_lengths.as_ref()),
            root: first.root.clone(),
            class: first.class,
            dtype: first.dtype,
            settings: first.settings.clone(),
            prompt_embeds: rows(|p| Some(&p.prompt_embeds))?.expect("every encoding has prompt embeddings"),
            pooled_prompt_embeds: rows(|p| p.pooled_prompt_embeds.as_ref())?,
            negative_prompt_embeds: rows(|p| p.negative_prompt_embeds.as_ref())?,
            negative_pooled_prompt_embeds: rows(|p| p.negative_pooled_prompt_embeds.as_ref())?,
        })
    }

    /// Every tensor has one row per prompt.
    pub(crate) fn check_rows(&self) -> Result<()> {
        let rows = self.rows();
        match self.tensors().into_iter().flatten().find(|t| t.rows() != rows) {
            Some(t) => Err(invalid(format!(
                "the prompt encoding has {rows} prompt rows but a tensor of shape {:?}: the prompts and negative prompts must be as many",
                t.dims
            ))),
            None => Ok(()),
        }
    }
}

/// Prompt embeddings on the device, one row per prompt or per image: what a pipeline's call
/// takes as given embeddings, and what its encoding of texts gives ([`crate::Pipeline`]).
pub struct Embeddings {
    pub prompt_embeds: Tensor,
    /// FLUX.1's and SD3's.
    pub pooled_prompt_embeds: Option<Tensor>,
    pub negative_prompt_embeds: Option<Tensor>,
    pub negative_pooled_prompt_embeds: Option<Tensor>,
    /// Rows of different lengths (Z-Image): each row's tokens, the rest padding.
    pub prompt_lengths: Option<Vec<usize>>,
    pub negative_prompt_lengths: Option<Vec<usize>>,
}

impl Embeddings {
    /// `prompt_embeds` and the negatives, of one length per row.
    pub fn new(
        prompt_embeds: Tensor,
        pooled: Option<Tensor>,
        negative: Option<(Tensor, Option<Tensor>)>,
    ) -> Embeddings {
        let (negative_prompt_embeds, negative_pooled_prompt_embeds) = match negative {
            Some((embeds, pooled)) => (Some(embeds), pooled),
            None => (None, None),
        };
        Embeddings {
            prompt_embeds,
            pooled_prompt_embeds: pooled,
            negative_prompt_embeds,
            negative_pooled_prompt_embeds,
            prompt_lengths: None,
            negative_prompt_lengths: None,
        }
    }

    /// `encoding` on `device`.
    pub(crate) fn upload(encoding: &PromptEncoding, device: &Device) -> Result<Embeddings> {
        let up = |t: &HostTensor| t.to_device(device);
        Ok(Embeddings {
            prompt_embeds: up(&encoding.prompt_embeds)?,
            pooled_prompt_embeds: encoding.pooled_prompt_embeds.as_ref().map(up).transpose()?,
            negative_prompt_embeds: encoding.negative_prompt_embeds.as_ref().map(up).transpose()?,
            negative_pooled_prompt_embeds: encoding.negative_pooled_prompt_embeds.as_ref().map(up).transpose()?,
            prompt_lengths: encoding.prompt_lengths.clone(),
            negative_prompt_lengths: encoding.negative_prompt_lengths.clone(),
        })
    }

    /// The encoding of `key`, copied to the host.
    pub(crate) fn download(&self, key: PromptKey) -> Result<PromptEncoding> {
        let host = |t: &Tensor| HostTensor::of(t);
        let encoding = PromptEncoding {
            root: key.root,
            class: key.class,
            dtype: key.dtype,
            settings: key.settings,
            prompt_embeds: host(&self.prompt_embeds)?,
            pooled_prompt_embeds: self.pooled_prompt_embeds.as_ref().map(host).transpose()?,
            negative_prompt_embeds: self.negative_prompt_embeds.as_ref().map(host).transpose()?,
            negative_pooled_prompt_embeds: self.negative_pooled_prompt_embeds.as_ref().map(host).transpose()?,
            prompt_lengths: self.prompt_lengths.clone(),
            negative_prompt_lengths: self.negative_prompt_lengths.clone(),
        };
        encoding.check_rows()?;
        Ok(encoding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(rows: &[&[u8]]) -> HostTensor {
        HostTensor {
            bytes: rows.concat(),
            dtype: DType::U8,
            dims: vec![rows.len(), rows[0].len()],
        }
    }

    #[test]
    fn rows_are_repeated_in_place_then_concatenated() {
        let a = host(&[&[1, 2], &[3, 4]]);
        let b = host(&[&[5, 6]]);
        let got = HostTensor::rows_of(&[(&a, 2), (&b, 3)]).unwrap();
        assert_eq!(
            got,
            host(&[&[1, 2], &[1, 2], &[3, 4], &[3, 4], &[5, 6], &[5, 6], &[5, 6]])
        );
        let c = host(&[&[7, 8, 9]]);
        let err = HostTensor::rows_of(&[(&a, 1), (&c, 1)]).unwrap_err().to_string();
        assert!(err.contains("cannot be batched"), "{err}");
    }
}
