"""MemoryEfficientAdamW against torch.optim.AdamW as the independent reference."""

import copy
import io

import pytest
import torch

from optimizer import MemoryEfficientAdamW

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NUM_STEPS = 20
BASE_LR = 2e-3
BASE_WEIGHT_DECAY = 0.05


def make_mlp(seed: int, device: str) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    ).to(device)


def param_groups(model: torch.nn.Sequential) -> list[dict]:
    """Three groups that differ in lr, weight decay, betas and eps; the last uses the defaults."""
    return [
        {"params": model[0].parameters(), "lr": 3e-3, "weight_decay": 0.1},
        {"params": model[2].parameters(), "weight_decay": 0.0, "betas": (0.8, 0.99)},
        {"params": model[4].parameters(), "eps": 1e-6},
    ]


def make_optimizer(model: torch.nn.Sequential, enabled: bool | None) -> torch.optim.Optimizer:
    """enabled=None gives the reference torch.optim.AdamW."""
    if enabled is None:
        return torch.optim.AdamW(param_groups(model), lr=BASE_LR, weight_decay=BASE_WEIGHT_DECAY)
    return MemoryEfficientAdamW(param_groups(model), lr=BASE_LR, weight_decay=BASE_WEIGHT_DECAY, enabled=enabled)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)


def backward(model: torch.nn.Sequential, step_index: int) -> None:
    """Fresh gradients from a regression batch that depends only on the step index."""
    generator = torch.Generator().manual_seed(1000 + step_index)
    first_param = next(model.parameters())
    inputs = torch.randn(32, 8, generator=generator).to(first_param.device, first_param.dtype)
    targets = torch.randn(32, 4, generator=generator).to(first_param.device, first_param.dtype)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def assert_same_params(model: torch.nn.Module, reference: torch.nn.Module, atol: float = 1e-6) -> None:
    for param, reference_param in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, reference_param, rtol=0, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("enabled", [True, False])
def test_matches_torch_adamw_every_step(enabled: bool, device: str) -> None:
    model = make_mlp(seed=0, device=device)
    reference = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    optimizer, reference_optimizer = make_optimizer(model, enabled), make_optimizer(reference, None)
    scheduler, reference_scheduler = make_scheduler(optimizer), make_scheduler(reference_optimizer)
    for step_index in range(NUM_STEPS):
        for net, opt, sched in ((model, optimizer, scheduler), (reference, reference_optimizer, reference_scheduler)):
            backward(net, step_index)
            opt.step()
            sched.step()
        assert_same_params(model, reference)
    # The comparison only means something if the parameters actually moved.
    moved = max((p - p0).abs().max().item() for p, p0 in zip(model.parameters(), initial.parameters()))
    assert moved > 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("enabled", [True, False])
def test_state_placement(enabled: bool, dtype: torch.dtype, device: str) -> None:
    model = make_mlp(seed=0, device=device).to(dtype)
    optimizer = MemoryEfficientAdamW(model.parameters(), enabled=enabled)
    for step_index in range(2):
        backward(model, step_index)
        optimizer.step()
    for param in model.parameters():
        assert param.device.type == device and param.dtype == dtype
        state = optimizer.state[param]
        assert state["step"].item() == 2
        for moment in (state["exp_avg"], state["exp_avg_sq"]):
            if enabled:
                assert moment.device.type == "cpu" and moment.dtype == torch.float32
            else:  # exactly what torch.optim.AdamW keeps
                assert moment.device == param.device and moment.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("enabled", [True, False])
