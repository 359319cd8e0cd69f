//! Chat templates: the Jinja template a tokenizer or processor folder ships
//! (`chat_template.jinja`, `chat_template.json`, or a `chat_template` key of
//! `processor_config.json` / `tokenizer_config.json`), rendered as transformers renders it
//! (`trim_blocks`, `lstrip_blocks`, no trailing newline kept, `raise_exception` and
//! `strftime_now` available, Python's `dict`/`str` methods callable) with the `minijinja` engine.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;

use crate::config::{existing, read_json, read_to_string};
use crate::error::{Result, TokenizerError};

/// One message of a conversation (`{"role": ..., "content": ...}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: ChatContent,
}

/// A message's content: a string, or a list of typed blocks (as processors take it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatContent {
    Text(String),
    Blocks(Vec<ChatBlock>),
}

/// One block of a message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatBlock {
    /// `{"type": "text", "text": ...}`.
    Text(String),
    /// `{"type": "image"}`.
    Image,
}

impl ChatMessage {
    /// A message whose content is a string (`{"role": role, "content": text}`).
    pub fn text(role: &str, text: &str) -> Self {
        ChatMessage {
            role: role.to_owned(),
            content: ChatContent::Text(text.to_owned()),
        }
    }

    /// A message whose content is one text block (`[{"type": "text", "text": text}]`).
    pub fn text_block(role: &str, text: &str) -> Self {
        ChatMessage {
            role: role.to_owned(),
            content: ChatContent::Blocks(vec![ChatBlock::Text(text.to_owned())]),
        }
    }

    fn to_value(&self) -> Value {
        let content = match &self.content {
            ChatContent::Text(text) => Value::from(text.as_str()),
            ChatContent::Blocks(blocks) => blocks
                .iter()
                .map(|block| {
                    let mut map = BTreeMap::new();
                    match block {
                        ChatBlock::Text(text) => {
                            map.insert("type".to_owned(), Value::from("text"));
                            map.insert("text".to_owned(), Value::from(text.as_str()));
                        }
                        ChatBlock::Image => {
                            map.insert("type".to_owned(), Value::from("image"));
                        }
                    }
                    Value::from(map)
                })
                .collect(),
        };
        let mut map = BTreeMap::new();
        map.insert("role".to_owned(), Value::from(self.role.as_str()));
        map.insert("content".to_owned(), content);
        Value::from(map)
    }
}

/// A chat template and the file it came from.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    path: PathBuf,
}

impl ChatTemplate {
    /// The template `source`, read from `path` (named in errors). Fails if it does not parse.
    pub fn new(source: impl Into<String>, path: impl Into<PathBuf>) -> Result<Self> {
        let template = ChatTemplate {
            source: source.into(),
            path: path.into(),
        };
        template
            .environment()
            .template_from_str(&template.source)
            .map_err(|e| template.error(&e))?;
        Ok(template)
    }

    /// The folder's chat template, looked for as transformers 5 does: `chat_template.jinja`,
    /// then `chat_template.json` (`{"chat_template": ...}`), then the `chat_template` key of
    /// `processor_config.json` and of `tokenizer_config.json` (a string, or a list of
    /// `{name, template}` of which `default` is taken). `None` if the folder has none.
    pub fn from_folder(folder: &Path) -> Result<Option<Self>> {
        if let Some(path) = existing(folder, "chat_template.jinja") {
            return Self::new(read_to_string(&path)?, path).map(Some);
        }
        for (file, expected) in [
            ("chat_template.json", "chat_template.json (a JSON object)"),
            ("processor_config.json", "processor_config.json (a JSON object)"),
            ("tokenizer_config.json", "tokenizer_config.json (a JSON object)"),
        ] {
            let path = folder.join(file);
            let Some(json) = read_json(&path, expected)? else {
                continue;
            };
            let source = match json.get("chat_template") {
                Some(Json::String(source)) => Some(source.clone()),
                Some(Json::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Json::as_str)
                    .map(str::to_owned),
                _ => None,
            };
            if let Some(source) = source {
                return Self::new(source, path).map(Some);
            }
        }
        Ok(None)
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The file the template was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renders `messages` with the special-token variables (`bos_token`, `eos_token`, ...) and
    /// `add_generation_prompt`, as `tokenizer.apply_chat_template(..., tokenize=False)`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        special_tokens: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_with(messages, special_tokens, add_generation_prompt, &[])
    }

