"""An egressproxy provider written from the proto and docs/contract.md alone.

Instances live in memory; each turns RUNNING with the address 127.0.0.1 (or its address
identity's) a moment after Create, and stays DELETING a moment after Delete. It shows, in plain grpcio, what any
provider must do beyond the proto:

- errors as google.rpc.Status in the grpc-status-details-bin trailer, with ErrorInfo
  (domain egressproxy.dev, an UPPER_SNAKE_CASE reason) and BadRequest field violations,
  a map entry named tags["key"] with only `"` and `\` escaped;
- echoed input bounded, so an error never outgrows a client's 16 KiB metadata limit;
- page tokens it can tell from anything it did not issue, and pages bounded in bytes;
- while an instance is DELETING, Create of its key answers UNAVAILABLE, reason
  KEY_BEING_DELETED;
- ListLocations (CAPABILITY_LIST_LOCATIONS): each host with the room each machine type
  has in its memory; a Create without a location goes to the host with the most room,
  and one where none fits is RESOURCE_EXHAUSTED, reason CAPACITY_EXHAUSTED (the host
  "full" never has room, so callers can see that answer);
- address identities (CAPABILITY_ADDRESS_IDENTITY, CAPABILITY_REQUESTED_ADDRESS): an
  instance created with an address_identity gets an address of ADDRESS_RANGE (the one
  the identity's hash picks while it is free, or the requested_address), which it holds
  until its last instance is gone; a second instance of a held identity is UNAVAILABLE,
  reason ADDRESS_IDENTITY_IN_USE; a requested address held by another instance is
  ALREADY_EXISTS, reason ADDRESS_TAKEN, one outside the range INVALID_ARGUMENT, reason
  ADDRESS_NOT_IN_RANGE; no address left is RESOURCE_EXHAUSTED, reason
  ADDRESSES_EXHAUSTED;
- UpdateInstanceTags (CAPABILITY_UPDATE_TAGS): compare-and-set of an instance's tags
  under the one lock Create and Delete take, so of concurrent updates from the same
  tags exactly one wins (the others answer FAILED_PRECONDITION, reason TAGS_CHANGED);
  a repeat of a done update answers OK, and a DELETING instance INSTANCE_DELETING;
- grpc.health.v1 SERVING for "" and egressproxy.provider.v1.Provider;
- server reflection v1 (grpcio-reflection ships only v1alpha: the same servicer is
  also registered under the v1 name, whose messages are identical on the wire) and the
  google.rpc error detail types in it.

Usage: python provider.py --generated DIR [--listen 127.0.0.1:0]
  DIR holds the code generate.sh made. Prints "listening on HOST:PORT" when ready.
"""

import argparse
import base64
import hashlib
import ipaddress
import re
import sys
import threading
import time
import uuid
from concurrent import futures

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_status import rpc_status

SERVICE = "egressproxy.provider.v1.Provider"
DOMAIN = "egressproxy.dev"
CONTRACT_VERSION = "1.5.0"
GIB = 1 << 30
# name -> (vCPUs, memory in bytes)
MACHINE_TYPES = {"small": (1, GIB), "medium": (2, 2 * GIB)}
IMAGES = ("debian-12",)
# name -> (CPUs, memory in bytes that instances may use)
HOSTS = {"local": (8, 64 * GIB), "full": (8, 0)}
PROVISIONING_SECONDS, DELETING_SECONDS = 0.2, 0.2
MAX_KEY_LEN, MAX_TAGS, MAX_TAG_BYTES, MAX_USER_DATA = 128, 64, 256, 64 * 1024
MAX_NAME, MAX_STRING, MAX_HOST, MAX_ADDRESS = 512, 128, 256, 64
# Addresses instances with an address identity get (TEST-NET-1: no real network routes it).
ADDRESS_RANGE = (ipaddress.IPv4Address("192.0.2.10"), ipaddress.IPv4Address("192.0.2.250"))
DEFAULT_ADDRESS = "127.0.0.1"
# fullmatch: with match and `$`, "key\n" would pass (`$` matches before a final line feed).
KEY_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000
MAX_RESPONSE_BYTES = 4 * 1024 * 1024 - 4096  # the 4 MiB every caller accepts, less room
MAX_FIELD_PATH, MAX_DESCRIPTION, MAX_MESSAGE, MAX_DETAILS = 1024, 512, 1024, 8 * 1024
TOKEN_CONTEXT = b"python-example/page-token/v1\0"
LOCATION_TOKEN_CONTEXT = b"python-example/location-token/v1\0"


