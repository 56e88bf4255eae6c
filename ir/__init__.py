"""The graph IR: immutable nodes, an op table, a printer/parser pair, and a verifier."""

from ir.attrs import ROLE, ROLES, SHARDING_ATTRS, Role
from ir.graph import DTYPE_BYTES, Graph, Node, add_params, input_node, param_node, rewrite
from ir.ops import OPS, IRError, bind_shape, eval_dim, make_node
from ir import attention_ops  # noqa: F401  (registers the attention ops in OPS)
from ir import moe_ops  # noqa: F401  (registers the mixture-of-experts ops in OPS)
from ir.parser import ParseError, parse_graph
from ir.printer import print_graph, same_structure
from ir.verify import VerifyError, verify

__all__ = [
    "ROLE", "ROLES", "Role", "DTYPE_BYTES", "SHARDING_ATTRS", "Graph", "Node", "add_params", "input_node",
    "make_node", "param_node",
    "rewrite", "same_structure", "OPS", "IRError", "bind_shape", "eval_dim", "ParseError",
    "parse_graph", "print_graph", "VerifyError", "verify",
]
