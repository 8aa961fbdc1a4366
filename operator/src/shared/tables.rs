//! Giving a map's table back once most of its entries are gone.
//!
//! A `HashMap` keeps the table it grew to at its peak: after a burst of 5,000 Proxies,
//! every map keyed by Proxy would hold a 5,000-entry table for ever, though the
//! allocator trim ([`super::memory`]) could hand the pages back if the table were freed.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

/// The smallest table a shrink asks for: below this many entries a table is not worth
/// rebuilding.
const SMALL_TABLE: usize = 64;

/// Rebuilds `map`'s table at the smallest size that holds twice its entries, once that
/// is smaller than the table it has. A table keeps the size of its peak: after a burst
/// of 5,000 Proxies every map keyed by Proxy would hold a 5,000-entry table for ever.
/// Tables come in powers of two, so this happens once the entries fill less than
/// about a fifth of the table, and leaves them filling about a fifth to two fifths of
/// the new one: the next rebuild needs half of them gone again, and growing back needs
/// as many new entries as are left, so a mass delete pays one pass over the entries
/// left per halving. `shrink_to` compares against the table's real size; `capacity()`
/// would not do, as it stops counting a slot a removal left behind as a tombstone.
pub fn shrink_when_sparse<K: Eq + Hash, V, S: BuildHasher>(map: &mut HashMap<K, V, S>) {
    map.shrink_to(map.len().saturating_mul(2).max(SMALL_TABLE));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entries the table `map` has can hold: `clear` keeps the table and counts
    /// every slot as room again, which `capacity()` alone does not after removals.
    fn table_room(mut map: HashMap<u32, u32>) -> usize {
        map.clear();
        map.capacity()
    }

    /// Fills a map with `count` entries, then removes `removed` of them, shrinking
    /// after each removal as the operator's maps do.
    fn after_removals(map: &mut HashMap<u32, u32>, count: u32, removed: u32) {
        map.extend((0..count).map(|i| (i, i)));
        for i in 0..removed {
            map.remove(&i);
            shrink_when_sparse(map);
        }
    }

    #[test]
    fn a_map_emptied_after_a_burst_gives_its_table_back() {
        let mut map = HashMap::new();
        after_removals(&mut map, 5000, 5000);
        assert!(
            table_room(map) <= SMALL_TABLE * 2,
            "the peak table was kept"
        );
    }

    #[test]
    fn a_table_full_at_its_peak_is_given_back_too() {
        // Filled to the last slot its size allows, most removals leave tombstones.
        let mut map = HashMap::with_capacity(7000);
        let full = u32::try_from(map.capacity()).expect("a small map");
        after_removals(&mut map, full, full);
        assert!(
            table_room(map) <= SMALL_TABLE * 2,
            "the peak table was kept"
        );
    }

    #[test]
    fn a_map_still_two_fifths_full_keeps_its_table() {
        let mut map = HashMap::new();
        after_removals(&mut map, 5000, 0);
        let peak = map.capacity();
        for i in 0..3000 {
            map.remove(&i);
            shrink_when_sparse(&mut map);
        }
        assert_eq!(table_room(map), peak, "a map two fifths full was rebuilt");
    }
}
