"""Every model the CLI trains keeps one contract (methods/base.py): it implements `step(batch) -> (loss, probe
features or None)` and, where it must, the hooks the CLI asks every model class; it trains, optimises and evaluates
through the base's `training_step`, `configure_optimizers` and `EvaluationMixin`, never through its own. A mixin
that adds Lightning hooks cannot be placed where its hooks would never run."""

import pytest

import methods
from methods.base import MethodBase
from methods.contract import BASE_HOOKS
from methods.momentum import MomentumMixin
from methods.pretrain import PretrainMethod

MODEL_CLASSES = [cls for name in methods.__all__ if isinstance(cls := getattr(methods, name), type) and issubclass(cls, MethodBase) and cls not in (MethodBase, PretrainMethod)]


@pytest.mark.parametrize("model_class", MODEL_CLASSES, ids=lambda cls: cls.__name__)
def test_every_model_class_trains_optimises_and_evaluates_through_the_base(model_class):
    own = {name for cls in model_class.__mro__[: model_class.__mro__.index(MethodBase)] for name in vars(cls)}
    assert own.isdisjoint(BASE_HOOKS), f"{model_class.__name__} overrides {sorted(own & set(BASE_HOOKS))}"
    assert model_class.step is not MethodBase.step or model_class.__name__ == "LongTailClassifier"


def test_the_cli_asks_the_model_class_where_it_runs_and_what_it_resumes():
    assert methods.MoCoV2.default_run_directory({}, "digits", 0) is None
    assert methods.LinearProbe.default_run_directory({"pretrained_ckpt": "runs/moco/checkpoints/last.ckpt"}, "digits", 0) == "runs/moco/linear"
    assert methods.LinearProbe.default_run_directory({"pretrained_ckpt": None}, "digits", 3) == "runs/linear_random_digits_s3"
    methods.MoCoV2.check_resume({"pretrained_ckpt": "gone.ckpt"}, {}, "ckpt_path 'x'")  # a pretraining run checks nothing more
    with pytest.raises(ValueError, match="holds a probe of model.pretrained_ckpt 'gone.ckpt', which is not an existing file here"):
        methods.LinearProbe.check_resume({"pretrained_ckpt": "gone.ckpt"}, {}, "ckpt_path 'x'")


def test_a_mixin_after_the_method_base_is_refused_when_the_class_is_created():
    with pytest.raises(TypeError) as error:

        class Wrong(PretrainMethod, MomentumMixin):
            pass

    assert str(error.value) == (
        "class Wrong: MomentumMixin must come before PretrainMethod in its bases (class Wrong(MomentumMixin, PretrainMethod)), "
        "or its hooks ['on_fit_start', 'optimizer_step'] never run"
    )


def test_a_mixin_before_the_method_base_is_accepted():
    class Right(MomentumMixin, PretrainMethod):  # what is checked: defining it raises no TypeError
        pass

    assert Right.optimizer_step is MomentumMixin.optimizer_step  # the mixin's hook is the one Lightning calls


def test_a_method_that_overrides_the_bases_training_or_evaluation_hooks_is_refused_when_the_class_is_created():
    with pytest.raises(TypeError, match=r"class OwnValidation: OwnValidation overrides \['on_validation_epoch_end'\]: the base trains, optimises and evaluates every method"):

        class OwnValidation(PretrainMethod):
            def on_validation_epoch_end(self):
                pass


def test_a_hook_of_the_base_overridden_without_super_is_refused_and_with_super_accepted():
    """on_train_batch_start without super() dropped the weight-decay schedule and train/lr, silently (a trial method
    outside the repository: the optimizer held 0.0005 where the schedule gave 0.02525)."""
    with pytest.raises(TypeError, match=r"class NoSuper: NoSuper.on_train_batch_start overrides the base's or a mixin's, .* call super\(\).on_train_batch_start\(...\) in it"):

        class NoSuper(PretrainMethod):
            def on_train_batch_start(self, batch, batch_idx):
                pass

    with pytest.raises(TypeError, match=r"class NoSuperOverMixin: NoSuperOverMixin.optimizer_step overrides"):

        class NoSuperOverMixin(MomentumMixin, PretrainMethod):
            def optimizer_step(self, *args, **kwargs):
                pass

    class WithSuper(PretrainMethod):  # what is checked: defining it raises no TypeError
        def on_train_batch_start(self, batch, batch_idx):
            return super().on_train_batch_start(batch, batch_idx)