    /// [`Self::render`] with further template variables, as `apply_chat_template`'s extra keyword
    /// arguments (Qwen3's `enable_thinking=False`).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        special_tokens: &[(&str, &str)],
        add_generation_prompt: bool,
        flags: &[(&str, bool)],
    ) -> Result<String> {
        let env = self.environment();
        let template = env.template_from_str(&self.source).map_err(|e| self.error(&e))?;
        let mut context: BTreeMap<String, Value> = special_tokens
            .iter()
            .map(|(name, token)| ((*name).to_owned(), Value::from(*token)))
            .collect();
        let messages: Value = messages.iter().map(ChatMessage::to_value).collect();
        context.insert("messages".to_owned(), messages);
        context.insert("add_generation_prompt".to_owned(), Value::from(add_generation_prompt));
        for (name, value) in flags {
            context.insert((*name).to_owned(), Value::from(*value));
        }
        template.render(Value::from(context)).map_err(|e| self.error(&e))
    }

    fn environment(&self) -> Environment<'static> {
        let mut env = Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        // Jinja2 runs in Python: templates call dict and str methods.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env
    }

    fn error(&self, error: &minijinja::Error) -> TokenizerError {
        let mut message = error.to_string();
        let mut source = std::error::Error::source(error);
        while let Some(inner) = source {
            message.push_str(&format!(": {inner}"));
            source = inner.source();
        }
        TokenizerError::ChatTemplate {
            path: self.path.clone(),
            message,
        }
    }
}

/// transformers' `strftime_now(format)`: the current time formatted (here in UTC) with the
/// common `strftime` codes (`%Y %y %m %d %e %H %I %M %S %p %B %b %A %a %j %%`); other codes are
/// kept as written. Templates use it for a default system message with today's date.
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_time(secs, format)
}

fn format_time(unix_secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (unix_secs / 86_400) as i64;
    let secs_of_day = unix_secs % 86_400;
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let day_of_year = cumulative[month as usize - 1] + day + i64::from(leap && month > 2);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_name = MONTHS[month as usize - 1];
    let day_name = DAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_dates_like_strftime() {
        // 2025-03-17 14:05:09 UTC, a Monday, day 76.
        let t = 1_742_220_309;
        assert_eq!(format_time(t, "%Y-%m-%d %H:%M:%S"), "2025-03-17 14:05:09");
        assert_eq!(
            format_time(t, "%A %a %B %b %j %y %I%p %% %Q"),
            "Monday Mon March Mar 076 25 02PM % %Q"
        );
        // 2024-02-29 (leap day), a Thursday.
        assert_eq!(
            format_time(1_709_164_800, "%d %B %Y %A %j"),
            "29 February 2024 Thursday 060"
        );
        assert_eq!(format_time(0, "%Y-%m-%d %A"), "1970-01-01 Thursday");
    }

    #[test]
    fn renders_with_transformers_whitespace_rules_and_helpers() {
        // Checked with Python's jinja2 (trim_blocks, lstrip_blocks): '  user:hi|\n<s>' — block
        // tags lose their indentation and newline, `{{ }}` lines keep theirs, the final newline goes.
        let source =
            "{%- for m in messages %}\n  {% if m['role'] == 'user' %}\n  {{ m['role'] }}:{{ m['content'] }}|\n  \
                      {% endif %}\n{% endfor %}\n{{ bos_token }}\n";
        let t = ChatTemplate::new(source, "t.jinja").unwrap();
        let messages = [ChatMessage {
            role: "user".into(),
            content: ChatContent::Text("hi".into()),
        }];
        assert_eq!(
            t.render(&messages, &[("bos_token", "<s>")], false).unwrap(),
            "  user:hi|\n<s>"
        );

        let t = ChatTemplate::new("{{ raise_exception('no ' + messages[0]['role']) }}", "t.jinja").unwrap();
        let err = t.render(&messages, &[], false).unwrap_err().to_string();
        assert!(err.contains("t.jinja") && err.contains("no user"), "{err}");

        // What the Mistral-Small-3.x templates use: strftime_now at the top, Python methods,
        // selectattr, `is defined`, loop.index0.
        let source = r#"{%- set today = strftime_now("%Y-%m-%d") %}
{%- set users = messages | selectattr("role", "equalto", "user") | list %}
{%- for m in messages %}
    {%- if not m.get("tool_calls") and m["role"] not in ["tool"] and loop.index0 == 0 %}
        {{- m["role"] + "=" + m["content"].strip() + ";" }}
    {%- endif %}
{%- endfor %}
{%- for k, v in {"a": 1}.items() %}{{ k }}{{ v }}{% endfor %}
{{- users | length }}|{{ today | length }}|{{ tools is defined }}"#;
        let t = ChatTemplate::new(source, "t.jinja").unwrap();
        let padded = [ChatMessage {
            role: "user".into(),
            content: ChatContent::Text(" hi ".into()),
        }];
        assert_eq!(t.render(&padded, &[], false).unwrap(), "user=hi;a11|10|False");

        let err = ChatTemplate::new("{% if %}", "bad.jinja").unwrap_err().to_string();
        assert!(err.contains("bad.jinja"), "{err}");
    }
}
