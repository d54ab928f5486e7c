"""What a careful new user tries at the API's edges, as one CPU script: ``python tests/reliability_check.py``.

Twelve scenarios (the cache, user kernels, DP micro-batches, optimizer groups, roots, compile, losses, forward side
effects, errors, physics, degenerate shapes), each on the CPU with the pure-PyTorch twins. Each prints one line,
``ok <what held>`` or ``FAIL <what happened>``; the exit status is 1 when any failed. What could delete data runs in
temporary directories; what could abort a process runs in a child process. Every error must name its argument.
tests/test_reliability_check.py runs this script; each scenario's detailed regression tests are in tests/<family>/.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

os.environ["TORCHKERN_BACKEND"] = "torch"  # the twins, on any machine: nothing is compiled for torchkern itself

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import torchkern_jit as jit  # noqa: E402
from torchkern import ebm, linalg  # noqa: E402
from torchkern.__main__ import main as cli  # noqa: E402
from torchkern.optim import SOAP, Shampoo  # noqa: E402
from torchkern.per_sample import clip_and_accumulate, per_sample_grad_norms, per_sample_gradients  # noqa: E402

SCENARIOS: list[Callable[[Path], str]] = []


class Failed(Exception):
    """What did not hold."""


def scenario(fn: Callable[[Path], str]) -> Callable[[Path], str]:
    SCENARIOS.append(fn)
    return fn


def check(condition: object, what: str) -> None:
    if not condition:
        raise Failed(what)


def refused(call: Callable[[], object], *names: str, kinds=(ValueError, TypeError, RuntimeError)) -> str:
    """The message of the error ``call`` raises, which must name each of ``names``."""
    try:
        call()
    except kinds as exc:
        message = str(exc)
        missing = [n for n in names if n not in message]
        check(not missing, f"an error that does not name {missing}: {type(exc).__name__}: {message[:300]}")
        return message
    raise Failed(f"accepted: nothing raised where an error naming {list(names)} was due")


def no_nan(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@contextlib.contextmanager
def environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_cli(*args: str, **env: str) -> tuple[int, str, str]:
    """``python -m torchkern <args>`` in this process under ``env``: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with environ(**env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli(list(args))
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def run_child(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def mse_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target, reduction="sum")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# ----------------------------------------------------------------------------- the scenarios


@scenario
def clean_touches_only_torchkern_files(tmp: Path) -> str:
    home = tmp / "home"
    write(home / "notes.txt", "keep")
    write(home / "sub" / "data.txt", "keep")
    rc, _, err = run_cli("clean", TORCHKERN_CACHE=str(home))
    check((home / "notes.txt").exists() and (home / "sub" / "data.txt").exists(), "clean deleted a user's files")
    check(rc == 1 and f"TORCHKERN_CACHE={home} does not look like a torchkern cache" in err,
          f"clean of a user's directory: exit {rc}, {err.strip()!r}")
    cache = tmp / "cache"
    with environ(TORCHKERN_CACHE=str(cache)):
        built = jit.load("rc_clean", [write(tmp / "value.cpp", 'extern "C" int rc_value() { return 1; }')])
    write(cache / "notes.txt", "keep")
    rc, out, err = run_cli("clean", TORCHKERN_CACHE=str(cache))
    check(rc == 0 and not Path(built.path).exists(), f"clean left torchkern's build: exit {rc}, {out}{err}")
    check((cache / "notes.txt").read_text() == "keep", "clean deleted a user's file inside the cache")
    return "clean refuses a directory torchkern did not make (naming TORCHKERN_CACHE); in a cache it removes " \
           "torchkern's builds and keeps a user's file"


@scenario
def reloading_an_edited_library_is_a_python_error(tmp: Path) -> str:
    # The loader finds a library's op namespaces in its source text. A stand-in for torch's macro keeps this build
    # to a second (tests/loader/test_loader_build.py loads a real TORCH_LIBRARY op twice).
    source = write(tmp / "ops.cpp", """
        #define TORCH_LIBRARY(...) extern "C" int rc_version() { return 1; }
        TORCH_LIBRARY(rc_ops, m)
    """)
    out = run_child(f"""
        import torchkern_jit as jit
        jit.load("rc_ops", [{str(source)!r}])
        with open({str(source)!r}, "a") as f:
            f.write("// edited\\n")
        try:
            jit.load("rc_ops", [{str(source)!r}])
            print("loaded again")
        except jit.ReloadError as exc:
            print(exc)
    """, TORCHKERN_CACHE=str(tmp / "cache"))
    check(out.returncode == 0, f"the process ended with status {out.returncode}: {out.stderr[-500:]}")
    check("namespace 'rc_ops'" in out.stdout and "Restart Python" in out.stdout and "new namespace" in out.stdout,
          f"the edited library: {out.stdout.strip()!r}")
    return "loading an edited TORCH_LIBRARY source again in one process raises ReloadError (restart, or a new " \
           "namespace); the process exits 0"


@scenario
def an_edited_header_rebuilds(tmp: Path) -> str:
    source = write(tmp / "src" / "main.cpp", """
        #include "factor.hxx"
        #include "detail/off.h"
        extern "C" int rc_value() { return FACTOR + OFF; }
    """)
    factor, off = tmp / "src" / "factor.hxx", tmp / "src" / "detail" / "off.h"
    seen = []
    with environ(TORCHKERN_CACHE=str(tmp / "cache")):
        for factor_value, off_value in ((1, 1), (100, 1), (100, 5)):
            write(factor, f"#define FACTOR {factor_value}\n")
            write(off, f"#define OFF {off_value}\n")
            seen.append(ctypes.CDLL(jit.load("rc_header", [source]).path).rc_value())
    check(seen == [2, 101, 105], f"after editing factor.hxx, then detail/off.h, the library returns {seen}")
    return "an edit to an included .hxx beside the source or a header in a subfolder builds a new library " \
           f"(returns {seen})"


@scenario
def a_rejected_micro_batch_discards_the_pending_sum(tmp: Path) -> str:
    x, y = randn(11, 10), randn(11, 3)
    fresh = mlp()
    clip_and_accumulate(fresh, mse_sum, x[:8], y[:8], 1.0)
    rejected = {"noise_multiplier": lambda m: clip_and_accumulate(m, mse_sum, x[:8], y[:8], 1.0, -1.0),
                "targets": lambda m: clip_and_accumulate(m, mse_sum, x[:8], y[:7], 1.0)}
    for name, call in rejected.items():
        model = mlp()
        clip_and_accumulate(model, mse_sum, x[8:], y[8:], 1.0, finalize=False)  # 3 other samples, pending
        refused(lambda: call(model), name)
        clip_and_accumulate(model, mse_sum, x[:8], y[:8], 1.0)
        for p, q in zip(model.parameters(), fresh.parameters()):
            error = float((p.grad - q.grad).norm() / q.grad.norm())
            check(error <= 1e-9, f"after a call rejected for {name}, .grad is {error:.3g} off a fresh step's")
    return "after finalize=False then a call rejected for noise_multiplier or targets, a full step's .grad equals " \
           "a fresh step's"


@scenario
def every_param_group_is_validated(tmp: Path) -> str:
    def param():
        torch.manual_seed(0)
        return nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

    bad = [(Shampoo, "lr", math.nan), (Shampoo, "lr", -1.0), (Shampoo, "betas", (1.5, 0.5)),
           (Shampoo, "precision", "fp8"), (Shampoo, "precondition_frequency", 0),
           (Shampoo, "max_preconditioner_dim", 0), (SOAP, "refresh", "xx"), (SOAP, "lr", math.nan)]
    for cls, arg, value in bad:
        p = param()
        refused(lambda: cls([{"params": [p], arg: value}]), arg, "param_groups[0]")
        opt = cls([p])
        refused(lambda: opt.add_param_group({"params": [param()], arg: value}), arg, "param_groups[1]")
    p = param()
    opt = Shampoo([p], precondition_frequency=1)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["lr"] = math.nan
    before = p.detach().clone()
    refused(opt.step, "lr")
    check(torch.equal(p.detach(), before), "a step with lr=nan set mid-run changed the parameter")
    opt.param_groups[0]["lr"] = 1e-3
    saved = opt.state_dict()
    saved["state"][0]["step"] = math.nan
    refused(lambda: Shampoo([param()]).load_state_dict(saved), "step")
    p = param()
    refused(lambda: Shampoo([p, p]), "listed twice")
    return "bad lr, betas, precision, frequencies, dims or refresh are refused in a group, in add_param_group, " \
           "set mid-run (the parameter untouched) and as a loaded step; a parameter listed twice is refused"


@scenario
def roots_of_finite_input_are_finite_or_refused(tmp: Path) -> str:
    refused(lambda: linalg.matrix_inverse_root(torch.eye(2), 4, eps=math.inf), "eps")
    refused(lambda: linalg.matrix_inverse_root(torch.eye(2), 4, eps=1e39), "eps")
    X, err = linalg.matrix_inverse_root(torch.zeros(2, 2, dtype=torch.float16), 1, method="newton",
                                        return_error=True)
    check(no_nan(X, err), f"the float16 Newton root of zeros: {X.tolist()}, error {err.tolist()}")
    return "eps=inf and eps=1e39 (float32) are refused naming eps; float16 Newton of zeros gives a finite root " \
           "and error"


@scenario
def compile_fullgraph_public_linalg(tmp: Path) -> str:
    torch.manual_seed(0)
    A = torch.randn(2, 5, 5)
    G = A @ A.mT + torch.eye(5)
    cases = {"linalg.eigh": (lambda a: linalg.eigh(a)[0], A + A.mT),
             "linalg.matrix_inverse_root": (lambda g: linalg.matrix_inverse_root(g, 4), G)}
    for name, (fn, arg) in cases.items():
        torch._dynamo.reset()
        try:
            got = torch.compile(fn, fullgraph=True, backend="aot_eager")(arg)
        except Exception as exc:  # what torch.compile raises is torch's own
            raise Failed(f"torch.compile(fullgraph=True) of {name}: {type(exc).__name__}: {str(exc)[:200]}")
        check(torch.allclose(got, fn(arg), rtol=1e-5, atol=1e-6), f"compiled {name} differs from eager")
    return "torch.compile(fullgraph=True) runs linalg.eigh and linalg.matrix_inverse_root, equal to eager"


class _LastStep(nn.Module):
    """A GRU over (B, T, 4), its last output through a linear head."""

    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


@scenario
def losses_must_be_scalars(tmp: Path) -> str:
    model, x, y = mlp(), randn(5, 10), randn(5, 3)
    loss = nn.MSELoss(reduction="none")
    for loss_reduction in (None, "sum", "mean"):
        for fn in (per_sample_grad_norms, per_sample_gradients):
            refused(lambda: fn(model, loss, x, y, loss_reduction=loss_reduction), "loss_fn", "loss_reduction")
        refused(lambda: clip_and_accumulate(model, loss, x, y, 1.0, loss_reduction=loss_reduction), "loss_fn",
                "loss_reduction")
    torch.manual_seed(0)
    gru, x, y = _LastStep().double(), randn(5, 6, 4), randn(5, 3)
    reference = []
    for i in range(5):
        grads = torch.autograd.grad(mse_sum(gru(x[i:i + 1]), y[i:i + 1]), list(gru.parameters()))
        reference.append(torch.cat([g.flatten() for g in grads]).norm())
    for method in ("auto", "fused", "func"):
        norms = per_sample_grad_norms(gru, mse_sum, x, y, method=method)
        error = float((norms - torch.stack(reference)).abs().max() / torch.stack(reference).max())
        check(error <= 1e-9, f"nn.GRU's per-sample norms (method={method!r}) are {error:.3g} off a loop's")
    return "a loss of reduction='none' is refused naming loss_fn and loss_reduction (None, 'sum', 'mean'); " \
           "nn.GRU's per-sample norms equal a loop's on every method"


class _Counting(nn.Module):
    """A forward that advances a buffer, as spectral norm or an EMA does; B = T = features makes dims ambiguous."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.head(torch.tanh(self.lin(x)).mean(1))


@scenario
def buffers_advance_once_per_call(tmp: Path) -> str:
    torch.manual_seed(0)
    model, x, y = _Counting().double(), randn(4, 4, 4), randn(4, 3)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    per_sample_grad_norms(model, mse_sum, x, y, method="fused")
    per_sample_gradients(model, mse_sum, x, y, method="fused")
    clip_and_accumulate(model, mse_sum, x, y, 1.0, method="fused")
    check(model.calls.item() == 3, f"after 3 calls the forward's counter reads {model.calls.item()}")
    return f"after 3 calls ({len(forwards)} forwards, the batch-dim probe's included) a buffer counter reads 3"


@scenario
def errors_name_their_argument(tmp: Path) -> str:
    for var, value in (("MAX_JOBS", "\u00b2"), ("TORCH_CUDA_ARCH_LIST", "0.0"), ("TORCH_CUDA_ARCH_LIST", "9.9")):
        with environ(**{var: value}):
            refused(jit.settings, var, repr(value), kinds=(ValueError,))
    env = dict(TORCHKERN_BACKEND="cuda", TORCHKERN_CACHE=str(tmp / "cache"), CUDA_HOME=str(tmp / "no-cuda"))
    info, imported = (subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env={**os.environ, **env})
                      for args in (["-m", "torchkern", "info"], ["-c", "import torchkern.primitives"]))
    info_err = info.communicate(timeout=300)[1]
    imported.communicate(timeout=300)
    check(info.returncode == 1 and "importing torchkern raises" in info_err and imported.returncode != 0,
          f"TORCHKERN_BACKEND=cuda without CUDA: info exits {info.returncode}, the import exits {imported.returncode}")
    missing = tmp / "scale.cpp"
    refused(lambda: jit.load("rc_missing", str(missing)), str(missing), kinds=(FileNotFoundError, ValueError))
    rc, _, err = run_cli("bench", "--json", str(tmp / "missing" / "x.json"))  # a usage error: nothing runs
    check(rc == 2 and "--json" in err, f"bench --json: exit {rc}: {err.strip()[-200:]!r}")
    sampler = ebm.LangevinDynamics(ebm.HarmonicEnergy(), 0.1)
    refused(lambda: sampler.sample(randn(3, 2), n_steps=2 ** 63), "n_steps")
    return "MAX_JOBS=\u00b2 and TORCH_CUDA_ARCH_LIST=0.0/9.9 are named; info with TORCHKERN_BACKEND=cuda fails " \
           "where the import does; a missing source given as a string, bench --json and n_steps=2**63 are named"


@scenario
def physics_is_validated(tmp: Path) -> str:
    refused(lambda: ebm.DoubleWellEnergy(barrier_height=math.nan), "barrier_height")
    refused(lambda: ebm.RosenbrockEnergy(b=math.inf), "b must")
    refused(lambda: ebm.HarmonicEnergy(k=-1.0), "k must")
    refused(lambda: ebm.GaussianEnergy(torch.zeros(2), precision=-torch.eye(2)), "precision")
    sampler = ebm.LangevinDynamics(ebm.DoubleWellEnergy(2.0, 1.0), 0.3)
    torch.manual_seed(0)
    refused(lambda: sampler.sample(torch.randn(40, 3), n_steps=30), "step_size", kinds=(FloatingPointError,))
    grad = torch.randn(4, 3)
    QL, QR = torch.linalg.qr(torch.randn(4, 4))[0], torch.linalg.qr(torch.randn(3, 3))[0]
    refused(lambda: linalg.kron_precondition(grad, (QL, torch.ones(2, 4)), (QR, torch.ones(3))), "(d)")
    A = torch.randn(5, 5, dtype=torch.float64)
    A = A + A.mT
    Q0 = torch.linalg.eigh(A)[1]
    refused(lambda: linalg.eigh(A, 2 * Q0), "Q0 must be orthogonal")
    return "non-finite or non-positive physics are refused naming the argument; a diverging Langevin run raises " \
           "naming step_size; a 2-D kron d and a non-orthogonal Q0 are refused"


@scenario
def vector_shaped_matrices_keep_vector_state(tmp: Path) -> str:
    for cls in (Shampoo, SOAP):
        p = nn.Parameter(torch.randn(1, 20000))
        opt = cls([p])
        for _ in range(2):
            p.grad = torch.randn_like(p)
            opt.step()
        values = [t for v in opt.state[p].values() for t in (v if isinstance(v, list) else [v])]
        size = sum(t.numel() for t in values if isinstance(t, torch.Tensor))
        check(size <= 2 * p.numel(), f"{cls.__name__} keeps {size / p.numel():.0f}x a (1, 20000) parameter's size")
        check(no_nan(p), f"{cls.__name__} made the (1, 20000) parameter non-finite")
    return "Shampoo and SOAP step a (1, 20000) parameter as a vector: state of at most twice its size"


def main() -> int:
    failed = 0
    start = time.perf_counter()
    for n, fn in enumerate(SCENARIOS, 1):
        began = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="torchkern-check-") as tmp:
            try:
                line = f"ok {n:2} {fn(Path(tmp))}"
            except Failed as exc:
                line = f"FAIL {n:2} {fn.__name__}: {exc}"
            except Exception as exc:  # an unexpected error is a failure of its scenario, not of the script
                line = f"FAIL {n:2} {fn.__name__}: {type(exc).__name__}: {str(exc)[:300]}"
        failed += line.startswith("FAIL")
        print(f"{line} [{time.perf_counter() - began:.1f} s]", flush=True)
    print(f"{len(SCENARIOS) - failed} of {len(SCENARIOS)} held in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
