//! The node's network: a namespace of its own, the address plan, and the uplink.
//!
//! Everything the node routes lives in one network namespace the test made
//! ([`NodeNetwork`]): containerd's CNI bridge and the pods' veths, kube-proxy's rules, the
//! node's address. Pod and Service addresses are private ranges that exist only there, so
//! no packet of the cluster leaves namespaces the test made. The same ranges can be
//! reused by every test process at once, as each node has its own namespace.
//!
//! The node's interface is one end of a veth pair. Alone, the other end stays in the
//! node's namespace; [`NodeNetwork::connect_uplink`] moves it into another namespace the
//! test made (the hypervisor's), as a node's link to a routed network: it routes the
//! given ranges (the VMs' network) through it, and the other side routes the node's
//! address back. Pods reach those ranges through the node, masqueraded to [`NODE_IP`]
//! by the CNI bridge as a pod leaving its node is in most clusters.

use std::net::Ipv4Addr;

use crate::netns::NetworkNamespace;

/// The node's address (its `InternalIP`), on [`NODE_LINK`].
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 2);
/// The other end of the node's link: the uplink's address once connected.
pub const UPLINK_IP: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 1);
/// The prefix length of [`NODE_IP`] and [`UPLINK_IP`].
pub const LINK_PREFIX: u8 = 24;
/// The node's interface.
pub const NODE_LINK: &str = "node0";
/// The other end of [`NODE_LINK`] (named so in either namespace).
pub const UPLINK: &str = "uplink0";
/// The pods' addresses on this node (the CNI bridge's range).
pub const POD_CIDR: &str = "10.244.0.0/24";
/// The cluster's pod range, which kube-proxy tells in-cluster traffic by.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The Service range. It must be the kube-harness's `--service-cluster-ip-range`.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The ClusterIP of the `kube-dns` Service (CoreDNS), which the kubelet gives pods.
pub const DNS_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The CNI bridge inside the node's namespace.
pub const POD_BRIDGE: &str = "cni0";

/// The node's network namespace with its link; deleted (with everything in it) on drop.
#[derive(Debug)]
pub struct NodeNetwork {
    netns: NetworkNamespace,
    /// The namespace holding [`UPLINK`] once moved there.
    uplink: Option<String>,
}

impl NodeNetwork {
    /// Creates the namespace and the node's link, with [`NODE_IP`] and a default route
    /// through it (kube-proxy's rules then catch Service addresses the node itself dials).
    pub fn create() -> anyhow::Result<Self> {
        let netns = NetworkNamespace::create("eptest-node")?;
        netns.ip(&[
            "link", "add", NODE_LINK, "type", "veth", "peer", "name", UPLINK,
        ])?;
        netns.ip(&[
            "addr",
            "add",
            &format!("{NODE_IP}/{LINK_PREFIX}"),
            "dev",
            NODE_LINK,
        ])?;
        netns.ip(&["link", "set", NODE_LINK, "up"])?;
        netns.ip(&["link", "set", UPLINK, "up"])?;
        netns.ip(&["route", "add", "default", "dev", NODE_LINK])?;
        Ok(Self {
            netns,
            uplink: None,
        })
    }

    /// The namespace.
    pub fn netns(&self) -> &NetworkNamespace {
        &self.netns
    }

    /// Moves [`UPLINK`] into `other` (a namespace the test made) with [`UPLINK_IP`],
    /// routes each of `routed` (CIDRs that live behind it, such as the VMs' network) from
    /// the node through it, and replaces the node's default route by one through it.
    pub fn connect_uplink(&mut self, other: &str, routed: &[&str]) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.uplink.is_none(),
            "the node's uplink is already connected"
        );
        self.netns.ip(&["link", "set", UPLINK, "netns", other])?;
        let there = |args: &[&str]| -> anyhow::Result<()> {
            let mut all = vec!["-n", other];
            all.extend_from_slice(args);
            crate::netns::ip(&all)
        };
        there(&[
            "addr",
            "add",
            &format!("{UPLINK_IP}/{LINK_PREFIX}"),
            "dev",
            UPLINK,
        ])?;
        there(&["link", "set", UPLINK, "up"])?;
        self.uplink = Some(other.to_owned());
        self.netns.ip(&[
            "route",
            "replace",
            "default",
            "via",
            &UPLINK_IP.to_string(),
            "dev",
            NODE_LINK,
        ])?;
        for cidr in routed {
            self.netns.ip(&[
                "route",
                "replace",
                cidr,
                "via",
                &UPLINK_IP.to_string(),
                "dev",
                NODE_LINK,
            ])?;
        }
        Ok(())
    }

    /// The CNI network configuration for containerd: a bridge with the pods' range,
    /// masquerading what leaves it, with host-local address management whose state lives
    /// in `ipam_dir`.
    pub fn cni_config(ipam_dir: &std::path::Path) -> String {
        serde_json::json!({
            "cniVersion": "0.4.0",
            "name": "pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": POD_BRIDGE,
                    "isGateway": true,
                    "ipMasq": true,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": ipam_dir,
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}]
                    }
                },
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        })
        .to_string()
    }
}

impl Drop for NodeNetwork {
    fn drop(&mut self) {
        // The uplink end lives in the other namespace; deleting it takes the node's end too.
        if let Some(other) = self.uplink.take() {
            let _ = crate::netns::ip(&["-n", &other, "link", "del", UPLINK]);
        }
    }
}
