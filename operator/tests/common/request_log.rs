//! A Kubernetes client that records every request it sends, for tests that count what
//! the operator asks of the apiserver. The apiserver's own request counters cannot tell
//! one test from another (one apiserver serves every test of a process) nor the
//! operator from the apiserver's own internal clients.

use std::sync::{Arc, Mutex};

use kube::client::Body;

/// `METHOD path?query` of every request, in the order sent.
#[derive(Clone, Default)]
pub struct RequestLog(Arc<Mutex<Vec<String>>>);

impl RequestLog {
    /// How many requests were sent so far.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// The requests sent after the first `mark`, other than watches, whose path names
    /// one of `resources` (`services`, `endpointslices`, …).
    pub fn reads_and_writes_of(&self, mark: usize, resources: &[&str]) -> Vec<String> {
        self.requests_since(mark, |_, path| {
            path.split('/').any(|part| resources.contains(&part))
        })
    }

    /// The lists (not watches) of `resource` (`proxies`, …) sent after the first `mark`:
    /// a GET whose path ends at the collection, in any namespace or in all.
    pub fn lists_of(&self, mark: usize, resource: &str) -> Vec<String> {
        self.requests_since(mark, |method, path| {
            method == "GET" && path.rsplit('/').next() == Some(resource)
        })
    }

    /// The requests sent after the first `mark`, other than watches, for which `wanted`
    /// holds of their method and path (without the query).
    fn requests_since(&self, mark: usize, wanted: impl Fn(&str, &str) -> bool) -> Vec<String> {
        self.0.lock().unwrap()[mark..]
            .iter()
            .filter(|request| !request.contains("watch=true") && !request.contains("watch=1"))
            .filter(|request| {
                let (method, rest) = request.split_once(' ').unwrap_or_default();
                wanted(method, rest.split('?').next().unwrap_or_default())
            })
            .cloned()
            .collect()
    }
}

/// A client that sends through `client` and records each request in the log.
pub fn recording(client: kube::Client, namespace: &str) -> (kube::Client, RequestLog) {
    let log = RequestLog::default();
    let recorded = log.clone();
    let service = tower::service_fn(move |request: http::Request<Body>| {
        let line = format!(
            "{} {}",
            request.method(),
            request
                .uri()
                .path_and_query()
                .map(ToString::to_string)
                .unwrap_or_default()
        );
        recorded.0.lock().unwrap().push(line);
        let client = client.clone();
        async move { client.send(request).await }
    });
    (kube::Client::new(service, namespace), log)
}
