#!/usr/bin/python3
"""What a guest's cloud-init makes of a NoCloud seed, computed by cloud-init's own code.

Runs the code of the installed `cloud-init` package (Debian 12: 22.4), the same version
as in the guest image, without booting anything:

1. `UserDataProcessor.process` splits and decodes user-data (and vendor-data) into
   parts: MIME, gzip, `#include`, `#cloud-config-archive` are all resolved here;
2. the part handlers a guest registers by default walk those parts: the cloud-config
   handler merges every cloud-config part, honouring each part's `Merge-Type` header or
   `merge_how` key; the jinja handler renders templates from instance data first; the
   shell-script handler writes scripts where `scripts-user` later runs them;
3. vendor-data is consumed only when the configuration so far (user-data's over
   cloud-init's built-in settings) leaves `vendor_data: {enabled: ...}` true, the test
   `stages.Init._consume_vendordata` makes; then it goes through steps 1 and 2 into
   `vendor_cloud_config`;
4. `ConfigMerger` (with vendor-data) gives the configuration that modules read.

Usage: cloud_init_oracle.py [--vendor-data VENDOR_DATA | --no-vendor-data | USER_DATA]...

Prints a JSON list with, for each USER_DATA (each seeded alone, with the VENDOR_DATA
of the last `--vendor-data` before it, unless a `--no-vendor-data` came after that), an
object: `config` (the merged configuration; YAML dates and times as
`{"date": iso}`), `schema_errors` (what `cloud-init schema` finds wrong in the
assembled `cloud-config.txt`; empty when valid or when there is none), `parts` (content
type, merge type and base64 payload of every processed user-data part, in order),
`vendor_parts` (the same of vendor-data; empty when it is not consumed), `scripts` (file name -> base64 content of the
scripts a guest would run) and `warnings` (cloud-init's warnings while processing).

Runs no user code: boot hooks and part handlers are recorded, never executed. A
`#include` is fetched for real, so the inputs given to it must only name `file://`
URLs or loopback addresses.
"""

import base64
import contextlib
import datetime
import io
import json
import logging
import os
import sys
import tempfile

from cloudinit import handlers, helpers, settings, util
from cloudinit.config.schema import (
    SchemaValidationError,
    get_schema,
    validate_cloudconfig_file,
)
from cloudinit.handlers.cloud_config import CloudConfigPartHandler
from cloudinit.handlers.jinja_template import JinjaTemplatePartHandler
from cloudinit.handlers.shell_script import ShellScriptPartHandler
from cloudinit.handlers.shell_script_by_frequency import (
    ShellScriptByFreqPartHandler,
)
from cloudinit.settings import PER_ALWAYS, PER_INSTANCE, PER_ONCE
from cloudinit.user_data import UserDataProcessor

INSTANCE_ID = "oracle-instance"
SCHEMA = get_schema()


class Datasource:
    """The little of a datasource that paths and the merger ask for."""

    def get_instance_id(self):
        return INSTANCE_ID

    def get_config_obj(self):
        return {}


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.date, datetime.datetime)):
        return {"date": value.isoformat()}
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    return value


def as_bytes(payload):
    if isinstance(payload, str):
        return payload.encode("utf-8", "surrogateescape")
    return payload or b""


def process(paths, blob, handler_opts, frequency):
    """Steps 1 and 2 for one document; returns the processed parts."""
    message = UserDataProcessor(paths).process(blob)
    opts = dict(handler_opts, paths=paths, datasource=paths.datasource)
    cloud_config = CloudConfigPartHandler(**opts)
    shell_script = ShellScriptPartHandler(**opts)
    default_handlers = [
        cloud_config,
        shell_script,
        ShellScriptByFreqPartHandler(PER_ALWAYS, **opts),
        ShellScriptByFreqPartHandler(PER_INSTANCE, **opts),
        ShellScriptByFreqPartHandler(PER_ONCE, **opts),
        JinjaTemplatePartHandler(
            **opts, sub_handlers=[cloud_config, shell_script]
        ),
    ]
    registry = helpers.ContentHandlers()
    for handler in default_handlers:
        registry.register(handler, overwrite=False)
    for handler in default_handlers:
        handlers.call_begin(handler, None, frequency)
    handlers.walk(
        message,
        handlers.walker_callback,
        data={
            "handlers": registry,
            "handlerdir": paths.get_ipath("handlers"),
            "data": None,
            "frequency": frequency,
            "handlercount": 0,
            # Never run user code on the test machine.
            "excluded": ["text/cloud-boothook", "text/part-handler"],
        },
    )
    for handler in default_handlers:
        handlers.call_end(handler, None, frequency)
    parts = []
    for part in message.walk():
        if part.get_content_maintype() == "multipart":
            continue
        payload = as_bytes(part.get_payload(decode=True))
        parts.append(
            {
                "content_type": part.get_content_type(),
                "merge_type": part.get("Merge-Type") or part.get("X-Merge-Type"),
                "payload": base64.b64encode(payload).decode(),
            }
        )
    return parts


