//! Whether a node has room for one more proxy pod, as the kubelet's admission judges
//! it: for every resource the new pod requests, the node's allocatable amount minus the
//! requests of the pods bound to it that have not terminated must cover the new pod's
//! request, and the node must take one pod more (`pods` is counted like a resource).
//!
//! The provider binds its pods itself (`spec.nodeName`), so no scheduler checks the fit
//! before the kubelet does: without this check a pod that does not fit is made, the
//! kubelet rejects it (`OutOfcpu`, `OutOfmemory`, `OutOfpods`) and its instance goes
//! STOPPED. With it the Create is refused with an error the caller can act on.
//!
//! Amounts are kept in thousandths of their unit (millicores, milli-bytes, milli-pods),
//! so every Kubernetes quantity is a whole number and sums are exact.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// The resource that counts pods.
const PODS: &str = "pods";

/// Amounts by resource name, in thousandths.
pub type Amounts = BTreeMap<String, i128>;

/// A node's allocatable resources and what its live pods request of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeRoom {
    /// `status.allocatable`.
    pub allocatable: Amounts,
    /// The sum of the requests of the pods bound to it that have not terminated, `pods`
    /// counting them.
    pub requested: Amounts,
}

impl NodeRoom {
    /// The room of `node` with `pods` (the pods bound to it that have not terminated).
    pub fn of(node: &Node, pods: &[Pod]) -> Self {
        let allocatable = node
            .status
            .as_ref()
            .and_then(|status| status.allocatable.as_ref())
            .map(amounts)
            .unwrap_or_default();
        let mut requested = Amounts::new();
        for pod in pods {
            add(&mut requested, &pod_requests(pod));
        }
        NodeRoom {
            allocatable,
            requested,
        }
    }

    /// What the node lacks for a pod requesting `wanted` (as [`new_pod_requests`] gives
    /// it), in words: `None` when the pod fits. A resource the node does not report
    /// allocatable is one it has none of, as for the kubelet.
    pub fn shortfall(&self, wanted: &Amounts) -> Option<String> {
        wanted
            .iter()
            .filter(|(_, amount)| **amount > 0)
            .find_map(|(resource, amount)| {
                let allocatable = self.allocatable.get(resource).copied().unwrap_or(0);
                let requested = self.requested.get(resource).copied().unwrap_or(0);
                (requested + amount > allocatable).then(|| {
                    format!(
                        "{resource}: {} of {} allocatable requested already, one more pod asks {}",
                        show(resource, requested),
                        show(resource, allocatable),
                        show(resource, *amount)
                    )
                })
            })
    }
}

/// What a new proxy pod with `resources` requests, `pods` included. The apiserver makes
/// a request of every limit set without one, so the kubelet counts those too.
pub fn new_pod_requests(resources: &ResourceRequirements) -> Amounts {
    let mut wanted = resources.limits.as_ref().map(amounts).unwrap_or_default();
    wanted.extend(resources.requests.as_ref().map(amounts).unwrap_or_default());
    wanted.insert(PODS.to_owned(), 1000);
    wanted
}

/// What `pod` requests of its node, as the kubelet counts it: per resource, the larger
/// of its containers' sum and its largest init container, plus its overhead; and one
/// pod.
pub fn pod_requests(pod: &Pod) -> Amounts {
    let mut total = Amounts::new();
    let Some(spec) = pod.spec.as_ref() else {
        return total;
    };
    for container in &spec.containers {
        add(
            &mut total,
            &container_requests(container.resources.as_ref()),
        );
    }
    for init in spec.init_containers.iter().flatten() {
        for (resource, amount) in container_requests(init.resources.as_ref()) {
            let entry = total.entry(resource).or_default();
            *entry = (*entry).max(amount);
        }
    }
    add(
        &mut total,
        &spec.overhead.as_ref().map(amounts).unwrap_or_default(),
    );
    *total.entry(PODS.to_owned()).or_default() += 1000;
    total
}

fn container_requests(resources: Option<&ResourceRequirements>) -> Amounts {
    resources
        .and_then(|resources| resources.requests.as_ref())
        .map(amounts)
        .unwrap_or_default()
}

fn add(total: &mut Amounts, more: &Amounts) {
    for (resource, amount) in more {
        *total.entry(resource.clone()).or_default() += amount;
    }
}

/// The amounts of a resource map; a quantity that does not parse counts as none (the
/// apiserver validated it, so this is a quantity form this parser does not know).
fn amounts(map: &BTreeMap<String, Quantity>) -> Amounts {
    map.iter()
        .filter_map(|(resource, quantity)| Some((resource.clone(), thousandths(&quantity.0)?)))
        .collect()
}

/// An amount for a message: millicores for `cpu`, whole units otherwise.
fn show(resource: &str, thousandths: i128) -> String {
    if resource == "cpu" {
        format!("{thousandths}m")
    } else {
        (thousandths / 1000).to_string()
    }
}

