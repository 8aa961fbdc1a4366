//! Step 1 of CreateInstance: check the request against the contract and the agent's
//! configuration, and resolve everything Create needs, before touching a hypervisor.
//!
//! Every problem is reported at once as INVALID_ARGUMENT naming its field
//! (`placement.host`, `placement.machine_type`, `placement.image`, `name`, `tags["k"]`,
//! `cloud_init.user_data`, ...). A bad cloud-init document that is the only problem
//! keeps its own reason (`INVALID_CLOUD_CONFIG`); several problems together have the
//! class's reason, as one error has one reason.
//!
//! The plan names the hosts the instance may go to: the host asked for, the hosts of
//! the zone asked for (`hosts[].zone`), or every host; which of them takes it is chosen
//! later by room ([`crate::provider::room`]). The plan carries the digest of the
//! request's spec
//! (placement as given, cloud-init, proxy port), stored in the domain's metadata, so a
//! repeated Create with the same key and another spec is ALREADY_EXISTS.

use egressproxy_provider::pb::placement::Location;
use egressproxy_provider::{pb, validation};
use sha2::{Digest, Sha256};

use crate::config::{Attachment, Config, HostConfig, ImageConfig, MachineType};
use crate::error::{ConfigProblem, Error};
use crate::guest::cloud_init::{SeedDocuments, seed_documents};
use crate::libvirt::naming::{InstanceNames, hostname_for_key};
use crate::libvirt::xml::metadata::check_xml_safe;

/// What a Create will make, resolved from the request and the configuration.
#[derive(Debug, Clone)]
pub struct CreatePlan {
    /// The hosts the instance may go to, in configuration order (one when a host was
    /// asked for).
    pub candidates: Vec<HostConfig>,
    /// The location as asked for: kept with the instance, so that Get answers a zone
    /// for an instance created in a zone.
    pub location: Option<Location>,
    /// The machine type's name and size.
    pub machine_type: (String, MachineType),
    /// The image's name and configuration.
    pub image: (String, ImageConfig),
    /// Names of the domain and volumes.
    pub names: InstanceNames,
    /// The guest's hostname.
    pub hostname: String,
    /// The seed's documents: the user's, and the guest-agent bootstrap beside them.
    pub documents: SeedDocuments,
    /// SHA-256 (hex) of the request's spec.
    pub spec_sha256: String,
    /// The address identity asked for.
    pub address_identity: Option<String>,
    /// The address asked for (only where every host has a static block).
    pub requested_address: Option<std::net::IpAddr>,
}

/// Checks `request` and resolves it against `config`. See the module docs.
pub fn plan_create(
    config: &Config,
    request: &pb::CreateInstanceRequest,
) -> Result<CreatePlan, Error> {
    validation::check_create_request(request)?;
    let placement = request
        .placement
        .as_ref()
        .expect("validated: placement is set");
    let ResolvedParts {
        candidates,
        machine,
        image,
        mut violations,
    } = resolve_parts(config, placement);
    violations.extend(undeclared_address_fields(config, request));
    if let Err(e) = check_xml_safe(&request.name) {
        violations.push(("name".into(), e.to_string()));
    }
    for (key, value) in &request.tags {
        if let Err(e) = check_xml_safe(key).and_then(|()| check_xml_safe(value)) {
            violations.push((validation::map_entry_path("tags", key), e.to_string()));
        }
    }
    let cloud_init = request.cloud_init.clone().unwrap_or_default();
    let guest_agent = image.as_ref().map(|i| i.guest_agent).unwrap_or_default();
    let documents = match seed_documents(
        &cloud_init.user_data,
        cloud_init.vendor_data.as_deref(),
        guest_agent,
    ) {
        Ok(documents) => Some(documents),
        // Alone, the cloud-init error goes out as it is, with its own reason.
        Err(e) if violations.is_empty() => return Err(e.into()),
        Err(e) => {
            violations.extend(e.field_violations());
            None
        }
    };
    if !violations.is_empty() {
        return Err(Error::InvalidFields { violations });
    }
    let (Some(candidates), Some(machine), Some(image), Some(documents)) =
        (candidates, machine, image, documents)
    else {
        return Err(no_hosts());
    };
    let names = InstanceNames::for_key(&request.key).map_err(|e| Error::InvalidArgument {
        field: "key",
        reason: e.to_string(),
    })?;
    Ok(CreatePlan {
        candidates,
        location: placement.location.clone(),
        machine_type: (placement.machine_type.clone(), machine),
        image: (placement.image.clone(), image),
        hostname: hostname_for_key(&request.key),
        names,
        documents,
        spec_sha256: spec_sha256(request),
        address_identity: request.address_identity.clone(),
        requested_address: request
            .requested_address
            .as_deref()
            .and_then(|text| validation::parse_requested_address(text).ok()),
    })
}

