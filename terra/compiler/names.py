"""Graph node names of recorded ops: lowering names each generated op after the record (or
TraceGraph node) it came from, so a TF error raised inside the graph maps back to the user's line
(terra/runtime/graph_runner.py parses the name out of the error)."""
import re

__all__ = ["op_node_name", "op_index_of"]

_OP_NAME_PREFIX = "terra_op_"
_INDEX_RE = re.compile(re.escape(_OP_NAME_PREFIX) + r"(\d+)")


def op_node_name(index):
    """Graph node name for recorded op `index` (so errors can be mapped back)."""
    return f"{_OP_NAME_PREFIX}{index}"


def op_index_of(node_name):
    """Recorded op index from a node name made by `op_node_name` (None if not one of ours)."""
    m = _INDEX_RE.search(node_name)
    return int(m.group(1)) if m else None
