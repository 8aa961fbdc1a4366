//! Stand-ins for VMs' proxies on this host's own addresses, for the tests whose
//! instances must report an address an EndpointSlice accepts (the apiserver refuses
//! loopback addresses there).

use std::net::IpAddr;

/// This host's addresses that an EndpointSlice accepts (neither loopback nor
/// link-local), IPv4 first, as `ip -o addr` lists them.
pub fn host_addresses() -> Vec<IpAddr> {
    let output = std::process::Command::new("ip")
        .args(["-o", "addr", "show"])
        .output()
        .expect("run `ip -o addr show` (iproute2)");
    let text = String::from_utf8_lossy(&output.stdout);
    let mut addresses: Vec<IpAddr> = text
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|w| *w == "inet" || *w == "inet6")?;
            let ip: IpAddr = words.next()?.split('/').next()?.parse().ok()?;
            let link_local = match ip {
                IpAddr::V4(v4) => v4.is_link_local(),
                IpAddr::V6(v6) => v6.is_unicast_link_local(),
            };
            (!ip.is_loopback() && !link_local).then_some(ip)
        })
        .collect();
    addresses.sort_by_key(IpAddr::is_ipv6);
    addresses.dedup();
    addresses
}

/// A stand-in for the VM's proxy on every address of this host (one dual-stack
/// socket), closed when dropped.
pub struct ProxyStandIn {
    task: tokio::task::JoinHandle<()>,
}

impl ProxyStandIn {
    pub async fn listen(port: u16) -> ProxyStandIn {
        let listener = tokio::net::TcpListener::bind(("::", port)).await.unwrap();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        });
        ProxyStandIn { task }
    }

    /// A stand-in on `address` only: another address of the host with the same port
    /// may have its own, or none.
    pub async fn listen_on(address: IpAddr, port: u16) -> ProxyStandIn {
        let listener = tokio::net::TcpListener::bind((address, port))
            .await
            .unwrap();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        });
        ProxyStandIn { task }
    }

    /// A free port to listen on.
    pub async fn port() -> u16 {
        let probe = tokio::net::TcpListener::bind(("::", 0)).await.unwrap();
        probe.local_addr().unwrap().port()
    }
}

impl Drop for ProxyStandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}
