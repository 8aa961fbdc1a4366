//! The watches of several namespaces merged into one stream that a single reflector
//! store (and so a single controller) can follow.
//!
//! kube-runtime's store takes `Init` … `InitDone` to mean "this is now everything":
//! fed the interleaved lists of two namespaces, the last list to finish would replace
//! the other. And one namespace whose watch keeps failing (a missing Role) must not
//! hold back the others. So the merged stream guarantees:
//!
//! 1. It starts with `Init` and `InitDone` of nothing: the store is ready at once, and
//!    every namespace's objects then come as changes, each as soon as its own watch
//!    has them. Which namespaces have listed is [`crate::k8s::watch_health`]'s business.
//! 2. A namespace's list (its first, or a relist after its watch expired or broke)
//!    becomes an `Apply` per listed object and, when the list is complete, a `Delete`
//!    per object it no longer has, so the other namespaces' objects stay in the store.
//! 3. An object that comes back under a known name with another UID (deleted and
//!    created again while the watch was down) first gets a `Delete` of the old one, so
//!    whatever was kept for the old UID is forgotten.
//! 4. It keeps no second copy of the objects: per namespace only each object's name
//!    and UID. The object a `Delete` of 2 or 3 carries is looked up (in the store the
//!    stream feeds, which still holds it).
//!
//! Watch errors pass through as they are.

use std::collections::{BTreeMap, BTreeSet};

use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::watcher::{self, Event};

/// One namespace's watch.
pub type NamespaceWatch<K> = BoxStream<'static, Result<Event<K>, watcher::Error>>;