/// A Kubernetes quantity (`100m`, `1.5`, `64Mi`, `2G`, `1e3`) in thousandths of its
/// unit, rounded up as Kubernetes rounds a milli-value; `None` when it is not one.
pub fn thousandths(quantity: &str) -> Option<i128> {
    let quantity = quantity.trim();
    let number_end = quantity
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(quantity.len());
    let (number, suffix) = quantity.split_at(number_end);
    let (negative, digits) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number.strip_prefix('+').unwrap_or(number)),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    if whole.is_empty() && fraction.is_empty()
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
        || whole.len() + fraction.len() > 30
    {
        return None;
    }
    let mantissa: i128 = format!("{whole}{fraction}").parse().ok()?;
    // value = mantissa × 10^exponent × binary, in thousandths: 10^(exponent + 3).
    let mut exponent = 3 - i32::try_from(fraction.len()).ok()?;
    let mut binary: i128 = 1;
    match suffix {
        "" => {}
        "n" => exponent -= 9,
        "u" => exponent -= 6,
        "m" => exponent -= 3,
        "k" => exponent += 3,
        "M" => exponent += 6,
        "G" => exponent += 9,
        "T" => exponent += 12,
        "P" => exponent += 15,
        "E" => exponent += 18,
        "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => {
            let power = "KMGTPE".find(&suffix[..1])? as u32 + 1;
            binary = 1024_i128.pow(power);
        }
        _ => {
            let power: i32 = suffix
                .strip_prefix('e')
                .or_else(|| suffix.strip_prefix('E'))?
                .parse()
                .ok()?;
            exponent += power;
        }
    }
    let scaled = mantissa.checked_mul(binary)?;
    let value = if exponent >= 0 {
        scaled.checked_mul(10_i128.checked_pow(exponent.unsigned_abs())?)?
    } else {
        let divisor = 10_i128.checked_pow(exponent.unsigned_abs())?;
        (scaled + divisor - 1) / divisor
    };
    Some(if negative { -value } else { value })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{Container, NodeStatus, PodSpec};

    use super::*;

    fn quantities(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
            .collect()
    }

    fn requesting(pairs: &[(&str, &str)]) -> ResourceRequirements {
        ResourceRequirements {
            requests: Some(quantities(pairs)),
            ..ResourceRequirements::default()
        }
    }

    fn pod(containers: &[&[(&str, &str)]], init: &[&[(&str, &str)]]) -> Pod {
        let container = |pairs: &&[(&str, &str)]| Container {
            resources: Some(requesting(pairs)),
            ..Container::default()
        };
        Pod {
            spec: Some(PodSpec {
                containers: containers.iter().map(container).collect(),
                init_containers: Some(init.iter().map(container).collect()),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn node(allocatable: &[(&str, &str)]) -> Node {
        Node {
            status: Some(NodeStatus {
                allocatable: Some(quantities(allocatable)),
                ..NodeStatus::default()
            }),
            ..Node::default()
        }
    }

    #[test]
    fn quantities_parse_as_kubernetes_writes_them() {
        let cases = [
            ("100m", Some(100)),
            ("2", Some(2000)),
            ("1.5", Some(1500)),
            ("0.1", Some(100)),
            ("64Mi", Some(64 * 1024 * 1024 * 1000)),
            ("1Gi", Some(1024_i128.pow(3) * 1000)),
            ("2k", Some(2_000_000)),
            ("2G", Some(2_000_000_000_000)),
            ("1e3", Some(1_000_000)),
            ("1E-3", Some(1)),
            ("1u", Some(1)),
            ("1n", Some(1)),
            ("-1", Some(-1000)),
            ("+5", Some(5000)),
            ("", None),
            ("m", None),
            ("1Qi", None),
            ("1.2.3", None),
            ("1e", None),
        ];
        for (quantity, expected) in cases {
            assert_eq!(thousandths(quantity), expected, "{quantity:?}");
        }
    }

    #[test]
    fn a_pod_requests_its_containers_sum_or_its_largest_init_container() {
        let requests = pod_requests(&pod(
            &[&[("cpu", "100m")], &[("cpu", "50m"), ("memory", "1Mi")]],
            &[&[("cpu", "120m")], &[("memory", "4Mi")]],
        ));
        assert_eq!(requests["cpu"], 150);
        assert_eq!(requests["memory"], 4 * 1024 * 1024 * 1000);
        assert_eq!(requests[PODS], 1000);
    }

    #[test]
    fn a_new_pod_fits_while_every_resource_it_asks_for_is_left() {
        let node = node(&[("cpu", "300m"), ("memory", "1Gi"), ("pods", "3")]);
        let wanted = new_pod_requests(&requesting(&[("cpu", "100m")]));
        let one = pod(&[&[("cpu", "100m")]], &[]);

        let room = NodeRoom::of(&node, std::slice::from_ref(&one));
        assert_eq!(room.shortfall(&wanted), None);
        let room = NodeRoom::of(&node, &[one.clone(), one.clone()]);
        assert_eq!(room.shortfall(&wanted), None, "exactly full after it");
        let room = NodeRoom::of(&node, &[one.clone(), one.clone(), one]);
        let short = room.shortfall(&wanted).unwrap();
        assert!(short.starts_with("cpu: 300m of 300m"), "{short}");
    }

    #[test]
    fn the_pod_count_and_unreported_resources_count_too() {
        let wanted = new_pod_requests(&requesting(&[("cpu", "10m")]));
        let full = NodeRoom::of(&node(&[("cpu", "4"), ("pods", "1")]), &[pod(&[&[]], &[])]);
        assert!(full.shortfall(&wanted).unwrap().starts_with("pods: 1 of 1"));

        let gpu = new_pod_requests(&requesting(&[("example.com/gpu", "1")]));
        let none = NodeRoom::of(&node(&[("cpu", "4"), ("pods", "10")]), &[]);
        assert!(none.shortfall(&gpu).unwrap().contains("0 of 0 allocatable"));
    }

    #[test]
    fn a_limit_without_a_request_is_requested() {
        let resources = ResourceRequirements {
            limits: Some(quantities(&[("memory", "128Mi"), ("cpu", "1")])),
            requests: Some(quantities(&[("cpu", "100m")])),
            ..ResourceRequirements::default()
        };
        let wanted = new_pod_requests(&resources);
        assert_eq!(wanted["cpu"], 100);
        assert_eq!(wanted["memory"], 128 * 1024 * 1024 * 1000);
    }
}
