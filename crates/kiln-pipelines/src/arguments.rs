//! The call arguments of every pipeline, in one table: [`GenerateCall`] and [`ARGUMENTS`] are
//! made from one list (`call_arguments!`) in which each argument — its name (diffusers' keyword),
//! value kind, group, help and check — is written once. The command line's flags, the server's
//! JSON fields, the PNG record and `--from` are all derived from [`ARGUMENTS`]; [`GenerateCall::check`]
//! is the one check of what needs no model. Which pipelines take an argument is each pipeline's
//! own list ([`crate::PipelineKind::arguments`]).
//!
//! To add an argument: one entry in the list below, and the pipelines that read it.

use serde_json::{Map, Value};

use crate::budget::{CallBudget, OverBudget};
use crate::call::{OutputType, StepCallback};
use crate::encoding::PromptEncoding;
pub use crate::error::ArgError;

/// How a command line gives an argument's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `--name VALUE`, once.
    One,
    /// `--name VALUE`, repeatable: the values in order.
    Repeated,
    /// `--name V,V,...`: a comma-separated list.
    List,
}

/// The group an argument's help is shown in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// What to draw: prompts, size, images.
    Draw,
    /// How to sample: seed, steps, guidance, ...
    Sample,
}

/// How the server's requests give an argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// A JSON field of its name (an OpenAI extra field, a jobs API field).
    Field,
    /// The API's own fields stand for it (`prompt`, `size`, `n`, `seed`).
    Api,
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct ArgSpec {
    /// diffusers' keyword: the field of [`GenerateCall`], the JSON key, the flag with dashes.
    pub name: &'static str,
    pub shape: Shape,
    /// What one value is, as help shows it (`TEXT`, `N`, `SCALE`).
    pub value_name: &'static str,
    /// Other flag names (with dashes, without the leading `--`).
    pub aliases: &'static [&'static str],
    pub group: Group,
    pub help: &'static str,
    pub served: Served,
    /// The field of AUTOMATIC1111's `txt2img` that gives it, where A1111 has one.
    pub a1111: Option<&'static str>,
    /// Checks one command-line value (a list's item); the message says what to give.
    pub check_item: fn(&str) -> Result<(), String>,
}

impl ArgSpec {
    /// The help text on one line.
    pub fn help(&self) -> String {
        self.help.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

/// The row of argument `name`.
pub fn spec(name: &str) -> Option<&'static ArgSpec> {
    ARGUMENTS.iter().find(|a| a.name == name)
}

impl ArgError {
    /// `message` about `argument`, which names it first.
    fn about(argument: &'static str, message: impl std::fmt::Display) -> ArgError {
        ArgError::new(argument, format!("{{{argument}}} {message}"))
    }

    /// An argument past its budget ([`OverBudget`]); `sigmas`: the steps are the sigmas' count.
    pub fn over_budget(over: &OverBudget, sigmas: bool) -> ArgError {
        let (argument, shown) = match over.argument {
            "num_inference_steps" if sigmas => ("sigmas", "{sigmas} (their count)".to_string()),
            name => match spec(name) {
                Some(s) => (s.name, format!("{{{}}}", s.name)),
                None => (over.argument, format!("`{name}`")),
            },
        };
        ArgError::new(argument, over.message(&shown))
    }
}

/// What one value of an argument is: how a command line and JSON give it.
pub trait Item {
    type T: Clone + std::fmt::Debug + PartialEq;
    fn parse(text: &str) -> Result<Self::T, String>;
    fn from_json(value: &Value) -> Result<Self::T, String>;
    fn to_json(value: &Self::T) -> Value;
    /// The file a value names, for a file argument ([`File`]).
    fn file_mut(_value: &mut Self::T) -> Option<&mut FileRef> {
        None
    }
}

/// A whole number, 0 or more (a count or a size).
pub struct Count;
/// A number (negative values allowed: diffusers takes them).
pub struct Number;
/// A seed in torch's range (`Generator.manual_seed`).
pub struct Seed;
/// A text.
pub struct Text;
/// A file the call reads (a LoRA adapter, an input image): [`FileRef`].
pub struct File;
/// `true` or `false`.
pub struct Bool;

/// A file a call reads (a LoRA adapter, an input image) as the call names it: its path, and the
/// sha256 of its bytes when a record gives it (`--from`): a file that changed since is then an
/// error naming it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FileRef {
    pub path: String,
    pub sha256: Option<String>,
}

impl FileRef {
    pub fn new(path: impl Into<String>) -> FileRef {
        FileRef {
            path: path.into(),
            sha256: None,
        }
    }
}

impl Item for Count {
    type T = usize;
    fn parse(text: &str) -> Result<usize, String> {
        parse_count(text)
    }
    fn from_json(value: &Value) -> Result<usize, String> {
        value
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| format!("must be a whole number, 0 or more, got {value}"))
    }
    fn to_json(value: &usize) -> Value {
        (*value as u64).into()
    }
}

impl Item for Number {
    type T = f64;
    fn parse(text: &str) -> Result<f64, String> {
        text.trim().parse().map_err(|_| "give a number".to_string())
    }
    fn from_json(value: &Value) -> Result<f64, String> {
        value.as_f64().ok_or_else(|| format!("must be a number, got {value}"))
    }
    fn to_json(value: &f64) -> Value {
        serde_json::Number::from_f64(*value).map_or(Value::Null, Value::Number)
    }
}

