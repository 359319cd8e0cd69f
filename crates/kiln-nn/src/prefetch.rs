//! [`Prefetcher`]: the one-ahead weight transfer that both model offload (whole components) and
//! sequential offload (repeated blocks) use. It holds two slots: the *current* thing (handed out
//! last, possibly still computing) and the *prefetched* one (whose transfer was issued ahead).
//!
//! Entering a thing (a component, a block) that is not the current one: its weights come from
//! the prefetched slot when they are on their way, else they are transferred now (a prefetched
//! other thing is released first); the previous thing's results — the inputs of the one entered,
//! or results that depend on them — are awaited before its weights leave, so that they are no
//! longer read. [`Order`] says whether the previous one leaves before or after the entered one's
//! transfer is issued. [`Prefetcher::prefetch`] then issues the next thing's transfer.

use kiln_tensor::Tensor;

use crate::error::Result;
use crate::offload_log::OffloadLog;

/// Weights on their way to the device (transfers are issued, not awaited).
pub struct Placed {
    /// The name the [`OffloadLog`] records.
    pub name: String,
    /// The weights, in the order their owner walks them.
    pub weights: Vec<Tensor>,
    /// Bytes moved to the device.
    pub bytes: u64,
}

/// What a [`Prefetcher`] moves, and how.
pub trait Mover<K> {
    /// Issues the transfer of `key`'s weights to the device.
    fn transfer(&mut self, key: &K) -> Result<Placed>;
    /// Called when `key`'s device weights were dropped (before the release is logged).
    fn released(&mut self, key: &K) {
        let _ = key;
    }
}

/// When the previous thing's weights leave, relative to the entered one's transfer (when that
/// was not prefetched).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Await and release the previous thing first: the two never share the device (components,
    /// which are large).
    ReleaseFirst,
    /// Issue the transfer first, then await and release the previous thing: the transfer runs
    /// while the previous thing computes (blocks, two of which fit).
    TransferFirst,
}

/// The current and the prefetched slot of one offloaded sequence (see the module docs); every
/// transfer, await and release is logged to an [`OffloadLog`].
pub struct Prefetcher<K> {
    order: Order,
    log: OffloadLog,
    current: Option<(K, Placed)>,
    prefetched: Option<(K, Placed)>,
}

impl<K: PartialEq> Prefetcher<K> {
    pub fn new(order: Order, log: OffloadLog) -> Self {
        Prefetcher {
            order,
            log,
            current: None,
            prefetched: None,
        }
    }

    /// The device weights of `key`, which is about to run on `inputs` (the previous thing's
    /// results, or tensors that depend on them); see the module docs.
    pub fn enter(&mut self, key: K, inputs: &[&Tensor], mover: &mut dyn Mover<K>) -> Result<Vec<Tensor>> {
        if let Some((k, placed)) = &self.current {
            if *k == key {
                return Ok(placed.weights.clone());
            }
        }
        let previous = self.current.take();
        let prefetched = self.prefetched.take();
        let entered = match self.order {
            Order::ReleaseFirst => {
                self.leave(previous, inputs, mover)?;
                self.arrive(key, prefetched, mover)?
            }
            Order::TransferFirst => {
                let entered = self.arrive(key, prefetched, mover)?;
                self.leave(previous, inputs, mover)?;
                entered
            }
        };
        let weights = entered.1.weights.clone();
        self.current = Some(entered);
        Ok(weights)
    }

    /// Issues the transfer of `key`'s weights ahead of its [`Self::enter`], releasing another
    /// prefetched thing's. Nothing happens when `key` is the current or already the prefetched
    /// thing.
    pub fn prefetch(&mut self, key: K, mover: &mut dyn Mover<K>) -> Result<()> {
        let holds = |slot: &Option<(K, Placed)>| slot.as_ref().is_some_and(|(k, _)| *k == key);
        if holds(&self.current) || holds(&self.prefetched) {
            return Ok(());
        }
        if let Some(other) = self.prefetched.take() {
            self.release(other, mover);
        }
        let placed = self.transfer(&key, mover)?;
        self.prefetched = Some((key, placed));
        Ok(())
    }

    /// Releases both slots (the end of a call).
    pub fn finish(&mut self, mover: &mut dyn Mover<K>) {
        for held in [self.current.take(), self.prefetched.take()].into_iter().flatten() {
            self.release(held, mover);
        }
    }

