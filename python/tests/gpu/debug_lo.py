import os, sys, time
sys.path.insert(0, ".")
import llama_offload as lo
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
a = lo.parse_args([])
dev = torch.device("cuda", 0)
torch.use_deterministic_algorithms(True, warn_only=True)
m = lo.build_model(a, dev, torch.bfloat16)
P = 8192
kv = lo.PagedKV(32, 145, 8, 64, 128, torch.bfloat16, dev); d = lo.PagedDecoder(m, kv)
g = torch.Generator().manual_seed(5)
table = torch.randperm(145, generator=g)[:130].to(dev)
prompt = torch.randint(0, 32000, (P,), generator=g).to(dev)
d.forward(table, prompt[:-1], 0)
def bench(name):
    for _ in range(3): d._forward(table, prompt[-1:], P - 1, None, False)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): r = d._forward(table, prompt[-1:], P - 1, None, False)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
    same = sum(torch.equal(d._forward(table, prompt[-1:], P - 1, None, False), r) for _ in range(10))
    print(name, "%.2f ms" % (dt * 1e3), same, "/10 identical", flush=True)
for bk in ([SDPBackend.FLASH_ATTENTION], [SDPBackend.EFFICIENT_ATTENTION], [SDPBackend.MATH], [SDPBackend.CUDNN_ATTENTION]):
    with sdpa_kernel(bk): bench(str(bk))
torch.use_deterministic_algorithms(False)
with sdpa_kernel([SDPBackend.MATH]): bench("math nondet-mode")
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]): bench("flash nondet-mode")
torch.use_deterministic_algorithms(True, warn_only=True)
from torch.profiler import profile, ProfilerActivity
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        d._forward(table, prompt[-1:], P - 1, None, False); torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
