//! Config parsing: the real FLUX.1 configs, every fixture config, defaults and errors.

mod common;

use std::path::Path;

use common::pipeline;
use kiln_io::config::{FeedForwardProj, SampleSize};
use kiln_io::{
    load_config, parse_config, Activation, AutoencoderKLConfig, ClipTextConfig, FluxTransformer2DConfig, IoError,
    SD3Transformer2DConfig, T5Config,
};
use serde_json::Value;

fn parse<T: serde::de::DeserializeOwned>(json: &str) -> T {
    parse_config(Path::new("config.json"), json).unwrap()
}

// Values from the real black-forest-labs repos (spec-flux1.md §1.3).
const SCHNELL_TRANSFORMER: &str = r#"{
  "_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0.dev0",
  "attention_head_dim": 128, "guidance_embeds": false, "in_channels": 64,
  "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19,
  "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768 }"#;

const FLUX_VAE: &str = r#"{
  "_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0.dev0", "act_fn": "silu",
  "block_out_channels": [128, 256, 512, 512],
  "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
  "force_upcast": true, "in_channels": 3, "latent_channels": 16, "latents_mean": null,
  "latents_std": null, "layers_per_block": 2, "mid_block_add_attention": true,
  "norm_num_groups": 32, "out_channels": 3, "sample_size": 1024, "scaling_factor": 0.3611,
  "shift_factor": 0.1159,
  "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
  "use_post_quant_conv": false, "use_quant_conv": false }"#;

const FLUX_CLIP: &str = r#"{
  "_name_or_path": "openai/clip-vit-large-patch14", "architectures": ["CLIPTextModel"],
  "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 2,
  "hidden_act": "quick_gelu", "hidden_size": 768, "initializer_factor": 1.0,
  "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
  "max_position_embeddings": 77, "model_type": "clip_text_model", "num_attention_heads": 12,
  "num_hidden_layers": 12, "pad_token_id": 1, "projection_dim": 768, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.3", "vocab_size": 49408 }"#;

const FLUX_T5: &str = r#"{
  "_name_or_path": "google/t5-v1_1-xxl", "architectures": ["T5EncoderModel"],
  "classifier_dropout": 0.0, "d_ff": 10240, "d_kv": 64, "d_model": 4096,
  "decoder_start_token_id": 0, "dense_act_fn": "gelu_new", "dropout_rate": 0.1,
  "eos_token_id": 1, "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0,
  "is_encoder_decoder": true, "is_gated_act": true, "layer_norm_epsilon": 1e-06,
  "model_type": "t5", "num_decoder_layers": 24, "num_heads": 64, "num_layers": 24,
  "output_past": true, "pad_token_id": 0, "relative_attention_max_distance": 128,
  "relative_attention_num_buckets": 32, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.3", "use_cache": true, "vocab_size": 32128 }"#;

#[test]
fn real_flux1_configs_parse() {
    let schnell: FluxTransformer2DConfig = parse(SCHNELL_TRANSFORMER);
    assert_eq!(schnell.out_channels, None);
    assert_eq!(schnell.out_channels(), 64);
    assert_eq!(schnell.axes_dims_rope, vec![16, 56, 56]);
    assert_eq!(schnell.inner_dim(), 3072);
    assert_eq!((schnell.num_layers, schnell.num_single_layers), (19, 38));
    assert!(!schnell.guidance_embeds);
    let dev: FluxTransformer2DConfig =
        parse(&SCHNELL_TRANSFORMER.replace("\"guidance_embeds\": false", "\"guidance_embeds\": true"));
    assert!(dev.guidance_embeds);
    assert_eq!(
        FluxTransformer2DConfig {
            guidance_embeds: false,
            ..dev
        },
        schnell
    );

    let vae: AutoencoderKLConfig = parse(FLUX_VAE);
    assert_eq!(vae.block_out_channels, vec![128, 256, 512, 512]);
    assert_eq!(vae.vae_scale_factor(), 8);
    assert_eq!(
        (vae.latent_channels, vae.layers_per_block, vae.norm_num_groups),
        (16, 2, 32)
    );
    assert_eq!((vae.scaling_factor, vae.shift_factor), (0.3611, Some(0.1159)));
    assert!(!vae.use_quant_conv && !vae.use_post_quant_conv && vae.mid_block_add_attention);
    assert_eq!(vae.sample_size, SampleSize::Square(1024));
    assert_eq!(vae.act_fn, Activation::Silu);
    assert_eq!(vae.latents_mean, None);

    let clip: ClipTextConfig = parse(FLUX_CLIP);
    assert_eq!(
        (clip.hidden_size, clip.num_hidden_layers, clip.num_attention_heads),
        (768, 12, 12)
    );
    assert_eq!((clip.eos_token_id, clip.hidden_act), (2, Activation::QuickGelu));
    assert_eq!((clip.projection_dim, clip.head_dim()), (768, 64));

    let t5: T5Config = parse(FLUX_T5);
    assert!(t5.is_gated_act());
    assert_eq!(t5.dense_act_fn(), Activation::GeluNew);
    assert_eq!(
        (t5.d_model, t5.d_ff, t5.num_heads, t5.num_layers),
        (4096, 10240, 64, 24)
    );
    assert_eq!(t5.layer_norm_epsilon, 1e-6);
}

