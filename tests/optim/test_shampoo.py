"""Shampoo against an independent reference (explicit blocks, eigh roots, Kronecker products), its batched root
calls, its CUDA path against the CPU, Newton roots that do not wait for the device and their float64 fallback,
"qr" roots, and small or extreme scales."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchkern
from torchkern.optim import Shampoo
from testing import devices, requires_cuda
from optim_testing import final_loss, reference_splits


def _ref_root(S, eps, relative=True, p=2):
    """(S + eps ||S||_F I)^(-1/p) (relative) or (S + eps I)^(-1/p) by a float64 eigendecomposition."""
    S = S.double()
    shift = eps * torch.linalg.matrix_norm(S) if relative else eps
    lam, Q = torch.linalg.eigh(S + shift * torch.eye(S.shape[0], dtype=torch.float64))
    return (Q * lam.clamp_min(1e-300).pow(-1.0 / p)) @ Q.T



class ShampooReference:
    """Independent Shampoo: explicit blocks, eigh roots, and the preconditioned block computed as
    (L_root kron R_root) vec(M) with an explicit Kronecker product."""

    def __init__(self, params, lr, betas, eps, freq, start, max_dim, weight_decay, graft_b2=0.999, graft_eps=1e-8,
                 grafting="adam", relative_eps=True, inverse_root=2):
        self.params = list(params)
        self.relative, self.root = relative_eps, inverse_root
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.freq, self.start, self.max_dim, self.wd = freq, start, max_dim, weight_decay
        self.graft_b2, self.graft_eps, self.grafting = graft_b2, graft_eps, grafting
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.blocks = {}
        for i, p in enumerate(self.params):
            if p.dim() >= 2:
                m, n = p.shape[0], p.numel() // p.shape[0]
                self.blocks[i] = [dict(r=r, c=c, L=torch.zeros(r.stop - r.start, r.stop - r.start, dtype=p.dtype),
                                       R=torch.zeros(c.stop - c.start, c.stop - c.start, dtype=p.dtype),
                                       Lr=None, Rr=None)
                                  for r in reference_splits(m, max_dim) for c in reference_splits(n, max_dim)]

    @torch.no_grad()
    def step(self):
        self.t += 1
        t = self.t
        for i, p in enumerate(self.params):
            g = p.grad.clone()
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            m_hat = self.m[i] / (1 - self.b1 ** t)
            if self.grafting == "adam":
                self.v[i] = self.graft_b2 * self.v[i] + (1 - self.graft_b2) * g * g
                adam = m_hat / ((self.v[i] / (1 - self.graft_b2 ** t)).sqrt() + self.graft_eps)
            elif self.grafting == "adagrad":
                self.v[i] = self.v[i] + g * g
                adam = m_hat / (self.v[i].sqrt() + self.graft_eps)
            else:
                adam = m_hat  # no grafting: the filtered gradient, and the Shampoo direction as it is
            direction = adam
            if i in self.blocks:
                g2, m2, a2 = g.reshape(p.shape[0], -1), m_hat.reshape(p.shape[0], -1), adam.reshape(p.shape[0], -1)
                direction = torch.zeros_like(m2)
                for b in self.blocks[i]:
                    gb = g2[b["r"], b["c"]]
                    b["L"] = self.b2 * b["L"] + gb @ gb.T
                    b["R"] = self.b2 * b["R"] + gb.T @ gb
                    if t >= self.start and (t - self.start) % self.freq == 0:
                        b["Lr"], b["Rr"] = (_ref_root(b["L"], self.eps, self.relative, self.root),
                                            _ref_root(b["R"], self.eps, self.relative, self.root))
                    if t >= self.start:
                        mb = m2[b["r"], b["c"]]
                        pb = (torch.kron(b["Lr"], b["Rr"]) @ mb.double().reshape(-1)).reshape(mb.shape).to(p.dtype)
                        ab = a2[b["r"], b["c"]]
                        direction[b["r"], b["c"]] = pb * (ab.norm() / pb.norm()) if self.grafting else pb
                    else:
                        direction[b["r"], b["c"]] = a2[b["r"], b["c"]]
                direction = direction.reshape(p.shape)
            p.mul_(1 - self.lr * self.wd)
            p.add_(direction, alpha=-self.lr)



def _shampoo_model(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3))
    return model.to(dtype)



@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-5)])
@pytest.mark.parametrize("grafting,beta1,relative,root", [
    ("adam", 0.9, True, 2), ("adagrad", 0.9, True, 2), (None, 0.9, True, 2), ("adam", 0.0, True, 2),
    ("adam", 0.9, False, 2), (None, 0.0, True, 2), ("adam", 0.9, True, 4), (None, 0.9, False, 4), (None, 0.9, True, 3)])
def test_shampoo_matches_reference(dtype, tol, grafting, beta1, relative, root):
    model = _shampoo_model(dtype)
    ref_model = copy.deepcopy(model)
    x = torch.randn(7, 2, 3, 3, dtype=dtype, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(4))
    # relative eps 10^-root: roots conditioned up to 10 whatever the root, so float32's rounding stays under tol
    kw = dict(lr=0.05, betas=(beta1, 0.95), eps=10.0 ** -root if relative else 1e-3, weight_decay=0.01,
              relative_eps=relative, inverse_root=root)
    # without grafting a root below 4 takes steps of lr's size whatever the gradients' (S^(-1/2) G is scale-free):
    # float32's rounding, carried through five such steps, moves the parameters by up to 1e-4
    ungrafted = 10 if grafting is None and root < 4 and dtype == torch.float32 else 1
    opt = Shampoo(model.parameters(), precondition_frequency=2, start_preconditioning_step=2,
                  max_preconditioner_dim=4, root_method="eigh", grafting=grafting, **kw)  # blocks: 12 -> 3x4, 5 -> 3+2
    ref = ShampooReference(ref_model.parameters(), freq=2, start=2, max_dim=4, grafting=grafting, **kw)
    for step in range(5):  # step 1: grafting only; roots at 2 and 4; steps 3 and 5 reuse cached roots
        xs = x + 0.1 * step
        for mdl, o in ((model, opt), (ref_model, ref)):
            for p in mdl.parameters():
                p.grad = None
            F.cross_entropy(mdl(xs), y).backward()
            o.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=tol * ungrafted, atol=tol * ungrafted)
    assert len(opt.state[model[3].weight]["L"]) == 2 * 3  # (5, 12) -> rows [3, 2] x cols [4, 4, 4]



def test_shampoo_one_root_call_per_block_size(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 4), nn.Linear(4, 1))
    calls = []
    real = torchkern.linalg.twins.matrix_inverse_root_eigh  # the default roots (eigh, at relative eps 1e-8)

    def counting(G, p, *args, **kwargs):
        calls.append((tuple(G.shape), p))
        return real(G, p, *args, **kwargs)

    monkeypatch.setattr(torchkern.linalg.twins, "matrix_inverse_root_eigh", counting)
    opt = Shampoo(model.parameters(), precondition_frequency=3, start_preconditioning_step=1)
    x = torch.randn(8, 6)
    for step in range(1, 6):
        calls.clear()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step in (1, 4):
            # factors: 6x6 (x5: L, R of both 6x6 weights, R of the 4x6 one), 4x4 (its L): one call per size; the
            # vector-shaped (1, 4) weight has none
            root = opt.param_groups[0]["inverse_root"]
            assert sorted(calls) == sorted([((5, 6, 6), root), ((1, 4, 4), root)])
        else:
            assert calls == []



@requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])  # float32: eigh on two devices
@pytest.mark.parametrize("max_dim", [4, 64])  # 4: every weight in blocks; 64: whole weights (the op's norms)
@pytest.mark.parametrize("grafting,beta1", [("adam", 0.9), ("adagrad", 0.9), (None, 0.9), ("adam", 0.0)])
def test_shampoo_on_cuda_matches_cpu(dtype, tol, max_dim, grafting, beta1):
    # the CPU run is checked against the independent reference above; this one runs the CUDA kernels
    models = [_shampoo_model(dtype), _shampoo_model(dtype).cuda()]
    x = torch.randn(7, 2, 3, 3, dtype=dtype, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(4))
    # float32 without grafting: 4th roots. Square roots' ungrafted steps (up to 1e2 times the gradient at eps 1e-4)
    # amplify the two devices' float32 eigh rounding over 5 steps (0.37 relative apart at inverse_root=2)
    root = 4 if dtype == torch.float32 and grafting is None else 2
    opts = [Shampoo(m.parameters(), lr=0.05, betas=(beta1, 0.95), eps=1e-4, weight_decay=0.01, precondition_frequency=2,
                    start_preconditioning_step=2, max_preconditioner_dim=max_dim, root_method="eigh", grafting=grafting,
                    inverse_root=root)
            for m in models]
    for step in range(5):
        for model, opt in zip(models, opts):
            device = next(model.parameters()).device
            opt.zero_grad()
            F.cross_entropy(model((x + 0.1 * step).to(device)), y.to(device)).backward()
            opt.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(q.cpu(), p, rtol=tol, atol=tol)



def _eigh_root(S: torch.Tensor, eps: float, p: int) -> torch.Tensor:
    """(S + eps ||S||_F I)^(-1/p) in float64: what Shampoo's cached root of factor S should be."""
    S = S.double()
    A = S + eps * torch.linalg.matrix_norm(S) * torch.eye(S.shape[0], dtype=S.dtype, device=S.device)
    lam, Q = torch.linalg.eigh(A)
    return (Q * lam.clamp_min(1e-300).pow(-1.0 / p)) @ Q.T



