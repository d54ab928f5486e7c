"""Device probe (2026-11-27, twelfth session): which SOAP step failed to capture in soap_cost_probe.py's sequence
("operation failed due to a previous error during capture"), with the full traceback of the failing op.
Arguments: cases run in this order in one process (fp32, bf16, fp32_norefresh, bf16_norefresh, adamw)."""
import sys
import time
import traceback

import torch

from _timing import bench_mlp_data

sys.path.insert(0, "src")
from torchkern import _cuda_graph  # noqa: E402
from torchkern.optim import SOAP  # noqa: E402
from torchkern.optim.bench import _mlp  # noqa: E402

original = _cuda_graph.capture


def traced_capture(body, *args, **kwargs):
    def traced_body():
        try:
            return body()
        except BaseException:
            print("FAILED INSIDE THE CAPTURE:\n" + traceback.format_exc(), flush=True)
            raise
    return original(traced_body, *args, **kwargs)


_cuda_graph.capture = traced_capture
x, y = bench_mlp_data()
for case in sys.argv[1:]:
    torch.manual_seed(0)
    model = _mlp(1024, 4, "cuda")
    if case == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        precision = case.split("_")[0]
        freq = 10**9 if case.endswith("norefresh") else 10
        opt = SOAP(model.parameters(), lr=1e-3, precision=precision, precondition_frequency=freq)
    start = time.perf_counter()
    for step in range(30):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    graph = getattr(opt, "_graph", None)
    print(f"{case}: {(time.perf_counter() - start) / 30 * 1e3:.3f} ms/step, replays "
          f"{graph.replays if graph else '-'}, errors {graph.errors if graph else '-'}", flush=True)
