//! Model folders: `model_index.json` and resolving repo ids in fake Hugging Face caches.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::pipeline;
use kiln_io::{resolve_model_with, HfCacheEnv, IoError, ModelIndex};

const FLUX_COMPONENTS: [(&str, &str); 7] = [
    ("scheduler", "FlowMatchEulerDiscreteScheduler"),
    ("text_encoder", "CLIPTextModel"),
    ("text_encoder_2", "T5EncoderModel"),
    ("tokenizer", "CLIPTokenizer"),
    ("tokenizer_2", "T5TokenizerFast"),
    ("transformer", "FluxTransformer2DModel"),
    ("vae", "AutoencoderKL"),
];

#[test]
fn fixture_model_indexes_parse() {
    for name in ["flux1_schnell", "flux1_dev", "flux1_dev_bf16"] {
        let index = ModelIndex::load(pipeline(name)).unwrap();
        assert_eq!(index.require_pipeline(&["FluxPipeline"]).unwrap(), "FluxPipeline");
        assert!(index.diffusers_version.is_some());
        for (component, class) in FLUX_COMPONENTS {
            let spec = index.require_component(component, &[class]).unwrap();
            assert_eq!(spec.class, class);
            assert!(spec.library == "diffusers" || spec.library == "transformers");
        }
        // `[null, null]` entries are absent components.
        assert!(index.components.contains_key("image_encoder"));
        assert_eq!(index.component("image_encoder"), None);
        assert_eq!(
            index
                .optional_component("image_encoder", &["CLIPVisionModelWithProjection"])
                .unwrap(),
            None
        );
        assert_eq!(index.components.len(), 9);
    }
}

#[test]
fn unsupported_classes_list_what_is_supported() {
    let index = ModelIndex::load(pipeline("flux1_dev")).unwrap();
    let err = index
        .require_pipeline(&["StableDiffusion3Pipeline", "Flux2Pipeline"])
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, IoError::UnsupportedPipeline { ref class, .. } if class == "FluxPipeline"));
    assert!(
        msg.contains("StableDiffusion3Pipeline, Flux2Pipeline") && msg.contains("model_index.json"),
        "{msg}"
    );

    let err = index.require_component("vae", &["AutoencoderKLFlux2"]).unwrap_err();
    assert!(matches!(&err, IoError::UnsupportedComponent { component, class, .. }
        if component == "vae" && class == "AutoencoderKL"));
    assert!(err.to_string().contains("AutoencoderKLFlux2"));
    let err = index
        .optional_component("text_encoder", &["CLIPTextModelWithProjection"])
        .unwrap_err();
    assert!(matches!(err, IoError::UnsupportedComponent { .. }));

    for missing in ["image_encoder", "text_encoder_3"] {
        let err = index.require_component(missing, &["X"]).unwrap_err();
        assert!(matches!(&err, IoError::MissingComponent { component, .. } if component == missing));
    }
}