def _rel(X: torch.Tensor, R: torch.Tensor) -> float:
    return (torch.linalg.matrix_norm(X.double() - R) / torch.linalg.matrix_norm(R)).item()


def _top_rel(root: torch.Tensor, S: torch.Tensor, shift: float, p: int, k: int) -> float:
    """How far ``root`` is from ``(lambda + shift)^(-1/p)`` on the ``k`` dominant eigendirections of the factor S
    (those float32 resolves): the largest relative error of ``root q`` against ``q (lambda + shift)^(-1/p)``."""
    lam, Q = torch.linalg.eigh(S.double())
    top, want = Q[:, -k:], (lam[-k:] + shift).pow(-1.0 / p)
    return ((root.double() @ top - top * want).norm(dim=0) / want).max().item()



@requires_cuda
def test_shampoo_default_root_updates_do_not_wait():
    # the default roots (eigh at relative eps 1e-8) on factors of 300, 200 and 10: no root update waits for the device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Tanh(), nn.Linear(200, 10)).cuda()
    x, y = torch.randn(64, 300, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    opt = Shampoo(model.parameters(), lr=1e-3, precondition_frequency=2, start_preconditioning_step=2)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    step()  # the first root update
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):  # three more root updates
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not opt._root_budgets  # no Newton
    eps, root_p = opt.param_groups[0]["eps"], opt.param_groups[0]["inverse_root"]
    for S, root in zip(opt.state[model[0].weight]["L"], opt.state[model[0].weight]["L_root"]):
        # on the factor's dominant directions (float32 resolves those) the root is (lambda + eps ||S||)^(-1/p)
        assert _top_rel(root, S, eps * torch.linalg.matrix_norm(S.double()).item(), root_p, 8) < 1e-3



