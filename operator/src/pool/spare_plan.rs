//! What a pool does with its spares, decided from what it has: pure, so every rule is
//! a row of a table test (the same table as in `docs/operator.md`, "Spares").
//!
//! A spare is *updated* (made from the current template, placed at a current spread
//! target) or *outdated*; *promised* while a new member's adopt annotation names it
//! and that member has no instance yet; *retiring* once the pool marked it for
//! deletion (a compare-and-set of its tags, so no member adopts it any more).
//! 1. **Adopt** ([`pick`]): a new member takes a Ready, updated spare that nobody was
//!    promised, placed where the member goes, the oldest first; none: it is created
//!    cold.
//! 2. **Retiring**: deleted.
//! 3. **No hand-over** (the provider does not declare `CAPABILITY_UPDATE_TAGS`): every
//!    spare is deleted (none can be adopted) and none is created.
//! 4. **Outdated** or **stuck** (not Ready within the template's
//!    `provisioningTimeoutSeconds`), not promised: retired.
//! 5. **Surplus**: updated spares above `spec.spares` are retired, not-Ready ones first,
//!    then the newest.
//! 6. **Create** updated spares until there are `spec.spares` besides the promised
//!    ones, each at the spread target with the fewest spares (ties: the first listed).

/// One spare as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spare {
    /// Its provider id.
    pub id: String,
    /// The number in its key (`<pool-uid>-spare-N`).
    pub serial: u32,
    /// Where it was placed (the `placed-at` tag).
    pub at: String,
    /// Made from the current template, at a current spread target.
    pub updated: bool,
    /// It runs and its proxy passes the health check.
    pub ready: bool,
    /// A new member's adopt annotation names it.
    pub promised: bool,
    /// The pool marked it for deletion.
    pub retiring: bool,
    /// Not Ready within the template's provisioning timeout.
    pub stuck: bool,
}

/// What to do with the spares now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SparePlan {
    /// Spares to delete at once (retiring ones, or any without a hand-over).
    pub delete: Vec<String>,
    /// Spares to retire (mark, then delete), and why.
    pub retire: Vec<(String, &'static str)>,
    /// Spares to create, by placement (`placed-at`).
    pub create: Vec<String>,
}

/// Whether a new member may adopt `spare` (rule 1): Ready, updated, and nobody's yet.
pub fn adoptable(spare: &Spare) -> bool {
    spare.ready && spare.updated && !spare.promised && !spare.retiring && !spare.stuck
}

/// How many spares a new member could adopt at each of `places`.
pub fn adoptable_at(spares: &[Spare], places: &[String]) -> Vec<u32> {
    places
        .iter()
        .map(|at| {
            spares
                .iter()
                .filter(|s| adoptable(s) && &s.at == at)
                .count() as u32
        })
        .collect()
}

/// The spare a member going to `at` adopts, if any (rule 1); marks it promised.
pub fn pick(spares: &mut [Spare], at: &str) -> Option<String> {
    let spare = spares
        .iter_mut()
        .filter(|s| adoptable(s) && s.at == at)
        .min_by_key(|s| s.serial)?;
    spare.promised = true;
    Some(spare.id.clone())
}

