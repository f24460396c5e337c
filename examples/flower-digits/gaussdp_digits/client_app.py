"""The ClientApp: local training on this node's partition; Flower's fixedclipping_mod clips the update.

The node's partition comes from its node config (``partition-id``, ``num-partitions``): set by
``flower-supernode --node-config`` in a deployment, by the simulation runtime for virtual nodes.
Clipping on the client is welcome but not trusted: gaussdp's server clips every update again.
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from gaussdp_digits import task

app = ClientApp(mods=[fixedclipping_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train from the received global model; reply with the new model (same keys).

    The defaults are those of pyproject.toml, for ``flwr.simulation.run_simulation`` (no run config).
    """
    cfg = context.run_config
    flat = task.to_flat(msg.content["arrays"])
    delta, n = task.local_update(
        flat,
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        local_steps=int(cfg.get("local-steps", 5)),
        learning_rate=float(cfg.get("learning-rate", 0.5)),
    )
    content = RecordDict(
        {"arrays": task.to_arrays(flat + delta), "metrics": MetricRecord({"num-examples": n})}
    )
    return Message(content=content, reply_to=msg)