@requires_cuda
def test_shampoo_root_updates_after_the_first_do_not_wait():
    # factors of 300 and 200: the Newton op's cuBLAS path, whose host loop would wait every iteration (Newton roots:
    # 4th roots at relative eps 1e-6, where float32 Newton converges)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Tanh(), nn.Linear(200, 10)).cuda()
    x, y = torch.randn(64, 300, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    opt = Shampoo(model.parameters(), lr=1e-3, precondition_frequency=2, start_preconditioning_step=2,
                  inverse_root=4, eps=1e-6)

    def step(grad_scale=1.0):
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * grad_scale).backward()
        opt.step()

    step()
    step()  # step 2: the first root update waits and learns each size's iteration count
    budgets = dict(opt._root_budgets)
    assert {key[0] for key in budgets} == {300, 200, 10}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):  # three more root updates, none waits for the device
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for key, budget in opt._root_budgets.items():
        assert budget is budgets[key] and 2 <= budget.iters < 30, (key, budget.iters)
    eps, root_p = opt.param_groups[0]["eps"], opt.param_groups[0]["inverse_root"]
    for p in (model[0].weight, model[2].weight):  # the roots taken at step 8 from the statistics of step 8
        state = opt.state[p]
        for S, root in zip(state["L"] + state["R"], state["L_root"] + state["R_root"]):
            # as close to float64 eigh as a call that waits for convergence (the budget sufficed); float32's floor
            # at these conditions is a few 1e-4, and the batch (cuBLAS's kernel choice) moves the rounding
            s = torch.linalg.matrix_norm(S)
            waited = torch.ops.torchkern.matrix_inverse_root_newton((S / s)[None], root_p, eps, 100, 1e-6)[0][0]
            waited = waited * s ** (-1.0 / root_p)
            exact = _eigh_root(S, eps, root_p)
            report = (S.shape, _rel(root, exact), _rel(waited, exact))
            assert _rel(root, exact) <= 2 * _rel(waited, exact) + 1e-4 and _rel(root, exact) < 5e-3, report

    # non-finite gradients at step 9: the step is skipped on the device (no sync), nothing changes, and the next
    # steps (a root update among them) neither wait nor raise; the host learns of the skip from an asynchronous
    # copy (during step 9 itself if the device was quick, else at step 10) and warns once
    state = opt.state[model[0].weight]
    before = {k: [t.clone() for t in state[k]] for k in ("L", "R", "L_root", "R_root")}
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="Shampoo: skipped a step"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(grad_scale=float("nan"))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for k, ts in before.items():
            assert all(torch.equal(a, b) for a, b in zip(ts, state[k])), k
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        step()
        step()
    assert opt.skipped_steps == 1 and state["step"] == 10
    assert all(torch.isfinite(p).all() for p in model.parameters())



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_shampoo_qr_roots(device):
    # root_method="qr": the first root update takes an eigendecomposition (its root is root_method="eigh"'s, to
    # float32's rounding); later updates take one power step from the previous basis: an approximate root, within a
    # few percent of the exact one here (beta2 = 1: sums, which change less and less); the bases stay orthonormal
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 5)).to(device)
    x, y = torch.randn(64, 24, device=device), torch.randint(0, 5, (64,), device=device)
    opt = Shampoo(model.parameters(), lr=1e-3, precondition_frequency=4, start_preconditioning_step=2,
                  root_method="qr")
    eps, p = opt.param_groups[0]["eps"], opt.param_groups[0]["inverse_root"]
    errors = []
    for step in range(1, 27):
        opt.zero_grad()
        F.cross_entropy(model(x + 0.01 * step), y).backward()
        opt.step()
        if step in (2, 26):  # root updates: 2 (eigh), 6, 10, ..., 26 (power steps)
            state = opt.state[model[0].weight]
            errs = []
            for S, root, Q in zip(state["L"] + state["R"], state["L_root"] + state["R_root"],
                                  state["L_basis"] + state["R_basis"]):
                s = torch.linalg.matrix_norm(S)
                by_eigh = torchkern.linalg.matrix_inverse_root(S / s, p, eps=eps, method="eigh") * s ** (-1.0 / p)
                errs.append((_rel(root, _eigh_root(S, eps, p)), _rel(by_eigh, _eigh_root(S, eps, p))))
                eye = torch.eye(Q.shape[0], dtype=Q.dtype, device=Q.device)
                assert torch.linalg.matrix_norm(Q.mT @ Q - eye).item() < 1e-5
            errors.append(errs)
    # the eigendecomposition's root: as close as root_method="eigh"'s, up to float32's floor for roots of factors
    # conditioned up to 1 + 1/eps (two float32 eigendecompositions of the same factor differ by that much)
    floor = (1 + 1 / eps) * torch.finfo(torch.float32).eps / 4
    assert all(qr <= 2 * eigh + floor for qr, eigh in errors[0]), errors[0]
    # a basis refined by six power steps; a relative error d in an eigenvalue moves its root by about d / p
    assert all(qr < 0.2 / p for qr, _ in errors[1]), errors[1]
    assert all(torch.isfinite(p).all() for p in model.parameters())



