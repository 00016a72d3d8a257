"""Every ShardingError (and the replicate warning) nnx_shard raises for bad input, printed.

Run: python examples/errors.py
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import warnings

from flax import nnx

import nnx_shard as ns

mesh = ns.make_mesh("data=4,model=2")
R = ns.Rules({"embed": "data", "mlp": "model"})


def show(title, f):
    try:
        f()
    except ns.ShardingError as e:
        print(f"### {title}\n{e}\n")


show("logical name missing from the rules", lambda: R.spec(("embed", "mpl"), shape=(1024, 4096), mesh=mesh, path="layers/0/kernel"))
show("mesh axis absent from the mesh", lambda: ns.Rules({"embed": "data", "mlp": "tensor"}).spec(("embed", "mlp"), shape=(1024, 4096), mesh=mesh, path="layers/0/kernel"))
show("same mesh axis for two dimensions", lambda: ns.Rules({"embed": "data", "mlp": "data"}).spec(("embed", "mlp"), shape=(1024, 4096), mesh=mesh, path="layers/0/kernel"))
show("fewer names than the rank (stacked layers without a layer name)", lambda: R.spec(("embed", "mlp"), shape=(4, 1024, 4096), mesh=mesh, path="layers/kernel"))
show("more names than the rank", lambda: R.spec(("embed", "mlp", None), shape=(1024, 4096), mesh=mesh, path="layers/0/kernel"))
show("dimension not divisible", lambda: R.spec(("embed", "mlp"), shape=(1024, 4095), mesh=mesh, path="layers/0/kernel"))
show("non-string names", lambda: R.spec(("embed", 3), shape=(1024, 4096), mesh=mesh, path="layers/0/kernel"))
misspelled = nnx.Linear(16, 32, kernel_metadata={"out_shardings": ("embed", "mlp")}, rngs=nnx.Rngs(0))
show("misspelled out_sharding metadata", lambda: ns.shardings(misspelled, mesh, R))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ns.Rules(R, indivisible="replicate").spec(("embed", "mlp"), shape=(1024, 4095), mesh=mesh, path="layers/0/kernel")
print("### indivisible='replicate' warning\n" + str(caught[0].message))
