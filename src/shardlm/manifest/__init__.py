"""The deployment manifest: a Plan as hand-editable YAML, and back again, validated.

Writing (``write``) builds a dict in schema order and dumps it with PyYAML (byte counts exact, each with a
human-size comment). Reading (``read``) loads the YAML without YAML 1.1's typing, checks it against the
pydantic schema (``schema``), then checks the fields together; every error names the file, the line, the
field and the fix:

    m.yaml:14: parallelism.tensor: expected an integer >= 1, got 'two'; set it to the tensor-parallel degree, e.g. 2

``checks`` holds what a manifest is checked against when used: the model given (``check_model``) and its
cluster's devices (``check_devices``). The schema, field by field, is in docs/manifest.md.
"""

from shardlm.manifest.checks import check_devices, check_model
from shardlm.manifest.read import device_of_cluster, parse_manifest, read_manifest
from shardlm.manifest.schema import HEADER, LIMITS, SCHEMA_VERSION, ManifestError
from shardlm.manifest.write import plan_to_yaml, write_manifest

__all__ = ["HEADER", "LIMITS", "SCHEMA_VERSION", "ManifestError", "check_devices", "check_model", "device_of_cluster",
           "parse_manifest", "plan_to_yaml", "read_manifest", "write_manifest"]