def _teacher_student(d=32, width=64, batch=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -2, d)
    teacher = torch.randn(d, 10, generator=g) / scales[:, None] ** 0.5
    x = torch.randn(512, d, generator=g) * scales
    y = (x @ teacher).argmax(1)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    return model.to(device), x.to(device), y.to(device), batch



@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("root_method", ["newton", "auto"])
def test_shampoo_tiny_relative_eps_trains(device, root_method):
    # betas=(0.9, 0.999), eps=1e-10: Newton roots of factors that are indefinite at float32's rounding level
    # diverge where eigh clamps; a root that does not converge is replaced by a float64 eigh root, and training
    # goes on
    model, x, y, batch = _teacher_student(device=device)
    opt = Shampoo(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-10, precondition_frequency=5,
                  root_method=root_method)
    start = final_loss(model, x, y)
    for i in range(20):
        idx = torch.arange(i * batch, (i + 1) * batch) % x.shape[0]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert final_loss(model, x, y) < 0.9 * start
    state = opt.state[model[2].weight]  # 64 x 64 factors of rank <= 16 per step: updated, finite roots
    for S, root in zip(state["L"] + state["R"], state["L_root"] + state["R_root"]):
        assert torch.isfinite(root).all() and not torch.equal(root, torch.eye(64, device=device))
        # on the factor's dominant directions, where float32 resolves it, the root is (lambda + eps ||S||)^(-1/p)
        p = opt.param_groups[0]["inverse_root"]
        rel = _top_rel(root, S, 1e-10 * torch.linalg.matrix_norm(S.double()).item(), p, 8)
        assert rel < 3e-2, rel  # CUDA's queued Newton updates stop within _NEWTON_ACCEPT, not at tol



