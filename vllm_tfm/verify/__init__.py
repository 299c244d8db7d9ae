"""Tree verification math in plain torch: the references every kernel and vLLM hook is checked
against.

- ``sampling``: accepting a tree without changing the output distribution (greedy,
  target-only, traversal verification), with per-node temperature / min-p / top-k / top-p.
- ``gdn``: rollback-free Gated DeltaNet tree verify (masked triangular solve from the committed
  state, no state written) and the commit of an accepted path.
- ``conv``: the short causal conv1d on a tree (window follows parents) and its commit.
"""

from vllm_tfm.verify.accept_result import AcceptResult
from vllm_tfm.verify.conv import tree_causal_conv1d, tree_conv_commit
from vllm_tfm.verify.gdn import gdn_chain_recurrence, gdn_gates, gdn_tree_commit, gdn_tree_verify
from vllm_tfm.verify.logits_processing import TreeSamplingParams, process_logits
from vllm_tfm.verify.sampling import verify_greedy, verify_target_only, verify_traversal, verify_tree

__all__ = [
    "AcceptResult",
    "TreeSamplingParams",
    "gdn_chain_recurrence",
    "gdn_gates",
    "gdn_tree_commit",
    "gdn_tree_verify",
    "process_logits",
    "tree_causal_conv1d",
    "tree_conv_commit",
    "verify_greedy",
    "verify_target_only",
    "verify_traversal",
    "verify_tree",
]