impl Item for Seed {
    type T = u64;
    fn parse(text: &str) -> Result<u64, String> {
        parse_seed(text)
    }
    fn from_json(value: &Value) -> Result<u64, String> {
        match (value.as_u64(), value.as_i64()) {
            (Some(v), _) => Ok(v),
            (None, Some(v)) => Ok(v as u64),
            _ => Err(format!(
                "must be a whole number from -9223372036854775808 to 18446744073709551615, got {value}"
            )),
        }
    }
    fn to_json(value: &u64) -> Value {
        (*value).into()
    }
}

impl Item for Text {
    type T = String;
    fn parse(text: &str) -> Result<String, String> {
        Ok(text.to_string())
    }
    fn from_json(value: &Value) -> Result<String, String> {
        value
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("must be a text (a string), got {value}"))
    }
    fn to_json(value: &String) -> Value {
        Value::String(value.clone())
    }
}

impl Item for File {
    type T = FileRef;
    fn parse(text: &str) -> Result<FileRef, String> {
        match text.trim() {
            "" => Err("give a file's path".to_string()),
            _ => Ok(FileRef::new(text)),
        }
    }
    fn from_json(value: &Value) -> Result<FileRef, String> {
        let shape = || format!("must be a file path, or an object with `path` and `sha256`, got {value}");
        match value {
            Value::String(path) => Self::parse(path),
            Value::Object(map) => {
                let text = |key: &str| map.get(key).and_then(Value::as_str).map(str::to_string);
                if map.keys().any(|k| k != "path" && k != "sha256") {
                    return Err(shape());
                }
                let mut lora = Self::parse(&text("path").ok_or_else(shape)?)?;
                lora.sha256 = text("sha256");
                Ok(lora)
            }
            _ => Err(shape()),
        }
    }
    fn file_mut(value: &mut FileRef) -> Option<&mut FileRef> {
        Some(value)
    }
    fn to_json(value: &FileRef) -> Value {
        match &value.sha256 {
            None => Value::String(value.path.clone()),
            Some(sha) => serde_json::json!({"path": value.path, "sha256": sha}),
        }
    }
}

/// A step cache's settings ([`crate::cache::CacheConfig`]): `KIND:FIELD=VALUE,...`, or a JSON
/// object with `kind`.
pub struct Cache;

impl Item for Cache {
    type T = crate::cache::CacheConfig;
    fn parse(text: &str) -> Result<Self::T, String> {
        crate::cache::CacheConfig::parse(text)
    }
    fn from_json(value: &Value) -> Result<Self::T, String> {
        match value {
            Value::String(text) => Self::parse(text),
            v => crate::cache::CacheConfig::from_json(v),
        }
    }
    fn to_json(value: &Self::T) -> Value {
        value.to_json()
    }
}

impl Item for Bool {
    type T = bool;
    fn parse(text: &str) -> Result<bool, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!("give true or false, not {text:?}")),
        }
    }
    fn from_json(value: &Value) -> Result<bool, String> {
        value
            .as_bool()
            .ok_or_else(|| format!("must be true or false, got {value}"))
    }
    fn to_json(value: &bool) -> Value {
        Value::Bool(*value)
    }
}

/// A count or a size as a command line gives it: a whole number, 0 or more.
pub fn parse_count(value: &str) -> Result<usize, String> {
    let v = value.trim();
    if v.strip_prefix('-').is_some_and(|n| n.parse::<f64>().is_ok()) {
        return Err("it cannot be negative: give a whole number, 0 or more".to_string());
    }
    v.parse::<usize>().map_err(|e| match e.kind() {
        std::num::IntErrorKind::PosOverflow => format!("it is larger than {}", usize::MAX),
        _ => "give a whole number, 0 or more".to_string(),
    })
}

/// A seed as torch's `Generator.manual_seed` takes it: -2^63 ..= 2^64 - 1, a negative seed taken
/// modulo 2^64 (torch reads it as a signed 64-bit integer and uses its bits).
pub fn parse_seed(value: &str) -> Result<u64, String> {
    let range = "a seed is a whole number from -9223372036854775808 to 18446744073709551615 (torch's range)";
    let v: i128 = value.trim().parse().map_err(|_| range.to_string())?;
    if v < 0 {
        i64::try_from(v).map(|s| s as u64).map_err(|_| range.to_string())
    } else {
        u64::try_from(v).map_err(|_| range.to_string())
    }
}

/// The value kind of an argument: the field's type, and how it is given.
pub trait ArgKind {
    type Field: Default + Clone + std::fmt::Debug + PartialEq;
    const SHAPE: Shape;
    /// One command-line value (a list's item), checked.
    fn check_item(text: &str) -> Result<(), String>;
    /// The value of a command line's items (one for [`Shape::One`]).
    fn from_items(items: &[String]) -> Result<Self::Field, String>;
    fn from_json(value: &Value) -> Result<Self::Field, String>;
    /// Its JSON (only asked of a given value).
    fn to_json(field: &Self::Field) -> Value;
    fn given(field: &Self::Field) -> bool;
    /// The texts of a [`PerPrompt`] argument; `None` for every other kind.
    fn per_prompt(_field: &Self::Field) -> Option<Option<&Vec<String>>> {
        None
    }
    fn per_prompt_mut(_field: &mut Self::Field) -> Option<&mut Option<Vec<String>>> {
        None
    }
    /// The files a file argument's value names.
    fn files_mut(_field: &mut Self::Field) -> Vec<&mut FileRef> {
        Vec::new()
    }
}

