//! Z-Image LoRA and LoKr files, as diffusers 0.42.1's `ZImageLoraLoaderMixin` reads them
//! (`lora_state_dict`, `_convert_non_diffusers_z_image_lora_to_diffusers`,
//! `_convert_non_diffusers_lokr_to_diffusers`, then peft through `load_lora_adapter`).
//!
//! The mixin adapts the transformer only (`_lora_loadable_modules = ["transformer"]`): keys of
//! other components (`text_encoder.…`, kohya `lora_te_…`) are dropped. A file goes through the
//! non-diffusers converter when any key ends in `.alpha`, starts with `lora_unet_` or
//! `diffusion_model.`, or holds `default.`; else its `transformer.` keys are read as they are.
//! The converter:
//! - strips `diffusion_model.` and `lora_unet_`; kohya names (`layers_0_attention_to_q`) become
//!   dotted, `to_q`/`to_k`/`to_v`/`to_out`/`feed_forward` kept whole, then `context_refiner`,
//!   `noise_refiner`, `adaLN_modulation`, `all_final_layer`, `all_x_embedder`, `cap_embedder`,
//!   `t_embedder` restored;
//! - reads the original checkpoint's `attention.out` as `attention.to_out.0` and (in the
//!   dot-separated `.lora.down.weight` form every kohya key takes there) splits the fused
//!   `attention.qkv` into `to_q`/`to_k`/`to_v` (B in three equal row blocks, A shared); either is
//!   dropped next to the split modules it duplicates, as is Anime-Z's `to.q` spelling normalised;
//! - folds `.alpha` into the factors as α/r (r: rows of A).
//!
//! kiln resolves every key by its module name with dots and underscores alike, so it reads all
//! of these. Where diffusers drops a module kiln applies (the fused `qkv` outside the kohya form,
//! a misspelt separator, `transformer.<name>.lora_down.weight`, unprefixed names without an
//! `.alpha` key, which `load_lora_adapter` finds no `transformer.` key in), its name is listed in
//! [`LoraFile::beyond_diffusers`]. Files diffusers fails on for their layout are errors:
//! `transformer.`-prefixed keys in a file the converter runs on (`.alpha` keys, `default.` names:
//! it prefixes `transformer.` again, and peft finds no target module).
//!
//! LoKr (`<module>.lokr_w1`, `lokr_w1_a`/`lokr_w1_b`, `lokr_w2`, `lokr_w2_a`/`lokr_w2_b`; ai-toolkit's
//! `diffusion_model.` names or peft's `transformer.` ones) changes a weight by
//! `scale · kron(W1, W2)` (`W = w` or `w_a @ w_b`), `scale` = α/r when an `.alpha` key is given
//! and a factor is rank-decomposed (r: rows of `lokr_w2_b`, else of `lokr_w1_b`), else 1, as
//! `_bake_lokr_alpha_` folds it (diffusers then gives peft `alpha = r`). A LoKr header
//! `lora_adapter_metadata` (peft's `LoKrConfig`) and CP-decomposed (`lokr_t2`) factors are
//! refused. kiln applies the product for any factor shapes; diffusers refuses files whose
//! factorisation peft's `decompose_factor` cannot reproduce.

use std::collections::{BTreeMap, BTreeSet};

use super::{
    match_template, Classified, Kron, LoraError, LoraFile, LoraFormat, LoraModule, Naming, Part, Reader, SplitKind,
    Target, MAX_MODULE_ELEMENTS, METADATA_KEY,
};

/// The block lists of `ZImageTransformer2DModel`, and whether their blocks are modulated
/// (`adaLN_modulation.0`).
const BLOCK_LISTS: [(&str, bool); 3] = [("noise_refiner", true), ("context_refiner", false), ("layers", true)];

/// The Linears of a block, inside `<list>.<i>.`.
const BLOCK_LINEARS: [&str; 8] = [
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
    "adaLN_modulation.0",
];