/// Whether the agent honours address identities with this configuration: when every
/// host either attaches its instances to a libvirt network, whose DHCP host list the
/// agent can reserve an address in, or to a bridge with a static block
/// (`staticAddresses`), from which the agent gives addresses itself. A bridge's DHCP
/// server (if any) is not the agent's, so without a block it could not keep a promise
/// there. GetCapabilities declares CAPABILITY_ADDRESS_IDENTITY exactly then.
pub fn address_identities_supported(config: &Config) -> bool {
    config.hosts.iter().all(|host| {
        matches!(host.attachment(), Attachment::Network(_)) || host.static_block().is_some()
    })
}

/// Whether the agent honours requested addresses with this configuration: when every
/// host gives addresses from a static block, where any free address of the block can be
/// granted at once. GetCapabilities declares CAPABILITY_REQUESTED_ADDRESS exactly then.
pub fn requested_addresses_supported(config: &Config) -> bool {
    !config.hosts.is_empty()
        && config
            .hosts
            .iter()
            .all(|host| host.static_block().is_some())
}

/// The address fields the agent does not honour with this configuration: refused, as the
/// contract requires, rather than ignored, so a caller never takes the address a VM
/// happens to get for one it can keep.
///
/// `requested_address` is honoured only where every host has a static block: libvirt's
/// dnsmasq does not hand out a reserved address while its lease to another MAC (a
/// deleted instance's) has not expired, and libvirt offers no call to end a lease, so on
/// a libvirt network the agent could not give a released address to another identity as
/// the contract demands.
fn undeclared_address_fields(
    config: &Config,
    request: &pb::CreateInstanceRequest,
) -> impl Iterator<Item = (String, String)> {
    let identity_refused =
        request.address_identity.is_some() && !address_identities_supported(config);
    let request_refused =
        request.requested_address.is_some() && !requested_addresses_supported(config);
    [
        (
            "address_identity",
            identity_refused,
            "kvm-agent does not declare CAPABILITY_ADDRESS_IDENTITY here: a host attaches its \
             instances to a bridge without staticAddresses, where the agent cannot reserve \
             an address; leave address_identity unset (the instance gets an address of its \
             host's network), or give that host a static block",
        ),
        (
            "requested_address",
            request_refused,
            "kvm-agent does not declare CAPABILITY_REQUESTED_ADDRESS here: a host has no \
             staticAddresses block; leave requested_address unset (with an \
             address_identity, the instance keeps the address it is given)",
        ),
    ]
    .into_iter()
    .filter(|(_, refused, _)| *refused)
    .map(|(field, _, why)| (field.to_owned(), why.to_owned()))
}

/// Unreachable while `Config::validate` rejects an empty host list; kept so that a
/// configuration built in code answers with the configuration's own error.
fn no_hosts() -> Error {
    Error::config(vec![ConfigProblem::new(
        "hosts",
        "no hosts configured; add at least one hypervisor",
    )])
}

/// A placement resolved against the configuration (ValidatePlacement's answer).
#[derive(Debug, Clone)]
pub struct ResolvedPlacement {
    /// The hosts the instance may go to, in configuration order.
    pub candidates: Vec<HostConfig>,
    /// The location as asked for.
    pub location: Option<Location>,
    /// The machine type's name and size.
    pub machine_type: (String, MachineType),
    /// The image's name and configuration.
    pub image: (String, ImageConfig),
}

impl ResolvedPlacement {
    /// The placement as the contract states it: the location asked for, or `chosen`
    /// (the host a Create would pick) when none was.
    pub fn to_contract(&self, chosen: &str) -> pb::Placement {
        pb::Placement {
            location: Some(
                self.location
                    .clone()
                    .unwrap_or_else(|| Location::Host(chosen.to_owned())),
            ),
            machine_type: self.machine_type.0.clone(),
            image: self.image.0.clone(),
        }
    }
}

