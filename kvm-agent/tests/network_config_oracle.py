#!/usr/bin/python3
"""What a guest's cloud-init makes of a NoCloud seed's `network-config`, computed by
cloud-init's own code (the installed `cloud-init` package), without booting anything:

1. the seed directory is read as the NoCloud datasource reads it
   (`util.pathprefix2dict` with its required and optional files, then the
   datasource's `_merge_new_seed`, which loads `network-config` as YAML);
2. `network_state.parse_net_config_data(..., skip_broken=False)` parses it as the
   guest does before rendering, failing on anything it cannot use;
3. `extract_physdevs` lists the MAC -> name pairs cloud-init renames NICs by, and the
   ENI renderer (the guest image's) renders the interfaces file.

Usage: network_config_oracle.py SEED_DIR

Prints one JSON object: `physdevs` ([mac, name] pairs), `interfaces` (name ->
`mac_address` and `subnets`, each with type, address, prefix, gateway,
`dns_nameservers` and routes as network_state holds them), `dns_nameservers` (the
global ones) and `eni` (the rendered interfaces file).
"""

import json
import sys

from cloudinit import util
from cloudinit.net import eni, extract_physdevs, network_state
from cloudinit.sources.DataSourceNoCloud import _merge_new_seed


def main(seed_dir):
    seeded = util.pathprefix2dict(
        seed_dir + "/",
        required=["user-data", "meta-data"],
        optional=["vendor-data", "network-config"],
    )
    merged = _merge_new_seed({"meta-data": {}}, seeded)
    config = merged["network-config"]
    state = network_state.parse_net_config_data(config, skip_broken=False)
    interfaces = {}
    for iface in state.iter_interfaces():
        interfaces[iface["name"]] = {
            "mac_address": iface.get("mac_address"),
            "subnets": [
                {
                    "type": subnet.get("type"),
                    "address": subnet.get("address"),
                    "prefix": subnet.get("prefix"),
                    "gateway": subnet.get("gateway"),
                    "dns_nameservers": subnet.get("dns_nameservers", []),
                    "routes": subnet.get("routes", []),
                }
                for subnet in iface.get("subnets", [])
            ],
        }
    print(
        json.dumps(
            {
                "physdevs": [[d[0], d[1]] for d in extract_physdevs(config)],
                "interfaces": interfaces,
                "dns_nameservers": list(state.dns_nameservers),
                "eni": eni.Renderer()._render_interfaces(state),
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
