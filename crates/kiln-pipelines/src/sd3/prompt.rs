//! SD3's prompt encoding: CLIP-L, CLIP-G and T5 on the prompts (and, with classifier-free
//! guidance, the negative prompts), assembled into the transformer's text inputs.

use kiln_tensor::Tensor;
use kiln_tokenizers::PromptTokenizer;

use super::{Pair, StableDiffusion3Call, StableDiffusion3Pipeline, CLIP_MAX_LENGTH};
use crate::call::Encoded;
use crate::error::{invalid, Result};

impl StableDiffusion3Pipeline {
    /// [`Self::encode_prompt`] after the checks: the prompts' (embeddings, pooled), and the
    /// negatives' with classifier-free guidance.
    pub(super) fn encode_with(&self, call: &StableDiffusion3Call<'_>) -> Result<(Pair, Option<Pair>)> {
        let (_, device) = self.core.loaded()?;
        let (batch, dtype) = (call.batch(), self.core.dtype());
        let cfg = call.do_classifier_free_guidance();
        // diffusers uses given embeddings as they are (no repetition per image).
        let given = |e: &Option<Tensor>, pooled: &Option<Tensor>| -> Result<Option<Pair>> {
            let (Some(e), Some(p)) = (e, pooled) else {
                return Ok(None);
            };
            let up = |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(device)?.to_dtype(dtype)?) };
            Ok(Some((up(e)?, up(p)?)))
        };
        let positive = given(&call.prompt_embeds, &call.pooled_prompt_embeds)?;
        let negative = match cfg {
            true => given(&call.negative_prompt_embeds, &call.negative_pooled_prompt_embeds)?,
            false => None,
        };
        let mut sets: Vec<([&Vec<String>; 3], Option<usize>)> = Vec::new();
        if positive.is_none() {
            let Some(prompt) = &call.prompt else {
                return Err(invalid("Provide either `prompt` or `prompt_embeds`."));
            };
            let (prompt_2, prompt_3) = (call.prompt_2.as_ref(), call.prompt_3.as_ref());
            sets.push((
                [prompt, prompt_2.unwrap_or(prompt), prompt_3.unwrap_or(prompt)],
                call.clip_skip,
            ));
        }
        let negatives = (cfg && negative.is_none())
            .then(|| negative_texts(call, batch))
            .transpose()?;
        if let Some([negative, negative_2, negative_3]) = &negatives {
            // diffusers quirk: negative prompts always use the penultimate CLIP layer (clip_skip ignored).
            sets.push(([negative, negative_2, negative_3], None));
        }
        let mut encoded = self.encode_texts(&sets, call)?.into_iter();
        let mut next = || encoded.next().expect("one encoding per set");
        let positive = positive.unwrap_or_else(&mut next);
        Ok((positive, cfg.then(|| negative.unwrap_or_else(&mut next))))
    }

    /// CLIP-L, CLIP-G and T5 on each set's prompts (each encoder entered once however many sets
    /// there are, with the set's `clip_skip`), assembled into `(prompt_embeds, pooled)` and
    /// repeated per image.
    fn encode_texts(
        &self,
        sets: &[([&Vec<String>; 3], Option<usize>)],
        call: &StableDiffusion3Call<'_>,
    ) -> Result<Vec<Pair>> {
        let (models, device) = self.core.loaded()?;
        let (n, max_sequence_length) = (call.num_images_per_prompt, call.max_sequence_length);
        for ([prompt, prompt_2, prompt_3], _) in sets {
            for (name, v) in [("prompt_2", prompt_2), ("prompt_3", prompt_3)] {
                if v.len() != prompt.len() {
                    return Err(invalid(format!(
                        "`{name}` has {} entries but `prompt` has {}: give one per prompt",
                        v.len(),
                        prompt.len()
                    )));
                }
            }
        }
        let clip = |component, k: usize| -> Result<Vec<Encoded>> {
            sets.iter()
                .map(|(prompts, clip_skip)| self.clip_states(component, prompts[k], *clip_skip))
                .collect()
        };
        let (clip_l, clip_g) = (clip("text_encoder", 0)?, clip("text_encoder_2", 1)?);
        let joint = self.transformer_config.joint_attention_dim;
        let mut out = Vec::with_capacity(sets.len());
        for ((([_, _, prompt_3], _), l), g) in sets.iter().zip(clip_l).zip(clip_g) {
            let t5 = match (&models.text_encoder_3, &self.tokenizer_3) {
                (Some(model), Some(tokenizer)) => {
                    let texts: Vec<&str> = prompt_3.iter().map(String::as_str).collect();
                    let ids = tokenizer.encode_batch(&texts, max_sequence_length)?;
                    let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
                    self.core.run("text_encoder_3", model, |t5| {
                        let states = t5.forward(&t, Some(&ids.input_ids), false)?.last_hidden_state;
                        Ok(states.to_dtype(self.core.dtype())?)
                    })?
                }
                // No T5: zeros of the sequence length still take positions 77.. (diffusers).
                _ => Tensor::zeros([prompt_3.len(), max_sequence_length, joint], self.core.dtype(), device)?,
            };
            let clip = Tensor::cat(&[&l.embeds, &g.embeds], -1)?;
            let clip_width = clip.dims()[2];
            let clip = clip.pad(&[(0, 0), (0, 0), (0, joint - clip_width)], 0.0)?;
            let embeds = Tensor::cat(&[&clip, &t5], 1)?;
            let pooled = Tensor::cat(&[&l.pooled, &g.pooled], -1)?;
            out.push((embeds.repeat_interleave(n, 0)?, pooled.repeat_interleave(n, 0)?));
        }
        Ok(out)
    }

    /// One CLIP branch: `hidden_states[-(clip_skip + 2)]` (the penultimate layer by default, no
    /// final LayerNorm) and the projected pooled output.
    fn clip_states(&self, component: &'static str, prompt: &[String], clip_skip: Option<usize>) -> Result<Encoded> {
        let (models, device) = self.core.loaded()?;
        let (model, tokenizer) = match component {
            "text_encoder" => (&models.text_encoder, &self.tokenizer),
            _ => (&models.text_encoder_2, &self.tokenizer_2),
        };
        let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
        let ids = tokenizer.encode_batch(&texts, CLIP_MAX_LENGTH)?;
        let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
        let (embeds, pooled) = self.core.run(component, model, |clip| {
            let mut out = clip.forward(&t, Some(&ids.input_ids), true)?;
            let back = clip_skip.unwrap_or(0).saturating_add(2);
            let layers = out.hidden_states.len() - 1;
            if back > out.hidden_states.len() {
                return Err(invalid(format!(
                    "`clip_skip` {} is too large: {component} has {layers} layers, so at most {} can be skipped",
                    clip_skip.unwrap_or(0),
                    layers.saturating_sub(1)
                )));
            }
            let embeds = out.hidden_states.swap_remove(out.hidden_states.len() - back);
            let pooled = out.text_embeds.expect("SD3's CLIPs are loaded with their projection");
            // diffusers casts both CLIP branches to text_encoder's dtype (the pipeline's dtype here).
            Ok((embeds.to_dtype(self.core.dtype())?, pooled))
        })?;
        Ok(Encoded { embeds, pooled })
    }
}