def test_resume_from_state_dict_equals_uninterrupted(enabled: bool, device: str) -> None:
    steps_before_save = 7
    uninterrupted = make_mlp(seed=0, device=device)
    optimizer = make_optimizer(uninterrupted, enabled)
    scheduler = make_scheduler(optimizer)
    checkpoint = io.BytesIO()
    for step_index in range(NUM_STEPS):
        if step_index == steps_before_save:
            torch.save(
                {"model": uninterrupted.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                checkpoint,
            )
        backward(uninterrupted, step_index)
        optimizer.step()
        scheduler.step()

    checkpoint.seek(0)
    saved = torch.load(checkpoint)
    resumed = make_mlp(seed=1, device=device)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = make_optimizer(resumed, enabled)
    resumed_scheduler = make_scheduler(resumed_optimizer)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    resumed_scheduler.load_state_dict(saved["scheduler"])
    for param in resumed.parameters():
        state = resumed_optimizer.state[param]
        assert state["step"].item() == steps_before_save
        assert state["exp_avg"].device.type == ("cpu" if enabled else device)
    for step_index in range(steps_before_save, NUM_STEPS):
        backward(resumed, step_index)
        resumed_optimizer.step()
        resumed_scheduler.step()
    assert_same_params(resumed, uninterrupted, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_loads_torch_adamw_state_and_continues_identically(device: str) -> None:
    reference = make_mlp(seed=0, device=device)
    reference_optimizer = make_optimizer(reference, None)
    for step_index in range(5):
        backward(reference, step_index)
        reference_optimizer.step()
    model = copy.deepcopy(reference)
    optimizer = make_optimizer(model, enabled=True)
    optimizer.load_state_dict(reference_optimizer.state_dict())
    assert all(state["exp_avg"].device.type == "cpu" for state in optimizer.state.values())
    for step_index in range(5, NUM_STEPS):
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            backward(net, step_index)
            opt.step()
    assert_same_params(model, reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("enabled", [True, False])
def test_params_without_grad_are_skipped(enabled: bool, device: str) -> None:
    """The last layer gets no gradient for the first steps: no state, no decay, no step count, like AdamW."""
    steps_without_grad = 5
    model = make_mlp(seed=0, device=device)
    reference = copy.deepcopy(model)
    frozen_weight = model[4].weight.detach().clone()
    optimizer, reference_optimizer = make_optimizer(model, enabled), make_optimizer(reference, None)
    for step_index in range(NUM_STEPS):
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            backward(net, step_index)
            if step_index < steps_without_grad:
                net[4].weight.grad = None
            opt.step()
        if step_index < steps_without_grad:
            assert model[4].weight not in optimizer.state
            assert torch.equal(model[4].weight, frozen_weight)
        assert_same_params(model, reference)
    assert optimizer.state[model[4].weight]["step"].item() == NUM_STEPS - steps_without_grad
    assert optimizer.state[model[4].bias]["step"].item() == NUM_STEPS


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_params_match_fp32_master_reference(device: str) -> None:
    """bf16 weights without a master copy: each step is fp32 AdamW on the bf16 value, rounded back.

    The reference is torch.optim.AdamW on fp32 master weights that are rounded
    through bf16 after every step, fed the same bf16 gradients. The fp32 moments
    must match it to fp32 precision; bf16 moments would be off by ~2**-8.
    """
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,)]
    initial = [torch.randn(shape, generator=generator).to(device, torch.bfloat16) for shape in shapes]
    params = [tensor.clone() for tensor in initial]
    masters = [tensor.float() for tensor in initial]
    hyperparameters = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    optimizer = MemoryEfficientAdamW(params, **hyperparameters)
    reference_optimizer = torch.optim.AdamW(masters, **hyperparameters)
    for _ in range(NUM_STEPS):
        for param, master in zip(params, masters):
            param.grad = torch.randn(param.shape, generator=generator).to(device, torch.bfloat16)
            master.grad = param.grad.float()
        optimizer.step()
        reference_optimizer.step()
        with torch.no_grad():
            for master in masters:
                master.copy_(master.bfloat16().float())
        for param, master in zip(params, masters):
            assert param.dtype == torch.bfloat16
            # Allow one bf16 rounding flip where CPU and device fp32 math differ in the last bit.
            torch.testing.assert_close(param.float(), master, rtol=2**-7, atol=0)
            state, reference_state = optimizer.state[param], reference_optimizer.state[master]
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state[key], reference_state[key].cpu(), rtol=1e-5, atol=1e-7)
    for param, param0 in zip(params, initial):
        assert not torch.equal(param, param0)