/// The plan for `spares`, with `wanted` spares spread across `targets` (the
/// `placed-at` of each spread target, or the template's placement alone), when the
/// provider can hand instances over (`hand_over`).
pub fn plan(wanted: u32, hand_over: bool, targets: &[String], spares: &[Spare]) -> SparePlan {
    let mut todo = SparePlan::default();
    for spare in spares {
        if spare.retiring || !hand_over {
            todo.delete.push(spare.id.clone());
        }
    }
    if !hand_over {
        return todo;
    }
    let live: Vec<&Spare> = spares.iter().filter(|s| !s.retiring).collect();
    for spare in live.iter().filter(|s| !s.promised) {
        if !spare.updated {
            todo.retire
                .push((spare.id.clone(), "made from an older template or spread"));
        } else if spare.stuck {
            todo.retire.push((
                spare.id.clone(),
                "not Ready within the template's provisioningTimeoutSeconds",
            ));
        }
    }
    let mut kept: Vec<&Spare> = live
        .iter()
        .copied()
        .filter(|s| s.updated && !s.stuck && !s.promised)
        .collect();
    while kept.len() > wanted as usize {
        let Some(position) = (0..kept.len()).max_by_key(|&i| (!kept[i].ready, kept[i].serial))
        else {
            break;
        };
        let spare = kept.remove(position);
        todo.retire
            .push((spare.id.clone(), "more spares than spec.spares"));
    }
    let mut counts: Vec<usize> = targets
        .iter()
        .map(|t| kept.iter().filter(|s| &s.at == t).count())
        .collect();
    for _ in kept.len()..wanted as usize {
        let Some(fewest) = (0..targets.len()).min_by_key(|&i| (counts[i], i)) else {
            break;
        };
        counts[fewest] += 1;
        todo.create.push(targets[fewest].clone());
    }
    todo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spare(id: &str, serial: u32, at: &str) -> Spare {
        Spare {
            id: id.into(),
            serial,
            at: at.into(),
            updated: true,
            ready: true,
            promised: false,
            retiring: false,
            stuck: false,
        }
    }

    fn targets(list: &[&str]) -> Vec<String> {
        list.iter().map(|t| (*t).to_owned()).collect()
    }

    /// A row: what it shows, `spec.spares`, whether the provider hands over, the
    /// places, the spares, the plan.
    type Row<'a> = (&'a str, u32, bool, &'a [String], Vec<Spare>, SparePlan);

    /// The table in `docs/operator.md` ("Spares"), row for row.
    #[test]
    fn the_spare_table() {
        let t = targets(&["template"]);
        let two = targets(&["host/h0", "host/h1"]);
        let booting = Spare {
            ready: false,
            ..spare("s2", 2, "template")
        };
        let old = Spare {
            updated: false,
            ..spare("s1", 1, "template")
        };
        let promised_old = Spare {
            promised: true,
            ..old.clone()
        };
        let retiring = Spare {
            retiring: true,
            ..spare("s3", 3, "template")
        };
        let promised = Spare {
            promised: true,
            ..spare("s4", 4, "template")
        };
        let rows: Vec<Row> = vec![
            (
                "none wanted, none there: nothing",
                0,
                true,
                &t,
                vec![],
                SparePlan::default(),
            ),
            (
                "missing spares are created",
                2,
                true,
                &t,
                vec![spare("s0", 0, "template")],
                SparePlan {
                    create: targets(&["template"]),
                    ..SparePlan::default()
                },
            ),
            (
                "a retiring spare is deleted and replaced",
                1,
                true,
                &t,
                vec![retiring.clone()],
                SparePlan {
                    delete: vec!["s3".into()],
                    create: targets(&["template"]),
                    ..SparePlan::default()
                },
            ),
            (
                "without a hand-over every spare goes and none is created",
                2,
                false,
                &t,
                vec![spare("s0", 0, "template"), retiring.clone()],
                SparePlan {
                    delete: vec!["s0".into(), "s3".into()],
                    ..SparePlan::default()
                },
            ),
            (
                "an outdated spare is retired and replaced",
                1,
                true,
                &t,
                vec![old.clone()],
                SparePlan {
                    retire: vec![("s1".into(), "made from an older template or spread")],
                    create: targets(&["template"]),
                    ..SparePlan::default()
                },
            ),
            (
                "an outdated spare that is promised stays",
                0,
                true,
                &t,
                vec![promised_old],
                SparePlan::default(),
            ),
            (
                "a spare stuck booting is retired and replaced",
                1,
                true,
                &t,
                vec![Spare {
                    ready: false,
                    stuck: true,
                    ..spare("s6", 6, "template")
                }],
                SparePlan {
                    retire: vec![(
                        "s6".into(),
                        "not Ready within the template's provisioningTimeoutSeconds",
                    )],
                    create: targets(&["template"]),
                    ..SparePlan::default()
                },
            ),
            (
                "surplus: the booting one goes first",
                1,
                true,
                &t,
                vec![spare("s0", 0, "template"), booting.clone()],
                SparePlan {
                    retire: vec![("s2".into(), "more spares than spec.spares")],
                    ..SparePlan::default()
                },
            ),
            (
                "surplus among Ready ones: the newest goes",
                1,
                true,
                &t,
                vec![spare("s0", 0, "template"), spare("s5", 5, "template")],
                SparePlan {
                    retire: vec![("s5".into(), "more spares than spec.spares")],
                    ..SparePlan::default()
                },
            ),
            (
                "a promised spare counts for nothing: another is created",
                1,
                true,
                &t,
                vec![promised],
                SparePlan {
                    create: targets(&["template"]),
                    ..SparePlan::default()
                },
            ),
            (
                "new spares go where the fewest are",
                3,
                true,
                &two,
                vec![spare("s0", 0, "host/h0")],
                SparePlan {
                    create: targets(&["host/h1", "host/h0"]),
                    ..SparePlan::default()
                },
            ),
        ];
        for (row, wanted, hand_over, at, spares, expected) in rows {
            assert_eq!(plan(wanted, hand_over, at, &spares), expected, "{row}");
        }
    }

    #[test]
    fn a_member_adopts_the_oldest_ready_updated_spare_at_its_placement_once() {
        let mut spares = vec![
            Spare {
                ready: false,
                ..spare("booting", 0, "host/h0")
            },
            Spare {
                updated: false,
                ..spare("old", 1, "host/h0")
            },
            spare("elsewhere", 2, "host/h1"),
            spare("newer", 4, "host/h0"),
            spare("older", 3, "host/h0"),
        ];
        assert_eq!(pick(&mut spares, "host/h0").as_deref(), Some("older"));
        assert_eq!(pick(&mut spares, "host/h0").as_deref(), Some("newer"));
        assert_eq!(
            pick(&mut spares, "host/h0"),
            None,
            "each spare is promised once"
        );
        assert_eq!(pick(&mut spares, "zone/z0"), None);
    }

    #[test]
    fn adoptable_spares_are_counted_per_place() {
        let spares = vec![
            spare("a", 0, "host/h0"),
            Spare {
                ready: false,
                ..spare("booting", 1, "host/h0")
            },
            Spare {
                promised: true,
                ..spare("told", 2, "host/h1")
            },
            spare("b", 3, "host/h1"),
            spare("c", 4, "host/h1"),
        ];
        let places = targets(&["host/h0", "host/h1", "host/h2"]);
        assert_eq!(adoptable_at(&spares, &places), [1, 2, 0]);
    }
}
