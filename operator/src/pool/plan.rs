//! What a pool does next, decided from what it has: pure, so every rule is a row of a
//! table test (the same table as in `docs/operator.md`, "ProxyPool").
//!
//! Members are *updated* (made from the current template, at one of the listed spread
//! targets) or *outdated*. A member being deleted counts for nothing but its name.
//! 1. **Surplus**: updated members above `replicas` go, not-Ready ones first, then from
//!    the most crowded spread target, then the newest (highest index).
//! 2. **Outdated, not Ready**: they go at once; they serve nothing.
//! 3. **Outdated, Ready**: they go only while the Ready members left stay at or above
//!    `replicas - maxUnavailable`, the newest first. With `maxUnavailable: 0` an old
//!    member goes only once a new one is Ready: surge first.
//! 4. **Swap**: an updated member *replacing* a lost VM (its Proxy lost one and the
//!    current one has not passed a health check yet) goes at once, and a new member
//!    takes its place at its spread target, adopting a Ready spare there: one swap per
//!    adoptable spare at that target, the lowest index first. It serves nothing, so
//!    deleting it first keeps `replicas - maxUnavailable`; a crash after the delete
//!    leaves the pool one member short, which rule 5 fills with the same spare.
//! 5. **Create** updated members until there are `replicas`, while all live members
//!    stay within `replicas + maxSurge`; each goes to the spread target with the
//!    fewest members (ties: the first listed) and takes the lowest free index.
//!
//! Any other updated member that is not Ready stays (booting for the first time,
//! Degraded, or replacing with no spare to swap in): its Proxy heals it by itself,
//! and the pool's Service lists it again once it is Ready.

use std::collections::BTreeSet;

/// One member as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The member Proxy's name.
    pub name: String,
    /// The number in its name (`POOL-N`).
    pub index: u32,
    /// Made from the current template, at a listed spread target.
    pub updated: bool,
    /// Its Proxy is Ready.
    pub ready: bool,
    /// Its Proxy lost a VM and the one replacing it has not passed a health check yet.
    pub replacing: bool,
    /// Its Proxy is being deleted.
    pub deleting: bool,
    /// Which spread target (index into `spec.spread`) it is at, if any.
    pub target: Option<usize>,
}

/// The pool's wishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// `spec.replicas`.
    pub replicas: u32,
    /// `spec.maxSurge`.
    pub max_surge: u32,
    /// `spec.maxUnavailable`.
    pub max_unavailable: u32,
    /// How many spread targets are listed (0: none).
    pub targets: usize,
}

/// Why a member is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// More updated members than `replicas`.
    Surplus,
    /// Made from an older template or spread.
    Outdated,
    /// Replacing a lost VM while a Ready spare can take its place.
    Swapped,
}

/// A member to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMember {
    /// The number in its name.
    pub index: u32,
    /// The spread target it goes to, if targets are listed.
    pub target: Option<usize>,
    /// The member it takes the place of (a swap), which adopts a spare.
    pub replaces: Option<String>,
}

/// What to do now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Members to delete, by name, and why.
    pub delete: Vec<(String, Removal)>,
    /// Members to create.
    pub create: Vec<NewMember>,
}