/// Checks `placement` and resolves it against `config` as Create would: every unknown
/// name is INVALID_ARGUMENT naming its field, all at once.
pub fn resolve_placement(
    config: &Config,
    placement: Option<&pb::Placement>,
) -> Result<ResolvedPlacement, Error> {
    validation::check_placement_request(placement)?;
    let placement = placement.expect("validated: placement is set");
    let ResolvedParts {
        candidates,
        machine,
        image,
        violations,
    } = resolve_parts(config, placement);
    if !violations.is_empty() {
        return Err(Error::InvalidFields { violations });
    }
    let (Some(candidates), Some(machine), Some(image)) = (candidates, machine, image) else {
        return Err(no_hosts());
    };
    Ok(ResolvedPlacement {
        candidates,
        location: placement.location.clone(),
        machine_type: (placement.machine_type.clone(), machine),
        image: (placement.image.clone(), image),
    })
}

struct ResolvedParts {
    candidates: Option<Vec<HostConfig>>,
    machine: Option<MachineType>,
    image: Option<ImageConfig>,
    violations: Vec<(String, String)>,
}

fn resolve_parts(config: &Config, placement: &pb::Placement) -> ResolvedParts {
    let mut violations: Vec<(String, String)> = Vec::new();
    let candidates = match &placement.location {
        Some(Location::Host(name)) => match config.host(name) {
            Some(host) => Some(vec![host.clone()]),
            None => {
                violations.push((
                    "placement.host".into(),
                    unknown("host", name, host_names(config)),
                ));
                None
            }
        },
        Some(Location::Zone(zone)) => {
            let hosts: Vec<HostConfig> = config
                .hosts
                .iter()
                .filter(|h| h.zone.as_deref() == Some(zone.as_str()))
                .cloned()
                .collect();
            if hosts.is_empty() {
                violations.push((
                    "placement.zone".into(),
                    unknown("zone", zone, zone_names(config)),
                ));
                None
            } else {
                Some(hosts)
            }
        }
        None => Some(config.hosts.clone()).filter(|hosts| !hosts.is_empty()),
    };
    let machine = config.machine_types.get(&placement.machine_type).cloned();
    if machine.is_none() {
        violations.push((
            "placement.machine_type".into(),
            unknown(
                "machine type",
                &placement.machine_type,
                config.machine_types.keys().map(String::as_str),
            ),
        ));
    }
    let image = config.images.get(&placement.image).cloned();
    if image.is_none() {
        violations.push((
            "placement.image".into(),
            unknown(
                "image",
                &placement.image,
                config.images.keys().map(String::as_str),
            ),
        ));
    }
    ResolvedParts {
        candidates,
        machine,
        image,
        violations,
    }
}

fn host_names(config: &Config) -> impl Iterator<Item = &str> {
    config.hosts.iter().map(|h| h.name.as_str())
}

/// The configured zones, each once, in configuration order.
pub fn zone_names(config: &Config) -> impl Iterator<Item = &str> {
    let mut seen = std::collections::HashSet::new();
    config
        .hosts
        .iter()
        .filter_map(|h| h.zone.as_deref())
        .filter(move |zone| seen.insert(*zone))
}

fn unknown<'a>(what: &str, name: &str, known: impl Iterator<Item = &'a str>) -> String {
    let known: Vec<&str> = known.collect();
    if known.is_empty() {
        format!("unknown {what} {name:?}: none is configured")
    } else {
        format!(
            "unknown {what} {name:?}: this provider offers {}",
            known.join(", ")
        )
    }
}