#[test]
fn sd3_clip_with_projection_configs_parse() {
    let clip_g = FLUX_CLIP
        .replace("\"CLIPTextModel\"", "\"CLIPTextModelWithProjection\"")
        .replace("\"quick_gelu\"", "\"gelu\"")
        .replace("\"projection_dim\": 768", "\"projection_dim\": 1280")
        .replace("\"eos_token_id\": 2", "\"eos_token_id\": 49407");
    let clip: ClipTextConfig = parse(&clip_g);
    assert_eq!(clip.architectures, vec!["CLIPTextModelWithProjection".to_string()]);
    assert_eq!(
        (clip.hidden_act, clip.projection_dim, clip.eos_token_id),
        (Activation::Gelu, 1280, 49407)
    );
}

#[test]
fn absent_keys_take_the_class_defaults() {
    assert_eq!(
        parse::<FluxTransformer2DConfig>("{}"),
        FluxTransformer2DConfig::default()
    );
    let vae: AutoencoderKLConfig = parse("{}");
    assert_eq!(
        (vae.block_out_channels.clone(), vae.latent_channels, vae.scaling_factor),
        (vec![64], 4, 0.18215)
    );
    assert!(vae.use_quant_conv && vae.use_post_quant_conv && vae.force_upcast);
    assert_eq!(vae.vae_scale_factor(), 1);
    let clip: ClipTextConfig = parse("{}");
    assert_eq!(
        (clip.hidden_size, clip.eos_token_id, clip.pad_token_id),
        (512, 49407, Some(1))
    );
    let t5: T5Config = parse("{}");
    assert_eq!(t5.feed_forward_proj, FeedForwardProj::default());
    assert!(!t5.is_gated_act());
    assert_eq!(t5.dense_act_fn(), Activation::Relu);
    let gated_silu: T5Config = parse(r#"{"feed_forward_proj": "gated-silu", "dense_act_fn": "relu"}"#);
    assert_eq!(
        (gated_silu.is_gated_act(), gated_silu.dense_act_fn()),
        (true, Activation::Silu)
    );
    let explicit: FluxTransformer2DConfig = parse(r#"{"out_channels": 16, "axes_dims_rope": [4, 6, 6]}"#);
    assert_eq!(
        (explicit.out_channels(), explicit.axes_dims_rope.clone()),
        (16, vec![4, 6, 6])
    );
    let rect: AutoencoderKLConfig = parse(r#"{"sample_size": [512, 768]}"#);
    assert_eq!(rect.sample_size, SampleSize::HeightWidth([512, 768]));
}

/// Checks every key the struct and the JSON share (values may differ in the hidden fixtures).
fn assert_same(json: &Value, fields: &[(&str, Value)]) {
    for (key, value) in fields {
        if let Some(in_file) = json.get(*key).filter(|v| !v.is_null()) {
            assert_eq!(in_file, value, "key {key}");
        }
    }
}

#[test]
fn every_fixture_config_parses() {
    let mut parsed = 0;
    for name in ["flux1_schnell", "flux1_dev", "flux1_dev_bf16"] {
        let root = pipeline(name);
        for component in ["text_encoder", "text_encoder_2", "transformer", "vae"] {
            let path = root.join(component).join("config.json");
            let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let n = |v: usize| Value::from(v);
            match component {
                "text_encoder" => {
                    let c: ClipTextConfig = load_config(&path).unwrap();
                    let fields = [
                        ("hidden_size", n(c.hidden_size)),
                        ("num_hidden_layers", n(c.num_hidden_layers)),
                        ("num_attention_heads", n(c.num_attention_heads)),
                        ("eos_token_id", Value::from(c.eos_token_id)),
                        ("hidden_act", Value::from(c.hidden_act.name())),
                        ("projection_dim", n(c.projection_dim)),
                    ];
                    assert_same(&json, &fields);
                }
                "text_encoder_2" => {
                    let c: T5Config = load_config(&path).unwrap();
                    let fields = [
                        ("d_model", n(c.d_model)),
                        ("d_ff", n(c.d_ff)),
                        ("num_heads", n(c.num_heads)),
                        ("num_layers", n(c.num_layers)),
                        ("is_gated_act", Value::from(c.is_gated_act())),
                        ("dense_act_fn", Value::from(c.dense_act_fn().name())),
                    ];
                    assert_same(&json, &fields);
                }
                "transformer" => {
                    let c: FluxTransformer2DConfig = load_config(&path).unwrap();
                    let fields = [
                        ("num_layers", n(c.num_layers)),
                        ("num_single_layers", n(c.num_single_layers)),
                        ("guidance_embeds", Value::from(c.guidance_embeds)),
                        ("axes_dims_rope", Value::from(c.axes_dims_rope.clone())),
                        ("joint_attention_dim", n(c.joint_attention_dim)),
                    ];
                    assert_same(&json, &fields);
                    assert_eq!(c.guidance_embeds, name != "flux1_schnell");
                }
                _ => {
                    let c: AutoencoderKLConfig = load_config(&path).unwrap();
                    let fields = [
                        ("block_out_channels", Value::from(c.block_out_channels.clone())),
                        ("scaling_factor", Value::from(c.scaling_factor)),
                        ("shift_factor", Value::from(c.shift_factor)),
                        ("use_post_quant_conv", Value::from(c.use_post_quant_conv)),
                        ("norm_num_groups", n(c.norm_num_groups)),
                    ];
                    assert_same(&json, &fields);
                }
            }
            parsed += 1;
        }
    }
    assert_eq!(parsed, 12);
}

// stabilityai/stable-diffusion-3.5-medium `transformer/config.json` (spec-sd3-flux2.md §A.1).
const SD35_MEDIUM_TRANSFORMER: &str = r#"{
  "_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.31.0.dev0",
  "attention_head_dim": 64, "caption_projection_dim": 1536,
  "dual_attention_layers": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
  "in_channels": 16, "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 24,
  "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
  "qk_norm": "rms_norm", "sample_size": 128 }"#;

#[test]
fn sd3_transformer_configs_parse() {
    let medium: SD3Transformer2DConfig = parse(SD35_MEDIUM_TRANSFORMER);
    assert_eq!((medium.inner_dim(), medium.out_channels()), (1536, 16));
    assert_eq!(medium.dual_attention_layers, (0..13).collect::<Vec<_>>());
    assert!(medium.is_dual_attention_layer(12) && !medium.is_dual_attention_layer(13));
    assert_eq!(medium.qk_norm.as_deref(), Some("rms_norm"));
    assert_eq!((medium.pos_embed_max_size, medium.sample_size), (384, 128));

    let defaults: SD3Transformer2DConfig = parse("{}");
    assert_eq!(defaults, SD3Transformer2DConfig::default());
    assert_eq!(
        (
            defaults.num_layers,
            defaults.inner_dim(),
            defaults.caption_projection_dim
        ),
        (18, 1152, 1152)
    );
    assert_eq!((defaults.pos_embed_max_size, defaults.out_channels()), (96, 16));
    assert!(defaults.dual_attention_layers.is_empty() && defaults.qk_norm.is_none());
    // `null` falls back to in_channels (diffusers: `out_channels if not None else in_channels`).
    let null_out: SD3Transformer2DConfig = parse(r#"{"in_channels": 8, "out_channels": null, "qk_norm": null}"#);
    assert_eq!((null_out.out_channels(), null_out.qk_norm), (8, None));

    let path = pipeline("sd3").join("transformer/config.json");
    let fixture: SD3Transformer2DConfig = load_config(&path).unwrap();
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let n = |v: usize| Value::from(v);
    let fields = [
        ("num_layers", n(fixture.num_layers)),
        ("num_attention_heads", n(fixture.num_attention_heads)),
        ("attention_head_dim", n(fixture.attention_head_dim)),
        ("caption_projection_dim", n(fixture.caption_projection_dim)),
        ("pos_embed_max_size", n(fixture.pos_embed_max_size)),
        (
            "dual_attention_layers",
            Value::from(fixture.dual_attention_layers.clone()),
        ),
        ("qk_norm", Value::from(fixture.qk_norm.clone())),
    ];
    assert_same(&json, &fields);
}

fn config_error<T: serde::de::DeserializeOwned + std::fmt::Debug>(json: &str) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write(dir.path(), "config.json", json.as_bytes());
    let err = load_config::<T>(&path).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    let IoError::Config { key, message, .. } = err else {
        panic!("{msg}")
    };
    (key, message)
}

#[test]
fn wrong_types_and_bad_values_name_file_and_key() {
    let (key, msg) = config_error::<FluxTransformer2DConfig>(r#"{"num_layers": "19"}"#);
    assert_eq!(key, "num_layers");
    assert!(msg.contains("invalid type: string"), "{msg}");
    let (key, _) = config_error::<FluxTransformer2DConfig>(r#"{"guidance_embeds": 1}"#);
    assert_eq!(key, "guidance_embeds");
    let (key, _) = config_error::<FluxTransformer2DConfig>(r#"{"num_layers": -1}"#);
    assert_eq!(key, "num_layers");
    let (key, _) = config_error::<AutoencoderKLConfig>(r#"{"block_out_channels": [128, "x"]}"#);
    assert!(key.starts_with("block_out_channels"), "{key}");
    let (key, _) = config_error::<AutoencoderKLConfig>(r#"{"scaling_factor": null}"#);
    assert_eq!(key, "scaling_factor");
    let (key, msg) = config_error::<ClipTextConfig>(r#"{"hidden_act": "mish"}"#);
    assert_eq!(key, "hidden_act");
    assert!(
        msg.contains("unknown activation `mish`") && msg.contains("quick_gelu"),
        "{msg}"
    );
    let (key, msg) = config_error::<T5Config>(r#"{"feed_forward_proj": "gated-gelu-x"}"#);
    assert_eq!(key, "feed_forward_proj");
    assert!(msg.contains("gated-{ACT_FN}"), "{msg}");
    let (key, _) = config_error::<T5Config>(r#"{"feed_forward_proj": "swiglu"}"#);
    assert_eq!(key, "feed_forward_proj");
    let (key, msg) = config_error::<T5Config>(r#"{"d_model": 4096,"#);
    assert_eq!(key, ".");
    assert!(msg.contains("line 1"), "{msg}");
    let (key, _) = config_error::<T5Config>(r#"[]"#);
    assert_eq!(key, ".");
    let (key, msg) = config_error::<T5Config>(r#"{} {}"#);
    assert_eq!(key, ".");
    assert!(msg.contains("trailing"), "{msg}");
    let (key, msg) = config_error::<SD3Transformer2DConfig>(r#"{"qk_norm": "rms"}"#);
    assert_eq!(key, "qk_norm");
    assert!(
        msg.contains("unknown qk_norm `rms`") && msg.contains("rms_norm"),
        "{msg}"
    );
    let (key, _) = config_error::<SD3Transformer2DConfig>(r#"{"pos_embed_max_size": null}"#);
    assert_eq!(key, "pos_embed_max_size");
    let (key, _) = config_error::<SD3Transformer2DConfig>(r#"{"dual_attention_layers": [0, -1]}"#);
    assert!(key.starts_with("dual_attention_layers"), "{key}");
    let err = load_config::<T5Config>("/nonexistent/config.json").unwrap_err();
    assert!(matches!(err, IoError::Read { .. }));
}

#[test]
fn a_missing_required_key_is_named() {
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Required {
        outer: Inner,
    }
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        needed: u32,
    }
    let (key, msg) = config_error::<Required>(r#"{}"#);
    assert_eq!((key.as_str(), msg.contains("missing field `outer`")), ("outer", true));
    let (key, _) = config_error::<Required>(r#"{"outer": {}}"#);
    assert_eq!(key, "outer.needed");
}
