//! A JSON object read key by key, so that duplicate keys are seen (a map type keeps only the last).

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

/// The top-level entries of a JSON object, in file order, duplicates kept.
pub(crate) struct Entries(pub Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, Value>()? {
                    entries.push((key, value));
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(EntriesVisitor)
    }
}

/// Parses `bytes` as one JSON object; the error is serde_json's (with line and column).
pub(crate) fn object_entries(bytes: &[u8]) -> Result<Vec<(String, Value)>, serde_json::Error> {
    serde_json::from_slice::<Entries>(bytes).map(|e| e.0)
}

/// The first key that occurs twice, if any.
pub(crate) fn first_duplicate<'a>(keys: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = std::collections::HashSet::new();
    keys.into_iter().find(|k| !seen.insert(*k))
}

/// A short description of a JSON value's type, for error messages.
pub(crate) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