/// One value; `None`: not given.
pub struct One<I>(std::marker::PhantomData<I>);
/// A comma-separated list.
pub struct List<I>(std::marker::PhantomData<I>);
/// `--name VALUE` repeated: the values in order (a JSON value stands for a list of one).
pub struct Many<I>(std::marker::PhantomData<I>);
/// The prompts: one per batch element; not given when empty.
pub struct Prompts;
/// Texts besides the prompts, given once for every prompt or once per prompt (a repeated flag; a
/// JSON string stands for a list of one).
pub struct PerPrompt;

impl<I: Item> ArgKind for One<I> {
    type Field = Option<I::T>;
    const SHAPE: Shape = Shape::One;
    fn check_item(text: &str) -> Result<(), String> {
        I::parse(text).map(|_| ())
    }
    fn from_items(items: &[String]) -> Result<Self::Field, String> {
        match items {
            [one] => I::parse(one).map(Some),
            _ => Err(format!("give one value, not {}", items.len())),
        }
    }
    fn from_json(value: &Value) -> Result<Self::Field, String> {
        match value {
            Value::Null => Ok(None),
            v => I::from_json(v).map(Some),
        }
    }
    fn to_json(field: &Self::Field) -> Value {
        field.as_ref().map_or(Value::Null, I::to_json)
    }
    fn given(field: &Self::Field) -> bool {
        field.is_some()
    }
    fn files_mut(field: &mut Self::Field) -> Vec<&mut FileRef> {
        field.iter_mut().filter_map(I::file_mut).collect()
    }
}

fn list_of<I: Item>(value: &Value, one_allowed: bool) -> Result<Vec<I::T>, String> {
    match value {
        Value::Array(values) => values
            .iter()
            .enumerate()
            .map(|(i, v)| I::from_json(v).map_err(|e| format!("item {i} {e}")))
            .collect(),
        v if one_allowed => I::from_json(v).map(|one| vec![one]),
        v => Err(format!("must be a list, got {v}")),
    }
}

impl<I: Item> ArgKind for List<I> {
    type Field = Option<Vec<I::T>>;
    const SHAPE: Shape = Shape::List;
    fn check_item(text: &str) -> Result<(), String> {
        I::parse(text).map(|_| ())
    }
    fn from_items(items: &[String]) -> Result<Self::Field, String> {
        items.iter().map(|t| I::parse(t)).collect::<Result<_, _>>().map(Some)
    }
    fn from_json(value: &Value) -> Result<Self::Field, String> {
        match value {
            Value::Null => Ok(None),
            v => list_of::<I>(v, false).map(Some),
        }
    }
    fn to_json(field: &Self::Field) -> Value {
        Value::Array(field.iter().flatten().map(I::to_json).collect())
    }
    fn given(field: &Self::Field) -> bool {
        field.is_some()
    }
}

impl<I: Item> ArgKind for Many<I> {
    type Field = Option<Vec<I::T>>;
    const SHAPE: Shape = Shape::Repeated;
    fn check_item(text: &str) -> Result<(), String> {
        I::parse(text).map(|_| ())
    }
    fn from_items(items: &[String]) -> Result<Self::Field, String> {
        items.iter().map(|t| I::parse(t)).collect::<Result<_, _>>().map(Some)
    }
    fn from_json(value: &Value) -> Result<Self::Field, String> {
        match value {
            Value::Null => Ok(None),
            v => list_of::<I>(v, true).map(Some),
        }
    }
    fn to_json(field: &Self::Field) -> Value {
        Value::Array(field.iter().flatten().map(I::to_json).collect())
    }
    fn given(field: &Self::Field) -> bool {
        field.is_some()
    }
    fn files_mut(field: &mut Self::Field) -> Vec<&mut FileRef> {
        field.iter_mut().flatten().filter_map(I::file_mut).collect()
    }
}

impl ArgKind for Prompts {
    type Field = Vec<String>;
    const SHAPE: Shape = Shape::Repeated;
    fn check_item(_: &str) -> Result<(), String> {
        Ok(())
    }
    fn from_items(items: &[String]) -> Result<Self::Field, String> {
        Ok(items.to_vec())
    }
    fn from_json(value: &Value) -> Result<Self::Field, String> {
        match value {
            Value::Null => Ok(Vec::new()),
            v => list_of::<Text>(v, true),
        }
    }
    fn to_json(field: &Self::Field) -> Value {
        Value::Array(field.iter().map(Text::to_json).collect())
    }
    fn given(field: &Self::Field) -> bool {
        !field.is_empty()
    }
}

impl ArgKind for PerPrompt {
    type Field = Option<Vec<String>>;
    const SHAPE: Shape = Shape::Repeated;
    fn check_item(_: &str) -> Result<(), String> {
        Ok(())
    }
    fn from_items(items: &[String]) -> Result<Self::Field, String> {
        Ok(Some(items.to_vec()))
    }
    fn from_json(value: &Value) -> Result<Self::Field, String> {
        match value {
            Value::Null => Ok(None),
            v => list_of::<Text>(v, true).map(Some),
        }
    }
    fn to_json(field: &Self::Field) -> Value {
        Value::Array(field.iter().flatten().map(Text::to_json).collect())
    }
    fn given(field: &Self::Field) -> bool {
        field.is_some()
    }
    fn per_prompt(field: &Self::Field) -> Option<Option<&Vec<String>>> {
        Some(field.as_ref())
    }
    fn per_prompt_mut(field: &mut Self::Field) -> Option<&mut Option<Vec<String>>> {
        Some(field)
    }
}