/// SHA-256 (hex) of what must match for a repeated Create to return the same instance:
/// the placement as requested, cloud-init, the proxy port, and the address identity
/// and requested address when set. Each field is
/// length-prefixed, so no two specs encode alike.
pub fn spec_sha256(request: &pb::CreateInstanceRequest) -> String {
    let mut hash = Sha256::new();
    let mut field = |tag: &[u8], value: &[u8]| {
        hash.update(tag);
        hash.update((value.len() as u64).to_be_bytes());
        hash.update(value);
    };
    let placement = request.placement.clone().unwrap_or_default();
    match &placement.location {
        Some(Location::Host(host)) => field(b"host", host.as_bytes()),
        Some(Location::Zone(zone)) => field(b"zone", zone.as_bytes()),
        None => field(b"anywhere", b""),
    }
    field(b"machine_type", placement.machine_type.as_bytes());
    field(b"image", placement.image.as_bytes());
    let cloud_init = request.cloud_init.clone().unwrap_or_default();
    field(b"user_data", &cloud_init.user_data);
    match &cloud_init.vendor_data {
        Some(vendor) => field(b"vendor_data", vendor),
        None => field(b"no_vendor_data", b""),
    }
    field(b"proxy_port", &request.proxy_port.to_be_bytes());
    // Only when set, so that the digest of an instance made without one is unchanged.
    if let Some(identity) = &request.address_identity {
        field(b"address_identity", identity.as_bytes());
    }
    if let Some(requested) = &request.requested_address {
        field(b"requested_address", requested.as_bytes());
    }
    hex::encode(hash.finalize())
}

#[cfg(test)]
mod tests {
    use egressproxy_provider::ProviderError;

    use super::*;

    fn config() -> Config {
        Config::parse(
            "hosts:\n- {name: hv1, local: true, zone: z1}\n- {name: hv2, local: true}\n\
             - {name: hv3, local: true, zone: z1}\n\
             machineTypes:\n  small: {vcpus: 1, memoryMiB: 1024, diskGiB: 10}\n\
             images:\n  debian-12: {url: 'https://example.org/d.qcow2'}\n",
        )
        .unwrap()
    }

    fn request() -> pb::CreateInstanceRequest {
        pb::CreateInstanceRequest {
            key: "uid-1".into(),
            name: "ns/proxy".into(),
            tags: [("cluster".to_string(), "dev".to_string())].into(),
            placement: Some(pb::Placement {
                location: None,
                machine_type: "small".into(),
                image: "debian-12".into(),
            }),
            cloud_init: Some(pb::CloudInit {
                user_data: b"#cloud-config\npackages: [squid]\n".to_vec(),
                vendor_data: None,
            }),
            proxy_port: 3128,
            ..Default::default()
        }
    }

    /// The contract's view of a plan's error: what the gRPC edge answers.
    fn contract(error: Error) -> ProviderError {
        error.to_provider_error()
    }

    fn fields(error: impl Into<ProviderError>) -> Vec<String> {
        let error = error.into();
        assert_eq!(
            error.class,
            egressproxy_provider::ErrorClass::InvalidArgument
        );
        error
            .field_violations
            .into_iter()
            .map(|v| v.field)
            .collect()
    }

    fn candidates(plan: &CreatePlan) -> Vec<&str> {
        plan.candidates.iter().map(|h| h.name.as_str()).collect()
    }

    #[test]
    fn a_request_may_go_to_the_host_it_names_its_zones_hosts_or_any() {
        let plan = plan_create(&config(), &request()).unwrap();
        assert_eq!(candidates(&plan), ["hv1", "hv2", "hv3"]);
        assert_eq!(plan.location, None);
        assert_eq!(plan.machine_type.1.disk_gib, 10);
        assert_eq!(plan.image.0, "debian-12");
        assert_eq!(plan.names.domain, "egressproxy-uid-1");
        assert_eq!(plan.hostname, "egressproxy-uid-1");
        assert!(String::from_utf8_lossy(&plan.documents.user_data).contains("qemu-guest-agent"));
        let mut on_hv2 = request();
        on_hv2.placement.as_mut().unwrap().location = Some(Location::Host("hv2".into()));
        assert_eq!(
            candidates(&plan_create(&config(), &on_hv2).unwrap()),
            ["hv2"]
        );
        let mut in_z1 = request();
        in_z1.placement.as_mut().unwrap().location = Some(Location::Zone("z1".into()));
        let plan = plan_create(&config(), &in_z1).unwrap();
        assert_eq!(candidates(&plan), ["hv1", "hv3"]);
        assert_eq!(plan.location, Some(Location::Zone("z1".into())));
    }

