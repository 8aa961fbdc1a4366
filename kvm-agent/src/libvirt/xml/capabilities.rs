//! libvirt's capabilities documents, parsed into the few facts the agent uses:
//! the domain capabilities of a domain type (`virConnectGetDomainCapabilities`: UEFI
//! firmware) and the host's security models (`virConnectGetCapabilities`: is the guest
//! confined by AppArmor or SELinux).

use serde::Deserialize;

use super::XmlError;

/// The parts of `virConnectGetDomainCapabilities` the agent uses.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DomainCapabilities {
    /// The domain type the capabilities are for (`kvm`, `qemu`).
    pub domain: String,
    /// The firmware kinds libvirt can select automatically (`bios`, `efi`).
    pub firmware: Vec<String>,
    /// Firmware images (loader paths) found.
    pub loaders: Vec<String>,
}

impl DomainCapabilities {
    /// Parses a `<domainCapabilities>` document; elements it does not need are ignored.
    pub fn parse(xml: &str) -> Result<Self, XmlError> {
        #[derive(Deserialize)]
        struct Caps {
            #[serde(default)]
            domain: String,
            #[serde(default)]
            os: Option<Os>,
        }
        #[derive(Deserialize)]
        struct Os {
            #[serde(rename = "@supported", default)]
            supported: String,
            #[serde(rename = "enum", default)]
            enums: Vec<Enum>,
            #[serde(default)]
            loader: Option<Loader>,
        }
        #[derive(Deserialize)]
        struct Enum {
            #[serde(rename = "@name")]
            name: String,
            #[serde(default)]
            value: Vec<String>,
        }
        #[derive(Deserialize)]
        struct Loader {
            #[serde(rename = "@supported", default)]
            supported: String,
            #[serde(default)]
            value: Vec<String>,
        }
        let caps: Caps = quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
            what: "domain capabilities",
            source,
        })?;
        let os = caps.os.filter(|os| os.supported == "yes");
        Ok(Self {
            domain: caps.domain,
            firmware: os
                .as_ref()
                .and_then(|os| os.enums.iter().find(|e| e.name == "firmware"))
                .map(|e| e.value.clone())
                .unwrap_or_default(),
            loaders: os
                .and_then(|os| os.loader)
                .filter(|l| l.supported == "yes")
                .map(|l| l.value)
                .unwrap_or_default(),
        })
    }

    /// Whether libvirt can pick UEFI firmware (`<os firmware='efi'>`).
    pub fn supports_uefi(&self) -> bool {
        self.firmware.iter().any(|f| f == "efi")
    }
}

/// The security models that confine guests on the host (`apparmor`, `selinux`), from
/// `virConnectGetCapabilities`; `dac` and `none` do not confine and are left out.
pub(crate) fn confinement_models(xml: &str) -> Result<Vec<String>, XmlError> {
    #[derive(Deserialize)]
    struct Capabilities {
        host: Host,
    }
    #[derive(Deserialize)]
    struct Host {
        #[serde(default)]
        secmodel: Vec<SecModel>,
    }
    #[derive(Deserialize)]
    struct SecModel {
        model: String,
    }
    let caps: Capabilities = quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
        what: "host capabilities",
        source,
    })?;
    Ok(caps
        .host
        .secmodel
        .into_iter()
        .map(|m| m.model)
        .filter(|m| m != "dac" && m != "none")
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uefi_and_loaders_come_from_the_os_element() {
        let xml = r#"<domainCapabilities>
  <path>/usr/bin/qemu-system-x86_64</path>
  <domain>qemu</domain>
  <machine>pc-q35-10.0</machine>
  <arch>x86_64</arch>
  <vcpu max='288'/>
  <os supported='yes'>
    <enum name='firmware'>
      <value>bios</value>
      <value>efi</value>
    </enum>
    <loader supported='yes'>
      <value>/usr/share/OVMF/OVMF_CODE_4M.fd</value>
      <enum name='type'><value>rom</value><value>pflash</value></enum>
    </loader>
  </os>
  <devices><disk supported='yes'/></devices>
</domainCapabilities>"#;
        let caps = DomainCapabilities::parse(xml).unwrap();
        assert_eq!(caps.domain, "qemu");
        assert!(caps.supports_uefi());
        assert_eq!(caps.loaders, ["/usr/share/OVMF/OVMF_CODE_4M.fd"]);

        let no_efi = xml.replace("<value>efi</value>", "");
        assert!(!DomainCapabilities::parse(&no_efi).unwrap().supports_uefi());
        let unsupported = xml.replace("<os supported='yes'>", "<os supported='no'>");
        assert_eq!(
            DomainCapabilities::parse(&unsupported).unwrap().firmware,
            Vec::<String>::new()
        );
    }
}