/// The checks of one argument's value (`Err`: the message after its name).
mod checks {
    pub fn size(v: &Option<usize>) -> Result<(), String> {
        match v {
            Some(0) => Err("must be positive; leave it out for the model's default size".into()),
            _ => Ok(()),
        }
    }
    pub fn at_least_one(v: &Option<usize>) -> Result<(), String> {
        match v {
            Some(0) => Err("must be at least 1".into()),
            _ => Ok(()),
        }
    }
    pub fn finite(v: &Option<f64>) -> Result<(), String> {
        match v {
            Some(v) if !v.is_finite() => Err(format!("must be a finite number, got {v}")),
            _ => Ok(()),
        }
    }
    pub fn fraction(v: &Option<f64>) -> Result<(), String> {
        match v {
            Some(v) if !(0.0..=1.0).contains(v) => Err(format!("must be between 0 and 1, got {v}")),
            _ => Ok(()),
        }
    }
    pub fn all_finite(v: &Option<Vec<f64>>) -> Result<(), String> {
        match v.iter().flatten().find(|v| !v.is_finite()) {
            Some(v) => Err(format!("must be finite numbers, got {v}")),
            None => Ok(()),
        }
    }
}

/// The base of a row before its own fields.
const BASE: ArgSpec = ArgSpec {
    name: "",
    shape: Shape::One,
    value_name: "VALUE",
    aliases: &[],
    group: Group::Sample,
    help: "",
    served: Served::Field,
    a1111: None,
    check_item: |_| Ok(()),
};

/// Declares [`GenerateCall`] and [`ARGUMENTS`] from one list: each entry is the help (doc
/// comment), the name and value kind, optionally `check` and a function of the field, and the
/// row's other fields.
macro_rules! call_arguments {
    ($(
        $(#[doc = $help:literal])+
        $name:ident: $kind:ty $(, check $check:path)? { $($key:ident: $value:expr),* $(,)? }
    ),* $(,)?) => {
        /// The arguments of a call of any pipeline, by diffusers' keyword names. Unset (`None`, or
        /// no prompt) means not given: the model's [`crate::CallDefaults`], else the pipeline's
        /// default. An argument the pipeline does not take is an error
        /// ([`crate::PipelineKind::check_arguments`]).
        pub struct GenerateCall<'a> {
            $( $(#[doc = $help])+ pub $name: <$kind as ArgKind>::Field, )*
            /// One generator seed per image instead of `seed` (a generator list; counts as `seed`).
            pub seeds: Option<Vec<u64>>,
            /// The prompts' encoding ([`crate::AnyPipeline::encode_prompt`]) instead of the texts:
            /// then `prompt` is empty and no other text is given, and the call's settings resolve to
            /// the ones the encoding was made with. One row per prompt; each is repeated per image.
            pub prompt_encoding: Option<PromptEncoding>,
            pub output_type: OutputType,
            /// Show a progress bar on stderr (when it is a terminal).
            pub progress: bool,
            pub callback: Option<Box<StepCallback<'a>>>,
        }

        impl Default for GenerateCall<'_> {
            fn default() -> Self {
                GenerateCall {
                    $( $name: Default::default(), )*
                    seeds: None,
                    prompt_encoding: None,
                    output_type: OutputType::Image,
                    progress: true,
                    callback: None,
                }
            }
        }

        /// The table: every argument a call can give.
        pub static ARGUMENTS: &[ArgSpec] = &[$(
            ArgSpec {
                name: stringify!($name),
                shape: <$kind as ArgKind>::SHAPE,
                help: concat!($($help),+),
                check_item: <$kind as ArgKind>::check_item,
                $($key: $value,)*
                ..BASE
            }
        ),*];

        impl GenerateCall<'_> {
            /// The arguments given, in the table's order (`seeds` counts as `seed`).
            pub fn given(&self) -> Vec<&'static str> {
                let mut given = Vec::new();
                $(
                    if <$kind as ArgKind>::given(&self.$name)
                        || (stringify!($name) == "seed" && self.seeds.is_some())
                    {
                        given.push(stringify!($name));
                    }
                )*
                given
            }

            /// Sets argument `name` from a command line's values.
            pub fn set_items(&mut self, name: &str, items: &[String]) -> Result<(), ArgError> {
                match name {
                    $( stringify!($name) => {
                        self.$name = <$kind as ArgKind>::from_items(items)
                            .map_err(|e| ArgError::about(stringify!($name), e))?;
                    } )*
                    _ => return Err(unknown(name)),
                }
                Ok(())
            }

            /// Sets argument `name` from its JSON value (`null`: unset).
            pub fn set_json(&mut self, name: &str, value: &Value) -> Result<(), ArgError> {
                match name {
                    $( stringify!($name) => {
                        self.$name = <$kind as ArgKind>::from_json(value)
                            .map_err(|e| ArgError::about(stringify!($name), e))?;
                    } )*
                    _ => return Err(unknown(name)),
                }
                Ok(())
            }

            /// The arguments given, as JSON by name (the PNG record's call).
            pub fn to_json(&self) -> Map<String, Value> {
                let mut map = Map::new();
                $(
                    if <$kind as ArgKind>::given(&self.$name) {
                        map.insert(stringify!($name).into(), <$kind as ArgKind>::to_json(&self.$name));
                    }
                )*
                map
            }

            /// A copy of the arguments (and `seeds`), without the encoding and the callback.
            pub fn arguments(&self) -> GenerateCall<'static> {
                GenerateCall {
                    $( $name: self.$name.clone(), )*
                    seeds: self.seeds.clone(),
                    ..Default::default()
                }
            }

            /// The texts besides `prompt` that may be given once for every prompt or once per
            /// prompt (the [`PerPrompt`] arguments), by name.
            pub fn per_prompt_texts(&self) -> Vec<(&'static str, Option<&Vec<String>>)> {
                let mut texts = Vec::new();
                $(
                    if let Some(list) = <$kind as ArgKind>::per_prompt(&self.$name) {
                        texts.push((stringify!($name), list));
                    }
                )*
                texts
            }

            fn per_prompt_texts_mut(&mut self) -> Vec<(&'static str, &mut Option<Vec<String>>)> {
                let mut texts = Vec::new();
                $(
                    if let Some(list) = <$kind as ArgKind>::per_prompt_mut(&mut self.$name) {
                        texts.push((stringify!($name), list));
                    }
                )*
                texts
            }

            /// The files the call reads (file arguments: `lora`, ...), by argument.
            pub fn files_mut(&mut self) -> Vec<(&'static str, &mut FileRef)> {
                let mut files = Vec::new();
                $(
                    files.extend(
                        <$kind as ArgKind>::files_mut(&mut self.$name)
                            .into_iter()
                            .map(|f| (stringify!($name), f)),
                    );
                )*
                files
            }

            /// Each argument's own check.
            fn check_each(&self) -> Result<(), ArgError> {
                $($(
                    $check(&self.$name).map_err(|e| ArgError::about(stringify!($name), e))?;
                )?)*
                Ok(())
            }
        }
    };
}