    #[test]
    fn every_unknown_name_and_bad_field_is_reported_at_once() {
        let mut bad = request();
        bad.name = "line\nbreak".into();
        bad.tags.insert("t".into(), "tab\t".into());
        bad.placement = Some(pb::Placement {
            location: Some(Location::Host("hv9".into())),
            machine_type: "huge".into(),
            image: "arch".into(),
        });
        bad.cloud_init.as_mut().unwrap().user_data = b"#cloud-config\n[1, 2]\n".to_vec();
        assert_eq!(
            fields(plan_create(&config(), &bad).unwrap_err()),
            [
                "placement.host",
                "placement.machine_type",
                "placement.image",
                "name",
                "tags[\"t\"]",
                "cloud_init.user_data"
            ]
        );
        let mut zoned = request();
        zoned.placement.as_mut().unwrap().location = Some(Location::Zone("z".into()));
        let err = plan_create(&config(), &zoned).unwrap_err();
        assert!(err.to_string().contains("this provider offers z1"), "{err}");
        assert_eq!(fields(err), ["placement.zone"]);
        // The contract's own checks come first.
        let mut no_key = request();
        no_key.key.clear();
        assert_eq!(
            fields(plan_create(&config(), &no_key).unwrap_err()),
            ["key"]
        );
    }

    #[test]
    fn an_identity_is_planned_on_networks_and_refused_with_a_bridge() {
        let mut with_identity = request();
        with_identity.address_identity = Some("uid-1".into());
        let plan = plan_create(&config(), &with_identity).unwrap();
        assert_eq!(plan.address_identity.as_deref(), Some("uid-1"));
        assert!(address_identities_supported(&config()));
        // The identity is part of the spec: the same key with another one is another
        // spec; without one the digest is what it always was.
        assert_ne!(plan.spec_sha256, spec_sha256(&request()));
        let mut bridged = config();
        bridged.hosts[1].bridge = Some("br0".into());
        assert!(!address_identities_supported(&bridged));
        let error = contract(plan_create(&bridged, &with_identity).unwrap_err());
        assert_eq!(error.reason, "INVALID_ARGUMENT");
        assert!(
            error.field_violations[0]
                .description
                .contains("CAPABILITY_ADDRESS_IDENTITY"),
            "{error:?}"
        );
        assert_eq!(fields(error), ["address_identity"]);
        assert!(plan_create(&bridged, &request()).is_ok());
    }

    #[test]
    fn a_requested_address_is_refused() {
        let mut with_address = request();
        with_address.address_identity = Some("uid-1".into());
        with_address.requested_address = Some("192.0.2.10".into());
        let error = contract(plan_create(&config(), &with_address).unwrap_err());
        assert!(
            error.field_violations[0]
                .description
                .contains("CAPABILITY_REQUESTED_ADDRESS"),
            "{error:?}"
        );
        assert_eq!(fields(error), ["requested_address"]);
    }

    fn static_block() -> crate::config::StaticAddresses {
        crate::config::StaticAddresses {
            first: "192.0.2.10".parse().unwrap(),
            last: "192.0.2.20".parse().unwrap(),
            prefix_length: 24,
            gateway: None,
            dns: vec![],
        }
    }

    #[test]
    fn static_blocks_on_every_bridge_host_bring_identities_and_requested_addresses() {
        let mut with_address = request();
        with_address.address_identity = Some("uid-1".into());
        with_address.requested_address = Some("192.0.2.10".into());
        // One bridge with a block, one network: identities yes, requests no.
        let mut mixed = config();
        mixed.hosts[1].bridge = Some("br0".into());
        mixed.hosts[1].static_addresses = Some(static_block());
        assert!(address_identities_supported(&mixed));
        assert!(!requested_addresses_supported(&mixed));
        assert_eq!(
            fields(plan_create(&mixed, &with_address).unwrap_err()),
            ["requested_address"]
        );
        // Every host with a block: both, and the request is planned and in the digest.
        let mut all_static = mixed.clone();
        for host in &mut all_static.hosts {
            host.bridge = Some("br0".into());
            host.static_addresses = Some(static_block());
        }
        assert!(requested_addresses_supported(&all_static));
        let plan = plan_create(&all_static, &with_address).unwrap();
        assert_eq!(plan.requested_address, Some("192.0.2.10".parse().unwrap()));
        let mut other = with_address.clone();
        other.requested_address = Some("192.0.2.11".into());
        assert_ne!(plan.spec_sha256, spec_sha256(&other));
        // A block on a host without a bridge counts for nothing.
        let mut networked = config();
        networked.hosts[0].static_addresses = Some(static_block());
        assert!(!requested_addresses_supported(&networked));
    }

