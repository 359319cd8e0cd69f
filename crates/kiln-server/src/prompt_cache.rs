//! The prompt-encoding cache: chat frontends send the same prompt (and the same empty negative
//! prompt) again and again, and the text encoders take seconds, so the worker keeps the
//! encodings it made ([`kiln_pipelines::PromptEncoding`], on the host) and passes them back
//! instead of the texts.
//!
//! A least-recently-used map bounded by bytes: a hash map of the entries and an ordered map from
//! each entry's last use to its key, so a look-up and an eviction cost O(log n). A crate such as
//! `lru` bounds the number of entries, not their bytes, and an encoding's size depends on the
//! model and `max_sequence_length` (from kilobytes to tens of MiB), so the byte accounting would
//! be ours either way; this is that accounting and the order, with no new dependency.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::Arc;

/// The values under their keys, the least recently used evicted first to keep the bytes within
/// the budget.
pub struct LruBytes<K, V> {
    budget: usize,
    bytes: usize,
    tick: u64,
    entries: HashMap<K, Entry<V>>,
    /// Last use → key.
    order: BTreeMap<u64, K>,
    evictions: u64,
}

struct Entry<V> {
    value: Arc<V>,
    bytes: usize,
    used: u64,
}

impl<K: Hash + Eq + Clone, V> LruBytes<K, V> {
    /// An empty cache of at most `budget` bytes (0: it keeps nothing).
    pub fn new(budget: usize) -> Self {
        LruBytes {
            budget,
            bytes: 0,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            evictions: 0,
        }
    }

    /// The value under `key`, now the most recently used.
    pub fn get(&mut self, key: &K) -> Option<Arc<V>> {
        self.tick += 1;
        let entry = self.entries.get_mut(key)?;
        self.order.remove(&entry.used);
        entry.used = self.tick;
        self.order.insert(self.tick, key.clone());
        Some(entry.value.clone())
    }

    /// Keeps `value` (of `bytes` bytes) under `key`, evicting the least recently used entries
    /// until it fits. A value larger than the whole budget is not kept.
    pub fn insert(&mut self, key: K, value: Arc<V>, bytes: usize) {
        self.remove(&key);
        if bytes > self.budget {
            return;
        }
        while self.bytes + bytes > self.budget {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.bytes;
                self.evictions += 1;
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key.clone());
        self.entries.insert(
            key,
            Entry {
                value,
                bytes,
                used: self.tick,
            },
        );
        self.bytes += bytes;
    }

    fn remove(&mut self, key: &K) {
        if let Some(e) = self.entries.remove(key) {
            self.order.remove(&e.used);
            self.bytes -= e.bytes;
        }
    }

    /// The bytes of the values kept.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries evicted to make room so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn budget(&self) -> usize {
        self.budget
    }
}

/// The key of a prompt encoding in the server: the worker (each device encodes for itself), the
/// model, and what the encoding depends on ([`kiln_pipelines::PromptKey`]: the texts and every
/// setting the encoding reads, resolved).
pub type PromptCacheKey = (usize, usize, kiln_pipelines::PromptKey);

/// The server's cache, shared by the workers.
pub type PromptCache = std::sync::Mutex<LruBytes<PromptCacheKey, kiln_pipelines::PromptEncoding>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_go_first_to_keep_within_the_byte_budget() {
        let mut cache = LruBytes::new(100);
        cache.insert("a", Arc::new(1), 40);
        cache.insert("b", Arc::new(2), 40);
        assert_eq!((cache.len(), cache.bytes()), (2, 80));
        // Using `a` makes `b` the least recently used: it goes when `c` needs room.
        assert_eq!(cache.get(&"a").as_deref(), Some(&1));
        cache.insert("c", Arc::new(3), 40);
        assert_eq!(cache.get(&"b"), None);
        assert_eq!(cache.get(&"a").as_deref(), Some(&1));
        assert_eq!(cache.get(&"c").as_deref(), Some(&3));
        assert_eq!((cache.len(), cache.bytes(), cache.evictions()), (2, 80, 1));
        // An entry as large as the budget evicts every other one.
        cache.insert("d", Arc::new(4), 100);
        assert_eq!((cache.len(), cache.bytes(), cache.evictions()), (1, 100, 3));
        assert_eq!(cache.get(&"a"), None);
        // One larger than the budget is not kept (and evicts nothing).
        cache.insert("e", Arc::new(5), 101);
        assert_eq!(cache.get(&"e"), None);
        assert_eq!(cache.get(&"d").as_deref(), Some(&4));
        // Replacing a key replaces its bytes.
        cache.insert("d", Arc::new(6), 10);
        assert_eq!((cache.len(), cache.bytes()), (1, 10));
        assert_eq!(cache.get(&"d").as_deref(), Some(&6));
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let mut cache = LruBytes::new(0);
        cache.insert("a", Arc::new(1), 1);
        assert!(cache.is_empty());
        assert_eq!((cache.get(&"a"), cache.bytes(), cache.evictions()), (None, 0, 0));
    }
}
