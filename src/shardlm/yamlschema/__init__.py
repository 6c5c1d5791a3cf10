"""YAML written by people, checked by a pydantic schema, every error one line naming file, line, field and fix.

Used by manifests and cluster files. ``document`` reads the YAML (bounded, without YAML 1.1's typing)
and locates every field; ``fields`` are the field types that type unquoted text; ``check`` turns
pydantic's errors into messages such as

    m.yaml:5: parallelism.tensor: expected an integer >= 1, got 'two'; set it to the tensor-parallel degree, e.g. 2
"""

from shardlm.yamlschema.check import hint, validate
from shardlm.yamlschema.document import Document, Limits, Plain, Spot, dotted, load_yaml, one_line, shown
from shardlm.yamlschema.fields import FLAG, NUMBER, TEXT, Expect, Int, Invalid, Section, choice

__all__ = ["FLAG", "NUMBER", "TEXT", "Document", "Expect", "Int", "Invalid", "Limits", "Plain", "Section", "Spot",
           "choice", "dotted", "hint", "load_yaml", "one_line", "shown", "validate"]