def cut_word(word):
    return word if len(word) <= 128 else f"{word[:128]}…({len(word.encode())} bytes)"


def bound(text, limit=MAX_MESSAGE):
    """Cuts every word over 128 characters, then the whole text to `limit` bytes."""
    text = " ".join(cut_word(w) for w in text.split(" "))
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[: limit - 20].decode(errors="ignore") + f"…({len(raw)} bytes)"


def field_path(path):
    """A field path is sent whole up to 1 KiB (any map entry within the limits fits)."""
    return path if len(path.encode()) <= MAX_FIELD_PATH else bound(path, MAX_DESCRIPTION)


def page_token(last_id, context=TOKEN_CONTEXT):
    """The last id of a page with a checksum, so a token this provider did not issue
    (made up, or an issued one changed) is refused instead of read as a position."""
    encoded = base64.urlsafe_b64encode(last_id.encode()).decode().rstrip("=")
    checksum = hashlib.sha256(context + last_id.encode()).hexdigest()[:16]
    return f"{encoded}.{checksum}"


def read_page_token(token, context=TOKEN_CONTEXT):
    """The last id a token names; None when this provider did not issue it."""
    encoded, _, _ = token.partition(".")
    try:
        last_id = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except ValueError:
        return None
    return last_id if page_token(last_id, context) == token else None


class ContractError(Exception):
    """An error of the contract: a gRPC code, a reason, and the fields at fault."""

    def __init__(self, code, reason, message, violations=(), retry_after=None):
        super().__init__(message)
        self.code, self.reason, self.message, self.violations = code, reason, message, list(violations)
        self.retry_after = retry_after  # seconds, sent as RetryInfo

    def abort(self, context):
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN)
        details = [info]
        # At most 10 violations, and fewer when the details would pass 8 KiB.
        violations, size = [], len(self.message.encode()) + 128
        for field, description in self.violations[:10]:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=field_path(field), description=bound(description, MAX_DESCRIPTION)
            )
            size += violation.ByteSize() + 8
            if violations and size > MAX_DETAILS:
                break
            violations.append(violation)
        message = self.message
        if len(violations) < len(self.violations):
            message += f" ({len(self.violations) - len(violations)} more field violations not shown: fix these first)"
        if violations:
            details.append(error_details_pb2.BadRequest(field_violations=violations))
        if self.retry_after is not None:
            retry = error_details_pb2.RetryInfo()
            retry.retry_delay.FromNanoseconds(int(self.retry_after * 1e9))
            details.append(retry)
        packed = []
        for detail in details:
            value = any_pb2.Any()
            value.Pack(detail)
            packed.append(value)
        status = status_pb2.Status(code=self.code, message=bound(message), details=packed)
        context.abort_with_status(rpc_status.to_status(status))


def invalid(violations):
    summary = "; ".join(f"{field}: {why}" for field, why in violations)
    return ContractError(code_pb2.INVALID_ARGUMENT, "INVALID_ARGUMENT", f"invalid request: {summary}", violations)


def entry_path(field, key):
    """A map entry's field path: tags["key"], with exactly `"` and `\\` escaped. A key
    within the limit is written whole; a longer one is cut like an echoed word."""
    shown = key if len(key.encode()) <= MAX_TAG_BYTES else cut_word(key)
    escaped = shown.replace("\\", "\\\\").replace('"', '\\"')
    return f'{field}["{escaped}"]'


