"""One rank of the exit check (test_exit.py): each collective once on tiny tensors, then destroy and exit 0.

all_gather, reduce_scatter sum and avg with an inf on rank 1, an uneven all_to_all and its autograd backward,
comm_stats; `import fp8comm` comes after init_process_group, as in users' scripts (its submodules load on use).
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
import fp8comm  # noqa: E402  (after init, deliberately)

r, W = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(r)
fp8comm.all_gather(torch.randn(W * 256, generator=g))
y = torch.randn(W * 256 + 3, generator=g)
if r == 1:
    y[5] = float("inf")
fp8comm.reduce_scatter(y, op="sum")
fp8comm.reduce_scatter(y, op="avg")
ins = [(r + j) % 3 for j in range(W)]  # rank r sends (r + j) % 3 rows to rank j: uneven, some empty
outs = [(i + r) % 3 for i in range(W)]
tokens = torch.randn(sum(ins), 256, generator=g).requires_grad_()
fp8comm.all_to_all(tokens, outs, ins).sum().backward()
assert tokens.grad is not None
fp8comm.comm_stats()
fp8comm.shutdown()
dist.destroy_process_group()