/// Linears outside the blocks with fixed names.
const FIXED_LINEARS: [&str; 3] = ["t_embedder.mlp.0", "t_embedder.mlp.2", "cap_embedder.1"];

/// Linears of the `ModuleDict`s keyed by `<patch_size>-<f_patch_size>`: `<dict>.<key><tail>`.
const PATCH_LINEARS: [(&str, &str); 3] = [
    ("all_x_embedder", ""),
    ("all_final_layer", ".linear"),
    ("all_final_layer", ".adaLN_modulation.1"),
];

/// The suffixes of a Z-Image LoRA key (`default.` already removed).
const SUFFIXES: &[(&str, Part)] = &[
    (".lora_A.weight", Part::Down),
    (".lora_B.weight", Part::Up),
    (".lora_down.weight", Part::Down),
    (".lora_up.weight", Part::Up),
    (".lora.down.weight", Part::Down),
    (".lora.up.weight", Part::Up),
    (".alpha", Part::Alpha),
];

/// The suffixes of a LoKr key.
const LOKR_SUFFIXES: [&str; 8] = [
    ".lokr_w1_a",
    ".lokr_w1_b",
    ".lokr_w2_a",
    ".lokr_w2_b",
    ".lokr_w1",
    ".lokr_w2",
    ".lokr_t2",
    ".alpha",
];

fn underscored(name: &str) -> String {
    name.replace('.', "_")
}

fn is_patch_key(key: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit());
    key.split_once('-').is_some_and(|(p, f)| digits(p) && digits(f))
}

/// What the module `name` of the Z-Image transformer adapts, read with dots and underscores
/// alike (diffusers' dotted names, kohya's underscored ones, Anime-Z's `to.q`): diffusers' Linear,
/// or the original checkpoint's fused `attention.qkv` (split) and `attention.out` (`to_out.0`);
/// the flag says it is one of these original names.
pub(super) fn resolve_name(name: &str) -> Option<(Target, bool)> {
    let c = underscored(name);
    if let Some(f) = FIXED_LINEARS.iter().find(|f| underscored(f) == c) {
        return Some((Target::One(f.to_string()), false));
    }
    for (dict, tail) in PATCH_LINEARS {
        let key = c
            .strip_prefix(dict)
            .and_then(|r| r.strip_prefix('_'))
            .and_then(|r| r.strip_suffix(underscored(tail).as_str()));
        if let Some(key) = key.filter(|k| is_patch_key(k)) {
            return Some((Target::One(format!("{dict}.{key}{tail}")), false));
        }
    }
    for (list, modulated) in BLOCK_LISTS {
        let Some(rest) = c.strip_prefix(list).and_then(|r| r.strip_prefix('_')) else {
            continue;
        };
        let Some(Some(index)) = rest
            .split_once('_')
            .and_then(|(digits, _)| match_template("{i}", digits))
        else {
            continue;
        };
        let sub = &rest[rest.find('_').unwrap_or(0) + 1..];
        let block = format!("{list}.{index}");
        if let Some(linear) = BLOCK_LINEARS
            .iter()
            .filter(|l| modulated || !l.starts_with("adaLN"))
            .find(|l| underscored(l) == sub)
        {
            return Some((Target::One(format!("{block}.{linear}")), false));
        }
        match sub {
            "attention_qkv" => {
                return Some((
                    Target::Split(
                        ["to_q", "to_k", "to_v"]
                            .iter()
                            .map(|p| format!("{block}.attention.{p}"))
                            .collect(),
                        SplitKind::Qkv,
                    ),
                    true,
                ))
            }
            "attention_out" => return Some((Target::One(format!("{block}.attention.to_out.0")), true)),
            _ => {}
        }
    }
    None
}

/// Whether `module` is the diffusers name of a Linear of the Z-Image transformer.
pub(super) fn is_linear(module: &str) -> bool {
    exact(module).is_some()
}

