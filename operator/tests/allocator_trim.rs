//! The allocator gives back what a burst of allocations left free, once trimmed
//! (`egressproxy_operator::shared::memory`). A test binary of its own: it reads the
//! process's resident size, which other tests running beside it would move.

#![forbid(unsafe_code)]

use egressproxy_operator::shared::memory::release_free_memory;

fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap_or(0)
}

#[test]
fn freed_pages_go_back_to_the_system() {
    // Many small blocks, then a few copies made after them, then the blocks freed: the
    // freed pages lie below the copies, not at the top of the heap, so free() keeps
    // them and only a trim returns them.
    let mut blocks: Vec<Vec<u8>> = (0..200_000).map(|i| vec![i as u8; 256]).collect();
    let survivors: Vec<Vec<u8>> = blocks.iter().step_by(1000).cloned().collect();
    let resident_full = resident_kib();
    blocks.clear();
    blocks.shrink_to_fit();
    let released = release_free_memory();
    let resident_after = resident_kib();
    std::hint::black_box(&survivors);
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        assert!(released, "malloc_trim released nothing");
        assert!(
            resident_after + 20_000 < resident_full,
            "resident {resident_full} KiB before, {resident_after} KiB after the trim"
        );
    }
}
