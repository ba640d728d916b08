"""A plain torch.distributed script (no Trainer, no Accelerator): `hfzero run --zero_*` cannot apply ZeRO to it."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