/// The Linear `name` names exactly (peft's target), if any.
fn exact(name: &str) -> Option<Target> {
    match resolve_name(name) {
        Some((Target::One(m), false)) if m == name => Some(Target::One(m)),
        _ => None,
    }
}

/// The name a group of keys is kept under: the module it adapts (`<block>.attention.qkv` for a
/// fused one).
fn group_name(target: &Target) -> String {
    match target {
        Target::One(m) | Target::SwapHalves(m) => m.clone(),
        Target::Split(ms, _) => {
            let first = &ms[0];
            let block = first.strip_suffix(".to_q").unwrap_or(first);
            format!("{block}.qkv")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// diffusers' key conversion, to tell where diffusers puts each module.

/// What decides diffusers' reading of a file.
struct Flags {
    /// A key starts with `diffusion_model.`.
    diffusion_model: bool,
    /// A key starts with `lora_unet_` (as `lora_state_dict` checks it).
    lora_unet: bool,
    /// After `diffusion_model.` is stripped (as the converter checks it).
    lora_unet_stripped: bool,
    /// A key ends in `.alpha`.
    alpha: bool,
    /// A key holds `default.`.
    default: bool,
}

impl Flags {
    fn of(keys: &[&String]) -> Flags {
        let diffusion_model = keys.iter().any(|k| k.starts_with("diffusion_model."));
        let strip = |k: &str| -> String {
            match diffusion_model {
                true => k.strip_prefix("diffusion_model.").unwrap_or(k).to_string(),
                false => k.to_string(),
            }
        };
        Flags {
            diffusion_model,
            lora_unet: keys.iter().any(|k| k.starts_with("lora_unet_")),
            lora_unet_stripped: keys.iter().any(|k| strip(k).starts_with("lora_unet_")),
            alpha: keys.iter().any(|k| k.ends_with(".alpha")),
            default: keys.iter().any(|k| k.contains("default.")),
        }
    }

    /// `lora_state_dict` runs `_convert_non_diffusers_z_image_lora_to_diffusers`.
    fn converted(&self) -> bool {
        self.alpha || self.lora_unet || self.diffusion_model || self.default
    }

    /// The converter's renaming of `key` (before its pair handling).
    fn rewrite(&self, key: &str) -> String {
        let mut k = match self.diffusion_model {
            true => key.strip_prefix("diffusion_model.").unwrap_or(key).to_string(),
            false => key.to_string(),
        };
        if self.lora_unet_stripped {
            k = convert_kohya_key(k.strip_prefix("lora_unet_").unwrap_or(&k));
        }
        k = normalize_out_key(&k);
        // (`has_default` is checked on the renamed keys, which keep every `default.`.)
        if self.default {
            k = k.replace("default.", "");
        }
        const FIXUPS: [(&str, &str); 7] = [
            ("context.refiner.", "context_refiner."),
            ("noise.refiner.", "noise_refiner."),
            ("adaLN.modulation.", "adaLN_modulation."),
            ("all.final.layer.", "all_final_layer."),
            ("all.x.embedder.", "all_x_embedder."),
            ("cap.embedder.", "cap_embedder."),
            ("t.embedder.", "t_embedder."),
        ];
        for (dotted, underscored) in FIXUPS {
            k = k.replace(dotted, underscored);
        }
        k
    }
}

/// The converter's `convert_key`: every `_` of the name before the last `.` becomes a `.`,
/// except inside `to_q`, `to_k`, `to_v`, `to_out` and `feed_forward`.
fn convert_kohya_key(key: &str) -> String {
    const PROTECTED: [(&str, &str); 5] = [
        ("to", "q"),
        ("to", "k"),
        ("to", "v"),
        ("to", "out"),
        ("feed", "forward"),
    ];
    let (base, suffix) = key.rsplit_once('.').unwrap_or((key, ""));
    let parts: Vec<&str> = base.split('_').collect();
    let mut merged = Vec::with_capacity(parts.len());
    let mut i = 0;
    while i < parts.len() {
        if i + 1 < parts.len() && PROTECTED.contains(&(parts[i], parts[i + 1])) {
            merged.push(format!("{}_{}", parts[i], parts[i + 1]));
            i += 2;
        } else {
            merged.push(parts[i].to_string());
            i += 1;
        }
    }
    let converted = merged.join(".");
    match suffix {
        "" => converted,
        s => format!("{converted}.{s}"),
    }
}

/// The converter's `normalize_out_key`: `<block>.out.lora_down.weight` (`lora_up`, `.alpha`)
/// becomes `<block>.to_out.0.…` in a key without `.to_out`.
fn normalize_out_key(k: &str) -> String {
    if k.contains(".to_out") {
        return k.to_string();
    }
    for tail in [".lora_down.weight", ".lora_up.weight", ".alpha"] {
        if let Some(block) = k.strip_suffix(tail).and_then(|h| h.strip_suffix(".out")) {
            return format!("{block}.to_out.0{tail}");
        }
    }
    k.to_string()
}

/// The converted file as diffusers pairs it.
struct Converted {
    /// Some key has `.lora_down.weight` / `.lora_up.weight` (then only those pairs are read).
    kohya_suffixes: bool,
    /// Every `.lora.down.weight` key.
    dotted: BTreeSet<String>,
}

impl Converted {
    fn of(rewritten: &[String]) -> Self {
        let has = |s: &[&str]| rewritten.iter().any(|k| s.iter().any(|x| k.contains(x)));
        Converted {
            kohya_suffixes: has(&[".lora_down.weight", ".lora_up.weight"]),
            dotted: rewritten
                .iter()
                .filter(|k| k.contains(".lora.down.weight"))
                .cloned()
                .collect(),
        }
    }

    /// Where diffusers applies the pair whose down (A) key it renamed to `k`; `None`: nowhere.
    fn target(&self, k: &str) -> Option<Target> {
        const DOT: &str = ".lora.down.weight";
        if let Some(stem) = k.strip_suffix(".lora_down.weight") {
            return exact(stem);
        }
        if let Some(stem) = k.strip_suffix(".lora_A.weight") {
            return if self.kohya_suffixes { None } else { exact(stem) };
        }
        let base = k.strip_suffix(DOT)?;
        if let Some(block) = base.strip_suffix(".qkv") {
            let split = ["q", "k", "v"].iter().any(|p| {
                self.dotted.contains(&format!("{block}.to.{p}{DOT}"))
                    || self.dotted.contains(&format!("{block}.to_{p}{DOT}"))
            });
            if split {
                return None;
            }
            let modules: Vec<String> = ["to_q", "to_k", "to_v"]
                .iter()
                .map(|p| format!("{block}.{p}"))
                .collect();
            return modules
                .iter()
                .all(|m| exact(m).is_some())
                .then_some(Target::Split(modules, SplitKind::Qkv));
        }
        if let Some(block) = base.strip_suffix(".out").filter(|_| !base.contains(".to_out")) {
            if self.dotted.contains(&format!("{block}.to_out.0{DOT}")) {
                return None;
            }
            return exact(&format!("{block}.to_out.0"));
        }
        let normalized = match base.len().checked_sub(5).map(|i| base.split_at(i)) {
            Some((head, tail)) if matches!(tail, ".to.q" | ".to.k" | ".to.v") => {
                format!("{head}.to_{}", &tail[4..])
            }
            _ => base.to_string(),
        };
        exact(&normalized)
    }
}

// ---------------------------------------------------------------------------------------------
// Reading.

impl Reader<'_> {
    /// The keys of a Z-Image LoRA file in groups (see the module docs).
    pub(super) fn classify_zimage(&self, keys: &[String]) -> Result<Classified, LoraError> {
        let mut c = Classified::new(LoraFormat::Peft);
        let keys: Vec<&String> = keys.iter().filter(|k| !c.ignore_dora_scale(k)).collect();
        let flags = Flags::of(&keys);
        if !flags.converted() {
            // `load_lora_weights` rejects any key without `lora`; `load_lora_adapter` reads the
            // `transformer.` ones with PEFT suffixes.
            self.reject_non_lora_keys(&keys)?;
            if !keys.iter().any(|k| k.starts_with("transformer.")) {
                c.format = LoraFormat::Unprefixed;
            }
            for key in keys {
                let Some((stem, part)) = super::split_suffix(key, SUFFIXES) else {
                    c.ignored.push(key.clone());
                    continue;
                };
                let peft = key.ends_with(".lora_A.weight") || key.ends_with(".lora_B.weight");
                if peft && stem.starts_with("transformer.") {
                    self.add(&mut c, key, stem, part, Naming::Peft)?;
                    continue;
                }
                // Beyond diffusers: `lora_down`/`lora_up` suffixes on `transformer.` names (its
                // peft conversion fails on them) and module names without `transformer.` (it
                // finds no key of the transformer).
                match resolve_name(stem.strip_prefix("transformer.").unwrap_or(stem)) {
                    Some((target, _)) => {
                        let group = group_name(&target);
                        self.add(&mut c, key, &group, part, Naming::ZImage { applied: false })?;
                    }
                    None => c.ignored.push(key.clone()),
                }
            }
            return Ok(c);
        }

        if let Some(key) = keys
            .iter()
            .find(|k| k.starts_with("transformer.") && super::split_suffix(k, SUFFIXES).is_some())
        {
            let why = if flags.alpha {
                "`.alpha` keys"
            } else {
                "`default.` names"
            };
            return Err(self.key_error(
                key,
                format!(
                    "diffusers names (`transformer.…`) with {why}: diffusers' Z-Image loader sends this file through its non-diffusers converter, which prefixes `transformer.` a second time, and then finds no module to adapt (NoMatchingPeftModuleError). Remove the `.alpha` keys (scaling lora_A by α/rank first) and `default.` from the names"
                ),
            ));
        }
        c.format = if flags.lora_unet {
            LoraFormat::Kohya
        } else if flags.diffusion_model {
            if keys
                .iter()
                .any(|k| k.contains(".lora_down.weight") || k.contains(".lora.down.weight"))
            {
                LoraFormat::Comfy
            } else {
                LoraFormat::AiToolkit
            }
        } else {
            LoraFormat::Unprefixed
        };

        // Each key's module, with diffusers' renaming of it.
        struct Entry<'k> {
            key: &'k String,
            part: Part,
            target: Target,
            original: bool,
            rewritten: String,
        }
        let rewritten: Vec<String> = keys.iter().map(|k| flags.rewrite(k)).collect();
        let converted = Converted::of(&rewritten);
        let mut entries = Vec::new();
        for (key, rewritten) in keys.into_iter().zip(rewritten) {
            let name = key.replace("default.", "");
            let resolved = super::split_suffix(&name, SUFFIXES).and_then(|(stem, part)| {
                let rest = stem.strip_prefix("diffusion_model.").unwrap_or(stem);
                let rest = rest.strip_prefix("lora_unet_").unwrap_or(rest);
                resolve_name(rest).map(|(target, original)| (part, target, original))
            });
            match resolved {
                Some((part, target, original)) => entries.push(Entry {
                    key,
                    part,
                    target,
                    original,
                    rewritten,
                }),
                None => c.ignored.push(key.clone()),
            }
        }
        // The original `attention.qkv` / `attention.out` next to the modules they duplicate are
        // dropped (diffusers drops them, or overwrites one with the other).
        let split: BTreeSet<String> = entries
            .iter()
            .filter(|e| !e.original)
            .map(|e| group_name(&e.target))
            .collect();
        let (entries, redundant): (Vec<Entry<'_>>, Vec<Entry<'_>>) = entries.into_iter().partition(|e| {
            !e.original
                || match &e.target {
                    Target::One(m) | Target::SwapHalves(m) => !split.contains(m),
                    Target::Split(ms, _) => !ms.iter().any(|m| split.contains(m)),
                }
        });
        c.ignored.extend(redundant.into_iter().map(|e| e.key.clone()));

        // Whether diffusers puts each group where kiln does (decided by its down key, else its up key).
        let mut applied: BTreeMap<String, bool> = BTreeMap::new();
        for e in entries.iter().filter(|e| e.part != Part::Alpha) {
            let group = group_name(&e.target);
            let by_down = e.part == Part::Down;
            if by_down || !applied.contains_key(&group) {
                let down = match by_down {
                    true => e.rewritten.clone(),
                    false => e
                        .rewritten
                        .replace(".lora_up.weight", ".lora_down.weight")
                        .replace(".lora_B.weight", ".lora_A.weight")
                        .replace(".lora.up.weight", ".lora.down.weight"),
                };
                applied.insert(group, converted.target(&down).as_ref() == Some(&e.target));
            }
        }
        for e in &entries {
            let group = group_name(&e.target);
            let naming = Naming::ZImage {
                applied: applied.get(&group).copied().unwrap_or(true),
            };
            self.add(&mut c, e.key, &group, e.part, naming)?;
        }
        Ok(c)
    }

    /// A Z-Image LoKr file (any key with `.lokr_`), read whole; `None`: not a LoKr file.
    pub(super) fn read_zimage_lokr(&self, keys: &[String]) -> Result<Option<LoraFile>, LoraError> {
        if !keys.iter().any(|k| k.contains(".lokr_")) {
            return Ok(None);
        }
        if self.file.metadata().contains_key(METADATA_KEY) {
            return Err(self.file_error(format!(
                "a LoKr file with a `{METADATA_KEY}` header: diffusers builds peft's LoKrConfig from it, which kiln does not reproduce; kiln reads LoKr files whose α is given by `.alpha` keys or is the rank (ai-toolkit's)"
            )));
        }
        let mut ignored = Vec::new();
        let converted = keys
            .iter()
            .any(|k| k.starts_with("diffusion_model.") || k.ends_with(".alpha"));
        let mut groups: BTreeMap<String, BTreeMap<&'static str, &String>> = BTreeMap::new();
        for key in keys {
            if key.contains("dora_scale") {
                ignored.push(key.clone());
                continue;
            }
            let name = match converted {
                true => key.strip_prefix("diffusion_model.").unwrap_or(key),
                false => key.as_str(),
            };
            if converted && name.starts_with("transformer.") {
                return Err(self.key_error(
                    key,
                    "diffusers names (`transformer.…`) in a LoKr file with `.alpha` keys or `diffusion_model.` names: diffusers' Z-Image loader prefixes `transformer.` a second time and finds no module to adapt. Remove the `.alpha` keys (scaling lokr_w1 by α/rank first)",
                ));
            }
            let Some(name) = (match converted {
                true => Some(name),
                false => name.strip_prefix("transformer."),
            }) else {
                ignored.push(key.clone());
                continue;
            };
            let Some((module, suffix)) = LOKR_SUFFIXES
                .iter()
                .find_map(|s| name.strip_suffix(s).map(|m| (m, *s)))
                .filter(|(m, _)| !m.is_empty())
            else {
                ignored.push(key.clone());
                continue;
            };
            if suffix == ".lokr_t2" {
                return Err(self.key_error(
                    key,
                    "a CP-decomposed LoKr factor (`lokr_t2`, for convolutions): kiln reads LoKr files of Linear layers only",
                ));
            }
            groups.entry(module.to_string()).or_default().insert(suffix, key);
        }
        let mut modules = Vec::new();
        for (module, parts) in &groups {
            if !is_linear(module) {
                ignored.extend(parts.values().map(|k| k.to_string()));
                continue;
            }
            if parts.keys().all(|s| *s == ".alpha") {
                ignored.extend(parts.values().map(|k| k.to_string()));
                continue;
            }
            let (w1, w1_rank) = self.lokr_factor(module, parts, ".lokr_w1")?;
            let (w2, w2_rank) = self.lokr_factor(module, parts, ".lokr_w2")?;
            let (w1_dims, w2_dims) = (w1.1, w2.1);
            let out = w1_dims[0] * w2_dims[0];
            let inp = w1_dims[1] * w2_dims[1];
            if (out as u64).saturating_mul(inp as u64) > MAX_MODULE_ELEMENTS {
                return Err(self.key_error(
                    module,
                    format!(
                        "adapts a [{out}, {inp}] weight, larger than any Linear kiln supports; the file is damaged"
                    ),
                ));
            }
            let scale = match (parts.get(".alpha"), w2_rank.or(w1_rank)) {
                (Some(alpha_key), Some(rank)) => self.read_alpha(alpha_key)? / rank as f64,
                _ => 1.0,
            };
            if let (Some(alpha_key), None) = (parts.get(".alpha"), w2_rank.or(w1_rank)) {
                // Full factors take no α (`_bake_lokr_alpha_` drops the key).
                ignored.push(alpha_key.to_string());
            }
            modules.push(LoraModule {
                component: "transformer".to_string(),
                module: module.clone(),
                source: module.clone(),
                out_features: out,
                in_features: inp,
                rank: 0,
                down: Vec::new(),
                up: Vec::new(),
                scale: scale as f32,
                kron: Some(Kron {
                    w1: w1.0,
                    w1_dims,
                    w2: w2.0,
                    w2_dims,
                }),
            });
        }
        if modules.is_empty() {
            return Err(self.nothing_applies(keys.len(), &ignored));
        }
        ignored.sort();
        Ok(Some(LoraFile {
            path: self.path(),
            format: LoraFormat::Lokr,
            modules,
            ignored,
            beyond_diffusers: Vec::new(),
        }))
    }

    /// One Kronecker factor (`base` `.lokr_w1` or `.lokr_w2`) of `module`: the matrix and its
    /// dimensions, and its rank when it is stored decomposed.
    #[allow(clippy::type_complexity)]
    fn lokr_factor(
        &self,
        module: &str,
        parts: &BTreeMap<&'static str, &String>,
        base: &'static str,
    ) -> Result<((Vec<f32>, [usize; 2]), Option<usize>), LoraError> {
        let full = parts.get(base);
        let a = parts.get(format!("{base}_a").as_str());
        let b = parts.get(format!("{base}_b").as_str());
        let matrix = |key: &str| -> Result<(Vec<f32>, [usize; 2]), LoraError> {
            let view = self.file.weight(key)?;
            match view.shape.dims() {
                &[rows, cols] if rows > 0 && cols > 0 => Ok((view.to_f32_vec(), [rows, cols])),
                _ => Err(self.key_error(
                    key,
                    format!(
                        "expected a non-empty 2-D LoKr factor, found shape {}; LoKr files of convolutions are not supported",
                        view.shape
                    ),
                )),
            }
        };
        match (full, a, b) {
            (Some(key), None, None) => Ok((matrix(key)?, None)),
            (None, Some(a_key), Some(b_key)) => {
                let (a, [rows, rank]) = matrix(a_key)?;
                let (b, [b_rank, cols]) = matrix(b_key)?;
                if rank != b_rank {
                    return Err(self.key_error(
                        b_key,
                        format!("shape [{b_rank}, {cols}] does not fit `{a_key}` of shape [{rows}, {rank}]: the file is damaged"),
                    ));
                }
                Ok(((matmul(&a, &b, rows, rank, cols), [rows, cols]), Some(rank)))
            }
            _ => Err(self.key_error(
                module,
                format!(
                    "its LoKr factor `{}` is missing or stored twice (it needs `{base}`, or `{base}_a` and `{base}_b`): the file is incomplete",
                    &base[1..]
                ),
            )),
        }
    }
}

/// `a @ b`, `[rows, inner] @ [inner, cols]` row-major (accumulated in f64).
fn matmul(a: &[f32], b: &[f32], rows: usize, inner: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    let mut acc = vec![0f64; cols];
    for r in 0..rows {
        acc.fill(0.0);
        for k in 0..inner {
            let x = f64::from(a[r * inner + k]);
            for (o, &y) in acc.iter_mut().zip(&b[k * cols..(k + 1) * cols]) {
                *o += x * f64::from(y);
            }
        }
        for (d, &v) in out[r * cols..(r + 1) * cols].iter_mut().zip(&acc) {
            *d = v as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &str) -> Option<(Target, bool)> {
        Some((Target::One(name.to_string()), false))
    }

    #[test]
    fn names_resolve_with_dots_or_underscores() {
        for name in [
            "layers.0.attention.to_q",
            "layers.12.attention.to_out.0",
            "noise_refiner.1.adaLN_modulation.0",
            "context_refiner.0.feed_forward.w2",
            "all_x_embedder.2-1",
            "all_final_layer.2-1.linear",
            "all_final_layer.2-1.adaLN_modulation.1",
            "t_embedder.mlp.2",
            "cap_embedder.1",
        ] {
            assert_eq!(resolve_name(name), one(name), "{name}");
            assert_eq!(resolve_name(&underscored(name)), one(name), "{name}");
            assert!(is_linear(name), "{name}");
        }
        assert_eq!(resolve_name("layers.3.attention.to.q"), one("layers.3.attention.to_q"));
        assert!(!is_linear("layers.3.attention.to.q"));
        assert_eq!(
            resolve_name("layers_3_attention_out"),
            Some((Target::One("layers.3.attention.to_out.0".into()), true))
        );
        assert!(matches!(
            resolve_name("noise_refiner.0.attention.qkv"),
            Some((Target::Split(ms, SplitKind::Qkv), true)) if ms[2] == "noise_refiner.0.attention.to_v"
        ));
        // No modulation in the context refiner; no SigLIP in ZImagePipeline's model.
        assert_eq!(resolve_name("context_refiner.0.adaLN_modulation.0"), None);
        assert_eq!(resolve_name("siglip_refiner.0.attention.to_q"), None);
        assert_eq!(resolve_name("all_x_embedder.2"), None);
        assert_eq!(resolve_name("layers.x.attention.to_q"), None);
        assert_eq!(resolve_name("layers.0.attention.norm_q"), None);
    }

    #[test]
    fn kohya_keys_are_renamed_as_diffusers_does() {
        assert_eq!(
            convert_kohya_key("layers_0_attention_to_q.lora_down.weight"),
            "layers.0.attention.to.q.lora.down.weight"
        );
        assert_eq!(
            convert_kohya_key("layers_0_attention_to_q.alpha"),
            "layers.0.attention.to_q.alpha"
        );
        assert_eq!(
            convert_kohya_key("layers_0_feed_forward_w1.lora_up.weight"),
            "layers.0.feed_forward.w1.lora.up.weight"
        );
        assert_eq!(
            normalize_out_key("layers.0.attention.out.lora_down.weight"),
            "layers.0.attention.to_out.0.lora_down.weight"
        );
        assert_eq!(
            normalize_out_key("layers.0.attention.out.alpha"),
            "layers.0.attention.to_out.0.alpha"
        );
        let keys: Vec<String> = ["lora_unet_noise_refiner_0_adaLN_modulation_0.lora_down.weight".to_string()].into();
        let refs: Vec<&String> = keys.iter().collect();
        let flags = Flags::of(&refs);
        assert!(flags.converted());
        assert_eq!(
            flags.rewrite(&keys[0]),
            "noise_refiner.0.adaLN_modulation.0.lora.down.weight"
        );
    }

    #[test]
    fn kronecker_factors_multiply() {
        assert_eq!(matmul(&[1.0, 2.0], &[3.0, 4.0], 2, 1, 1), vec![3.0, 6.0]);
        assert_eq!(matmul(&[1.0, 2.0], &[3.0, 4.0], 1, 2, 1), vec![11.0]);
    }
}