@pytest.mark.parametrize("relative", [True, False])
def test_shampoo_newton_roots_that_diverge_fall_back_to_eigh(relative):
    # the departure on the twin of the CUDA kernel: statistics of a few samples are rank-deficient, float32 rounding
    # leaves eigenvalues near -1e-8 ||S||, and with eps = 1e-10 the Newton iteration diverges (error inf/NaN) where
    # eigh clamps; before, that read as "statistics contain NaN/Inf" (CUDA) or kept the identity roots (CPU)
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    eps = 1e-10 if relative else 1e-12
    # absolute eps 1e-12 with square roots: the null space's (1e-12)^(-1/2) = 1e6 in a float32 root drowns its top
    # directions' 1e-2 in rounding, so that case takes 4th roots (1e3 against 0.1)
    opt = Shampoo(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=eps, precondition_frequency=1,
                  start_preconditioning_step=1, root_method="newton", relative_eps=relative,
                  inverse_root=2 if relative else 4)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 64)).square().sum().backward()
        opt.step()
    state, p = opt.state[model.weight], opt.param_groups[0]["inverse_root"]
    for S, root in ((state["L"][0], state["L_root"][0]), (state["R"][0], state["R_root"][0])):
        shift = (eps * torch.linalg.matrix_norm(S)).item() if relative else eps
        scale = torch.linalg.matrix_norm(S) if relative else torch.ones(())
        _, err, _ = torch.ops.torchkern.matrix_inverse_root_newton((S / scale)[None], p, shift / scale.item(), 100,
                                                                   1e-6)
        assert not (err <= 0.1).all(), err  # Newton alone does not converge here
        assert torch.isfinite(root).all() and not torch.equal(root, torch.eye(64))
        # on the factor's 4 nonzero directions, where float32 resolves it, the root is (lambda + shift)^(-1/p)
        rel = _top_rel(root, S, shift, p, 4)
        assert rel < 1e-2, rel
    assert all(torch.isfinite(p).all() for p in model.parameters())



def test_shampoo_extreme_gradient_scales_stay_finite():
    for scale in (1e-30, 1e15):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        opt = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1, eps=1e-12,
                      relative_eps=False)
        for _ in range(3):
            opt.zero_grad()
            (F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))) * scale).backward()
            opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters()), scale
        for state in opt.state.values():
            for key in ("L_root", "R_root"):
                assert all(torch.isfinite(r).all() for r in state.get(key, [])), (scale, key)



def test_shampoo_state_dict_without_inverse_root_resumes_with_4th_roots():
    # its cached roots are 4th roots: the group keeps taking them, and steps on
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1, inverse_root=4)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
    saved = opt.state_dict()
    del saved["param_groups"][0]["inverse_root"]
    fresh = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["inverse_root"] == 4
    fresh.zero_grad()
    model(torch.randn(8, 6)).square().mean().backward()
    fresh.step()
    state = fresh.state[model.weight]
    S, root = state["L"][0], state["L_root"][0]
    torch.testing.assert_close(root.double(), _eigh_root(S, fresh.param_groups[0]["eps"], 4), rtol=1e-3, atol=1e-3)
