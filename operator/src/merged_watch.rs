//! The watches of several namespaces merged into one stream that a single reflector
//! store (and so a single controller) can follow.
//!
//! kube-runtime's store takes `Init` … `InitDone` to mean "this is now everything":
//! fed the interleaved lists of two namespaces, the last list to finish would replace
//! the other. So the merged stream guarantees:
//!
//! 1. Nothing comes out until every namespace has listed once; then one `Init`, an
//!    `InitApply` per object of every namespace, and one `InitDone`. The store becomes
//!    ready with the whole picture, as it would from one cluster-wide watch (and, like
//!    that watch, not before: a namespace whose watch keeps failing holds back all).
//! 2. Afterwards a namespace's relist (its watch expired or broke) becomes changes: an
//!    `Apply` per listed object and, when the list is complete, a `Delete` per object
//!    it no longer has, so the other namespaces' objects stay in the store.
//! 3. An object that comes back under a known name with another UID (deleted and
//!    created again while the watch was down) first gets a `Delete` of the old one, so
//!    whatever was kept for the old UID is forgotten.
//!
//! Watch errors pass through as they are.

use std::collections::{BTreeMap, BTreeSet};

use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::watcher::{self, Event};

/// Merges `streams`, each the watch of one namespace.
pub fn merge<K>(
    streams: Vec<BoxStream<'static, Result<Event<K>, watcher::Error>>>,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + Send + 'static,
{
    let merger = Merger::new(streams.len());
    let tagged = streams
        .into_iter()
        .enumerate()
        .map(|(index, stream)| stream.map(move |event| (index, event)).boxed());
    stream::select_all(tagged)
        .scan(merger, |merger, (index, event)| {
            let out: Vec<_> = match event {
                Ok(event) => merger.handle(index, event).into_iter().map(Ok).collect(),
                Err(error) => vec![Err(error)],
            };
            futures::future::ready(Some(stream::iter(out)))
        })
        .flatten()
}

/// What the merged stream knows of each namespace.
struct Merger<K> {
    namespaces: Vec<Namespace<K>>,
    /// Whether the first complete picture has gone out.
    started: bool,
}

struct Namespace<K> {
    /// The namespace's objects by name, as last seen.
    known: BTreeMap<String, K>,
    /// The names seen so far by a list in progress.
    listing: Option<BTreeSet<String>>,
    /// Whether a list has completed.
    listed: bool,
}

impl<K: Resource + Clone> Merger<K> {
    fn new(namespaces: usize) -> Self {
        Merger {
            namespaces: (0..namespaces)
                .map(|_| Namespace {
                    known: BTreeMap::new(),
                    listing: None,
                    listed: false,
                })
                .collect(),
            started: false,
        }
    }

    /// Takes one event of namespace `index`; the events to pass on.
    fn handle(&mut self, index: usize, event: Event<K>) -> Vec<Event<K>> {
        let namespace = &mut self.namespaces[index];
        let changes = match event {
            Event::Init => {
                namespace.listing = Some(BTreeSet::new());
                Vec::new()
            }
            Event::InitApply(object) => {
                if let Some(listing) = &mut namespace.listing {
                    listing.insert(name(&object));
                }
                namespace.apply(object)
            }
            Event::InitDone => {
                namespace.listed = true;
                let listed = namespace.listing.take();
                let gone: Vec<String> = namespace
                    .known
                    .keys()
                    .filter(|name| listed.as_ref().is_some_and(|l| !l.contains(*name)))
                    .cloned()
                    .collect();
                gone.iter()
                    .filter_map(|name| namespace.known.remove(name))
                    .map(Event::Delete)
                    .collect()
            }
            Event::Apply(object) => namespace.apply(object),
            Event::Delete(object) => {
                namespace.known.remove(&name(&object));
                vec![Event::Delete(object)]
            }
        };
        if self.started {
            return changes;
        }
        if !self.namespaces.iter().all(|namespace| namespace.listed) {
            return Vec::new();
        }
        self.started = true;
        let everything = self
            .namespaces
            .iter()
            .flat_map(|namespace| namespace.known.values().cloned())
            .map(Event::InitApply);
        std::iter::once(Event::Init)
            .chain(everything)
            .chain(std::iter::once(Event::InitDone))
            .collect()
    }
}

impl<K: Resource + Clone> Namespace<K> {
    /// Records `object`; an `Apply`, preceded by a `Delete` of a different object that
    /// had its name.
    fn apply(&mut self, object: K) -> Vec<Event<K>> {
        let replaced = self.known.insert(name(&object), object.clone());
        let mut changes = Vec::with_capacity(2);
        if let Some(old) = replaced.filter(|old| old.meta().uid != object.meta().uid) {
            changes.push(Event::Delete(old));
        }
        changes.push(Event::Apply(object));
        changes
    }
}

fn name<K: Resource>(object: &K) -> String {
    object.meta().name.clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;

    use super::*;

    fn object(name: &str, uid: &str) -> ConfigMap {
        let mut object = ConfigMap::default();
        object.metadata.name = Some(name.into());
        object.metadata.uid = Some(uid.into());
        object
    }

    /// Each event as `kind name/uid`, to compare whole sequences at a glance.
    fn describe(events: &[Event<ConfigMap>]) -> Vec<String> {
        let show = |kind: &str, object: &ConfigMap| {
            let meta = &object.metadata;
            format!(
                "{kind} {}/{}",
                meta.name.as_deref().unwrap_or_default(),
                meta.uid.as_deref().unwrap_or_default()
            )
        };
        events
            .iter()
            .map(|event| match event {
                Event::Init => "Init".to_owned(),
                Event::InitDone => "InitDone".to_owned(),
                Event::InitApply(o) => show("InitApply", o),
                Event::Apply(o) => show("Apply", o),
                Event::Delete(o) => show("Delete", o),
            })
            .collect()
    }

    fn feed(merger: &mut Merger<ConfigMap>, events: Vec<(usize, Event<ConfigMap>)>) -> Vec<String> {
        let out: Vec<_> = events
            .into_iter()
            .flat_map(|(index, event)| merger.handle(index, event))
            .collect();
        describe(&out)
    }

    #[test]
    fn nothing_until_every_namespace_listed_then_one_complete_list() {
        let mut merger = Merger::new(2);
        let held = feed(
            &mut merger,
            vec![
                (0, Event::Init),
                (0, Event::InitApply(object("a", "1"))),
                (1, Event::Init),
                (0, Event::InitDone),
                // Changes of a listed namespace while the other still lists.
                (0, Event::Apply(object("b", "2"))),
                (0, Event::Delete(object("a", "1"))),
                (1, Event::InitApply(object("c", "3"))),
            ],
        );
        assert_eq!(held, Vec::<String>::new());
        let first = feed(&mut merger, vec![(1, Event::InitDone)]);
        assert_eq!(
            first,
            ["Init", "InitApply b/2", "InitApply c/3", "InitDone"]
        );
        let later = feed(&mut merger, vec![(1, Event::Apply(object("d", "4")))]);
        assert_eq!(later, ["Apply d/4"]);
    }

    #[test]
    fn a_relist_of_one_namespace_only_changes_that_namespace() {
        let mut merger = Merger::new(2);
        feed(
            &mut merger,
            vec![
                (0, Event::Init),
                (0, Event::InitApply(object("a", "1"))),
                (0, Event::InitApply(object("b", "2"))),
                (0, Event::InitDone),
                (1, Event::Init),
                (1, Event::InitApply(object("c", "3"))),
                (1, Event::InitDone),
            ],
        );
        // Namespace 0's watch broke; meanwhile `a` was deleted and `b` made anew.
        let relist = feed(
            &mut merger,
            vec![
                (0, Event::Init),
                (0, Event::InitApply(object("b", "9"))),
                (0, Event::InitDone),
            ],
        );
        assert_eq!(relist, ["Delete b/2", "Apply b/9", "Delete a/1"]);
        // An empty relist of namespace 1 empties namespace 1 only.
        let relist = feed(&mut merger, vec![(1, Event::Init), (1, Event::InitDone)]);
        assert_eq!(relist, ["Delete c/3"]);
    }

    #[tokio::test]
    async fn errors_pass_through_and_events_flow_from_every_stream() {
        let listing = |name: &'static str| {
            stream::iter(vec![
                Ok(Event::Init),
                Ok(Event::InitApply(object(name, name))),
                Ok(Event::InitDone),
            ])
            .boxed()
        };
        let failing = stream::iter(vec![Err(watcher::Error::NoResourceVersion)])
            .chain(listing("b"))
            .boxed();
        let merged: Vec<_> = merge(vec![listing("a"), failing]).collect().await;
        let errors = merged.iter().filter(|event| event.is_err()).count();
        assert_eq!(errors, 1);
        let events: Vec<_> = merged.into_iter().filter_map(Result::ok).collect();
        let mut seen = describe(&events);
        seen[1..3].sort();
        assert_eq!(seen, ["Init", "InitApply a/a", "InitApply b/b", "InitDone"]);
    }
}