/// The negative texts of CFG for a batch of `batch` prompts — diffusers: `negative_prompt or ""`,
/// the _2/_3 variants default to it; one text stands for the whole batch — each one per prompt.
fn negative_texts(call: &StableDiffusion3Call<'_>, batch: usize) -> Result<[Vec<String>; 3]> {
    let broadcast = |v: Vec<String>| if v.len() == 1 { vec![v[0].clone(); batch] } else { v };
    let negative = broadcast(call.negative_prompt.clone().unwrap_or_else(|| vec![String::new()]));
    let or_negative = |v: &Option<Vec<String>>| v.clone().map_or_else(|| negative.clone(), broadcast);
    let (negative_2, negative_3) = (
        or_negative(&call.negative_prompt_2),
        or_negative(&call.negative_prompt_3),
    );
    if negative.len() != batch {
        return Err(invalid(format!(
            "`negative_prompt`: {negative:?} has batch size {}, but `prompt`: {:?} has batch size {batch}. Please make sure that passed `negative_prompt` matches the batch size of `prompt`.",
            negative.len(),
            call.prompt.as_deref().unwrap_or_default()
        )));
    }
    for (name, v) in [("negative_prompt_2", &negative_2), ("negative_prompt_3", &negative_3)] {
        if v.len() != batch {
            return Err(invalid(format!(
                "`{name}` has {} entries but there are {batch} prompts: give one, or one per prompt",
                v.len()
            )));
        }
    }
    Ok([negative, negative_2, negative_3])
}