@pytest.mark.parametrize("hook", ["check_data", "results_context", "expected_warnings"])
def test_the_projects_own_hooks_overridden_without_super_are_refused(hook):
    """A `check_data` without super() dropped the view, batch-size and queue-capacity checks of the base and the
    mixins, and every test still passed; `results_context` and `expected_warnings` are filled in the same way."""
    def check_data(self, datamodule, world_size):
        pass

    def results_context(self):
        return {}

    def expected_warnings(self):
        return ()

    with pytest.raises(TypeError, match=rf"class NoSuper: NoSuper.{hook} overrides the base's or a mixin's, .* call super\(\).{hook}\(...\) in it"):
        type("NoSuper", (MomentumMixin, PretrainMethod), {hook: locals()[hook]})


def logged(hook):
    """A decorator without functools.wraps: the class sees only `wrapper`."""

    def wrapper(*args, **kwargs):
        return hook(*args, **kwargs)

    return wrapper


def test_a_hook_under_a_decorator_without_functools_wraps_is_read_through_its_wrapper():
    with pytest.raises(TypeError, match=r"class DecoratedNoSuper: DecoratedNoSuper.on_train_batch_start overrides"):

        class DecoratedNoSuper(PretrainMethod):
            @logged
            def on_train_batch_start(self, batch, batch_idx):
                pass

    class DecoratedWithSuper(PretrainMethod):  # accepted
        @logged
        def on_train_batch_start(self, batch, batch_idx):
            return super().on_train_batch_start(batch, batch_idx)

    class Unreadable(PretrainMethod):  # a wrapper that closes over no function of the hook's name: taken on trust
        on_train_batch_start = staticmethod(print)


def test_any_class_with_lightning_hooks_after_the_method_base_is_refused_not_only_the_projects_mixins():
    class LoggingMixin:
        def on_train_epoch_end(self):
            raise AssertionError("never runs after the base")

    with pytest.raises(TypeError, match=r"class Late: LoggingMixin must come before PretrainMethod in its bases .* its hooks \['on_train_epoch_end'\] never run"):

        class Late(PretrainMethod, LoggingMixin):
            pass

    class Early(LoggingMixin, PretrainMethod):  # accepted: the base has no on_train_epoch_end for it to hide
        pass

    class BatchStartMixin:
        def on_train_batch_start(self, batch, batch_idx):
            pass

    with pytest.raises(TypeError, match=r"class HidesTheBase: BatchStartMixin.on_train_batch_start overrides the base's or a mixin's"):

        class HidesTheBase(BatchStartMixin, PretrainMethod):
            pass


def test_every_way_of_calling_the_overridden_hook_is_accepted_and_a_mention_in_a_comment_is_not():
    """The check reads the hook's code, not its text (a review: `super(Class, self).setup(...)`, `super().setup (stage)`
    and `PretrainMethod.setup(self, stage)` were refused, a `super().setup(` in a comment accepted)."""

    class TwoArgumentSuper(PretrainMethod):
        def setup(self, stage):
            super(TwoArgumentSuper, self).setup(stage)

    class Spaced(PretrainMethod):
        def setup(self, stage):
            super().setup (stage)  # noqa: E211

    class Explicit(PretrainMethod):
        def setup(self, stage):
            PretrainMethod.setup(self, stage)

    with pytest.raises(TypeError, match=r"class OnlyAComment: OnlyAComment.setup overrides"):

        class OnlyAComment(PretrainMethod):
            def setup(self, stage):
                pass  # super().setup(stage)
