"""The family/task layout: every use a family declares is composed into an adapter that
names its class, carries what its task needs, and pickles (a `spec()` crosses processes)."""

from __future__ import annotations

import pickle

import pytest

from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.families.base import Family
from pipelines.registry import USES, adapter_for, load_pipeline

# What a family's stages must write for any use it steps.
STEP_HOOKS = ("encode", "scheduler", "noise", "denoise", "decode")


@pytest.mark.parametrize("class_name", sorted(USES))
def test_every_use_is_composed_with_what_its_task_needs(class_name: str) -> None:
    family, use = USES[class_name]
    cls = adapter_for(class_name)
    assert isinstance(cls, type) and issubclass(cls, DiffusersAdapter)
    assert (cls.family_class, cls.use) == (family, use)
    assert cls.modality == use.task.modality
    assert cls.input_image_count == (use.images or use.task.input_images)
    needs = use.task.needs + (STEP_HOOKS if use.stepped else ())
    missing = [name for name in needs if getattr(family, name) is getattr(Family, name)]
    assert not missing, f"{family.__name__} lacks {missing} for {use.task.name}"
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert pickle.loads(pickle.dumps(use)) == use


@pytest.mark.slow
def test_an_edit_adapters_spec_pickles_and_admits_as_it_does() -> None:
    pipeline = load_pipeline(
        PipelineConfig(model="tiny-sd", pipeline_class="pipelines.registry:StableDiffusionImageToImage")
    )
    assert isinstance(pipeline, DiffusersAdapter)
    spec = pickle.loads(pickle.dumps(pipeline.spec()))
    assert type(spec) is type(pipeline) and spec.supports_step_batch and spec.task is pipeline.task
    assert spec.default_params() == pipeline.default_params()