def vendor_data_enabled(paths):
    """Whether a guest consumes vendor-data after this user-data (step 3)."""
    so_far = helpers.ConfigMerger(
        paths=paths,
        datasource=paths.datasource,
        additional_fns=[],
        base_cfg=settings.CFG_BUILTIN,
        include_vendor=False,
    ).cfg
    vendor_data = so_far.get("vendor_data", {})
    return isinstance(vendor_data, dict) and util.is_true(vendor_data.get("enabled"))


def assemble(user_path, vendor_path):
    """Steps 1 to 4 for one seed, in a fresh instance directory."""
    recorder = Recorder()
    logging.getLogger().addHandler(recorder)
    try:
        with tempfile.TemporaryDirectory() as root:
            return assemble_in(root, user_path, vendor_path, recorder)
    finally:
        logging.getLogger().removeHandler(recorder)


def assemble_in(root, user_path, vendor_path, recorder):
    cloud_dir = os.path.join(root, "cloud")
    run_dir = os.path.join(root, "run")
    paths = helpers.Paths(
        {"cloud_dir": cloud_dir, "run_dir": run_dir}, ds=Datasource()
    )
    instance_dir = paths.get_ipath()
    os.makedirs(instance_dir)
    os.makedirs(run_dir)
    os.symlink(instance_dir, paths.instance_link)
    # What a NoCloud guest's jinja templates see.
    with open(paths.get_runpath("instance_data_sensitive"), "w") as f:
        json.dump(
            {
                "v1": {
                    "instance_id": INSTANCE_ID,
                    "local_hostname": "egressproxy-oracle",
                    "cloud_name": "nocloud",
                    "platform": "nocloud",
                },
                "ds": {"meta_data": {"instance-id": INSTANCE_ID}},
            },
            f,
        )
    with open(user_path, "rb") as f:
        parts = process(paths, f.read(), {}, PER_INSTANCE)
    vendor_parts = []
    if vendor_path and vendor_data_enabled(paths):
        with open(vendor_path, "rb") as f:
            vendor_parts = process(
                paths,
                f.read(),
                {
                    "script_path": "vendor_scripts",
                    "cloud_config_path": "vendor_cloud_config",
                },
                PER_INSTANCE,
            )
    config = helpers.ConfigMerger(
        paths=paths, datasource=paths.datasource, include_vendor=True
    ).cfg
    scripts = {}
    scripts_dir = paths.get_ipath_cur("scripts")
    if os.path.isdir(scripts_dir):
        for name in sorted(os.listdir(scripts_dir)):
            path = os.path.join(scripts_dir, name)
            # `vendor/` holds vendor-data's scripts.
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    scripts[name] = base64.b64encode(f.read()).decode()
    # `cloud-init schema --config-file` on the cloud-config the guest assembled (the
    # file modules read), by the function that command runs, without a process each.
    schema_errors = ""
    cloud_config_txt = paths.get_ipath_cur("cloud_config")
    if os.path.isfile(cloud_config_txt) and os.path.getsize(cloud_config_txt) > 0:
        try:
            # It prints its (empty) list of deprecations; stdout is the answer's.
            with contextlib.redirect_stdout(io.StringIO()):
                validate_cloudconfig_file(cloud_config_txt, SCHEMA)
        except SchemaValidationError as e:
            schema_errors = str(e)
    return {
        "config": jsonable(config),
        "schema_errors": schema_errors,
        "parts": parts,
        "vendor_parts": vendor_parts,
        "scripts": scripts,
        "warnings": recorder.messages,
    }


def main():
    args = iter(sys.argv[1:])
    vendor_path = None
    logging.getLogger().setLevel(logging.WARNING)
    results = []
    for arg in args:
        if arg == "--vendor-data":
            vendor_path = next(args)
        elif arg == "--no-vendor-data":
            vendor_path = None
        else:
            results.append(assemble(arg, vendor_path))
    json.dump(results, sys.stdout, sort_keys=True)


if __name__ == "__main__":
    main()
