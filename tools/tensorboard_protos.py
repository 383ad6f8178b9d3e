#!/usr/bin/env python3
"""The event-file messages as the installed tensorboard package defines them, for protoc.

    tensorboard_protos.py OUT.pb

Writes a FileDescriptorSet of tensorboard/compat/proto/event.proto and every file it imports, taken
from the package's compiled descriptors (tensorboard is pinned in tools/requirements.txt), and prints
their names, one per line: CMake compiles them with protoc --descriptor_set_in, so composer writes
the messages TensorBoard itself reads. Exits 1 when the package is missing.
"""
import sys

try:
    from google.protobuf import descriptor_pb2
    from tensorboard.compat.proto import event_pb2
except ImportError as e:
    print(f"tensorboard_protos: {e}", file=sys.stderr)
    sys.exit(1)

files = descriptor_pb2.FileDescriptorSet()
seen = set()


def add(fd):
    if fd.name in seen:
        return
    for dep in fd.dependencies:
        add(dep)
    seen.add(fd.name)
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    files.file.append(proto)


add(event_pb2.DESCRIPTOR)
with open(sys.argv[1], "wb") as f:
    f.write(files.SerializeToString())
print("\n".join(p.name for p in files.file))