/// Merges `streams`, each the watch of the namespace it is paired with; `lookup`
/// finds an object by namespace and name as the merged stream last passed it on.
pub fn merge<K, L>(
    streams: Vec<(String, NamespaceWatch<K>)>,
    lookup: L,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + Send + 'static,
    L: Fn(&str, &str) -> Option<K> + Send + 'static,
{
    let (namespaces, streams): (Vec<String>, Vec<_>) = streams.into_iter().unzip();
    let merger = Merger::new(namespaces, lookup);
    let tagged = streams
        .into_iter()
        .enumerate()
        .map(|(index, stream)| stream.map(move |event| (index, event)).boxed());
    let ready = stream::iter([Ok(Event::Init), Ok(Event::InitDone)]);
    let changes = stream::select_all(tagged)
        .scan(merger, |merger, (index, event)| {
            let out: Vec<_> = match event {
                Ok(event) => merger.handle(index, event).into_iter().map(Ok).collect(),
                Err(error) => vec![Err(error)],
            };
            futures::future::ready(Some(stream::iter(out)))
        })
        .flatten();
    ready.chain(changes)
}

/// What the merged stream knows of each namespace.
struct Merger<L> {
    namespaces: Vec<Namespace>,
    lookup: L,
}

struct Namespace {
    name: String,
    /// The UIDs of the namespace's objects, by name, as last passed on.
    known: BTreeMap<String, String>,
    /// The names seen so far by a list in progress.
    listing: Option<BTreeSet<String>>,
}

impl<L> Merger<L> {
    fn new(namespaces: Vec<String>, lookup: L) -> Self {
        Merger {
            namespaces: namespaces
                .into_iter()
                .map(|name| Namespace {
                    name,
                    known: BTreeMap::new(),
                    listing: None,
                })
                .collect(),
            lookup,
        }
    }

    /// Takes one event of namespace `index`; the events to pass on.
    fn handle<K>(&mut self, index: usize, event: Event<K>) -> Vec<Event<K>>
    where
        K: Resource + Clone,
        L: Fn(&str, &str) -> Option<K>,
    {
        let lookup = &self.lookup;
        let namespace = &mut self.namespaces[index];
        match event {
            Event::Init => {
                namespace.listing = Some(BTreeSet::new());
                Vec::new()
            }
            Event::InitApply(object) => {
                if let Some(listing) = &mut namespace.listing {
                    listing.insert(name(&object));
                }
                namespace.apply(object, lookup)
            }
            Event::InitDone => {
                let listed = namespace.listing.take().unwrap_or_default();
                let gone: Vec<String> = namespace
                    .known
                    .keys()
                    .filter(|name| !listed.contains(*name))
                    .cloned()
                    .collect();
                gone.into_iter()
                    .filter_map(|gone| {
                        namespace.known.remove(&gone);
                        lookup(&namespace.name, &gone).map(Event::Delete)
                    })
                    .collect()
            }
            Event::Apply(object) => namespace.apply(object, lookup),
            Event::Delete(object) => {
                namespace.known.remove(&name(&object));
                vec![Event::Delete(object)]
            }
        }
    }
}

impl Namespace {
    /// Records `object`; an `Apply`, preceded by a `Delete` of a different object that
    /// had its name.
    fn apply<K, L>(&mut self, object: K, lookup: &L) -> Vec<Event<K>>
    where
        K: Resource + Clone,
        L: Fn(&str, &str) -> Option<K>,
    {
        let name = name(&object);
        let uid = object.meta().uid.clone().unwrap_or_default();
        let mut changes = Vec::with_capacity(2);
        if let Some(old_uid) = self.known.insert(name.clone(), uid.clone())
            && old_uid != uid
            && let Some(old) = lookup(&self.name, &name)
        {
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
    use std::collections::HashMap;

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

    /// A store fed by what the merger passes on, as the reflector's would be.
    type Store = std::rc::Rc<std::cell::RefCell<HashMap<(String, String), ConfigMap>>>;

    fn merger(namespaces: &[&str]) -> (Merger<impl Fn(&str, &str) -> Option<ConfigMap>>, Store) {
        let store = Store::default();
        let reading = store.clone();
        let lookup = move |namespace: &str, name: &str| {
            reading
                .borrow()
                .get(&(namespace.to_owned(), name.to_owned()))
                .cloned()
        };
        let names = namespaces.iter().map(|n| (*n).to_owned()).collect();
        (Merger::new(names, lookup), store)
    }

    fn feed<L: Fn(&str, &str) -> Option<ConfigMap>>(
        merger: &mut Merger<L>,
        store: &Store,
        events: Vec<(usize, Event<ConfigMap>)>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for (index, event) in events {
            let namespace = merger.namespaces[index].name.clone();
            for change in merger.handle(index, event) {
                let key = |o: &ConfigMap| (namespace.clone(), o.metadata.name.clone().unwrap());
                match &change {
                    Event::Apply(o) => {
                        store.borrow_mut().insert(key(o), o.clone());
                    }
                    Event::Delete(o) => {
                        store.borrow_mut().remove(&key(o));
                    }
                    _ => {}
                }
                out.push(change);
            }
        }
        describe(&out)
    }

    #[test]
    fn each_namespace_comes_as_soon_as_it_lists_whatever_the_others_do() {
        let (mut merger, store) = merger(&["a", "b"]);
        let first = feed(
            &mut merger,
            &store,
            vec![
                (0, Event::Init),
                (0, Event::InitApply(object("a", "1"))),
                (1, Event::Init),
                (0, Event::InitDone),
                (0, Event::Apply(object("b", "2"))),
                (0, Event::Delete(object("a", "1"))),
            ],
        );
        assert_eq!(first, ["Apply a/1", "Apply b/2", "Delete a/1"]);
        let second = feed(
            &mut merger,
            &store,
            vec![
                (1, Event::InitApply(object("c", "3"))),
                (1, Event::InitDone),
            ],
        );
        assert_eq!(second, ["Apply c/3"]);
    }

    #[test]
    fn a_relist_of_one_namespace_only_changes_that_namespace() {
        let (mut merger, store) = merger(&["a", "b"]);
        feed(
            &mut merger,
            &store,
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
            &store,
            vec![
                (0, Event::Init),
                (0, Event::InitApply(object("b", "9"))),
                (0, Event::InitDone),
            ],
        );
        assert_eq!(relist, ["Delete b/2", "Apply b/9", "Delete a/1"]);
        // An empty relist of namespace 1 empties namespace 1 only.
        let relist = feed(
            &mut merger,
            &store,
            vec![(1, Event::Init), (1, Event::InitDone)],
        );
        assert_eq!(relist, ["Delete c/3"]);
        assert_eq!(store.borrow().len(), 1);
    }

    #[tokio::test]
    async fn the_store_is_ready_at_once_and_a_failing_namespace_holds_back_no_other() {
        let listing = |name: &'static str| {
            stream::iter(vec![
                Ok(Event::Init),
                Ok(Event::InitApply(object(name, name))),
                Ok(Event::InitDone),
            ])
            .boxed()
        };
        let failing = stream::iter(vec![Err(watcher::Error::NoResourceVersion)]).boxed();
        let streams = vec![("a".to_owned(), listing("a")), ("b".to_owned(), failing)];
        let merged: Vec<_> = merge(streams, |_: &str, _: &str| None).collect().await;
        let errors = merged.iter().filter(|event| event.is_err()).count();
        assert_eq!(errors, 1);
        let events: Vec<_> = merged.into_iter().filter_map(Result::ok).collect();
        assert_eq!(describe(&events), ["Init", "InitDone", "Apply a/a"]);
    }
}
