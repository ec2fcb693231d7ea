"""The contract of a method class, checked when the class is created (`MethodBase.__init_subclass__`): what a subclass
may override and where a mixin goes, so that a new method cannot silently drop the work the base does in its hooks."""

import inspect

import lightning as L


# The base's training, optimisation and evaluation path: a method implements `step` and never overrides these.
BASE_HOOKS = ("training_step", "configure_optimizers", "validation_step", "test_step", "on_validation_epoch_end", "on_test_epoch_end")
# The project's own hooks that the base and the mixins fill in, which an override must reach as Lightning's: the data
# checks (queue capacity, views, batch size), what the results record and the warnings the CLI silences.
PROJECT_HOOKS = ("check_data", "results_context", "expected_warnings")


def lightning_hooks(cls: type) -> set[str]:
    """The LightningModule hooks a class defines itself."""
    return {name for name in vars(cls) if not name.startswith("__") and hasattr(L.LightningModule, name)}


def overridable_hooks(cls: type) -> set[str]:
    """The hooks a class defines itself whose overrides must reach the overridden: Lightning's and `PROJECT_HOOKS`."""
    return lightning_hooks(cls) | {name for name in PROJECT_HOOKS if name in vars(cls)}


def reaches_the_overridden(function, name: str) -> bool:
    """Whether a hook's code (nested functions included) names the hook it overrides as an attribute: `super().name(...)`,
    `super(Class, self).name(...)` or `Parent.name(self, ...)`. A decorator's wrapper without functools.wraps is read
    through to the function of that name it closes over; one that closes over none counts as calling it (its hook
    cannot be read)."""
    code = getattr(function, "__code__", None)
    if code is not None and code.co_name != name:
        wrapped = [cell.cell_contents for cell in function.__closure__ or () if getattr(cell.cell_contents, "__code__", None) is not None]
        return next((reaches_the_overridden(hook, name) for hook in wrapped if hook.__code__.co_name == name), True)
    if code is None:
        return True
    codes = [code]
    while codes:
        code = codes.pop()
        if name in code.co_names:
            return True
        codes += [constant for constant in code.co_consts if hasattr(constant, "co_names")]
    return False


def check_method_class(cls: type, method_base: type) -> None:
    """Refuse, when a method class is created, what would silently drop the base's work: a Lightning hook of the base
    overridden (`BASE_HOOKS`: the method implements `step`), another hook the base or a mixin implements overridden
    without reaching the overridden one (on_train_batch_start's weight-decay schedule, on_before_optimizer_step's
    clipping, ...: `reaches_the_overridden`), or a class with Lightning hooks placed after the base in its bases."""
    order = cls.__mro__
    late = [parent for parent in order[order.index(method_base) + 1 :] if parent not in method_base.__mro__ and lightning_hooks(parent)]
    if late:
        base = next(parent for parent in cls.__bases__ if issubclass(parent, method_base))
        raise TypeError(
            f"class {cls.__name__}: {late[0].__name__} must come before {base.__name__} in its bases "
            f"(class {cls.__name__}({late[0].__name__}, {base.__name__})), or its hooks {sorted(lightning_hooks(late[0]))} never run"
        )
    end = order.index(L.LightningModule)
    for position, owner in enumerate(order[: order.index(method_base)]):  # the class and the mixins before the base (its classes were checked when made)
        if owner is not cls and issubclass(owner, method_base):
            continue
        own = overridable_hooks(owner)
        if own & set(BASE_HOOKS):
            raise TypeError(f"class {cls.__name__}: {owner.__name__} overrides {sorted(own & set(BASE_HOOKS))}: the base trains, optimises and "
                            "evaluates every method (methods/base.py); a method implements step(batch) -> (loss, probe features) instead")
        later = {name for parent in order[position + 1 : end] for name in overridable_hooks(parent)}
        for name in sorted(own & later):
            if not reaches_the_overridden(inspect.unwrap(vars(owner)[name]), name):
                raise TypeError(f"class {cls.__name__}: {owner.__name__}.{name} overrides the base's or a mixin's, which does the run's work "
                                f"there; call super().{name}(...) in it")