    /// `key`'s weights: the prefetched ones when they are `key`'s, else a new transfer (after
    /// releasing the prefetched ones).
    fn arrive(&mut self, key: K, prefetched: Option<(K, Placed)>, mover: &mut dyn Mover<K>) -> Result<(K, Placed)> {
        match prefetched {
            Some((k, placed)) if k == key => Ok((k, placed)),
            other => {
                if let Some(other) = other {
                    self.release(other, mover);
                }
                let placed = self.transfer(&key, mover)?;
                Ok((key, placed))
            }
        }
    }

    /// Awaits `inputs` (so the previous thing's computation is done) and releases it.
    fn leave(&mut self, previous: Option<(K, Placed)>, inputs: &[&Tensor], mover: &mut dyn Mover<K>) -> Result<()> {
        if let Some(previous) = previous {
            for t in inputs {
                t.wait()?;
            }
            self.log.awaited(&previous.1.name);
            self.release(previous, mover);
        }
        Ok(())
    }

    fn transfer(&self, key: &K, mover: &mut dyn Mover<K>) -> Result<Placed> {
        let placed = mover.transfer(key)?;
        self.log.transferred(&placed.name, placed.bytes);
        Ok(placed)
    }

    fn release(&self, (key, placed): (K, Placed), mover: &mut dyn Mover<K>) {
        let Placed { name, weights, bytes } = placed;
        drop(weights);
        mover.released(&key);
        self.log.released(&name, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OffloadEvent::{self, Await, Release, Transfer};

    /// Moves named things of 1 byte and no weights, counting the releases it is told of.
    #[derive(Default)]
    struct Names {
        released: Vec<&'static str>,
    }

    impl Mover<&'static str> for Names {
        fn transfer(&mut self, key: &&'static str) -> Result<Placed> {
            Ok(Placed {
                name: key.to_string(),
                weights: Vec::new(),
                bytes: 1,
            })
        }
        fn released(&mut self, key: &&'static str) {
            self.released.push(key);
        }
    }

    fn events(order: Order, steps: impl FnOnce(&mut Prefetcher<&'static str>, &mut Names)) -> Vec<OffloadEvent> {
        let log = OffloadLog::new();
        log.set_recording(true);
        let mut p = Prefetcher::new(order, log.clone());
        let mut names = Names::default();
        steps(&mut p, &mut names);
        assert_eq!(log.weight_bytes(), 0, "every transfer is released in the end");
        log.events()
    }

    fn t(s: &str) -> OffloadEvent {
        Transfer(s.into())
    }
    fn a(s: &str) -> OffloadEvent {
        Await(s.into())
    }
    fn r(s: &str) -> OffloadEvent {
        Release(s.into())
    }

    /// The entered thing comes from the prefetched slot; the previous one is awaited and released
    /// before the next transfer; entering the current thing again changes nothing.
    #[test]
    fn a_prefetched_thing_is_entered_without_a_new_transfer() {
        for order in [Order::ReleaseFirst, Order::TransferFirst] {
            let got = events(order, |p, m| {
                p.enter("a", &[], m).unwrap();
                p.prefetch("b", m).unwrap();
                p.prefetch("b", m).unwrap();
                p.prefetch("a", m).unwrap();
                p.enter("b", &[], m).unwrap();
                p.enter("b", &[], m).unwrap();
                p.finish(m);
            });
            assert_eq!(got, [t("a"), t("b"), a("a"), r("a"), r("b")], "{order:?}");
        }
    }

    /// Entering something that was not prefetched: the prefetched other thing is released, and the
    /// previous one leaves before (components) or after (blocks) the new transfer is issued.
    #[test]
    fn the_order_says_when_the_previous_thing_leaves() {
        let steps = |p: &mut Prefetcher<&'static str>, m: &mut Names| {
            p.enter("a", &[], m).unwrap();
            p.prefetch("b", m).unwrap();
            p.enter("c", &[], m).unwrap();
            p.finish(m);
            assert_eq!(m.released.len(), 3);
        };
        assert_eq!(
            events(Order::ReleaseFirst, steps),
            [t("a"), t("b"), a("a"), r("a"), r("b"), t("c"), r("c")]
        );
        assert_eq!(
            events(Order::TransferFirst, steps),
            [t("a"), t("b"), r("b"), t("c"), a("a"), r("a"), r("c")]
        );
    }

    /// A new prefetch replaces another prefetched thing.
    #[test]
    fn prefetching_another_thing_releases_the_first() {
        let got = events(Order::ReleaseFirst, |p, m| {
            p.enter("a", &[], m).unwrap();
            p.prefetch("b", m).unwrap();
            p.prefetch("c", m).unwrap();
            p.finish(m);
            assert_eq!(m.released, ["b", "a", "c"]);
        });
        assert_eq!(got, [t("a"), t("b"), r("b"), t("c"), r("a"), r("c")]);
    }
}