@pytest.mark.parametrize(
    "bad_arguments, message",
    [({"lr": -1.0}, "lr must be"), ({"betas": (0.9, 1.0)}, "betas must"), ({"eps": -1e-8}, "eps must"),
     ({"weight_decay": -0.1}, "weight_decay must")],
)
def test_bad_hyperparameters_are_rejected(bad_arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryEfficientAdamW([torch.zeros(2, requires_grad=True)], **bad_arguments)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("enabled", [True, False])
def test_master_weights_follow_float32_adamw_where_bf16_weights_alone_stall(enabled: bool, device: str) -> None:
    """bf16 weights with float32 master weights (optim.master_weights: float32), over 300 steps at lr 1e-5 with
    gradients summed over 4 micro-batches, against torch.optim.AdamW on float32 weights fed the same gradients
    (summed in float32): the master copies follow it to float32 precision, and the bf16 weights are them rounded.
    Without master weights most updates round away (Adam's step ~lr is under half a bf16 ulp above |w| ~4e-3)."""
    from distributed import OptimizerStep

    steps, micro_batches = 300, 4
    generator = torch.Generator().manual_seed(0)
    initial = (0.05 * torch.randn(256, generator=generator)).bfloat16()  # ulp ~2.4e-4: 24 steps of lr 1e-5
    hyperparameters = dict(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with_master, without_master = (torch.nn.Parameter(initial.to(device, copy=True)) for _ in range(2))
    reference = torch.nn.Parameter(initial.float().to(device))
    runs = [(with_master, MemoryEfficientAdamW([with_master], enabled=enabled, master_weights=True, **hyperparameters)),
            (without_master, MemoryEfficientAdamW([without_master], enabled=enabled, **hyperparameters))]
    reference_optimizer = torch.optim.AdamW([reference], **hyperparameters)
    for _ in range(steps):
        # bf16-representable pieces: backward through the bf16 weight gives them exactly, so any difference is ours.
        pieces = [(1 + torch.randn(256, generator=generator)).bfloat16().to(device) for _ in range(micro_batches)]
        for param, optimizer in runs:
            step = OptimizerStep(torch.nn.ParameterList([param]), optimizer, max_grad_norm=1e9)
            for piece in pieces:
                with step.micro_batch(last=piece is pieces[-1]):
                    (param * piece).sum().backward()
            step()
        reference.grad = sum(piece.float() for piece in pieces)
        reference_optimizer.step()
    master = runs[0][1].state[with_master]["master"]
    assert master.dtype == torch.float32 and master.device.type == ("cpu" if enabled else device)
    torch.testing.assert_close(master.to(device), reference.detach(), rtol=0, atol=1e-6)
    assert torch.equal(with_master, reference.detach().bfloat16())
    # A steady gradient moves every weight by ~300 lr = 3e-3: many bf16 ulps, which bf16 AdamW never takes.
    assert (with_master != initial.to(device)).float().mean() > 0.9
    assert (without_master == initial.to(device)).float().mean() > 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_master_weight_sums_reuse_their_buffers_and_zero_what_a_step_did_not_reach(device: str) -> None:
    """On a CPU the float32 sums live in buffers made at the first step and reused (a weight-sized allocation
    per step fragmented the heap); on a GPU they are freed after each step (the rollout needs the room). Either
    way each step starts its sums afresh: a weight that step 2's backward does not reach gets a zero gradient
    there (what OptimizerStep sums over ranks), as torch.optim.AdamW given zeros."""
    from distributed import OptimizerStep

    generator = torch.Generator().manual_seed(2)
    initial = [torch.randn(32, generator=generator).bfloat16() for _ in range(2)]
    pieces = [[(1 + torch.randn(32, generator=generator)).bfloat16().to(device) for _ in range(2)] for _ in range(3)]
    reached = [[True, True], [True, False], [True, True]]  # step 2 reaches the first weight only
    params = [torch.nn.Parameter(weight.to(device, copy=True)) for weight in initial]
    optimizer = MemoryEfficientAdamW(params, lr=1e-3, enabled=False, master_weights=True)
    step = OptimizerStep(torch.nn.ParameterList(params), optimizer, max_grad_norm=1e9)
    references = [torch.nn.Parameter(weight.float().to(device)) for weight in initial]
    reference_optimizer = torch.optim.AdamW(references, lr=1e-3, weight_decay=0.0)
    buffers = []
    for step_pieces, step_reached in zip(pieces, reached):
        for micro_batch in range(2):  # two micro-batches, the second the same gradient again
            with step.micro_batch(last=micro_batch == 1):
                losses = [(param * piece).sum() for param, piece, hit in zip(params, step_pieces, step_reached) if hit]
                sum(losses).backward()
        step()
        buffers.append(dict(optimizer.float32_gradients.buffers))
        for reference, piece, hit in zip(references, step_pieces, step_reached):
            reference.grad = 2 * piece.float() if hit else torch.zeros(32, device=device)
        reference_optimizer.step()
        for param, reference in zip(params, references):
            torch.testing.assert_close(optimizer.state[param]["master"], reference.detach(), rtol=0, atol=1e-6)
    if device == "cpu":
        assert all(buffers[0][param] is later[param] for later in buffers[1:] for param in params)
    else:
        assert buffers == [{}, {}, {}]


def test_master_weights_resume_exactly_from_a_state_dict() -> None:
    from distributed import OptimizerStep

    generator = torch.Generator().manual_seed(1)
    initial = torch.randn(64, generator=generator).bfloat16()
    gradients = [torch.randn(64, generator=generator).bfloat16() for _ in range(10)]

    def run(param, optimizer, pieces):
        step = OptimizerStep(torch.nn.ParameterList([param]), optimizer, max_grad_norm=1.0)  # clipped sums, too
        for piece in pieces:
            with step.micro_batch(last=True):
                (param * piece).sum().backward()
            step()

    whole = torch.nn.Parameter(initial.clone())
    whole_optimizer = MemoryEfficientAdamW([whole], lr=1e-3, enabled=True, master_weights=True)
    run(whole, whole_optimizer, gradients)
    first = torch.nn.Parameter(initial.clone())
    first_optimizer = MemoryEfficientAdamW([first], lr=1e-3, enabled=True, master_weights=True)
    run(first, first_optimizer, gradients[:5])
    saved = io.BytesIO()
    torch.save(first_optimizer.state_dict(), saved)
    resumed = torch.nn.Parameter(first.detach().clone())
    resumed_optimizer = MemoryEfficientAdamW([resumed], lr=1e-3, enabled=True, master_weights=True)
    resumed_optimizer.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    run(resumed, resumed_optimizer, gradients[5:])
    assert torch.equal(resumed_optimizer.state[resumed]["master"], whole_optimizer.state[whole]["master"])
    assert torch.equal(resumed, whole)


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_step_in_pieces_matches_torch_adamw(device: str, monkeypatch) -> None:
    """The offloaded step moves and updates each weight in pieces (optimizer.OFFLOAD_PIECE elements: 7 here, so
    every weight of the MLP is cut, unevenly): still torch.optim.AdamW's result, and each weight's step counted once."""
    import optimizer as optimizer_module

    monkeypatch.setattr(optimizer_module, "OFFLOAD_PIECE", 7)
    model = make_mlp(seed=0, device=device)
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = make_optimizer(model, True), make_optimizer(reference, None)
    for step_index in range(NUM_STEPS):
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            backward(net, step_index)
            opt.step()
        assert_same_params(model, reference)
    assert all(state["step"].item() == NUM_STEPS for state in optimizer.state.values())
