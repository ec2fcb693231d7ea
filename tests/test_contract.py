"""Every model the CLI trains keeps one contract (methods/base.py): it implements `step(batch) -> (loss, probe
features or None)` and, where it must, the hooks the CLI asks every model class; it trains, optimises and evaluates
through the base's `training_step`, `configure_optimizers` and `EvaluationMixin`, never through its own. A mixin
that adds Lightning hooks cannot be placed where its hooks would never run."""

import pytest

import methods
from methods.base import MethodBase
from methods.momentum import MomentumMixin
from methods.pretrain import PretrainMethod

MODEL_CLASSES = [cls for name in methods.__all__ if isinstance(cls := getattr(methods, name), type) and issubclass(cls, MethodBase) and cls not in (MethodBase, PretrainMethod)]
BASE_HOOKS = ("training_step", "configure_optimizers", "validation_step", "test_step", "on_validation_epoch_end", "on_test_epoch_end")


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
