//! FLUX.2 configs: the real FLUX.2 [dev] values, the fixture folders, class defaults and errors.

mod common;

use std::path::Path;

use common::pipeline;
use kiln_io::config::SampleSize;
use kiln_io::{load_config, parse_config, Activation, AutoencoderKLFlux2Config, Flux2TransformerConfig, IoError};

fn parse<T: serde::de::DeserializeOwned>(json: &str) -> T {
    parse_config(Path::new("config.json"), json).unwrap()
}

// black-forest-labs/FLUX.2-dev `transformer/config.json` (spec-sd3-flux2.md §B.1).
const DEV_TRANSFORMER: &str = r#"{
  "_class_name": "Flux2Transformer2DModel", "_diffusers_version": "0.36.0.dev0",
  "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32], "eps": 1e-06,
  "in_channels": 128, "joint_attention_dim": 15360, "mlp_ratio": 3.0, "num_attention_heads": 48,
  "num_layers": 8, "num_single_layers": 48, "out_channels": null, "patch_size": 1,
  "rope_theta": 2000, "timestep_guidance_channels": 256 }"#;

#[test]
fn the_dev_transformer_config_is_the_class_default() {
    let dev: Flux2TransformerConfig = parse(DEV_TRANSFORMER);
    assert_eq!(dev, Flux2TransformerConfig::default());
    assert_eq!(
        (dev.inner_dim(), dev.mlp_hidden_dim(), dev.out_channels()),
        (6144, 18432, 128)
    );
    assert!(dev.guidance_embeds);
    assert_eq!(dev.rope_theta, 2000.0);
    // klein: 24 heads, 5 + 20 blocks, no guidance embedder.
    let klein: Flux2TransformerConfig = parse(
        r#"{"num_attention_heads": 24, "num_layers": 5, "num_single_layers": 20,
            "joint_attention_dim": 7680, "guidance_embeds": false}"#,
    );
    assert_eq!((klein.inner_dim(), klein.mlp_hidden_dim()), (3072, 9216));
    assert!(!klein.guidance_embeds);
    let odd: Flux2TransformerConfig = parse(r#"{"num_attention_heads": 1, "attention_head_dim": 5, "mlp_ratio": 2.5}"#);
    assert_eq!(odd.mlp_hidden_dim(), 12, "int(5 · 2.5) truncates");
    assert_eq!(
        parse::<Flux2TransformerConfig>(r#"{"out_channels": 0}"#).out_channels(),
        128
    );
}

#[test]
fn the_vae_defaults_are_flux2_dev() {
    let vae: AutoencoderKLFlux2Config = parse("{}");
    assert_eq!(vae.block_out_channels, vec![128, 256, 512, 512]);
    assert_eq!(
        (vae.latent_channels, vae.layers_per_block, vae.norm_num_groups),
        (32, 2, 32)
    );
    assert_eq!(
        (vae.batch_norm_eps, vae.patch_size, vae.bn_channels()),
        (1e-4, [2, 2], 128)
    );
    assert_eq!(vae.sample_size, SampleSize::Square(1024));
    assert_eq!(vae.vae_scale_factor(), 8);
    assert!(vae.use_quant_conv && vae.use_post_quant_conv && vae.mid_block_add_attention);
    assert_eq!(vae.decoder_block_out_channels, None);
    let kl = vae.autoencoder_kl();
    assert_eq!(
        (
            kl.block_out_channels.clone(),
            kl.latent_channels,
            kl.act_fn,
            kl.down_block_types.len()
        ),
        (vec![128, 256, 512, 512], 32, Activation::Silu, 4)
    );
    assert!(kl.use_quant_conv && kl.use_post_quant_conv);
}

#[test]
fn the_fixture_configs_parse() {
    let root = pipeline("flux2_dev");
    let t: Flux2TransformerConfig = load_config(root.join("transformer/config.json")).unwrap();
    assert_eq!(
        (t.num_attention_heads, t.attention_head_dim, t.in_channels),
        (2, 16, 128)
    );
    assert_eq!((t.num_layers, t.num_single_layers, t.joint_attention_dim), (2, 2, 48));
    assert_eq!(t.axes_dims_rope, vec![4, 4, 4, 4]);
    assert!(t.guidance_embeds);
    let v: AutoencoderKLFlux2Config = load_config(root.join("vae/config.json")).unwrap();
    assert_eq!((v.block_out_channels.clone(), v.latent_channels), (vec![16, 32], 32));
    assert_eq!((v.norm_num_groups, v.layers_per_block, v.bn_channels()), (8, 1, 128));
    assert_eq!(v.vae_scale_factor(), 2);
}

#[test]
fn bad_values_name_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    for (json, want) in [
        (r#"{"rope_theta": "2000"}"#, "rope_theta"),
        (r#"{"guidance_embeds": 1}"#, "guidance_embeds"),
        (r#"{"axes_dims_rope": [32, -1]}"#, "axes_dims_rope"),
    ] {
        let path = common::write(dir.path(), "config.json", json.as_bytes());
        let err = load_config::<Flux2TransformerConfig>(&path).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        let IoError::Config { key, .. } = err else {
            panic!("{msg}")
        };
        assert!(key.starts_with(want), "{key} for {json}");
    }
    for (json, want) in [
        (r#"{"patch_size": [2]}"#, "patch_size"),
        (r#"{"batch_norm_eps": null}"#, "batch_norm_eps"),
        (r#"{"act_fn": "mish"}"#, "act_fn"),
    ] {
        let path = common::write(dir.path(), "config.json", json.as_bytes());
        let err = load_config::<AutoencoderKLFlux2Config>(&path).unwrap_err();
        let msg = err.to_string();
        let IoError::Config { key, .. } = err else {
            panic!("{msg}")
        };
        assert!(key.starts_with(want), "{key} for {json}");
    }
}

// Qwen/Qwen3-4B `config.json` (the FLUX.2 [klein] 4B text encoder), keys that differ from the
// class defaults.
const QWEN3_4B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "bos_token_id": 151643,
  "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
  "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36,
  "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
  "sliding_window": null, "tie_word_embeddings": true, "use_sliding_window": false,
  "vocab_size": 151936 }"#;

#[test]
fn qwen3_configs_parse_old_and_new_layouts() {
    let real: kiln_io::Qwen3Config = parse(QWEN3_4B);
    assert_eq!(
        (real.hidden_size, real.num_hidden_layers, real.head_dim()),
        (2560, 36, 128)
    );
    assert_eq!((real.num_attention_heads, real.num_key_value_heads), (32, 8));
    assert_eq!((real.rope_theta(), real.rope_type()), (1e6, "default"));
    assert!(real.tie_word_embeddings && !real.attention_bias);
    assert_eq!(real.layer_window(35), None);
    assert_eq!(real.hidden_act, Activation::Silu);

    let fixture: kiln_io::Qwen3Config = load_config(pipeline("flux2_klein").join("text_encoder/config.json")).unwrap();
    assert_eq!(
        (fixture.hidden_size, fixture.num_hidden_layers, fixture.head_dim()),
        (16, 28, 8)
    );
    assert_eq!((fixture.num_attention_heads, fixture.num_key_value_heads), (2, 1));
    assert_eq!((fixture.rope_theta(), fixture.rms_norm_eps), (1e6, 1e-6));
    assert_eq!(fixture.layer_types.as_ref().map(Vec::len), Some(28));
    assert_eq!(fixture.layer_window(27), None);

    // Sliding layers: from layer_types, else from max_window_layers with use_sliding_window.
    let sliding: kiln_io::Qwen3Config =
        parse(r#"{"use_sliding_window": true, "max_window_layers": 2, "sliding_window": 16}"#);
    assert_eq!((sliding.layer_window(1), sliding.layer_window(2)), (None, Some(16)));
    let typed: kiln_io::Qwen3Config =
        parse(r#"{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}"#);
    assert_eq!((typed.layer_window(0), typed.layer_window(1)), (Some(8), None));
}
