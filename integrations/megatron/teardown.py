"""End of a Megatron-Core job: drop the references to process groups that Megatron keeps after its own teardown.

torch.distributed.destroy_process_group() frees a gloo group, and stops its worker and socket threads, only when no
Python object holds it any more; threads still running at exit meet interpreter teardown, which can abort
("terminate called without an active exception"). Measured on Megatron-Core 0.19.2, 1 rank, a 2-layer GPT with
rotary embeddings, DDP with the distributed optimizer and overlap, fp8comm installed, 2 steps, the model dropped,
then uninstall(), destroy_model_parallel(), fp8comm.shutdown() and destroy_process_group(): 60 gloo threads left
(20 of the 24 groups); 6 with the rotary cache cleared, 0 after shutdown() below. What holds them:

- parallel_state globals that destroy_model_parallel() does not reset: _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP
  and its _GLOO twin (without distributed-optimizer instances they are the data-parallel-with-CP groups), and the
  hierarchical / hybrid context-parallel groups;
- the lru_cache on RotaryEmbedding.forward (and YarnRotaryEmbedding.forward): its keys hold the embedding module,
  whose TransformerConfig holds the DDP model through config.no_sync_func / param_sync_func (bound methods), and the
  model holds every bucket's group. It outlives the model for good (up to 32 entries per class);
- MoE token dispatchers keep the last step's routing probabilities (MoEAlltoAllTokenDispatcher.probs,
  MoEAllGatherTokenDispatcher.local_probs): their autograd graph reaches the router weight's gradient accumulator,
  whose hook (Megatron's DDP backward hook) holds the DDP model, which holds the dispatcher. The cycle runs through
  C++ autograd nodes, where no garbage collection sees it: with MoE, 60 threads left on 1 rank even with both of the
  above released (126 per rank after the 2-rank MoE checks), 0 once those tensors are detached.

All are Megatron's private names, read on Megatron-Core 0.19.2 and looked up defensively: a name that is missing is
reported once (that release keeps its groups elsewhere: gloo threads may outlive the job again). Any other
parallel_state global still holding a group after destroy_model_parallel() is reset too.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist

from fp8comm.comm import shutdown as comm_shutdown

from ..private_names import MissingNames
from .install import logger, uninstall

CHECKED_ON = "0.19.2"  # the Megatron-Core release whose private names below were read

PARALLEL_STATE = "megatron.core.parallel_state"
# parallel_state globals holding groups that destroy_model_parallel() leaves set (dicts are emptied, others -> None)
LEFT_BY_DESTROY = (
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "_HYBRID_DP_CP_GROUPS",
)
# (module, class, method) of lru_caches whose keys hold a module, hence its config and the model
MODULE_CACHES = (
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding", "forward"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding", "forward"),
)

# (module, class) whose instances keep per-step tensors with an autograd graph (flex: its dispatch managers; read,
# not run here: DeepEP / HybridEP need GPUs)
GRAPH_HOLDERS = (
    ("megatron.core.transformer.moe.token_dispatcher", "MoETokenDispatcher"),
    ("megatron.core.transformer.moe.token_dispatcher", "_DispatchManager"),
)

_missing = MissingNames("Megatron-Core", CHECKED_ON, logger)


def shutdown() -> None:
    """End of the Megatron job: uninstall(), release_groups() and fp8comm.shutdown(), so that
    dist.destroy_process_group() next stops every gloo thread. Every rank, idempotent.

    Drop the model, its optimizer and the config's hooks into them (config.no_sync_func, param_sync_func,
    grad_scale_func, bound methods) first: what is still referenced keeps its groups."""
    uninstall()  # a no-op when nothing is installed
    release_groups()
    comm_shutdown()  # all of fp8comm's references (node groups included), not only the adapter's share
    for _ in range(4):  # a DDP model sits in reference cycles (its config holds its bound methods): free them all
        if not gc.collect():
            break


def release_groups() -> None:
    """Megatron's destroy_model_parallel(), then drop the group references it leaves: parallel_state globals, the
    rotary-embedding caches, MoE dispatchers' autograd graphs. Local (no collective), idempotent, a no-op when
    Megatron-Core is not loaded.

    Call it when training is done, before destroy_process_group(); initialize_model_parallel() (a collective) makes
    the groups again if they are needed afterwards."""
    ps = sys.modules.get(PARALLEL_STATE)
    if ps is not None:
        ps.destroy_model_parallel()
        _reset_leftovers(ps)
    _clear_module_caches()
    _detach_dispatcher_graphs()


def _holds_group(value) -> bool:
    if isinstance(value, dist.ProcessGroup):
        return True
    if isinstance(value, dict):
        return any(map(_holds_group, value.values()))
    if isinstance(value, (list, tuple, set)):
        return any(map(_holds_group, value))
    return False


def _reset_leftovers(ps) -> None:
    names = list(LEFT_BY_DESTROY)
    for name in LEFT_BY_DESTROY:
        if not hasattr(ps, name):
            _missing(f"{PARALLEL_STATE}.{name}")
    # and any other global that still holds a group: a later release may add one that destroy_model_parallel misses
    private = [n for n in vars(ps) if n.startswith("_") and not n.startswith("__") and n not in LEFT_BY_DESTROY]
    names += [n for n in private if _holds_group(getattr(ps, n))]
    for name in names:
        value = getattr(ps, name, None)
        if isinstance(value, dict):
            value.clear()  # its initial value is an empty dict, which Megatron fills in place
        elif value is not None:
            setattr(ps, name, None)


def _clear_module_caches() -> None:
    for module, cls, method in MODULE_CACHES:
        mod = sys.modules.get(module)
        if mod is None:
            continue
        clear = getattr(getattr(getattr(mod, cls, None), method, None), "cache_clear", None)
        if callable(clear):
            clear()  # costs a recomputation of the embedding at the next forward
        else:
            _missing(f"{module}.{cls}.{method}'s lru_cache")


def _detach_dispatcher_graphs() -> None:
    classes = []
    for module, cls in GRAPH_HOLDERS:
        mod = sys.modules.get(module)
        if mod is None:
            continue
        found = getattr(mod, cls, None)
        if isinstance(found, type):
            classes.append(found)
        else:
            _missing(f"{module}.{cls}")
    if not classes:
        return
    holders = tuple(classes)
    # Megatron keeps no registry of its dispatchers: one pass over the heap (0.05 s for 450k objects)
    for obj in gc.get_objects():
        if issubclass(type(obj), holders):
            for name, value in list(getattr(obj, "__dict__", {}).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(obj, name, value.detach())  # same values, no graph: the next step sets it anew
