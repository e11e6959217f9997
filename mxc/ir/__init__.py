"""The IR: graph types, the op set with a rule per op, YAML binding and dumping, the verifier."""

from mxc.ir.graph import Graph, Node, QuantSpec, Repeat, ShardSpec, Sym, TensorType, Weight, map_bodies
from mxc.ir.ops import OPS
from mxc.ir.serialize import dump_graph, load_graph
from mxc.ir.template import bind
from mxc.ir.verify import VerifyError, verify

__all__ = ["Graph", "Node", "QuantSpec", "Repeat", "ShardSpec", "Sym", "TensorType", "Weight", "map_bodies",
           "OPS", "dump_graph", "load_graph", "bind", "VerifyError", "verify"]