def check_tags(field, tags, violations):
    if len(tags) > MAX_TAGS:
        violations.append((field, f"at most {MAX_TAGS} entries, got {len(tags)}"))
    for key in sorted(tags):
        if not key or len(key.encode()) > MAX_TAG_BYTES or len(tags[key].encode()) > MAX_TAG_BYTES:
            violations.append((entry_path(field, key), f"keys must be 1 to {MAX_TAG_BYTES} bytes and values at most {MAX_TAG_BYTES}"))


def requested_address_problem(text):
    """What is wrong with a requested_address as an address an instance can hold, or None."""
    if len(text.encode()) > MAX_ADDRESS:
        return f"over the {MAX_ADDRESS}-byte limit"
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return f"{cut_word(text)!r} is not an IP address (192.0.2.10, 2001:db8::10)"
    broadcast = address.version == 4 and address == ipaddress.IPv4Address("255.255.255.255")
    if address.is_loopback or address.is_link_local or address.is_multicast or address.is_unspecified or broadcast:
        return f"{address} is a loopback, link-local, multicast, unspecified or broadcast address: no instance can hold it"
    return None


def optional(message, field):
    """An optional field's value, or None when it is unset (never its zero value)."""
    return getattr(message, field) if message.HasField(field) else None


def in_range(address):
    return address.version == 4 and ADDRESS_RANGE[0] <= address <= ADDRESS_RANGE[1]