    #[test]
    fn a_bad_cloud_config_alone_keeps_its_reason() {
        let mut bad = request();
        bad.cloud_init.as_mut().unwrap().user_data = b"#cloud-config\n[1, 2]\n".to_vec();
        let err = contract(plan_create(&config(), &bad).unwrap_err());
        assert_eq!(err.reason, "INVALID_CLOUD_CONFIG", "{err}");
        assert_eq!(fields(err), ["cloud_init.user_data"]);
        // With another problem beside it, the error is about the request as a whole.
        bad.placement.as_mut().unwrap().image = "arch".into();
        let err = contract(plan_create(&config(), &bad).unwrap_err());
        assert_eq!(err.reason, "INVALID_ARGUMENT", "{err}");
        assert_eq!(fields(err), ["placement.image", "cloud_init.user_data"]);
    }

    #[test]
    fn an_image_with_the_agent_preinstalled_gets_no_package() {
        let config = Config::parse(
            "hosts:\n- {name: hv1, local: true}\n\
             machineTypes:\n  small: {vcpus: 1, memoryMiB: 1024, diskGiB: 10}\n\
             images:\n  debian-12: {url: 'https://example.org/d.qcow2', guestAgent: preinstalled}\n",
        )
        .unwrap();
        let mut blank = request();
        blank.cloud_init = None;
        let plan = plan_create(&config, &blank).unwrap();
        assert_eq!(
            String::from_utf8(plan.documents.user_data).unwrap(),
            "#cloud-config\nruncmd:\n  - [systemctl, enable, --now, qemu-guest-agent]\n"
        );
    }

    #[test]
    fn placements_resolve_like_create_with_the_chosen_host_filled_in() {
        let placement = request().placement;
        let resolved = resolve_placement(&config(), placement.as_ref()).unwrap();
        assert_eq!(
            resolved.to_contract("hv2"),
            pb::Placement {
                location: Some(Location::Host("hv2".into())),
                machine_type: "small".into(),
                image: "debian-12".into(),
            }
        );
        let mut in_z1 = request().placement.unwrap();
        in_z1.location = Some(Location::Zone("z1".into()));
        let resolved = resolve_placement(&config(), Some(&in_z1)).unwrap();
        assert_eq!(resolved.to_contract("hv3"), in_z1, "a zone stays the zone");
        let bad = pb::Placement {
            location: Some(Location::Host("hv9".into())),
            machine_type: "small".into(),
            image: "arch".into(),
        };
        assert_eq!(
            fields(resolve_placement(&config(), Some(&bad)).unwrap_err()),
            ["placement.host", "placement.image"]
        );
        assert_eq!(
            fields(resolve_placement(&config(), None).unwrap_err()),
            ["placement"]
        );
    }

    #[test]
    fn unknown_names_list_what_is_offered() {
        let mut bad = request();
        bad.placement.as_mut().unwrap().machine_type = "huge".into();
        let err = contract(plan_create(&config(), &bad).unwrap_err());
        assert!(err.message.contains("this provider offers small"), "{err}");
    }

    #[test]
    fn the_spec_digest_changes_with_every_part_of_the_spec_and_nothing_else() {
        let base = spec_sha256(&request());
        assert_eq!(base.len(), 64);
        let mut same = request();
        same.name = "other/name".into();
        same.tags.clear();
        assert_eq!(spec_sha256(&same), base, "name and tags are not the spec");
        let variants: [fn(&mut pb::CreateInstanceRequest); 6] = [
            |r| r.proxy_port = 8080,
            |r| r.placement.as_mut().unwrap().image = "debian-13".into(),
            |r| r.placement.as_mut().unwrap().machine_type = "big".into(),
            |r| r.placement.as_mut().unwrap().location = Some(Location::Host("hv1".into())),
            |r| r.cloud_init.as_mut().unwrap().user_data.push(b'\n'),
            |r| r.cloud_init.as_mut().unwrap().vendor_data = Some(Vec::new()),
        ];
        let mut seen = std::collections::BTreeSet::from([base]);
        for change in variants {
            let mut r = request();
            change(&mut r);
            assert!(
                seen.insert(spec_sha256(&r)),
                "a change left the digest unchanged"
            );
        }
    }
}