fn unknown(name: &str) -> ArgError {
    let known: Vec<&str> = ARGUMENTS.iter().map(|a| a.name).collect();
    ArgError::new(
        "",
        format!(
            "`{name}` is not a call argument kiln knows (it knows {})",
            known.join(", ")
        ),
    )
}

call_arguments! {
    /// The prompt. Give it several times for a batch: one image file per prompt and image.
    prompt: Prompts { group: Group::Draw, value_name: "TEXT", served: Served::Api },
    /// What not to draw: once for every prompt, or once per --prompt. FLUX.1 uses it only with
    /// --true-cfg-scale above 1.
    negative_prompt: PerPrompt { group: Group::Draw, value_name: "TEXT", a1111: Some("negative_prompt") },
    /// The second text encoder's prompt (FLUX.1: T5; SD3: CLIP-G); default: --prompt. Once, or
    /// once per --prompt.
    prompt_2: PerPrompt { group: Group::Draw, value_name: "TEXT" },
    /// The second text encoder's negative prompt; default: --negative-prompt.
    negative_prompt_2: PerPrompt { group: Group::Draw, value_name: "TEXT" },
    /// SD3: the third text encoder's (T5) prompt; default: --prompt.
    prompt_3: PerPrompt { group: Group::Draw, value_name: "TEXT" },
    /// SD3: the third text encoder's negative prompt; default: --negative-prompt.
    negative_prompt_3: PerPrompt { group: Group::Draw, value_name: "TEXT" },
    /// Image height in pixels (default: the model's).
    height: One<Count>, check checks::size { group: Group::Draw, value_name: "PIXELS", served: Served::Api },
    /// Image width in pixels (default: the model's).
    width: One<Count>, check checks::size { group: Group::Draw, value_name: "PIXELS", served: Served::Api },
    /// Images per prompt (default 1).
    num_images_per_prompt: One<Count>, check checks::at_least_one {
        group: Group::Draw, value_name: "N", aliases: &["num-images"], served: Served::Api,
    },
    /// Seed of the torch CPU generator that draws the initial noise of the batch (default 0). As
    /// torch's `manual_seed`, a negative seed (down to -2^63) is taken modulo 2^64.
    seed: One<Seed> { value_name: "SEED", served: Served::Api },
    /// Denoising steps (default: the model's).
    num_inference_steps: One<Count> { value_name: "N", aliases: &["steps"], a1111: Some("steps") },
    /// The sigmas of the schedule instead, comma-separated (1.0,0.75,0.5,0.25); their count is
    /// the number of steps.
    sigmas: List<Number>, check checks::all_finite { value_name: "S,S,..." },
    /// Guidance scale (default: the model's). FLUX.1 [dev] embeds it; [schnell] ignores it.
    guidance_scale: One<Number>, check checks::finite {
        value_name: "SCALE", aliases: &["guidance"], a1111: Some("cfg_scale"),
    },
    /// FLUX.1: true classifier-free guidance (default 1, off); above 1 with a --negative-prompt
    /// the transformer runs twice per step.
    true_cfg_scale: One<Number>, check checks::finite { value_name: "SCALE", aliases: &["true-cfg"] },
    /// Tokens of the T5 prompt (FLUX.2: of the Mistral chat text) (default: the model's; FLUX.1 and
    /// SD3 allow up to 512).
    max_sequence_length: One<Count>, check checks::at_least_one { value_name: "TOKENS" },
    /// SD3: the transformer layers skip-layer guidance leaves out, comma-separated (7,8,9).
    skip_guidance_layers: List<Count> { value_name: "I,I,..." },
    /// SD3: the skip-layer guidance scale (diffusers' default 2.8).
    skip_layer_guidance_scale: One<Number>, check checks::finite { value_name: "SCALE" },
    /// SD3: the fraction of the steps at which skip-layer guidance starts (default 0.01).
    skip_layer_guidance_start: One<Number>, check checks::finite { value_name: "FRACTION" },
    /// SD3: the fraction of the steps at which skip-layer guidance stops (default 0.2).
    skip_layer_guidance_stop: One<Number>, check checks::finite { value_name: "FRACTION" },
    /// SD3: the number of CLIP layers skipped from the end for the prompt embeddings.
    clip_skip: One<Count> { value_name: "N" },
    /// FLUX.2: the text encoder's hidden states stacked into the prompt embeddings,
    /// comma-separated (diffusers' default 10,20,30; FLUX.2 [klein] 9,18,27).
    text_encoder_out_layers: List<Count> { value_name: "K,K,..." },
    /// Z-Image: clamp the guided prediction's norm to the positive prediction's (diffusers'
    /// `cfg_normalization`; default false).
    cfg_normalization: One<Bool> { value_name: "true|false" },
    /// Z-Image: steps whose `t = 1 − σ` is above it run without CFG (default 1.0: every step).
    cfg_truncation: One<Number>, check checks::finite { value_name: "T" },
    /// An input image (PNG, JPEG, ...): image-to-image and inpainting start from it, FLUX.1
    /// Kontext edits it, FLUX.2 takes each as a reference (repeat it). (A server takes no file
    /// paths: its image routes give it.)
    image: Many<File> { group: Group::Draw, value_name: "FILE", served: Served::Api },
    /// Inpainting: the mask of --image (white: repaint, black: keep), resized to the output.
    mask_image: One<File> { group: Group::Draw, value_name: "FILE", served: Served::Api },
    /// How much of the input image is redrawn, 0 to 1 (diffusers' default 0.6): the share of the
    /// steps that run.
    strength: One<Number>, check checks::fraction { group: Group::Draw, value_name: "FRACTION" },
    /// FLUX.1 Kontext: the output's pixel count; height and width keep their aspect ratio
    /// (default 1048576, 1024²).
    max_area: One<Count>, check checks::at_least_one { group: Group::Draw, value_name: "PIXELS" },
    /// A step cache (diffusers' hooks): first-block, taylorseer, magcache or faster (FasterCache's
    /// guidance-distilled mode), as diffusers runs them on FLUX.1, FLUX.2 and SD3 (and on Z-Image),
    /// with diffusers' config fields, e.g. first-block:threshold=0.12 or
    /// magcache:threshold=0.06,num_inference_steps=28 (lists joined with `;`);
    /// magcache:calibrate=true measures the ratios. A server takes an object: {"kind":
    /// "first-block", "threshold": 0.12}.
    cache: One<Cache> { value_name: "KIND[:FIELD=VALUE,...]" },
    /// A LoRA adapter (`.safetensors`: diffusers/PEFT, kohya, ComfyUI, XLabs or ai-toolkit
    /// names), merged into the weights for this call; repeat it for several. The server names
    /// adapters of its --lora-dir instead (`loras`).
    lora: Many<File> { group: Group::Draw, value_name: "FILE", served: Served::Api },
    /// Each --lora's weight, in order (diffusers' `set_adapters(adapter_weights=…)`; default 1.0,
    /// negative allowed).
    lora_scale: Many<Number>, check checks::all_finite {
        group: Group::Draw, value_name: "SCALE", served: Served::Api,
    },
}

