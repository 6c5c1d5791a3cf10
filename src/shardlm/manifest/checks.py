"""A read manifest against what it is used with: the model actually given, and the devices of its cluster.

Parsing checks a manifest on its own; these catch a manifest made for another model (its layer ranges
would not exist there) or for other devices (an address its cluster does not have), before anything is
sharded, spawned or predicted. Both raise ``ManifestError`` naming the field, both values and the fix.
"""

from __future__ import annotations

from shardlm.hardware import Cluster
from shardlm.manifest.schema import ManifestError
from shardlm.plan.plan import ModelRef, Plan


def check_model(plan: Plan, ref: ModelRef, source: str) -> None:
    """Raise ManifestError when the manifest's model disagrees with the model given (`ref`, as
    ``shardlm.plan.make.load_model`` returns it): ``model.architecture`` and ``model.parameters`` when the
    manifest gives them (non-empty, non-zero), and always ``model.layers`` (the end of the last stage)."""
    m = plan.model
    make = f"make a manifest for {ref.name} with `shardlm plan {ref.name}`"
    fix = (f"use the model this manifest was made for ({m.name}), or {make}" if m.name != ref.name else
           f"{make}, or set model.name back to the model this manifest was made for")
    if m.architecture and m.architecture != ref.architecture:
        raise ManifestError(f"{source}: model.architecture: the manifest is for {m.architecture} but {ref.name} "
                            f"is {ref.architecture or 'of an unknown architecture'}; {fix}")
    if m.n_layers != ref.n_layers:
        raise ManifestError(f"{source}: model.layers: the manifest's stages cover {m.n_layers} layers but "
                            f"{ref.name} has {ref.n_layers}; {fix}")
    if m.parameters and m.parameters != ref.parameters:
        raise ManifestError(f"{source}: model.parameters: the manifest is for {m.parameters} parameters but "
                            f"{ref.name} has {ref.parameters}; {fix}")


def check_devices(plan: Plan, cluster: Cluster, source: str) -> None:
    """Raise ManifestError for the first device address of the plan (stage, then replica, then tensor rank,
    as the manifest lists them) that `cluster` (the plan's ``cluster`` field, resolved) does not have."""
    known = {d.address for d in cluster.devices}
    lay = plan.layout
    for s in range(lay.pp):
        for r in range(lay.dp):
            for t, address in enumerate(lay.devices[r][s]):
                if address not in known:
                    raise ManifestError(
                        f"{source}: stages[{s}].devices[{r}][{t}]: device {address!r} is not in cluster "
                        f"{plan.cluster} ({cluster.describe()}: {_addresses(cluster)}); use its devices, or set "
                        "`cluster` to the devices the plan is for (a shorthand such as 8xH100-80GB, or a "
                        "cluster file)")


def _addresses(cluster: Cluster) -> str:
    """``0:0..0:7, 1:0..1:7``, a range per node (the first four nodes)."""
    spans = [f"{n.devices[0].address}..{n.devices[-1].address}" if len(n.devices) > 1 else n.devices[0].address
             for n in cluster.nodes[:4]]
    return ", ".join(spans) + (", ..." if len(cluster.nodes) > 4 else "")
