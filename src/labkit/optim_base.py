"""What every optimizer of the course shares with ``torch.optim``, so that an exercise module holds
only its update.

* :func:`run_closure`: ``step(closure)`` as ``torch.optim`` defines it — the closure re-evaluates
  the model with gradients enabled and its loss is what ``step`` returns.
* :class:`Optimizer`: ``torch.optim.Optimizer`` whose ``load_state_dict`` keeps every state
  tensor in the dtype it was saved in. torch's loader casts each floating-point parameter's
  state tensors to the parameter's dtype (its rule for Adam's moments, which live in that dtype):
  an fp32 master weight or fp32 moments of a bf16 parameter would come back in bf16, and uint8
  codes of an 8-bit state as floats. bitsandbytes overrides ``load_state_dict`` for the same
  reason. Only the device follows the parameter, as in torch.
* :class:`PerParameterOptimizer`: an optimizer whose step updates each parameter on its own;
  ``step`` visits, group by group, every parameter that has a gradient and calls
  ``self._update(param, grad, state, group)``: a parameter without a gradient is skipped and its
  state (its step count too) is left as it was, exactly as in ``torch.optim``.
* :func:`param_groups`: ``params`` as ``torch.optim`` takes it, as a list of groups with their
  options filled in, for the optimizers that are not ``torch.optim.Optimizer`` subclasses
  (LOMO, NVMe Adam, the ZeRO wrappers).
* :class:`UpdateInBackward`: the given half of LOMO (the update inside backward's hooks).

Used by the optimizers of Lab 2, Lab 3 (mixed-precision Adam, ZeRO-3) and Lab 4 (ZeRO-2).
"""
from __future__ import annotations

import copy

import torch

from labkit import validate

__all__ = ["run_closure", "param_groups", "refuse_unfrozen", "refuse_sparse_grad", "Optimizer",
           "PerParameterOptimizer", "UpdateInBackward"]


def run_closure(closure):
    """Call ``closure`` (if not None) with gradients enabled and return its loss, as
    ``torch.optim.Optimizer.step(closure)`` does before it updates."""
    if closure is None:
        return None
    if not callable(closure):
        raise TypeError(f"closure must be None or a callable that returns the loss, got "
                        f"{type(closure).__name__}")
    with torch.enable_grad():
        return closure()


def refuse_unfrozen(frozen: dict, owner: str) -> None:
    """Refuse, naming them, parameters of ``frozen`` ({label: parameter}: those that were frozen
    when ``owner`` was built) that require grad now. An optimizer that lays out its parameters
    at construction (hooks, host masters, flat shards) trains only those trainable then: one
    unfrozen later would silently not be trained, where ``torch.optim``'s optimizers (which
    hold frozen parameters) step it once it has a gradient."""
    woke = [label for label, p in frozen.items() if p.requires_grad]
    if woke:
        raise ValueError(f"parameters {woke} have requires_grad=True but were frozen when {owner} "
                         "was built: it trains the parameters that required grad then; build a "
                         "new one after unfreezing")


def refuse_sparse_grad(grad: torch.Tensor, owner: str) -> None:
    """Refuse a sparse gradient (``nn.Embedding(sparse=True)`` makes one), naming ``owner``: the
    course's optimizers update dense tensors, as ``torch.optim.Adam`` does (which refuses it too,
    pointing to ``SparseAdam``); without this, torch fails deep inside the update."""
    if grad.layout != torch.strided:
        raise TypeError(f"{owner} does not support sparse gradients, got a {grad.layout} gradient "
                        "(e.g. from nn.Embedding(sparse=True)): use sparse=False, or "
                        "torch.optim.SparseAdam for those parameters")


class Optimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose ``load_state_dict`` keeps each state tensor's saved dtype
    (moved to its parameter's device): a checkpoint resumes exactly where it was written.

    Two refusals torch's base class does not make, so that nothing is silently ignored:
    ``add_param_group`` (the constructor's too) refuses a group option the optimizer does not
    have (``maximize``, ``amsgrad``, ``weight_decay`` where there is none: torch's optimizers
    would honour them, this one would not), naming it; and a group listing a tensor twice (a
    tied weight) holds it once (torch warns and would step it twice). ``load_state_dict``
    refuses a state_dict whose groups lack one of this optimizer's options (one written by
    another optimizer), naming it."""

    ALLOWED_EXTRA = frozenset({"initial_lr"})  # what torch's lr schedulers add to a group

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        unknown = sorted(set(param_group) - {"params"} - set(self.defaults) - self.ALLOWED_EXTRA)
        if unknown:
            raise ValueError(f"{type(self).__name__} has no option {', '.join(map(repr, unknown))} "
                             f"(a param group's options: {sorted(self.defaults)}): it would be "
                             "silently ignored")
        ps = param_group.get("params")
        if ps is not None and not isinstance(ps, (torch.Tensor, set)):
            ps, seen = list(ps), set()
            ps = [p for p in ps if not (id(p) in seen or seen.add(id(p)))]  # each tensor once
            param_group = {**param_group, "params": ps}
        super().add_param_group(param_group)

    def check_dense_grads(self) -> None:
        """Refuse a sparse gradient of any parameter (:func:`refuse_sparse_grad`), before the step
        changes anything: call it first in ``step``."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    refuse_sparse_grad(p.grad, type(self).__name__)

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("state_dict must be what state_dict() returned: a dict with "
                             "'state' and 'param_groups'")
        for k, g in enumerate(state_dict["param_groups"]):
            missing = sorted(set(self.defaults) - set(g))
            if missing:
                raise ValueError(f"state_dict's param group {k} has no option "
                                 f"{', '.join(map(repr, missing))} of {type(self).__name__}: was "
                                 "it written by another optimizer (e.g. torch.optim.Adam)?")
        saved = state_dict["state"]
        # torch checks the groups and restores the options; the state is restored below
        super().load_state_dict({**state_dict, "state": {}})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in saved:
                self.state[p] = {k: v.to(p.device, copy=True) if isinstance(v, torch.Tensor)
                                 else copy.deepcopy(v) for k, v in saved[i].items()}


class PerParameterOptimizer(Optimizer):
    """An optimizer that updates each parameter with a gradient on its own: subclasses write
    ``_update(param, grad, state, group)`` (``state`` is ``self.state[param]``, empty before the
    parameter's first step). ``skip_empty``: leave parameters with no elements alone;
    ``grad_dtype``: the dtype ``grad`` is handed over in (None: the gradient's own).

    Refused by name (TypeError), as ``torch.optim.Adafactor`` refuses them: a complex parameter
    (when its group is added: the factored and 8-bit states hold real numbers, and a cast would
    silently drop the imaginary part) and a sparse gradient (at ``step``)."""

    skip_empty = False
    grad_dtype: torch.dtype | None = None

    def add_param_group(self, param_group: dict) -> None:
        ps = param_group.get("params") if isinstance(param_group, dict) else None
        for p in [ps] if isinstance(ps, torch.Tensor) else ps if isinstance(ps, (list, tuple, set)) else ():
            if isinstance(p, torch.Tensor) and p.is_complex():
                raise TypeError(f"{type(self).__name__} does not support complex parameters, got one "
                                f"of dtype {p.dtype} and shape {tuple(p.shape)}: params must be real "
                                "floating-point tensors (torch.view_as_real(p) is a real view of one)")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Call the closure (if any), then ``_update`` every parameter that has a gradient."""
        loss = run_closure(closure)
        self.check_dense_grads()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or (self.skip_empty and p.numel() == 0):
                    continue
                grad = p.grad if self.grad_dtype is None else p.grad.to(self.grad_dtype)
                self._update(p, grad, self.state[p], group)
        return loss

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError  # pragma: no cover - every subclass writes it


def param_groups(params, defaults: dict, *, allowed=None, check=None,
                 name: str = "params") -> list[dict]:
    """``params`` as ``torch.optim`` takes it (tensors, or dicts with "params" and options) →
    a list of groups ``{"params": [tensors], **options}``, every option the group's own or the
    default's; each parameter once (a tied weight listed twice, in groups with the same options,
    is one parameter).

    Refuses, naming ``name``: a mix of tensors and dicts; a group option not in ``allowed``
    (when given); a parameter in two groups with different options. ``check(options)`` (when
    given) validates each group's options.
    """
    items = validate.params(name, params)
    n_dicts = sum(isinstance(i, dict) for i in items)
    if 0 < n_dicts < len(items):
        raise TypeError(f"{name} must hold only tensors or only param-group dicts, not both")
    groups, options_of, where = [], [], {}  # where: id(param) -> index of its group
    for k, g in enumerate(items if n_dicts else [{"params": items}]):
        unknown = set(g) - {"params"} - (set(allowed) if allowed is not None else set(g))
        if unknown:
            raise ValueError(f"{name}: group {k} has options {sorted(unknown)}; allowed: "
                             f"{sorted(allowed)}")
        options = {**defaults, **{o: v for o, v in g.items() if o != "params"}}
        if check is not None:
            check(options)
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        mine = []
        for p in ps:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name} must hold tensors, got {type(p).__name__}")
            if id(p) in where:
                if where[id(p)] != k and options_of[where[id(p)]] != options:
                    raise ValueError(f"{name}: a parameter appears in two groups with different "
                                     "options")
                continue
            where[id(p)] = k
            mine.append(p)
        groups.append({"params": mine, **options})
        options_of.append(options)
    return groups


class UpdateInBackward:
    """The given half of an optimizer whose update runs inside backward (LOMO, Lab 2 exercise
    2.4): the parameters and each one's learning rate from ``params`` as ``torch.optim.SGD``
    takes it (groups with their own "lr"; frozen parameters accepted and left alone), the hooks'
    handles, ``zero_grad`` (nothing left to forget) and ``remove``; it calls the subclass's
    ``_attach()``.

    Attributes: ``lr`` (the default), ``params`` (the parameters that require grad, each once),
    ``lr_of(param)``, ``handles``.
    """

    def __init__(self, params, lr: float):
        self.lr = validate.non_negative_number("lr", lr)
        groups = param_groups(params, {"lr": self.lr}, allowed={"lr"},
                              check=lambda o: validate.non_negative_number("lr", o["lr"]))
        self._lr = {id(p): g["lr"] for g in groups for p in g["params"]}  # id(param) -> its lr
        self.params = [p for g in groups for p in g["params"] if p.requires_grad]
        if not self.params:
            raise ValueError("params has no parameter that requires grad: nothing to train")
        self.handles = []
        self._attach()

    def lr_of(self, param: torch.Tensor) -> float:
        """The learning rate of ``param``'s group."""
        return self._lr[id(param)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to forget: every gradient was used and released inside backward (so that the
        optimizer stands where an optimizer's ``zero_grad()`` is called)."""

    def remove(self) -> None:
        """Remove the hooks: backward goes back to only computing gradients."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _attach(self) -> None:
        raise NotImplementedError  # pragma: no cover - the exercise
