"""Co-execution runtime primitives: placeholders, feed/fetch channels, the graph runner.

These pieces need no TraceGraph: the PythonRunner hands out `Placeholder`s, feeds values and
case/loop choices through `FeedChannel`s, reads values through `FetchChannel`s, while the
`GraphRunner` runs the generated graph function on a background thread. See docs/runtime.md.
"""
from terra.compiler.channels import (DEFAULT_TIMEOUT, FeedChannel, FeedFetchOrder, FetchChannel,
                                    case_select_channel, loop_cond_channel, wait_until)
from terra.errors import ChannelClosedError, TerraRuntimeError, TerraTimeoutError
from terra.runtime.graph_runner import (FetchResolver, GraphRun, GraphRunner, Timing, op_index_of,
                                        op_node_name, timing, with_error_context)
from terra.runtime.placeholders import ConstantResolver, Placeholder, is_placeholder

__all__ = [
    "DEFAULT_TIMEOUT", "FeedChannel", "FeedFetchOrder", "FetchChannel", "case_select_channel",
    "loop_cond_channel", "wait_until", "ChannelClosedError", "TerraRuntimeError",
    "TerraTimeoutError", "FetchResolver", "GraphRun", "GraphRunner", "Timing", "op_index_of",
    "op_node_name",
    "timing", "with_error_context", "ConstantResolver", "Placeholder", "is_placeholder",
]