#[test]
fn model_index_errors_name_file_and_key() {
    let parse = |text: &str| ModelIndex::parse(Path::new("/m/model_index.json"), text.as_bytes());
    let ok = parse(
        r#"{"_class_name": "FluxPipeline", "force_zeros_for_empty_prompt": true,
                       "vae": ["diffusers", "AutoencoderKL"], "_name_or_path": "x"}"#,
    )
    .unwrap();
    assert_eq!(ok.options.len(), 2);
    assert_eq!(ok.diffusers_version, None);
    assert!(ok.bool_option("force_zeros_for_empty_prompt", false).unwrap());
    assert!(ok.bool_option("is_distilled", true).unwrap());
    assert!(!ok.bool_option("is_distilled", false).unwrap());
    let bad = parse(r#"{"_class_name": "Flux2KleinPipeline", "is_distilled": "yes"}"#).unwrap();
    let err = bad.bool_option("is_distilled", false).unwrap_err().to_string();
    assert!(err.contains("is_distilled") && err.contains("true or false"), "{err}");
    let cases = [
        (r#"{"vae": ["diffusers", "AutoencoderKL"]}"#, "_class_name"),
        (r#"{"_class_name": 3}"#, "_class_name"),
        (r#"{"_class_name": "P", "vae": ["diffusers"]}"#, "vae"),
        (r#"{"_class_name": "P", "vae": ["diffusers", null]}"#, "vae"),
        (r#"{"_class_name": "P", "vae": [1, 2]}"#, "vae"),
        (
            r#"{"_class_name": "P", "vae": [null, null], "vae": [null, null]}"#,
            "vae",
        ),
        (r#"{"_class_name": "P""#, "."),
        (r#"["_class_name"]"#, "."),
    ];
    for (text, want_key) in cases {
        let err = parse(text).unwrap_err();
        assert!(err.to_string().contains("/m/model_index.json"), "{err}");
        let IoError::Config { key, .. } = &err else {
            panic!("{text}: {err}")
        };
        assert_eq!(key, want_key, "{text}");
    }
    let err = ModelIndex::load("/nonexistent-kiln-folder").unwrap_err();
    assert!(matches!(err, IoError::Read { .. }));
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A fake cache with `org/flux` at `main` and tag `v1`, and `org/broken` whose ref points nowhere.
fn fake_cache(root: &Path) -> PathBuf {
    let repo = root.join("models--org--flux");
    fs::create_dir_all(repo.join("snapshots").join(COMMIT)).unwrap();
    fs::create_dir_all(repo.join("snapshots").join("feedbeef")).unwrap();
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs").join("main"), format!("{COMMIT}\n")).unwrap();
    fs::write(repo.join("refs").join("v1"), "feedbeef").unwrap();
    let broken = root.join("models--org--broken");
    fs::create_dir_all(broken.join("refs")).unwrap();
    fs::write(broken.join("refs").join("main"), "deadbeef").unwrap();
    repo
}

#[test]
fn repo_ids_resolve_offline_in_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let repo = fake_cache(dir.path());
    let env = HfCacheEnv::with_hub_cache(dir.path());
    let main = resolve_model_with("org/flux", None, &env).unwrap();
    assert_eq!(main, repo.join("snapshots").join(COMMIT));
    assert_eq!(resolve_model_with("org/flux", Some("main"), &env).unwrap(), main);
    let v1 = resolve_model_with("org/flux", Some("v1"), &env).unwrap();
    assert_eq!(v1, repo.join("snapshots").join("feedbeef"));
    // A commit hash with a snapshot folder needs no ref.
    assert_eq!(resolve_model_with("org/flux", Some(COMMIT), &env).unwrap(), main);
    // An existing folder is used as is, even when it looks like a repo id.
    let local = pipeline("flux1_dev");
    assert_eq!(resolve_model_with(local.to_str().unwrap(), None, &env).unwrap(), local);
}

#[test]
fn missing_repos_say_where_kiln_looked_and_how_to_download() {
    let dir = tempfile::tempdir().unwrap();
    let repo = fake_cache(dir.path());
    let env = HfCacheEnv::with_hub_cache(dir.path());
    let cases: [(&str, Option<&str>, Vec<PathBuf>); 4] = [
        (
            "org/absent",
            None,
            vec![dir.path().join("models--org--absent/refs/main")],
        ),
        (
            "org/broken",
            None,
            vec![dir.path().join("models--org--broken/snapshots/deadbeef")],
        ),
        ("org/flux", Some("v2"), vec![repo.join("refs/v2")]),
        (
            "org/flux",
            Some(&"f".repeat(40)),
            vec![repo.join("snapshots").join("f".repeat(40))],
        ),
    ];
    for (id, revision, expected_paths) in cases {
        let err = resolve_model_with(id, revision, &env).unwrap_err();
        let msg = err.to_string();
        let IoError::NotInCache { repo: r, looked_in, .. } = &err else {
            panic!("{msg}")
        };
        assert_eq!(r, id);
        assert_eq!(looked_in[0], PathBuf::from(id), "the local folder comes first");
        for path in expected_paths {
            assert!(looked_in.contains(&path), "{path:?} not in {looked_in:?}");
            assert!(msg.contains(&path.display().to_string()), "{msg}");
        }
        assert!(msg.contains(&format!("huggingface-cli download {id}")), "{msg}");
    }
    let err = resolve_model_with("org/flux", Some("v2"), &env).unwrap_err();
    assert!(err.to_string().contains("--revision v2"), "{err}");
    // A revision cannot climb out of the repo folder.
    for revision in ["../../etc", "/abs", ""] {
        let err = resolve_model_with("org/flux", Some(revision), &env).unwrap_err();
        assert!(matches!(err, IoError::NotInCache { .. }), "{revision}: {err}");
    }
    // Not a folder and not a repo id.
    for spec in ["./missing/model", "missing", "a/b/c", "org/../x", "org--x/y"] {
        let err = resolve_model_with(spec, None, &env).unwrap_err();
        assert!(matches!(err, IoError::ModelNotFound { .. }), "{spec}: {err}");
        assert!(err.to_string().contains("ORG/NAME"));
    }
    let file = dir.path().join("file.txt");
    fs::write(&file, "x").unwrap();
    let err = resolve_model_with(file.to_str().unwrap(), None, &env).unwrap_err();
    assert!(err.to_string().contains("it is a file"), "{err}");
    // No cache location at all.
    let err = resolve_model_with("org/flux", None, &HfCacheEnv::default()).unwrap_err();
    assert!(matches!(err, IoError::NotInCache { ref looked_in, .. } if looked_in.len() == 1));
}

#[test]
fn the_cache_location_follows_huggingface_hub() {
    let p = |s: &str| Some(PathBuf::from(s));
    let full = HfCacheEnv {
        hf_hub_cache: p("/a"),
        huggingface_hub_cache: p("/b"),
        hf_home: p("/c"),
        xdg_cache_home: p("/d"),
        home: p("/home/u"),
    };
    assert_eq!(full.hub_cache(), p("/a"));
    let legacy = HfCacheEnv {
        hf_hub_cache: None,
        ..full.clone()
    };
    assert_eq!(legacy.hub_cache(), p("/b"));
    let hf_home = HfCacheEnv {
        huggingface_hub_cache: None,
        ..legacy.clone()
    };
    assert_eq!(hf_home.hub_cache(), p("/c/hub"));
    let xdg = HfCacheEnv {
        hf_home: None,
        ..hf_home.clone()
    };
    assert_eq!(xdg.hub_cache(), p("/d/huggingface/hub"));
    let home = HfCacheEnv {
        xdg_cache_home: None,
        ..xdg.clone()
    };
    assert_eq!(home.hub_cache(), p("/home/u/.cache/huggingface/hub"));
    let tilde = HfCacheEnv {
        hf_home: p("~/hf"),
        ..home.clone()
    };
    assert_eq!(tilde.hub_cache(), p("/home/u/hf/hub"));
    assert_eq!(HfCacheEnv::default().hub_cache(), None);

    // Resolution goes through HF_HOME the same way.
    let dir = tempfile::tempdir().unwrap();
    fake_cache(&dir.path().join("hub"));
    let env = HfCacheEnv {
        hf_home: Some(dir.path().to_path_buf()),
        ..HfCacheEnv::default()
    };
    let found = resolve_model_with("org/flux", None, &env).unwrap();
    assert!(found.starts_with(dir.path().join("hub/models--org--flux/snapshots")));
}