def preferred_index(identity):
    """Where in ADDRESS_RANGE an identity's search for a free address starts: a hash of
    it, so an identity whose last instance is gone gets its address back while it is free."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:4], "big")


def load_generated(directory):
    sys.path.insert(0, directory)
    from egressproxy.provider.v1 import provider_pb2, provider_pb2_grpc  # noqa: E402

    return provider_pb2, provider_pb2_grpc


class Record:
    """One instance: the Instance as created, the host it takes room on, when, the spec
    a repeated Create must match, and when Delete was called (DELETING until
    DELETING_SECONDS later)."""

    def __init__(self, instance, host, spec, address=None):
        self.instance, self.host, self.spec = instance, host, spec
        self.address = address  # the address it holds for its address identity
        self.created, self.deleted = time.monotonic(), None


def build_servicer(pb, pb_grpc):
    class Provider(pb_grpc.ProviderServicer):
        def __init__(self):
            self.lock = threading.Lock()
            self.instances = {}  # id -> Record
            self.ids_by_key = {}

        # Every method turns a ContractError into the contract's status.
        def _call(self, context, work):
            try:
                return work()
            except ContractError as error:
                error.abort(context)

        def _purge(self):
            """Removes the instances whose DELETING time is over (with the lock held)."""
            now = time.monotonic()
            for instance_id in [i for i, r in self.instances.items() if r.deleted and now - r.deleted >= DELETING_SECONDS]:
                record = self.instances.pop(instance_id)
                if self.ids_by_key.get(record.instance.key) == instance_id:
                    del self.ids_by_key[record.instance.key]

        def GetPluginInfo(self, request, context):
            return pb.GetPluginInfoResponse(
                name="python.example.egressproxy.dev", vendor_version="0.1.0", contract_version=CONTRACT_VERSION,
                manifest={"language": "python", "storage": "memory"},
            )

        def GetCapabilities(self, request, context):
            return pb.GetCapabilitiesResponse(capabilities=[
                pb.CAPABILITY_VALIDATE_PLACEMENT, pb.CAPABILITY_LIST_LOCATIONS,
                pb.CAPABILITY_ADDRESS_IDENTITY, pb.CAPABILITY_REQUESTED_ADDRESS,
                pb.CAPABILITY_UPDATE_TAGS,
            ])

        def _free_memory(self, host):
            """Memory instances on `host` may still use (with the lock held): deleted
            ones take room until they are gone."""
            used = sum(MACHINE_TYPES[r.instance.placement.machine_type][1] for r in self.instances.values() if r.host == host)
            return max(HOSTS[host][1] - used, 0)

        def _room(self, host, machine_type):
            vcpus, memory = MACHINE_TYPES[machine_type]
            return 0 if vcpus > HOSTS[host][0] else self._free_memory(host) // memory

        def _choose(self, placement):
            """The host an instance of `placement` goes to: the one named, or the one with
            the most room for its machine type (the first on a tie)."""
            if placement.WhichOneof("location") == "host":
                return placement.host
            return max(HOSTS, key=lambda host: (self._room(host, placement.machine_type), -list(HOSTS).index(host)))

        def _check_placement(self, placement, present, violations):
            if not present:
                violations.append(("placement", "required: set machine_type and image"))
                return
            location = placement.WhichOneof("location")
            if location == "host" and placement.host not in HOSTS:
                violations.append(("placement.host", f"unknown host {placement.host!r}: use one of {', '.join(HOSTS)}"))
            if location == "zone":
                violations.append(("placement.zone", "this provider has no zones: leave the location unset or name a host"))
            if placement.machine_type not in MACHINE_TYPES:
                violations.append(("placement.machine_type", f"unknown machine type {placement.machine_type!r}: use one of {', '.join(MACHINE_TYPES)}"))
            if placement.image not in IMAGES:
                violations.append(("placement.image", f"unknown image {placement.image!r}: use one of {', '.join(IMAGES)}"))

        def _validate_create(self, request):
            violations = []
            if not KEY_PATTERN.fullmatch(request.key):
                violations.append(("key", f"must be 1 to {MAX_KEY_LEN} characters of [A-Za-z0-9._-]"))
            if len(request.name.encode()) > MAX_NAME:
                violations.append(("name", f"over the {MAX_NAME}-byte limit"))
            check_tags("tags", request.tags, violations)
            self._check_placement(request.placement, request.HasField("placement"), violations)
            if len(request.cloud_init.user_data) > MAX_USER_DATA:
                violations.append(("cloud_init.user_data", f"over the {MAX_USER_DATA}-byte limit"))
            if request.cloud_init.HasField("vendor_data"):
                violations.append(("cloud_init.vendor_data", "this provider does not declare CAPABILITY_VENDOR_DATA: put it in user_data"))
            if not 1 <= request.proxy_port <= 65535:
                violations.append(("proxy_port", f"{request.proxy_port} is not a TCP port: use 1 to 65535"))
            if request.HasField("address_identity") and not KEY_PATTERN.fullmatch(request.address_identity):
                violations.append(("address_identity", f"must be 1 to {MAX_KEY_LEN} characters of [A-Za-z0-9._-]"))
            if request.HasField("requested_address"):
                problem = requested_address_problem(request.requested_address)
                if problem is None and not request.HasField("address_identity"):
                    problem = "needs address_identity: an address is held by an identity"
                if problem is not None:
                    violations.append(("requested_address", problem))
            if violations:
                raise invalid(violations)

        def _snapshot(self, record):
            snapshot = pb.Instance()
            snapshot.CopyFrom(record.instance)
            if record.deleted is not None:
                snapshot.state = pb.INSTANCE_STATE_DELETING
                snapshot.state_message = "being deleted"
            elif time.monotonic() - record.created >= PROVISIONING_SECONDS:
                snapshot.state = pb.INSTANCE_STATE_RUNNING
                address = str(record.address) if record.address is not None else DEFAULT_ADDRESS
                snapshot.addresses.append(pb.Address(address=address, scope=pb.ADDRESS_SCOPE_INTERNAL, family=pb.IP_FAMILY_V4))
            else:
                snapshot.state = pb.INSTANCE_STATE_PROVISIONING
                snapshot.state_message = "booting"
            return snapshot

        def _grant(self, request):
            """The address a new instance of request.address_identity gets (with the lock
            held). An address is held while any instance that holds it exists, DELETING
            ones included, so it is released exactly when the last one is gone."""
            identity = request.address_identity
            for instance_id, record in self.instances.items():
                if record.instance.HasField("address_identity") and record.instance.address_identity == identity:
                    raise ContractError(code_pb2.UNAVAILABLE, "ADDRESS_IDENTITY_IN_USE",
                                        f"address identity {identity} is held by instance {instance_id}, which still exists: "
                                        "delete it, then create again (two instances with one address would take each other's traffic)",
                                        retry_after=0.1)
            holders = {record.address: instance_id for instance_id, record in self.instances.items() if record.address is not None}
            if request.HasField("requested_address"):
                requested = ipaddress.ip_address(request.requested_address)
                if not in_range(requested):
                    shown = f"{ADDRESS_RANGE[0]}-{ADDRESS_RANGE[1]}"
                    raise ContractError(code_pb2.INVALID_ARGUMENT, "ADDRESS_NOT_IN_RANGE",
                                        f"requested_address {requested} is not in a range this provider offers",
                                        [("requested_address", f"{requested} is not in a range this provider offers: use one of {shown}")])
                if requested in holders:
                    raise ContractError(code_pb2.ALREADY_EXISTS, "ADDRESS_TAKEN",
                                        f"address {requested} is held by instance {holders[requested]}: ask for another, or delete that instance first")
                return requested
            first, size = int(ADDRESS_RANGE[0]), int(ADDRESS_RANGE[1]) - int(ADDRESS_RANGE[0]) + 1
            start = preferred_index(identity)
            for step in range(size):
                address = ipaddress.IPv4Address(first + (start + step) % size)
                if address not in holders:
                    return address
            raise ContractError(code_pb2.RESOURCE_EXHAUSTED, "ADDRESSES_EXHAUSTED",
                                f"every address of {ADDRESS_RANGE[0]}-{ADDRESS_RANGE[1]} is held by an instance: delete one, or retry later",
                                retry_after=1)

        def CreateInstance(self, request, context):
            def work():
                self._validate_create(request)
                # Idempotency compares the requested placement, cloud-init, port, address
                # identity and requested address; name and tags are informational. An
                # unset cloud_init serializes like an empty one: the same input.
                spec = (request.placement.SerializeToString(deterministic=True),
                        request.cloud_init.SerializeToString(deterministic=True), request.proxy_port,
                        optional(request, "address_identity"), optional(request, "requested_address"))
                with self.lock:
                    self._purge()
                    existing = self.ids_by_key.get(request.key)
                    if existing is not None:
                        record = self.instances[existing]
                        if record.deleted is not None:
                            left = max(DELETING_SECONDS - (time.monotonic() - record.deleted), 0.01)
                            raise ContractError(code_pb2.UNAVAILABLE, "KEY_BEING_DELETED",
                                                f"key {request.key} belongs to instance {existing}, which is being deleted: retry once it is gone",
                                                retry_after=left)
                        if record.spec != spec:
                            raise ContractError(code_pb2.ALREADY_EXISTS, "ALREADY_EXISTS",
                                                f"key {request.key} belongs to instance {existing}, created with another placement, cloud-init, proxy port or "
                                                "address: delete it first or use another key")
                        return pb.CreateInstanceResponse(instance=self._snapshot(record))
                    host = self._choose(request.placement)
                    if self._room(host, request.placement.machine_type) == 0:
                        raise ContractError(code_pb2.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED",
                                            f"no room for machine type {request.placement.machine_type} on host {host}: "
                                            f"{self._free_memory(host) // (1 << 20)} MiB free; delete instances or name another "
                                            "host (ListLocations shows the room of each)", retry_after=30)
                    address = self._grant(request) if request.HasField("address_identity") else None
                    instance_id = f"py-{uuid.uuid4()}"
                    created = timestamp_pb2.Timestamp()
                    created.GetCurrentTime()
                    placement = pb.Placement()
                    placement.CopyFrom(request.placement)
                    placement.host = host
                    instance = pb.Instance(id=instance_id, key=request.key, name=request.name, create_time=created,
                                           tags=dict(request.tags), placement=placement, proxy_port=request.proxy_port)
                    if request.HasField("address_identity"):
                        instance.address_identity = request.address_identity
                    record = Record(instance, host, spec, address)
                    self.instances[instance_id] = record
                    self.ids_by_key[request.key] = instance_id
                    return pb.CreateInstanceResponse(instance=self._snapshot(record))

            return self._call(context, work)

        @staticmethod
        def _require_id(instance_id):
            if not instance_id:
                raise invalid([("id", "required: the id CreateInstance returned")])

        def GetInstance(self, request, context):
            def work():
                self._require_id(request.id)
                with self.lock:
                    self._purge()
                    record = self.instances.get(request.id)
                    if record is None:
                        raise ContractError(code_pb2.NOT_FOUND, "NOT_FOUND", f"instance {request.id} does not exist")
                    return pb.GetInstanceResponse(instance=self._snapshot(record))

            return self._call(context, work)

        def DeleteInstance(self, request, context):
            def work():
                self._require_id(request.id)
                with self.lock:
                    record = self.instances.get(request.id)
                    if record is not None and record.deleted is None:
                        record.deleted = time.monotonic()
                    self._purge()
                return pb.DeleteInstanceResponse()

            return self._call(context, work)

        def UpdateInstanceTags(self, request, context):
            def work():
                violations = []
                if not request.id:
                    violations.append(("id", "required: the id CreateInstance returned"))
                check_tags("expected_tags", request.expected_tags, violations)
                check_tags("tags", request.tags, violations)
                if violations:
                    raise invalid(violations)
                # The compare and the set happen under one lock: no other update (nor a
                # Delete) comes between them.
                with self.lock:
                    self._purge()
                    record = self.instances.get(request.id)
                    if record is None:
                        raise ContractError(code_pb2.NOT_FOUND, "NOT_FOUND", f"instance {request.id} does not exist")
                    if record.deleted is not None:
                        raise ContractError(code_pb2.FAILED_PRECONDITION, "INSTANCE_DELETING",
                                            f"instance {request.id} is being deleted: its tags can no longer change")
                    current = dict(record.instance.tags)
                    if current == dict(request.tags):
                        # A retry whose answer was lost, or a no-op: nothing changes.
                        return pb.UpdateInstanceTagsResponse(instance=self._snapshot(record))
                    if current != dict(request.expected_tags):
                        raise ContractError(code_pb2.FAILED_PRECONDITION, "TAGS_CHANGED",
                                            f"instance {request.id}'s tags are no longer the expected ones (another caller "
                                            "changed them): read the instance again and decide anew")
                    record.instance.tags.clear()
                    record.instance.tags.update(request.tags)
                    return pb.UpdateInstanceTagsResponse(instance=self._snapshot(record))

            return self._call(context, work)

        def ListInstances(self, request, context):
            def work():
                violations = []
                check_tags("tag_selector", request.tag_selector, violations)
                after = read_page_token(request.page_token) if request.page_token else ""
                if after is None:
                    violations.append(("page_token", "not a token this provider issued: pass next_page_token unchanged, or an empty token to start again"))
                if violations:
                    raise invalid(violations)
                size = request.page_size if request.HasField("page_size") and request.page_size else DEFAULT_PAGE_SIZE
                size = min(size, MAX_PAGE_SIZE)
                # The token names the last id of the previous page, so a walk under
                # concurrent changes never repeats an instance. A page also stops
                # before 4 MiB, the largest message every caller accepts.
                with self.lock:
                    self._purge()
                    matching = [
                        self.instances[i] for i in sorted(self.instances)
                        if i > after
                        and all(self.instances[i].instance.tags.get(k) == v for k, v in request.tag_selector.items())
                    ]
                    page, size_bytes = [], 0
                    for record in matching:
                        snapshot = self._snapshot(record)
                        size_bytes += snapshot.ByteSize() + 8
                        if len(page) == size or (page and size_bytes > MAX_RESPONSE_BYTES):
                            break
                        page.append(snapshot)
                token = page_token(page[-1].id) if len(page) < len(matching) else ""
                return pb.ListInstancesResponse(instances=page, next_page_token=token)

            return self._call(context, work)

        def ValidatePlacement(self, request, context):
            def work():
                violations = []
                self._check_placement(request.placement, request.HasField("placement"), violations)
                if violations:
                    raise invalid(violations)
                resolved = pb.Placement()
                resolved.CopyFrom(request.placement)
                warnings = []
                with self.lock:
                    self._purge()
                    resolved.host = self._choose(request.placement)
                    if self._room(resolved.host, resolved.machine_type) == 0:
                        warnings.append(f"no room for machine type {resolved.machine_type} on host {resolved.host} now: a Create would answer RESOURCE_EXHAUSTED")
                return pb.ValidatePlacementResponse(resolved=resolved, warnings=warnings)

            return self._call(context, work)

        def ListLocations(self, request, context):
            def work():
                violations = [(field, f"over the {MAX_STRING}-byte limit") for field in ("machine_type", "image")
                              if len(getattr(request, field).encode()) > MAX_STRING]
                after = read_page_token(request.page_token, LOCATION_TOKEN_CONTEXT) if request.page_token else ""
                if after is None:
                    violations.append(("page_token", "not a token this provider issued: pass next_page_token unchanged, or an empty token to start again"))
                if violations:
                    raise invalid(violations)
                size = min(request.page_size if request.HasField("page_size") and request.page_size else DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
                machine_types = [m for m in MACHINE_TYPES if request.machine_type in ("", m)]
                images = [i for i in IMAGES if request.image in ("", i)]
                if not machine_types or not images:
                    return pb.ListLocationsResponse()
                locations = []
                with self.lock:
                    self._purge()
                    for host in sorted(HOSTS):
                        if f"host/{host}" <= after:
                            continue
                        instances = sum(1 for r in self.instances.values() if r.host == host)
                        rooms = [pb.MachineTypeRoom(name=m, vcpus=MACHINE_TYPES[m][0], memory_bytes=MACHINE_TYPES[m][1],
                                                    room=self._room(host, m)) for m in machine_types]
                        capacity = pb.Capacity(free_memory_bytes=self._free_memory(host), cpus=HOSTS[host][0], instances=instances)
                        full = all(room.room == 0 for room in rooms)
                        locations.append(pb.Location(host=host, machine_types=rooms, images=images, capacity=capacity,
                                                     message="no room" if full else ""))
                page = locations[:size]
                token = page_token(f"host/{page[-1].host}", LOCATION_TOKEN_CONTEXT) if len(page) < len(locations) else ""
                return pb.ListLocationsResponse(locations=page, next_page_token=token)

            return self._call(context, work)

    return Provider()


def serve(listen, generated):
    pb, pb_grpc = load_generated(generated)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_ProviderServicer_to_server(build_servicer(pb, pb_grpc), server)

    health_servicer = health.HealthServicer()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    names = (
        SERVICE,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        "grpc.reflection.v1.ServerReflection",
        reflection.SERVICE_NAME,
    )
    # v1alpha as grpcio-reflection ships it, and the same servicer under the v1 name.
    reflection.enable_server_reflection(names, server)
    v1 = grpc.method_handlers_generic_handler(
        "grpc.reflection.v1.ServerReflection",
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                reflection.ReflectionServicer(names).ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))

    host, _, port = listen.rpartition(":")
    bound_port = server.add_insecure_port(f"{host}:{port}")
    server.start()
    print(f"listening on {host}:{bound_port}", flush=True)
    server.wait_for_termination()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:50051")
    parser.add_argument("--generated", required=True, help="directory generate.sh wrote to")
    args = parser.parse_args()
    serve(args.listen, args.generated)


if __name__ == "__main__":
    main()