/// The rule for prompt text in every entry point: the images' PNG text chunks record the
/// prompts, and a PNG text chunk cannot hold a NUL character (readers cut the text there), so a
/// prompt with one is refused. Every other character is kept (non-ASCII text goes to an iTXt
/// chunk, which holds UTF-8).
pub fn check_prompt_text(text: &str) -> Result<(), String> {
    match text.find('\0') {
        Some(at) => Err(format!(
            "the text has a NUL character (at byte {at}), which a PNG text chunk cannot hold; remove it"
        )),
        None => Ok(()),
    }
}

impl GenerateCall<'_> {
    /// A call for one prompt with the other arguments at their defaults.
    pub fn prompt(prompt: impl Into<String>) -> Self {
        GenerateCall {
            prompt: vec![prompt.into()],
            ..Default::default()
        }
    }

    /// A call of the arguments of JSON `map` (as [`GenerateCall::to_json`] writes them).
    pub fn from_json(map: &Map<String, Value>) -> Result<GenerateCall<'static>, ArgError> {
        let mut call = GenerateCall::default();
        for (name, value) in map {
            call.set_json(name, value)?;
        }
        Ok(call)
    }

    /// This call with `encoding` ([`crate::AnyPipeline::encode_prompt`]) in place of its texts.
    pub fn with_prompt_encoding(self, encoding: PromptEncoding) -> Self {
        let mut call = GenerateCall {
            prompt: Vec::new(),
            prompt_encoding: Some(encoding),
            ..self
        };
        for (_, list) in call.per_prompt_texts_mut() {
            *list = None;
        }
        call
    }

    /// The texts of text argument `name` as given (`prompt`'s always, maybe none).
    pub fn text_argument(&self, name: &str) -> Option<Vec<String>> {
        if name == "prompt" {
            return Some(self.prompt.clone());
        }
        let (_, list) = self.per_prompt_texts().into_iter().find(|(n, _)| *n == name)?;
        list.cloned()
    }

    /// Every text argument's texts, `prompt` first.
    pub fn texts(&self) -> impl Iterator<Item = (&'static str, &String)> {
        let prompts = self.prompt.iter().map(|t| ("prompt", t));
        let others: Vec<(&'static str, &String)> = self
            .per_prompt_texts()
            .into_iter()
            .flat_map(|(name, list)| list.into_iter().flatten().map(move |t| (name, t)))
            .collect();
        prompts.chain(others)
    }

    /// Every text against [`check_prompt_text`]; the error names the argument.
    pub fn check_text(&self) -> Result<(), ArgError> {
        for (name, text) in self.texts() {
            check_prompt_text(text).map_err(|e| ArgError::new(name, format!("{{{name}}}: {e}")))?;
        }
        Ok(())
    }

    /// The number of denoising steps as given: the sigmas' count when they are given.
    pub fn steps_given(&self) -> Option<usize> {
        self.sigmas.as_ref().map(Vec::len).or(self.num_inference_steps)
    }

    /// The call's budget ([`CallBudget`]) with `defaults` for what is unset.
    pub fn budget(&self, defaults: &crate::CallDefaults) -> CallBudget {
        CallBudget {
            num_inference_steps: self.steps_given().unwrap_or(defaults.num_inference_steps),
            batch: self
                .prompt_encoding
                .as_ref()
                .map_or(self.prompt.len(), PromptEncoding::rows),
            num_images_per_prompt: self.num_images_per_prompt.unwrap_or(1),
            height: self.height.unwrap_or(defaults.height),
            width: self.width.unwrap_or(defaults.width),
        }
    }

    /// The checks that need no model: each argument's own (sizes and counts positive, numbers
    /// finite), the texts, per-prompt lists given once or once per prompt, the steps against the
    /// sigmas, and the budget ([`CallBudget::check`]) — in the library, the command line and the
    /// server alike.
    pub fn check(&self) -> Result<(), ArgError> {
        self.check_each()?;
        self.check_text()?;
        let batch = self.prompt.len();
        for (name, list) in self.per_prompt_texts() {
            if let Some(list) = list.filter(|l| batch > 0 && l.len() > 1 && l.len() != batch) {
                return Err(ArgError::new(
                    name,
                    format!(
                        "{{{name}}} is given {} times for {batch} prompt(s): give it once for every prompt or once per {{prompt}}",
                        list.len()
                    ),
                ));
            }
        }
        if let Some(scales) = &self.lora_scale {
            let loras = self.lora.as_ref().map_or(0, Vec::len);
            if scales.len() != loras {
                return Err(ArgError::new(
                    "lora_scale",
                    format!(
                        "{{lora_scale}} is given {} times for {loras} {{lora}}: give one per {{lora}}, in the same order, or none (each 1.0)",
                        scales.len()
                    ),
                ));
            }
        }
        // What is unset is checked with the model (it brings its defaults).
        self.budget(&crate::CallDefaults::default())
            .check()
            .map_err(|over| ArgError::over_budget(&over, self.sigmas.is_some()))?;
        if let (Some(sigmas), Some(steps)) = (&self.sigmas, self.num_inference_steps) {
            if steps != sigmas.len() {
                return Err(ArgError::new(
                    "num_inference_steps",
                    format!(
                        "{{num_inference_steps}} {steps} does not match the {} {{sigmas}}; leave it out (the sigmas set the number of steps)",
                        sigmas.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Lists given once for several prompts, repeated for each (what the command line means by
    /// one `--negative-prompt` for several `--prompt`s).
    pub fn broadcast_texts(&mut self) {
        let batch = self.prompt.len();
        for (_, list) in self.per_prompt_texts_mut() {
            if let Some(l) = list.as_mut().filter(|l| l.len() == 1 && batch > 1) {
                *l = vec![l[0].clone(); batch];
            }
        }
    }

    /// Fills in the defaults that depend on the model, so that a record holds the values used.
    /// Pipeline defaults that never change (true CFG off, `prompt_2` = `prompt`) stay unset.
    pub fn resolve(&mut self, defaults: &crate::CallDefaults) {
        self.height.get_or_insert(defaults.height);
        self.width.get_or_insert(defaults.width);
        self.num_images_per_prompt.get_or_insert(1);
        self.seed.get_or_insert(0);
        match &self.sigmas {
            Some(sigmas) => self.num_inference_steps = Some(sigmas.len()),
            None => {
                self.num_inference_steps.get_or_insert(defaults.num_inference_steps);
            }
        }
        self.guidance_scale.get_or_insert(defaults.guidance_scale);
        self.max_sequence_length.get_or_insert(defaults.max_sequence_length);
    }

    /// Every file the call reads, named as a record names it: by its absolute path, with the
    /// sha256 of its bytes (which `--from` then checks). An error names the argument and file.
    pub fn pin_files(&mut self) -> Result<(), ArgError> {
        for (name, file) in self.files_mut() {
            let bad = |e: std::io::Error| ArgError::new(name, format!("{{{name}}} {}: {e}", file.path));
            let absolute = std::path::Path::new(&file.path).canonicalize().map_err(bad)?;
            let sha = crate::lora::file_sha256(&absolute)
                .map_err(|e| ArgError::new(name, format!("{{{name}}} {}: {e}", file.path)))?;
            file.path = absolute.display().to_string();
            file.sha256 = Some(sha);
        }
        Ok(())
    }

    /// The number of images the call makes.
    pub fn image_count(&self) -> usize {
        self.prompt.len() * self.num_images_per_prompt.unwrap_or(1)
    }

    /// Image `k`'s prompt and negative prompt (diffusers' order: prompt-major), a list given once
    /// standing for every prompt.
    pub fn prompts_of_image(&self, k: usize) -> (String, Option<String>) {
        let p = k / self.num_images_per_prompt.unwrap_or(1).max(1);
        let negative = self
            .negative_prompt
            .as_ref()
            .and_then(|n| n.get(p).or(n.first()))
            .cloned();
        (self.prompt.get(p).cloned().unwrap_or_default(), negative)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_and_the_call_have_the_same_arguments() {
        let names: Vec<&str> = ARGUMENTS.iter().map(|a| a.name).collect();
        assert_eq!(names.len(), 30);
        assert_eq!(names[0], "prompt");
        let mut call = GenerateCall::prompt("a");
        for a in ARGUMENTS {
            let value = match a.shape {
                Shape::Repeated if a.name == "lora_scale" => serde_json::json!([0.5]),
                Shape::Repeated => serde_json::json!(["b"]),
                Shape::List => serde_json::json!([1]),
                Shape::One if a.name == "cfg_normalization" => serde_json::json!(true),
                Shape::One if a.value_name == "FILE" => serde_json::json!("m.png"),
                Shape::One if a.name == "cache" => serde_json::json!({"kind": "first-block"}),
                Shape::One => serde_json::json!(1),
            };
            call.set_json(a.name, &value).unwrap();
        }
        assert_eq!(call.given(), names);
        let per_prompt: Vec<&str> = call.per_prompt_texts().iter().map(|(n, _)| *n).collect();
        assert_eq!(
            per_prompt,
            [
                "negative_prompt",
                "prompt_2",
                "negative_prompt_2",
                "prompt_3",
                "negative_prompt_3"
            ]
        );
        let json = call.to_json();
        let again = GenerateCall::from_json(&json).unwrap();
        assert_eq!(again.to_json(), json);
        assert_eq!(again.given(), names);
    }

    #[test]
    fn errors_name_the_argument_the_way_each_front_end_does() {
        let call = GenerateCall {
            guidance_scale: Some(f64::NAN),
            ..GenerateCall::prompt("a")
        };
        let e = call.check().unwrap_err();
        assert_eq!(e.argument, "guidance_scale");
        assert_eq!(e.to_string(), "`guidance_scale` must be a finite number, got NaN");
        let upper = |e: &ArgError| e.render(&|name| name.to_uppercase());
        assert_eq!(upper(&e), "GUIDANCE_SCALE must be a finite number, got NaN");
        let call = GenerateCall {
            sigmas: Some(vec![1.0, 0.5]),
            num_inference_steps: Some(3),
            ..GenerateCall::prompt("a")
        };
        assert_eq!(
            upper(&call.check().unwrap_err()),
            "NUM_INFERENCE_STEPS 3 does not match the 2 SIGMAS; leave it out (the sigmas set the number of steps)"
        );
        let call = GenerateCall {
            prompt: vec!["a".into(), "b".into()],
            negative_prompt: Some(vec!["x".into(), "y".into(), "z".into()]),
            ..Default::default()
        };
        assert!(upper(&call.check().unwrap_err()).starts_with("NEGATIVE_PROMPT is given 3 times for 2 prompt(s)"));
        let e = GenerateCall::prompt("a\0b").check().unwrap_err();
        assert_eq!(
            e.to_string(),
            "`prompt`: the text has a NUL character (at byte 1), which a PNG text chunk cannot hold; remove it"
        );
        let call = GenerateCall {
            sigmas: Some(vec![0.5; 10_001]),
            ..GenerateCall::prompt("a")
        };
        assert!(upper(&call.check().unwrap_err()).starts_with("SIGMAS (their count) 10001 is more than kiln allows"));
    }

    #[test]
    fn values_parse_as_a_command_line_and_as_json_give_them() {
        assert_eq!(parse_seed("-1"), Ok(u64::MAX));
        assert!(parse_count("-1").unwrap_err().contains("cannot be negative"));
        let mut call = GenerateCall::default();
        call.set_items("sigmas", &["1".into(), "0.5".into()]).unwrap();
        call.set_json("negative_prompt", &serde_json::json!("n")).unwrap();
        assert_eq!(call.sigmas, Some(vec![1.0, 0.5]));
        assert_eq!(call.negative_prompt, Some(vec!["n".to_string()]));
        let e = call.set_json("height", &serde_json::json!(-3)).unwrap_err();
        assert_eq!(e.argument, "height");
        assert!(e.to_string().starts_with("`height` must be a whole number"), "{e}");
        assert!(call.set_json("image_path", &serde_json::json!("x")).is_err());
    }
}
