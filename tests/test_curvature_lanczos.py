"""Lanczos on Hessian-vector products against explicit Hessians (issue 23)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradforensics.replay.curvature import blocks_of, lanczos, top_eigenvalues  # noqa: E402


def _mlp(seed: int = 0, d: int = 12, h: int = 40, c: int = 5) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Tanh(), torch.nn.Linear(h, c)).double()
    x = torch.randn(64, d, dtype=torch.float64)
    y = torch.randint(0, c, (64,))
    return net, x, y


def _explicit(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, names: list[str]) -> torch.Tensor:
    """The Hessian of the loss in the tensors *names* (others fixed), by torch.autograd.functional.hessian."""
    params = dict(net.named_parameters())
    base = {n: p.detach() for n, p in params.items()}
    shapes = [base[n].shape for n in names]
    sizes = [base[n].numel() for n in names]

    def f(flat: torch.Tensor) -> torch.Tensor:
        parts = dict(zip(names, (c.view(s) for c, s in zip(torch.split(flat, sizes), shapes))))
        out = torch.func.functional_call(net, {**base, **parts}, (x,))
        return torch.nn.functional.cross_entropy(out, y)

    flat = torch.cat([base[n].reshape(-1) for n in names])
    return torch.autograd.functional.hessian(f, flat)


def _loss(net, x, y):
    return lambda: torch.nn.functional.cross_entropy(net(x), y)


def test_quadratic_with_known_spectrum():
    torch.manual_seed(1)
    n = 300
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    spectrum = torch.cat([torch.tensor([50.0, 20.0, 10.0]), torch.linspace(-1.0, 1.0, n - 3, dtype=torch.float64)])
    a = q @ torch.diag(spectrum) @ q.T
    res = lanczos(lambda v: a @ v, n, k=3, max_iter=80, tol=1e-10)
    assert res.converged
    assert res.eigenvalues == pytest.approx((50.0, 20.0, 10.0), rel=1e-8)
    assert max(res.residuals) < 1e-8 * 50


def test_quadratic_loss_through_autograd():
    """Loss 0.5 θᵀAθ: the Hessian is A whatever θ; double backward recovers its top eigenvalues."""
    torch.manual_seed(2)
    n = 120
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    spectrum = torch.linspace(0.1, 7.0, n, dtype=torch.float64)
    a = q @ torch.diag(spectrum) @ q.T
    theta = torch.randn(n, dtype=torch.float64, requires_grad=True)
    res = top_eigenvalues([lambda: 0.5 * theta @ a @ theta], {"theta": theta}, k=2, max_iter=120, tol=1e-9)
    assert res.eigenvalues == pytest.approx((7.0, float(spectrum[-2])), rel=1e-7)


@pytest.mark.slow
def test_whole_model_matches_explicit_hessian():
    net, x, y = _mlp(0, 20, 80, 10)      # 2,490 parameters
    names = [n for n, _ in net.named_parameters()]
    assert 2000 < sum(p.numel() for p in net.parameters()) < 5000
    h = _explicit(net, x, y, names)
    want = torch.linalg.eigvalsh(h).flip(0)[:3]
    res = top_eigenvalues([_loss(net, x, y)], dict(net.named_parameters()), k=3, max_iter=200, tol=1e-8)
    assert res.converged, res
    for got, ref in zip(res.eigenvalues, want.tolist()):
        assert abs(got - ref) <= 1e-4 * abs(ref)


def test_per_block_is_the_diagonal_block():
    net, x, y = _mlp(3)
    params = dict(net.named_parameters())
    for block, names in blocks_of(list(params), "layer").items():
        h = _explicit(net, x, y, names)
        want = float(torch.linalg.eigvalsh(h)[-1])
        res = top_eigenvalues([_loss(net, x, y)], {n: params[n] for n in names}, k=1, max_iter=200, tol=1e-9)
        assert abs(res.eigenvalues[0] - want) <= 1e-4 * abs(want), block
    assert list(blocks_of(list(params), "layer")) == ["0", "2"]
    assert blocks_of(["a.w", "a.b"], "tensor") == {"a.w": ["a.w"], "a.b": ["a.b"]}


def test_mixture_is_the_weighted_sum():
    net, x, y = _mlp(4)
    names = [n for n, _ in net.named_parameters()]
    halves = [(x[:32], y[:32]), (x[32:], y[32:])]
    h = sum(0.25 * _explicit(net, xs, ys, names) if i == 0 else 0.75 * _explicit(net, xs, ys, names)
            for i, (xs, ys) in enumerate(halves))
    want = float(torch.linalg.eigvalsh(h)[-1])
    res = top_eigenvalues([_loss(net, xs, ys) for xs, ys in halves], dict(net.named_parameters()),
                          weights=[0.25, 0.75], max_iter=200, tol=1e-9, cache=False)
    assert abs(res.eigenvalues[0] - want) <= 1e-4 * abs(want)


def test_preconditioned_matches_explicit_p_inverse_h():
    net, x, y = _mlp(5)
    params = dict(net.named_parameters())
    names = list(params)
    torch.manual_seed(6)
    pdiag = {n: torch.rand_like(p) * 1e-2 + 1e-3 for n, p in params.items()}   # sqrt(v_hat) + eps > 0
    h = _explicit(net, x, y, names)
    p = torch.cat([pdiag[n].reshape(-1) for n in names])
    eig = torch.linalg.eigvals(torch.diag(1.0 / p) @ h)
    assert float(eig.imag.abs().max()) < 1e-6 * float(eig.real.abs().max())   # real: similar to a symmetric one
    want = float(eig.real.max())
    res = top_eigenvalues([_loss(net, x, y)], params, precondition=pdiag, max_iter=300, tol=1e-9)
    assert res.converged
    assert abs(res.eigenvalues[0] - want) <= 1e-4 * abs(want)
    plain = top_eigenvalues([_loss(net, x, y)], params, max_iter=200, tol=1e-9).eigenvalues[0]
    assert res.eigenvalues[0] > 10 * plain       # P < 1e-2 everywhere: the preconditioned sharpness is far larger


def test_convergence_is_reported_honestly():
    torch.manual_seed(7)
    n = 400
    a = torch.diag(torch.linspace(0.0, 1.0, n, dtype=torch.float64))    # no gap: 5 iterations cannot converge
    res = lanczos(lambda v: a @ v, n, k=1, max_iter=5, tol=1e-10)
    assert not res.converged and res.iterations == 5 and res.residuals[0] > 1e-10
