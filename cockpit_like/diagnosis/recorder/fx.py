"""Exporter: the recorded forward pass and loss as a ``torch.fx.GraphModule``.

:func:`to_graph_module` turns a record into an FX graph of aten calls, one
node per recorded operation (its module path and phase in the node's
``meta``), whose inputs are the step's external values (parameters, buffers,
the batch; the recorded draws of random operations) and whose output is the
tuple ``(model outputs..., loss)``. Run it, print its code
(``graph_module.code``), or hand it to other FX tooling.

May import torch and :mod:`cockpit_like.diagnosis.recorder`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from cockpit_like.diagnosis.recorder.program import NotReplayableError, replayable_ops

__all__ = ["to_graph_module", "resolve_op"]


def resolve_op(name: str):
    """``"aten.addmm.default"`` -> ``torch.ops.aten.addmm.default``."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _decode(value: Any, node_of) -> Any:
    if isinstance(value, dict):
        if "t" in value:
            return node_of(value["t"])
        if "float" in value:
            return float(value["float"])
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "device" in value:
            return torch.device(value["device"])
        if "layout" in value:
            return getattr(torch, value["layout"])
        if "memory_format" in value:
            return getattr(torch, value["memory_format"])
        raise NotReplayableError(f"argument {value!r} cannot be turned into a graph argument")
    if isinstance(value, list):
        return [_decode(v, node_of) for v in value]
    return value


def to_graph_module(record) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``(graph_module, inputs)``: ``graph_module(*inputs)`` recomputes the record's
    model outputs and loss, as the tuple ``(outputs..., loss)`` (the loss last, if recorded).

    The input names are ``v<id>`` as in the record. Raises :class:`NotReplayableError`
    for the records :func:`~.program.export_program` cannot replay either.
    """
    data, tensors = record.data, record.tensors
    ops = replayable_ops(record)
    produced = {v for op in ops for v in op["outputs"] if v is not None}
    # a tensor read again after an in-place operation wrote into it through a view: the same node
    aliases = {int(k): info["alias_of"] for k, info in data["values"].items() if info.get("alias_of") is not None}

    def base_of(value_id: int) -> int:
        while value_id in aliases and value_id not in produced:
            value_id = aliases[value_id]
        return value_id

    random_outputs = [v for op in ops if op.get("random") for v in op["outputs"] if v is not None]
    external: list[int] = []
    seen: set[int] = set()
    for op in ops:
        if op.get("random"):
            continue
        for value_id in map(base_of, op["inputs"]):
            if value_id not in produced and value_id not in seen:
                seen.add(value_id)
                external.append(value_id)
    external += random_outputs

    graph = torch.fx.Graph()
    env: dict[int, torch.fx.Node] = {v: graph.placeholder(f"v{v}") for v in external}
    if any(resolve_op(op["op"])._schema.is_mutable for op in ops if not op.get("random")):
        # in-place operations (ReLU(inplace=True), dropout's scaling, ...) work on copies: the inputs stay as given
        env = {v: graph.call_function(torch.ops.aten.clone.default, (node,)) for v, node in env.items()}

    def node_of(value_id: int) -> torch.fx.Node:
        value_id = value_id if value_id in env else base_of(value_id)
        if value_id not in env:
            raise NotReplayableError(f"value v{value_id} is read before any recorded operation made it")
        return env[value_id]

    for op in ops:
        if op.get("random"):
            continue
        args = tuple(_decode(a, node_of) for a in op["args"])
        kwargs = {k: _decode(v, node_of) for k, v in op["kwargs"].items()}
        node = graph.call_function(resolve_op(op["op"]), args, kwargs)
        node.meta.update(module=op["module"], module_type=op["module_type"], phase=op["phase"], index=op["index"])
        if op["single"]:
            env[op["outputs"][0]] = node
            continue
        for position, value_id in enumerate(op["outputs"]):
            if value_id is not None:
                env[value_id] = graph.call_function(operator.getitem, (node, position))
    results = [env[base_of(v)] for v in data["outputs"].get("output", []) if base_of(v) in env]
    loss_id = data["outputs"].get("loss")
    if loss_id is not None and base_of(loss_id) in env:
        results.append(env[base_of(loss_id)])
    graph.output(tuple(results))
    graph.lint()
    missing = [v for v in external if v not in tensors]
    if missing:
        raise NotReplayableError(f"the record has no tensors for values {missing[:5]}")
    return torch.fx.GraphModule(torch.nn.Module(), graph), [tensors[v] for v in external]

