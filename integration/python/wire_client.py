"""An independent gRPC client of the Provider contract: C-core grpcio, descriptors from
the server's reflection only (no project protos, no generated code).

Usage: wire_client.py HOST:PORT CALL ID
  CALL is GetInstance or DeleteInstance. Prints one JSON object: the status code's
  name, the message's length, ErrorInfo's domain and reason, and BadRequest's fields.
"""

import json
import sys

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from grpc_status import rpc_status

SERVICE = "egressproxy.provider.v1.Provider"


def main():
    address, call, instance_id = sys.argv[1], sys.argv[2], sys.argv[3]
    channel = grpc.insecure_channel(address)
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindServiceByName(SERVICE).FindMethodByName(call)
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    stub = channel.unary_unary(
        f"/{SERVICE}/{call}",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    result = {"code": "OK"}
    try:
        stub(request_class(id=instance_id), timeout=30)
    except grpc.RpcError as error:
        result["code"] = error.code().name
        result["message_len"] = len(error.details() or "")
        status = rpc_status.from_call(error)
        for detail in status.details if status else []:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                result["domain"] = info.domain
                result["reason"] = info.reason
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                result["fields"] = [v.field for v in bad.field_violations]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
