"""Where a process's one-time CUDA cost goes (bench only; not part of the harness): seconds
for each first use, in the order a harness process meets them."""
import time

t = time.perf_counter()
marks = []


def mark(name):
    global t
    now = time.perf_counter()
    marks.append((name, now - t))
    t = now


import torch  # noqa: E402

mark("import torch")
torch.cuda.init()
mark("cuda init (context)")
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
mark("first allocation")
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
(a @ a).sum().item()
mark("first bf16 matmul (cuBLAS)")
p = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
mark("first pinned 256 MiB")
import transformers  # noqa: E401,E402,F401

mark("import transformers, datasets, peft, trl")
import soup_cli.trainer.sft  # noqa: E402,F401

mark("import soup_cli.trainer.sft")
for name, s in marks:
    print(f"{name:40s} {s:7.2f} s")