/// The plan for `members` under `bounds` (module doc), with `adoptable[t]` Ready
/// spares nobody was promised at spread target `t` (at index 0 without targets).
pub fn plan(bounds: Bounds, members: &[Member], adoptable: &[u32]) -> Plan {
    let live: Vec<&Member> = members.iter().filter(|m| !m.deleting).collect();
    let mut going: BTreeSet<&str> = BTreeSet::new();
    let mut delete = Vec::new();
    let replicas = bounds.replicas as usize;

    // 1. Surplus updated members.
    let mut updated: Vec<&Member> = live.iter().copied().filter(|m| m.updated).collect();
    while updated.len() > replicas {
        let crowd = |m: &Member| {
            m.target
                .map(|t| updated.iter().filter(|o| o.target == Some(t)).count())
                .unwrap_or(0)
        };
        let Some(position) = (0..updated.len()).max_by_key(|&i| {
            let m = updated[i];
            (!m.ready, crowd(m), m.index)
        }) else {
            break;
        };
        let member = updated.remove(position);
        going.insert(&member.name);
        delete.push((member.name.clone(), Removal::Surplus));
    }

    // 2. Outdated members that are not Ready.
    let outdated: Vec<&Member> = live.iter().copied().filter(|m| !m.updated).collect();
    for member in outdated.iter().filter(|m| !m.ready) {
        going.insert(&member.name);
        delete.push((member.name.clone(), Removal::Outdated));
    }

    // 3. Outdated Ready members, within maxUnavailable.
    let min_ready = bounds.replicas.saturating_sub(bounds.max_unavailable) as usize;
    let mut ready_left = live
        .iter()
        .filter(|m| m.ready && !going.contains(m.name.as_str()))
        .count();
    let mut old_ready: Vec<&Member> = outdated.iter().copied().filter(|m| m.ready).collect();
    old_ready.sort_by_key(|m| std::cmp::Reverse(m.index));
    for member in old_ready {
        if ready_left <= min_ready {
            break;
        }
        ready_left -= 1;
        going.insert(&member.name);
        delete.push((member.name.clone(), Removal::Outdated));
    }

    // 4. Swaps: a member replacing a lost VM for a Ready spare at its target.
    let mut taken: BTreeSet<u32> = members.iter().map(|m| m.index).collect();
    let mut spares_left = adoptable.to_vec();
    let mut create = Vec::new();
    let mut replacing: Vec<&Member> = live
        .iter()
        .copied()
        .filter(|m| m.updated && m.replacing && !m.ready && !going.contains(m.name.as_str()))
        .collect();
    replacing.sort_by_key(|m| m.index);
    for member in replacing {
        let slot = match (bounds.targets, member.target) {
            (0, _) => 0,
            (_, Some(t)) => t,
            // At a place no longer listed: no spare is placed there.
            (_, None) => continue,
        };
        let Some(left) = spares_left.get_mut(slot).filter(|n| **n > 0) else {
            continue;
        };
        *left -= 1;
        going.insert(&member.name);
        delete.push((member.name.clone(), Removal::Swapped));
        let index = (0..).find(|i| !taken.contains(i)).unwrap_or(u32::MAX);
        taken.insert(index);
        create.push(NewMember {
            index,
            target: member.target,
            replaces: Some(member.name.clone()),
        });
    }

    // 5. New members, within maxSurge.
    let staying: Vec<&Member> = live
        .iter()
        .copied()
        .filter(|m| !going.contains(m.name.as_str()))
        .collect();
    let updated_staying = staying.iter().filter(|m| m.updated).count() + create.len();
    let need = replicas.saturating_sub(updated_staying);
    let room = (replicas + bounds.max_surge as usize).saturating_sub(staying.len() + create.len());
    let mut per_target: Vec<usize> = (0..bounds.targets)
        .map(|t| {
            staying.iter().filter(|m| m.target == Some(t)).count()
                + create.iter().filter(|c| c.target == Some(t)).count()
        })
        .collect();
    for _ in 0..need.min(room) {
        let index = (0..).find(|i| !taken.contains(i)).unwrap_or(u32::MAX);
        taken.insert(index);
        let target = (0..per_target.len()).min_by_key(|&t| (per_target[t], t));
        if let Some(t) = target {
            per_target[t] += 1;
        }
        create.push(NewMember {
            index,
            target,
            replaces: None,
        });
    }
    Plan { delete, create }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member from a short code: `u`/`o` (updated or outdated), `r`/`n` (Ready or
    /// not), optionally `d` (being deleted) and `x` (replacing a lost VM), then `@T`
    /// for spread target T.
    fn member(index: u32, code: &str) -> Member {
        let (flags, target) = match code.split_once('@') {
            Some((flags, target)) => (flags, Some(target.parse().unwrap())),
            None => (code, None),
        };
        Member {
            name: format!("pool-{index}"),
            index,
            updated: flags.contains('u'),
            ready: flags.contains('r'),
            deleting: flags.contains('d'),
            replacing: flags.contains('x'),
            target,
        }
    }

    fn members(codes: &[&str]) -> Vec<Member> {
        codes
            .iter()
            .enumerate()
            .map(|(i, code)| member(i as u32, code))
            .collect()
    }

    fn bounds(replicas: u32, max_surge: u32, max_unavailable: u32, targets: usize) -> Bounds {
        Bounds {
            replicas,
            max_surge,
            max_unavailable,
            targets,
        }
    }

    /// Members (by position = index), bounds, then the names deleted and the indices
    /// (with targets) created.
    type Row = (
        &'static str,
        Vec<&'static str>,
        Bounds,
        Vec<&'static str>,
        Vec<(u32, Option<usize>)>,
    );

    #[test]
    fn the_pool_plan_follows_its_table() {
        let rows: Vec<Row> = vec![
            (
                "a new pool creates every member at once",
                vec![],
                bounds(3, 1, 0, 0),
                vec![],
                vec![(0, None), (1, None), (2, None)],
            ),
            (
                "a full, Ready pool does nothing",
                vec!["ur", "ur", "ur"],
                bounds(3, 1, 0, 0),
                vec![],
                vec![],
            ),
            (
                "an updated member that is not Ready stays: its Proxy heals it",
                vec!["ur", "un", "ur"],
                bounds(3, 1, 0, 0),
                vec![],
                vec![],
            ),
            (
                "a member replacing its lost VM with no spare stays: its Proxy boots one",
                vec!["ur", "unx", "ur"],
                bounds(3, 1, 0, 0),
                vec![],
                vec![],
            ),
            (
                "scaling up fills the lowest free indices",
                vec!["ur", "dur", "ur"],
                bounds(4, 1, 0, 0),
                vec![],
                vec![(3, None), (4, None)],
            ),
            (
                "scaling down drops not-Ready members first, then the newest",
                vec!["ur", "un", "ur", "ur"],
                bounds(2, 1, 0, 0),
                vec!["pool-1", "pool-3"],
                vec![],
            ),
            (
                "a template change surges one new member first",
                vec!["or", "or", "or"],
                bounds(3, 1, 0, 0),
                vec![],
                vec![(3, None)],
            ),
            (
                "an old member goes once a new one is Ready, and the next is created",
                vec!["or", "or", "or", "ur"],
                bounds(3, 1, 0, 0),
                vec!["pool-2"],
                vec![(4, None)],
            ),
            (
                "no old member goes while the new one is not Ready",
                vec!["or", "or", "or", "un"],
                bounds(3, 1, 0, 0),
                vec![],
                vec![],
            ),
            (
                "maxUnavailable lets old members go before new ones are Ready",
                vec!["or", "or", "or"],
                bounds(3, 0, 1, 0),
                vec!["pool-2"],
                vec![(3, None)],
            ),
            (
                "outdated members that are not Ready go at once",
                vec!["on", "on", "or"],
                bounds(3, 1, 0, 0),
                vec!["pool-0", "pool-1"],
                vec![(3, None), (4, None), (5, None)],
            ),
            (
                "the last old member goes when the new ones are Ready",
                vec!["ur", "or", "ur", "ur"],
                bounds(3, 1, 0, 0),
                vec!["pool-1"],
                vec![],
            ),
            (
                "scaling to zero deletes everyone",
                vec!["ur", "or"],
                bounds(0, 1, 0, 0),
                vec!["pool-0", "pool-1"],
                vec![],
            ),
            (
                "new members go to the least used spread target",
                vec!["ur@0", "ur@0", "ur@1"],
                bounds(6, 1, 0, 3),
                vec![],
                vec![(3, Some(2)), (4, Some(1)), (5, Some(2))],
            ),
            (
                "scaling down takes from the most crowded target",
                vec!["ur@0", "ur@0", "ur@1"],
                bounds(2, 1, 0, 2),
                vec!["pool-1"],
                vec![],
            ),
        ];
        for (what, codes, bounds, deleted, created) in rows {
            let got = plan(bounds, &members(&codes), &[]);
            let got_deleted: Vec<&str> = got.delete.iter().map(|(n, _)| n.as_str()).collect();
            let mut got_deleted = got_deleted;
            got_deleted.sort();
            let got_created: Vec<(u32, Option<usize>)> =
                got.create.iter().map(|c| (c.index, c.target)).collect();
            assert_eq!((got_deleted, got_created), (deleted, created), "{what}");
        }
    }

    /// Members, bounds, adoptable spares per target, then the names deleted with why,
    /// and the members created (index, target, the member replaced).
    type SwapRow = (
        &'static str,
        Vec<&'static str>,
        Bounds,
        Vec<u32>,
        Vec<(&'static str, Removal)>,
        Vec<(u32, Option<usize>, Option<&'static str>)>,
    );

    #[test]
    fn a_member_replacing_its_vm_is_swapped_for_a_ready_spare_per_its_table() {
        let rows: Vec<SwapRow> = vec![
            (
                "a member replacing its lost VM is swapped for a Ready spare",
                vec!["ur", "unx"],
                bounds(2, 1, 0, 0),
                vec![1],
                vec![("pool-1", Removal::Swapped)],
                vec![(2, None, Some("pool-1"))],
            ),
            (
                "without a Ready spare it replaces its VM itself",
                vec!["ur", "unx"],
                bounds(2, 1, 0, 0),
                vec![0],
                vec![],
                vec![],
            ),
            (
                "a member booting for the first time is not swapped",
                vec!["ur", "un"],
                bounds(2, 1, 0, 0),
                vec![1],
                vec![],
                vec![],
            ),
            (
                "a Degraded member, not replacing, is not swapped",
                vec!["ur", "un"],
                bounds(2, 1, 0, 0),
                vec![1],
                vec![],
                vec![],
            ),
            (
                "one swap per Ready spare, the lowest index first",
                vec!["unx", "ur", "unx"],
                bounds(3, 1, 0, 0),
                vec![1],
                vec![("pool-0", Removal::Swapped)],
                vec![(3, None, Some("pool-0"))],
            ),
            (
                "a swap takes a spare at the member's own spread target",
                vec!["ur@0", "unx@1", "unx@0"],
                bounds(3, 1, 0, 2),
                vec![0, 1],
                vec![("pool-1", Removal::Swapped)],
                vec![(3, Some(1), Some("pool-1"))],
            ),
            (
                "a member already being deleted is not swapped again",
                vec!["ur", "dunx"],
                bounds(2, 1, 0, 0),
                vec![1],
                vec![],
                vec![(2, None, None)],
            ),
            (
                "an outdated member replacing its VM just goes, as any outdated one",
                vec!["ur", "onx"],
                bounds(2, 1, 0, 0),
                vec![1],
                vec![("pool-1", Removal::Outdated)],
                vec![(2, None, None)],
            ),
            (
                "swaps keep maxSurge 0 and maxUnavailable 0: the count does not change",
                vec!["ur", "unx"],
                bounds(2, 0, 0, 0),
                vec![2],
                vec![("pool-1", Removal::Swapped)],
                vec![(2, None, Some("pool-1"))],
            ),
        ];
        for (what, codes, bounds, adoptable, deleted, created) in rows {
            let got = plan(bounds, &members(&codes), &adoptable);
            let got_deleted: Vec<(&str, Removal)> =
                got.delete.iter().map(|(n, r)| (n.as_str(), *r)).collect();
            let got_created: Vec<(u32, Option<usize>, Option<&str>)> = got
                .create
                .iter()
                .map(|c| (c.index, c.target, c.replaces.as_deref()))
                .collect();
            assert_eq!((got_deleted, got_created), (deleted, created), "{what}");
        }
    }

    #[test]
    fn a_rollout_never_drops_below_replicas_minus_max_unavailable() {
        // A rollout of Ready outdated members under several bounds. A created member
        // becomes Ready only two steps later (it boots), so plans also run while new
        // members are not Ready; a deleted member vanishes at once.
        for (replicas, max_surge, max_unavailable) in [(3, 1, 0), (3, 0, 1), (4, 2, 1), (5, 1, 2)] {
            let b = bounds(replicas, max_surge, max_unavailable, 0);
            let min_ready = (replicas - max_unavailable) as usize;
            let most_live = (replicas + max_surge) as usize;
            let mut pool: Vec<(Member, u32)> =
                (0..replicas).map(|i| (member(i, "or"), 0)).collect();
            for step in 0..50 {
                for (m, booting) in &mut pool {
                    if *booting > 0 {
                        *booting -= 1;
                        m.ready = *booting == 0;
                    }
                }
                let members: Vec<Member> = pool.iter().map(|(m, _)| m.clone()).collect();
                let p = plan(b, &members, &[]);
                pool.retain(|(m, _)| !p.delete.iter().any(|(n, _)| *n == m.name));
                let ready = pool.iter().filter(|(m, _)| m.ready).count();
                assert!(
                    ready >= min_ready,
                    "{b:?}, step {step}: {ready} Ready after {p:?}"
                );
                assert!(
                    pool.len() + p.create.len() <= most_live,
                    "{b:?}, step {step}: over replicas + maxSurge with {p:?}"
                );
                for c in p.create {
                    let mut new = member(c.index, "u");
                    new.ready = false;
                    pool.push((new, 2));
                }
            }
            assert_eq!(pool.len(), replicas as usize, "{b:?}");
            assert!(
                pool.iter().all(|(m, _)| m.updated && m.ready),
                "{b:?}: the rollout finished"
            );
        }
    }
}
